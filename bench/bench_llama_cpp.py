"""llama.cpp's GATED_DELTA_NET on kda's ggml backend against ggml's own CPU op, side by side.

--op: the op alone (build/kda_ggml_op_bench: both backends in one process, rounds alternated,
medians) at decode (one token, with and without the copy of the state into the recurrent cache that
llama.cpp's graph makes after it; with the caches warm from the run before, and cold, emptied before
every run as a model's other layers empty them) and at prefill chunk sizes, for Qwen3.5's head
shapes (16 key heads, 32 value heads, S = 128, scalar gate) and Kimi Linear's (32 heads, S = 128,
per-channel gate).

--models: end to end, on 4-layer models with real layer sizes and random weights, F16 and Q8_0
(bench/make_llama_models.py, made once into build/llama_bench_models):
  1. the op's share of stock llama.cpp's time and its speed-up inside the model, from
     build/kda_llama_op_share (each node timed alone through the scheduler's evaluation callback;
     the run's time from llama.cpp's own counters), and the end-to-end speed-up that share predicts,
     1 / (1 - share + share / op speed-up);
  2. llama-bench pp512, pp2048 and tg128, stock and with the backend, in alternated rounds: tokens
     per second as medians of every sample;
  3. the measured speed-up, from pairs: build/kda_llama_paired runs the same test in two processes,
     stock and with the backend, one run each in turn (the order alternating), so the two runs of a
     pair are seconds apart and a change of the machine's speed reaches both. The speed-up is the
     median of the pairs' ratios (with its quartiles), and the fraction of the predicted gain it
     reaches. (Separate llama-bench rounds differed by 0.84x to 1.29x on this VM with nothing
     changed but the time, more than the 3-7% the share predicts.)

    python bench/bench_llama_cpp.py [--op] [--models] [--threads 2] [--rounds 7] [--json]

Neither flag: both. Needs scripts/setup_llama_cpp.sh. Measure on an otherwise idle machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
KDA_BACKEND = dict(os.environ, GGML_BACKEND_PATH=str(BUILD / "libggml-kda.so"))
STOCK = {k: v for k, v in os.environ.items() if k != "GGML_BACKEND_PATH"}
MODEL_TESTS = [("pp", 512), ("pp", 2048), ("tg", 128)]
SHAPES = {
    "Qwen3.5": dict(heads="16,32", gate="scalar"),
    "Kimi Linear": dict(heads="32,32", gate="channel"),
}
# (tokens, sequences, cache copy, cold): decode alone, decode with the cache copy, a batch of 4
# decodes, the last two again with the caches emptied before every run (a model's decode step: its
# layers' weights pass through the caches between two steps of one layer), prefill chunks (llama.cpp's
# default micro-batch is 512 tokens).
CASES = [
    (1, 1, False, False),
    (1, 1, True, False),
    (1, 4, True, False),
    (1, 1, True, True),
    (1, 4, True, True),
    (64, 1, False, False),
    (512, 1, False, False),
    (2048, 1, False, False),
]


def run(shape, tokens, sequences, cache_copy, threads, rounds, cold=False):
    args = [
        str(BUILD / "kda_ggml_op_bench"),
        "--heads",
        shape["heads"],
        "--head-size",
        "128",
        "--gate",
        shape["gate"],
    ]
    args += [
        "--tokens",
        str(tokens),
        "--sequences",
        str(sequences),
        "--threads",
        str(threads),
        "--rounds",
        str(rounds),
    ]
    if cache_copy:
        args.append("--cache-copy")
    if cold:
        args.append("--cold")
    done = subprocess.run(args, env=KDA_BACKEND, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cpp_paths():
    env = dict(line.split("=", 1) for line in (BUILD / "llama_cpp.env").read_text().split())
    return Path(env["KDA_LLAMA_CPP_SOURCE"]), Path(env["KDA_LLAMA_CPP_BUILD"])


def op_share(model, kind, tokens, threads, repeat, env):
    flag = "--prompt" if kind == "pp" else "--generate"
    args = [str(BUILD / "kda_llama_op_share"), str(model), flag, str(tokens), "--threads", str(threads)]
    done = subprocess.run(
        [*args, "--repeat", str(repeat)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_bench(binary, model, threads, repetitions, env):
    """Tokens per second of every sample, by test name (pp512, ...)."""
    tests = ",".join(str(n) for kind, n in MODEL_TESTS if kind == "pp")
    gen = ",".join(str(n) for kind, n in MODEL_TESTS if kind == "tg")
    args = [str(binary), "-m", str(model), "-p", tests, "-n", gen, "-t", str(threads)]
    done = subprocess.run(
        [*args, "-r", str(repetitions), "-o", "json"], env=env, capture_output=True, text=True, check=True
    )
    samples = {}
    for row in json.loads(done.stdout):
        name = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        samples[name] = row["samples_ts"]
    return samples


def paired(model, kind, tokens, threads, pairs):
    """Times (ms) of `pairs` runs stock and with kda's backend, the two processes taking turns."""
    flag = "--prompt" if kind == "pp" else "--generate"
    args = [str(BUILD / "kda_llama_paired"), str(model), flag, str(tokens), "--threads", str(threads)]
    sides = {}
    for label, env in (("stock", STOCK), ("kda", KDA_BACKEND)):
        sides[label] = subprocess.Popen(
            args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
    try:
        for label, side in sides.items():
            if side.stdout.readline().strip() != "ready":
                raise SystemExit(f"kda_llama_paired ({label}) did not start on {model}: {stopped(side)}")
        times = {"stock": [], "kda": []}
        for i in range(pairs):
            for label in ("stock", "kda") if i % 2 == 0 else ("kda", "stock"):
                side = sides[label]
                try:
                    side.stdin.write("run\n")
                    side.stdin.flush()
                except BrokenPipeError:
                    pass  # it stopped: the read below says how
                line = side.stdout.readline()
                if not line.strip():
                    raise SystemExit(
                        f"kda_llama_paired ({label}) stopped on {model} {kind}{tokens} after "
                        f"{len(times[label])} runs: {stopped(side)}"
                    )
                times[label].append(float(line))
        return times
    finally:
        for side in sides.values():
            try:
                side.stdin.close()
            except BrokenPipeError:
                pass
            side.wait()


def stopped(process):
    """How a child that printed nothing more ended (its messages go to /dev/null: llama.cpp's log)."""
    code = process.wait(timeout=60)
    return f"exit status {code}" + (" (a signal)" if code < 0 else "")


def quartiles(values):
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def bench_models(a):
    source, build = llama_cpp_paths()
    binary = build / "bin" / "llama-bench"
    if not binary.exists():
        print("== building llama-bench", flush=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-bench"], check=True)
    models = BUILD / "llama_bench_models"
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "make_llama_models.py"), str(source), str(models)], check=True
    )
    print(f"\nEnd to end, {a.threads} threads. GATED_DELTA_NET's share: kda_llama_op_share, medians of")
    print(
        f"{a.share_repeat}; llama-bench tokens/s: medians of {a.model_rounds} alternated rounds x 2 samples; "
        f"measured: the median (quartiles) of {a.pairs} paired runs' speed-ups"
    )
    header = (
        f"{'model':<12} {'weights':<7} {'test':<7} {'op share':>8} {'op x':>6} {'predicted':>9} "
        f"{'stock t/s':>9} {'kda t/s':>9} {'measured':>8} {'quartiles':>13} {'of gain':>7}"
    )
    print(header)
    for gguf in sorted(models.glob("*.gguf")):
        if a.select and gguf.stem not in a.select.split(","):
            continue
        name, weights = gguf.stem.rsplit("-", 1)
        samples = {"stock": {}, "kda": {}}
        for _ in range(a.model_rounds):
            for label, env in (("stock", STOCK), ("kda", KDA_BACKEND)):
                for test, values in llama_bench(binary, gguf, a.threads, 2, env).items():
                    samples[label].setdefault(test, []).extend(values)
        for kind, n in MODEL_TESTS:
            test = f"{kind}{n}"
            stock = op_share(gguf, kind, n, a.threads, a.share_repeat, STOCK)
            kda = op_share(gguf, kind, n, a.threads, a.share_repeat, KDA_BACKEND)
            pairs = paired(gguf, kind, n, a.threads, a.pairs)
            if a.json:
                print(json.dumps(stock))
                print(json.dumps(kda))
                print(json.dumps({"model": gguf.name, "test": test, "paired_ms": pairs}))
            total = statistics.median(stock["plain_ms"])
            op_stock = stock["ops"]["GATED_DELTA_NET"]["ms"]
            share, speedup = op_stock / total, op_stock / kda["ops"]["GATED_DELTA_NET"]["ms"]
            predicted = 1.0 / (1.0 - share + share / speedup)
            low, measured, high = quartiles(
                [s / k for s, k in zip(pairs["stock"], pairs["kda"], strict=True)]
            )
            gain = (measured - 1.0) / (predicted - 1.0) if predicted > 1.0 else float("nan")
            rates = [
                statistics.median(samples[label][test]) if test in samples[label] else float("nan")
                for label in ("stock", "kda")
            ]
            print(
                f"{name:<12} {weights:<7} {test:<7} {share:>7.1%} {speedup:>5.2f}x {predicted:>8.3f}x "
                f"{rates[0]:>9.2f} {rates[1]:>9.2f} {measured:>7.3f}x {low:>5.3f}-{high:>5.3f}x {gain:>6.0%}",
                flush=True,
            )
        if a.json:
            print(json.dumps({"model": gguf.name, "samples_ts": samples}))


