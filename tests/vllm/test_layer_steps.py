"""The KDA layer's step (kda.vllm.layer.serve_step) on the tensors vLLM 0.32.0 builds, without an engine.

vLLM's C++ short-convolution ops check their arguments' strides, and the tensors vLLM hands the layer
are views: the q/k/v part is a column slice of the fused input projection, and with speculative
decoding configured a step with no speculative rows gets ``block_table[:, 0]`` (stride 1 + S) as its
state indices. Those ops run only on CPUs with AVX-512 BF16 (or Arm BF16), so these tests hand the
layer a stand-in that checks the same layouts the C++ ops check (and then computes with the real ops
where the CPU has them, else with vLLM's torch ops): the layouts are tested on every CPU.

Each case compares the layer's output and state slots with the same step on vLLM's torch-level ops
(``native=None``), which take any strides, and checks that no other slot was written.
"""

import os
import sys
from types import SimpleNamespace

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.importorskip("vllm")

from kda.vllm import conv  # noqa: E402
from kda.vllm.layer import check_served, serve_step  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402

H, D = 2, 32  # heads and head dim of the tiny checkpoint (tiny_kimi.py)
DIM = 3 * H * D  # the q/k/v channels of the short convolution
WIDE = DIM + H + D  # the fused projection's width: q/k/v, beta, f_a (vLLM's split, no full-rank gate)
SLOTS = 8


class CheckingOps:
    """vLLM's C++ short-convolution ops as the layer calls them, with the checks those ops make."""

    def __init__(self):
        self.real = conv.native_ops()
        self.calls = []

    def pack(self, weight):
        assert weight.dtype == torch.bfloat16 and weight.is_contiguous()
        return self.real.pack(weight) if self.real else weight

    def prefill(self, *, x, cache_indices, **kw):
        # causal_conv1d_fwd_cpu: "expect x to be transposed.", "tensor must be contiguous"
        assert x.stride() == (1, x.shape[0]), f"prefill x strides {x.stride()}: not a transposed [T, dim]"
        assert cache_indices.is_contiguous(), f"prefill cache_indices strides {cache_indices.stride()}"
        self.calls.append("prefill")
        if self.real:
            return self.real.prefill(x=x, cache_indices=cache_indices, **kw)
        from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu

        return causal_conv1d_fn_cpu(
            x,
            kw["weight"].float(),
            kw["bias"],
            kw["conv_states"],
            kw["query_start_loc"],
            cache_indices=conv.kda_slots(cache_indices),
            has_initial_state=kw["has_initial_state"],
            activation="silu",
        )

    def decode(self, *, x, conv_state_indices, **kw):
        # causal_conv1d_update_cpu: "x must be contiguous", "tensor must be contiguous"
        assert x.is_contiguous(), f"decode x strides {x.stride()}"
        assert conv_state_indices.is_contiguous(), f"decode indices strides {conv_state_indices.stride()}"
        self.calls.append("decode")
        if self.real:
            return self.real.decode(x=x, conv_state_indices=conv_state_indices, **kw)
        from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

        return causal_conv1d_update_cpu(
            x, kw["conv_states"], kw["weight"].float(), kw["bias"], "silu", conv_state_indices
        )


def make_layer(native, pool_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    conv1d = SimpleNamespace(weight=torch.randn(DIM, 1, 4, generator=gen) * 0.5, bias=None)
    # vLLM's default conv-state layout (SD): [slots, width - 1 + S, dim]; the layer reads it transposed
    conv_state = torch.randn(SLOTS, 3, DIM, generator=gen).to(torch.bfloat16)
    pool = (torch.randn(SLOTS, H, D, D, generator=gen) * 0.1).to(pool_dtype)
    return SimpleNamespace(
        kv_cache=(conv_state, pool),
        short_conv=conv.ShortConvolution(conv1d, native),
        head_dim=D,
        local_projection_size=H * D,
        kda_options=dict(
            A_log=torch.randn(H, generator=gen),
            dt_bias=torch.randn(H * D, generator=gen) * 0.5,
            lower_bound=None,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
        ),
    )


def step_inputs(T, seed=1):
    """mixed_qkv, g1 and beta as vLLM's layer passes them: slices of the fused projection."""
    gen = torch.Generator().manual_seed(seed)
    projected = torch.randn(T, WIDE, generator=gen).to(torch.bfloat16)
    mixed_qkv, beta, _ = projected.split([DIM, H, D], dim=-1)
    g1 = torch.randn(1, T, H, D, generator=gen).to(torch.bfloat16)
    return mixed_qkv, g1, beta.unsqueeze(0)


def prefill_metadata(lengths, indices, has_initial_state):
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return GDNAttentionMetadata(
        num_prefills=len(lengths),
        num_prefill_tokens=sum(lengths),
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=sum(lengths),
        has_initial_state=torch.tensor(has_initial_state),
        non_spec_query_start_loc=qsl,
        non_spec_state_indices_tensor=indices,
    )


def decode_metadata(indices):
    N = indices.shape[0]
    return GDNAttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=N,
        num_decode_tokens=N,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=N,
        non_spec_query_start_loc=torch.arange(N + 1, dtype=torch.int32),
        non_spec_state_indices_tensor=indices,
    )


