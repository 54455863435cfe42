"""Bad input gets a clear error of the right type (fla's own type where fla checks the same thing), and
nothing else: no crash, no change to any input."""

import warnings

import kda
import pytest
import torch
from harness import KIMI, Case, make_inputs

FUNCTIONS = ("chunk_kda", "fused_recurrent_kda")


def _inputs(**case):
    return make_inputs(Case(**{"T": 20, "K": 8, "V": 8, **case}))


def _call(function, tensors, options, **overrides):
    args = dict(tensors)
    kwargs = dict(options, **overrides)
    for name in ("q", "k", "v", "g", "beta"):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    return getattr(kda, function)(**args, output_final_state=True, **kwargs)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_unknown_keyword_is_a_type_error_naming_it(function):
    tensors, options = _inputs()
    with pytest.raises(TypeError, match="'chunk_sizes'"):
        _call(function, tensors, options, chunk_sizes=64)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_transpose_state_layout_is_the_deprecated_alias(function):
    tensors, options = _inputs(state_v_first=True)
    options = dict(options)
    del options["state_v_first"]
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        o, s = _call(function, tensors, options, transpose_state_layout=True)
    o_ref, s_ref = _call(function, tensors, options, state_v_first=True)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    with pytest.raises(ValueError, match="transpose_state_layout"):
        _call(function, tensors, options, state_v_first=True, transpose_state_layout=True)


def test_options_the_engine_cannot_honour_are_not_implemented():
    tensors, options = _inputs()
    with pytest.raises(TypeError, match="'cp_context'"):  # kda.cp's contexts only (test_cp.py)
        _call("chunk_kda", tensors, options, cp_context=object())
    headwise = torch.rand(1, 20, 2, 8)
    for function in FUNCTIONS:
        with pytest.raises(NotImplementedError, match="headwise"):
            _call(function, tensors, options, beta=headwise)
    with torch.inference_mode(), pytest.raises(NotImplementedError, match="64"):
        _call("chunk_kda", tensors, options, return_intermediate_states=True, chunk_size=32)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_tensors_on_another_device_say_kda_computes_on_the_cpu(function):
    tensors, options = _inputs()
    for name in ("q", "g", "beta"):
        moved = dict(tensors, **{name: tensors[name].to("meta")})
        with pytest.raises(NotImplementedError, match=f"CPU.*'{name}' is on meta"):
            _call(function, moved, options)
    with pytest.raises(NotImplementedError, match="'initial_state' is on meta"):
        _call(function, tensors, options, initial_state=options["initial_state"].to("meta"))


@pytest.mark.parametrize("function", FUNCTIONS)
def test_fla_shape_checks(function):
    tensors, options = _inputs(H=2, HV=4)
    B, T = 1, 20
    with pytest.raises(AssertionError, match="q and k must have the same shape"):
        _call(function, tensors, options, k=torch.randn(B, T, 2, 4))
    with pytest.raises(AssertionError, match="key headdim <=256"):
        big = torch.randn(B, T, 2, 257)
        _call(function, tensors, options, q=big, k=big, g=torch.randn(B, T, 4, 257))
    with pytest.raises(NotImplementedError, match="V=300"):
        _call(function, tensors, options, v=torch.randn(B, T, 4, 300))
    with pytest.raises(AssertionError, match="divisible"):
        _call(
            function,
            tensors,
            options,
            v=torch.randn(B, T, 3, 8),
            g=torch.randn(B, T, 3, 8),
            beta=torch.rand(B, T, 3),
        )
    with pytest.raises(AssertionError, match="g must have shape"):
        _call(function, tensors, options, g=torch.randn(B, T, 4, 7))
    with pytest.raises(AssertionError, match="beta must have shape"):
        _call(function, tensors, options, beta=torch.rand(B, T, 2))
    with pytest.raises(ValueError, match="'q' must be a 4-D tensor"):
        _call(function, tensors, options, q=torch.randn(T, 2, 8))
    with pytest.raises(ValueError, match="v must have shape"):
        _call(function, tensors, options, v=torch.randn(B, T + 1, 4, 8))


