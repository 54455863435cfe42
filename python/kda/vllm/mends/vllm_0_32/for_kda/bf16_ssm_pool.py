"""Kimi Linear keeps the bfloat16 recurrent-state pool asked for (``mamba_ssm_cache_dtype``).

On CPUs with AVX-512 BF16, vLLM 0.32.0's ``CpuPlatform.check_and_update_config`` resets
``mamba_ssm_cache_dtype`` to float32 for every model but its own GDN ones ("Reset SSM cache type to
float32 for accelerated GDN mamba backend 'kimi_linear'"), because its CPU state kernels for other
models take float32: right for vLLM's layers, but Kimi Linear's KDA layers run on kda, which reads and
writes bf16 pools in place. Mend: for ``kimi_linear`` a ``bfloat16`` pool asked for is kept (on CPUs
without AVX-512 BF16 it always was). The layer's ``get_state_dtype`` passes the dtype on, which vLLM's
Kimi layer does not.
"""

from ..._patching import code_shows, install

PHASE = "process"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("vllm.platforms.cpu:CpuPlatform.check_and_update_config",)


def needed():
    """The platform resets a bf16 SSM cache dtype to float32 for models other than its GDN ones."""
    from vllm.platforms.cpu import CpuPlatform

    return code_shows(CpuPlatform.check_and_update_config.__func__, 'mamba_ssm_cache_dtype = "float32"')


def mended(inner):
    def check_and_update_config(cls, vllm_config):
        cache = vllm_config.cache_config
        asked = cache.mamba_ssm_cache_dtype
        inner(cls, vllm_config)
        text_config = getattr(vllm_config.model_config, "hf_text_config", None)
        model_type = getattr(text_config, "model_type", None)
        if asked == "bfloat16" and model_type == "kimi_linear" and cache.mamba_ssm_cache_dtype != asked:
            cache.mamba_ssm_cache_dtype = asked

    return check_and_update_config


def apply():
    from vllm.platforms.cpu import CpuPlatform

    install(CpuPlatform, "check_and_update_config", __name__, mended)
