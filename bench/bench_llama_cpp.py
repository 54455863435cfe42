"""llama.cpp's GATED_DELTA_NET on kda's ggml backend against ggml's own CPU op, side by side.

The op alone (build/kda_ggml_op_bench: both backends in one process, rounds alternated, medians) at
decode (one token, with and without the copy of the state into the recurrent cache that llama.cpp's
graph makes after it) and at prefill chunk sizes, for Qwen3.5's head shapes (16 key heads, 32 value
heads, S = 128, scalar gate) and Kimi Linear's (32 heads, S = 128, per-channel gate). Prints a table
and the ratios; --json adds the raw lines.

    python bench/bench_llama_cpp.py [--threads 2] [--rounds 7] [--json]

Needs scripts/setup_llama_cpp.sh. Measure on an otherwise idle machine.
"""

import argparse
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
SHAPES = {
    "Qwen3.5": dict(heads="16,32", gate="scalar"),
    "Kimi Linear": dict(heads="32,32", gate="channel"),
}
# (tokens, sequences, cache copy): decode alone, decode with the cache copy, a batch of 4 decodes,
# prefill chunks (llama.cpp's default micro-batch is 512 tokens).
CASES = [(1, 1, False), (1, 1, True), (1, 4, True), (64, 1, False), (512, 1, False), (2048, 1, False)]


def run(shape, tokens, sequences, cache_copy, threads, rounds):
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
    env = dict(os.environ, GGML_BACKEND_PATH=str(BUILD / "libggml-kda.so"))
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    if not (BUILD / "kda_ggml_op_bench").exists():
        raise SystemExit("build/kda_ggml_op_bench is missing: run scripts/setup_llama_cpp.sh")
    print(f"GATED_DELTA_NET alone, {a.threads} threads, medians of {a.rounds} alternated rounds (us)")
    print(
        f"{'model':<12} {'T':>5} {'N':>2} {'cache copy':>10} {'ggml CPU':>10} {'kda':>10} {'ggml / kda':>10}"
    )
    for name, shape in SHAPES.items():
        for tokens, sequences, cache_copy in CASES:
            r = run(shape, tokens, sequences, cache_copy, a.threads, a.rounds)
            if a.json:
                print(json.dumps(r))
            ratio = r["ggml_us"] / r["kda_us"]
            copy = "yes" if cache_copy else "no"
            times = f"{r['ggml_us']:>10.1f} {r['kda_us']:>10.1f}"
            print(f"{name:<12} {tokens:>5} {sequences:>2} {copy:>10} {times} {ratio:>9.2f}x")


if __name__ == "__main__":
    main()
