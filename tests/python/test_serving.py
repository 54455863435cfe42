"""Serving through the torch layer, for every family: its decode (fused_recurrent_kda_fwd for KDA,
fused_recurrent_gdn_fwd for the gated delta rule, fla's serving entries, on kda's decode kernel) and
the pooled prefill of its chunked function, both updating a state pool in place, against the float64
oracle; untouched slots bitwise identical, every bad argument refused before a write (a gate of the
other family's shape among them); the ops declared as mutating for torch.compile."""

import re

import kda
import pytest
import torch
from harness import (
    KIMI,
    LOWER_BOUND,
    Case,
    family_cases,
    function_of,
    make_inputs,
    rel_rms,
    tolerance,
)
from kda import _ops

POISON = -1234.5  # what an untouched slot holds


def _state_shape(case):
    return (case.HV, case.V, case.K) if case.state_v_first else (case.HV, case.K, case.V)


def _decode(family):
    return getattr(kda, function_of(family, "decode"))


def _oracle(family, tensors, options, starts):
    """Outputs and final states from the float64 oracle, starting from `starts` [N, HV, state]."""
    t64 = {n: t.double() for n, t in tensors.items()}
    o64 = {n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in options.items()}
    o64["initial_state"] = starts.double()
    with torch.no_grad():
        return getattr(kda, family.recurrent_function)(**t64, output_final_state=True, **o64)


def _pool(case, slots, dtype):
    return torch.full((slots, *_state_shape(case)), POISON, dtype=dtype)


def _other_familys_gate(g, K):
    """A gate of the other family's shape: one per head for a gate per key channel, and the reverse."""
    return g[..., 0] if g.dim() == 4 else g.unsqueeze(-1).expand(*g.shape, K)


SERVING_CASES = [
    Case(B=6, T=1, H=2, HV=4, K=32, V=16, regime="unbounded", **KIMI),
    Case(B=6, T=1, H=2, HV=2, K=128, V=128, regime="mild", state_v_first=True),
    Case(B=5, T=1, H=2, HV=2, K=64, V=64, regime="mild", state_v_first=True),
    Case(B=5, T=3, H=1, HV=2, K=16, V=32, regime="strong", **LOWER_BOUND),
    Case(B=4, T=2, H=2, HV=4, K=64, V=64, regime="spike", state_v_first=True, dtype=torch.bfloat16),
    Case(B=4, T=3, H=1, HV=2, K=16, V=32, regime="spike", beta="sigmoid_x2", dtype=torch.bfloat16),
]


@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("family, case", family_cases(SERVING_CASES))
def test_decode_on_a_pool_matches_the_oracle(family, case, pool_dtype):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state").to(pool_dtype)
    N, slots = case.B, 3 * case.B
    indices = torch.randperm(slots, generator=torch.Generator().manual_seed(3))[:N]
    pool = _pool(case, slots, pool_dtype)
    pool[indices] = starts
    untouched = pool.clone()
    with torch.inference_mode():
        o, final = _decode(family)(
            **tensors, initial_state=pool, ssm_state_indices=indices, output_final_state=True, **options
        )
    assert final is pool and o.dtype == tensors["v"].dtype
    o_ref, s_ref = _oracle(family, tensors, options, starts.float())
    assert rel_rms(o, o_ref) <= tolerance("decode", o.dtype, "o")
    assert rel_rms(pool[indices].float(), s_ref) <= tolerance("decode", pool_dtype, "state")
    mask = torch.ones(slots, dtype=torch.bool)
    mask[indices] = False
    assert torch.equal(pool[mask], untouched[mask])


@pytest.mark.parametrize(
    "family, case",
    family_cases(
        [
            Case(B=4, T=4, H=1, HV=2, K=32, V=16, regime="unbounded", **KIMI, state_v_first=state_v_first)
            for state_v_first in (False, True)
        ]
    ),
)
def test_speculative_decoding_every_accepted_count(family, case):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    N, T = case.B, case.T
    slots = N * T + 5
    table = torch.randperm(slots, generator=torch.Generator().manual_seed(5))[: N * T].view(N, T)
    accepted = torch.arange(1, N + 1, dtype=torch.int32)  # request n accepted n+1 tokens last step
    pool = _pool(case, slots, torch.float32)
    pool[table[torch.arange(N), accepted.long() - 1]] = starts
    untouched = pool.clone()
    with torch.inference_mode():
        o, _ = _decode(family)(
            **tensors, initial_state=pool, ssm_state_indices=table, num_accepted_tokens=accepted, **options
        )
    o_ref, _ = _oracle(family, tensors, options, starts)
    assert rel_rms(o, o_ref) <= tolerance("decode", torch.float32, "o")
    for t in range(T):  # the state after token t is in column t's slot
        prefix = {n: x[:, : t + 1] for n, x in tensors.items()}
        _, s_t = _oracle(family, prefix, options, starts)
        assert rel_rms(pool[table[:, t]], s_t) <= tolerance("decode", torch.float32, "state"), t
    mask = torch.ones(slots, dtype=torch.bool)
    mask[table.flatten()] = False
    assert torch.equal(pool[mask], untouched[mask])


