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
import random
import subprocess
import sys

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
# ~u * sqrt(25) = 0.02, and a log-probability moves by up to twice the largest logit change times |z|
# (this checkpoint's logits reach 4-5): ~0.2 typically, more in the tail. Measured on the same tokens,
# transformers' own bf16 model differs from its float32 model by up to 0.41 (any position, any token of
# the vocabulary), and rounding only the weights to bf16 moves them by 0.06-0.07 (docs/vllm.md, "bf16
# log-probabilities"); the engine reached 0.35 on one token of 300 requests. So a token may differ by
# 0.5; what tells a defect from rounding is the run's RMS error, which must stay within 1.5x that of
# transformers' own bf16 model on the same tokens (measured: 0.85-1.0x). The float32 engines hold the
# exactness burden: 2e-3, and 1e-4 against the same request served alone.
BF16_TOL = 0.5
BF16_RMS_RATIO = 1.5

# A request against the same request served alone in the same engine. float32: measured < 2.2e-6 (the
# order of GEMM sums changes with the rows of a step). bf16: a prompt that shares its step with others
# may be prefilled in other pieces than alone (chunked prefill is on for bf16 engines on AMX CPUs), and
# vLLM's MLA prefill attends to the cached piece separately and merges the partial results, which
# rounds differently in bf16 from one causal attention (docs/vllm.md): measured 0.016-0.10, and a
# near-tie greedy token can flip, after which the two runs are different sequences. Every layer before
# the MLA attention, kda's included, is bitwise equal; so bf16 is held to its own tolerance up to the
# first token where the two runs part, and the float32 engines hold the 1e-4.
SOLO_TOL = {"float32": 1e-4, "bfloat16": BF16_TOL}

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


def _rms(xs):
    return (sum(x * x for x in xs) / len(xs)) ** 0.5


def _compare(checkpoint, run, dtype):
    """Every request's generated tokens against transformers' model on the same tokens, and against the
    same request served alone where the run has that (``solo``); prints the run's figures."""
    results = run["results"]
    bf16 = dtype == "bfloat16"
    reference = _run("reference", checkpoint, {"sequences": [r["ids"] for r in results], "bf16": bf16})
    engine_errors, bf16_errors, solo_errors, failures = [], [], [], []
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    for r, ref in zip(results, reference, strict=True):
        n = len(r["logprobs"])
        assert n, f"{r['name']} generated nothing"
        fp32, top = ref["logprobs"][-n:], ref["top"][-n:]
        errors = [abs(a - b) for a, b in zip(r["logprobs"], fp32, strict=True)]
        if max(errors) > tol:
            failures.append(f"{r['name']}: log-probability errors {errors} (tolerance {tol})")
        if dtype == "float32":
            # greedy: each token is the float32 model's most likely one, up to the engine's rounding
            gaps = [t - a for a, t in zip(fp32, top, strict=True)]
            if max(gaps) > 2 * FP32_TOL:
                failures.append(f"{r['name']}: not the greedy tokens (gaps {gaps})")
        engine_errors += errors
        if bf16:
            bf16_errors += [abs(a - b) for a, b in zip(ref["bf16_logprobs"][-n:], fp32, strict=True)]
        if "solo_logprobs" in r:
            served, alone = r["ids"][r["prompt_len"] :], r["solo_ids"][r["prompt_len"] :]
            same = next(
                (i for i, (a, b) in enumerate(zip(served, alone, strict=False)) if a != b), len(served)
            )
            if dtype == "float32" and (same < len(served) or len(alone) != len(served)):
                failures.append(f"{r['name']}: other tokens than served alone")
                continue
            # up to and including the first token where the runs part (bf16 near-ties)
            kept = min(same + 1, len(served), len(alone))
            diffs = [abs(a - b) for a, b in zip(r["logprobs"][:kept], r["solo_logprobs"][:kept], strict=True)]
            if max(diffs) > SOLO_TOL[dtype]:
                failures.append(f"{r['name']}: differs from its solo run by {diffs}")
            solo_errors += diffs
    figures = {
        "requests": len(results),
        "tokens": len(engine_errors),
        "engine_vs_fp32_max": max(engine_errors),
        "engine_vs_fp32_rms": _rms(engine_errors),
        "tf_bf16_vs_fp32_rms": _rms(bf16_errors) if bf16 else None,
        "batched_vs_solo_max": max(solo_errors, default=None),
    }
    print("figures", json.dumps(figures))
    if (
        dtype == "bfloat16"
        and figures["engine_vs_fp32_rms"] > BF16_RMS_RATIO * figures["tf_bf16_vs_fp32_rms"]
    ):
        failures.append(f"noisier than the model's own bf16 rounding: {figures}")
    assert not failures, "\n".join(failures)
    return figures


def _ids(n, seed):
    """n token ids of the tokenizer's words (4..127), seeded: prompts of exact lengths."""
    gen = random.Random(seed)
    return [gen.randrange(4, tiny_kimi.VOCAB) for _ in range(n)]


MAX_MODEL_LEN = 256
MAX_TOKENS = 8


