"""Mends vLLM 0.32.0's CPU build needs to serve a Kimi Linear checkpoint (each: what, why)."""

import os

import torch

__all__ = ["apply_model_mends", "apply_process_mends"]


def apply_process_mends():
    # VLLM_KIMI_K3_GEMM_AR defaults to 1 in vLLM 0.32.0: Kimi's MLP then imports the CuTe DSL
    # GEMM + all-reduce kernels (the `cutlass` package), which a CPU install lacks. On the CPU there
    # is nothing to fuse; a value the user set is kept.
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
    _mla_block_sizes()
    _cpu_platform_config()


def _cpu_platform_config():
    # Three mends around vLLM 0.32.0's CpuPlatform.check_and_update_config (each: what, why).
    #
    # AMX MLA for bf16 only: on CPUs with AMX tiles vLLM prefers its AMX MLA backend
    # (CpuPlatform.get_attn_backend_cls) whatever the engine's dtype, but that backend's kernels take
    # bf16 only (AMXMLABackend.supported_dtypes): a float32 engine stops at its first decode step in
    # decode_attention_cpu ("not implemented for 'Float'"). For an MLA model in another dtype, with no
    # backend chosen by the user, the reference CPU MLA backend is chosen, as on CPUs without AMX.
    #
    # Whole prompts under speculative decoding: where MLA runs on that reference backend (float32
    # engines; every engine on CPUs without AMX), the platform turns chunked prefill off and raises
    # max_num_batched_tokens to max(max_model_len, 2048), so that any prompt fits one step. But
    # VllmConfig set max_num_scheduled_tokens (the scheduler's real budget under speculative decoding)
    # from the old max_num_batched_tokens before the platform ran, and leaves it. A prompt longer than
    # that budget is then never scheduled: the scheduler stops at it every step, so the request and
    # every request queued behind it wait forever (a float32 engine with --max-num-batched-tokens 128
    # and a 129-token prompt). Mend: raise the budget to the new max_num_batched_tokens.
    #
    # The bf16 state pool a user asks for: on CPUs with AVX-512 BF16 the platform resets
    # mamba_ssm_cache_dtype to float32 for every model but its own GDN ones ("Reset SSM cache type to
    # float32 for accelerated GDN mamba backend 'kimi_linear'"), because its CPU state kernels for other
    # models take float32. Kimi Linear's KDA layers run on kda, which reads and writes bf16 pools, so
    # for Kimi Linear a bfloat16 pool asked for is kept (on CPUs without AVX-512 BF16 it always was).
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, "_kda_mend", False):
        return

    def check_and_update_config(cls, vllm_config):
        model = vllm_config.model_config
        attention = vllm_config.attention_config
        if (
            model is not None
            and getattr(model, "use_mla", False)
            and model.dtype != torch.bfloat16
            and attention.backend is None
        ):
            attention.backend = AttentionBackendEnum.CPU_MLA
        cache = vllm_config.cache_config
        asked = cache.mamba_ssm_cache_dtype
        original(cls, vllm_config)
        model_type = getattr(getattr(model, "hf_text_config", None), "model_type", None)
        if asked == "bfloat16" and model_type == "kimi_linear" and cache.mamba_ssm_cache_dtype != asked:
            cache.mamba_ssm_cache_dtype = asked
        scheduler = vllm_config.scheduler_config
        budget = scheduler.max_num_scheduled_tokens
        if not scheduler.enable_chunked_prefill and budget is not None:
            scheduler.max_num_scheduled_tokens = max(budget, scheduler.max_num_batched_tokens)

    check_and_update_config._kda_mend = True
    check_and_update_config.__wrapped__ = original
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _mla_block_sizes():
    # vLLM 0.32.0's CPU MLA backend accepts only block size 16 (supports_block_size), but a hybrid
    # model's KV cache blocks are aligned so that one attention block holds as many bytes as one
    # mamba state (128 tokens for Kimi Linear), and the platform then refuses the aligned size.
    # The backend's kernels see blocks of get_supported_kernel_block_sizes() = [16] (vLLM splits each
    # cache block into kernel blocks), so any multiple of 16 is sound. Mend: accept multiples of 16.
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    if getattr(CPUMLABackend.supports_block_size, "_kda_mend", False):
        return

    def supports_block_size(cls, block_size):
        return block_size is None or (block_size > 0 and block_size % 16 == 0)

    supports_block_size._kda_mend = True
    CPUMLABackend.supports_block_size = classmethod(supports_block_size)


