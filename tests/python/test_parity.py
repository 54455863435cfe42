"""Every family's chunked and token-by-token functions (chunk_kda and fused_recurrent_kda for KDA,
chunk_gated_delta_rule and fused_recurrent_gated_delta_rule for the gated delta rule) against kda's
float64 oracle: outputs, final and per-chunk states and every gradient, over gate regimes, odd lengths,
varlen, GVA, both state layouts, fp32 and bf16 and every fused option. Each case runs for every family
it applies to (harness.family_cases); the gated delta rule's own cases are in test_gdn.py."""

import itertools

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
    family_cases,
    family_params,
    function_of,
    gate_parameter_magnitudes,
    gradients,
    make_inputs,
    rel_rms,
    run,
    sum_error,
    tolerance,
)
from kda._family import KDA

KINDS = ("chunk", "recurrent")
VARLEN_SETTINGS = (("mild", {}), ("spike", {}), ("unbounded", KIMI), ("strong", LOWER_BOUND))


def _grid():
    cases = []
    # GVA (HV = 2H), T not a multiple of the chunk, K != V: every gate setting in both dtypes, two shapes
    for T, V in ((150, 48), (100, 24)):
        for seed, ((regime, options), dtype) in enumerate(
            itertools.product(GATE_SETTINGS, (torch.float32, torch.bfloat16))
        ):
            cases.append(
                Case(B=2, T=T, H=2, HV=4, K=32, V=V, regime=regime, **options, dtype=dtype, seed=seed)
            )
    # varlen with an empty sequence and a one-token one, both layouts (the seeds the rows always had)
    for T, cu_seqlens, seed in ((200, [0, 1, 1, 65, 130, 200], 12), (150, [0, 1, 1, 65, 150], 8)):
        for (regime, options), state_v_first in itertools.product(VARLEN_SETTINGS, (False, True)):
            cases.append(
                Case(
                    T=T,
                    cu_seqlens=cu_seqlens,
                    H=1,
                    HV=2,
                    K=16,
                    V=24,
                    regime=regime,
                    **options,
                    state_v_first=state_v_first,
                    seed=seed,
                )
            )
            seed += 1
    cases += [
        Case(T=1, regime="unbounded", **KIMI),
        Case(T=1, B=3, regime="mild", state_v_first=True),
        Case(T=64, regime="strong"),
        Case(T=64, regime="strong", beta="sigmoid_x2"),
        Case(T=129, K=64, V=64, regime="spike", initial_state=False),
        Case(T=65, K=64, V=64, regime="zero", initial_state=False),
        Case(T=70, K=128, V=128, H=1, HV=1, regime="unbounded", **KIMI),
        Case(T=70, K=128, V=128, H=1, HV=1, regime="unbounded", **KIMI, dt_bias=False),
        Case(T=33, K=1, V=1, regime="mild"),
        Case(T=45, K=17, V=9, H=3, HV=6, regime="strong", **LOWER_BOUND, dtype=torch.bfloat16),
        Case(T=45, K=17, V=9, H=3, HV=6, regime="unbounded", **KIMI, dtype=torch.bfloat16),
        Case(T=80, regime="mild", scale=1.0),
        Case(T=80, regime="mild", scale=1.0, state_v_first=True),
        Case(T=80, regime="unbounded", **KIMI, scale=0.1, state_v_first=True),
    ]
    return cases


GRID = _grid()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family, case", family_cases(GRID))
def test_forward_matches_oracle(family, case, kind):
    function = function_of(family, kind)
    tensors, options = make_inputs(case)
    assert tensors["g"].shape == family.gate_shape(case.B, case.T, case.HV, case.K, case.V)
    with torch.no_grad():
        o, final, _ = run(function, tensors, options)
        o_ref, final_ref, _ = run(function, *as_oracle(tensors, options))
    assert o.dtype == (tensors["q"].dtype if kind == "chunk" else tensors["v"].dtype)
    assert final.dtype == torch.float32 and o_ref.dtype == torch.float64
    assert rel_rms(o, o_ref) <= tolerance("forward", o.dtype, "o")
    # States are fp32 whatever the activations: they meet the fp32 limit on the same (rounded) inputs.
    assert rel_rms(final, final_ref) <= tolerance("forward", final.dtype, "state")