@pytest.mark.parametrize(
    "family, case",
    family_cases([Case(T=6, cu_seqlens=[0, 1, 1, 4, 6], H=1, HV=2, K=16, V=16, regime="mild")]),
)
def test_padding_rows_varlen_requests_and_out(family, case):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    indices = torch.tensor([3, 0, -1, 5])  # request 2 (3 tokens) is padding
    pool = _pool(case, 7, torch.float32)
    pool[indices[indices >= 0]] = starts[indices >= 0]
    before = pool.clone()
    o = torch.full_like(tensors["v"], 7.0)
    with torch.inference_mode():
        returned, _ = _decode(family)(
            **tensors, initial_state=pool, ssm_state_indices=indices, out=o, **options
        )
    assert returned is o
    assert torch.equal(o[:, 1:4], torch.zeros_like(o[:, 1:4]))  # request 2's rows
    assert torch.equal(pool[[1, 2, 4, 6]], before[[1, 2, 4, 6]])
    o_ref, s_ref = _oracle(family, tensors, options, starts)
    keep = torch.tensor([0, 4, 5])
    assert rel_rms(o[:, keep], o_ref[:, keep]) <= tolerance("decode", torch.float32, "o")
    assert rel_rms(pool[[3, 5]], s_ref[[0, 3]]) <= tolerance("decode", torch.float32, "state")
    assert torch.equal(pool[0], before[0])  # request 1 has no token: its state is as it was


@pytest.mark.parametrize(
    "family, case", family_cases([Case(B=3, T=1, H=2, HV=2, K=16, V=16, regime="unbounded", **KIMI)])
)
def test_not_in_place_and_without_indices(family, case):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    pool = _pool(case, 5, torch.float32)
    pool[[4, 0, 2]] = starts
    before = pool.clone()
    decode, recurrent = _decode(family), getattr(kda, family.recurrent_function)
    with torch.inference_mode():
        o, final = decode(
            **tensors,
            initial_state=pool,
            ssm_state_indices=torch.tensor([4, 0, 2]),
            inplace_final_state=False,
            output_final_state=True,
            **options,
        )
        o_plain, final_plain = recurrent(**tensors, initial_state=starts, output_final_state=True, **options)
        h = starts.clone()
        o_h, final_h = decode(**tensors, initial_state=h, **options)  # fla: in place
    assert torch.equal(pool, before)
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)
    assert final_h is h and torch.equal(h, final_plain) and torch.equal(o_h, o_plain)


@pytest.mark.parametrize(
    "family, case", family_cases([Case(B=3, T=1, H=2, HV=2, K=16, V=16, regime="strong")])
)
def test_without_a_starting_state_the_final_state_is_returned_only_when_asked(family, case):
    """No initial_state (fla asserts one with inplace_final_state): the requests start from zeros and
    there is no pool to update, so the final state comes back only with output_final_state."""
    tensors, options = make_inputs(case)
    options.pop("initial_state")
    decode = _decode(family)
    with torch.inference_mode():
        o, none = decode(**tensors, **options)
        o2, final = decode(**tensors, output_final_state=True, **options)
        o_ref, final_ref = getattr(kda, family.recurrent_function)(
            **tensors, output_final_state=True, **options
        )
    assert none is None
    assert torch.equal(o, o2)
    # (the plain function without a starting state runs another kernel: equal up to rounding)
    assert rel_rms(o, o_ref) < 1e-6 and rel_rms(final, final_ref) < 1e-6


