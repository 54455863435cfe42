"""kda: exact Kimi Delta Attention kernels (C++ engine) for PyTorch and any DLPack array.

The torch layer, drop-in for flash-linear-attention's functions of the same names::

    from kda import chunk_kda, fused_recurrent_kda, fused_kda_gate
    from kda import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule   # Gated DeltaNet

``kda.engine`` is the engine itself over DLPack / buffer-protocol arrays (NumPy, torch) with
caller-allocated outputs; it needs no torch. The torch layer (``kda.functional``, ``kda.layers`` for
the Hugging Face ``kernels`` hub, ``kda.hub`` to build that hub folder) and the serving entries
(``kda.serving``: ``fused_recurrent_kda_fwd``, ``fused_recurrent_gdn_fwd``, state pools updated in
place) are imported on first use; ``kda.fla_backend.register()`` makes fla's own functions run
through kda on CPU tensors; ``kda.cp`` is context parallelism over ``torch.distributed``.
"""

import importlib


def _load_engine():
    """The compiled engine. A wheel's engine takes its OpenMP runtime (libgomp.so.1) from the process,
    so that kda's threads and torch's share one: where the system has none, torch's copy serves once
    torch is loaded."""
    try:
        from . import _engine
    except ImportError as error:
        if "libgomp" not in str(error):
            raise
        try:
            import torch  # noqa: F401 - loads the libgomp.so.1 its wheel carries
        except ImportError:
            raise ImportError(
                "kda's engine needs the OpenMP runtime libgomp.so.1: install torch (its wheel carries one) "
                "or the system's (Debian/Ubuntu: apt-get install libgomp1)"
            ) from error
        from . import _engine
    return _engine


engine = _load_engine()


def _warn_other_kda():
    """PyPI's distribution `kda` (Kinetic Diagram Analysis, unrelated) installs a top-level module of
    this name too: next to this one, each install overwrites the other's files."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    others = sorted(p.name for p in here.parent.glob("kda-*.dist-info"))
    if others:
        import warnings

        warnings.warn(
            f"kda: {', '.join(others)} in {here.parent} is another distribution that installs a module "
            "named kda (this one is kda-kernels): both cannot live in one environment; uninstall one "
            "(pip uninstall kda) and reinstall the other",
            RuntimeWarning,
            stacklevel=2,
        )


_warn_other_kda()

try:  # written by the build from VERSION; travels with the copy the kernels hub folder holds
    from ._version import __version__
except ImportError:  # a tree without the build's file: the installed distribution's metadata
    from importlib.metadata import PackageNotFoundError, version

    try:
        __version__ = version("kda-kernels")
    except PackageNotFoundError:
        __version__ = "unknown"

simd_target = engine.simd_target
simd_targets = engine.simd_targets
CHUNK_SIZE = engine.CHUNK_SIZE
MAX_HEAD_DIM = engine.MAX_HEAD_DIM

# function: the module that defines it
_TORCH_FUNCTIONS = {
    "chunk_kda": "functional",
    "fused_recurrent_kda": "functional",
    "fused_kda_gate": "functional",
    "fused_recurrent_kda_fwd": "serving",
    "chunk_gated_delta_rule": "gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "gated_delta_rule",
    "chunk_gdn": "gated_delta_rule",
    "fused_recurrent_gdn": "gated_delta_rule",
    "fused_recurrent_gdn_fwd": "serving",
}
_TORCH_MODULES = {"functional", "gated_delta_rule", "serving", "layers", "hub", "fla_backend", "ops", "cp"}

__all__ = ["engine", "simd_target", "simd_targets", "CHUNK_SIZE", "MAX_HEAD_DIM", *sorted(_TORCH_FUNCTIONS)]


def __getattr__(name):
    # Lazy, so that `import kda` needs no torch; relative, so that a copy imported under another name
    # (the kernels hub loader does that) uses its own modules.
    if name in _TORCH_FUNCTIONS:
        value = getattr(importlib.import_module(f".{_TORCH_FUNCTIONS[name]}", __name__), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    if name in _TORCH_MODULES:
        module = importlib.import_module("._ops" if name == "ops" else f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
