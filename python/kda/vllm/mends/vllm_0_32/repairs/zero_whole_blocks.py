"""The CPU model runner zeroes whole manager blocks of new attention blocks ("first request drifts").

vLLM 0.32.0's CPU model runner zeroes the attention cache blocks the scheduler just allocated
(``CPUModelRunner._zero_block_ids``) with ``kv[block_id].zero_()``. For a hybrid model the attention
cache is bound in kernel blocks (16 tokens for the CPU MLA backend) while block ids count manager
blocks (128 tokens for Kimi Linear, aligned to one mamba state): ``kv[block_id]`` is then 1/8 of manager
block ``block_id / 8``, which is another layer's page, a KDA layer's recurrent and conv state of an
earlier request (with the allocator's order, often the first request of the batch). That request's
state is overwritten by zeros whenever a request joins, so its log-probabilities drift by 0.07-1.3 from
the next step on. Mend: zero the kernel blocks that make up each manager block, as vLLM's GPU runner
(``KVBlockZeroer``) does.
"""

import torch

from ..._patching import code_shows, replace

PHASE = "model"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("vllm.v1.worker.cpu_model_runner:CPUModelRunner._zero_block_ids",)


def _runner():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return CPUModelRunner


def needed():
    """The runner indexes the kernel-block cache with manager block ids."""
    return code_shows(_runner()._zero_block_ids, "kv[block_id].zero_()")


def _zero_block_ids(self, block_ids):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    num_blocks = self.kv_cache_config.num_blocks
    seen = set()
    for group in self.kv_cache_config.kv_cache_groups:
        if not isinstance(group.kv_cache_spec, FullAttentionSpec):
            continue
        for name in group.layer_names:
            layer = self.compilation_config.static_forward_context.get(name)
            kv = getattr(layer, "kv_cache", None)
            if not isinstance(kv, torch.Tensor) or kv.data_ptr() in seen:
                continue
            seen.add(kv.data_ptr())
            ratio = max(kv.shape[0] // num_blocks, 1)  # kernel blocks per manager block
            for block_id in block_ids:
                kv[block_id * ratio : (block_id + 1) * ratio].zero_()


def apply():
    replace(_runner(), "_zero_block_ids", __name__, _zero_block_ids)
