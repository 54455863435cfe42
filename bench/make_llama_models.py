"""Models with real layer sizes and random weights for llama-bench, as F16 and Q8_0 GGUF files.

Two 4-layer models, three gated-delta-net layers and one attention layer as in the real models' 3:1
pattern, with their real widths:
  qwen3_5: Qwen3.5-shaped, hidden 2048, 16 key and 32 value heads of 128, MLP 6144, gated attention
           with 16 query and 2 key-value heads of 256;
  kimi_linear: Kimi-Linear-shaped, hidden 2304, 32 KDA heads of 128, MLA (32 heads, KV rank 512),
           mixture of experts with 8 of 16 routed experts of 1024 and one shared expert per token
           (the real model routes 8 of 256: the same work per token, a 16th of the weights).
Both take GPT-2's vocabulary (tests/ggml/make_models.py rebuilds it from llama.cpp's own file). The
weights are transformers' random initialisation in bf16; the gates' A_log and dt_bias are drawn as
in the tests. Converted by llama.cpp's convert_hf_to_gguf.py.

    python bench/make_llama_models.py LLAMA_CPP_SOURCE OUT_DIR [NAME ...]

writes OUT_DIR/NAME-f16.gguf and OUT_DIR/NAME-q8_0.gguf, and skips files that exist.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ggml"))
import make_models  # noqa: E402  (sets up transformers without fla)
import torch  # noqa: E402

OUTTYPES = ("f16", "q8_0")
LAYERS = ["linear_attention"] * 3 + ["full_attention"]
MODELS = {
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=4,
            layer_types=LAYERS,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.25,
                mrope_section=[11, 11, 10],
                mrope_interleaved=True,
            ),
        ),
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            hidden_size=2304,
            intermediate_size=9216,
            moe_intermediate_size=1024,
            num_hidden_layers=4,
            layer_types=LAYERS,
            mlp_layer_types=["sparse"] * 4,  # transformers saves a dense layer under MoE names
            num_local_experts=16,
            num_experts_per_tok=8,
            n_shared_experts=1,
            linear_num_heads=32,
            linear_head_dim=128,
            tie_word_embeddings=False,
        ),
    ),
}


def make(name: str, llama_cpp: Path, out: Path):
    files = [out / f"{name}-{t}.gguf" for t in OUTTYPES]
    if all(f.exists() for f in files):
        return
    config_name, model_name, extra = MODELS[name]
    folder = out / name
    make_models.checkpoint(llama_cpp, folder, config_name, model_name, extra, "gpt-2", torch.bfloat16)
    for outtype, gguf_file in zip(OUTTYPES, files, strict=True):
        make_models.convert(llama_cpp, folder, outtype, gguf_file)


def main():
    llama_cpp, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    names = sys.argv[3:] or list(MODELS)
    for name in names:
        make(name, llama_cpp, out)
    print(json.dumps({"models": names, "out": str(out)}))


if __name__ == "__main__":
    main()
