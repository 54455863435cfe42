"""vLLM on the CPU: Kimi Linear's KDA layers on kda next to vLLM's native CPU GDN layers.

Two random stacks of the same sizes, served by vLLM's CPU build (run with the vLLM environment):
  - Kimi-Linear-shaped: KDA layers of 32 heads of 128 (kda, through the kda.vllm plugin), one MLA
    layer, a small MoE;
  - Qwen3-Next-shaped: Gated DeltaNet layers of 32 heads of 128 (vLLM's native CPU kernels), one
    full-attention layer, the same MoE.
The Kimi stack runs twice: with vLLM's default recurrent state for KDA (float32) and with a bf16
state (``mamba_ssm_cache_dtype="bfloat16"``), which is vLLM's default for GDN (the model's dtype):
the same state bytes per step as the Qwen stack.
For each, at batch 1, 8 and 32: prefill tokens/s (``--prompt`` tokens per request, one step) and decode
tokens/s (``--decode`` generated tokens per request), and the time and share of the step time spent in
the linear-attention layers (their forward, timed inside the engine). Every engine step of a generate
call is timed: a step whose batch held prefill tokens counts as prefill (the layers report it), the
others as decode steps; the median of ``--reps`` calls.

    bash scripts/setup_vllm.sh
    .venv-vllm/bin/python bench/bench_vllm.py --threads 2            # the figures (minutes)
    .venv-vllm/bin/python bench/bench_vllm.py --tiny                 # a smoke test (tiny sizes)

Each model runs in its own process (``--run``); the engine runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the layer timers are read where they run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SIZES = dict(hidden=2304, heads=32, head_dim=128, layers=4, experts=8, top_k=2, moe=256, vocab=4096)
# (vLLM's CPU GDN kernels take head dim 128 only, so the tiny stack keeps it)
TINY = dict(hidden=64, heads=2, head_dim=128, layers=4, experts=4, top_k=2, moe=32, vocab=128)


def kimi_config(s):
    layers = s["layers"]
    full = [layers - 1]  # 1-based: the third of four layers is MLA, as in Kimi Linear's 3:1 ratio
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": s["vocab"],
        "hidden_size": s["hidden"],
        "intermediate_size": 2 * s["moe"],
        "moe_intermediate_size": s["moe"],
        "num_hidden_layers": layers,
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["heads"],
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": s["head_dim"],
        "mla_use_nope": True,
        "num_experts": s["experts"],
        "num_experts_per_token": s["top_k"],
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in range(layers) if i + 1 not in full],
            "full_attn_layers": full,
            "head_dim": s["head_dim"],
            "num_heads": s["heads"],
            "short_conv_kernel_size": 4,
        },
    }


def qwen_config(s):
    layers = s["layers"]
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": s["vocab"],
        "hidden_size": s["hidden"],
        "intermediate_size": 2 * s["moe"],
        "moe_intermediate_size": s["moe"],
        "shared_expert_intermediate_size": s["moe"],
        "num_hidden_layers": layers,
        "num_attention_heads": s["heads"],
        "num_key_value_heads": 2,
        "head_dim": s["head_dim"],
        "linear_num_key_heads": s["heads"],
        "linear_num_value_heads": s["heads"],
        "linear_key_head_dim": s["head_dim"],
        "linear_value_head_dim": s["head_dim"],
        "linear_conv_kernel_dim": 4,
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "norm_topk_prob": True,
        "layer_types": ["full_attention" if i == layers - 2 else "linear_attention" for i in range(layers)],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_checkpoint(path, config):
    """Random weights (transformers' own initialisation) and a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if config["model_type"] == "kimi_linear":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "vllm"))
        import tiny_kimi

        tiny_kimi._rename_dense_mlp(path)
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0"
    ).save_pretrained(path)


