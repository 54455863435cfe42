"""Torch forms of the three CUDA-only fused epilogues of Kimi's MLA (bf16/fp32 cache, NoPE).

vLLM 0.32.0's Kimi MLA layer (``vllm.models.kimi_k3.nvidia.mla``) calls three ops that only its CUDA
build registers (``torch.ops._C.fused_kimi_k3_mla_*``: key concat + cache insert, context key concat,
decode query concat + cache insert); the CPU build has none of them and the first prefill fails. Each
one only concatenates keys/queries and writes the latent ``[kv_c_normed | k_pe]`` into the paged cache,
so a few torch operations do the same on the CPU. Kimi Linear's MLA is NoPE (no RoPE in the epilogue);
fp8 caches are not served on the CPU. Mend: the module's names of the missing ops point at these.
"""

import torch

PHASE = "model"


def _insert_latent(kv_c_normed, k_pe, kv_cache, slot_mapping):
    """Writes [kv_c_normed | k_pe] of each token to its cache slot (a negative slot: padding)."""
    rank = kv_c_normed.shape[-1]
    block_size = kv_cache.shape[1]
    slots = slot_mapping.reshape(-1).long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, kv_c_normed, k_pe = slots[valid], kv_c_normed[valid], k_pe[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, offsets, :rank] = kv_c_normed.to(kv_cache.dtype)
    kv_cache[blocks, offsets, rank:] = k_pe.reshape(k_pe.shape[0], -1).to(kv_cache.dtype)


def _no_rope(positions, cos_sin_cache):
    if positions is not None or cos_sin_cache is not None:
        raise NotImplementedError("kda.vllm: RoPE inside Kimi's MLA epilogue is not served on the CPU")


def _full_key(k_nope, k_pe):
    k_pe = k_pe.reshape(k_pe.shape[0], 1, -1).expand(-1, k_nope.shape[1], -1)
    return torch.cat([k_nope, k_pe.to(k_nope.dtype)], dim=-1)


def mla_key_concat_kv_cache_insert(
    q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions=None, cos_sin_cache=None
):
    """Prefill: the full key ``[k_nope | k_pe]`` per head; the latent goes into the cache."""
    _no_rope(positions, cos_sin_cache)
    if k_nope.shape[0]:
        _insert_latent(kv_c_normed, k_pe, kv_cache, slot_mapping)
    return _full_key(k_nope, k_pe)


def mla_kv_concat(k_nope, k_pe):
    """Chunked context: the full key ``[k_nope | k_pe]``."""
    return _full_key(k_nope, k_pe)


def mla_decode_q_concat_kv_cache_insert(
    ql_nope,
    q_pe,
    kv_c_normed,
    k_pe,
    kv_cache,
    slot_mapping,
    *,
    ds_mla=False,
    q_scale_inv=None,
    cache_scale_inv=None,
    positions=None,
    cos_sin_cache=None,
):
    """Decode: the latent query ``[ql_nope | q_pe]``; the latent goes into the cache."""
    if ds_mla or q_scale_inv is not None or cache_scale_inv is not None:
        raise NotImplementedError("kda.vllm: fp8 MLA caches are not served on the CPU")
    _no_rope(positions, cos_sin_cache)
    if ql_nope.shape[0]:
        _insert_latent(kv_c_normed, k_pe, kv_cache, slot_mapping)
    return torch.cat([ql_nope, q_pe.to(ql_nope.dtype)], dim=-1)


OPS = {
    # name in vllm.models.kimi_k3.nvidia.mla: (the CUDA op it wraps, the torch form)
    "fused_mla_key_concat_kv_cache_insert": (
        "fused_kimi_k3_mla_key_concat_kv_cache_insert",
        mla_key_concat_kv_cache_insert,
    ),
    "fused_mla_kv_concat": ("fused_kimi_k3_mla_kv_concat", mla_kv_concat),
    "fused_mla_decode_q_concat_kv_cache_insert": (
        "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert",
        mla_decode_q_concat_kv_cache_insert,
    ),
}
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = tuple(f"vllm.models.kimi_k3.nvidia.mla:{name}" for name in OPS)


def _missing():
    """The names in Kimi's MLA module whose CUDA op this vLLM build lacks."""
    from vllm.models.kimi_k3.nvidia import mla

    return mla, [
        name for name, (op, _) in OPS.items() if not hasattr(torch.ops._C, op) and hasattr(mla, name)
    ]


def needed():
    """Kimi's MLA module calls ops that this build of vLLM does not register."""
    return bool(_missing()[1])


def apply():
    mla, names = _missing()
    for name in names:
        setattr(mla, name, OPS[name][1])
