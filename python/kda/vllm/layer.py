"""Kimi Linear's KDA layer with its core on kda (vLLM 0.32.0, CPU platform).

:class:`KdaKimiDeltaAttention` subclasses vLLM's ``KimiGatedDeltaNetAttention`` and keeps everything
but the core: the projections, the weights and their loaders, the state shapes and dtypes, the
gated output norm (vLLM's native torch form runs on the CPU) and the output projection. Its
``_forward`` (the core vLLM's layer runs with Triton kernels) reads vLLM's GDN attention metadata
and runs, per batch:

- the short convolution with vLLM's own CPU ops (``causal_conv1d_fn`` for prefill rows,
  ``causal_conv1d_update`` for plain decode rows) on the packed q/k/v conv state; speculative rows
  roll the wide conv buffer by their accepted-token count (a few torch ops per row);
- prefill and chunked-prefill continuation rows (and, in a batch with prefills, its decode rows):
  kda's pooled ``chunk_kda`` straight on vLLM's pool (``ssm_state_indices``, ``has_initial_state``);
- plain decode rows: kda's in-place ``fused_recurrent_kda_fwd`` on the pool (``[N]`` indices);
- speculative rows: the same with the ``[N, 1 + S]`` slot table and ``num_accepted_tokens``;

each with the gate (``-exp(A_log) * softplus(g + dt_bias)``, or the lower-bound gate), the beta
sigmoid and the q/k L2 norm fused in kda's kernels, the pool in vLLM's layout (``[slots, H, V, K]``,
V-first) and dtype (float32, or bfloat16 with ``mamba_ssm_cache_dtype``).

Slot 0 of vLLM's pools is its null block (``NULL_BLOCK_ID``): padding rows point there. kda reads a
negative index as padding, so indices <= 0 become -1 before a call.
"""

import torch

import kda

from . import counts

__all__ = ["KdaKimiDeltaAttention", "register_layers"]


def _slots(indices):
    """vLLM's state indices as kda's: the null block (0) and padding (-1) become -1."""
    return torch.where(indices > 0, indices, torch.full_like(indices, -1))


def _heads(x, head_dim):
    """``[T, H * D]`` -> ``[1, T, H, D]`` (a view)."""
    return x.unflatten(-1, (-1, head_dim)).unsqueeze(0)


def _spec_conv(x, conv_buf, weight, query_start_loc, first_slots, accepted, width):
    """The short convolution of speculative rows on the wide conv buffer (``[slots, dim, L]``,
    ``L = width - 1 + S``): row n's context is the ``width - 1`` inputs from column
    ``accepted[n] - 1`` on; after it, the buffer holds its history from the second input on (so that
    the next step, having accepted a tokens, finds the inputs before its first token at a - 1)."""
    out = torch.empty_like(x)
    L = conv_buf.shape[-1]
    w = weight.to(conv_buf.dtype).unsqueeze(1)
    starts = query_start_loc.tolist()
    slots = first_slots.tolist()
    acc = accepted.tolist()
    for n, slot in enumerate(slots):
        bos, eos = starts[n], starts[n + 1]
        if eos == bos or slot <= 0:
            continue
        buf = conv_buf[slot]
        seq = x[bos:eos].t().to(buf.dtype)
        offset = acc[n] - 1
        history = torch.cat([buf[:, offset : offset + width - 1], seq], dim=-1)
        y = torch.nn.functional.conv1d(history.unsqueeze(0), w, groups=seq.shape[0])[0]
        out[bos:eos] = torch.nn.functional.silu(y).t().to(out.dtype)
        kept = history[:, 1 : 1 + L]
        buf[:, : kept.shape[-1]].copy_(kept)
    return out


