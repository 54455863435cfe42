"""transformers' Kimi Linear runs its KDA through kda, unchanged (see kimi_linear_check.py, run in its
own process because transformers must not see fla there)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("kernels")

CHECK = Path(__file__).with_name("kimi_linear_check.py")


@pytest.fixture(scope="module")
def report(hub_folder):
    result = subprocess.run(
        [sys.executable, str(CHECK), str(hub_folder)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_training_runs_on_kda_ops(report):
    # One chunked forward and backward per linear-attention layer: kda's ops, not the torch fallback.
    n = report["linear_layers"]
    assert report["train_ops"] == {"chunk_fwd": n, "chunk_bwd": n}


def test_logits_and_every_gradient_match_transformers_fallback(report):
    assert report["logits_error"] <= 1e-5
    assert not report["grads_missing"]
    worst = max(report["grad_errors"].values())
    assert worst <= 1e-4, sorted(report["grad_errors"].items(), key=lambda kv: -kv[1])[:3]


def test_generation_prefills_with_the_chunked_op_and_decodes_with_the_recurrent_op(report):
    n, steps = report["linear_layers"], report["new_tokens"] - 1
    assert report["generate_ops"] == {"chunk_fwd": n, "recurrent_fwd": n * steps}
    assert report["tokens_equal"]
