"""kda's ggml backend (build/libggml-kda.so) in llama.cpp, where its users run it.

- ggml's own test-backend-ops: every GATED_DELTA_NET case (and the cache-copy fusion cases) with the
  kda backend against ggml's CPU backend, on every core and on one thread;
- real models: tiny random Qwen3-Next, Qwen3.5, Qwen3.5-MoE and Kimi Linear checkpoints converted by
  llama.cpp's convert_hf_to_gguf.py (make_models.py), run by llama.cpp with and without the backend
  (one sequence, and two side by side): the same greedy tokens, logits within float32 rounding, and
  both as close to transformers' float32 logits as each other;
- a GGUF with a head size kda refuses still runs, on ggml's CPU op, with the reason in the log;
- llama-server with the backend loaded answers completions (a one-token prompt included) with the
  tokens llama.cpp generates without it.

Needs scripts/setup_llama_cpp.sh (build/llama_cpp.env names the llama.cpp build); run by
scripts/test_llama_cpp.sh.
"""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build"
BACKEND = BUILD / "libggml-kda.so"
DRIVER = BUILD / "kda_llama_logits"
MODELS = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear"]
GENERATE = 8


def llama_paths():
    env_file = BUILD / "llama_cpp.env"
    if not env_file.exists() or not BACKEND.exists():
        pytest.fail("build/llama_cpp.env or build/libggml-kda.so is missing: run scripts/setup_llama_cpp.sh")
    return dict(line.split("=", 1) for line in env_file.read_text().split())


@pytest.fixture(scope="session")
def llama():
    paths = llama_paths()
    return Path(paths["KDA_LLAMA_CPP_SOURCE"]), Path(paths["KDA_LLAMA_CPP_BUILD"])


@pytest.fixture(scope="session")
def models(llama):
    """The GGUF files and transformers' references, made once per version of make_models.py."""
    source, _ = llama
    maker = Path(__file__).with_name("make_models.py")
    digest = hashlib.sha256(maker.read_bytes()).hexdigest()[:12]
    out = BUILD / "ggml_models" / digest
    names = MODELS + ["qwen3_5_wide_heads"]
    if not all((out / f"{n}.reference.npz").exists() for n in names):
        subprocess.run([sys.executable, str(maker), str(source), str(out), *names], check=True)
    return out


def with_backend(on, **extra):
    env = dict(os.environ, **extra)
    env.pop("GGML_BACKEND_PATH", None)
    if on:
        env["GGML_BACKEND_PATH"] = str(BACKEND)
    return env


def read_logits(path):
    raw = path.read_bytes()
    S, L, N, V = np.frombuffer(raw[:16], dtype=np.int32)
    at = 16
    prompt = np.frombuffer(raw, np.float32, S * L * V, at).reshape(S, L, V)
    at += 4 * S * L * V
    tokens = np.frombuffer(raw, np.int32, S * N, at).reshape(S, N)
    at += 4 * S * N
    steps = np.frombuffer(raw, np.float32, S * N * V, at).reshape(S, N, V)
    return prompt, tokens, steps


