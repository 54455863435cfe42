"""VLLM_KIMI_K3_GEMM_AR defaults to 0 on the CPU (a value the user set is kept).

vLLM 0.32.0 reads ``VLLM_KIMI_K3_GEMM_AR`` with a default of 1, and then Kimi's MLP
(``vllm.models.kimi_k3.nvidia.model.maybe_init_gemm_rs_ar``) imports the CuTe DSL GEMM + all-reduce
kernels (the ``cutlass`` package), which a CPU install lacks: the model fails to build with an import
error. On the CPU there is nothing to fuse.
"""

import os

PHASE = "process"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("env:VLLM_KIMI_K3_GEMM_AR",)
VARIABLE = "VLLM_KIMI_K3_GEMM_AR"


def needed():
    """vLLM reads the variable and, when it is unset, turns the fused GEMM + all-reduce on."""
    import vllm.envs as envs

    read = envs.environment_variables.get(VARIABLE)
    if read is None:
        return False
    given = os.environ.pop(VARIABLE, None)
    try:
        return bool(read())
    finally:
        if given is not None:
            os.environ[VARIABLE] = given


def apply():
    os.environ.setdefault(VARIABLE, "0")