# return_intermediate_states is chunk_kda's (fla's chunk_gated_delta_rule has no such argument).
@pytest.mark.parametrize("family, case", family_cases(GRID, families=(KDA,)))
def test_chunk_states_match_oracle(family, case):
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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family, case", family_cases(GRID))
def test_backward_matches_oracle(family, case, kind):
    function = function_of(family, kind)
    tensors, options = make_inputs(case)
    o, final, grads = gradients(function, tensors, options)
    o_ref, final_ref, grads_ref = gradients(function, *as_oracle(tensors, options), round_to=o.dtype)
    for name in ("q", "k", "v", "g", "beta"):
        assert grads[name].dtype == tensors[name].dtype and grads[name].shape == tensors[name].shape
        assert rel_rms(grads[name], grads_ref[name]) <= tolerance(
            "backward", grads[name].dtype, GRADIENT_OF[name]
        ), name
    if case.initial_state:
        assert rel_rms(grads["initial_state"], grads_ref["initial_state"]) <= tolerance(
            "backward", torch.float32, "dh0"
        )
    if "A_log" in options:
        mag_A, mag_bias = gate_parameter_magnitudes(grads_ref["g"], tensors, options)
        assert grads["A_log"].shape == (case.HV,)
        assert sum_error(grads["A_log"], grads_ref["A_log"], mag_A) <= tolerance(
            "backward", torch.float32, "dA_log"
        )
        if case.dt_bias:
            assert grads["dt_bias"].shape == (family.dt_bias_size(case.HV, case.K, case.V),)
            assert sum_error(grads["dt_bias"], grads_ref["dt_bias"], mag_bias) <= tolerance(
                "backward", torch.float32, "ddt_bias"
            )


@pytest.mark.parametrize(
    "family, case",
    family_cases(
        [
            Case(T=300, H=2, HV=2, K=64, V=64, regime="unbounded", **KIMI),
            Case(T=300, H=2, HV=2, K=64, V=64, regime="spike"),
        ]
    ),
)
def test_chunked_and_recurrent_agree(family, case):
    """The two kernels compute the same function: they agree to fp32 rounding."""
    tensors, options = make_inputs(case)
    with torch.no_grad():
        o_c, s_c, _ = run(family.chunk_function, tensors, options)
        o_r, s_r, _ = run(family.recurrent_function, tensors, options)
    # Each within the fp32 limit of the oracle, so within twice of each other.
    assert rel_rms(o_c, o_r) <= 2 * tolerance("forward", torch.float32, "o")
    assert rel_rms(s_c, s_r) <= 2 * tolerance("forward", torch.float32, "state")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "family, case", family_cases([Case(B=2, T=200, H=2, HV=4, K=32, V=32, regime="unbounded", **KIMI)])
)
def test_bitwise_identical_for_any_thread_count(family, case, kind):
    function = function_of(family, kind)
    tensors, options = make_inputs(case)
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


@pytest.mark.parametrize("family, case", family_cases([Case(T=50, regime="mild")]))
def test_float16_is_computed_in_float32_and_returned_in_float16(family, case):
    tensors, options = make_inputs(case)
    chunk = getattr(kda, family.chunk_function)
    half = {n: t.half() for n, t in tensors.items()}
    with torch.no_grad():
        o16, s16 = chunk(**half, output_final_state=True, **options)
        o32, s32 = chunk(**{n: t.float() for n, t in half.items()}, output_final_state=True, **options)
    assert o16.dtype == torch.float16 and s16.dtype == torch.float32
    assert torch.equal(o16, o32.half()) and torch.equal(s16, s32)
    o, _, grads = gradients(family.chunk_function, half, options)
    assert all(grads[n].dtype == torch.float16 for n in ("q", "k", "v", "g", "beta"))


@pytest.mark.parametrize("family, case", family_cases([Case(T=40, regime="unbounded", **KIMI)]))
def test_mixed_dtypes(family, case):
    """fla's convention: o takes q's dtype in the chunked function, v's in the recurrent one; g and beta
    may differ from q (a float32 gate next to bf16 activations is the usual Kimi layer)."""
    tensors, options = make_inputs(case)
    mixed = dict(tensors, q=tensors["q"].bfloat16(), k=tensors["k"].bfloat16(), v=tensors["v"].bfloat16())
    with torch.no_grad():
        o, _, _ = run(family.chunk_function, mixed, options)
        o_ref, _, _ = run(family.chunk_function, *as_oracle(mixed, options))
    assert o.dtype == torch.bfloat16 and rel_rms(o, o_ref) <= tolerance("forward", torch.bfloat16, "o")
    mixed_qk = dict(tensors, q=tensors["q"].bfloat16())  # q and k differ: both read in float32
    with torch.no_grad():
        o, _, _ = run(family.recurrent_function, mixed_qk, options)
        o_ref, _, _ = run(family.recurrent_function, *as_oracle(mixed_qk, options))
    assert o.dtype == torch.float32 and rel_rms(o, o_ref) <= tolerance("forward", torch.float32, "o")