def _timed(cls, timer):
    """Times cls.forward into timer[0]; sets timer[1] when a call's batch held prefill tokens."""
    forward = cls.forward
    from vllm.forward_context import get_forward_context

    def timed_forward(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            timer[0] += time.perf_counter() - start
            metadata = get_forward_context().attn_metadata
            m = metadata.get(self.prefix) if isinstance(metadata, dict) else None
            if m is not None and getattr(m, "num_prefills", 0) > 0:
                timer[1] = True

    cls.forward = timed_forward


def run(path, kind, batches, prompt, decode, threads, reps, state_dtype):
    """One model: prefill and decode at each batch size; prints one JSON line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    from vllm import LLM, SamplingParams

    timer = [0.0, False]  # seconds in the linear layers; whether this step had prefill tokens
    if kind == "kimi":
        import kda.vllm
        import kda.vllm.layer

        kda.vllm.register()
        _timed(kda.vllm.layer.KdaKimiDeltaAttention, timer)
    else:
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (  # noqa: F401
            QwenGatedDeltaNetAttention as layer_cls,
        )

        _timed(layer_cls, timer)
    llm = LLM(
        path,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=prompt + decode + 16,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(batches) * (prompt + 16),
        dtype="bfloat16",
        seed=0,
        **({} if state_dtype == "auto" else {"mamba_ssm_cache_dtype": state_dtype}),
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    ids = [4 + (7 * i) % (vocab - 4) for i in range(prompt)]
    # Every engine step timed, with the linear-attention layers' time inside it; a step whose batch
    # held prefill tokens (the prefill of a batch may take several steps: the scheduler's token
    # budget) counts as prefill, the others as decode steps.
    steps = []
    engine_step = llm.llm_engine.step

    def timed_step():
        start, layer = time.perf_counter(), timer[0]
        timer[1] = False
        try:
            return engine_step()
        finally:
            steps.append((time.perf_counter() - start, timer[0] - layer, timer[1]))

    llm.llm_engine.step = timed_step
    rows = []
    for batch in batches:
        prompts = [{"prompt_token_ids": ids[i % 7 :] + ids[: i % 7]} for i in range(batch)]
        params = SamplingParams(max_tokens=decode + 1, temperature=0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        runs = []
        for _ in range(reps):
            steps.clear()
            llm.generate(prompts, params, use_tqdm=False)
            head = [s for s in steps if s[2]]
            rest = [s for s in steps if not s[2] and s[1] > 0]  # (steps that ran no layer: none)
            runs.append(
                (
                    sum(s[0] for s in head),
                    sum(s[1] for s in head),
                    sum(s[0] for s in rest),
                    sum(s[1] for s in rest),
                    len(rest),
                    len(head),
                )
            )
        # the median run by its total time (its prefill and decode figures belong together)
        runs.sort(key=lambda r: r[0] + r[2])
        prefill_s, prefill_layer, decode_s, decode_layer, decode_steps, prefill_steps = runs[len(runs) // 2]
        rows.append(
            dict(
                batch=batch,
                prefill_tok_s=batch * prompt / prefill_s,
                prefill_linear_share=prefill_layer / prefill_s,
                prefill_linear_ms=1e3 * prefill_layer,
                decode_tok_s=batch * decode / decode_s,
                decode_linear_share=decode_layer / decode_s,
                decode_linear_ms_per_step=1e3 * decode_layer / max(decode_steps, 1),
                decode_steps=decode_steps,
                prefill_steps=prefill_steps,
            )
        )
    print("RESULT " + json.dumps(rows), flush=True)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--decode", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--reps", type=int, default=3, help="timed generate calls per batch (the median)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    parser.add_argument("--write", nargs=2, metavar=("CHECKPOINT", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--run", nargs=2, metavar=("CHECKPOINT", "KIND"), help=argparse.SUPPRESS)
    parser.add_argument("--state-dtype", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.write:
        write_checkpoint(args.write[0], json.loads(args.write[1]))
        return
    if args.run:
        run(
            args.run[0],
            args.run[1],
            batches,
            args.prompt,
            args.decode,
            args.threads,
            args.reps,
            args.state_dtype,
        )
        return
    sizes = TINY if args.tiny else SIZES
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        configs = {"kimi": kimi_config(sizes), "qwen": qwen_config(sizes)}
        for kind, config in configs.items():
            done = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--write",
                    os.path.join(tmp, kind),
                    json.dumps(config),
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                sys.exit(f"bench_vllm: writing the {kind} checkpoint failed:\n{done.stderr[-4000:]}")
        for label, kind, state_dtype in (
            ("kimi", "kimi", "auto"),
            ("kimi_bf16", "kimi", "bfloat16"),
            ("qwen", "qwen", "auto"),
        ):
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--run", os.path.join(tmp, kind), kind]
                + ["--batches", args.batches, "--prompt", str(args.prompt), "--decode", str(args.decode)]
                + ["--threads", str(args.threads), "--reps", str(args.reps), "--state-dtype", state_dtype],
                env=env,
                capture_output=True,
                text=True,
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"bench_vllm: the {label} run failed:\n{proc.stderr[-4000:]}")
            results[label] = json.loads(lines[-1][len("RESULT ") :])
    name = {
        "kimi": "Kimi Linear, KDA on kda (fp32 state)",
        "kimi_bf16": "Kimi Linear, KDA on kda (bf16 state)",
        "qwen": "Qwen3-Next, vLLM's CPU GDN (bf16 state)",
    }
    print(
        f"sizes {sizes}, {args.threads} threads, prompt {args.prompt}, decode {args.decode}, "
        f"median of {args.reps} generate calls"
    )
    print(
        "\n| model | batch | prefill steps | prefill tok/s | linear layers, prefill ms | share "
        "| decode steps | decode tok/s | linear layers, ms per decode step | share |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, rows in results.items():
        for r in rows:
            print(
                f"| {name[kind]} | {r['batch']} | {r['prefill_steps']} | {r['prefill_tok_s']:.1f} "
                f"| {r['prefill_linear_ms']:.1f} | {r['prefill_linear_share']:.1%} | {r['decode_steps']} "
                f"| {r['decode_tok_s']:.1f} "
                f"| {r['decode_linear_ms_per_step']:.2f} | {r['decode_linear_share']:.1%} |"
            )
    print("\nThe target: KDA layers on kda take no more time per step than vLLM's native GDN layers")
    print("| batch | state | prefill: KDA / GDN layer time | decode: KDA / GDN layer time per step |")
    print("| --- | --- | --- | --- |")
    for label, state in (("kimi", "KDA fp32, GDN bf16"), ("kimi_bf16", "both bf16")):
        for kimi, qwen in zip(results[label], results["qwen"], strict=True):
            print(
                f"| {kimi['batch']} | {state} | {kimi['prefill_linear_ms'] / qwen['prefill_linear_ms']:.2f} "
                f"| {kimi['decode_linear_ms_per_step'] / qwen['decode_linear_ms_per_step']:.2f} |"
            )


if __name__ == "__main__":
    main()
