"""kda against flash-linear-attention (fla-core 0.6.0, installed as a test dependency), for every
family: fla's naive PyTorch functions (naive_recurrent_kda and naive_chunk_kda for KDA, the
naive_*_gated_delta_rule ones for the gated delta rule), the only ones that run on the CPU, with
autograd through them for the gradients.

fla's naive functions take the log decay and beta as they are and compute in float32, so the fused
pre-processing (gate, beta sigmoid, L2 norm) is applied here with fla's own gate helpers and torch.
The naive chunked forms evaluate exp(G_i - G_j) unmasked and overflow for strong gates: they are
compared in the mild regimes only (naive_chunk_kda needs T to be a multiple of 64); the naive
recurrences in every regime.
"""

import kda
import pytest
import torch
import torch.nn.functional as F
from harness import (
    GATE_SETTINGS,
    KIMI,
    LOWER_BOUND,
    Case,
    family_cases,
    family_params,
    function_of,
    loss_weights,
    make_inputs,
    rel_rms,
    run,
)
from kda._family import GDN, KDA

kda_naive = pytest.importorskip("fla.ops.kda.naive")
gdn_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
fla_gate = pytest.importorskip("fla.ops.kda.gate")

KINDS = ("chunk", "recurrent")
# fla's naive functions of each family by form, and whether they take grouped value heads (the gated
# delta rule's do not: q and k are repeated to the value heads for them).
NAIVE = {
    KDA.name: (dict(recurrent=kda_naive.naive_recurrent_kda, chunk=kda_naive.naive_chunk_kda), True),
    GDN.name: (
        dict(
            recurrent=gdn_naive.naive_recurrent_gated_delta_rule, chunk=gdn_naive.naive_chunk_gated_delta_rule
        ),
        False,
    ),
}

# Both sides compute in float32 with different summation orders: agreement to a few fp32 roundings
# accumulated over the sequence.
FLA_FORWARD = 2e-5
FLA_BACKWARD = 1e-4


def _fla_preprocess(family, tensors, options):
    """The log decay, beta and normalised q/k that kda's fused options compute, via fla and torch."""
    q, k, g, beta = (tensors[n].float() for n in ("q", "k", "g", "beta"))
    if options.get("use_gate_in_kernel"):
        if not family.gate_channels:  # one decay per head: fla's gate helpers are KDA's
            g = -options["A_log"].exp() * F.softplus(g + options.get("dt_bias", 0))
        elif options.get("lower_bound") is not None:
            g = fla_gate.naive_kda_lowerbound_gate(
                g, options["A_log"], options["dt_bias"], options["lower_bound"]
            )
        else:
            g = fla_gate.naive_kda_gate(g, options["A_log"], options["dt_bias"])
    if options.get("use_beta_sigmoid_in_kernel"):
        beta = beta.sigmoid() * (2.0 if options.get("allow_neg_eigval") else 1.0)
    if options.get("use_qk_l2norm_in_kernel"):
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    return q, k, g, beta


def _fla(family, form, tensors, options, requires_grad):
    """fla's naive function of the family in `form` (recurrent, chunk) on the same problem."""
    naive, grouped_heads = NAIVE[family.name]
    inputs = {n: t.detach().clone().requires_grad_(requires_grad) for n, t in tensors.items()}
    opts = dict(options)
    for name in ("initial_state", "A_log", "dt_bias"):
        if opts.get(name) is not None:
            opts[name] = opts[name].detach().clone().requires_grad_(requires_grad)
            inputs[name] = opts[name]
    q, k, g, beta = _fla_preprocess(family, inputs, opts)
    if not grouped_heads:
        groups = inputs["v"].shape[2] // q.shape[2]
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    o, final = naive[form](
        q=q,
        k=k,
        v=inputs["v"],
        g=g,
        beta=beta,
        scale=opts.get("scale"),
        initial_state=opts.get("initial_state"),
        output_final_state=True,
        **(dict(chunk_size=64) if form == "chunk" else {}),
    )
    return o, final, inputs


def _compare(family, kind, form, case):
    """kda's function of the kind against fla's naive function in `form`: outputs and every gradient."""
    tensors, options = make_inputs(case)
    o, final, inputs = run(function_of(family, kind), tensors, options, requires_grad=True)
    o_fla, final_fla, inputs_fla = _fla(family, form, tensors, options, requires_grad=True)
    assert rel_rms(o, o_fla) <= FLA_FORWARD
    assert rel_rms(final, final_fla) <= FLA_FORWARD
    w_o, w_s = loss_weights(o, final, round_to=o.dtype)
    ((o.double() * w_o).sum() + (final.double() * w_s).sum()).backward()
    ((o_fla.double() * w_o).sum() + (final_fla.double() * w_s).sum()).backward()
    for name, t in inputs.items():
        assert rel_rms(t.grad, inputs_fla[name].grad) <= FLA_BACKWARD, name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "family, case",
    family_cases(
        [
            Case(B=2, T=100, H=2, HV=4, K=32, V=32, regime=r, **options, seed=i)
            for i, (r, options) in enumerate(GATE_SETTINGS)
        ]
        + [
            Case(T=1, regime="unbounded", **KIMI),
            Case(T=77, K=64, V=16, regime="mild", scale=1.0, initial_state=False),
        ]
        + [
            Case(T=150, H=2, HV=2, K=32, V=32, regime=regime, **options, seed=i)
            for i, (regime, options) in enumerate(
                (("strong", {}), ("spike", {}), ("unbounded", KIMI), ("strong", LOWER_BOUND))
            )
        ]
        + [
            Case(B=2, T=80, H=1, HV=2, K=16, V=16, regime=regime, **options, seed=3)
            for regime, options in GATE_SETTINGS
        ]
    ),
)
def test_matches_fla_naive_recurrent_in_every_regime(family, case, kind):
    _compare(family, kind, "recurrent", case)


