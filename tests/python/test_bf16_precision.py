"""precision="bf16" (kda's addition to chunk_kda and chunk_gated_delta_rule): the chunked forward's
matrix products on bf16 operands, fp32 sums, on the CPU's bf16 unit. Against the float64 oracle within
definitions.txt's forward_bf16 limit in every gate regime, both families, fp32 and bf16 inputs; its
backward is the exact one (the same gradients as an exact forward given the bf16 forward's states,
within the exact limits); exact stays the default; bad values are errors naming the argument."""

import os

import kda
import pytest
import torch
from harness import GATE_SETTINGS, Case, as_oracle, make_inputs, rel_rms, tolerance

FUNCTIONS = {"per_key": "chunk_kda", "per_head": "chunk_gated_delta_rule"}


def _call(function, tensors, options, **extra):
    return getattr(kda, function)(**tensors, output_final_state=True, **options, **extra)


@pytest.mark.parametrize("gate_width", ["per_key", "per_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "regime,extra", GATE_SETTINGS, ids=[f"{r}-{e.get('gate', 'log')}" for r, e in GATE_SETTINGS]
)
def test_within_the_bf16_limit_of_the_oracle(regime, extra, dtype, gate_width):
    if gate_width == "per_head" and extra.get("gate") == "lower_bound":
        pytest.skip("the gated delta rule has no lower-bound gate (fla's chunk_gated_delta_rule)")
    case = Case(T=200, H=2, HV=4, K=64, V=48, regime=regime, dtype=dtype, gate_width=gate_width, **extra)
    tensors, options = make_inputs(case)
    function = FUNCTIONS[gate_width]
    o, final = _call(function, tensors, options, precision="bf16")
    want_o, want_final = _call(function, *as_oracle(tensors, options))
    assert o.dtype == dtype and final.dtype == torch.float32
    assert rel_rms(o, want_o) <= tolerance("forward_bf16", dtype, "o")
    assert rel_rms(final, want_final) <= tolerance("forward_bf16", torch.float32, "state")


def test_exact_is_the_default_and_bf16_differs():
    tensors, options = make_inputs(Case(T=130, K=64, V=64))
    exact, _ = kda.chunk_kda(**tensors, **options)
    named, _ = kda.chunk_kda(**tensors, **options, precision="exact")
    bf16, _ = kda.chunk_kda(**tensors, **options, precision="bf16")
    assert torch.equal(exact, named)
    assert not torch.equal(exact, bf16)  # the products really were rounded


def test_backward_is_the_exact_backward():
    case = Case(T=150, H=2, HV=2, K=32, V=32, regime="strong")
    tensors, options = make_inputs(case)
    grads = {}
    for precision in ("exact", "bf16"):
        inputs = {n: t.clone().requires_grad_() for n, t in tensors.items()}
        o, final = kda.chunk_kda(**inputs, **options, output_final_state=True, precision=precision)
        (o.sum() + final.sum()).backward()
        grads[precision] = {n: t.grad for n, t in inputs.items()}
    # The bf16 forward's states differ from the exact ones by bf16 rounding; the backward computes in
    # fp32 from them, so the gradients differ by that much, not more.
    for name in tensors:
        assert rel_rms(grads["bf16"][name], grads["exact"][name]) <= tolerance(
            "forward_bf16", torch.float32, "o"
        )


def test_bad_values_and_unsupported_combinations():
    tensors, options = make_inputs(Case(T=20))
    with pytest.raises(ValueError, match="precision"):
        kda.chunk_kda(**tensors, **options, precision="fp8")
    with pytest.raises(NotImplementedError, match="precision"):
        pool = torch.zeros(3, 2, 32, 32)
        kda.chunk_kda(
            **tensors,
            initial_state=pool,
            ssm_state_indices=torch.tensor([1]),
            precision="bf16",
        )
    with pytest.raises(TypeError, match="precision"):
        kda.fused_recurrent_kda(**tensors, **options, precision="bf16")


def test_engine_names_its_unit():
    units = kda.engine.bf16_product_units()
    models = ("amx_model", "avx512_bf16_model")
    assert units[-1] == "portable" and not set(models) & set(units)
    # The models (a native kernel over a model of its instructions, for tests) run only where
    # KDA_BF16_UNIT names them.
    unit = kda.engine.bf16_product_unit()
    if unit in models:
        assert os.environ.get("KDA_BF16_UNIT", "").lower() == unit
    else:
        assert unit in units


# fla's own bf16 criterion, as its test_kda / gated delta rule tests apply it to the chunked forward:
# fla.utils.testing.assert_close at a 0.005 ratio (the relative RMS error) for o and the final state,
# against fla's naive recurrence in float32 on the same bf16 inputs, with gates from logsigmoid scaled
# by the normalizers fla's tests sweep (1: mild, 0.1: strong, 10: weak).
@pytest.mark.parametrize("gate_width", ["per_key", "per_head"])
@pytest.mark.parametrize("normalizer", [1.0, 0.1, 10.0])
def test_fla_bf16_criterion(gate_width, normalizer):
    testing = pytest.importorskip("fla.utils.testing")
    if gate_width == "per_key":
        naive = pytest.importorskip("fla.ops.kda.naive").naive_recurrent_kda
    else:
        naive = pytest.importorskip("fla.ops.gated_delta_rule.naive").naive_recurrent_gated_delta_rule
    gen = torch.Generator().manual_seed(7)
    B, T, H, D = 2, 300, 2, 64
    gate_shape = (B, T, H, D) if gate_width == "per_key" else (B, T, H)
    q, k, v = (torch.rand(B, T, H, D, generator=gen).to(torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(gate_shape, generator=gen)) / normalizer
    beta = torch.rand(B, T, H, generator=gen).sigmoid().to(torch.bfloat16)
    h0 = torch.randn(B, H, D, D, generator=gen)
    # fla's tests normalise q and k in the kernel (use_qk_l2norm_in_kernel) and before the naive call.
    qn, kn = (torch.nn.functional.normalize(x.float(), p=2, dim=-1) for x in (q, k))
    # fla's naive gated delta rule takes beta before g.
    gate_args = (g, beta.float()) if gate_width == "per_key" else (beta.float(), g)
    ref, ref_ht = naive(qn, kn, v.float(), *gate_args, initial_state=h0.clone(), output_final_state=True)
    function = getattr(kda, FUNCTIONS[gate_width])
    tri, tri_ht = function(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        precision="bf16",
    )
    testing.assert_close("o", ref, tri.float(), 0.005)
    testing.assert_close("ht", ref_ht, tri_ht, 0.005)


def test_the_accuracy_bench_runs_and_stays_within_the_limit():
    # bench/bf16_accuracy.py, the curve docs/math.md quotes, at its smallest length: a row per family
    # and regime, each error within forward_bf16's limits (it had failed at its first case unnoticed).
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bf16_accuracy.py"
    out = subprocess.run(
        [sys.executable, str(script), "--T", "300"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["KDA"], ["GDN"])]
    assert {(r[0], r[1]) for r in rows} == {
        (f, g) for f in ("KDA", "GDN") for g in ("mild", "strong", "zero", "spike", "unbounded")
    }
    for family, regime, T, o_bf16, state_bf16, o_exact, state_exact, _ in rows:
        assert T == "300"
        assert float(o_bf16) <= tolerance("forward_bf16", torch.float32, "o"), (family, regime)
        assert float(state_bf16) <= tolerance("forward_bf16", torch.float32, "state"), (family, regime)
        assert float(o_exact) <= tolerance("forward", torch.float32, "o"), (family, regime)
        assert float(state_exact) <= tolerance("forward", torch.float32, "state"), (family, regime)


@pytest.mark.parametrize("gate_width", ["per_key", "per_head"])
def test_huge_queries_and_keys_stay_finite(gate_width):
    # The split form scales q and k by factors up to e^40 (docs/math.md, bf16 products, step 0); a
    # chunk whose scaled operands would overflow takes the per-block forms, which keep them at most
    # |q| and |k|. q at 1e30 (o ~1e30, inside fp32) must come out finite and within the limit.
    case = Case(T=130, H=1, HV=2, K=64, V=32, regime="mild", gate_width=gate_width)
    tensors, options = make_inputs(case)
    tensors["q"] = tensors["q"] * 1e30
    function = FUNCTIONS[gate_width]
    o, final = _call(function, tensors, options, precision="bf16")
    want_o, want_final = _call(function, *as_oracle(tensors, options))
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_rms(o, want_o) <= tolerance("forward_bf16", torch.float32, "o")
    assert rel_rms(final, want_final) <= tolerance("forward_bf16", torch.float32, "state")
