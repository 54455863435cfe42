"""The OpenAI server under load: the full form of tests/vllm/test_server_load.py (kda's vLLM plugin).

For each configuration, ``python -m vllm.entrypoints.openai.api_server`` serves the tiny random Kimi
Linear checkpoint of the tests (tests/vllm/tiny_kimi.py) on 127.0.0.1, started and stopped by its PID,
and 16 concurrent clients send a fixed, seeded list of greedy /v1/completions requests: token-id
prompts of 1 to ``--max-prompt`` tokens (log-uniform, with one-token prompts), half streamed, a tenth
of the streamed ones cancelled after a chunk or two by closing the socket and each followed at once by
another request from the same client. Configurations:

  - bf16: vLLM's serving dtype;
  - bf16-ngram: bf16 with n-gram speculative decoding (2 draft tokens);
  - fp32-preempt: float32, a KV pool of 13 blocks and 4 sequences at most (max-model-len 1024), so
    that vLLM preempts running requests and recomputes them (the longest prompt is 640 there).

Then every token received is checked against transformers' float32 model (teacher-forced; bf16 within
0.5 in log-probability, float32 within 2e-3, tests/vllm/test_vllm_kimi.py derives both), the server
must be alive, idle and have lost nothing, and a table per configuration is printed: requests,
completed, cancelled, errors, generated tokens/s (all clients together), p50/p99 latency of the
completed requests, preemptions, accepted draft tokens, the worst log-probability error and the worst
gap between a greedy token and the reference's top log-probability.

    .venv-vllm/bin/python bench/bench_vllm_server.py             # the full form (tens of minutes)
    .venv-vllm/bin/python bench/bench_vllm_server.py --quick     # a smoke run

The tiny model makes the model's arithmetic negligible: the figures measure vLLM's serving path
(scheduling, the API server, streaming) with kda's layers in it, and depend on what else runs on the
machine. Exit status 1 when any check failed.
"""

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))

import server_load  # noqa: E402
import tiny_kimi  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def configurations(args):
    full = dict(max_model_len=4096)
    long_jobs = dict(max_prompt=args.max_prompt, max_tokens=(4, 16), cancel_tokens=512, repeats=0.3)
    return {
        "bf16": (dict(dtype="bfloat16", **full), long_jobs),
        "bf16-ngram": (dict(dtype="bfloat16", speculative=SPEC, **full), long_jobs),
        # see test_server_load.py: 13 blocks of which a 1024-token request needs 11; prompts ending
        # just short of a 128-token block edge and long decodes keep the pool oversubscribed
        "fp32-preempt": (
            dict(dtype="float32", max_model_len=1024, max_num_seqs=4, num_blocks=13),
            dict(max_prompt=640, max_tokens=(48, 128), cancel_tokens=256, block_edge=128),
        ),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    parser.add_argument("--time-limit", type=float, default=1200, help="seconds of load per configuration")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 requests, prompts <= 300")
    parser.add_argument("--checkpoint", help="the tiny checkpoint's folder (default: written to a temp dir)")
    parser.add_argument("--json", help="also write the reports here")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_prompt = 40, 300

    tmp = tempfile.mkdtemp(prefix="bench_vllm_server_")
    checkpoint = args.checkpoint or tiny_kimi.write_checkpoint(os.path.join(tmp, "tiny-kimi-linear"))
    rows, reports, ok = [], {}, True
    for name, (server_kwargs, job_kwargs) in configurations(args).items():
        if args.only and name not in args.only:
            continue
        jobs = server_load.make_jobs(args.requests, seed=args.seed, **job_kwargs)
        log = os.path.join(tmp, f"{name}.log")
        print(f"== {name}: {args.requests} requests, server log {log}", flush=True)
        began = time.time()
        with server_load.Server(checkpoint, log, **server_kwargs) as server:
            load = server_load.run_load(
                server, jobs, clients=args.clients, time_limit=args.time_limit, request_timeout=600
            )
            fp32 = server_kwargs["dtype"] == "float32"
            tol = server_load.FP32_TOL if fp32 else server_load.BF16_TOL
            rep = server_load.check(
                checkpoint, server, load, tol, greedy_tol=tol if fp32 else 2 * tol, solo=not fp32
            )
        print(
            f"   server start {server.start_seconds:.0f} s, load {load.wall:.0f} s, reference "
            f"{rep.reference_seconds:.0f} s, total {time.time() - began:.0f} s; {rep.tokens_checked} tokens "
            f"checked, {rep.after_cancel_checked} right after a cancellation, "
            f"{rep.cancelled_but_finished} cancelled ones finished by the server first",
            flush=True,
        )
        if rep.solo_rechecked:
            print(f"   outside the bf16 bounds also when served alone: {rep.solo_rechecked}", flush=True)
        for failure in rep.failures[:20]:
            print("   FAIL", failure, flush=True)
        ok = ok and not rep.failures
        rows.append((name, rep.row()))
        reports[name] = {k: v for k, v in vars(rep).items()}
    print()
    server_load.print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
