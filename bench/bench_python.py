"""kda's PyTorch layer against the peers a KDA user would otherwise run on the CPU.

    python bench/bench_python.py [--T 1024,2048,4096] [--H 16] [--K 128] [--V 128] [--reps 3]
                                 [--threads 2] [--plot bench/python_bench.png] [--cli build/kda]

Prints a table of forward and forward+backward time and peak memory for
  kda            kda.chunk_kda and kda.fused_recurrent_kda
  transformers   its torch fallbacks, chunk_kimi_delta_attention and recurrent_kimi_delta_attention
                 (what Kimi Linear runs without fla), and torch.compile of the chunked one (with
                 its compile time)
  fla            fla-core's naive_chunk_kda and naive_recurrent_kda
at B=1, H=16, K=V=128, fp32, then the same run's sgemm rate and copy bandwidth, and the per-call
overhead of the Python layer on a one-token decode step (B=1, H=32) against the same call from C++
(`kda decode`, when the C++ build is there). Saves a PNG plot.

Each measurement runs in a fresh process (the fallbacks need several GB; fla must be hidden from
transformers for it to take its torch fallbacks), under a memory limit: a run that exceeds it is
reported as such. Peak memory is the resident-set growth during one call after a warm-up (freed heap
trimmed, the kernel's high-water mark reset), inputs excluded. Times are medians.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPLS = {
    # name: (label, supports backward)
    "kda_chunk": ("kda chunk_kda", True),
    "kda_recurrent": ("kda fused_recurrent_kda", True),
    "hf_chunk": ("transformers torch chunk", True),
    "hf_chunk_compiled": ("torch.compile(transformers torch chunk)", True),
    "hf_recurrent": ("transformers torch recurrent", True),
    "fla_naive_chunk": ("fla naive_chunk_kda", True),
    "fla_naive_recurrent": ("fla naive_recurrent_kda", True),
}
MODES = ("fwd", "fwdbwd")


# ---- one measurement, in its own process ----------------------------------------------------------


def _rss_kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _trim_heap():
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _function(impl):
    if impl.startswith("hf_"):
        sys.modules["fla"] = None  # transformers takes its torch fallbacks only without fla
        from transformers.models.kimi_linear import modeling_kimi_linear as kimi

        if impl == "hf_recurrent":
            return lambda q, k, v, g, b: kimi.recurrent_kimi_delta_attention(q, k, v, g, b, None, True)
        chunk = kimi.chunk_kimi_delta_attention
        fn = lambda q, k, v, g, b: chunk(q, k, v, g, b, output_final_state=True)  # noqa: E731
        return torch_compile(fn) if impl == "hf_chunk_compiled" else fn
    if impl.startswith("fla_"):
        from fla.ops.kda import naive

        f = naive.naive_chunk_kda if impl == "fla_naive_chunk" else naive.naive_recurrent_kda
        return lambda q, k, v, g, b: f(q, k, v, g, b, output_final_state=True)
    import kda

    f = kda.chunk_kda if impl == "kda_chunk" else kda.fused_recurrent_kda
    return lambda q, k, v, g, b: f(q, k, v, g, b, output_final_state=True)


def torch_compile(fn):
    import torch

    return torch.compile(fn)


def worker(impl, mode, T, H, K, V, reps, threads):
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -torch.exp(torch.randn(1, T, H, K, generator=gen) - 3.0)  # a mild log decay
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    fn = _function(impl)
    backward = mode == "fwdbwd"
    inputs = [x.requires_grad_(backward) for x in (q, k, v, g, beta)]

    def call():
        if not backward:
            with torch.no_grad():
                return fn(*inputs)
        for x in inputs:
            x.grad = None
        o, s = fn(*inputs)
        (o.square().sum() + s.sum()).backward()
        return o

    t0 = time.perf_counter()
    call()  # warm-up (torch.compile compiles here)
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    for x in inputs:
        x.grad = None
    _trim_heap()
    base = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    call()
    peak = _rss_kb("VmHWM") - base
    return {
        "seconds": median,
        "times": times,
        "first": first,
        "compile": max(0.0, first - median),
        "peak_mb": peak / 1024,
    }


def run_worker(args, impl, mode, T):
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        impl,
        mode,
        str(T),
        "--H",
        str(args.H),
        "--K",
        str(args.K),
        "--V",
        str(args.V),
        "--reps",
        str(args.reps),
        "--threads",
        str(args.threads),
        "--memory-limit-gb",
        str(args.memory_limit_gb),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    with tempfile.TemporaryDirectory(prefix="kda-bench-inductor-") as cache:
        # A cold compile every time: inductor's on-disk caches would otherwise hide the compile time.
        env.update(
            TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0"
        )
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"over {args.timeout / 60:.0f} min"}
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["failed"])[-1]
        oom = "can't allocate memory" in result.stderr or "MemoryError" in result.stderr
        return {"error": f"over {args.memory_limit_gb:g} GB" if oom else tail[:80]}
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- yardsticks measured in the same run ----------------------------------------------------------


def yardsticks(threads):
    import torch

    torch.set_num_threads(threads)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    sgemm = 2 * n**3 / statistics.median(times) / 1e9
    x = torch.empty(64 * 1024 * 1024)  # 256 MiB
    x.fill_(1.0)
    y = torch.empty_like(x)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        times.append(time.perf_counter() - t0)
    copy = 2 * x.numel() * 4 / statistics.median(times) / 1e9  # read + write
    return sgemm, copy


def prefill_flops(T, H, K, V):
    """The work of a forward in the recurrent form's count, 7 K V per token and head (tools/speed.hpp):
    the kernel chunk_kda's forward runs on the CPU (see docs/api.md, chunk_forward)."""
    return T * H * 7.0 * K * V


