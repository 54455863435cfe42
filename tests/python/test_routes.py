"""The two routes of a torch-layer call: straight into an op's implementation (the fast route, taken
when nothing watches the dispatcher) and through the custom op. They must give bitwise the same
results, the op route must stay usable alone (a torch without the private probes the fast route reads
falls back to it), and the ops' arguments must come from the one options record."""

import kda
import pytest
import torch
from harness import KIMI, LOWER_BOUND, Case, as_oracle, make_inputs, rel_rms
from kda import _ops

# The schemas as they were spelled out by hand before the options record (plus its gate_width row,
# added since): generating them from PROBLEM_OPTIONS must not change an op's signature.
_SCHEMAS = {
    "forward": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, Tensor? cu_seqlens, float scale, bool state_v_first, bool qk_l2norm, "
    "str gate, float gate_lower_bound, str beta_mode, str gate_width, bool output_final_state, "
    "bool keep_chunk_states) -> (Tensor, Tensor, Tensor)",
    "backward": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, Tensor? cu_seqlens, Tensor? chunk_states, Tensor d_o, Tensor? d_final_state, "
    "float scale, bool state_v_first, bool qk_l2norm, str gate, float gate_lower_bound, str beta_mode, "
    "str gate_width, bool want_d_initial_state) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "decode": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor(a!) pool, Tensor state_indices, Tensor? num_accepted_tokens, Tensor? cu_seqlens, float scale, "
    "bool state_v_first, bool qk_l2norm, str gate, float gate_lower_bound, str beta_mode, str gate_width, "
    "Tensor(b!) out) -> ()",
    "pooled": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor(a!) pool, Tensor pool_indices, Tensor? has_initial_state, Tensor? cu_seqlens, float scale, "
    "bool state_v_first, bool qk_l2norm, str gate, float gate_lower_bound, str beta_mode, str gate_width) "
    "-> Tensor",
}
_SIGNATURES = {
    "forward": _ops._FORWARD,
    "backward": _ops._BACKWARD,
    "decode": _ops._DECODE,
    "pooled": _ops._POOLED,
}


@pytest.mark.parametrize("op", sorted(_SCHEMAS))
def test_schemas_generated_from_the_options_record(op):
    signature = _SIGNATURES[op]
    assert signature.schema == _SCHEMAS[op]
    # Every problem option reaches every op, and options() reads them back by name.
    args = signature.Args._make(f"value of {n}" for n in signature.fields)
    assert signature.options(args) == _ops.Options._make(f"value of {n}" for n in _ops.Options._fields)


def test_registered_schemas_are_the_generated_ones():
    registered = {
        "forward": _ops.PATHS["chunk"].forward_op,
        "backward": _ops.PATHS["recurrent"].backward_op,
        "decode": _ops.decode_op,
        "pooled": _ops.POOLED["chunk"][1],
    }
    for op, custom_op in registered.items():
        schema = str(custom_op._opoverload._schema)
        assert schema.endswith(_SCHEMAS[op]), (op, schema)


def test_problem_options_defaults():
    q = torch.zeros(1, 1, 1, 16)
    assert _ops.problem_options(q) == _ops.Options(None, 0.25, False, False, "log_decay", -5.0, "given")
    assert _ops.problem_options(q, scale=0.25) == _ops.Options()._replace(scale=0.25)  # the table's defaults
    options = _ops.problem_options(q, scale=2, gate="lower_bound", gate_lower_bound=-3, state_v_first=True)
    assert options.scale == 2.0 and type(options.scale) is float
    assert options.gate_lower_bound == -3.0 and type(options.gate_lower_bound) is float
    assert options.state_v_first is True and options.gate == "lower_bound"


# ---- the two routes --------------------------------------------------------------------------------


class _Counted:
    """A custom op wrapped to count the calls that reach it."""

    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


def _count_op(monkeypatch, kind, path=None):
    """Wraps the op a route would call; returns the counter."""
    if kind == "forward":
        counter = _Counted(_ops.PATHS[path].forward_op)
        monkeypatch.setattr(_ops.PATHS[path], "forward_op", counter)
    elif kind == "decode":
        counter = _Counted(_ops.decode_op)
        monkeypatch.setattr(_ops, "decode_op", counter)
    else:
        compute, op = _ops.POOLED[path]
        counter = _Counted(op)
        monkeypatch.setitem(_ops.POOLED, path, (compute, counter))
    return counter


def _both_routes(monkeypatch, call, kind, path=None):
    """Runs call() on the fast route and on the op route (fast route turned off); returns both results
    after checking which route each took."""
    assert _ops.FAST_ROUTE  # this torch has every probe
    counter = _count_op(monkeypatch, kind, path)
    with torch.inference_mode():
        fast = call()
        assert counter.calls == 0  # straight into the implementation
        monkeypatch.setattr(_ops, "FAST_ROUTE", False)
        slow = call()
        assert counter.calls == 1  # through the op
    return fast, slow