@pytest.mark.parametrize(
    "family, case",
    family_cases(
        [
            Case(B=3, T=2, H=1, HV=2, K=16, V=16, regime="mild"),
            Case(B=3, T=2, H=1, HV=2, K=16, V=16, regime="unbounded", **KIMI),
        ]
    ),
)
def test_serving_errors_leave_the_pool_unchanged(family, case):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    pool = _pool(case, 6, torch.float32)
    pool[[1, 2, 3]] = starts
    before = pool.clone()
    table = torch.tensor([[1, 4], [2, 5], [3, 0]])
    decode = _decode(family)

    def call(**kw):
        args, opts = dict(tensors), dict(options)
        for n in list(kw):
            if n in args or n in opts:
                (args if n in args else opts)[n] = kw.pop(n)
        with torch.inference_mode():
            return decode(**args, initial_state=pool, **opts, **kw)

    idx = dict(ssm_state_indices=torch.tensor([1, 2, 3]))
    bad = [
        (
            ValueError,
            "'ssm_state_indices': index 6 .* past the pool",
            dict(ssm_state_indices=torch.tensor([1, 2, 6])),
        ),
        (
            ValueError,
            "'ssm_state_indices': slot 1 would be written twice",
            dict(ssm_state_indices=torch.tensor([1, 2, 1])),
        ),
        (
            ValueError,
            "num_accepted_tokens",
            dict(ssm_state_indices=table, num_accepted_tokens=torch.tensor([1, 0, 1])),
        ),
        (
            ValueError,
            r"'num_accepted_tokens': expected 1\.\.2 \(the columns of ssm_state_indices\)",
            dict(ssm_state_indices=table, num_accepted_tokens=torch.tensor([1, 3, 1])),
        ),
        (TypeError, "int32 or int64", dict(ssm_state_indices=torch.tensor([1.0, 2.0, 3.0]))),
        (ValueError, "needs ssm_state_indices", dict(num_accepted_tokens=torch.tensor([1, 1, 1]))),
    ]
    other_gate = _other_familys_gate(tensors["g"], case.K)
    bad.append((ValueError, re.escape(family.gate_rank_message(other_gate)), dict(g=other_gate, **idx)))
    if "A_log" in options:  # the fused gate's parameters in other shapes (dt_bias: the other family's)
        size = family.dt_bias_size(case.HV, case.K, case.V)
        bad += [
            (ValueError, f"'dt_bias': expected {size} elements", dict(dt_bias=torch.zeros(size * 16), **idx)),
            (ValueError, f"'A_log': expected {case.HV} elements", dict(A_log=torch.zeros(32), **idx)),
        ]
    if not family.lower_bound_gate:  # the bounded gate is another family's
        bad.append((TypeError, "lower_bound", dict(lower_bound=-5.0, **idx)))
    for error, message, kw in bad:
        with pytest.raises(error, match=message):
            call(**kw)
        assert torch.equal(pool, before), message
    with (
        pytest.raises(TypeError, match="'initial_state': expected dtype float32 or bfloat16"),
        torch.inference_mode(),
    ):
        decode(**tensors, initial_state=pool.double(), ssm_state_indices=torch.tensor([1, 2, 3]), **options)
    with pytest.raises(ValueError, match="'initial_state': expected shape"), torch.inference_mode():
        decode(
            **tensors,
            initial_state=pool.transpose(-1, -2).contiguous()[..., :8],
            ssm_state_indices=torch.tensor([1, 2, 3]),
            **options,
        )
    grad = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    with pytest.raises(RuntimeError, match="records no gradient"):
        decode(**grad, initial_state=pool, ssm_state_indices=torch.tensor([1, 2, 3]), **options)
    assert torch.equal(pool, before)


PREFILL_CASES = [
    Case(T=T, cu_seqlens=[0, 70, 71, 71, T], H=1, HV=2, K=32, V=16, regime="unbounded", **KIMI)
    for T in (200, 150)
]


@pytest.mark.parametrize("path", ("chunk", "recurrent"))
@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("family, case", family_cases(PREFILL_CASES))
def test_pooled_prefill_equals_the_plain_forward(family, case, pool_dtype, path):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    indices = torch.tensor([5, -1, 2, 0])
    has = torch.tensor([True, True, True, False])
    pool = _pool(case, 7, pool_dtype)
    pool[[5, 2, 0]] = starts[[0, 2, 3]].to(pool_dtype)
    reads = starts.clone()
    reads[[0, 2]] = pool[[5, 2]].float()
    reads[[1, 3]] = 0.0
    with torch.inference_mode():
        if path == "chunk":
            o, returned = getattr(kda, family.chunk_function)(
                **tensors, initial_state=pool, ssm_state_indices=indices, has_initial_state=has, **options
            )
        else:
            args = _pooled_args(case, tensors, options, pool, indices, has)
            o = _ops.pooled_forward("recurrent", True, *args)
            returned = pool
        fn = getattr(kda, function_of(family, path))
        o_plain, s_plain = fn(**tensors, initial_state=reads, output_final_state=True, **options)
    assert returned is pool
    assert torch.equal(o, o_plain)
    assert torch.equal(pool[[5, 2, 0]], s_plain[[0, 2, 3]].to(pool_dtype))
    assert (pool[[1, 3, 4, 6]] == POISON).all()