def bench_op(a):
    print(f"GATED_DELTA_NET alone, {a.threads} threads, medians of {a.rounds} alternated rounds (us)")
    print(
        f"{'model':<12} {'T':>5} {'N':>2} {'cache copy':>10} {'caches':>6} {'ggml CPU':>10} {'kda':>10} "
        f"{'ggml / kda':>10}"
    )
    for name, shape in SHAPES.items():
        for tokens, sequences, cache_copy, cold in CASES:
            r = run(shape, tokens, sequences, cache_copy, a.threads, a.rounds, cold)
            if a.json:
                print(json.dumps(r))
            ratio = r["ggml_us"] / r["kda_us"]
            copy = "yes" if cache_copy else "no"
            caches = "cold" if cold else "warm"
            times = f"{r['ggml_us']:>10.1f} {r['kda_us']:>10.1f}"
            print(
                f"{name:<12} {tokens:>5} {sequences:>2} {copy:>10} {caches:>6} {times} {ratio:>9.2f}x",
                flush=True,
            )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--op", action="store_true", help="the op alone")
    parser.add_argument("--models", action="store_true", help="llama-bench and the op's share, end to end")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="alternated rounds of the op alone")
    parser.add_argument("--model-rounds", type=int, default=3, help="alternated llama-bench rounds")
    parser.add_argument("--share-repeat", type=int, default=3, help="repeats of each op-share run")
    parser.add_argument("--pairs", type=int, default=15, help="paired runs, stock and kda, per test")
    parser.add_argument("--select", default="", help="models to run, e.g. qwen3_5-f16,kimi_linear-q8_0")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    for binary in ("kda_ggml_op_bench", "kda_llama_op_share", "kda_llama_paired"):
        if not (BUILD / binary).exists():
            raise SystemExit(f"build/{binary} is missing: run scripts/setup_llama_cpp.sh")
    if a.op or not a.models:
        bench_op(a)
    if a.models or not a.op:
        bench_models(a)


if __name__ == "__main__":
    main()
