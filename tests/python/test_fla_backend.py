"""kda registered with fla 0.6.0's backend registry (kda.fla_backend.register()): fla's own chunk_kda,
fused_recurrent_kda and chunk_gated_delta_rule, called on CPU tensors, run through kda and give kda's
results bit for bit; calls kda's verifier refuses go on to fla as before."""

import inspect
import warnings

import kda
import pytest
import torch
from harness import KIMI, Case, make_inputs

fla_kda = pytest.importorskip("fla.ops.kda")
fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule")
from kda import fla_backend  # noqa: E402


@pytest.fixture
def registered():
    fla_backend.register()
    fla_backend.register()  # idempotent
    assert fla_backend.registered()
    yield
    fla_backend.unregister()
    assert not fla_backend.registered()


def _grad_inputs(tensors, options):
    t = {n: x.clone().requires_grad_() for n, x in tensors.items()}
    o = {
        n: (x.clone().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x)
        for n, x in options.items()
    }
    return t, o


def _same_results_and_gradients(fla_function, kda_function, tensors, options):
    ours_t, ours_o = _grad_inputs(tensors, options)
    theirs_t, theirs_o = _grad_inputs(tensors, options)
    o, s = kda_function(**ours_t, output_final_state=True, **ours_o)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla's "Triton is not supported on current platform"
        o_fla, s_fla = fla_function(**theirs_t, output_final_state=True, **theirs_o)
    assert torch.equal(o, o_fla) and torch.equal(s, s_fla)
    (o.sum() + s.sum()).backward()
    (o_fla.sum() + s_fla.sum()).backward()
    for n in ours_t:
        assert torch.equal(ours_t[n].grad, theirs_t[n].grad), n
    for n, x in ours_o.items():
        if torch.is_tensor(x) and x.requires_grad:
            assert torch.equal(x.grad, theirs_o[n].grad), n


def test_fla_chunk_kda_runs_on_kda(registered):
    tensors, options = make_inputs(Case(T=90, H=1, HV=2, K=16, V=16, regime="unbounded", **KIMI))
    _same_results_and_gradients(fla_kda.chunk_kda, kda.chunk_kda, tensors, options)


def test_fla_fused_recurrent_kda_runs_on_kda_with_a_backward(registered):
    tensors, options = make_inputs(Case(T=20, H=1, HV=2, K=16, V=16, regime="strong", state_v_first=True))
    _same_results_and_gradients(fla_kda.fused_recurrent_kda, kda.fused_recurrent_kda, tensors, options)


def test_fla_chunk_gated_delta_rule_runs_on_kda(registered):
    tensors, options = make_inputs(
        Case(
            T=100,
            cu_seqlens=[0, 30, 100],
            H=1,
            HV=2,
            K=16,
            V=16,
            regime="unbounded",
            **KIMI,
            gate_width="per_head",
        )
    )
    _same_results_and_gradients(fla_gdn.chunk_gated_delta_rule, kda.chunk_gated_delta_rule, tensors, options)


def test_fla_serving_entry_runs_on_a_pool(registered):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    tensors, options = make_inputs(Case(B=3, T=1, H=1, HV=2, K=16, V=16, regime="unbounded", **KIMI))
    starts = options.pop("initial_state")
    pool, pool_fla = torch.zeros(5, 2, 16, 16), torch.zeros(5, 2, 16, 16)
    idx = torch.tensor([4, 0, 2])
    pool[idx] = pool_fla[idx] = starts
    with torch.no_grad():
        o, _ = kda.fused_recurrent_kda_fwd(**tensors, initial_state=pool, ssm_state_indices=idx, **options)
        o_fla, _ = fused_recurrent_kda_fwd(
            **tensors, initial_state=pool_fla, ssm_state_indices=idx, **options
        )
    assert torch.equal(o, o_fla) and torch.equal(pool, pool_fla)


def test_the_verifier_takes_cpu_tensors_only():
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert fla_backend.cpu_only(cpu, x=cpu) == (True, None)
    accepted, reason = fla_backend.cpu_only(cpu, initial_state=meta)
    assert not accepted and "meta" in reason
    assert not fla_backend.cpu_only(1, scale=0.5)[0]


def test_without_registration_fla_is_untouched():
    assert not fla_backend.registered()
    tensors, options = make_inputs(Case(T=10, K=8, V=8, gate_width="per_head"))
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="active drivers"):
        warnings.simplefilter("ignore")
        fla_gdn.chunk_gated_delta_rule(**tensors, **options)


def test_fla_fused_recurrent_gated_delta_rule_is_not_served(registered):
    """fla 0.6.0 calls its Triton kernel for fused_recurrent_gated_delta_rule without asking the registry
    (transformers' gated delta rule models decode through it): register() cannot serve it. When this
    fails, a newer fla dispatches the function, and kda.fla_backend can join its registry."""
    tensors, options = make_inputs(Case(T=1, H=1, HV=2, K=8, V=8, gate_width="per_head"))
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="active drivers"):
        warnings.simplefilter("ignore")
        fla_gdn.fused_recurrent_gated_delta_rule(**tensors, **options, output_final_state=True)


def test_fused_recurrent_kda_fwd_calls_bind_to_the_serving_signature():
    backend = fla_backend._backend_class()()
    tensors, options = make_inputs(Case(T=6, H=1, HV=2, K=8, V=8, regime="unbounded", **KIMI))
    q, k, v, g, beta = (tensors[n] for n in ("q", "k", "v", "g", "beta"))
    h0, scale = options.pop("initial_state"), options.pop("scale")
    A_log, dt_bias = options.pop("A_log"), options.pop("dt_bias")
    o_ref, s_ref = kda.fused_recurrent_kda(
        q, k, v, g, beta, A_log, dt_bias, scale, h0, output_final_state=True, **options
    )
    # Positional up to inplace_final_state=False: a fresh state, from kda's differentiable function.
    start = h0.clone()
    o, s = backend.fused_recurrent_kda_fwd(
        q, k, v, g, beta, A_log, dt_bias, h0, scale, True, False, **options
    )
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref) and torch.equal(h0, start)
    # inplace_final_state's default: the serving entry updates initial_state in place.
    with torch.no_grad():
        o, s = backend.fused_recurrent_kda_fwd(q, k, v, g, beta, A_log, dt_bias, h0, scale=scale, **options)
    # (the decode kernel, not the recurrent forward: the same results to rounding)
    assert s is h0 and torch.allclose(o, o_ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(h0, s_ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="beta"):  # Python's own error, from the serving entry
        backend.fused_recurrent_kda_fwd(q, k, v, g)
    with pytest.raises(TypeError, match="'bogus'"):
        backend.fused_recurrent_kda_fwd(q, k, v, g, beta, inplace_final_state=False, bogus=1)


def test_registration_with_fla_dispatch_disabled(monkeypatch):
    """FLA_DISABLE_BACKEND_DISPATCH=1: fla keeps no function registry and dispatches nothing."""
    import fla.backends as backends

    monkeypatch.setattr(backends, "_DISPATCH_DISABLED", True)
    monkeypatch.delitem(backends._function_registries, inspect.unwrap(fla_kda.chunk_kda))
    with pytest.warns(UserWarning, match="FLA_DISABLE_BACKEND_DISPATCH"):
        fla_backend.register()
    assert not fla_backend.registered()
    fla_backend.unregister()  # nothing to remove, and no KeyError