_model_mends_done = False


def apply_model_mends(vllm_config=None):
    """The mends of Kimi's MLA layer (``vllm.models.kimi_k3.nvidia.mla``), applied when the first KDA
    layer is built: importing that module when the plugin loads pulls numba in before vLLM's CPU
    worker has set itself up, and breaks its start-up."""
    global _model_mends_done
    if not _model_mends_done:
        _model_mends_done = True
        from vllm.models.kimi_k3.nvidia import mla

        _keep_kv_b_proj(mla.MultiHeadLatentAttention)
        _mla_torch_ops(mla)
        if not hasattr(torch.ops._C_cache_ops, "gather_and_maybe_dequant_cache"):
            _torch_context_gather(mla.MultiHeadLatentAttention)
        _no_out_on_cpu_prefill()
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

        _mark_fresh_spec_rows(GDNAttentionMetadataBuilder)
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        _zero_whole_blocks(CPUModelRunner)
    if vllm_config is not None:  # MLA layers built before this KDA layer
        for module in vllm_config.compilation_config.static_forward_context.values():
            _mark_kv_b_proj(module)


def _mark_kv_b_proj(module):
    kv_b_proj = getattr(module, "kv_b_proj", None)
    if kv_b_proj is not None:
        kv_b_proj._cpu_skip_gemm_dispatch = True


def _keep_kv_b_proj(cls):
    # vLLM 0.32.0's CPU linear layers hand their weight to a packed GEMM and free it
    # (dispatch_cpu_unquantized_gemm(remove_weight=True)), unless the layer carries
    # `_cpu_skip_gemm_dispatch`, which vLLM's own MLA layer sets on its kv_b_proj. Kimi's MLA layer
    # does not, so its process_weights_after_loading finds an empty kv_b_proj weight when it splits
    # it into the absorbed W_UK / W_UV. Mend: mark Kimi's kv_b_proj as vLLM marks its own.
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _mark_kv_b_proj(self)

    __init__.__wrapped__ = init
    cls.__init__ = __init__


# ---- Kimi's MLA: torch forms of its three CUDA-only fused epilogues (bf16 cache, NoPE) ------------
# vLLM 0.32.0's Kimi MLA layer calls three ops that only its CUDA build registers
# (torch.ops._C.fused_kimi_k3_mla_*); the CPU build has none of them. Each one only concatenates
# keys/queries and writes the latent [kv_c_normed | k_pe] into the paged cache, so a few torch
# operations do the same on the CPU. Kimi Linear's MLA is NoPE (no RoPE in the epilogue); fp8 caches
# are not served on the CPU.


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


