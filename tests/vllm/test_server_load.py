"""The OpenAI server under load (the short form of bench/bench_vllm_server.py), with kda's plugin.

Two servers, each started and stopped by its PID (server_load.Server), each loaded by 16 concurrent
clients with a fixed, seeded list of greedy /v1/completions requests (token-id prompts, half streamed,
a tenth of the streamed ones cancelled mid-stream by closing the socket, each followed at once by a
request from the same client), then checked against transformers' float32 model (server_load.check):

- bf16 (vLLM's serving dtype) with n-gram speculative decoding, prompts of 1 to 1000 tokens;
- float32 without speculation, with a KV pool of 13 blocks (one 1024-token request needs 11: 3 KDA
  state blocks and 8 MLA blocks of 128 tokens) so that vLLM preempts running requests and recomputes
  them, then the bad requests (each a 4xx, and the next good request served and correct), then
  cancellations on the idle server (each an abort: nothing left running, nothing finished).

Run with the vLLM environment: ``.venv-vllm/bin/python -m pytest tests/vllm/test_server_load.py -q``.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import server_load  # noqa: E402
import test_vllm_kimi  # noqa: E402
import tiny_kimi  # noqa: E402

SPEC = test_vllm_kimi.SPEC
CLIENTS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_kimi.write_checkpoint(str(tmp_path_factory.mktemp("kimi") / "tiny-kimi-linear"))


def _assert_report(rep, server, jobs):
    log = "\n".join(server.log_lines("ERROR", "Traceback", "Error"))[-4000:]
    assert not rep.failures, "\n".join(rep.failures[:20]) + f"\nserver log errors:\n{log}"
    cancels = sum(1 for job in jobs if job[0].cancel_after)
    assert rep.completed + rep.cancelled == rep.requests
    assert rep.cancelled >= cancels - 1  # (one may have ended at EOS before its cancellation)
    assert rep.after_cancel_checked == cancels  # each request sent right after a cancellation


def test_load_bf16_speculative(checkpoint, tmp_path):
    jobs = server_load.make_jobs(
        56, seed=1, max_prompt=1000, max_tokens=(4, 16), cancel_tokens=512, repeats=0.3
    )
    with server_load.Server(
        checkpoint, tmp_path / "server.log", dtype="bfloat16", max_model_len=2048, speculative=SPEC
    ) as server:
        load = server_load.run_load(server, jobs, clients=CLIENTS, time_limit=240, request_timeout=180)
        rep = server_load.check(
            checkpoint, server, load, server_load.BF16_TOL, greedy_tol=2 * server_load.BF16_TOL, solo=True
        )
    print(rep.row(), f"reference {rep.reference_seconds:.0f} s, solo rechecked {rep.solo_rechecked}")
    _assert_report(rep, server, jobs)
    # speculation ran ([N, 1 + S] slot tables) and drafts were accepted (num_accepted_tokens > 1)
    assert rep.spec_drafts > 0 and rep.spec_accepted > 0


def test_load_float32_preemption_and_bad_requests(checkpoint, tmp_path):
    # long decodes from prompts just short of a 128-token block edge: running requests keep needing
    # new MLA blocks while admissions keep the pool full, which is when vLLM preempts
    jobs = server_load.make_jobs(
        40, seed=2, max_prompt=512, max_tokens=(48, 128), cancel_tokens=256, block_edge=128
    )
    with server_load.Server(
        checkpoint,
        tmp_path / "server.log",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=4,
        num_blocks=13,
    ) as server:
        load = server_load.run_load(server, jobs, clients=CLIENTS, time_limit=240, request_timeout=180)
        rep = server_load.check(checkpoint, server, load, server_load.FP32_TOL)
        bad = server_load.check_bad_requests(checkpoint, server, server_load.FP32_TOL)
        not_aborted = server_load.check_cancellation(server)
        alive = server.alive()
    print(rep.row(), f"reference {rep.reference_seconds:.0f} s, solo rechecked {rep.solo_rechecked}")
    _assert_report(rep, server, jobs)
    assert rep.preemptions > 0, "no preemption: the KV pool is not small enough"
    assert not bad, "\n".join(bad)
    assert not not_aborted, "\n".join(not_aborted)
    assert alive


@pytest.mark.parametrize(
    "refused",
    [
        # KDA layers of head dim 512: kda's limit is 256; the plugin refuses them while vLLM builds them
        ("model", {"head_dim": 512}, None, "cannot run on kda"),
        # Kimi Linear has no MTP head: vLLM refuses the method while it reads the config
        ("speculative", {}, {"method": "mtp", "num_speculative_tokens": 1}, "Unsupported speculative method"),
    ],
    ids=lambda refused: refused[0],
)
def test_refused_at_start(tmp_path, refused):
    """What the server cannot serve is refused when it starts, with a message that says why, and the
    server exits; never a server that starts and then fails (or dies on) its first request."""
    _, linear_attn, speculative, message = refused
    checkpoint = tiny_kimi.write_checkpoint(str(tmp_path / "kimi"), **linear_attn)
    log = tmp_path / "server.log"
    server = server_load.Server(checkpoint, log, dtype="bfloat16", speculative=speculative)
    with pytest.raises(RuntimeError, match="the server exited") as error:
        with server:
            pass
    assert message in str(error.value) or message in log.read_text()
    assert server.proc.poll() is not None
