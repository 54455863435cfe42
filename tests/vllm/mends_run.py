"""Runs kda.vllm's mends in a fresh process where vLLM loaded no plugin (test_mends.py runs it with
VLLM_PLUGINS=""); prints JSON on a ``RESULT`` line.

``python mends_run.py each``: for every mend of the plugin's vLLM release, in the registry's order: its
kind and phase, its probe before and after applying it, and whether each thing it changes in vLLM (its
``PATCHES``) changed at the first ``apply()`` and stayed the same object at the second, and the kda
mends that wrap it (each once at most).

``python mends_run.py fixed``: the probes of a few mends once vLLM is made to behave as if fixed (the
defect's code replaced by a correct one): each must say not needed.

``python mends_run.py registry``: the registry's entry points, each called twice (the process mends,
then the model mends, as the plugin and its layers call them): the mends it applied and the lines it
logged through the plugin's logger.
"""

import importlib
import inspect
import json
import logging
import os
import sys

from kda.vllm import mends as registry


def resolve(target):
    """The object ``module:Owner.attribute`` names (as its owner holds it), or ``env:NAME``'s value."""
    where, _, path = target.partition(":")
    if where == "env":
        return os.environ.get(path)
    obj = importlib.import_module(where)
    *owners, name = path.split(".")
    for owner in owners:
        obj = getattr(obj, owner)
    return inspect.getattr_static(obj, name)


def same(a, b):
    return a is b or (isinstance(a, str) and a == b)


def wrappers(obj):
    """The names of the kda mends wrapping ``obj`` (a function, classmethod or other), outermost first."""
    function = getattr(obj, "__func__", obj)
    names = []
    while getattr(function, "_kda_mend", None):
        names.append(function._kda_mend)
        function = function.__wrapped__
    return names


def each():
    results = {}
    for mend in registry.mends():
        before = [resolve(t) for t in mend.PATCHES]
        needed = mend.needed()
        mend.apply()
        first = [resolve(t) for t in mend.PATCHES]
        mend.apply()
        second = [resolve(t) for t in mend.PATCHES]
        results[registry.name_of(mend)] = {
            "phase": mend.PHASE,
            "documented": bool((mend.__doc__ or "").strip()),
            "patches": list(mend.PATCHES),
            "needed": needed,
            "needed_after": mend.needed(),
            "changed": [not same(a, b) for a, b in zip(before, first, strict=True)],
            "stable": [same(a, b) for a, b in zip(first, second, strict=True)],
            "wrappers": [wrappers(obj) for obj in second],
        }
    return results


def fixed():
    """A few of vLLM's defects replaced by correct code: those mends' probes must say not needed."""
    import vllm.envs as envs
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    envs.environment_variables["VLLM_KIMI_K3_GEMM_AR"] = lambda: False

    def supports_block_size(cls, block_size):
        return block_size is None or block_size % 16 == 0

    CPUMLABackend.supports_block_size = classmethod(supports_block_size)
    CPUSDPAMLAPrefillBackend.supports_out = lambda self: False

    def _zero_block_ids(self, block_ids):
        pass  # vLLM's code no longer indexes kernel blocks with manager block ids

    CPUModelRunner._zero_block_ids = _zero_block_ids
    names = ("gemm_ar_env", "mla_block_sizes", "no_out_on_cpu_prefill", "zero_whole_blocks")
    return {
        registry.name_of(m): m.needed()
        for m in registry.mends()
        if registry.name_of(m).split(".")[1] in names
    }


def registry_run():
    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("kda.vllm")
    logger.addHandler(Lines())
    logger.setLevel(logging.INFO)
    for _ in range(2):
        registry.apply_process_mends()
    for _ in range(2):
        registry.apply_model_mends()
    return {
        "mends": [registry.name_of(m) for m in registry.mends()],
        "applied": registry.applied(),
        "log": [line for line in lines if "kda.vllm: applied" in line or "kda.vllm: skipped" in line],
    }


if __name__ == "__main__":
    result = {"each": each, "fixed": fixed, "registry": registry_run}[sys.argv[1]]()
    print("RESULT " + json.dumps(result))