@pytest.mark.parametrize(
    "family, case", family_cases([Case(B=2, T=70, H=2, HV=2, K=16, V=16, regime="mild")])
)
def test_strided_inputs_are_read_in_place(family, case):
    """q, k, v as column slices of one fused projection (B, T and head strides free) give the same result
    as contiguous copies, and an empty sequence (T = 0) is a valid call."""
    tensors, options = make_inputs(case)
    fused = torch.cat([tensors["q"], tensors["k"], tensors["v"]], dim=-1)  # [B, T, H, 3K]
    views = dict(tensors, q=fused[..., :16], k=fused[..., 16:32], v=fused[..., 32:])
    assert not views["q"].is_contiguous()
    with torch.no_grad():
        o_view, s_view, _ = run(family.chunk_function, views, options)
        o, s, _ = run(family.chunk_function, tensors, options)
    assert torch.equal(o_view, o) and torch.equal(s_view, s)
    empty = {n: t[:, :0] for n, t in tensors.items()}
    o0, s0 = getattr(kda, family.chunk_function)(**empty, output_final_state=True, **options)
    assert o0.shape == (2, 0, 2, 16) and torch.equal(s0, options["initial_state"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family, case", family_cases([Case(B=2, T=3, H=1, HV=2, K=8, V=8, regime="mild")]))
def test_an_empty_sequence_has_gradients(family, case, kind):
    """T = 0 through loss.backward(): o.sum()'s gradient is an expanded empty tensor (strides 0, which
    torch calls contiguous), read as it is; the initial state's gradient is the final state's."""
    tensors, options = make_inputs(case)
    empty = {n: t[:, :0].detach().requires_grad_() for n, t in tensors.items()}
    h0 = options.pop("initial_state").detach().requires_grad_()
    f = getattr(kda, function_of(family, kind))
    o, final = f(**empty, initial_state=h0, output_final_state=True, **options)
    (o.sum() + 3 * final.sum()).backward()
    assert torch.equal(h0.grad, torch.full_like(h0, 3.0))
    assert all(t.grad is not None and t.grad.shape == t.shape for t in empty.values())


@pytest.mark.parametrize("family, case", family_cases([Case(T=130, regime="unbounded", **KIMI)]))
def test_no_nan_from_extreme_finite_inputs(family, case):
    """A_log = 30 (decays of -1e13), raw gates of 1e30, huge logits: every output and gradient finite."""
    tensors, options = make_inputs(case)
    tensors["g"] = tensors["g"] * 1e30
    tensors["beta"] = tensors["beta"] * 1e30
    options["A_log"] = torch.full_like(options["A_log"], 30.0)
    for kind in KINDS:
        o, final, grads = gradients(function_of(family, kind), tensors, options)
        assert torch.isfinite(o).all() and torch.isfinite(final).all()
        assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", family_params())
def test_decays_of_minus_1e4_and_huge_gates_stay_exact(family, kind):
    """-1e4 log decays on single tokens (the state is wiped there; every key channel of a KDA gate) and
    the unbounded softplus gate with exp(A_log) up to ~150 on a wide raw gate."""
    function = function_of(family, kind)
    tensors, options = make_inputs(
        Case(B=2, T=130, H=2, HV=2, K=32, V=32, regime="mild", gate_width=family.gate_width, seed=11)
    )
    g = tensors["g"].clone()
    g[0, 7, 1] = g[1, 64, 0] = g[1, 100, 1] = -1e4
    for t, opts in (
        (dict(tensors, g=g), options),
        make_inputs(Case(T=130, regime="unbounded", **KIMI, gate_width=family.gate_width)),
    ):
        o, final, grads = gradients(function, t, opts)
        o_ref, final_ref, grads_ref = gradients(function, *as_oracle(t, opts))
        assert rel_rms(o, o_ref) <= tolerance("forward", torch.float32, "o")
        assert rel_rms(final, final_ref) <= tolerance("forward", torch.float32, "state")
        for name in ("q", "k", "v", "g", "beta"):
            assert rel_rms(grads[name], grads_ref[name]) <= tolerance(
                "backward", torch.float32, GRADIENT_OF[name]
            )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "family, case",
    family_cases([Case(B=1, T=40, H=2, HV=2, K=8, V=8, dtype=torch.float64, regime="strong")]),
)
def test_float64_takes_the_scale_as_given(family, case, kind):
    """The float64 path computes in double all through: a scale that float cannot hold (the default
    K^-0.5 at K = 8, or 0.1) is not rounded to float on the way (it was, 1.5e-8 to 3e-8 off)."""
    tensors, options = make_inputs(case)
    f = getattr(kda, function_of(family, kind))
    for scale in (None, 0.1, 1 / 3):
        o, s = f(**tensors, **dict(options, scale=scale), output_final_state=True)
        exact = case.K**-0.5 if scale is None else scale
        o_ref, s_ref = f(
            **dict(tensors, q=tensors["q"] * exact), **dict(options, scale=1.0), output_final_state=True
        )
        assert rel_rms(o, o_ref) < 1e-14 and torch.equal(s, s_ref)
