"""transformers' models of every family run their linear attention through kda's hub layers,
unchanged: Kimi Linear (KDA), Qwen3-Next, Qwen3.5, Qwen3.5-MoE and OLMo-hybrid (the gated delta rule).
Each family's models are built and run by its check (harness.MODEL_CHECKS: kimi_linear_check.py,
gdn_models_check.py), in its own process because transformers must not see fla there; the gated delta
rule's own checks (against the models in float64) are in test_gdn_transformers.py."""

import pytest
from harness import family_models
from kda._family import KDA

pytest.importorskip("transformers")
pytest.importorskip("kernels")


@pytest.mark.parametrize("family, model", family_models())
def test_training_runs_on_kda_ops(report):
    # One chunked forward and backward per linear-attention layer: kda's ops, not the torch function.
    n = report["linear_layers"]
    assert report["train_ops"] == {"chunk_fwd": n, "chunk_bwd": n}


@pytest.mark.parametrize("family, model", family_models())
def test_logits_match_transformers_torch_functions_and_every_gradient_is_there(report):
    assert report["logits_error"] <= 1e-5
    assert not report["grads_missing"]


@pytest.mark.parametrize("family, model", family_models((KDA,)))
def test_every_gradient_matches_transformers_fallback(report):
    # (the gated delta rule's torch functions differentiate exp() of cumulative decays: their gate
    # gradients are far from exact, and test_gdn_transformers.py measures both against float64)
    worst = max(report["grad_errors"].values())
    assert worst <= 1e-4, sorted(report["grad_errors"].items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("family, model", family_models())
def test_generation_prefills_with_the_chunked_op_and_decodes_with_the_recurrent_op(report):
    n, steps = report["linear_layers"], report["new_tokens"] - 1
    assert report["generate_ops"] == {"chunk_fwd": n, "recurrent_fwd": n * steps}
    assert report["tokens_equal"]