@pytest.mark.parametrize("function", FUNCTIONS)
def test_fla_option_checks(function):
    tensors, options = _inputs()
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        _call(function, tensors, options, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="A_log"):
        _call(function, tensors, options, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="lower_bound must be a finite number < 0"):
        _call(function, tensors, options, use_gate_in_kernel=True, lower_bound=0.5)
    # numbers of the wrong kind name themselves (float("x") said only "could not convert string")
    for kwargs in (dict(scale="half"), dict(scale=[0.5])):
        with pytest.raises(TypeError, match="scale must be a number"):
            _call(function, tensors, options, **kwargs)
    with pytest.raises(TypeError, match="lower_bound must be a number, got str"):
        _call(function, tensors, options, use_gate_in_kernel=True, lower_bound="low")


def test_chunk_kda_specific_checks():
    tensors, options = _inputs()
    with pytest.raises(AssertionError, match="initial_state must be in float32"):
        _call("chunk_kda", tensors, options, initial_state=options["initial_state"].double())
    with pytest.raises(ValueError, match="chunk_size"):
        _call("chunk_kda", tensors, options, chunk_size=16)
    gate = dict(use_gate_in_kernel=True, A_log=torch.zeros(2))
    with pytest.raises(ValueError, match="`lower_bound` must be specified"):
        _call("chunk_kda", tensors, options, safe_gate=True, **gate)
    with pytest.raises(ValueError, match="safe range"):
        _call("chunk_kda", tensors, options, safe_gate=True, lower_bound=-6.0, **gate)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        _call("chunk_kda", tensors, options, cu_seqlens_cpu=torch.tensor([0, 20]))
    grad = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    with pytest.raises(AssertionError, match="return_intermediate_states"):
        _call("chunk_kda", grad, options, return_intermediate_states=True)


def test_recurrent_reads_other_state_dtypes_as_float32():
    tensors, options = _inputs()
    o, s = _call("fused_recurrent_kda", tensors, options, initial_state=options["initial_state"].bfloat16())
    o_ref, s_ref = _call(
        "fused_recurrent_kda", tensors, options, initial_state=options["initial_state"].bfloat16().float()
    )
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_varlen_errors(function):
    tensors, options = _inputs(T=30, cu_seqlens=[0, 10, 30])
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        _call(function, {n: t.expand(2, *t.shape[1:]) for n, t in tensors.items()}, options)
    with pytest.raises(ValueError, match="number of initial states"):
        _call(function, tensors, options, initial_state=options["initial_state"][:1])
    bad = {
        "non-decreasing": [0, 20, 10, 30],
        "last offset": [0, 10, 29],
        r"cu_seqlens\[0\] == 0": [1, 10, 30],
    }
    for message, offsets in bad.items():
        h0 = torch.zeros(len(offsets) - 1, *options["initial_state"].shape[1:])
        with pytest.raises(ValueError, match=f"'cu_seqlens'.*{message}"):
            _call(function, tensors, options, cu_seqlens=torch.tensor(offsets), initial_state=h0)
    with pytest.raises(TypeError, match="int32 or int64"):
        _call(function, tensors, options, cu_seqlens=torch.tensor([0.0, 10.0, 30.0]))
    o32, _ = _call(function, tensors, options, cu_seqlens=torch.tensor([0, 10, 30], dtype=torch.int32))
    o64, _ = _call(function, tensors, options)
    assert torch.equal(o32, o64)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_side_tensor_shapes_are_named(function):
    tensors, options = _inputs(regime="unbounded", **KIMI)
    with pytest.raises(ValueError, match="'initial_state': expected shape"):
        _call(function, tensors, options, initial_state=torch.zeros(1, 2, 8, 9))
    with pytest.raises(ValueError, match="'A_log': expected 2 elements"):
        _call(function, tensors, options, A_log=torch.zeros(3))
    with pytest.raises(ValueError, match="'dt_bias': expected 16 elements"):
        _call(function, tensors, options, dt_bias=torch.zeros(15))
    with pytest.raises(TypeError, match="'q' must be a floating-point tensor"):
        _call(function, tensors, options, q=torch.ones(1, 20, 2, 8, dtype=torch.int32))