# ---- the decode overhead --------------------------------------------------------------------------


def python_decode_us(H, K, V, calls, batches, threads):
    """One-token decode steps through kda.fused_recurrent_kda_fwd (fla's serving entry): the state in
    slot 0 of a pool of two, updated in place, as `kda decode` does from C++."""
    import kda
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, 1, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, 1, H, K, generator=gen), dim=-1)
    v = torch.randn(1, 1, H, V, generator=gen)
    g = -torch.exp(torch.randn(1, 1, H, K, generator=gen) - 3.0)
    beta = torch.sigmoid(torch.randn(1, 1, H, generator=gen))
    pool = torch.randn(2, H, K, V, generator=gen) * 0.5
    slot = torch.tensor([0])
    out = torch.empty_like(v)
    results = []
    with torch.inference_mode():
        for _ in range(batches + 1):
            t0 = time.perf_counter()
            for _ in range(calls):
                kda.fused_recurrent_kda_fwd(
                    q, k, v, g, beta, initial_state=pool, ssm_state_indices=slot, out=out
                )
            results.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(results[1:])


def cpp_decode_us(cli, H, K, V, calls, batches, threads):
    """The same step through kda::decode from C++ (`kda decode`, K-first fp32 pool of two slots)."""
    command = [cli, "decode", "--json", "--B", "1", "--layout", "k", "--pool-dtype", "f32", "--gate", "key"]
    command += ["--slots", "2"]
    command += ["--threads", str(threads), "--H", str(H), "--K", str(K), "--V", str(V)]
    command += ["--calls", str(calls), "--reps", str(batches)]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["us_per_call"]


def decode_overhead(args):
    """Python and C++ decode calls, interleaved so that drifts in the machine's speed hit both."""
    rows = []
    for H, K, V, label in (
        (32, 128, 128, "B=1 H=32 K=V=128"),
        (1, 16, 16, "B=1 H=1 K=V=16 (overhead floor)"),
    ):
        calls = 2000 if H == 32 else 20000
        py, cpp = [], []
        for _ in range(5):
            py.append(python_decode_us(H, K, V, calls, 5, args.threads))
            if args.cli:
                cpp.append(cpp_decode_us(args.cli, H, K, V, calls, 5, args.threads))
        rows.append((label, py, cpp or None))
    return rows


def print_decode_overhead(args):
    print(
        "\nPython layer overhead on a one-token decode step (kda.fused_recurrent_kda_fwd under "
        "inference_mode, state updated in place in a pool slot, against `kda decode` from C++):"
    )
    for label, py, cpp in decode_overhead(args):
        if cpp is None:
            print(f"  {label}: Python {statistics.median(py):.1f} us per call (C++ figure unavailable)")
            continue
        # Rounds alternate Python and C++; the spread of the rounds says how much of a difference is noise.
        diffs = sorted(p - c for p, c in zip(py, cpp, strict=True))
        print(
            f"  {label}: Python {statistics.median(py):.1f} us, C++ {statistics.median(cpp):.1f} us: "
            f"overhead {statistics.median(diffs):.1f} us per call (rounds {diffs[0]:.1f} to {diffs[-1]:.1f})"
        )


# ---- the report -----------------------------------------------------------------------------------


def fmt_time(r):
    if "error" in r:
        return r["error"]
    s = r["seconds"]
    return f"{s * 1e3:.0f} ms" if s < 10 else f"{s:.1f} s"


