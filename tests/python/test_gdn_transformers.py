"""transformers' gated delta rule models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid) run their GDN
through kda's hub layers, unchanged (see gdn_models_check.py, run in its own process because
transformers must not see fla there)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("kernels")

CHECK = Path(__file__).with_name("gdn_models_check.py")
MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")


@pytest.fixture(scope="module")
def reports(hub_folder):
    result = subprocess.run(
        [sys.executable, str(CHECK), str(hub_folder)], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", MODELS)
def test_training_runs_on_kda_ops(reports, model):
    # One chunked forward and backward per linear-attention layer: kda's ops, not the torch function.
    report = reports[model]
    n = report["linear_layers"]
    assert report["train_ops"] == {"chunk_fwd": n, "chunk_bwd": n}


@pytest.mark.parametrize("model", MODELS)
def test_logits_and_every_gradient(reports, model):
    report = reports[model]
    assert report["logits_error"] <= 1e-5  # against transformers' torch function
    assert report["logits_error_exact"] <= 1e-5  # against the model in float64
    assert not report["grads_missing"]
    # Against the float64 model: kda's every gradient is exact to fp32 rounding, and never further
    # from it than transformers' torch function (whose gate gradient is the least exact).
    worst = max(report["grad_errors"].values())
    assert worst <= 1e-5, sorted(report["grad_errors"].items(), key=lambda kv: -kv[1])[:3]
    for name, error in report["grad_errors"].items():
        assert error <= max(report["fallback_grad_errors"][name], 2e-6), name


@pytest.mark.parametrize("model", MODELS)
def test_generation_prefills_with_the_chunked_op_and_decodes_with_the_recurrent_op(reports, model):
    report = reports[model]
    n, steps = report["linear_layers"], report["new_tokens"] - 1
    assert report["generate_ops"] == {"chunk_fwd": n, "recurrent_fwd": n * steps}
    assert report["tokens_equal"]