@pytest.mark.parametrize("function", ("fused_recurrent_kda", "fused_recurrent_gated_delta_rule"))
def test_side_tensors_of_integers_or_complex_numbers_are_type_errors(function):
    """A cast would drop their fractions or imaginary parts (another float dtype is read as float32)."""
    per_head = function == "fused_recurrent_gated_delta_rule"
    tensors, options = _inputs(regime="unbounded", **KIMI, gate_width="per_head" if per_head else "per_key")
    h0 = options["initial_state"]
    for name, bad in (
        ("initial_state", h0.to(torch.int32)),
        ("initial_state", h0.to(torch.complex64)),
        ("A_log", options["A_log"].to(torch.int64)),
        ("dt_bias", options["dt_bias"].to(torch.complex64)),
    ):
        with pytest.raises(TypeError, match=f"'{name}' must be a floating-point tensor, got {bad.dtype}"):
            _call(function, tensors, options, **{name: bad})
    for name in ("A_log", "dt_bias"):
        bad = options[name].to(torch.int32)
        with torch.inference_mode(), pytest.raises(TypeError, match=f"'{name}' must be a floating-point"):
            decode = kda.serving.fused_recurrent_gdn_fwd if per_head else kda.serving.fused_recurrent_kda_fwd
            decode(**tensors, **dict(options, **{name: bad}), inplace_final_state=False)


