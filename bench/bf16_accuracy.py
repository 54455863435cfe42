"""How far chunk_forward's opt-in bf16 products (precision='bf16') fall from the float64 oracle, by T.

    .venv/bin/python bench/bf16_accuracy.py [--T 1024,4096,16384,65536] [--plot FILE]

Both families (KDA's per-key gate, the gated delta rule's per-head gate) in the five gate regimes of
harness/definitions.txt (drawn as kda.check draws them: mild, strong, zero, -1000 spikes, the unbounded
softplus gate with a large A_log), one head of K = V = 128 from a random initial state, fp32 inputs:
the relative RMS error of o and of the final state against kda.engine.reference_forward, for the
process's bf16 unit (KDA_BF16_UNIT pins one) and, for scale, the exact fp32 kernel. Prints a table;
with --plot writes the error curves (matplotlib). The question it answers: does the error grow
without bound with T? (The limit the tests hold it to is 5e-3, definitions.txt's forward_bf16.)
"""

import argparse
import time

import numpy as np
from kda import check, engine
from kda._family import GDN, KDA


def errors(family, regime, T, precision, rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    x, state, fused = check._inputs(rng, family, regime, 1, T, 1, 1, 128, 128)
    gate = "softplus" if fused else "log_decay"
    problem = engine.prepare(x["q"], x["v"], gate=gate, gate_width=family.gate_width)
    o_ref = np.zeros(x["v"].shape, np.float64)
    ht_ref = np.zeros(state.shape, np.float64)
    wide = [a.astype(np.float64) for a in x.values()]
    wide_fused = {name: a.astype(np.float64) for name, a in fused.items()}
    h0 = state.astype(np.float64)
    engine.reference_forward(problem, *wide, o_ref, initial_state=h0, final_state=ht_ref, **wide_fused)
    out = {}
    for p in precision:
        o, ht = np.zeros(x["v"].shape, np.float32), np.zeros(state.shape, np.float32)
        engine.chunk_forward(
            problem, *x.values(), o, initial_state=state, final_state=ht, precision=p, **fused
        )
        out[p] = (check._rel(o, o_ref), check._rel(ht, ht_ref))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", default="1024,4096,16384,65536", help="sequence lengths, comma-separated")
    parser.add_argument("--plot", help="write the curves to this image file")
    args = parser.parse_args()
    lengths = [int(t) for t in args.T.split(",")]
    units = ", ".join(engine.bf16_product_units())
    print(
        f"bf16 products on {engine.bf16_product_unit()} (units here: {units}); relative RMS error against "
        "the float64 oracle, one head, K = V = 128, fp32 inputs"
    )
    print(
        f"{'family':<6} {'regime':<10} {'T':>6}  {'o bf16':>8} {'state bf16':>10}  {'o exact':>8} "
        f"{'state exact':>11}  seconds"
    )
    curves = {}
    for family in (KDA, GDN):
        for regime in check.REGIMES:
            for T in lengths:
                start = time.perf_counter()
                e = errors(family, regime, T, ("bf16", "exact"))
                name = family.name
                curves.setdefault((name, regime), []).append((T, *e["bf16"]))
                print(
                    f"{name:<6} {regime:<10} {T:>6}  {e['bf16'][0]:8.2e} {e['bf16'][1]:10.2e}  "
                    f"{e['exact'][0]:8.2e} {e['exact'][1]:11.2e}  {time.perf_counter() - start:7.1f}",
                    flush=True,
                )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for (name, regime), points in curves.items():
            t, o, s = zip(*points, strict=True)
            style = "-" if name == "KDA" else "--"
            axes[0].plot(t, o, style, marker="o", label=f"{name} {regime}")
            axes[1].plot(t, s, style, marker="o", label=f"{name} {regime}")
        for ax, what in zip(axes, ("o", "final state"), strict=True):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.axhline(5e-3, color="grey", lw=0.8)
            ax.set_xlabel("T")
            ax.set_title(f"{what}: relative RMS error, bf16 products ({engine.bf16_product_unit()})")
        axes[0].set_ylabel("relative RMS error against float64")
        axes[1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
