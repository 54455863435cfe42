"""A NaN in an input reaches exactly the outputs and gradients it touches, as in the float64 oracle
(and in torch): never hidden (a NaN gate once passed for "no decay": the clamp min(g, 0) and the
exponential dropped it), never spread to what the recurrence does not tie to it (a zero of a
triangular mask times a NaN row is NaN). Every entry point, fp32 and bf16, forward and backward,
and the decode on a pool; the elements that stay numbers match the oracle."""

import kda
import pytest
import torch
from harness import rel_rms, tolerance

B, T, H, K, V = 1, 150, 2, 32, 32
AT = (0, 70, 1)  # batch, token, head of the NaN: inside the second chunk of 64

ENTRIES = {
    "chunk_kda": (kda.chunk_kda, False),
    "fused_recurrent_kda": (kda.fused_recurrent_kda, False),
    "chunk_gated_delta_rule": (kda.chunk_gated_delta_rule, True),
    "fused_recurrent_gated_delta_rule": (kda.fused_recurrent_gated_delta_rule, True),
}
POISONED = ("g", "A_log", "beta", "q", "k", "v")
# (fla's chunk_gated_delta_rule has no fused gate: no A_log there.)
CASES = [(e, p) for e in ENTRIES for p in POISONED if (e, p) != ("chunk_gated_delta_rule", "A_log")]
# The tolerance table's quantity for each result. dA_log and ddt_bias sum dg over the tokens: the
# table bounds them against the terms' magnitudes (harness.sum_error); here, with one NaN head, their
# relative error is held to dg's limit.
QUANTITY = dict(final_state="state", dA_log="dg", ddt_bias="dg")


def _inputs(per_head, poisoned, dtype, fused):
    """The inputs in `dtype` (A_log, dt_bias in float32), leaves of the graph."""
    gen = torch.Generator().manual_seed(5)
    x = {
        "q": torch.randn(B, T, H, K, generator=gen),
        "k": torch.randn(B, T, H, K, generator=gen),
        "v": torch.randn(B, T, H, V, generator=gen),
        "g": torch.randn(B, T, H, *(() if per_head else (K,)), generator=gen),
        "beta": torch.randn(B, T, H, generator=gen),
    }
    if not fused:
        x["g"] = -torch.nn.functional.softplus(x["g"])
    gate = {
        "A_log": torch.rand(H, generator=gen),
        "dt_bias": torch.rand(H if per_head else H * K, generator=gen),
    }
    if poisoned == "A_log":
        gate["A_log"][AT[2]] = float("nan")
    elif poisoned in ("g", "beta"):
        x[poisoned][AT] = float("nan")
    else:
        x[poisoned][AT + (3,)] = float("nan")
    x = {n: t.to(dtype).requires_grad_() for n, t in x.items()}
    if fused:
        x.update({n: t.requires_grad_() for n, t in gate.items()})
    return x


def _run(entry, x, fused):
    fn = ENTRIES[entry][0]
    options = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True)
    if fused:
        options["use_gate_in_kernel"] = True
    o, state = fn(**x, **options)
    (o.float().sum() + state.float().sum()).backward()
    results = {"o": o.detach(), "final_state": state.detach()}
    results.update({"d" + n: t.grad for n, t in x.items()})
    return results


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize(("entry", "poisoned"), CASES)
def test_a_nan_reaches_what_it_touches_and_nothing_else(entry, poisoned, dtype):
    fused = poisoned == "A_log" or entry != "chunk_gated_delta_rule"
    x = _inputs(ENTRIES[entry][1], poisoned, dtype, fused)
    got = _run(entry, x, fused)
    # The oracle on the same (rounded) values.
    want = _run(entry, {n: t.detach().double().requires_grad_() for n, t in x.items()}, fused)
    assert torch.isnan(want["o"]).any()
    for name, ref in want.items():
        have = got[name].double()
        nan_have, nan_ref = int(torch.isnan(have).sum()), int(torch.isnan(ref).sum())
        assert torch.equal(torch.isnan(have), torch.isnan(ref)), (
            f"{name}: NaN at {nan_have}, the oracle at {nan_ref}"
        )
        finite = ~torch.isnan(ref)
        if finite.any():
            quantity = QUANTITY.get(name, name)
            path = "forward" if quantity in ("o", "state") else "backward"
            err = rel_rms(have[finite], ref[finite])
            assert err <= tolerance(path, dtype, quantity), f"{name}: relative RMS error {err:.2e}"


@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("per_head", (False, True), ids=("kda", "gdn"))
def test_a_nan_gate_in_a_decode_step_reaches_its_slot_only(per_head, pool_dtype):
    N, slots = 4, 8
    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(N, 1, H, K, generator=gen), torch.randn(N, 1, H, K, generator=gen)
    v = torch.randn(N, 1, H, V, generator=gen)
    g = -torch.rand(N, 1, H, *(() if per_head else (K,)), generator=gen)
    beta = torch.rand(N, 1, H, generator=gen)
    g[2, 0, 1] = float("nan")
    pool = torch.randn(slots, H, K, V, generator=gen).to(pool_dtype)
    before = pool.clone()
    indices = torch.tensor([5, 0, 3, 6])
    decode = kda.serving.fused_recurrent_gdn_fwd if per_head else kda.serving.fused_recurrent_kda_fwd
    with torch.inference_mode():
        o, _ = decode(
            q, k, v, g, beta, initial_state=pool, ssm_state_indices=indices, use_qk_l2norm_in_kernel=True
        )
    nan_o = torch.isnan(o.reshape(N, H, V))
    assert nan_o[2, 1].all() and nan_o.sum() == V, "the NaN gate's request and head only"
    nan_pool = torch.isnan(pool.float())
    assert nan_pool[3, 1].all() and nan_pool.sum() == K * V, "the NaN gate's slot and head only"
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[indices] = False
    assert torch.equal(pool[untouched], before[untouched])