def test_unused_gate_arguments_are_not_silently_ignored():
    tensors, options = _inputs()
    with pytest.warns(UserWarning, match="A_log and dt_bias are only used with use_gate_in_kernel"):
        _call("fused_recurrent_kda", tensors, options, A_log=torch.zeros(2))
    with pytest.warns(UserWarning, match="A_log and dt_bias are only used"):
        _call("chunk_kda", tensors, options, dt_bias=torch.zeros(16))
    with pytest.warns(UserWarning, match="lower_bound is only used"):
        _call("chunk_kda", tensors, options, lower_bound=-5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call("chunk_kda", tensors, options, lower_bound=-5.0, safe_gate=True)  # fla's bounded-gate hint


def test_unused_gate_arguments_warn_at_the_callers_line_in_both_families():
    """A_log without use_gate_in_kernel is not applied: a UserWarning pointing at the caller's line, from
    KDA's and the gated delta rule's functions and serving entries alike (gk's route included)."""
    gdn, _ = make_inputs(Case(T=10, H=1, HV=2, K=8, V=8, gate_width="per_head"))
    kda_tensors, _ = make_inputs(Case(T=10, H=1, HV=2, K=8, V=8))
    no_g = {n: t for n, t in gdn.items() if n != "g"}
    A_log = torch.zeros(2)
    calls = {
        "chunk_kda": lambda: kda.chunk_kda(**kda_tensors, A_log=A_log),
        "fused_recurrent_kda": lambda: kda.fused_recurrent_kda(**kda_tensors, A_log=A_log),
        "fused_recurrent_kda_fwd": lambda: kda.fused_recurrent_kda_fwd(**kda_tensors, A_log=A_log),
        "chunk_gated_delta_rule": lambda: kda.chunk_gated_delta_rule(**gdn, A_log=A_log),
        "fused_recurrent_gated_delta_rule": lambda: kda.fused_recurrent_gated_delta_rule(**gdn, A_log=A_log),
        "gk": lambda: kda.fused_recurrent_gated_delta_rule(**no_g, gk=kda_tensors["g"], A_log=A_log),
        "fused_recurrent_gdn_fwd": lambda: kda.fused_recurrent_gdn_fwd(**gdn, A_log=A_log),
    }
    for name, call in calls.items():
        with torch.no_grad(), warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            call()
        unused = [w for w in record if "only used with use_gate_in_kernel=True" in str(w.message)]
        assert len(unused) == 1 and unused[0].category is UserWarning, name
        assert unused[0].filename == __file__, (name, unused[0].filename)


def test_a_rejected_call_changes_no_input():
    tensors, options = _inputs(regime="unbounded", **KIMI)
    before = {
        n: t.clone()
        for n, t in {**tensors, **{k: v for k, v in options.items() if torch.is_tensor(v)}}.items()
    }
    with pytest.raises(ValueError):
        _call("chunk_kda", tensors, options, dt_bias=torch.zeros(15))
    after = {**tensors, **{k: v for k, v in options.items() if torch.is_tensor(v)}}
    for n, t in before.items():
        assert torch.equal(t, after[n]), n


def test_gate_helper_errors():
    g = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="needs A_log"):
        kda.fused_kda_gate(g)
    with pytest.raises(ValueError, match="A_log must have HV = 4"):
        kda.fused_kda_gate(g, torch.zeros(3))
    with pytest.raises(ValueError, match="dt_bias must have HV"):
        kda.fused_kda_gate(g, torch.zeros(4), torch.zeros(31))
    with pytest.raises(ValueError, match=r"\[..., HV, K\]"):
        kda.fused_kda_gate(torch.randn(8), torch.zeros(4))
    # arguments of the wrong kind: errors naming them, as chunk_kda's (they were AttributeErrors, or a
    # positive or NaN lower_bound computed a gate that grows)
    bad = [
        (TypeError, "'g' must be a tensor, got NoneType", dict(g=None, A_log=torch.zeros(4))),
        (TypeError, "'A_log' must be a tensor or None, got list", dict(g=g, A_log=[0.0] * 4)),
        (TypeError, "'g' must be a floating-point tensor", dict(g=g.int(), A_log=torch.zeros(4))),
        (
            TypeError,
            "'dt_bias' must be a floating-point",
            dict(g=g, A_log=torch.zeros(4), dt_bias=torch.zeros(32).int()),
        ),
        (
            TypeError,
            "output_dtype must be a floating-point",
            dict(g=g, A_log=torch.zeros(4), output_dtype=torch.int32),
        ),
        (TypeError, "lower_bound must be a number", dict(g=g, lower_bound="-5")),
        (ValueError, "lower_bound must be a finite number < 0", dict(g=g, lower_bound=1.0)),
        (ValueError, "lower_bound must be a finite number < 0", dict(g=g, lower_bound=float("nan"))),
    ]
    for error, message, kwargs in bad:
        with pytest.raises(error, match=message):
            kda.fused_kda_gate(**kwargs)


@pytest.mark.parametrize(
    "function",
    FUNCTIONS
    + (
        "chunk_gated_delta_rule",
        "fused_recurrent_gated_delta_rule",
        "fused_recurrent_kda_fwd",
        "fused_recurrent_gdn_fwd",
    ),
)
def test_an_argument_that_is_not_a_tensor_is_a_type_error_naming_it(function):
    """fla fails on an attribute of None or of a list; kda names the argument (TypeError)."""
    per_head = "gated_delta_rule" in function or "gdn" in function
    tensors, options = _inputs(B=1, gate_width="per_head" if per_head else "per_key")
    options.pop("initial_state", None)
    f = getattr(kda, function)
    for name, bad in (("cu_seqlens", [0, 5, 20]), ("initial_state", [1.0])):
        with torch.inference_mode(), pytest.raises(TypeError, match=f"'{name}' must be a tensor or None"):
            f(**tensors, **dict(options, **{name: bad}))
    required = ("q", "k", "v")
    if function != "fused_recurrent_gated_delta_rule":  # there g and beta may be left out
        required += ("g", "beta")
    for name in required:  # (q, k and v were read for the output's dtype before they were checked)
        for bad in (None, [1.0]):
            with (
                torch.inference_mode(),
                pytest.raises(TypeError, match=f"'{name}' must be a tensor, got {type(bad).__name__}"),
            ):
                f(**dict(tensors, **{name: bad}), **options)
