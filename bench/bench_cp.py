"""One long sequence past one thread and past one process: in-process column shares and context
parallelism (kda.cp) over torch.distributed with gloo, next to a FLOP model.

    .venv/bin/python bench/bench_cp.py [--T 65536] [--H 4] [--K 128] [--V 128] [--reps 3]
                                       [--ranks 2] [--parts threads,cp] [--quick]

Part 1, threads: one sequence of one head (B=1, H=1, T, K, V, fp32), the prefill forward
(kda.chunk_kda, no gradient) on 1 and 2 threads. With fewer (sequence, head) items than threads the
recurrent forward shares the head's state columns among the threads (docs/math.md, "Segment
transitions"); the segment transition of the sequence's first half (kda.engine.segment_transition) is
timed too, to check the model's cost of a transition. Then (part 1b) the same head's forward+backward
(autograd) on 1 and 2 threads: the chunked backward splits the head's value columns into shares
(src/cpu/chunk_backward.cpp), and the backward at V / 2 on one thread measures the fraction f of its
time that every share repeats.

Part 2, processes: B=1, H=4, one sequence of T tokens, forward and forward+backward (autograd, fp32):
one process (1 thread, then --ranks threads) against --ranks processes of one thread each, the
sequence split evenly (kda.cp, gloo on this machine). Per rank: time, the share of it in the
transitions, the all-gathers (status and data) and the chaining (kda.cp.profile), and the bytes each
rank receives per layer; then the model's speedup for 8 and 64 ranks.

The FLOP model. Let F(w) = 7 K w FLOPs per token and head be the forward at value width w (the
recurrent forward's k^T S, the rank-one update, the decay and q^T S each touch the K x w state; 114.7 k
at K = w = 128, docs/performance.md), and B ~ 3 F(V) the backward (docs/performance.md: the backward
does 3.0x the forward's FLOPs).
- Column shares (part 1): the state's V columns evolve independently, so P threads each run F(V / P)
  per token with no extra work: ideal speedup P (the per-token work on K-vectors, the gate and the
  key norm, is repeated by each thread: O(K), negligible).
- Column shares of the backward (part 1b): the gradients of q, k, g and beta are sums over the
  columns, so each share runs the backward at width V / P and the partial sums are added; what every
  share repeats is the V-independent work of a chunk of C = 64 tokens: ~11 C^2 K FLOPs (the
  intra-chunk matrices, the pair terms, the solve's W half) against 14 C K V + 4 C^2 V that scale
  with V (f = 0.26 of the FLOPs at K = V = 128). P shares take f + (1 - f) / P of the time.
- Segments with transitions (what CP does across processes, and what a split inside one process
  would do): a sequence cut into W segments of T / W tokens; every segment but the last computes its
  transition, one forward at width V + K from zeros and the identity, all of them at once; the maps
  are exchanged and chained (rank r chains r maps, 2 K^2 V FLOPs each per head), then every segment
  runs its local forward from its true entering state. The critical path of the forward is
      T / W * (F(V + K) + F(V)) + (W - 1) * 2 K^2 V   per head,
  against T * F(V) unsplit: at K = V the forward alone gains W / 3 (two segments are slower than one,
  0.67x). The backward needs, on every rank whose first sequence began on an earlier rank, delta
  (that sequence's entering state's gradient from this rank's outputs) before any local backward:
  the adjoint sum_t R_t dO_t^T of the readout R_t = scale M_t^T q_t of the sequence's transition
  (docs/math.md), which the forward computes (with the maps where the sequence also runs on; the last
  rank's own transition call runs while it would wait for the earlier ranks' maps, so the critical
  path above is unchanged); 2 K V FLOPs per token and head in the backward (one GEMM; the readout
  keeps T / W * HV * K fp32 values from the forward to the backward). Then every rank runs its local
  backward at once, after the chaining of gradients back (another (W - 1) * 2 K^2 V):
      T / W * (F(V + K) + F(V) + B + 2 K V) + 2 (W - 1) * 2 K^2 V   against   T * (F(V) + B),
  at K = V about 0.64 W for forward+backward (0.44 W when delta took an extra local backward, and
  no gain at all at W = 2 when the last rank's delta came from its own local backward, which the
  first rank then waited for). The exchange adds the all-gathers: HV K (K + V) fp32 values per rank
  forward, HV K V backward, plus a status of 11 int64s before each call.
Part 2 fills the model with this machine's measured per-token times (F(V), F(V + K) and B from the
one-process run and the transition timing, the chain from the measured chaining, the exchange from
the measured all-gather time per byte) to predict 8 and 64 ranks.

Timings are medians over --reps; the ranks start each repetition together (a barrier). A rank's
"exchange" share includes its wait for the other ranks (without a gradient the last rank computes no
transition, so it waits for rank 0's; with one it computes its first sequence's readout then).
--quick: a small T, a smoke test of the script (its figures mean nothing).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch


def _inputs(T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -0.05 * torch.rand(1, T, H, K, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def _median(fn, reps, barrier=None):
    times = []
    for _ in range(reps):
        if barrier:
            barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- part 1: threads ---------------------------------------------------------------------------------


def part_threads(args):
    import kda
    from kda import _ops

    T, K, V = args.T, args.K, args.V
    q, k, v, g, beta = _inputs(T, 1, K, V)
    rows = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with torch.no_grad():
            kda.chunk_kda(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64])  # warm-up
            rows[threads] = _median(lambda: kda.chunk_kda(q, k, v, g, beta), args.reps)
    torch.set_num_threads(1)
    half = T // 2
    options = _ops.problem_options(q)
    parts = [t[:, :half] for t in (q, k, v, g, beta)]
    problem = _ops.prepare(parts[0], parts[2], options)
    transition = _median(lambda: _ops.segment_transition(problem, *parts, None, None, 0), args.reps)
    with torch.no_grad():
        local_half = _median(lambda: kda.chunk_kda(*parts), args.reps)

    flop = 7 * K * V * T
    print(f"\n## Part 1: one sequence of one head, T={T}, K={K}, V={V}, fp32 forward (prefill)\n")
    print("| threads | ms | GFLOP/s | speedup | model: column shares | model: 2 segments + transition |")
    print("| --- | --- | --- | --- | --- | --- |")
    # Two segments on two threads: max(transition of half 1 then local of half 2, local of half 1)
    # after the transition; model in FLOPs: T/2 (F(V+K) + F(V)) against T F(V).
    seg_model = (7 * K * V * T) / (half * 7 * K * (V + K) + half * 7 * K * V)
    for threads, t in rows.items():
        model_cols = float(threads)
        model_seg = 1.0 if threads == 1 else seg_model
        print(
            f"| {threads} | {t * 1e3:.1f} | {flop / t / 1e9:.1f} | {rows[1] / t:.2f}x | {model_cols:.2f}x "
            f"| {model_seg:.2f}x |"
        )
    measured_seg = rows[1] / (transition + local_half)
    print(
        f"\nsegment transition of the first {half} tokens (1 thread): {transition * 1e3:.1f} ms, "
        f"{transition / local_half:.2f}x the local forward of those tokens ({local_half * 1e3:.1f} ms; "
        f"model {(V + K) / V:.2f}x); two segments on two threads from these timings: "
        f"{measured_seg:.2f}x against one thread"
    )
    _part_threads_backward(args)


def _forward_backward(T, K, V, reps, seed=0):
    """Median seconds of the forward, and of the forward+backward (autograd), of one head."""
    import kda

    inputs = [t.requires_grad_() for t in _inputs(T, 1, K, V, seed)]
    d_o = torch.randn(1, T, 1, V, generator=torch.Generator().manual_seed(seed + 1))

    def forward():
        with torch.no_grad():
            kda.chunk_kda(*inputs)

    def both():
        o, _ = kda.chunk_kda(*inputs)
        o.backward(d_o)

    both()  # warm-up
    return _median(forward, reps), _median(both, reps)


def _part_threads_backward(args):
    """The chunked backward's column shares: one head, forward+backward on 1 and 2 threads, against
    the FLOP model (the V-independent fraction f of the backward is repeated by every share)."""
    T, K, V = args.T, args.K, args.V
    times = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        times[threads] = _forward_backward(T, K, V, args.reps)
    torch.set_num_threads(1)
    half_fwd, half_both = _forward_backward(T, K, V // 2, args.reps)
    bwd = {t: both - fwd for t, (fwd, both) in times.items()}
    # f from the timings: the backward at width V / 2 takes f + (1 - f) / 2 of the one at V.
    f_measured = 2 * (half_both - half_fwd) / bwd[1] - 1
    # f from the FLOP count per chunk of C = 64 rows, the chunk states given by the forward (as autograd
    # does; docs/performance.md, "Column shares of the backward"): 14 C K V + 4 C^2 V depend on V,
    # ~11 C^2 K do not.
    C = 64
    dep = 14 * C * K * V + 4 * C * C * V
    indep = 11 * C * C * K
    f_model = indep / (dep + indep)
    fwd1 = times[1][0]

    def model(f):  # forward+backward on two threads: the forward's column shares, two backward shares
        return (fwd1 + bwd[1]) / (fwd1 / 2 + bwd[1] * (f + (1 - f) / 2))

    print(f"\n## Part 1b: the same head, forward+backward (autograd, fp32), T={T}\n")
    print(
        "| threads | forward ms | backward ms | forward+backward ms | speedup | model (FLOP count) "
        "| model (measured f) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for threads, (fwd, both) in times.items():
        flop_model = 1.0 if threads == 1 else model(f_model)
        time_model = 1.0 if threads == 1 else model(f_measured)
        print(
            f"| {threads} | {fwd * 1e3:.1f} | {bwd[threads] * 1e3:.1f} | {both * 1e3:.1f} "
            f"| {times[1][1] / both:.2f}x | {flop_model:.2f}x | {time_model:.2f}x |"
        )
    print(
        f"\nbackward on 2 threads: {bwd[1] / bwd[2]:.2f}x one thread (two column shares). The V-independent "
        f"fraction f of the backward, which every share repeats: {f_model:.2f} of its FLOPs (two shares "
        f"{1 / (f_model + (1 - f_model) / 2):.2f}x), {f_measured:.2f} of its time (the backward at "
        f"V = {V // 2} took {(half_both - half_fwd) * 1e3:.1f} ms on one thread; two shares "
        f"{1 / (f_measured + (1 - f_measured) / 2):.2f}x)"
    )


# ---- part 2: processes ---------------------------------------------------------------------------------


def _layer(ctx, args, grad):
    import kda

    T, H, K, V = args.T, args.H, args.K, args.V
    q, k, v, g, beta = _inputs(T, H, K, V)
    s, e = (0, T) if ctx is None else ctx.token_range
    tensors = [t[:, s:e].clone().requires_grad_(grad) for t in (q, k, v, g, beta)]
    cu = torch.tensor([0, T]) if ctx is None else None

    def run():
        if grad:
            o, _ = kda.chunk_kda(*tensors, cu_seqlens=cu, cp_context=ctx)
            o.sum().backward()
        else:
            with torch.no_grad():
                kda.chunk_kda(*tensors, cu_seqlens=cu, cp_context=ctx)

    return run


def _rank_main(rank, world, args, directory):
    import torch.distributed as dist
    from kda import cp

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(directory) / 'rendezvous'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    ctx = cp.build_cp_context(torch.tensor([0, args.T]))
    result = {}
    for mode, grad in (("fwd", False), ("fwdbwd", True)):
        run = _layer(ctx, args, grad)
        run()  # warm-up
        with cp.profile() as stats:
            t = _median(run, args.reps, barrier=dist.barrier)
        result[mode] = dict(time=t, **{n: x / args.reps for n, x in stats.items()})
    # one all-gather of the forward's size, for the exchange's time per byte
    width = args.H * args.K * (args.K + args.V)
    parts = [torch.empty(width) for _ in range(world)]
    mine = torch.zeros(width)
    result["gather"] = _median(lambda: dist.all_gather(parts, mine), max(args.reps, 5), barrier=dist.barrier)
    torch.save(result, Path(directory) / f"rank-{rank}.pt")
    dist.destroy_process_group()


def part_cp(args):
    import torch.multiprocessing as mp
    from kda import _ops

    T, H, K, V, W = args.T, args.H, args.K, args.V, args.ranks
    single = {}
    for threads in (1, W):
        torch.set_num_threads(threads)
        for mode, grad in (("fwd", False), ("fwdbwd", True)):
            run = _layer(None, args, grad)
            run()
            single[threads, mode] = _median(run, args.reps)
    torch.set_num_threads(1)
    q, k, v, g, beta = _inputs(T // W, H, K, V)
    problem = _ops.prepare(q, v, _ops.problem_options(q))
    transition = _median(lambda: _ops.segment_transition(problem, q, k, v, g, beta, None, None, 0), args.reps)

    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(_rank_main, args=(W, args, directory), nprocs=W, start_method="spawn")
        ranks = [torch.load(Path(directory) / f"rank-{r}.pt") for r in range(W)]

    fwd_bytes = (W - 1) * H * K * (K + V) * 4
    bwd_bytes = (W - 1) * H * K * V * 4
    status_bytes = 2 * (W - 1) * 11 * 8
    print(f"\n## Part 2: context parallelism, B=1, H={H}, one sequence of T={T}, K={K}, V={V}, fp32\n")
    print(
        f"one process, 1 thread: forward {single[1, 'fwd'] * 1e3:.0f} ms, "
        f"forward+backward {single[1, 'fwdbwd'] * 1e3:.0f} ms"
    )
    print(
        f"one process, {W} threads: forward {single[W, 'fwd'] * 1e3:.0f} ms, "
        f"forward+backward {single[W, 'fwdbwd'] * 1e3:.0f} ms\n"
    )
    print(
        "| rank | mode | ms | speedup vs 1 process x 1 thread | vs 1 process x W threads | transition | "
        "exchange | chain | local |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r, result in enumerate(ranks):
        for mode in ("fwd", "fwdbwd"):
            x = result[mode]
            t = x["time"]
            print(
                f"| {r} | {mode} | {t * 1e3:.0f} | {single[1, mode] / t:.2f}x | {single[W, mode] / t:.2f}x "
                f"| {x['transition'] / t:.1%} | {x['exchange'] / t:.1%} | {x['chain'] / t:.2%} "
                f"| {x['local'] / t:.1%} |"
            )
    print(
        f"\nbytes each rank receives per layer: forward {fwd_bytes} (maps), backward {bwd_bytes} (deltas), "
        f"status {status_bytes}; measured (forward+backward, rank 0) {int(ranks[0]['fwdbwd']['bytes'])}"
    )

    # The model, filled with this machine's per-token times (seconds per token, all heads, 1 thread).
    f_local = single[1, "fwd"] / T
    b_local = (single[1, "fwdbwd"] - single[1, "fwd"]) / T
    f_trans = transition / (T // W)
    # the chain: rank 1 chains one map forward and one backward per call (measured, per map)
    chain = max(ranks[1]["fwdbwd"]["chain"], 1e-9) / 2 if W > 1 else 0.0
    per_byte = ranks[0]["gather"] / max(fwd_bytes, 1)

    def predicted(world, mode):
        n = T / world
        t = n * (f_trans + f_local) + (world - 1) * chain + (world - 1) * H * K * (K + V) * 4 * per_byte
        if mode == "fwdbwd":
            # the adjoint GEMM for delta: 2 K V FLOPs per token and head, costed at the forward's
            # FLOP rate (an upper bound: a GEMM runs faster than the recurrence)
            adjoint = f_local * 2 / 7
            t += n * (b_local + adjoint) + (world - 1) * chain + (world - 1) * H * K * V * 4 * per_byte
        return t

    print("\n| ranks | model forward speedup | model forward+backward speedup |")
    print("| --- | --- | --- |")
    for world in sorted({W, 8, 64}):
        print(
            f"| {world} | {single[1, 'fwd'] / predicted(world, 'fwd'):.2f}x "
            f"| {single[1, 'fwdbwd'] / predicted(world, 'fwdbwd'):.2f}x |"
        )
    print(
        f"\n(per token, 1 thread: forward {f_local * 1e6:.2f} us, transition {f_trans * 1e6:.2f} us, "
        f"backward {b_local * 1e6:.2f} us; one map chained {chain * 1e3:.3f} ms; all-gather "
        f"{per_byte * 1e9:.2f} ns per byte at {W} ranks)"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=65536)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--parts", default="threads,cp")
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.T, args.H, args.K, args.V, args.reps = 1024, 2, 32, 32, 1
    if "KDA_NUM_THREADS" in os.environ:
        sys.exit("unset KDA_NUM_THREADS: the script sets the thread counts itself")
    import kda

    print(
        f"kda {kda.__version__}, SIMD target {kda.simd_target()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}"
    )
    parts = args.parts.split(",")
    if "threads" in parts:
        part_threads(args)
    if "cp" in parts:
        part_cp(args)


if __name__ == "__main__":
    main()
