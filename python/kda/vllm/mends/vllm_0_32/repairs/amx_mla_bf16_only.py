"""The AMX MLA backend only for bf16 engines: other dtypes get the reference CPU MLA backend.

On CPUs with AMX tiles vLLM 0.32.0 prefers its AMX MLA backend (``CpuPlatform.get_attn_backend_cls``)
whatever the engine's dtype, but that backend's kernels take bf16 only
(``AMXMLABackend.supported_dtypes``): a float32 engine stops at its first decode step in
``decode_attention_cpu`` ("not implemented for 'Float'"). Mend: for an MLA model in another dtype, with
no backend chosen by the user, the platform's config step chooses the reference CPU MLA backend, as on
CPUs without AMX (a bf16 engine keeps AMX MLA).
"""

import torch

from ..._patching import code_shows, install

PHASE = "process"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("vllm.platforms.cpu:CpuPlatform.check_and_update_config",)


def needed():
    """The AMX MLA backend takes bf16 only, and the platform picks it without looking at the dtype."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend

    if set(AMXMLABackend.supported_dtypes) >= {torch.float32, torch.bfloat16}:
        return False
    return code_shows(CpuPlatform.get_attn_backend_cls.__func__, "AMX_MLA", absent=("dtype",))


def mended(inner):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def check_and_update_config(cls, vllm_config):
        model = vllm_config.model_config
        attention = vllm_config.attention_config
        if (
            model is not None
            and getattr(model, "use_mla", False)
            and model.dtype != torch.bfloat16
            and attention.backend is None
        ):
            attention.backend = AttentionBackendEnum.CPU_MLA
        inner(cls, vllm_config)

    return check_and_update_config


def apply():
    from vllm.platforms.cpu import CpuPlatform

    install(CpuPlatform, "check_and_update_config", __name__, mended)
