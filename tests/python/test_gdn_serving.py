"""Serving the gated delta rule on state pools: kda.fused_recurrent_gdn_fwd (the decode, with
fused_recurrent_kda_fwd's slot semantics) and the pooled prefill of chunk_gated_delta_rule, against
the float64 oracle; poisoned pools, untouched slots bitwise equal, every bad index refused before a
write."""

import kda
import pytest
import torch
from harness import KIMI, Case, make_inputs, rel_rms, tolerance

POISON = -1234.5  # what an untouched slot holds
GDN = dict(gate_width="per_head")


def _state_shape(case):
    return (case.HV, case.V, case.K) if case.state_v_first else (case.HV, case.K, case.V)


def _pool(case, slots, dtype):
    return torch.full((slots, *_state_shape(case)), POISON, dtype=dtype)


def _oracle(tensors, options, starts):
    t64 = {n: t.double() for n, t in tensors.items()}
    o64 = {n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in options.items()}
    o64["initial_state"] = starts.double()
    with torch.no_grad():
        return kda.fused_recurrent_gated_delta_rule(**t64, output_final_state=True, **o64)


SERVING_CASES = [
    Case(B=6, T=1, H=2, HV=4, K=32, V=16, regime="unbounded", **KIMI, **GDN),
    Case(B=5, T=1, H=2, HV=2, K=64, V=64, regime="mild", state_v_first=True, **GDN),
    Case(B=4, T=3, H=1, HV=2, K=16, V=32, regime="spike", beta="sigmoid_x2", **GDN, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("case", SERVING_CASES, ids=str)
def test_decode_on_a_pool_matches_the_oracle(case, pool_dtype):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state").to(pool_dtype)
    N, slots = case.B, 3 * case.B
    indices = torch.randperm(slots, generator=torch.Generator().manual_seed(3))[:N]
    pool = _pool(case, slots, pool_dtype)
    pool[indices] = starts
    untouched = pool.clone()
    with torch.inference_mode():
        o, final = kda.fused_recurrent_gdn_fwd(
            **tensors, initial_state=pool, ssm_state_indices=indices, output_final_state=True, **options
        )
    assert final is pool and o.dtype == tensors["v"].dtype
    o_ref, s_ref = _oracle(tensors, options, starts.float())
    assert rel_rms(o, o_ref) <= tolerance("decode", o.dtype, "o")
    assert rel_rms(pool[indices].float(), s_ref) <= tolerance("decode", pool_dtype, "state")
    mask = torch.ones(slots, dtype=torch.bool)
    mask[indices] = False
    assert torch.equal(pool[mask], untouched[mask])


@pytest.mark.parametrize("state_v_first", (False, True))
def test_speculative_decoding_every_accepted_count(state_v_first):
    case = Case(
        B=4, T=4, H=1, HV=2, K=32, V=16, regime="unbounded", **KIMI, **GDN, state_v_first=state_v_first
    )
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    N, T = case.B, case.T
    slots = N * T + 5
    table = torch.randperm(slots, generator=torch.Generator().manual_seed(5))[: N * T].view(N, T)
    accepted = torch.arange(1, N + 1, dtype=torch.int32)
    pool = _pool(case, slots, torch.float32)
    pool[table[torch.arange(N), accepted.long() - 1]] = starts
    untouched = pool.clone()
    with torch.inference_mode():
        o, _ = kda.fused_recurrent_gdn_fwd(
            **tensors, initial_state=pool, ssm_state_indices=table, num_accepted_tokens=accepted, **options
        )
    o_ref, _ = _oracle(tensors, options, starts)
    assert rel_rms(o, o_ref) <= tolerance("decode", torch.float32, "o")
    for t in range(T):  # the state after token t is in column t's slot
        _, s_t = _oracle({n: x[:, : t + 1] for n, x in tensors.items()}, options, starts)
        assert rel_rms(pool[table[:, t]], s_t) <= tolerance("decode", torch.float32, "state"), t
    mask = torch.ones(slots, dtype=torch.bool)
    mask[table.flatten()] = False
    assert torch.equal(pool[mask], untouched[mask])


def test_padding_rows_varlen_requests_and_out():
    case = Case(T=6, cu_seqlens=[0, 1, 1, 4, 6], H=1, HV=2, K=16, V=16, regime="mild", **GDN)
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    indices = torch.tensor([3, 0, -1, 5])  # request 2 (3 tokens) is padding
    pool = _pool(case, 7, torch.float32)
    pool[indices[indices >= 0]] = starts[indices >= 0]
    before = pool.clone()
    o = torch.full_like(tensors["v"], 7.0)
    with torch.inference_mode():
        returned, _ = kda.fused_recurrent_gdn_fwd(
            **tensors, initial_state=pool, ssm_state_indices=indices, out=o, **options
        )
    assert returned is o
    assert torch.equal(o[:, 1:4], torch.zeros_like(o[:, 1:4]))  # request 2's rows
    assert torch.equal(pool[[0, 1, 2, 4, 6]], before[[0, 1, 2, 4, 6]])  # request 1 has no token
    o_ref, s_ref = _oracle(tensors, options, starts)
    keep = torch.tensor([0, 4, 5])
    assert rel_rms(o[:, keep], o_ref[:, keep]) <= tolerance("decode", torch.float32, "o")
    assert rel_rms(pool[[3, 5]], s_ref[[0, 3]]) <= tolerance("decode", torch.float32, "state")


def test_not_in_place_and_without_indices():
    case = Case(B=3, T=1, H=2, HV=2, K=16, V=16, regime="unbounded", **KIMI, **GDN)
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    pool = _pool(case, 5, torch.float32)
    pool[[4, 0, 2]] = starts
    before = pool.clone()
    with torch.inference_mode():
        o, final = kda.fused_recurrent_gdn_fwd(
            **tensors,
            initial_state=pool,
            ssm_state_indices=torch.tensor([4, 0, 2]),
            inplace_final_state=False,
            output_final_state=True,
            **options,
        )
        o_plain, final_plain = kda.fused_recurrent_gated_delta_rule(
            **tensors, initial_state=starts, output_final_state=True, **options
        )
        h = starts.clone()
        o_h, final_h = kda.fused_recurrent_gdn_fwd(**tensors, initial_state=h, **options)  # in place
    assert torch.equal(pool, before)
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)
    assert final_h is h and torch.equal(h, final_plain) and torch.equal(o_h, o_plain)


def test_without_a_starting_state_the_final_state_is_returned_only_when_asked():
    """No initial_state (fla asserts one with inplace_final_state): the requests start from zeros and
    there is no pool to update, so the final state comes back only with output_final_state."""
    case = Case(B=3, T=1, H=2, HV=2, K=16, V=16, regime="strong", **GDN)
    tensors, options = make_inputs(case)
    options.pop("initial_state")
    with torch.inference_mode():
        o, none = kda.fused_recurrent_gdn_fwd(**tensors, **options)
        o2, final = kda.fused_recurrent_gdn_fwd(**tensors, output_final_state=True, **options)
        o_ref, final_ref = kda.fused_recurrent_gated_delta_rule(**tensors, output_final_state=True, **options)
    assert none is None
    assert torch.equal(o, o2)
    # (the plain function without a starting state runs another kernel: equal up to rounding)
    assert rel_rms(o, o_ref) < 1e-6 and rel_rms(final, final_ref) < 1e-6


def test_serving_errors_leave_the_pool_unchanged():
    case = Case(B=3, T=2, H=1, HV=2, K=16, V=16, regime="unbounded", **KIMI, **GDN)
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    pool = _pool(case, 6, torch.float32)
    pool[[1, 2, 3]] = starts
    before = pool.clone()
    table = torch.tensor([[1, 4], [2, 5], [3, 0]])

    def call(**kw):
        args = dict(tensors)
        opts = dict(options)
        for n in list(kw):
            if n in args or n in opts:
                (args if n in args else opts)[n] = kw.pop(n)
        with torch.inference_mode():
            return kda.fused_recurrent_gdn_fwd(**args, initial_state=pool, **opts, **kw)

    idx = dict(ssm_state_indices=torch.tensor([1, 2, 3]))
    bad = [
        (ValueError, "past the pool", dict(ssm_state_indices=torch.tensor([1, 2, 6]))),
        (ValueError, "written twice", dict(ssm_state_indices=torch.tensor([1, 2, 1]))),
        (
            ValueError,
            "num_accepted_tokens",
            dict(ssm_state_indices=table, num_accepted_tokens=torch.tensor([1, 0, 1])),
        ),
        (
            ValueError,
            "num_accepted_tokens",
            dict(ssm_state_indices=table, num_accepted_tokens=torch.tensor([1, 3, 1])),
        ),
        (TypeError, "int32 or int64", dict(ssm_state_indices=torch.tensor([1.0, 2.0, 3.0]))),
        (ValueError, "needs ssm_state_indices", dict(num_accepted_tokens=torch.tensor([1, 1, 1]))),
        (ValueError, "'g' of the gated delta rule", dict(g=torch.zeros(3, 2, 2, 16), **idx)),  # KDA's gate
        (ValueError, "'dt_bias': expected 2 elements", dict(dt_bias=torch.zeros(32), **idx)),  # KDA's shape
        (ValueError, "'A_log': expected 2 elements", dict(A_log=torch.zeros(32), **idx)),
        (TypeError, "lower_bound", dict(lower_bound=-5.0, **idx)),  # no bounded gate for GDN
    ]
    for error, message, kw in bad:
        with pytest.raises(error, match=message):
            call(**kw)
        assert torch.equal(pool, before), message
    with pytest.raises(TypeError, match="'pool': expected dtype float32 or bfloat16"), torch.inference_mode():
        kda.fused_recurrent_gdn_fwd(
            **tensors, initial_state=pool.double(), ssm_state_indices=torch.tensor([1, 2, 3]), **options
        )
    grad = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    with pytest.raises(RuntimeError, match="records no gradient"):
        kda.fused_recurrent_gdn_fwd(
            **grad, initial_state=pool, ssm_state_indices=torch.tensor([1, 2, 3]), **options
        )
    assert torch.equal(pool, before)


@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16))
def test_pooled_prefill_equals_the_plain_forward(pool_dtype):
    case = Case(
        T=150, cu_seqlens=[0, 70, 71, 71, 150], H=1, HV=2, K=32, V=16, regime="unbounded", **KIMI, **GDN
    )
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
        o, returned = kda.chunk_gated_delta_rule(
            **tensors, initial_state=pool, ssm_state_indices=indices, has_initial_state=has, **options
        )
        o_plain, s_plain = kda.chunk_gated_delta_rule(
            **tensors, initial_state=reads, output_final_state=True, **options
        )
    assert returned is pool
    assert torch.equal(o, o_plain)
    assert torch.equal(pool[[5, 2, 0]], s_plain[[0, 2, 3]].to(pool_dtype))
    assert (pool[[1, 3, 4, 6]] == POISON).all()
    before = pool.clone()
    with torch.inference_mode(), pytest.raises(ValueError, match="'g' of the gated delta rule"):
        kda.chunk_gated_delta_rule(
            **dict(tensors, g=tensors["g"].unsqueeze(-1).expand(-1, -1, -1, 32)),
            initial_state=pool,
            ssm_state_indices=indices,
            **options,
        )
    with torch.inference_mode(), pytest.raises(ValueError, match="slot 5 is used by sequences 0 and 2"):
        kda.chunk_gated_delta_rule(
            **tensors, initial_state=pool, ssm_state_indices=torch.tensor([5, 1, 5, 0]), **options
        )
    assert torch.equal(pool, before)


def test_decode_compiles_and_matches_eager():
    case = Case(B=3, T=1, H=1, HV=2, K=16, V=16, regime="unbounded", **KIMI, **GDN)
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    pool = _pool(case, 4, torch.float32)
    idx = torch.tensor([3, 1, 0])
    pool[idx] = starts

    def step(p):
        o, _ = kda.fused_recurrent_gdn_fwd(**tensors, initial_state=p, ssm_state_indices=idx, **options)
        return o

    eager_pool, compiled_pool = pool.clone(), pool.clone()
    with torch.inference_mode():
        o_eager = step(eager_pool)
        o_compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_pool)
    assert torch.equal(o_eager, o_compiled) and torch.equal(eager_pool, compiled_pool)