_NAIVE_CHUNK_CASES = [
    Case(B=2, T=128, H=2, HV=2, K=32, V=32, regime="mild"),
    Case(T=64, H=1, HV=2, K=64, V=64, regime="zero"),
    Case(T=192, regime="mild", initial_state=False, seed=3),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "family, case",
    family_cases(_NAIVE_CHUNK_CASES)
    # (T = 100: naive_chunk_kda takes whole chunks only)
    + family_cases([Case(B=2, T=100, H=2, HV=2, K=16, V=16, regime="mild", seed=5)], families=(GDN,)),
)
def test_matches_fla_naive_chunk(family, case, kind):
    _compare(family, kind, "chunk", case)


@pytest.mark.parametrize("lower_bound", (None, -5.0, -2.0))
@pytest.mark.parametrize("with_A_log", (True, False))
def test_gate_matches_fla(lower_bound, with_A_log):
    if lower_bound is None and not with_A_log:
        pytest.skip("the softplus gate needs A_log")
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(2, 9, 4, 16, generator=gen) * 3).bfloat16()
    A_log = torch.randn(4, generator=gen) if with_A_log else None
    dt_bias = torch.randn(64, generator=gen)
    ours = [t.clone().requires_grad_() if t is not None else None for t in (g, A_log, dt_bias)]
    theirs = [t.clone().requires_grad_() if t is not None else None for t in (g, A_log, dt_bias)]
    y = kda.fused_kda_gate(*ours, lower_bound=lower_bound)
    if lower_bound is None:
        y_ref = fla_gate.naive_kda_gate(*theirs)
    else:
        y_ref = fla_gate.naive_kda_lowerbound_gate(*theirs, lower_bound=lower_bound)
    assert y.dtype == torch.float32
    assert rel_rms(y, y_ref) <= 1e-6
    w = torch.randn(y.shape, generator=gen)
    (y * w).sum().backward()
    (y_ref * w).sum().backward()
    for a, b in zip(ours, theirs, strict=True):
        if a is not None:
            assert a.grad.dtype == a.dtype
            assert rel_rms(a.grad.float(), b.grad.float()) <= 1e-5
    assert (
        kda.fused_kda_gate(g, A_log, dt_bias, lower_bound, output_dtype=torch.bfloat16).dtype
        == torch.bfloat16
    )


@pytest.mark.parametrize("A_log", [None, 100.0], ids=["case", "A_log=100"])
def test_fused_gate_equals_gate_then_kernel(A_log):
    """chunk_kda(use_gate_in_kernel=True) equals fused_kda_gate followed by chunk_kda on the log decay,
    also where exp(A_log) passes fp32's range: both clamp it and the log decay to the largest float
    (fla's fused_kda_gate gives -inf and NaN there)."""
    tensors, options = make_inputs(Case(T=90, regime="unbounded", **KIMI))
    if A_log is not None:
        options["A_log"] = torch.full_like(options["A_log"], A_log)
    with torch.no_grad():
        o_fused, s_fused, _ = run("chunk_kda", tensors, options)
        g = kda.fused_kda_gate(tensors["g"], options["A_log"], options["dt_bias"])
        unfused = {k: v for k, v in options.items() if k not in ("A_log", "dt_bias", "use_gate_in_kernel")}
        o, s, _ = run("chunk_kda", dict(tensors, g=g), unfused)
    assert torch.isfinite(g).all() and torch.isfinite(o).all()
    assert rel_rms(o_fused, o) <= 2e-6 and rel_rms(s_fused, s) <= 2e-6


@pytest.mark.parametrize("family", family_params())
def test_fla_reference_itself_agrees_with_the_oracle(family):
    """Guards the comparisons above: fla's naive recurrence is itself within fp32 rounding of kda's
    float64 oracle (so an agreement with it means something)."""
    tensors, options = make_inputs(Case(T=100, regime="mild", gate_width=family.gate_width))
    with torch.no_grad():
        o_fla, _, _ = _fla(family, "recurrent", tensors, options, requires_grad=False)
        t64 = {n: t.double() for n, t in tensors.items()}
        o64, _ = getattr(kda, family.recurrent_function)(
            **t64, **dict(options, initial_state=options["initial_state"].double())
        )
    assert rel_rms(o_fla, o64) <= FLA_FORWARD
    assert F.mse_loss(o_fla.double(), o64).item() > 0  # two different computations
