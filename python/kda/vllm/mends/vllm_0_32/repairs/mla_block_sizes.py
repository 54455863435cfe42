"""The CPU MLA backend accepts block sizes that are multiples of 16, not only 16.

vLLM 0.32.0's CPU MLA backend accepts only block size 16 (``CPUMLABackend.supports_block_size``), but
a hybrid model's KV cache blocks are aligned so that one attention block holds as many bytes as one
mamba state (128 tokens for Kimi Linear), and the platform then refuses the aligned size: the engine
does not start. The backend's kernels see blocks of ``get_supported_kernel_block_sizes()`` = [16] (vLLM
splits each cache block into kernel blocks), so any multiple of 16 is sound.
"""

from ..._patching import original, replace

PHASE = "process"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend.supports_block_size",)


def _backend():
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    return CPUMLABackend


def needed():
    """vLLM's own supports_block_size refuses 128-token blocks of 16-token kernel blocks."""
    backend = _backend()
    if 16 not in backend.get_supported_kernel_block_sizes():
        return False
    return not original(backend.supports_block_size.__func__)(backend, 128)


def supports_block_size(cls, block_size):
    return block_size is None or (block_size > 0 and block_size % 16 == 0)


def apply():
    replace(_backend(), "supports_block_size", __name__, supports_block_size)