def _equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


_FORWARD_CASES = [
    (Case(B=2, T=70, H=1, HV=2, K=16, V=8, regime="unbounded", **KIMI), False),
    (Case(B=2, T=70, H=1, HV=2, K=16, V=8, regime="unbounded", **KIMI), True),
    (Case(T=90, cu_seqlens=[0, 20, 20, 90], H=1, HV=1, K=8, V=16, regime="strong", **LOWER_BOUND), True),
    (Case(T=33, K=8, V=8, regime="mild", state_v_first=True, initial_state=False), True),
]


@pytest.mark.parametrize("function,path", [("chunk_kda", "chunk"), ("fused_recurrent_kda", "recurrent")])
@pytest.mark.parametrize("case,final", _FORWARD_CASES, ids=lambda x: str(x) if isinstance(x, Case) else None)
def test_forward_routes_bitwise_equal(monkeypatch, function, path, case, final):
    tensors, options = make_inputs(case)
    fast, slow = _both_routes(
        monkeypatch,
        lambda: getattr(kda, function)(**tensors, output_final_state=final, **options),
        "forward",
        path,
    )
    assert len(fast) == len(slow) == 2
    assert all(_equal(a, b) for a, b in zip(fast, slow, strict=True))
    assert (fast[1] is None) == (not final)


def test_intermediate_states_routes_bitwise_equal(monkeypatch):
    tensors, options = make_inputs(
        Case(T=150, cu_seqlens=[0, 70, 150], regime="unbounded", **KIMI, K=16, V=16)
    )
    fast, slow = _both_routes(
        monkeypatch,
        lambda: kda.chunk_kda(**tensors, output_final_state=True, return_intermediate_states=True, **options),
        "forward",
        "chunk",
    )
    assert all(_equal(a, b) for a, b in zip(fast, slow, strict=True))


def test_reference_path_routes_bitwise_equal(monkeypatch):
    tensors, options = as_oracle(*make_inputs(Case(T=40, K=8, V=8, regime="unbounded", **KIMI)))
    fast, slow = _both_routes(
        monkeypatch,
        lambda: kda.chunk_kda(**tensors, output_final_state=True, **options),
        "forward",
        "reference",
    )
    assert fast[0].dtype == torch.float64
    assert all(_equal(a, b) for a, b in zip(fast, slow, strict=True))


def _pool_of(case, slots, starts, indices, dtype):
    state = (case.V, case.K) if case.state_v_first else (case.K, case.V)
    pool = torch.full((slots, case.HV, *state), -1234.5, dtype=dtype)
    pool[indices] = starts.to(dtype)
    return pool


@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize(
    "case",
    [
        Case(B=4, T=1, H=2, HV=4, K=32, V=16, regime="unbounded", **KIMI),
        Case(B=3, T=2, H=1, HV=2, K=16, V=16, regime="strong", **LOWER_BOUND, state_v_first=True),
    ],
    ids=str,
)
def test_decode_on_a_pool_routes_bitwise_equal(monkeypatch, case, pool_dtype):
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    indices = torch.tensor([5, 0, 3, 1][: case.B])
    pools = [_pool_of(case, 7, starts, indices, pool_dtype) for _ in range(2)]

    def step():
        pool = pools.pop(0)
        o, returned = kda.fused_recurrent_kda_fwd(
            **tensors, initial_state=pool, ssm_state_indices=indices, **options
        )
        assert returned is pool
        return o, pool

    (o_fast, pool_fast), (o_slow, pool_slow) = _both_routes(monkeypatch, step, "decode")
    assert _equal(o_fast, o_slow) and _equal(pool_fast, pool_slow)


def test_pooled_prefill_routes_bitwise_equal(monkeypatch):
    case = Case(T=200, cu_seqlens=[0, 70, 71, 71, 200], H=1, HV=2, K=32, V=16, regime="unbounded", **KIMI)
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    indices = torch.tensor([5, -1, 2, 0])
    has = torch.tensor([True, True, True, False])
    pools = [_pool_of(case, 7, starts[[0, 2, 3]], [5, 2, 0], torch.float32) for _ in range(2)]

    def prefill():
        pool = pools.pop(0)
        o, returned = kda.chunk_kda(
            **tensors, initial_state=pool, ssm_state_indices=indices, has_initial_state=has, **options
        )
        assert returned is pool
        return o, pool

    (o_fast, pool_fast), (o_slow, pool_slow) = _both_routes(monkeypatch, prefill, "pooled", "chunk")
    assert _equal(o_fast, o_slow) and _equal(pool_fast, pool_slow)


# ---- the engine seam: one validation per engine call ---------------------------------------------