def _make_layer_class():
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
        causal_conv1d_fn_cpu,
        causal_conv1d_update_cpu,
    )
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import (
        _causal_conv1d_fwd_cpu as native_conv_prefill,
    )
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import (
        _causal_conv1d_update_cpu as native_conv_decode,
    )
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

    native_conv_cpu = torch.cpu._is_avx512_bf16_supported() or is_arm_bf16()

    class KdaKimiDeltaAttention(KimiGatedDeltaNetAttention):
        """Kimi Linear's KDA layer, its core on kda (see the module's docstring)."""

        def __init__(self, *args, **kwargs):
            from . import mends

            super().__init__(*args, **kwargs)
            # Kimi's MLA module, imported only once a model is built (see kda.vllm.mends)
            mends.apply_model_mends(args[1] if len(args) > 1 else kwargs.get("vllm_config"))
            self._kda_native_conv_weight = None
            # The packed copy is made from the loaded weight on first use; a later load (vLLM's
            # reload_weights, an RL weight update) goes through the parameter's weight_loader, which
            # then drops the copy so that the next step packs the new weight.
            weight = self.conv1d.weight
            loader = weight.weight_loader

            def reloading_loader(*a, **k):
                self._kda_native_conv_weight = None
                return loader(*a, **k)

            weight.weight_loader = reloading_loader

        def _native_conv_weight(self, x):
            """The conv weight packed for vLLM's C++ short convolution, or None where that op does
            not serve this step (then vLLM's torch-level CPU ops run).

            vLLM's GDN layers run their short convolution with C++ ops (``causal_conv1d_fwd_cpu``,
            ``causal_conv1d_update_cpu``: bf16 activations, a packed bf16 weight) on CPUs with
            AVX-512 BF16 (or Arm with BF16): 36x faster than the torch loop at a 512-token prefill
            and 17x at a one-token decode step, measured at this layer's 3 x 4096 channels. Kimi's
            layer keeps its conv weight in float32 (so vLLM never packs it) and its torch path is
            all Kimi gets. In a bf16 engine the activations entering and leaving the convolution are
            bf16 already; rounding the weight to bf16 as well adds one more rounding of the same
            size (the test's bf16 budget counts it), and the float32 engine keeps the torch ops.
            """
            if not native_conv_cpu or x.dtype != torch.bfloat16 or self.conv1d.weight.shape[-1] != 4:
                return None
            if self._kda_native_conv_weight is None:
                from vllm import _custom_ops as ops

                w = self.conv1d.weight
                unpacked = w.detach().view(w.shape[0], w.shape[-1]).to(torch.bfloat16).contiguous()
                self._kda_native_conv_weight = ops.causal_conv1d_weight_pack(unpacked)
            return self._kda_native_conv_weight

        def _kda_options(self):
            return dict(
                A_log=self.A_log,
                dt_bias=self.dt_bias,
                lower_bound=self.gate_lower_bound,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                use_qk_l2norm_in_kernel=True,
                state_v_first=True,
            )

        def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
            metadata = get_forward_context().attn_metadata
            if metadata is None:
                return
            m = metadata.get(self.prefix)
            if m is None:  # profile / warm-up runs carry no metadata for mamba-family layers
                return
            with torch.inference_mode():
                self._core(m, mixed_qkv, g1, beta, core_attn_out)
            # The gated output norm (sigmoid gate g2), in vLLM's torch form.
            core_attn_out.copy_(self.o_norm(core_attn_out, g2))

        def _core(self, m, mixed_qkv, g1, beta, core_attn_out):
            n = m.num_actual_tokens
            mixed_qkv, g1, beta = mixed_qkv[:n], g1[:, :n], beta[:, :n]
            conv_state, pool = self.kv_cache
            if not is_conv_state_dim_first():
                conv_state = conv_state.transpose(-1, -2)  # [slots, dim, L] either way
            width = self.conv1d.weight.shape[-1]
            weight = self.conv1d.weight.view(self.conv1d.weight.shape[0], width)
            D = self.head_dim
            options = self._kda_options()

            spec = m.spec_sequence_masks is not None
            only_spec = spec and m.num_prefills == 0 and m.num_decodes == 0
            if not spec:
                qkv_ns, g_ns, b_ns = mixed_qkv, g1, beta
            elif not only_spec:
                ns = m.non_spec_token_indx
                qkv_ns, g_ns, b_ns = (
                    mixed_qkv.index_select(0, ns),
                    g1.index_select(1, ns),
                    beta.index_select(1, ns),
                )

            out_spec = out_ns = None
            if spec:
                if only_spec:
                    qkv_s, g_s, b_s = mixed_qkv, g1, beta
                else:
                    si = m.spec_token_indx
                    qkv_s, g_s, b_s = (
                        mixed_qkv.index_select(0, si),
                        g1.index_select(1, si),
                        beta.index_select(1, si),
                    )
                num = m.num_spec_decodes
                table = m.spec_state_indices_tensor[:num]
                accepted = m.num_accepted_tokens[:num]
                qsl = m.spec_query_start_loc[: num + 1]
                fresh = getattr(m, "kda_spec_fresh", None)
                if fresh is not None and bool(fresh.any()):
                    counts["fresh"] += 1
                    # A request whose first step is a speculative row (a one-token prompt): its slots
                    # were recycled, so it starts from zeros, as a prefill row does.
                    start = table[fresh].gather(1, (accepted[fresh].long() - 1).view(-1, 1)).view(-1)
                    start = start[start > 0].long()
                    pool[start] = 0
                    first = table[fresh, 0]
                    conv_state[first[first > 0].long()] = 0
                x = _spec_conv(qkv_s, conv_state, weight, qsl, table[:, 0], accepted, width)
                q, k, v = (_heads(t, D) for t in x.split(self.local_projection_size, dim=-1))
                out_spec, _ = kda.fused_recurrent_kda_fwd(
                    q,
                    k,
                    v,
                    g_s,
                    b_s,
                    initial_state=pool,
                    cu_seqlens=qsl,
                    ssm_state_indices=_slots(table),
                    num_accepted_tokens=accepted,
                    **options,
                )
                counts["spec"] += 1

            if not only_spec:
                native = self._native_conv_weight(qkv_ns)
                if native is not None:
                    counts["native_conv"] += 1
                indices = m.non_spec_state_indices_tensor
                if m.num_prefills > 0:
                    qsl = m.non_spec_query_start_loc
                    rows = qsl.shape[0] - 1
                    indices = indices[:rows]
                    if native is not None:
                        x = native_conv_prefill(
                            x=qkv_ns.contiguous().t(),  # the op reads a transposed [T, dim] tensor
                            weight=native,
                            bias=self.conv1d.bias,
                            conv_states=conv_state,
                            query_start_loc=qsl,
                            # vLLM's own indices, as its GDN layers pass them: a padding row's
                            # block 0 is vLLM's null block, scratch that no request reads
                            cache_indices=indices,
                            has_initial_state=m.has_initial_state[:rows],
                            silu_activation=True,
                            is_weight_packed=True,
                        ).t()
                    else:
                        x = causal_conv1d_fn_cpu(
                            qkv_ns.t(),
                            weight,
                            self.conv1d.bias,
                            conv_state,
                            qsl,
                            cache_indices=_slots(indices),
                            has_initial_state=m.has_initial_state[:rows],
                            activation="silu",
                        ).t()
                    q, k, v = (_heads(t, D) for t in x.split(self.local_projection_size, dim=-1))
                    out_ns, _ = kda.chunk_kda(
                        q,
                        k,
                        v,
                        g_ns,
                        b_ns,
                        initial_state=pool,
                        cu_seqlens=qsl,
                        ssm_state_indices=_slots(indices),
                        has_initial_state=m.has_initial_state[:rows],
                        **options,
                    )
                    counts["prefill"] += 1
                else:
                    rows = qkv_ns.shape[0]
                    indices = indices[:rows]
                    if native is not None:
                        x = native_conv_decode(
                            x=qkv_ns.contiguous(),
                            conv_states=conv_state[:, :, : width - 1],
                            weight=native,
                            bias=self.conv1d.bias,
                            silu_activation=True,
                            conv_state_indices=indices,
                            is_weight_packed=True,
                        )
                    else:
                        x = causal_conv1d_update_cpu(
                            qkv_ns,
                            conv_state[:, :, : width - 1],
                            weight,
                            self.conv1d.bias,
                            activation="silu",
                            conv_state_indices=indices,
                        )
                    q, k, v = (
                        t.unflatten(-1, (-1, D)).unsqueeze(1)
                        for t in x.split(self.local_projection_size, dim=-1)
                    )
                    out_ns, _ = kda.fused_recurrent_kda_fwd(
                        q,
                        k,
                        v,
                        g_ns.transpose(0, 1),
                        b_ns.transpose(0, 1),
                        initial_state=pool,
                        ssm_state_indices=_slots(indices),
                        **options,
                    )
                    out_ns = out_ns.transpose(0, 1)
                    counts["decode"] += 1

            if out_spec is not None and out_ns is not None:
                core_attn_out[0, :n].index_copy_(0, m.spec_token_indx, out_spec[0])
                core_attn_out[0, :n].index_copy_(0, m.non_spec_token_indx, out_ns[0])
            else:
                core_attn_out[0, :n] = (out_ns if out_spec is None else out_spec)[0, :n]

    return KdaKimiDeltaAttention


KdaKimiDeltaAttention = None


def register_layers():
    """Registers the layer with vLLM's ``PluggableLayer.register_oot`` (once per process)."""
    global KdaKimiDeltaAttention
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    if "KimiGatedDeltaNetAttention" in op_registry_oot:
        return
    KdaKimiDeltaAttention = _make_layer_class()
    PluggableLayer.register_oot(KdaKimiDeltaAttention, name="KimiGatedDeltaNetAttention")
