"""Tiny random checkpoints of the models llama.cpp runs on GATED_DELTA_NET, as GGUF files.

For each of Qwen3-Next, Qwen3.5, Qwen3.5-MoE (the gated delta rule, two value heads per key head)
and Kimi Linear (KDA) it builds a randomly initialised transformers causal LM, saves it as a
checkpoint folder, converts that with llama.cpp's own convert_hf_to_gguf.py (float32, so that the
GGUF holds the checkpoint's exact weights), and records transformers' float32 logits for the test
prompt and its greedy continuation.

The tokenizers are rebuilt from the vocabulary files llama.cpp ships (models/ggml-vocab-*.gguf):
GPT-2's byte-level BPE, small, and Qwen3.5's own. The converter recognises a tokenizer by the hash
of its encoding of a fixed text, and the models' own tokenizer files are not on PyPI.

    python make_models.py LLAMA_CPP_SOURCE OUT_DIR

writes OUT_DIR/NAME/ (the checkpoint), OUT_DIR/NAME.gguf and OUT_DIR/NAME.reference.npz (prompt,
logits [L, vocab], greedy tokens [N]) for every NAME in MODELS.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
sys.modules["fla"] = None  # transformers would prefer fla's Triton kernels, which need a GPU

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

PROMPT_LENGTH = 83  # over one 64-token chunk, not a multiple of it
GENERATE = 8

GDN = dict(
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head: ggml's tiled broadcast
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    tie_word_embeddings=False,
)
# Qwen3.5's rotary sections, sized to its rotary dimensions (32 * 0.25 = 8: 4 pairs); llama.cpp's
# default sections are sized for the real head_dim 256.
MROPE = dict(
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    )
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
KIMI = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,  # llama.cpp sizes the KDA layers by the attention heads, as the real model has
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    linear_head_dim=32,
    linear_num_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["sparse", "sparse", "sparse"],  # transformers saves a dense layer under MoE names
    tie_word_embeddings=False,
)
MODELS = {
    # name: (transformers config, model, its arguments, the vocabulary)
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(GDN, intermediate_size=128, **MOE),
        "gpt-2",
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(GDN, intermediate_size=128, **MROPE),
        "gpt-2",
    ),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(GDN, **MOE, **MROPE), "qwen35"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", KIMI, "gpt-2"),
    # Head size 264, over kda's 256: the backend declines its nodes and ggml's CPU op runs them.
    "qwen3_5_wide_heads": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(GDN, intermediate_size=128, **MROPE, linear_key_head_dim=264, linear_value_head_dim=264),
        "gpt-2",
    ),
}


def prompt_ids():
    rng = np.random.default_rng(7)
    return [int(t) for t in rng.integers(0, 50000, PROMPT_LENGTH)]  # ordinary tokens of both vocabularies


def vocabulary(llama_cpp: Path, name: str):
    """The tokens and merges of one of the vocabulary files llama.cpp ships."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(str(llama_cpp / "models" / f"ggml-vocab-{name}.gguf"))

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    return strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")


def write_tokenizer(llama_cpp: Path, kind: str, folder: Path) -> int:
    """Writes the tokenizer into `folder`; returns the id of <|endoftext|>.

    gpt-2: GPT-2's byte-level BPE (a 50257-token vocabulary), named GPT2Tokenizer so that AutoTokenizer
    reads it as is. qwen35: Qwen3.5's own vocabulary in transformers' Qwen3_5Tokenizer, which
    AutoTokenizer imposes on the Qwen3.5-MoE model type whatever the folder says.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = vocabulary(llama_cpp, kind)
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    if kind == "qwen35":
        tokenizer = transformers.Qwen3_5Tokenizer(vocab=vocab, merges=pairs)
    else:
        bpe = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=bpe,
            bos_token="<|endoftext|>",
            eos_token="<|endoftext|>",
            unk_token="<|endoftext|>",
        )
    tokenizer.save_pretrained(folder)
    if kind == "gpt-2":
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["tokenizer_class"] = "GPT2Tokenizer"
        config_file.write_text(json.dumps(config, indent=2))
    return vocab["<|endoftext|>"]


def remote_code_keys(folder: Path, config):
    """Adds the keys of Moonshot's own Kimi Linear config.json, which llama.cpp's converter reads, for
    what transformers' KimiLinearConfig names otherwise."""
    config_file = folder / "config.json"
    keys = json.loads(config_file.read_text())
    layers = config.layer_types
    keys["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(layers) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(layers) if t == "linear_attention"],
        "num_heads": config.linear_num_heads,
        "head_dim": config.linear_head_dim,
        "short_conv_kernel_size": config.linear_conv_kernel_dim,
    }
    keys["first_k_dense_replace"] = config.mlp_layer_types.index("sparse")
    keys["moe_router_activation_func"] = "sigmoid"  # transformers' router scores with a sigmoid
    config_file.write_text(json.dumps(keys, indent=2))


def checkpoint(llama_cpp: Path, folder: Path, config_name, model_name, extra, vocabulary_name, dtype):
    """A randomly initialised transformers model (seed 0) with its tokenizer, saved in `folder` as a
    checkpoint llama.cpp's converter reads; returns (model, end-of-text id). The gates' A_log and
    dt_bias are drawn from U(-1, 1): the random init leaves them at their defaults."""
    eos = write_tokenizer(llama_cpp, vocabulary_name, folder)
    vocab_size = len(vocabulary(llama_cpp, vocabulary_name)[0])
    config = getattr(transformers, config_name)(
        **extra, vocab_size=vocab_size, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("A_log", "dt_bias")):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0))
    model.save_pretrained(folder, safe_serialization=True)
    if config_name == "KimiLinearConfig":
        remote_code_keys(folder, config)
    return model, eos


def convert(llama_cpp: Path, folder: Path, outtype: str, gguf_file: Path):
    """The checkpoint in `folder` as a GGUF file, by llama.cpp's own convert_hf_to_gguf.py; the Qwen
    models' converters would also export a multi-token prediction head unless told not to."""
    config = json.loads((folder / "config.json").read_text())
    mtp = ["--no-mtp"] if config["model_type"].startswith("qwen") else []
    command = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype]
    done = subprocess.run([*command, *mtp, "--outfile", str(gguf_file)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed on {folder} ({outtype}):\n{done.stderr[-4000:]}")


def make(name: str, llama_cpp: Path, out: Path):
    config_name, model_name, extra, vocabulary_name = MODELS[name]
    model, eos = checkpoint(
        llama_cpp, out / name, config_name, model_name, extra, vocabulary_name, torch.float32
    )
    if "num_experts" in extra or "num_local_experts" in extra:
        model.set_experts_implementation("eager")
    convert(llama_cpp, out / name, "f32", out / f"{name}.gguf")
    ids = prompt_ids()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
        generated = model.generate(
            torch.tensor([ids]), max_new_tokens=GENERATE, do_sample=False, eos_token_id=None, pad_token_id=eos
        )[0, len(ids) :].numpy()
    np.savez(out / f"{name}.reference.npz", prompt=np.array(ids), logits=logits, tokens=generated)


def main():
    llama_cpp, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    names = sys.argv[3:] or list(MODELS)
    for name in names:
        make(name, llama_cpp, out)
    print(json.dumps({"models": names, "out": str(out)}))


if __name__ == "__main__":
    main()