def _validations(call):
    before = kda.engine.validation_count()
    result = call()
    return kda.engine.validation_count() - before, result


@pytest.mark.parametrize("fast", (True, False), ids=("fast_route", "op_route"))
def test_one_problem_validation_per_engine_call(monkeypatch, fast):
    monkeypatch.setattr(_ops, "FAST_ROUTE", fast)
    case = Case(T=100, cu_seqlens=[0, 30, 100], regime="unbounded", K=16, V=16)
    tensors, options = make_inputs(case)
    with torch.no_grad():
        n, _ = _validations(lambda: kda.chunk_kda(**tensors, output_final_state=True, **options))
        assert n == 1
        n, _ = _validations(
            lambda: kda.chunk_kda(
                **tensors, output_final_state=True, return_intermediate_states=True, **options
            )
        )
        assert n == 1  # the chunk states sized from the same problem
    grad = {name: t.clone().requires_grad_() for name, t in tensors.items()}
    n, (o, final) = _validations(lambda: kda.chunk_kda(**grad, output_final_state=True, **options))
    assert n == 1
    n, _ = _validations(lambda: (o.sum() + final.sum()).backward())
    assert n == 1

    decode_case = Case(B=3, T=1, H=1, HV=2, K=16, V=16, regime="unbounded")
    tensors, options = make_inputs(decode_case)
    pool = options.pop("initial_state")
    with torch.inference_mode():
        n, _ = _validations(
            lambda: kda.fused_recurrent_kda_fwd(
                **tensors, initial_state=pool, ssm_state_indices=torch.tensor([2, 0, 1]), **options
            )
        )
    assert n == 1


_FAMILY_FUNCTIONS = {
    "per_key": (kda.chunk_kda, kda.fused_recurrent_kda_fwd),
    "per_head": (kda.chunk_gated_delta_rule, kda.fused_recurrent_gdn_fwd),
}


@pytest.mark.parametrize("width", sorted(_FAMILY_FUNCTIONS))
def test_one_validation_per_call_of_every_family(monkeypatch, tmp_path, width):
    """One problem validation per engine call, for each family: the chunked forward (no gradient,
    and recording one) and its backward, the pooled prefill, the decode, and a one-rank
    context-parallel call forward and backward. fla's Python checks run on none of these valid calls
    (they run only when the engine refuses one), but once on a context-parallel call, whose ranks
    must all learn of a bad argument before the first collective."""
    import torch.distributed as dist
    from kda import _arguments

    chunked, decode = _FAMILY_FUNCTIONS[width]
    checks = []
    real_checks = _arguments.check_shapes
    monkeypatch.setattr(_arguments, "check_shapes", lambda *a: checks.append(1) or real_checks(*a))
    # (the modules that imported check_shapes by name)
    import kda.serving

    monkeypatch.setattr(kda.serving, "check_shapes", _arguments.check_shapes)
    case = Case(T=100, cu_seqlens=[0, 30, 100], regime="unbounded", K=16, V=16, gate_width=width, **KIMI)
    tensors, options = make_inputs(case)
    h0 = options.pop("initial_state")
    with torch.no_grad():
        assert (
            _validations(lambda: chunked(**tensors, initial_state=h0, output_final_state=True, **options))[0]
            == 1
        )
    grad = {name: t.clone().requires_grad_() for name, t in tensors.items()}
    n, (o, final) = _validations(
        lambda: chunked(**grad, initial_state=h0, output_final_state=True, **options)
    )
    assert n == 1
    assert _validations(lambda: (o.sum() + final.sum()).backward())[0] == 1

    pool = _pool_of(case, 5, h0, [3, 1], torch.float32)
    with torch.inference_mode():
        n, _ = _validations(
            lambda: chunked(**tensors, initial_state=pool, ssm_state_indices=torch.tensor([3, 1]), **options)
        )
    assert n == 1

    decode_case = Case(B=3, T=1, H=1, HV=2, K=16, V=16, regime="unbounded", gate_width=width, **KIMI)
    d_tensors, d_options = make_inputs(decode_case)
    d_pool = d_options.pop("initial_state")
    d_options.pop("cu_seqlens", None)
    with torch.inference_mode():
        n, _ = _validations(
            lambda: decode(
                **d_tensors, initial_state=d_pool, ssm_state_indices=torch.tensor([2, 0, 1]), **d_options
            )
        )
    assert n == 1
    assert checks == []

    # A one-rank context-parallel call: the status exchange, one local forward, one local backward.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        from kda.cp import build_cp_context

        ctx = build_cp_context(torch.tensor(case.cu_seqlens))
        cp_options = {k: v for k, v in options.items() if k != "cu_seqlens"}
        grad = {name: t.clone().requires_grad_() for name, t in tensors.items()}
        n, (o, _) = _validations(lambda: chunked(**grad, cp_context=ctx, **cp_options))
        assert n == 1
        assert _validations(lambda: o.sum().backward())[0] == 1
    finally:
        dist.destroy_process_group()
    assert checks == [1]


