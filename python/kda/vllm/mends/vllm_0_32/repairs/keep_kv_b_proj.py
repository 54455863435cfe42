"""Kimi's MLA ``kv_b_proj`` keeps its weight (marked ``_cpu_skip_gemm_dispatch``, as vLLM's own MLA's).

vLLM 0.32.0's CPU linear layers hand their weight to a packed GEMM and free it
(``dispatch_cpu_unquantized_gemm(remove_weight=True)``), unless the layer carries
``_cpu_skip_gemm_dispatch``, which vLLM's own MLA layer sets on its ``kv_b_proj``. Kimi's MLA layer
(``vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention``) does not, so its
``process_weights_after_loading`` finds an empty ``kv_b_proj`` weight when it splits it into the
absorbed ``W_UK`` / ``W_UV``, and loading fails. Mend: mark Kimi's ``kv_b_proj`` as vLLM marks its own,
in the layer's ``__init__`` and, for MLA layers built before the first KDA layer, in ``each_model``.
"""

from ..._patching import code_shows, install

PHASE = "model"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention.__init__",)


def _mla():
    from vllm.models.kimi_k3.nvidia import mla

    return mla


def needed():
    """Kimi's MLA module never sets _cpu_skip_gemm_dispatch."""
    return code_shows(_mla(), absent=("_cpu_skip_gemm_dispatch",))


def mark(module):
    kv_b_proj = getattr(module, "kv_b_proj", None)
    if kv_b_proj is not None:
        kv_b_proj._cpu_skip_gemm_dispatch = True


def mended(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        mark(self)

    return __init__


def apply():
    install(_mla().MultiHeadLatentAttention, "__init__", __name__, mended)


def each_model(vllm_config):
    """Marks the MLA layers of ``vllm_config`` built before this mend was applied."""
    for module in vllm_config.compilation_config.static_forward_context.values():
        mark(module)