_MLA_OPS = {
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


def _mla_torch_ops(mla):
    for name, (op, replacement) in _MLA_OPS.items():
        if not hasattr(torch.ops._C, op) and hasattr(mla, name):
            setattr(mla, name, replacement)


# ---- Kimi's MLA under speculative decoding: context prefill ---------------------------------------
# With speculative decoding, vLLM's MLA treats each multi-token verification row as a prefill with
# context, and Kimi's MLA layer gathers that context from the paged cache with
# ops.gather_and_maybe_dequant_cache, a CUDA-only op in vLLM 0.32.0 (the CPU build has no
# _C_cache_ops.gather_and_maybe_dequant_cache). Mend: gather with torch indexing for a cache in the
# model dtype (the only CPU cache dtype); other cache formats keep vLLM's path.


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


def _torch_context_gather(cls):
    original = cls._gather_context_latent

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

    _gather_context_latent.__wrapped__ = original
    cls._gather_context_latent = _gather_context_latent


# vLLM 0.32.0's CPU SDPA MLA prefill backend reports supports_out() = True, but its
# run_prefill_context_chunk asserts that no `out` is given ("CPU MLA context prefill does not
# support in-place output"); Kimi's MLA layer trusts supports_out() and passes `out` when a context
# spans several chunks. Mend: report what the backend does (no `out`); the layer then copies.


def _no_out_on_cpu_prefill():
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    def supports_out(self):
        return False

    CPUSDPAMLAPrefillBackend.supports_out = supports_out


# ---- new requests under speculative decoding ---------------------------------------------------
# With speculative decoding on, vLLM 0.32.0's GDN metadata builder classifies every request that has
# a draft count (>= 0) as a speculative row, including a request whose prompt is one token: its
# first step is then a speculative row, which resumes from the state slot at num_accepted_tokens - 1
# with no has_initial_state flag, i.e. from whatever state the recycled slot holds. Mend: the
# builder also records, for each speculative row, whether the request has no computed token yet
# (`kda_spec_fresh`); kda's layer zeroes those rows' state and conv slots before the step.


def _mark_fresh_spec_rows(builder_cls):
    if getattr(builder_cls.build, "_kda_mend", False):
        return
    build = builder_cls.build

    def build_with_fresh_rows(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        metadata = build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        mask = getattr(metadata, "spec_sequence_masks_cpu", None)
        if metadata.spec_sequence_masks is not None and mask is not None:
            computed = common_attn_metadata.compute_num_computed_tokens()[: mask.shape[0]]
            metadata.kda_spec_fresh = (computed[mask] == 0)[: metadata.num_spec_decodes]
        return metadata

    build_with_fresh_rows._kda_mend = True
    build_with_fresh_rows.__wrapped__ = build
    builder_cls.build = build_with_fresh_rows


# ---- the "first request drifts" defect: new attention blocks zeroed in the wrong unit ------------
# vLLM 0.32.0's CPU model runner zeroes the attention cache blocks the scheduler just allocated
# (CPUModelRunner._zero_block_ids) with `kv[block_id].zero_()`. For a hybrid model the attention
# cache is bound in kernel blocks (16 tokens for the CPU MLA backend) while block ids count manager
# blocks (128 tokens for Kimi Linear, aligned to one mamba state): kv[block_id] is then 1/8 of
# manager block block_id / 8, which is another layer's page, a KDA layer's recurrent and conv state
# of an earlier request (with the allocator's order, often the first request of the batch). That
# request's state is overwritten by zeros whenever a request joins (a plain batch's later requests,
# a mixed step), so its log-probabilities drift by 0.07-1.3 from the next step on. Mend: zero the
# kernel blocks that make up each manager block, as vLLM's GPU runner (KVBlockZeroer) does.


def _zero_whole_blocks(runner_cls):
    if getattr(runner_cls._zero_block_ids, "_kda_mend", False):
        return
    original = runner_cls._zero_block_ids

    def _zero_block_ids(self, block_ids):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        num_blocks = self.kv_cache_config.num_blocks
        seen = set()
        for group in self.kv_cache_config.kv_cache_groups:
            if not isinstance(group.kv_cache_spec, FullAttentionSpec):
                continue
            for name in group.layer_names:
                layer = self.compilation_config.static_forward_context.get(name)
                kv = getattr(layer, "kv_cache", None)
                if not isinstance(kv, torch.Tensor) or kv.data_ptr() in seen:
                    continue
                seen.add(kv.data_ptr())
                ratio = max(kv.shape[0] // num_blocks, 1)  # kernel blocks per manager block
                for block_id in block_ids:
                    kv[block_id * ratio : (block_id + 1) * ratio].zero_()

    _zero_block_ids._kda_mend = True
    _zero_block_ids.__wrapped__ = original
    runner_cls._zero_block_ids = _zero_block_ids
