"""transformers' Kimi Linear on kda, through the Hugging Face `kernels` hub: KDA's check of
harness.MODEL_CHECKS, run in its own process for test_transformers.py (python kimi_linear_check.py
HUB_FOLDER), printing one JSON line, {"kimi_linear": report}.

It runs a tiny, randomly initialised KimiLinearForCausalLM twice: with transformers' own torch
fallbacks, then kernelized with kda's hub layers (register_kernel_mapping + LocalLayerRepository +
model.set_use_kernels(True): no patching of transformers). fla is made unimportable first, because
transformers prefers an installed fla over its torch fallbacks and fla's Triton kernels cannot run on
the CPU. It reports the logits' and every parameter gradient's relative error, the greedy tokens of
prefill-then-decode generation with the cache, and which kda ops the dispatcher ran.
"""

import json
import os
import sys
from pathlib import Path

sys.modules["fla"] = None  # transformers then takes its torch fallbacks
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
from kernels import LocalLayerRepository, register_kernel_mapping  # noqa: E402
from model_check import OpLog, generate, namespace_of_the_hub_copy, rel, train_step  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402


def tiny_model():
    config = KimiLinearConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        linear_head_dim=16,
        linear_num_heads=2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "dense", "dense"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return KimiLinearForCausalLM(config).float(), config


def main(hub_folder):
    model, config = tiny_model()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (2, 100), generator=gen)  # T not a multiple of 64
    prompt = torch.randint(3, config.vocab_size, (1, 21), generator=gen)
    new_tokens = 12

    logits_ref, grads_ref = train_step(model, ids)
    tokens_ref = generate(model, prompt, new_tokens)

    hub = Path(hub_folder)
    register_kernel_mapping(
        {
            "chunk_kda": {
                "cpu": LocalLayerRepository(repo_path=hub, layer_name="chunk_kimi_delta_attention")
            },
            "fused_recurrent_kda": {
                "cpu": LocalLayerRepository(repo_path=hub, layer_name="recurrent_kimi_delta_attention")
            },
        }
    )
    model.train()
    model.set_use_kernels(True)
    namespace = namespace_of_the_hub_copy()

    with OpLog(namespace) as train_log:
        logits, grads = train_step(model, ids)
    with OpLog(namespace) as gen_log:
        tokens = generate(model, prompt, new_tokens)

    linear_layers = config.layer_types.count("linear_attention")
    print(
        json.dumps(
            {
                "kimi_linear": {
                    "namespace": namespace,
                    "linear_layers": linear_layers,
                    "new_tokens": new_tokens,
                    "logits_error": rel(logits, logits_ref),
                    "grad_errors": {n: rel(g, grads_ref[n]) for n, g in grads.items()},
                    "grads_missing": sorted(set(grads_ref) ^ set(grads)),
                    "train_ops": train_log.counts,
                    "generate_ops": gen_log.counts,
                    "tokens_equal": bool(torch.equal(tokens, tokens_ref)),
                    "tokens": tokens.tolist(),
                }
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