def plot(results, lengths, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    panels = (
        ("fwd", "seconds", "forward time (s)"),
        ("fwdbwd", "seconds", "forward+backward time (s)"),
        ("fwdbwd", "peak_mb", "forward+backward peak memory (MB)"),
    )
    for ax, (mode, key, title) in zip(axes, panels, strict=True):
        for impl, (label, _) in IMPLS.items():
            pts = [
                (T, results[impl, mode, T][key]) for T in lengths if key in results.get((impl, mode, T), {})
            ]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    marker="o",
                    label=label,
                    linewidth=2.5 if impl.startswith("kda") else 1.2,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [str(T) for T in lengths])
        ax.set_xlabel("sequence length T")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("KDA on the CPU: kda against the PyTorch peers (B=1, H=16, K=V=128, fp32, medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", default="1024,2048,4096")
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--memory-limit-gb", type=float, default=16.0)
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per measurement")
    parser.add_argument(
        "--results",
        default=None,
        help="JSON file of measurements: read to skip those already made, updated after each",
    )
    parser.add_argument("--plot", default=str(Path(__file__).with_name("python_bench.png")))
    parser.add_argument("--cli", default=str(Path(__file__).resolve().parent.parent / "build" / "kda"))
    parser.add_argument(
        "--overhead-only", action="store_true", help="only the Python layer's decode overhead, no T sweep"
    )
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "MODE", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        limit = int(args.memory_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        impl, mode, T = args.worker
        print(json.dumps(worker(impl, mode, int(T), args.H, args.K, args.V, args.reps, args.threads)))
        return

    if not Path(args.cli).exists():
        print(f"note: {args.cli} not found (bash scripts/setup.sh builds it): no C++ decode figure")
        args.cli = None
    if args.overhead_only:
        print_decode_overhead(args)
        return
    lengths = [int(t) for t in args.T.split(",")]
    impls = args.impls.split(",")
    print(
        f"kda Python layer against its peers: B=1 H={args.H} K={args.K} V={args.V} fp32, {args.threads} "
        f"threads, medians of {args.reps} runs after a warm-up; each run in a fresh process\n",
        flush=True,
    )
    results = {}
    saved = Path(args.results) if args.results else None
    if saved and saved.exists():
        for row in json.loads(saved.read_text()):
            results[row["impl"], row["mode"], row["T"]] = row["result"]
    for T in lengths:
        for impl in impls:
            for mode in MODES:
                if (impl, mode, T) in results:
                    continue
                print(f"  measuring {impl} {mode} T={T} ...", file=sys.stderr, flush=True)
                results[impl, mode, T] = run_worker(args, impl, mode, T)
                print(f"    {results[impl, mode, T]}", file=sys.stderr, flush=True)
                if saved:
                    rows = [{"impl": i, "mode": m, "T": t, "result": r} for (i, m, t), r in results.items()]
                    saved.write_text(json.dumps(rows, indent=1))

    sgemm, copy = yardsticks(args.threads)
    header = (
        f"{'T':>5}  {'implementation':<40} {'forward':>12} {'fwd+bwd':>12} {'peak fwd':>10} {'peak f+b':>10}"
    )
    print(header)
    print("-" * len(header))
    for T in lengths:
        for impl in impls:
            f, fb = results[impl, "fwd", T], results[impl, "fwdbwd", T]
            mem = [f"{r['peak_mb']:.0f} MB" if "peak_mb" in r else "-" for r in (f, fb)]
            extra = ""
            if impl == "hf_chunk_compiled" and "compile" in f:
                extra = f"  (compile {f['compile']:.0f} s fwd, {fb.get('compile', 0):.0f} s f+b)"
            print(
                f"{T:>5}  {IMPLS[impl][0]:<40} {fmt_time(f):>12} {fmt_time(fb):>12} "
                f"{mem[0]:>10} {mem[1]:>10}{extra}"
            )
        print()

    print(
        f"yardsticks (same run, {args.threads} threads): torch sgemm 2048^3 {sgemm:.0f} GFLOP/s, "
        f"copy {copy:.1f} GB/s"
    )
    for T in lengths:
        kda_f = results.get(("kda_chunk", "fwd", T), {})
        hf_f, hf_fb = results.get(("hf_chunk", "fwd", T), {}), results.get(("hf_chunk", "fwdbwd", T), {})
        kda_fb = results.get(("kda_chunk", "fwdbwd", T), {})
        line = f"  T={T}:"
        if "seconds" in kda_f:
            gflops = prefill_flops(T, args.H, args.K, args.V) / kda_f["seconds"] / 1e9
            line += f" kda chunk forward {gflops:.0f} GFLOP/s = {gflops / sgemm:.0%} of sgemm;"
        if "seconds" in kda_f and "seconds" in hf_f:
            line += f" {hf_f['seconds'] / kda_f['seconds']:.0f}x faster than the torch chunk forward"
        if "seconds" in kda_fb and "seconds" in hf_fb:
            line += (
                f", {hf_fb['seconds'] / kda_fb['seconds']:.0f}x forward+backward with "
                f"{kda_fb['peak_mb'] / max(hf_fb['peak_mb'], 1e-9):.1%} of its peak memory"
            )
        print(line)

    print_decode_overhead(args)

    plot(results, lengths, args.plot)
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
