"""The gated delta rule's own cases (GDN: one log decay per token and value head, g [B, T, HV]) for
kda.chunk_gated_delta_rule and kda.fused_recurrent_gated_delta_rule: the scalar gate as KDA's gate
repeated over the key channels, transformers' torch functions (and the hub layers' chunk_size) with
autograd, fla's gate arguments (gk, gv), short names and chunk sizes, and bad input. The cases every
family shares are in test_parity.py (the oracle in every gate regime), test_ops.py (opcheck,
torch.compile, gradcheck), test_fla.py (fla's naive functions), test_serving.py and
test_transformers.py."""

import inspect
import warnings

import kda
import pytest
import torch
from harness import (
    KIMI,
    Case,
    gradients,
    make_inputs,
    rel_rms,
)

FUNCTIONS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
GDN = dict(gate_width="per_head")


def test_the_scalar_gate_is_kda_with_the_gate_repeated_over_the_key_channels():
    """GDN on g equals KDA on g broadcast over K, and dg is KDA's dg summed over the key channels."""
    tensors, options = make_inputs(Case(B=2, T=90, H=1, HV=2, K=16, V=16, regime="unbounded", **KIMI, **GDN))
    broadcast = dict(options, dt_bias=options["dt_bias"].repeat_interleave(16))
    for gdn, kda_function in (
        ("chunk_gated_delta_rule", "chunk_kda"),
        ("fused_recurrent_gated_delta_rule", "fused_recurrent_kda"),
    ):
        o, s, grads = gradients(gdn, tensors, options)
        wide = dict(tensors, g=tensors["g"].unsqueeze(-1).expand(-1, -1, -1, 16).contiguous())
        o_k, s_k, grads_k = gradients(kda_function, wide, broadcast)
        assert rel_rms(o, o_k) <= 2e-6 and rel_rms(s, s_k) <= 2e-6
        assert rel_rms(grads["g"], grads_k["g"].sum(-1)) <= 1e-5
        assert rel_rms(grads["dt_bias"], grads_k["dt_bias"].view(2, 16).sum(-1)) <= 1e-5
        for name in ("q", "k", "v", "beta", "A_log", "initial_state"):
            assert rel_rms(grads[name], grads_k[name]) <= 1e-5, name


# ---- transformers' torch functions ----------------------------------------------------------------


def _torch_function(decorated):
    """transformers' torch function itself: its hub decorator turns it into a kernels module whose
    forward calls a wrapper that prefers fla (installed in this process) over the torch code."""
    if isinstance(decorated, torch.nn.Module):
        decorated = inspect.getclosurevars(type(decorated).forward).nonlocals["func"]
    return inspect.unwrap(decorated)


