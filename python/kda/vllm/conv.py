"""Kimi's short convolution on vLLM's CPU ops, in the layouts those ops require (vLLM 0.32.0).

Two families of ops serve it:

- vLLM's C++ ops (``causal_conv1d_fwd_cpu`` for prefill rows, ``causal_conv1d_update_cpu`` for decode
  rows; bf16 activations and a packed bf16 weight), which vLLM's GDN layers use on CPUs with
  AVX-512 BF16 (or Arm BF16). They check their arguments' strides: the prefill input must be the
  transpose of a row-major ``[T, dim]`` tensor (strides ``(1, dim)``: "expect x to be transposed"),
  decode rows must be contiguous, and the state indices must be contiguous ("tensor must be
  contiguous");
- vLLM's torch-level ops (``causal_conv1d_fn_cpu``, ``causal_conv1d_update_cpu``), which take any
  strides, everywhere else and in float32 engines.

The tensors vLLM hands the layer are views with other strides. Its q/k/v part is a column slice of
the fused input projection ``[T, W]`` (row stride ``W > dim``); torch's ``.contiguous()`` leaves a
one-token slice as it is (a size-1 dimension counts as contiguous whatever its stride), so a lone
one-token prompt reached the C++ prefill op with strides ``(1, W)``. With speculative decoding
configured, a step with no speculative rows gets ``block_table[:, 0]`` as its state indices (stride
``1 + S``). :func:`dense_rows` and :func:`dense_indices` copy exactly where the layout differs.
"""

import torch

__all__ = ["NativeOps", "ShortConvolution", "dense_indices", "dense_rows", "kda_slots", "native_ops"]


def kda_slots(indices):
    """vLLM's state indices as kda's: block 0 (vLLM's null block, where padding rows point) and
    padding (-1) become -1, which kda's pools and vLLM's torch ops read as a row to skip."""
    return torch.where(indices > 0, indices, torch.full_like(indices, -1))


def dense_rows(x):
    """``x [T, dim]`` with strides ``(dim, 1)``: ``x`` itself when it has them, else a copy."""
    if x.stride(-1) == 1 and x.stride(0) == x.shape[-1]:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def dense_indices(indices):
    """An index tensor the C++ ops accept: ``indices`` when contiguous, else a contiguous copy."""
    return indices if indices.is_contiguous() else indices.contiguous()


class NativeOps:
    """vLLM's C++ short-convolution ops: ``pack(weight [dim, 4] bf16)``, ``prefill(**kw)`` and
    ``decode(**kw)`` with the keyword arguments of vLLM's ``_causal_conv1d_fwd_cpu`` and
    ``_causal_conv1d_update_cpu``. Tests substitute a stand-in that checks the same layouts."""

    def __init__(self, pack, prefill, decode):
        self.pack, self.prefill, self.decode = pack, prefill, decode