def run_llama(models, tmp_path, name, backend, sequences=1, threads=2, prompt_ids=None):
    reference = np.load(models / f"{name}.reference.npz")
    ids = reference["prompt"] if prompt_ids is None else prompt_ids
    out = tmp_path / f"{name}-{'kda' if backend else 'cpu'}-{sequences}-{threads}-{len(ids)}.bin"
    prompt = ",".join(str(int(t)) for t in ids)
    args = [
        str(DRIVER),
        str(models / f"{name}.gguf"),
        str(out),
        "--prompt",
        prompt,
        "--generate",
        str(GENERATE),
    ]
    args += ["--sequences", str(sequences), "--threads", str(threads)]
    done = subprocess.run(args, env=with_backend(backend), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_logits(out), done.stderr, reference


def rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


# ---- ggml's own tests ------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [None, "1"], ids=["every-core", "one-thread"])
def test_backend_ops_gated_delta_net(llama, threads):
    _, build = llama
    extra = {} if threads is None else {"KDA_NUM_THREADS": threads}
    done = subprocess.run(
        [str(build / "bin" / "test-backend-ops"), "test", "-b", "KDA", "-o", "GATED_DELTA_NET.*"],
        env=with_backend(True, **extra),
        capture_output=True,
        text=True,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "loaded KDA backend" in out
    passed = re.search(r"(\d+)/(\d+) tests passed", out)
    assert passed, out[-4000:]
    # 36 GATED_DELTA_NET cases (both gate widths, grouped heads, permuted inputs, K snapshots) and 5
    # with the copy into a recurrent cache, in this llama.cpp; none may be left unsupported.
    assert passed.group(1) == passed.group(2) and int(passed.group(2)) >= 41, out[-4000:]
    assert "not supported" not in out and "FAIL" not in out


# ---- real models -----------------------------------------------------------------------------


@pytest.mark.parametrize("sequences", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_model_same_tokens_and_logits(models, tmp_path, name, sequences):
    (cpu_prompt, cpu_tokens, cpu_steps), _, reference = run_llama(models, tmp_path, name, False, sequences)
    (kda_prompt, kda_tokens, kda_steps), log, _ = run_llama(models, tmp_path, name, True, sequences)
    assert "GATED_DELTA_NET runs on kda" in log, log[-3000:]
    assert "straight into the recurrent cache" in log, log[-3000:]  # llama.cpp's state copy, fused
    np.testing.assert_array_equal(kda_tokens, cpu_tokens)
    assert rel(kda_prompt, cpu_prompt) < 1e-5
    assert rel(kda_steps, cpu_steps) < 1e-5
    # Against transformers on the same checkpoint (sequence 0 has the reference's prompt): the backend
    # adds nothing to llama.cpp's own distance from it.
    cpu_hf, kda_hf = rel(cpu_prompt[0], reference["logits"]), rel(kda_prompt[0], reference["logits"])
    assert kda_hf <= cpu_hf * 1.01 + 1e-6, (kda_hf, cpu_hf)
    np.testing.assert_array_equal(kda_tokens[0], reference["tokens"])
    if name != "kimi_linear":
        # llama.cpp's Qwen graphs reproduce transformers' float32 logits; its Kimi Linear graph
        # differs from transformers' by about 3e-3 with or without kda (docs/llama_cpp.md).
        assert cpu_hf < 1e-3


def test_one_thread(models, tmp_path):
    (cpu_prompt, cpu_tokens, _), _, _ = run_llama(models, tmp_path, "qwen3_5", False, 1, threads=1)
    (kda_prompt, kda_tokens, _), _, _ = run_llama(models, tmp_path, "qwen3_5", True, 1, threads=1)
    np.testing.assert_array_equal(kda_tokens, cpu_tokens)
    assert rel(kda_prompt, cpu_prompt) < 1e-5


def test_declined_head_size_runs_on_ggml(models, tmp_path):
    (cpu_prompt, cpu_tokens, cpu_steps), _, _ = run_llama(models, tmp_path, "qwen3_5_wide_heads", False)
    (kda_prompt, kda_tokens, kda_steps), log, _ = run_llama(models, tmp_path, "qwen3_5_wide_heads", True)
    assert "head size 264: kda takes 1..256" in log, log[-3000:]
    assert "GATED_DELTA_NET runs on kda" not in log
    # Every node ran on ggml's CPU backend, as without the backend: the same floats.
    np.testing.assert_array_equal(kda_tokens, cpu_tokens)
    np.testing.assert_array_equal(kda_prompt, cpu_prompt)
    np.testing.assert_array_equal(kda_steps, cpu_steps)


def test_backend_that_cannot_run_kda_is_not_loaded(models, tmp_path):
    # A CPU target kda lacks stands for any reason kda cannot run: ggml is told the backend is not
    # supported here, logs why, and llama.cpp runs without it.
    done = subprocess.run(
        [
            str(DRIVER),
            str(models / "qwen3_5.gguf"),
            str(tmp_path / "x.bin"),
            "--prompt",
            "1,2,3",
            "--generate",
            "2",
        ],
        env=with_backend(True, KDA_CPU_TARGET="NOT_A_TARGET"),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kda cannot run here" in done.stderr and "not supported on this system" in done.stderr


# ---- llama-server ----------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body, timeout=120):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_llama_server_answers_with_the_backend(llama, models, tmp_path):
    _, build = llama
    name = "qwen3_5"
    (_, tokens, _), _, reference = run_llama(models, tmp_path, name, False)
    one_token = [int(reference["prompt"][0])]
    (_, one_token_tokens, _), _, _ = run_llama(models, tmp_path, name, False, prompt_ids=one_token)
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [str(build / "bin" / "llama-server"), "-m", str(models / f"{name}.gguf"), "--host", "127.0.0.1"]
        + [
            "--port",
            str(port),
            "-t",
            "2",
            "-c",
            "512",
            "-np",
            "2",
            "--no-webui",
            "-lv",
            "4",
        ],  # -lv 4: ggml's info lines
        env=with_backend(True),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "llama-server did not come up"
            time.sleep(0.5)
        greedy = dict(n_predict=GENERATE, temperature=0.0, top_k=1, return_tokens=True, cache_prompt=False)
        answer = post(port, "/completion", dict(greedy, prompt=[int(t) for t in reference["prompt"]]))
        assert answer["tokens"] == [int(t) for t in tokens[0]]
        one = post(port, "/completion", dict(greedy, prompt=one_token))
        assert one["tokens"] == [int(t) for t in one_token_tokens[0]]
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    server_log = (tmp_path / "server.log").read_text()
    assert "loaded KDA backend" in server_log and "GATED_DELTA_NET runs on kda" in server_log, server_log[
        -3000:
    ]
