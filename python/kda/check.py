"""The installed engine against its float64 oracle: a parity check that needs only NumPy.

    python -m kda.check [--T N] [--threads N]

For an installed wheel, where the C++ tool ``kda check`` is not at hand: both operator families (KDA's
per-key gate, the gated delta rule's per-head gate) in five gate regimes (mild, strong, zero, -1000
spikes, the unbounded softplus gate of Kimi-Linear-48B with a large A_log), a packed varlen batch
with grouped value heads, and each exact path (the chunked forward, the token-by-token forward, the
chunked backward) against ``kda.engine.reference_forward`` / ``reference_backward`` on the same fp32
inputs. Prints one line per case and exits 1 when a relative RMS error passes its limit (the fp32
limits of harness/definitions.txt: 2e-6 forward, 1e-5 gradients) or a result is not finite. The
torch layer and its suites are tested by the repository's pytest suites; this is the engine alone.
"""

import argparse
import sys

import numpy as np

from . import _engine as engine
from ._family import FAMILIES

FORWARD_LIMIT = 2e-6  # harness/definitions.txt: tolerance forward f32
BACKWARD_LIMIT = 1e-5  # harness/definitions.txt: tolerance backward f32
REGIMES = ("mild", "strong", "zero", "spike", "unbounded")


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _inputs(rng, family, regime, B, T, H, HV, K, V):
    """fp32 inputs of one case of the family (kda._family; the distributions of
    harness/definitions.txt, drawn with NumPy)."""
    gshape = family.gate_shape(B, T, HV, K, V)
    G = family.dt_bias_size(HV, K, V) // HV
    f32 = np.float32
    q = rng.standard_normal((B, T, H, K)).astype(f32)
    k = rng.standard_normal((B, T, H, K))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(f32)
    v = rng.standard_normal((B, T, HV, V)).astype(f32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV))))).astype(f32)
    state = (0.5 * rng.standard_normal((B, HV, K, V))).astype(f32)
    fused = {}
    if regime == "unbounded":  # raw gate through the fused softplus: log decays down to -1e3
        fused["A_log"] = rng.uniform(3, 5, HV).astype(f32)
        fused["dt_bias"] = (0.5 * rng.standard_normal(HV * G)).astype(f32)
        g = (6.0 * rng.standard_normal(gshape)).astype(f32)
    elif regime == "zero":
        g = np.zeros(gshape, f32)
    else:
        g = (_log_sigmoid(rng.standard_normal(gshape)) * (5.0 if regime == "strong" else 1.0)).astype(f32)
        if regime == "spike":  # e^-1000 on a few tokens of every head
            for t in rng.choice(T, size=min(3, T), replace=False):
                g[:, t] = -1000.0
    return dict(q=q, k=k, v=v, g=g, beta=beta), state, fused


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    scale = np.sqrt(np.mean(ref * ref))
    return float(np.sqrt(np.mean((x - ref) ** 2)) / (scale if scale > 0 else 1.0))


def _case(rng, family, regime, T, threads, varlen=False):
    B, H, HV, K, V = (1, 1, 2, 32, 24) if varlen else (2, 2, 2, 32, 24)
    x, state, fused = _inputs(rng, family, regime, B, T, H, HV, K, V)
    cu = np.array([0, T // 3, T // 3, T], np.int64) if varlen else None
    gate = "softplus" if fused else "log_decay"
    problem = engine.prepare(x["q"], x["v"], cu_seqlens=cu, gate=gate, gate_width=family.gate_width)
    n = problem.num_sequences
    h0 = np.ascontiguousarray(np.resize(state, (n, *state.shape[1:])))
    wide = {name: a.astype(np.float64) for name, a in x.items()}
    wfused = {name: a.astype(np.float64) for name, a in fused.items()}
    o_ref = np.zeros(x["v"].shape, np.float64)
    ht_ref = np.zeros(h0.shape, np.float64)
    engine.reference_forward(
        problem, *wide.values(), o_ref, initial_state=h0.astype(np.float64), final_state=ht_ref, **wfused
    )
    errors = {}
    for path in ("chunk_forward", "recurrent_forward"):
        o, ht = np.zeros(x["v"].shape, np.float32), np.zeros(h0.shape, np.float32)
        getattr(engine, path)(
            problem, *x.values(), o, initial_state=h0, final_state=ht, num_threads=threads, **fused
        )
        errors[path] = (max(_rel(o, o_ref), _rel(ht, ht_ref)), FORWARD_LIMIT)
    # The chunked backward of (o . d_o + ht . d_ht), against the oracle's.
    d_o = rng.standard_normal(x["v"].shape).astype(np.float32)
    d_ht = rng.standard_normal(h0.shape).astype(np.float32)
    chunk_states = np.zeros((problem.num_chunks, *problem.state_shape), np.float32)
    o = np.zeros(x["v"].shape, np.float32)
    engine.chunk_forward(
        problem, *x.values(), o, initial_state=h0, chunk_states=chunk_states, num_threads=threads, **fused
    )
    grads = {name: np.zeros(a.shape, np.float32) for name, a in x.items()}
    refs = {name: np.zeros(a.shape, np.float64) for name, a in x.items()}
    dh0, dh0_ref = np.zeros(h0.shape, np.float32), np.zeros(h0.shape, np.float64)
    engine.chunk_backward(
        problem,
        *x.values(),
        d_o,
        *grads.values(),
        initial_state=h0,
        d_final_state=d_ht,
        chunk_states=chunk_states,
        d_initial_state=dh0,
        num_threads=threads,
        **fused,
    )
    engine.reference_backward(
        problem,
        *wide.values(),
        d_o.astype(np.float64),
        *refs.values(),
        initial_state=h0.astype(np.float64),
        d_final_state=d_ht.astype(np.float64),
        d_initial_state=dh0_ref,
        **wfused,
    )
    worst = max([_rel(grads[name], refs[name]) for name in grads] + [_rel(dh0, dh0_ref)])
    errors["chunk_backward"] = (worst, BACKWARD_LIMIT)
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kda.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=150, help="tokens per sequence (default 150: three chunks)")
    parser.add_argument("--threads", type=int, default=0, help="threads (default 0: all cores)")
    args = parser.parse_args(argv)
    import kda

    print(
        f"kda {kda.__version__}: SIMD target {engine.simd_target()}; limits {FORWARD_LIMIT:g} (forward), "
        f"{BACKWARD_LIMIT:g} (gradients), relative RMS against the float64 oracle"
    )
    rng = np.random.default_rng(0)
    failed = 0
    families = [f for f in FAMILIES if f.kernels]
    cases = [(fam, reg, False) for fam in families for reg in REGIMES]
    cases += [(fam, "unbounded", True) for fam in families]
    for family, regime, varlen in cases:
        errors = _case(rng, family, regime, args.T, args.threads, varlen)
        bad = [path for path, (err, limit) in errors.items() if not err <= limit]
        failed += bool(bad)
        cells = "  ".join(f"{path} {err:.1e}" for path, (err, _) in errors.items())
        name = f"{family.name} {regime}{' varlen' if varlen else ''}"
        print(f"{'FAIL' if bad else 'ok  '}  {name:<20} {cells}")
    print(f"kda.check: {len(cases) - failed} of {len(cases)} cases within their limits")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
