"""The gated delta rule's models in transformers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid, built
and run by gdn_models_check.py) on kda's hub layers, against the same models in float64: their own
checks. What every family's models share is in test_transformers.py."""

import pytest
from harness import family_models
from kda._family import GDN

pytest.importorskip("transformers")
pytest.importorskip("kernels")


@pytest.mark.parametrize("family, model", family_models((GDN,)))
def test_logits_and_every_gradient_against_the_model_in_float64(report):
    assert report["logits_error_exact"] <= 1e-5  # against the model in float64
    # Against the float64 model: kda's every gradient is exact to fp32 rounding, and never further
    # from it than transformers' torch function (whose gate gradient is the least exact).
    worst = max(report["grad_errors"].values())
    assert worst <= 1e-5, sorted(report["grad_errors"].items(), key=lambda kv: -kv[1])[:3]
    for name, error in report["grad_errors"].items():
        assert error <= max(report["fallback_grad_errors"][name], 2e-6), name