def test_layers_match_transformers_torch_functions():
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from kda import layers

    gen = torch.Generator().manual_seed(2)
    B, T, HV, K, V = 2, 70, 4, 16, 8  # q/k already expanded to the value heads, as the models do
    base = dict(
        query=torch.randn(B, T, HV, K, generator=gen),
        key=torch.randn(B, T, HV, K, generator=gen),
        value=torch.randn(B, T, HV, V, generator=gen),
        g=-3 * torch.rand(B, T, HV, generator=gen),
        beta=torch.rand(B, T, HV, generator=gen),
        initial_state=torch.randn(B, HV, K, V, generator=gen),
    )
    for layer, reference, length in (
        (layers.chunk_gated_delta_rule(), qwen.torch_chunk_gated_delta_rule, T),
        (layers.recurrent_gated_delta_rule(), qwen.torch_recurrent_gated_delta_rule, 1),
    ):
        ours = {
            n: (t[:, :length] if t.dim() > 3 or n in ("g", "beta") else t).clone().requires_grad_()
            for n, t in base.items()
        }
        ours["initial_state"] = base["initial_state"].clone().requires_grad_()
        theirs = {n: t.detach().clone().requires_grad_() for n, t in ours.items()}
        o, s = layer(**ours, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_ref, s_ref = _torch_function(reference)(
            **theirs, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert o.dtype == o_ref.dtype and s.dtype == s_ref.dtype
        assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(s, s_ref) <= 1e-5
        w = torch.randn(o.shape, generator=gen)
        ((o * w).sum() + s.sum()).backward()
        ((o_ref * w).sum() + s_ref.sum()).backward()
        for n in ours:
            assert rel_rms(ours[n].grad, theirs[n].grad) <= 1e-4, n


def test_chunk_layers_forward_chunk_size(monkeypatch):
    """transformers' chunked torch functions take chunk_size (default 64): the hub layers hand it on."""
    from kda import layers

    seen = {}

    def recorder(name):
        def call(*args, **kwargs):
            seen[name] = kwargs["chunk_size"]
            return None, None

        return call

    monkeypatch.setattr(layers, "chunk_kda", recorder("kda"))
    monkeypatch.setattr(layers._gdn, "chunk_gated_delta_rule", recorder("gdn"))
    x = torch.zeros(1)
    for layer, name in (
        (layers.chunk_kimi_delta_attention(), "kda"),
        (layers.chunk_gated_delta_rule(), "gdn"),
    ):
        layer(x, x, x, x, x, 32)
        assert seen.pop(name) == 32
        layer(query=x, key=x, value=x, g=x, beta=x, chunk_size=16)
        assert seen.pop(name) == 16
        layer(x, x, x, x, x)
        assert seen.pop(name) == 64


# ---- fla's other gates and defaults ----------------------------------------------------------------


def test_gk_per_key_channel_is_kda():
    tensors, options = make_inputs(Case(B=2, T=50, H=1, HV=2, K=16, V=16, regime="strong"))
    t = dict(tensors)
    gk = t.pop("g")
    o, s = kda.fused_recurrent_gated_delta_rule(**t, gk=gk, output_final_state=True, **options)
    o_ref, s_ref = kda.fused_recurrent_kda(**tensors, output_final_state=True, **options)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_no_gate_and_no_beta():
    tensors, options = make_inputs(Case(B=2, T=30, H=1, HV=2, K=8, V=8, regime="zero", **GDN))
    o, s = kda.fused_recurrent_gated_delta_rule(
        tensors["q"],
        tensors["k"],
        tensors["v"],
        output_final_state=True,
        initial_state=options["initial_state"],
    )
    ones = torch.ones_like(tensors["beta"])
    o_ref, s_ref = kda.fused_recurrent_gated_delta_rule(
        **dict(tensors, beta=ones), output_final_state=True, initial_state=options["initial_state"]
    )
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)  # regime zero: g = 0


def test_gv_and_two_gates_are_refused():
    tensors, _ = make_inputs(Case(T=10, H=1, HV=2, K=8, V=8, **GDN))
    gk = torch.zeros(1, 10, 2, 8)
    with pytest.raises(NotImplementedError, match="'gv'"):
        kda.fused_recurrent_gated_delta_rule(**tensors, gv=torch.zeros(1, 10, 2, 8))
    with pytest.raises(ValueError, match="'g'.*'gk'"):
        kda.fused_recurrent_gated_delta_rule(**tensors, gk=gk)
    t = dict(tensors)
    del t["g"]
    with pytest.raises(ValueError, match="needs g"):  # fla's fused gate applies to g only
        kda.fused_recurrent_gated_delta_rule(**t, gk=gk, use_gate_in_kernel=True, A_log=torch.zeros(2))


def test_beta_in_gks_place_is_named():
    """fla's fused_recurrent_gated_delta_rule takes (q, k, v, g, gk, gv, beta): a call written as
    chunk_gated_delta_rule's (q, k, v, g, beta) puts beta in gk's place, and the message says so."""
    t, _ = make_inputs(Case(T=10, H=1, HV=2, K=8, V=8, **GDN))
    with pytest.raises(
        ValueError, match="not both; 'gk' got a \\[B, T, HV\\] tensor: fla's fifth positional"
    ):
        kda.fused_recurrent_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"])
    with pytest.raises(ValueError, match="fifth positional parameter here is gk, not beta"):
        kda.fused_recurrent_gated_delta_rule(t["q"], t["k"], t["v"], None, t["beta"])
    with pytest.raises(ValueError, match="not both$"):  # a real second gate gets no such hint
        kda.fused_recurrent_gated_delta_rule(**t, gk=torch.zeros(1, 10, 2, 8))


def test_a_malformed_gk_is_named_gk():
    """gk goes on to fused_recurrent_kda, whose messages name its gate 'g': gk is checked first."""
    tensors, _ = make_inputs(Case(B=2, T=10, H=1, HV=2, K=8, V=4, **GDN))
    t = dict(tensors)
    del t["g"]
    bad = [
        ("'gk' must be a 4-D tensor \\[B, T, HV, K\\]", torch.zeros(2, 10, 2)),  # the per-head gate
        ("'gk' must be a 4-D tensor", torch.zeros(2, 10, 2, 8, 1)),
        ("gk must have shape \\[B, T, HV, K\\]=\\[2, 10, 2, 8\\]", torch.zeros(2, 10, 2, 4)),  # K of v
        ("gk must have shape", torch.zeros(2, 10, 1, 8)),
        ("gk must have shape", torch.zeros(1, 10, 2, 8)),
        ("gk must have shape", torch.zeros(2, 9, 2, 8)),
    ]
    for message, gk in bad:
        with pytest.raises(ValueError, match=message):
            kda.fused_recurrent_gated_delta_rule(**t, gk=gk)
    with pytest.raises(NotImplementedError, match="'gk' is on meta"):
        kda.fused_recurrent_gated_delta_rule(**t, gk=torch.zeros(2, 10, 2, 8, device="meta"))


def test_gk_takes_the_gated_delta_rules_exception_types():
    """fused_recurrent_kda asserts on shapes (fla's KDA); through gk the errors are those the same call
    with g raises, and a gate of the wrong dtype is named gk."""
    q, v, beta = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.rand(1, 4, 2)
    R = kda.fused_recurrent_gated_delta_rule
    for gate in (dict(g=torch.zeros(1, 4, 2)), dict(gk=torch.zeros(1, 4, 2, 8))):
        with pytest.raises(ValueError, match="q and k must have the same shape"):
            R(q, torch.randn(1, 4, 1, 8), v, beta=beta, **gate)
        with pytest.raises(ValueError, match="num_v_heads"):
            R(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8), v, beta=beta, **gate)
    wide = torch.randn(1, 4, 1, 300)
    with pytest.raises(NotImplementedError, match="key head dims up to 256"):
        R(wide, wide, torch.randn(1, 4, 1, 8), gk=torch.zeros(1, 4, 1, 300), beta=torch.ones(1, 4, 1))
    with pytest.raises(TypeError, match="'gk' must be a floating-point tensor"):
        R(q, q, v, gk=torch.zeros(1, 4, 2, 8, dtype=torch.int32), beta=beta)


