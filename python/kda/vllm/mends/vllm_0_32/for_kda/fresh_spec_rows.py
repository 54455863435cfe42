"""The GDN metadata marks speculative rows of requests with no computed token (``kda_spec_fresh``).

With speculative decoding on, vLLM 0.32.0's GDN metadata builder classifies every request that has a
draft count (>= 0) as a speculative row, including a request whose prompt is one token: its first step
is then a speculative row, which resumes from the state slot at ``num_accepted_tokens - 1`` with no
``has_initial_state`` flag, i.e. from whatever state the recycled slot holds, and the request drifts.
Mend: the builder also records, for each speculative row, whether the request has no computed token
yet; kda's layer (``kda.vllm.layer.serve_step``) zeroes those rows' state and conv slots before the step.
"""

from ..._patching import code_shows, install

PHASE = "model"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder.build",)


def _builder():
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    return GDNAttentionMetadataBuilder


def needed():
    """Speculative rows are every row with a draft count, and the metadata gives them no initial-state
    flag."""
    import dataclasses

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    fields = [f.name for f in dataclasses.fields(GDNAttentionMetadata)]
    if "spec_sequence_masks" not in fields:
        return False
    if any("spec" in f and "initial" in f for f in fields):
        return False
    return code_shows(_builder().build, "num_decode_draft_tokens_cpu >= 0")


def mended(build):
    def build_with_fresh_rows(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        metadata = build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        mask = getattr(metadata, "spec_sequence_masks_cpu", None)
        if metadata.spec_sequence_masks is not None and mask is not None:
            computed = common_attn_metadata.compute_num_computed_tokens()[: mask.shape[0]]
            metadata.kda_spec_fresh = (computed[mask] == 0)[: metadata.num_spec_decodes]
        return metadata

    return build_with_fresh_rows


def apply():
    install(_builder(), "build", __name__, mended)
