"""kda.chunk_kda and kda.fused_recurrent_kda against kda's float64 oracle: outputs, final and per-chunk
states and every gradient, over gate regimes, odd lengths, varlen, GVA, both state layouts, fp32 and
bf16 and every fused option."""

import kda
import pytest
import torch
from harness import (
    GATE_SETTINGS,
    GRADIENT_OF,
    KIMI,
    LOWER_BOUND,
    Case,
    as_oracle,
    gate_parameter_magnitudes,
    gradients,
    make_inputs,
    rel_rms,
    run,
    sum_error,
    tolerance,
)

FUNCTIONS = ("chunk_kda", "fused_recurrent_kda")


def _grid():
    cases = []
    for regime, options in GATE_SETTINGS:
        for dtype in (torch.float32, torch.bfloat16):
            # GVA (HV = 2H), T not a multiple of the chunk, K != V
            cases.append(
                Case(
                    B=2, T=150, H=2, HV=4, K=32, V=48, regime=regime, **options, dtype=dtype, seed=len(cases)
                )
            )
    for regime, options in (("mild", {}), ("spike", {}), ("unbounded", KIMI), ("strong", LOWER_BOUND)):
        for state_v_first in (False, True):
            # varlen with an empty sequence and a one-token one, both layouts
            cases.append(
                Case(
                    T=200,
                    cu_seqlens=[0, 1, 1, 65, 130, 200],
                    H=1,
                    HV=2,
                    K=16,
                    V=24,
                    regime=regime,
                    **options,
                    state_v_first=state_v_first,
                    seed=len(cases),
                )
            )
    cases += [
        Case(T=1, regime="unbounded", **KIMI),
        Case(T=1, B=3, regime="mild", state_v_first=True),
        Case(T=64, regime="strong"),
        Case(T=129, K=64, V=64, regime="spike", initial_state=False),
        Case(T=70, K=128, V=128, H=1, HV=1, regime="unbounded", **KIMI),
        Case(T=33, K=1, V=1, regime="mild"),
        Case(T=45, K=17, V=9, H=3, HV=6, regime="strong", **LOWER_BOUND, dtype=torch.bfloat16),
        Case(T=80, regime="mild", scale=1.0),
        Case(T=80, regime="unbounded", **KIMI, scale=0.1, state_v_first=True),
    ]
    return cases


GRID = _grid()


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("case", GRID, ids=str)
def test_forward_matches_oracle(function, case):
    tensors, options = make_inputs(case)
    with torch.no_grad():
        o, final, _ = run(function, tensors, options)
        o_ref, final_ref, _ = run(function, *as_oracle(tensors, options))
    assert o.dtype == (tensors["q"].dtype if function == "chunk_kda" else tensors["v"].dtype)
    assert final.dtype == torch.float32 and o_ref.dtype == torch.float64
    assert rel_rms(o, o_ref) <= tolerance("forward", o.dtype, "o")
    # States are fp32 whatever the activations: they meet the fp32 limit on the same (rounded) inputs.
    assert rel_rms(final, final_ref) <= tolerance("forward", final.dtype, "state")