def test_short_names_and_chunk_size():
    assert kda.chunk_gdn is kda.chunk_gated_delta_rule
    assert kda.fused_recurrent_gdn is kda.fused_recurrent_gated_delta_rule
    tensors, options = make_inputs(Case(T=40, **GDN))
    o, s = kda.chunk_gated_delta_rule(**tensors, output_final_state=True, **options)
    for chunk_size in (16, 32):
        o2, s2 = kda.chunk_gated_delta_rule(
            **tensors, output_final_state=True, chunk_size=chunk_size, **options
        )
        assert torch.equal(o, o2) and torch.equal(s, s2)


# ---- bad input ------------------------------------------------------------------------------------


def _all_tensors(tensors, options):
    return {**tensors, **{n: v for n, v in options.items() if torch.is_tensor(v)}}


@pytest.mark.parametrize("function", FUNCTIONS)
def test_bad_input_is_named_and_nothing_is_written(function):
    tensors, options = make_inputs(Case(T=20, H=1, HV=2, K=8, V=8, regime="unbounded", **KIMI, **GDN))
    before = {n: t.clone() for n, t in _all_tensors(tensors, options).items()}
    call = getattr(kda, function)
    bad = [
        (ValueError, "'g' of the gated delta rule must be \\[B, T, HV\\]", dict(g=torch.randn(1, 20, 2, 8))),
        (ValueError, "g must have shape \\[B, T, HV\\]", dict(g=torch.randn(1, 20, 3))),
        (ValueError, "'dt_bias': expected 2 elements", dict(dt_bias=torch.zeros(16))),  # KDA's [HV*K]
        (ValueError, "'A_log': expected 2 elements", dict(A_log=torch.zeros(16))),
        (
            ValueError,
            "num_v_heads",
            dict(
                q=torch.randn(1, 20, 2, 8),
                k=torch.randn(1, 20, 2, 8),
                v=torch.randn(1, 20, 3, 8),
                g=torch.randn(1, 20, 3),
                beta=torch.rand(1, 20, 3),
            ),
        ),
        (ValueError, "q and k", dict(k=torch.randn(1, 20, 2, 8))),
        (ValueError, "'initial_state': expected shape", dict(initial_state=torch.zeros(1, 2, 8, 9))),
        (TypeError, "'chunk_sizes'", dict(chunk_sizes=64)),
        (NotImplementedError, "CPU.*'g' is on meta", dict(g=tensors["g"].to("meta"))),
        (NotImplementedError, "headwise", dict(beta=torch.rand(1, 20, 2, 8))),
        (ValueError, "allow_neg_eigval", dict(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False)),
    ]
    for error, message, override in bad:
        args = dict(tensors)
        opts = dict(options)
        for n, x in override.items():
            (args if n in args else opts)[n] = x
        with pytest.raises(error, match=message):
            call(**args, output_final_state=True, **opts)
    with pytest.raises(AssertionError if function == "chunk_gated_delta_rule" else ValueError, match="A_log"):
        call(**tensors, **dict(options, A_log=None))
    for n, t in _all_tensors(tensors, options).items():
        assert torch.equal(t, before[n]), n