def run_step(native, m, T, pool_dtype):
    layer = make_layer(native, pool_dtype)
    before = [t.clone() for t in layer.kv_cache]
    mixed_qkv, g1, beta = step_inputs(T)
    out = torch.zeros(1, T, H, D, dtype=torch.bfloat16)
    serve_step(layer, m, mixed_qkv, g1, beta, out)
    return out, before, layer.kv_cache


def assert_same_step(m, T, used_slots, pool_dtype=torch.float32):
    ops = CheckingOps()
    out, before, after = run_step(ops, m, T, pool_dtype)
    assert ops.calls, "the layer did not take vLLM's C++ convolution path"
    ref_out, _, ref_after = run_step(None, m, T, pool_dtype)
    assert torch.isfinite(out.float()).all()
    # the C++ ops round the conv weight to bf16 (the torch ops keep it in float32): bf16-sized differences
    torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=3e-2)
    for got, ref, old in zip(after, ref_after, before, strict=True):
        torch.testing.assert_close(got[used_slots].float(), ref[used_slots].float(), atol=3e-2, rtol=3e-2)
        others = [s for s in range(SLOTS) if s not in used_slots]
        assert torch.equal(got[others], old[others]), "a slot no row uses was written"


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_lone_one_token_prompt(pool_dtype):
    """A one-token prompt alone in its step: its q/k/v row is a [1, DIM] slice of the [1, WIDE]
    projection (row stride WIDE), which torch's .contiguous() leaves as it is; the C++ prefill op
    needs row stride DIM ("expect x to be transposed": the server died on `"prompt": "the"`)."""
    block_table = torch.tensor([[5]], dtype=torch.int32)
    m = prefill_metadata([1], block_table[:, 0], [False])
    assert_same_step(m, 1, [5], pool_dtype)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_two_prefills_with_speculation_configured(pool_dtype):
    """Speculative decoding configured (block table [N, 1 + S]) and a step with no speculative rows:
    vLLM's builder passes block_table[:, 0] (stride 1 + S) as the state indices, which the C++ op
    refuses ("tensor must be contiguous"). Lengths 1 and 3, one of them resuming its state."""
    block_table = torch.tensor([[3, 4, 6], [2, 7, 1]], dtype=torch.int32)  # S = 2
    indices = block_table[:, 0]
    assert not indices.is_contiguous()
    m = prefill_metadata([1, 3], indices, [True, False])
    assert_same_step(m, 4, [3, 2], pool_dtype)


def test_lone_decode_row_and_strided_indices():
    """Decode rows: a [1, DIM] slice (one request), then two rows with strided indices."""
    block_table = torch.tensor([[6, 1, 2], [4, 3, 5]], dtype=torch.int32)
    assert_same_step(decode_metadata(block_table[:1, 0]), 1, [6])
    assert_same_step(decode_metadata(block_table[:, 0]), 2, [6, 4])


def test_dense_helpers_copy_only_where_needed():
    wide = torch.zeros(4, 10)
    rows = wide[:1, :6]
    assert rows.is_contiguous() and rows.stride() == (10, 1)  # why .contiguous() is not enough
    assert conv.dense_rows(rows).stride() == (6, 1)
    dense = torch.zeros(3, 6)
    assert conv.dense_rows(dense) is dense
    table = torch.arange(6).view(2, 3)
    assert conv.dense_indices(table[:, 0]).is_contiguous()
    row = table[0]
    assert conv.dense_indices(row) is row


def test_check_served_names_the_layer_and_the_limit():
    options = make_layer(None, torch.float32).kda_options
    check_served(H, D, "model.layers.0.self_attn", options)  # the tiny checkpoint's shapes: served
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn \(2 heads of dimension 512\).*256"):
        check_served(H, 512, "model.layers.0.self_attn", options)
