"""The plugin's mends: its changes to vLLM besides the layer swap, one module per mend, a folder per vLLM
release (``vllm_0_32``: vLLM 0.32), in two kinds:

- ``repairs``: defects of vLLM's CPU build that stop a Kimi Linear checkpoint from running (or make it
  drift), whatever serves its KDA layers; vLLM's own fixes would make them unneeded;
- ``for_kda``: what the layer kda adds (:mod:`kda.vllm.layer`) needs from vLLM, which vLLM's own layer
  does not.

Each mend module has a docstring (what it changes, why, vLLM's symptom without it), ``PHASE``
("process": when the plugin loads; "model": when the first KDA layer is built, because it imports
Kimi's model code, which the plugin must not import before vLLM's CPU worker has set itself up),
``needed()``, a probe of the installed vLLM (its own code, under any mends: whether the defect's code
path is still there), ``apply()``, idempotent, and ``PATCHES``, what it changes in vLLM (for the
tests). The release's package lists its mends (``REPAIRS``, then ``FOR_KDA``); within a phase they
apply in that order. This registry applies those whose probe says needed and logs one line per mend,
applied or skipped, through the plugin's logger (``kda.vllm``, INFO).
"""

import importlib

__all__ = ["apply_model_mends", "apply_process_mends", "applied", "mends"]

KINDS = ("repairs", "for_kda")

_done = set()  # the phases applied in this process
_applied = {}  # "kind.name" -> the mend module, applied in this process


def release_package(version=None):
    """The package of ``version``'s mends (default: the release the plugin is written for)."""
    if version is None:
        from .. import VLLM_VERSION as version
    major, minor = version.split(".")[:2]
    return importlib.import_module(f"{__name__}.vllm_{major}_{minor}")


def mends(version=None, phase=None):
    """The mend modules of ``version`` (of one ``phase``, or all), in the order they apply."""
    package = release_package(version)
    found = []
    for kind in KINDS:
        for name in getattr(package, kind.upper()):
            module = importlib.import_module(f"{package.__name__}.{kind}.{name}")
            if phase is None or module.PHASE == phase:
                found.append(module)
    return found


def name_of(mend):
    """``kind.name`` of a mend module (``repairs.mla_block_sizes``)."""
    return ".".join(mend.__name__.split(".")[-2:])


def applied():
    """The names of the mends applied in this process."""
    return list(_applied)


def _apply_phase(phase):
    if phase in _done:
        return
    _done.add(phase)
    from .. import _vllm_logger

    logger = _vllm_logger()
    for mend in mends(phase=phase):
        name = name_of(mend)
        summary = (mend.__doc__ or "").strip().splitlines()[0].replace("``", "")
        if mend.needed():
            mend.apply()
            _applied[name] = mend
            logger.info("kda.vllm: applied mend %s: %s", name, summary)
        else:
            logger.info("kda.vllm: skipped mend %s, this vLLM does not need it: %s", name, summary)


def apply_process_mends():
    """The mends applied when the plugin loads, in each vLLM process."""
    _apply_phase("process")


def apply_model_mends(vllm_config=None):
    """The mends applied when the first KDA layer is built (they import Kimi's model code, which the
    plugin must not import when it loads: it pulls numba in before vLLM's CPU worker has set itself up,
    and breaks its start-up). Each KDA layer calls this with its ``vllm_config``, which the applied mends
    that have an ``each_model(vllm_config)`` see (MLA layers built before it)."""
    _apply_phase("model")
    if vllm_config is not None:
        for mend in _applied.values():
            hook = getattr(mend, "each_model", None)
            if hook is not None:
                hook(vllm_config)