def test_chunk_specific_checks():
    tensors, options = make_inputs(Case(T=20, K=8, V=8, **GDN))
    with pytest.raises(ValueError, match="chunk_size"):
        kda.chunk_gated_delta_rule(**tensors, **options, chunk_size=128)
    with pytest.raises(TypeError, match="'cp_context'"):  # kda.cp's contexts only (test_cp.py)
        kda.chunk_gated_delta_rule(**tensors, **options, cp_context=object())
    with pytest.raises(DeprecationWarning, match="head_first"):
        kda.chunk_gated_delta_rule(**tensors, **options, head_first=False)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="batch size"):
        kda.chunk_gated_delta_rule(
            **{n: t.expand(2, *t.shape[1:]) for n, t in tensors.items()},
            cu_seqlens=torch.tensor([0, 20]),
        )


def test_kda_functions_refuse_a_per_head_gate():
    tensors, options = make_inputs(Case(T=20, K=8, V=8, **GDN))
    for function in ("chunk_kda", "fused_recurrent_kda"):
        with pytest.raises(ValueError, match="'g' must be a 4-D tensor"):
            getattr(kda, function)(**tensors, **options)
    pool = torch.zeros(4, 2, 8, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="'g' must be a 4-D tensor"):
        kda.fused_recurrent_kda_fwd(
            **{n: t[:, :1] for n, t in tensors.items()},
            initial_state=pool,
            ssm_state_indices=torch.tensor([1]),
        )
    assert not pool.any()
