"""The scheduler's token budget follows the raised batch size when chunked prefill is off.

Where MLA runs on vLLM 0.32.0's reference CPU backend (float32 engines; every engine on CPUs without
AMX), ``CpuPlatform.check_and_update_config`` turns chunked prefill off and raises
``max_num_batched_tokens`` to ``max(max_model_len, 2048)``, so that any prompt fits one step. But
``VllmConfig`` set ``max_num_scheduled_tokens`` (the scheduler's real budget under speculative decoding)
from the old ``max_num_batched_tokens`` before the platform ran, and leaves it. A prompt longer than that
budget is then never scheduled: the scheduler stops at it every step, so the request and every request
queued behind it wait forever (a float32 engine with ``--max-num-batched-tokens 128`` and a 129-token
prompt). Mend: raise the budget to the new ``max_num_batched_tokens``.
"""

from ..._patching import code_shows, install

PHASE = "process"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("vllm.platforms.cpu:CpuPlatform.check_and_update_config",)


def needed():
    """The platform raises max_num_batched_tokens and leaves max_num_scheduled_tokens as it was."""
    from vllm.platforms.cpu import CpuPlatform

    return code_shows(
        CpuPlatform.check_and_update_config.__func__,
        "max_num_batched_tokens =",
        absent=("max_num_scheduled_tokens",),
    )


def mended(inner):
    def check_and_update_config(cls, vllm_config):
        inner(cls, vllm_config)
        scheduler = vllm_config.scheduler_config
        budget = scheduler.max_num_scheduled_tokens
        if not scheduler.enable_chunked_prefill and budget is not None:
            scheduler.max_num_scheduled_tokens = max(budget, scheduler.max_num_batched_tokens)

    return check_and_update_config


def apply():
    from vllm.platforms.cpu import CpuPlatform

    install(CpuPlatform, "check_and_update_config", __name__, mended)