def native_ops():
    """vLLM's C++ ops where this CPU runs them (AVX-512 BF16, or Arm with BF16), else None."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    if not (torch.cpu._is_avx512_bf16_supported() or gdn_attention.is_arm_bf16()):
        return None
    return NativeOps(
        ops.causal_conv1d_weight_pack,
        gdn_attention._causal_conv1d_fwd_cpu,
        gdn_attention._causal_conv1d_update_cpu,
    )


class ShortConvolution:
    """The layer's depthwise causal convolution (width 4, SiLU) on its conv-state slots
    ``conv_state [slots, dim, L]`` (``L = width - 1``, or ``width - 1 + S`` with speculative decoding).

    A bf16 step runs on vLLM's C++ ops where ``native`` is given (many times faster than the torch
    loop: docs/vllm.md has the figures); float32 steps, other widths and CPUs without the ops run
    vLLM's torch-level ops.
    Kimi keeps its conv weight in float32, so vLLM never packs it: this class packs a bf16 copy on
    first use and drops it when the weight is reloaded (:meth:`weight_changed`). In a bf16 engine the
    activations around the convolution are bf16 already; rounding the weight as well adds one rounding
    of the same size.
    """

    def __init__(self, conv1d, native=None):
        self.conv1d = conv1d
        self.native = native
        self._packed = None
        #: calls that ran on the C++ ops (the plugin's counters read it)
        self.native_calls = 0

    @property
    def width(self):
        return self.conv1d.weight.shape[-1]

    def weight(self):
        """The weight as ``[dim, width]`` (a view)."""
        w = self.conv1d.weight
        return w.view(w.shape[0], w.shape[-1])

    def weight_changed(self):
        """Called by the weight's loader: the next bf16 step packs the new weight."""
        self._packed = None

    def _packed_weight(self, x):
        if self.native is None or x.dtype != torch.bfloat16 or self.width != 4:
            return None
        if self._packed is None:
            self._packed = self.native.pack(self.weight().detach().to(torch.bfloat16).contiguous())
        return self._packed

    def prefill(self, x, conv_state, query_start_loc, indices, has_initial_state):
        """Prefill and chunked-prefill rows: ``x [T, dim]`` packed by ``query_start_loc``; row n starts
        from slot ``indices[n]``'s conv state where ``has_initial_state[n]``, else from zeros, and leaves
        its last ``width - 1`` inputs there. vLLM's indices (block 0 is its null block, scratch that no
        request reads). Returns ``[T, dim]``."""
        packed = self._packed_weight(x)
        if packed is not None:
            self.native_calls += 1
            return self.native.prefill(
                x=dense_rows(x).t(),  # the op reads the transpose of a row-major [T, dim] tensor
                weight=packed,
                bias=self.conv1d.bias,
                conv_states=conv_state,
                query_start_loc=query_start_loc,
                cache_indices=dense_indices(indices),
                has_initial_state=has_initial_state,
                silu_activation=True,
                is_weight_packed=True,
            ).t()
        from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu

        return causal_conv1d_fn_cpu(
            x.t(),
            self.weight(),
            self.conv1d.bias,
            conv_state,
            query_start_loc,
            cache_indices=kda_slots(indices),
            has_initial_state=has_initial_state,
            activation="silu",
        ).t()

    def decode(self, x, conv_state, indices):
        """One token per row: ``x [N, dim]``, row n on slot ``indices[n]`` (vLLM's indices)."""
        state = conv_state[:, :, : self.width - 1]
        packed = self._packed_weight(x)
        if packed is not None:
            self.native_calls += 1
            return self.native.decode(
                x=dense_rows(x),
                conv_states=state,
                weight=packed,
                bias=self.conv1d.bias,
                silu_activation=True,
                conv_state_indices=dense_indices(indices),
                is_weight_packed=True,
            )
        from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

        return causal_conv1d_update_cpu(
            x, state, self.weight(), self.conv1d.bias, activation="silu", conv_state_indices=indices
        )

    def speculative(self, x, conv_state, query_start_loc, first_slots, accepted):
        """Speculative rows on the wide conv buffer (``L = width - 1 + S``): row n's context is the
        ``width - 1`` inputs from column ``accepted[n] - 1`` on; after it, the buffer holds its history
        from the second input on (so that the next step, having accepted a tokens, finds the inputs
        before its first token at a - 1). Rows on slot <= 0 (padding, the null block) are skipped."""
        width = self.width
        out = torch.empty_like(x)
        L = conv_state.shape[-1]
        # in float32, rounded once on the way out, as the torch prefill op computes
        w = self.weight().float().unsqueeze(1)
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        starts = query_start_loc.tolist()
        slots = first_slots.tolist()
        acc = accepted.tolist()
        for n, slot in enumerate(slots):
            bos, eos = starts[n], starts[n + 1]
            if eos == bos or slot <= 0:
                continue
            buf = conv_state[slot]
            seq = x[bos:eos].t().to(buf.dtype)
            offset = acc[n] - 1
            history = torch.cat([buf[:, offset : offset + width - 1], seq], dim=-1)
            y = torch.nn.functional.conv1d(history.unsqueeze(0).float(), w, bias, groups=seq.shape[0])[0]
            out[bos:eos] = torch.nn.functional.silu(y).t().to(out.dtype)
            kept = history[:, 1 : 1 + L]
            buf[:, : kept.shape[-1]].copy_(kept)
        return out