@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("family, case", family_cases(PREFILL_CASES))
def test_pooled_prefill_errors_leave_the_pool_unchanged(family, case, pool_dtype):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    pool = _pool(case, 7, pool_dtype)
    pool[[5, 2, 0]] = starts[[0, 2, 3]].to(pool_dtype)
    before = pool.clone()
    chunk = getattr(kda, family.chunk_function)
    indices = torch.tensor([5, -1, 2, 0])
    other_gate = _other_familys_gate(tensors["g"], case.K)
    with (
        torch.inference_mode(),
        pytest.raises(ValueError, match=re.escape(family.gate_rank_message(other_gate))),
    ):
        chunk(
            **dict(tensors, g=other_gate),
            initial_state=pool,
            ssm_state_indices=indices,
            **options,
        )
    with (
        torch.inference_mode(),
        pytest.raises(ValueError, match="'ssm_state_indices': slot 5 is used by sequences 0 and 2"),
    ):
        chunk(**tensors, initial_state=pool, ssm_state_indices=torch.tensor([5, 1, 5, 0]), **options)
    assert torch.equal(pool, before)


def _pooled_args(case, tensors, options, pool, indices, has):
    return (
        tensors["q"],
        tensors["k"],
        tensors["v"],
        tensors["g"],
        tensors["beta"],
        options["A_log"],
        options["dt_bias"],
        pool,
        indices,
        has,
        options["cu_seqlens"],
        case.K**-0.5,
        False,
        True,
        "softplus",
        -5.0,
        "sigmoid",
        case.gate_width,
    )


@pytest.mark.parametrize(
    "family, case", family_cases([Case(B=3, T=1, H=1, HV=2, K=16, V=16, regime="unbounded", **KIMI)])
)
def test_decode_op_is_declared_mutating_and_compiles(family, case):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    pool = _pool(case, 4, torch.float32)
    pool[[3, 1, 0]] = starts
    idx = torch.tensor([3, 1, 0])
    args = (
        tensors["q"],
        tensors["k"],
        tensors["v"],
        tensors["g"],
        tensors["beta"],
        options["A_log"],
        options["dt_bias"],
        pool.clone(),
        idx,
        None,
        None,
        0.25,
        False,
        True,
        "softplus",
        -5.0,
        "sigmoid",
        case.gate_width,
        torch.empty_like(tensors["v"]),
    )
    torch.library.opcheck(_ops.decode_op, args)
    schema = str(_ops.decode_op._opoverload._schema)
    assert "Tensor(a!) pool" in schema and "Tensor(b!) out" in schema
    prefill = Case(T=80, cu_seqlens=[0, 30, 80], regime="unbounded", **KIMI, gate_width=case.gate_width)
    torch.library.opcheck(
        _ops.POOLED["chunk"][1],
        _pooled_args(
            prefill,
            *make_inputs(prefill),
            pool=_pool(Case(K=32, V=32, HV=2), 3, torch.float32),
            indices=torch.tensor([2, 0]),
            has=None,
        ),
    )

    def step(p):
        o, _ = _decode(family)(**tensors, initial_state=p, ssm_state_indices=idx, **options)
        return o

    eager_pool, compiled_pool = pool.clone(), pool.clone()
    with torch.inference_mode():
        o_eager = step(eager_pool)
        o_compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_pool)
    assert torch.equal(o_eager, o_compiled) and torch.equal(eager_pool, compiled_pool)


def test_pool_arguments_that_are_not_tensors_are_type_errors_naming_them():
    """The pool's own arguments as lists (what a caller building them by hand might pass): a TypeError
    naming each, the pool untouched, for the decode and the pooled prefill."""
    N, HV, K, V = 2, 2, 8, 8
    pool = torch.randn(4, HV, K, V)
    before = pool.clone()
    step = dict(
        q=torch.randn(N, 1, 1, K),
        k=torch.randn(N, 1, 1, K),
        v=torch.randn(N, 1, HV, V),
        g=-torch.rand(N, 1, HV, K),
        beta=torch.rand(N, 1, HV),
        initial_state=pool,
        ssm_state_indices=torch.tensor([0, 2], dtype=torch.int32),
    )
    prefill = dict(
        {n: t.reshape(1, N, *t.shape[2:]) for n, t in step.items() if n in ("q", "k", "v", "g", "beta")},
        initial_state=pool,
        ssm_state_indices=torch.tensor([0, 2], dtype=torch.int32),
        cu_seqlens=torch.tensor([0, 1, 2]),
        has_initial_state=torch.tensor([True, False]),
    )
    table = dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    bad = [
        (kda.fused_recurrent_kda_fwd, step, "ssm_state_indices", [0, 2], {}),
        (kda.fused_recurrent_kda_fwd, step, "num_accepted_tokens", [1, 1], table),
        (kda.fused_recurrent_kda_fwd, step, "out", [0.0], {}),
        (kda.chunk_kda, prefill, "ssm_state_indices", [0, 2], {}),
        (kda.chunk_kda, prefill, "has_initial_state", [True, False], {}),
    ]
    for function, args, name, value, extra in bad:
        with torch.inference_mode(), pytest.raises(TypeError, match=f"'{name}' must be .*tensor.*, got list"):
            function(**dict(args, **extra, **{name: value}))
        assert torch.equal(pool, before), name
