"""transformers' gated delta rule models on kda, through the Hugging Face `kernels` hub: GDN's check of
harness.MODEL_CHECKS, run in its own process for test_transformers.py and test_gdn_transformers.py
(python gdn_models_check.py HUB_FOLDER), printing one JSON line, {model: report}.

For each of Qwen3-Next, Qwen3.5, Qwen3.5-MoE and OLMo-hybrid it builds a tiny, randomly initialised
causal LM (grouped value heads: the models expand q and k to the value heads themselves) and runs it
twice: with transformers' own torch functions (torch_chunk_gated_delta_rule /
torch_recurrent_gated_delta_rule), then kernelized with kda's hub layers (register_kernel_mapping +
LocalLayerRepository + model.set_use_kernels(True): nothing of transformers is patched). fla is made
unimportable first, because transformers prefers an installed fla over its torch functions and fla's
Triton kernels cannot run on the CPU. It reports the logits' relative error, every parameter
gradient's relative error against the model in float64 (kda's oracle) for kda and the fallback, the
greedy tokens of prefill-then-decode generation with the cache, and which kda ops the
dispatcher ran.
"""

import json
import os
import sys
from pathlib import Path

sys.modules["fla"] = None  # transformers then takes its torch functions
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import transformers  # noqa: E402
from kernels import LocalLayerRepository, register_kernel_mapping  # noqa: E402
from model_check import OpLog, generate, namespace_of_the_hub_copy, rel, train_step  # noqa: E402

LAYERS = ["linear_attention", "full_attention", "linear_attention"]
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=len(LAYERS),
    num_attention_heads=2,
    num_key_value_heads=1,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=LAYERS,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
QWEN = dict(head_dim=16, intermediate_size=128)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
MODELS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(QWEN, **MOE)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(head_dim=16, **MOE)),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(intermediate_size=128)),
}


def tiny_model(name):
    config_name, model_name, extra = MODELS[name]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).float()
    if "num_experts" in extra:  # torch's grouped_mm, transformers' default, has no float64
        model.set_experts_implementation("eager")
    return model, config


def check(name, hub, gen):
    model, config = tiny_model(name)
    ids = torch.randint(3, config.vocab_size, (2, 100), generator=gen)  # T not a multiple of 64
    prompt = torch.randint(3, config.vocab_size, (1, 21), generator=gen)
    new_tokens = 8

    logits_ref, grads_ref = train_step(model, ids)
    tokens_ref = generate(model, prompt, new_tokens)

    model.train()
    model.set_use_kernels(True)
    namespace = namespace_of_the_hub_copy()
    with OpLog(namespace) as train_log:
        logits, grads = train_step(model, ids)
    with OpLog(namespace) as gen_log:
        tokens = generate(model, prompt, new_tokens)
    # The exact gradients: the same model in float64, whose kda layers then run kda's float64 oracle.
    # transformers' torch function computes in float32 and its chunked form differentiates exp() of
    # cumulative decays: with the models' strong gates its g gradient (A_log's, dt_bias') is off by up
    # to ~1e-2 relative, so gradients are measured against this reference, for both sides.
    model.double()
    logits64, grads64 = train_step(model, ids.clone())
    return {
        "linear_layers": config.layer_types.count("linear_attention"),
        "new_tokens": new_tokens,
        "logits_error": rel(logits, logits_ref),
        "logits_error_exact": rel(logits, logits64),
        "grad_errors": {n: rel(g, grads64[n]) for n, g in grads.items()},
        "fallback_grad_errors": {n: rel(g, grads64[n]) for n, g in grads_ref.items()},
        "grads_missing": sorted(set(grads_ref) ^ set(grads)),
        "train_ops": train_log.counts,
        "generate_ops": gen_log.counts,
        "tokens_equal": bool(torch.equal(tokens, tokens_ref)),
    }


def main(hub_folder):
    hub = Path(hub_folder)
    register_kernel_mapping(
        {
            "chunk_gated_delta_rule": {
                "cpu": LocalLayerRepository(repo_path=hub, layer_name="chunk_gated_delta_rule")
            },
            "fused_recurrent_gated_delta_rule": {
                "cpu": LocalLayerRepository(repo_path=hub, layer_name="recurrent_gated_delta_rule")
            },
        }
    )
    gen = torch.Generator().manual_seed(1)
    print(json.dumps({name: check(name, hub, gen) for name in MODELS}))


if __name__ == "__main__":
    main(sys.argv[1])