@pytest.mark.parametrize("case", GRID[::3], ids=str)
def test_chunk_states_match_oracle(case):
    tensors, options = make_inputs(case)
    with torch.inference_mode():
        o, final, h = kda.chunk_kda(
            **tensors, output_final_state=True, return_intermediate_states=True, **options
        )
        o_ref, final_ref, h_ref = kda.chunk_kda(
            **as_oracle(tensors, options)[0],
            output_final_state=True,
            return_intermediate_states=True,
            **as_oracle(tensors, options)[1],
        )
    n_chunks = (
        sum((e - s + 63) // 64 for s, e in zip(case.cu_seqlens[:-1], case.cu_seqlens[1:], strict=True))
        if case.cu_seqlens
        else (case.T + 63) // 64
    )
    state = (case.V, case.K) if case.state_v_first else (case.K, case.V)
    assert h.shape == (case.B, n_chunks, case.HV, *state)
    assert h.dtype == tensors["k"].dtype
    assert rel_rms(h, h_ref) <= tolerance("forward", h.dtype, "state")


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("case", GRID, ids=str)
def test_backward_matches_oracle(function, case):
    tensors, options = make_inputs(case)
    o, final, grads = gradients(function, tensors, options)
    o_ref, final_ref, grads_ref = gradients(function, *as_oracle(tensors, options), round_to=o.dtype)
    for name in ("q", "k", "v", "g", "beta"):
        assert grads[name].dtype == tensors[name].dtype
        assert rel_rms(grads[name], grads_ref[name]) <= tolerance(
            "backward", grads[name].dtype, GRADIENT_OF[name]
        ), name
    if case.initial_state:
        assert rel_rms(grads["initial_state"], grads_ref["initial_state"]) <= tolerance(
            "backward", torch.float32, "dh0"
        )
    if "A_log" in options:
        mag_A, mag_bias = gate_parameter_magnitudes(grads_ref["g"], tensors, options)
        assert sum_error(grads["A_log"], grads_ref["A_log"], mag_A) <= tolerance(
            "backward", torch.float32, "dA_log"
        )
        assert sum_error(grads["dt_bias"], grads_ref["dt_bias"], mag_bias) <= tolerance(
            "backward", torch.float32, "ddt_bias"
        )


@pytest.mark.parametrize(
    "case",
    [
        Case(T=300, H=2, HV=2, K=64, V=64, regime="unbounded", **KIMI),
        Case(T=300, H=2, HV=2, K=64, V=64, regime="spike"),
    ],
    ids=str,
)
def test_chunked_and_recurrent_agree(case):
    """The two kernels compute the same function: they agree to fp32 rounding."""
    tensors, options = make_inputs(case)
    with torch.no_grad():
        o_c, s_c, _ = run("chunk_kda", tensors, options)
        o_r, s_r, _ = run("fused_recurrent_kda", tensors, options)
    # Each within the fp32 limit of the oracle, so within twice of each other.
    assert rel_rms(o_c, o_r) <= 2 * tolerance("forward", torch.float32, "o")
    assert rel_rms(s_c, s_r) <= 2 * tolerance("forward", torch.float32, "state")


@pytest.mark.parametrize("function", FUNCTIONS)
def test_bitwise_identical_for_any_thread_count(function):
    tensors, options = make_inputs(Case(B=2, T=200, H=2, HV=4, K=32, V=32, regime="unbounded", **KIMI))
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(gradients(function, tensors, options))
    finally:
        torch.set_num_threads(saved)
    first = results[0]
    for other in results[1:]:
        assert torch.equal(first[0], other[0]) and torch.equal(first[1], other[1])
        for name, grad in first[2].items():
            assert torch.equal(grad, other[2][name]), name


def test_float16_is_computed_in_float32_and_returned_in_float16():
    tensors, options = make_inputs(Case(T=50, regime="mild"))
    half = {n: t.half() for n, t in tensors.items()}
    with torch.no_grad():
        o16, s16 = kda.chunk_kda(**half, output_final_state=True, **options)
        o32, s32 = kda.chunk_kda(
            **{n: t.float() for n, t in half.items()}, output_final_state=True, **options
        )
    assert o16.dtype == torch.float16 and s16.dtype == torch.float32
    assert torch.equal(o16, o32.half()) and torch.equal(s16, s32)
    o, _, grads = gradients("chunk_kda", half, options)
    assert all(grads[n].dtype == torch.float16 for n in ("q", "k", "v", "g", "beta"))


def test_mixed_dtypes():
    """fla's convention: o takes q's dtype in chunk_kda, v's in fused_recurrent_kda; g and beta may
    differ from q (a float32 gate next to bf16 activations is the usual Kimi layer)."""
    tensors, options = make_inputs(Case(T=40, regime="unbounded", **KIMI))
    mixed = dict(tensors, q=tensors["q"].bfloat16(), k=tensors["k"].bfloat16(), v=tensors["v"].bfloat16())
    with torch.no_grad():
        o, _, _ = run("chunk_kda", mixed, options)
        o_ref, _, _ = run("chunk_kda", *as_oracle(mixed, options))
    assert o.dtype == torch.bfloat16 and rel_rms(o, o_ref) <= tolerance("forward", torch.bfloat16, "o")
    mixed_qk = dict(tensors, q=tensors["q"].bfloat16())  # q and k differ: both read in float32
    with torch.no_grad():
        o, _, _ = run("fused_recurrent_kda", mixed_qk, options)
        o_ref, _, _ = run("fused_recurrent_kda", *as_oracle(mixed_qk, options))
    assert o.dtype == torch.float32 and rel_rms(o, o_ref) <= tolerance("forward", torch.float32, "o")


def test_strided_inputs_are_read_in_place():
    """q, k, v as column slices of one fused projection (B, T and head strides free) give the same result
    as contiguous copies, and an empty sequence (T = 0) is a valid call."""
    case = Case(B=2, T=70, H=2, HV=2, K=16, V=16, regime="mild")
    tensors, options = make_inputs(case)
    fused = torch.cat([tensors["q"], tensors["k"], tensors["v"]], dim=-1)  # [B, T, H, 3K]
    views = dict(tensors, q=fused[..., :16], k=fused[..., 16:32], v=fused[..., 32:])
    assert not views["q"].is_contiguous()
    with torch.no_grad():
        o_view, s_view, _ = run("chunk_kda", views, options)
        o, s, _ = run("chunk_kda", tensors, options)
    assert torch.equal(o_view, o) and torch.equal(s_view, s)
    empty = {n: t[:, :0] for n, t in tensors.items()}
    o0, s0 = kda.chunk_kda(**empty, output_final_state=True, **options)
    assert o0.shape == (2, 0, 2, 16) and torch.equal(s0, options["initial_state"])


def test_no_nan_from_extreme_finite_inputs():
    """A_log = 30 (decays of -1e13), raw gates of 1e30, huge logits: every output and gradient finite."""
    case = Case(T=130, regime="unbounded", **KIMI)
    tensors, options = make_inputs(case)
    tensors["g"] = tensors["g"] * 1e30
    tensors["beta"] = tensors["beta"] * 1e30
    options["A_log"] = torch.full_like(options["A_log"], 30.0)
    for function in FUNCTIONS:
        o, final, grads = gradients(function, tensors, options)
        assert torch.isfinite(o).all() and torch.isfinite(final).all()
        assert all(torch.isfinite(g).all() for g in grads.values())