@pytest.mark.parametrize("path", ("chunk", "recurrent", "reference"))
def test_a_per_head_gate_reaches_the_engine(path):
    """A 3-D g [B, T, HV] with the problem option gate_width="per_head" is the gated delta rule's
    scalar gate: the engine computes it as KDA's gate with the head's value in every key channel (the
    float64 oracle bitwise; the kernels, which use the scalar structure, to fp32 rounding); a g of the
    other width's rank is refused."""
    dtype = torch.float64 if path == "reference" else torch.float32
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 8, 2, 16, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(1, 8, 2, 16, generator=gen, dtype=dtype)
    g = -0.1 * torch.rand(1, 8, 2, generator=gen, dtype=dtype)
    beta = torch.rand(1, 8, 2, generator=gen, dtype=dtype)
    args = (q, k, v, g, beta, None, None, None, *_ops.problem_options(q, gate_width="per_head"), True, False)
    g_wide = g[..., None].expand(*g.shape, q.shape[-1]).contiguous()
    wide = (q, k, v, g_wide, beta, None, None, None, *_ops.problem_options(q), True, False)
    for mismatched in ((*args[:3], g_wide, *args[4:]), (*wide[:3], g, *wide[4:])):
        with torch.no_grad(), pytest.raises(ValueError, match="'g'"):
            _ops.forward(path, True, *mismatched)
    for direct in (True, False):
        with torch.no_grad():
            if path == "reference":
                o, final, _ = _ops.forward(path, direct, *args)
                o_wide, final_wide, _ = _ops.forward(path, direct, *wide)
                assert torch.equal(o, o_wide) and torch.equal(final, final_wide)
                continue
            o, final, _ = _ops.forward(path, direct, *args)
            o_wide, final_wide, _ = _ops.forward(path, direct, *wide)
            assert rel_rms(o, o_wide) <= 2e-6 and rel_rms(final, final_wide) <= 2e-6


# ---- a torch without the private probes ------------------------------------------------------------

_PROBES = [
    (torch._C, "_len_torch_dispatch_stack"),
    (torch._C, "_is_torch_function_mode_enabled"),
    (torch._C, "_are_functorch_transforms_active"),
    (torch._C._autograd, "_profiler_enabled"),
]


@pytest.mark.parametrize("owner,name", _PROBES, ids=[n for _, n in _PROBES])
def test_a_missing_probe_turns_the_fast_route_off(monkeypatch, owner, name):
    with monkeypatch.context() as hidden:  # torch itself needs the probe back before anything runs
        hidden.delattr(owner, name)
        probes = _ops._resolve_probes()
    assert probes is None
    assert _ops._resolve_probes() is not None
    monkeypatch.setattr(_ops, "_PROBES", probes)
    monkeypatch.setattr(_ops, "FAST_ROUTE", probes is not None)

    case = Case(B=2, T=1, H=1, HV=2, K=16, V=16, regime="unbounded", **KIMI)
    tensors, options = make_inputs(case)
    starts = options.pop("initial_state")
    forward_op = _count_op(monkeypatch, "forward", "chunk")
    decode_op = _count_op(monkeypatch, "decode")

    def calls():
        with torch.inference_mode():
            o, final = kda.chunk_kda(**tensors, initial_state=starts, output_final_state=True, **options)
            pool = starts.clone()
            o_decode, _ = kda.fused_recurrent_kda_fwd(
                **tensors, initial_state=pool, ssm_state_indices=torch.tensor([0, 1]), **options
            )
        return o, final, o_decode, pool

    without = calls()
    assert forward_op.calls == 1 and decode_op.calls == 1  # every call took its op
    monkeypatch.setattr(_ops, "_PROBES", _ops._resolve_probes())
    monkeypatch.setattr(_ops, "FAST_ROUTE", True)
    with_probes = calls()
    assert forward_op.calls == 1 and decode_op.calls == 1  # the fast route again
    assert all(_equal(a, b) for a, b in zip(without, with_probes, strict=True))


# ---- the serving module ------------------------------------------------------------------------------


def test_serving_functions_live_in_kda_serving():
    from kda import functional, serving

    assert kda.fused_recurrent_kda_fwd is serving.fused_recurrent_kda_fwd
    assert functional.fused_recurrent_kda_fwd is serving.fused_recurrent_kda_fwd
    assert kda.serving is serving
    assert "fused_recurrent_kda_fwd" in kda.__all__


def test_hub_folder_carries_the_serving_module(hub_folder):
    from kda import hub

    package = hub_folder / "build" / hub.variant_name() / "kda"
    for module in ("serving.py", "_arguments.py", "_ops.py", "functional.py"):
        assert (package / module).exists(), module
