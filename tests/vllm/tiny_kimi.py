"""A tiny random Kimi Linear checkpoint (config, weights, word-level tokenizer), written by the tests.

Its shapes are the smallest vLLM's CPU build serves: the CPU MLA backend needs kv_lora_rank 512 and
qk_rope_head_dim 64; everything else is small (hidden 64, 2 KDA heads of 32, 4 experts of 32). Layers
1, 2 and 4 are KDA layers, layer 3 is MLA (the checkpoint's 1-based ``kda_layers`` /
``full_attn_layers``), the first layer's MLP dense and the others MoE, as in Kimi Linear.
"""

import json
import os

WORDS = [
    "the", "a", "cat", "dog", "sat", "on", "mat", "ran", "to", "park", "and", "then", "it", "was",
    "big", "small", "red", "blue", "green", "house", "tree", "sun", "moon", "star", "sky", "sea",
    "fish", "bird", "ate", "saw", "with", "under", "over", "one", "two", "three", "four", "five",
    "six", "seven", "eight", "nine", "ten", "hello", "world", "is", "of", "in",
]  # fmt: skip
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
VOCAB = 128


def config_dict(**linear_attn):
    """The checkpoint's config; keyword arguments replace entries of its ``linear_attn_config``."""
    config = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 72,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 64,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 4,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "model_max_length": 4096,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "linear_attn_config": {
            "kda_layers": [1, 2, 4],
            "full_attn_layers": [3],
            "head_dim": 32,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
        },
    }
    config["linear_attn_config"].update(linear_attn)
    return config


def write_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS)}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    for i in range(len(vocab), VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(path)


def write_checkpoint(path, seed=0, **linear_attn):
    """Writes the checkpoint to ``path`` (once: a finished folder is reused) and returns ``path``;
    keyword arguments replace entries of the config's ``linear_attn_config`` (``head_dim=512``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "done")):
        return path
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_dict(**linear_attn), f, indent=1)
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    far_from_flat(model)
    model.save_pretrained(path)
    _rename_dense_mlp(path)
    with open(os.path.join(path, "config.json"), "w") as f:  # the checkpoint's own config, as written
        json.dump(config_dict(**linear_attn), f, indent=1)
    write_tokenizer(path)
    open(os.path.join(path, "done"), "w").close()
    return path


def far_from_flat(model, norm_center=lambda name: 1.0):
    """Random weights of a scale that makes the logits far from uniform (a random model with the usual
    0.02 initialisation predicts an almost flat distribution, which would test nothing); the gate's
    A_log and dt_bias in the ranges of trained models. ``norm_center(name)``: where a norm's weights
    centre (1 for a plain RMSNorm; 0 for one that scales by 1 + weight)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 8.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "conv1d" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in name:
                p.copy_(norm_center(name) + 0.1 * torch.randn_like(p))
            elif "e_score_correction_bias" in name:
                p.zero_()
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.1)


def _rename_dense_mlp(path):
    """transformers saves the dense MLP of the first layer under ``block_sparse_moe`` (its renaming of
    MoE blocks runs backwards over every ``mlp``); Kimi Linear checkpoints, and vLLM, call it ``mlp``."""
    import re

    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    dense = re.compile(r"(\.layers\.\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.")
    save_file(
        {dense.sub(r"\1.mlp.\2.", k): v.contiguous() for k, v in weights.items()}, file, {"format": "pt"}
    )
