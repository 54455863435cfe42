"""A torch form of the MLA context gather (``gather_and_maybe_dequant_cache``, CUDA-only).

With speculative decoding, vLLM 0.32.0's MLA treats each multi-token verification row as a prefill with
context, and Kimi's MLA layer gathers that context from the paged cache with
``ops.gather_and_maybe_dequant_cache`` (``MultiHeadLatentAttention._gather_context_latent``), an op the
CPU build does not register (no ``torch.ops._C_cache_ops.gather_and_maybe_dequant_cache``): the first
verification step fails. Mend: gather with torch indexing for a cache in the model dtype (the only CPU
cache dtype); other cache formats keep vLLM's path.
"""

import torch

from ..._patching import install

PHASE = "model"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention._gather_context_latent",)


def gather_context_latent(kv_cache, workspace, block_table, cu_seq_lens, token_to_seq, num_tokens, starts):
    """Copies each context token's latent from its paged-cache slot into ``workspace[:num_tokens]``."""
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[1]
    seq = token_to_seq[:num_tokens].long()
    position = torch.arange(num_tokens) - cu_seq_lens.long()[seq]
    if starts is not None:
        position = position + starts.long()[seq]
    blocks = block_table.long()[seq, position // block_size]
    workspace[:num_tokens] = kv_cache[blocks, position % block_size].to(workspace.dtype)


def _layer():
    from vllm.models.kimi_k3.nvidia import mla

    return mla.MultiHeadLatentAttention


def needed():
    """Kimi's MLA gathers its context with a cache op this build of vLLM does not register."""
    return hasattr(_layer(), "_gather_context_latent") and not hasattr(
        torch.ops._C_cache_ops, "gather_and_maybe_dequant_cache"
    )


def mended(original):
    def _gather_context_latent(self, chunk, kv_cache, prefill, fp8_prefill):
        if fp8_prefill or self.kv_cache_dtype != "auto":
            return original(self, chunk, kv_cache, prefill, fp8_prefill)
        gather_context_latent(
            kv_cache,
            prefill.chunked_context.workspace,
            prefill.block_table[chunk.request_slice],
            chunk.cu_seq_lens,
            chunk.token_to_seq,
            chunk.num_context_tokens,
            chunk.starts,
        )

    return _gather_context_latent


def apply():
    install(_layer(), "_gather_context_latent", __name__, mended)