def _phases(spec):
    """The batch shapes every engine of the matrix serves, one phase after the other."""
    repeat = ["the cat the cat the cat the cat", "one two three one two three one"]  # drafts get accepted
    return [
        {"name": "lone one-token prompt", "batch": [[tiny_kimi.WORDS.index("the") + 4]]},
        {"name": "many one-token prompts", "batch": [_ids(1, seed) for seed in range(6)]},
        # chunk boundaries of kda's chunked prefill (64) and, with max_num_batched_tokens = 128, a
        # prompt prefilled in two steps (a chunked-prefill continuation row)
        {"name": "63/64/65/129 tokens", "batch": [_ids(n, n) for n in (63, 64, 65, 129)]},
        {
            "name": "prefill and decode rows in one step",
            "batch": repeat if spec else PROMPTS[:2],
            "later": [_ids(4, 4), _ids(64, 64), [5]],  # the one-token request: a fresh speculative row
            "after": 2,
        },
        {"name": "one prompt at two batch rows", "batch": [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[2]]},
        # prompt + generated tokens = max-model-len, and a prompt one short of it (one token generated)
        {
            "name": "at max-model-len",
            "batch": [_ids(MAX_MODEL_LEN - MAX_TOKENS, 7), _ids(MAX_MODEL_LEN - 1, 8)],
        },
    ]


MATRIX = {
    # engine dtype, speculative decoding, the KDA state pool's dtype (mamba_ssm_cache_dtype)
    "float32-plain": ("float32", False, "float32"),
    "float32-ngram": ("float32", True, "float32"),
    "bfloat16-plain-bf16pool": ("bfloat16", False, "bfloat16"),
    "bfloat16-ngram": ("bfloat16", True, "float32"),
    "bfloat16-ngram-bf16pool": ("bfloat16", True, "bfloat16"),
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_serving_matrix(checkpoint, case):
    """Every batch shape of _phases through one engine, each request compared with transformers'
    float32 model: float32 engines within FP32_TOL, bf16 engines within BF16_TOL. A speculative engine
    first serves prompts to the end, so that later requests get recycled state slots (a one-token
    request then starts as a speculative row on a recycled slot and must start from zeros)."""
    dtype, spec, pool = MATRIX[case]
    llm = {"dtype": dtype, "mamba_ssm_cache_dtype": pool, "max_model_len": MAX_MODEL_LEN}
    llm["max_num_batched_tokens"] = 128
    phases = _phases(spec)
    argument = {"llm": llm, "phases": phases, "max_tokens": MAX_TOKENS}
    if spec:
        llm["speculative_config"] = SPEC
        argument["warm"] = ["one two one two one two one two", "a red fish saw two birds"]
    argument["solo"] = True
    run = _run("engine", checkpoint, argument)
    _compare(checkpoint, run, dtype)

    results = {r["name"]: r for r in run["results"]}
    at_limit = [r for name, r in results.items() if name.startswith(f"p{len(phases) - 1}.")]
    assert [len(r["ids"]) for r in at_limit] == [MAX_MODEL_LEN, MAX_MODEL_LEN]
    # a request's result must not depend on its batch row (a defect once drifted the first row by 0.07)
    first, third = results["p4.b0"], results["p4.b2"]
    assert first["ids"] == third["ids"]
    assert max(abs(a - b) for a, b in zip(first["logprobs"], third["logprobs"], strict=True)) <= 1e-3

    counts = run["counts"]
    # every KDA layer call ran on kda, each one kda call validated by the engine
    assert counts["prefill"] > 0 and counts["validations"] >= counts["prefill"] + counts["decode"]
    if spec:
        assert counts["spec"] > 0 and counts["fresh"] > 0
    else:
        assert counts["decode"] > 0 and counts["spec"] == 0
    # vLLM's C++ convolution serves bf16 on CPUs with AVX-512 BF16 (or Arm BF16), as for GDN
    native = torch.cpu._is_avx512_bf16_supported() or (
        platform.machine() == "aarch64" and torch.cpu.get_capabilities().get("bf16", False)
    )
    assert (counts["native_conv"] > 0) == (native and dtype == "bfloat16")


def test_refused_model_shapes(tmp_path):
    """A checkpoint whose KDA layers kda cannot run (head dim 512 > 256): the engine refuses the model
    while it builds it, with a message that names the layer and the limit; before, it started and
    then failed the first request (an HTTP 500 that took the server down)."""
    checkpoint = tiny_kimi.write_checkpoint(str(tmp_path / "kimi-head-512"), head_dim=512)
    code = f"import json, sys; sys.argv = ['', 'engine', {checkpoint!r}, json.dumps({{'batch': ['the']}})]\n"
    code += f"exec(open({os.path.join(HERE, 'engine_run.py')!r}).read())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "cannot run on kda" in proc.stderr and "<=256 for KDA, got 512" in proc.stderr, proc.stderr[-3000:]


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
    import kda.vllm

    written_for = f"written for vLLM {kda.vllm.VLLM_VERSION}"  # the [vllm] extra's pin
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if written_for in line]
    assert len(lines) == 1, proc.stderr[-3000:]
