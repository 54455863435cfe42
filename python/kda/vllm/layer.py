"""Kimi Linear's KDA layer with its core on kda (vLLM 0.32.0, CPU platform).

:class:`KdaKimiDeltaAttention` subclasses vLLM's ``KimiGatedDeltaNetAttention`` and keeps everything
but the core: the projections, the weights and their loaders, the state shapes and dtypes, the
gated output norm (vLLM's native torch form runs on the CPU) and the output projection. Its
``_forward`` (the core vLLM's layer runs with Triton kernels) reads vLLM's GDN attention metadata
and runs, per batch:

- the short convolution (:mod:`kda.vllm.conv`) with vLLM's own CPU ops (prefill and plain decode
  rows: its C++ ops in bf16 where the CPU has them, else its torch-level ops) on the packed q/k/v
  conv state; speculative rows roll the wide conv buffer by their accepted-token count;
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
from .conv import ShortConvolution, kda_slots, native_ops

__all__ = ["KdaKimiDeltaAttention", "check_served", "register_layers", "serve_step"]


def _heads(x, head_dim):
    """``[T, H * D]`` -> ``[1, T, H, D]`` (a view)."""
    return x.unflatten(-1, (-1, head_dim)).unsqueeze(0)


def check_served(heads, head_dim, prefix, options):
    """Raises a ValueError naming the layer when kda does not serve its shapes, so that the engine
    refuses the model when it is built instead of failing every request (the server died at its
    first request). kda's own validation decides: one token through a two-slot pool, all zeros."""
    zeros = torch.zeros(1, 1, heads, head_dim)
    pool = torch.zeros(2, heads, head_dim, head_dim)
    probe = dict(options, A_log=torch.zeros(heads), dt_bias=torch.zeros(heads * head_dim))
    try:
        with torch.inference_mode():
            kda.fused_recurrent_kda_fwd(
                zeros,
                zeros,
                zeros,
                zeros,
                zeros[..., 0],
                initial_state=pool,
                ssm_state_indices=torch.tensor([1]),
                **probe,
            )
    except (AssertionError, ValueError, NotImplementedError, TypeError) as error:
        raise ValueError(
            f"kda.vllm: the KDA layer {prefix} ({heads} heads of dimension {head_dim}) cannot run on kda: "
            f"{error}"
        ) from None


