"""Kimi Linear served by vLLM's CPU build with kda's plugin, on a tiny random checkpoint.

Run with the vLLM environment's python (scripts/setup_vllm.sh makes it):
``.venv-vllm/bin/python -m pytest tests/vllm -q``. Each engine scenario runs in its own process
(engine_run.py): an engine start holds ~2 GB and vLLM's state is per process.

The tests compare teacher-forced log-probabilities, not token strings: the greedy tokens of a random
model are near-ties that any rounding can flip, while the log-probability vLLM reports for a token is
a smooth function of the model's arithmetic. The reference is transformers' Kimi Linear in float32.
"""

import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tiny_kimi  # noqa: E402

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
}

# float32 engine against the float32 reference: both compute the same model in float32 and differ only
# in the order of their sums (GEMM blocking, chunked vs token-by-token KDA); over ~10 layers of width
# <= 576 that moves a log-probability by ~1e-5 (measured: < 5e-5). 2e-3 leaves a wide margin and is
# still 30x below the smallest error a wrong state slot, a stale convolution state or a missed
# has_initial_state causes (0.07 and more: a request then sees another request's, or a previous
# step's, history).
FP32_TOL = 2e-3

# bfloat16 engine (vLLM's serving dtype) against the float32 reference: weights and activations are
# rounded to bf16 (unit roundoff u = 2^-8) at every GEMM input and output along a token's path
# (~25 roundings through 4 layers), independent errors that add in quadrature: a relative logit error
# ~u * sqrt(25) = 0.02. A log-probability moves by at most twice the largest logit change, and this
# checkpoint's logits reach |z| ~ 4-5: 2 * 0.02 * 5 = 0.2, so 0.25. Its attention-free part (the
# MLPs and the head alone) already differs by 0.03; the full model by up to 0.12.
BF16_TOL = 0.25

PROMPTS = [
    "the cat sat on the mat and then it ran to the park",
    "hello world is big",
    "a red fish saw two birds under the sea",
    "one two three four five six seven",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_kimi.write_checkpoint(str(tmp_path_factory.mktemp("kimi") / "tiny-kimi-linear"))


def _run(mode, checkpoint, argument, timeout=600):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "engine_run.py"), mode, checkpoint, json.dumps(argument)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def _compare(checkpoint, run, tol):
    """Every generated token's log-probability against the reference's; returns the largest error."""
    results = run["results"]
    reference = _run("reference", checkpoint, [r["ids"] for r in results])
    worst = 0.0
    for r, ref in zip(results, reference, strict=True):
        assert r["logprobs"], f"{r['name']} generated nothing"
        ref = ref["logprobs"][-len(r["logprobs"]) :]
        errors = [abs(a - b) for a, b in zip(r["logprobs"], ref, strict=True)]
        assert max(errors) <= tol, f"{r['name']}: log-probability errors {errors} (tolerance {tol})"
        worst = max(worst, *errors)
    return worst


def test_plain_and_mixed_batches_float32(checkpoint):
    """A plain batch (four prefills, then four decodes a step), then requests that prefill while the
    batch decodes (mixed steps: chunk_kda takes their prefill rows and the decode rows together)."""
    run = _run(
        "engine",
        checkpoint,
        {"llm": {"dtype": "float32"}, "batch": PROMPTS, "later": PROMPTS[:2], "after": 3, "max_tokens": 8},
    )
    _compare(checkpoint, run, FP32_TOL)
    counts = run["counts"]
    # every KDA layer ran on kda: 3 KDA layers per step, each one kda call validated by the engine
    assert counts["prefill"] > 0 and counts["decode"] > 0
    assert counts["validations"] >= counts["prefill"] + counts["decode"] > 0
    assert counts["native_conv"] == 0  # vLLM's C++ convolution takes bf16 only: the torch ops ran


def test_batch_position_and_bf16(checkpoint):
    """The serving dtype: within bf16 noise of the float32 reference; and one prompt placed first and
    third in a batch gets the same log-probabilities (a request's result must not depend on its row:
    the defect this guards against drifted the first request of a plain batch by 0.07-0.10)."""
    batch = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    run = _run("engine", checkpoint, {"batch": batch, "max_tokens": 8})
    _compare(checkpoint, run, BF16_TOL)
    first, third = run["results"][0], run["results"][2]
    assert first["ids"] == third["ids"]
    assert max(abs(a - b) for a, b in zip(first["logprobs"], third["logprobs"], strict=True)) <= 1e-3
    # on CPUs with AVX-512 BF16 (or Arm BF16) the short convolution ran on vLLM's C++ ops, as for GDN
    native = torch.cpu._is_avx512_bf16_supported() or (
        platform.machine() == "aarch64" and torch.cpu.get_capabilities().get("bf16", False)
    )
    assert (run["counts"]["native_conv"] > 0) == native


def test_speculative_decoding_float32(checkpoint):
    """n-gram drafts ([N, 1 + S] slot tables, num_accepted_tokens), prompts that repeat so that drafts
    get accepted, and a one-token request arriving while others decode: it comes as a speculative row
    on a recycled slot and must start from zeros."""
    run = _run(
        "engine",
        checkpoint,
        {
            "llm": {"dtype": "float32", "speculative_config": SPEC},
            "warm": ["one two one two one two one two", "a red fish saw two birds"],
            "batch": ["the cat the cat the cat the cat", "one two three one two three one"],
            "later": ["the"],
            "after": 2,
            "max_tokens": 10,
        },
    )
    _compare(checkpoint, run, FP32_TOL)
    counts = run["counts"]
    assert counts["spec"] > 0 and counts["prefill"] > 0
    assert counts["fresh"] > 0  # the one-token request was started from zeroed slots


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_completions(checkpoint, tmp_path):
    """`python -m vllm.entrypoints.openai.api_server` with the plugin: /v1/completions answers."""
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    env = {k: v for k, v in ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            checkpoint,
            "--served-model-name",
            "tiny-kimi",
            "--port",
            str(port),
            "--max-model-len",
            "256",
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "4",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "the server did not start in 300 s"
                time.sleep(1)
        body = json.dumps(
            {"model": "tiny-kimi", "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "logprobs": 1}
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
        choice = answer["choices"][0]
        assert answer["usage"]["completion_tokens"] == 5
        assert len(choice["logprobs"]["token_logprobs"]) == 5
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_other_vllm_version_patches_nothing():
    """On a vLLM release it was not written for, the plugin logs one line and patches nothing."""
    code = (
        "import vllm, kda.vllm\n"
        "vllm.__version__ = '0.31.0'\n"
        "kda.vllm.register()\n"
        "from vllm.model_executor.custom_op import op_registry_oot\n"
        "print('PATCHED' if 'KimiGatedDeltaNetAttention' in op_registry_oot else 'UNPATCHED')\n"
    )
    env = {**ENV, "VLLM_PLUGINS": ""}  # vLLM itself must not have loaded the plugin first
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UNPATCHED" in proc.stdout
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "written for vLLM 0.32.0" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
