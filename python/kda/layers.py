"""Layers for the Hugging Face ``kernels`` hub: transformers' Kimi Linear calls these in place of its
torch fallbacks ``chunk_kimi_delta_attention`` and ``recurrent_kimi_delta_attention``; its gated delta
rule models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid) in place of ``torch_chunk_gated_delta_rule``
and ``torch_recurrent_gated_delta_rule`` (mapped as ``chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule``).

``kernels`` requires a layer without ``__init__``, with no members besides ``has_backward`` and
``can_torch_compile``, whose ``forward`` has the arguments of the function it replaces; the layers
of both families are made by one factory per kind (chunked, token by token). Register them
with ``kernels.register_kernel_mapping`` (see the README) and call ``model.set_use_kernels(True)``.
"""

import torch.nn as nn

from . import gated_delta_rule as _gdn
from .functional import chunk_kda, fused_recurrent_kda


def _chunk_layer(name, function, doc):
    """A chunked layer over ``function()`` (chunk_kda or chunk_gated_delta_rule, looked up on each
    call), with the arguments of transformers' torch fallbacks of both families."""

    def forward(
        self,
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        # transformers' fallbacks ignore their other keyword arguments (attention plumbing) and so does
        # this layer, except packed sequences, which kda keeps apart as fla does. The output comes
        # back in the query's dtype and the state in float32, as the fallbacks return them.
        return function()(
            query,
            key,
            value,
            g,
            beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=kwargs.get("cu_seqlens"),
            chunk_size=chunk_size,
        )

    members = dict(
        __doc__=doc, __module__=__name__, has_backward=True, can_torch_compile=True, forward=forward
    )
    return type(name, (nn.Module,), members)


ChunkKimiDeltaAttention = _chunk_layer(
    "ChunkKimiDeltaAttention",
    lambda: chunk_kda,
    "Prefill and multi-token steps: kda's chunked op (forward and backward).",
)
ChunkGatedDeltaRule = _chunk_layer(
    "ChunkGatedDeltaRule",
    lambda: _gdn.chunk_gated_delta_rule,
    "The gated delta rule's prefill, training and multi-token steps: kda's chunked op with the "
    "per-head gate (forward and backward). The models pass q and k already expanded to the value "
    "heads, g as the log decay [B, T, HV] and beta after its sigmoid.",
)


def _recurrent_layer(name, function, doc, state_required):
    """A token-by-token layer over ``function()`` (fused_recurrent_kda or
    fused_recurrent_gated_delta_rule, looked up on each call). ``state_required``: the replaced
    fallback takes initial_state and output_final_state without defaults (transformers' Kimi
    Linear's does, its gated delta rule models' do not)."""

    def forward(
        self,
        query,
        key,
        value,
        g,
        beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        o, state = function()(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=kwargs.get("cu_seqlens"),
        )
        return o.to(query.dtype), state  # the fallbacks return the query's dtype

    if state_required:
        forward.__defaults__ = forward.__defaults__[-1:]  # only use_qk_l2norm_in_kernel keeps its default
    members = dict(
        __doc__=doc, __module__=__name__, has_backward=True, can_torch_compile=True, forward=forward
    )
    return type(name, (nn.Module,), members)


RecurrentKimiDeltaAttention = _recurrent_layer(
    "RecurrentKimiDeltaAttention",
    lambda: fused_recurrent_kda,
    "One-token decode steps with a cached state: kda's recurrent op.",
    state_required=True,
)
RecurrentGatedDeltaRule = _recurrent_layer(
    "RecurrentGatedDeltaRule",
    lambda: _gdn.fused_recurrent_gated_delta_rule,
    "The gated delta rule's one-token decode steps with a cached state: kda's recurrent op.",
    state_required=False,
)


# The layer names a kernel mapping refers to (those of the functions they replace; the gated delta
# rule's are the names the kernels-community hub gives them).
chunk_kimi_delta_attention = ChunkKimiDeltaAttention
recurrent_kimi_delta_attention = RecurrentKimiDeltaAttention
chunk_gated_delta_rule = ChunkGatedDeltaRule
recurrent_gated_delta_rule = RecurrentGatedDeltaRule

__all__ = [
    "ChunkGatedDeltaRule",
    "ChunkKimiDeltaAttention",
    "RecurrentGatedDeltaRule",
    "RecurrentKimiDeltaAttention",
    "chunk_gated_delta_rule",
    "chunk_kimi_delta_attention",
    "recurrent_gated_delta_rule",
    "recurrent_kimi_delta_attention",
]