def serve_step(layer, m, mixed_qkv, g1, beta, core_attn_out):
    """One step of a KDA layer on vLLM's GDN metadata ``m``: the short convolution, then kda on the
    pool, rows as the module's docstring says. ``layer`` has ``kv_cache`` (conv state, pool),
    ``short_conv`` (:class:`kda.vllm.conv.ShortConvolution`), ``head_dim``,
    ``local_projection_size`` and ``kda_options`` (a dict); tests call this with the tensors vLLM builds.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    n = m.num_actual_tokens
    mixed_qkv, g1, beta = mixed_qkv[:n], g1[:, :n], beta[:, :n]
    conv_state, pool = layer.kv_cache
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)  # [slots, dim, L] either way
    conv = layer.short_conv
    D = layer.head_dim
    options = layer.kda_options

    def split(x):
        return x.split(layer.local_projection_size, dim=-1)

    spec = m.spec_sequence_masks is not None
    only_spec = spec and m.num_prefills == 0 and m.num_decodes == 0
    if not spec:
        qkv_ns, g_ns, b_ns = mixed_qkv, g1, beta
    elif not only_spec:
        ns = m.non_spec_token_indx
        qkv_ns, g_ns, b_ns = mixed_qkv.index_select(0, ns), g1.index_select(1, ns), beta.index_select(1, ns)

    out_spec = out_ns = None
    if spec:
        if only_spec:
            qkv_s, g_s, b_s = mixed_qkv, g1, beta
        else:
            si = m.spec_token_indx
            qkv_s, g_s, b_s = mixed_qkv.index_select(0, si), g1.index_select(1, si), beta.index_select(1, si)
        num = m.num_spec_decodes
        table = m.spec_state_indices_tensor[:num]
        accepted = m.num_accepted_tokens[:num]
        qsl = m.spec_query_start_loc[: num + 1]
        fresh = getattr(m, "kda_spec_fresh", None)
        if fresh is not None and bool(fresh.any()):
            counts["fresh"] += 1
            # A request whose first step is a speculative row (a one-token prompt): its slots were
            # recycled, so it starts from zeros, as a prefill row does.
            start = table[fresh].gather(1, (accepted[fresh].long() - 1).view(-1, 1)).view(-1)
            pool[start[start > 0].long()] = 0
            first = table[fresh, 0]
            conv_state[first[first > 0].long()] = 0
        x = conv.speculative(qkv_s, conv_state, qsl, table[:, 0], accepted)
        qkv = [_heads(t, D) for t in split(x)]
        slots = dict(ssm_state_indices=kda_slots(table), num_accepted_tokens=accepted)
        out_spec, _ = kda.fused_recurrent_kda_fwd(
            *qkv, g_s, b_s, initial_state=pool, cu_seqlens=qsl, **slots, **options
        )
        counts["spec"] += 1

    if not only_spec:
        native_before = conv.native_calls
        indices = m.non_spec_state_indices_tensor
        if m.num_prefills > 0:
            qsl = m.non_spec_query_start_loc
            rows = qsl.shape[0] - 1
            indices, has_initial_state = indices[:rows], m.has_initial_state[:rows]
            x = conv.prefill(qkv_ns, conv_state, qsl, indices, has_initial_state)
            qkv = [_heads(t, D) for t in split(x)]
            slots = dict(ssm_state_indices=kda_slots(indices), has_initial_state=has_initial_state)
            out_ns, _ = kda.chunk_kda(
                *qkv, g_ns, b_ns, initial_state=pool, cu_seqlens=qsl, **slots, **options
            )
            counts["prefill"] += 1
        else:
            indices = indices[: qkv_ns.shape[0]]
            x = conv.decode(qkv_ns, conv_state, indices)
            q, k, v = (t.unflatten(-1, (-1, D)).unsqueeze(1) for t in split(x))
            out_ns, _ = kda.fused_recurrent_kda_fwd(
                q,
                k,
                v,
                g_ns.transpose(0, 1),
                b_ns.transpose(0, 1),
                initial_state=pool,
                ssm_state_indices=kda_slots(indices),
                **options,
            )
            out_ns = out_ns.transpose(0, 1)
            counts["decode"] += 1
        counts["native_conv"] += conv.native_calls - native_before

    if out_spec is not None and out_ns is not None:
        core_attn_out[0, :n].index_copy_(0, m.spec_token_indx, out_spec[0])
        core_attn_out[0, :n].index_copy_(0, m.non_spec_token_indx, out_ns[0])
    else:
        core_attn_out[0, :n] = (out_ns if out_spec is None else out_spec)[0, :n]


def _make_layer_class():
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention

    class KdaKimiDeltaAttention(KimiGatedDeltaNetAttention):
        """Kimi Linear's KDA layer, its core on kda (see the module's docstring)."""

        def __init__(self, *args, **kwargs):
            from . import mends

            super().__init__(*args, **kwargs)
            # Kimi's MLA module, imported only once a model is built (see kda.vllm.mends)
            mends.apply_model_mends(args[1] if len(args) > 1 else kwargs.get("vllm_config"))
            #: kda's options for this layer, made once (every step passes them): Kimi's gate, beta and
            #: q/k norm fused, vLLM's V-first pool. A_log and dt_bias are the layer's parameters,
            #: which weight loading and vLLM's reload_weights fill in place.
            self.kda_options = dict(
                A_log=self.A_log,
                dt_bias=self.dt_bias,
                lower_bound=self.gate_lower_bound,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                use_qk_l2norm_in_kernel=True,
                state_v_first=True,
            )
            check_served(self.local_num_heads, self.head_dim, self.prefix, self.kda_options)
            self.short_conv = ShortConvolution(self.conv1d, native_ops())
            # The packed conv weight is made from the loaded weight on first use; a later load
            # (vLLM's reload_weights, an RL weight update) goes through the parameter's
            # weight_loader, which then drops the packed copy so that the next step packs the new one.
            weight = self.conv1d.weight
            loader = weight.weight_loader

            def reloading_loader(*a, **k):
                self.short_conv.weight_changed()
                return loader(*a, **k)

            weight.weight_loader = reloading_loader

        def get_state_dtype(self):
            """The conv state in the cache dtype, the recurrent pool in ``mamba_ssm_cache_dtype``
            (float32 by default, or bfloat16). vLLM 0.32.0's layer drops the latter (it passes only the
            cache dtype, so the pool stayed float32 whatever was asked), while its model class sizes
            the cache pages with it; kda reads and writes either pool dtype in place."""
            from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

            cache = self.cache_config
            return MambaStateDtypeCalculator.kda_state_dtype(
                self.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
            )

        def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
            metadata = get_forward_context().attn_metadata
            if metadata is None:
                return
            m = metadata.get(self.prefix)
            if m is None:  # profile / warm-up runs carry no metadata for mamba-family layers
                return
            with torch.inference_mode():
                serve_step(self, m, mixed_qkv, g1, beta, core_attn_out)
            # The gated output norm (sigmoid gate g2), in vLLM's torch form.
            core_attn_out.copy_(self.o_norm(core_attn_out, g2))

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
