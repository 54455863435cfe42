"""The third operator family, the value-channel gate (kda._family.GV): fla's ``gv [B, T, HV, V]`` of
``fused_recurrent_gated_delta_rule``, one log decay per value channel, so that the state's value
columns decay before each token's delta-rule update. The float64 oracle computes its forward; the
kernels refuse it (not supported yet) and so does every other dtype, naming the gate."""

import kda
import numpy as np
import pytest
import torch
from kda._family import GV

GEN = torch.Generator().manual_seed(11)


def _inputs(B=2, T=37, H=1, HV=2, K=8, V=6, dtype=torch.float64):
    q = torch.randn(B, T, H, K, generator=GEN, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=GEN, dtype=dtype), dim=-1)
    v = torch.randn(B, T, HV, V, generator=GEN, dtype=dtype)
    gv = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, V, generator=GEN, dtype=dtype)) * 2
    beta = torch.rand(B, T, HV, generator=GEN, dtype=dtype)
    h0 = torch.randn(B, HV, K, V, generator=GEN, dtype=dtype)
    return q, k, v, gv, beta, h0


def _recurrence(q, k, v, gv, beta, h0, scale):
    """The value-channel gate's recurrence, token by token, in NumPy float64 (K-first states):
    S <- S diag(exp(gv_t)); S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = scale S^T q_t."""
    q, k, v, gv, beta, S = (t.numpy().astype(np.float64) for t in (q, k, v, gv, beta, h0))
    B, T, H, _ = q.shape
    HV = v.shape[2]
    S = S.copy()
    o = np.zeros(v.shape)
    for b in range(B):
        for hv in range(HV):
            h = hv // (HV // H)
            for t in range(T):
                S[b, hv] *= np.exp(gv[b, t, hv])[None, :]
                r = beta[b, t, hv] * (v[b, t, hv] - S[b, hv].T @ k[b, t, h])
                S[b, hv] += np.outer(k[b, t, h], r)
                o[b, t, hv] = scale * S[b, hv].T @ q[b, t, h]
    return o, S


@pytest.mark.parametrize("state_v_first", (False, True), ids=("k_first", "v_first"))
def test_the_oracle_computes_the_value_gate(state_v_first):
    q, k, v, gv, beta, h0 = _inputs()
    start = h0.transpose(-1, -2).contiguous() if state_v_first else h0
    o, final = kda.fused_recurrent_gated_delta_rule(
        q, k, v, gv=gv, beta=beta, initial_state=start, output_final_state=True, state_v_first=state_v_first
    )
    o_ref, final_ref = _recurrence(q, k, v, gv, beta, h0, scale=q.shape[-1] ** -0.5)
    if state_v_first:
        final = final.transpose(-1, -2)
    assert o.dtype == torch.float64 and final.dtype == torch.float64
    np.testing.assert_allclose(o.numpy(), o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(final.numpy(), final_ref, rtol=1e-12, atol=1e-12)


def test_varlen_and_strong_decays():
    """Packed sequences start from their own states; -1000 spikes and zero gates stay finite."""
    q, k, v, gv, beta, h0 = _inputs(B=1, T=40)
    gv[0, 5] = -1000.0
    gv[0, 30:] = 0.0
    cu = torch.tensor([0, 13, 13, 40])
    starts = torch.randn(3, *h0.shape[1:], generator=GEN, dtype=torch.float64)
    o, final = kda.fused_recurrent_gated_delta_rule(
        q, k, v, gv=gv, beta=beta, initial_state=starts, output_final_state=True, cu_seqlens=cu
    )
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    scale = q.shape[-1] ** -0.5
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        piece = [t[:, a:b] for t in (q, k, v, gv, beta)]
        o_ref, final_ref = _recurrence(*piece, starts[n : n + 1], scale)
        np.testing.assert_allclose(o[:, a:b].numpy(), o_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(final[n].numpy(), final_ref[0], rtol=1e-12, atol=1e-12)


def test_one_decay_for_every_column_is_the_gated_delta_rule():
    """A value gate that is the same for every column decays the whole state, as the per-head gate
    does: bitwise the same oracle results (the key rows' factor 1 is exact)."""
    q, k, v, gv, beta, h0 = _inputs()
    g = gv[..., 0]
    same = g[..., None].expand_as(gv).contiguous()
    o, final = kda.fused_recurrent_gated_delta_rule(
        q, k, v, gv=same, beta=beta, initial_state=h0, output_final_state=True
    )
    o_gdn, final_gdn = kda.fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True
    )
    assert torch.equal(o, o_gdn) and torch.equal(final, final_gdn)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_the_kernels_refuse_it(dtype):
    q, k, v, gv, beta, _ = (t.to(dtype) for t in _inputs())
    with pytest.raises(NotImplementedError, match="per value channel.*'gv'.*not supported yet"):
        kda.fused_recurrent_gated_delta_rule(q, k, v, gv=gv, beta=beta)


def test_no_backward_yet():
    q, k, v, gv, beta, h0 = _inputs(B=1, T=5)
    gv.requires_grad_()
    o, _ = kda.fused_recurrent_gated_delta_rule(q, k, v, gv=gv, beta=beta, initial_state=h0)
    with pytest.raises(ValueError, match="per_value.*no backward yet"):
        o.sum().backward()


def test_a_malformed_gv_is_named():
    q, k, v, gv, beta, _ = _inputs()
    for bad in (gv[..., :-1], gv[..., 0], gv[None]):
        with pytest.raises(ValueError, match="'?gv'? must"):
            kda.fused_recurrent_gated_delta_rule(q, k, v, gv=bad.contiguous(), beta=beta)
    assert GV.gate_shape(2, 37, 2, 8, 6) == (2, 37, 2, 6)
