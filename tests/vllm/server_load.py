"""A load test against vLLM's real OpenAI server serving the tiny Kimi Linear checkpoint (kda's plugin).

Three parts, used by test_server_load.py (the short form, in CI) and bench/bench_vllm_server.py (the
full form):

- ``Server``: starts ``python -m vllm.entrypoints.openai.api_server`` on a free 127.0.0.1 port, waits
  for /health (bounded), and always stops it by the PID it started (terminate, then kill); its log is
  kept for failure messages.
- ``make_jobs`` and ``run_load``: a fixed, seeded list of /v1/completions requests (token-id prompts of
  1 to a few thousand tokens, greedy, half streamed), sent by concurrent client threads; about a tenth
  of the streamed ones are cancelled after a chunk or two by closing the socket, and the same client
  then sends a follow-up request at once (it may get the state slots the cancelled one freed).
- ``check``: the server alive throughout and idle at the end, nothing lost (every request completed or
  deliberately cancelled, the server's own counts bounded by the clients'), and every token a client
  received, cancelled requests' included, against transformers' float32 model (teacher-forced,
  engine_run.py's reference): each token's log-probability within the tolerance, and for a float32
  server each greedy token within FP32_TOL of the reference's largest log-probability at its
  position. Near-ties make token ids a poor comparison (test_vllm_kimi.py's docstring); a wrong state
  slot, a stale state after a cancellation or a bad recompute after a preemption moves
  log-probabilities by 0.07 and more.
- ``check_cancellation``: on the idle server after a load, a cancelled request is aborted, not
  finished, whether its socket closes after its first chunk or right after the headers.

The clients use the standard library only (the tolerances come from test_vllm_kimi.py, which
imports torch and pytest); nothing of vLLM is imported in the driving process.
"""

import http.client
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "tiny-kimi"
WORD_IDS = (4, 128)  # the tokenizer's words (tiny_kimi: ids 0-3 are <pad> <bos> <eos> <unk>)

sys.path.insert(0, HERE)
# The tolerances of test_vllm_kimi.py (derived there): float32 server vs the float32 reference, and the
# bf16 server vs the float32 reference; imported, not repeated, so that the two stay one.
from test_vllm_kimi import BF16_TOL, FP32_TOL  # noqa: E402, F401 (used by the callers)


def server_env(kv_space_gib=1):
    """test_vllm_kimi.ENV, less VLLM_ENABLE_V1_MULTIPROCESSING: the server runs its engine core in its
    own process, as in production."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The OpenAI api_server as a context manager: ``with Server(ckpt, log, dtype="float32") as s:``.

    ``num_blocks`` is ``--num-gpu-blocks-override``: the one knob that shrinks the KV pool below what
    VLLM_CPU_KVCACHE_SPACE gives (its unit is 1 GiB, ~200 requests of 4096 tokens for this checkpoint).
    A request holds one block per KDA layer (the mamba block size is max-model-len) and one per 128
    tokens of the MLA layer, so a pool of a few dozen blocks preempts under 16 clients.
    """

    def __init__(
        self,
        checkpoint,
        log_path,
        *,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=16,
        speculative=None,
        num_blocks=None,
        kv_space_gib=1,
        max_num_batched_tokens=None,
        extra_args=(),
        start_timeout=300,
    ):
        self.checkpoint, self.log_path, self.start_timeout = checkpoint, log_path, start_timeout
        self.port = free_port()
        self.args = [
            "--model", checkpoint, "--served-model-name", MODEL, "--host", "127.0.0.1",
            "--port", str(self.port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--enforce-eager", "--no-enable-prefix-caching",
            "--seed", "0",
        ]  # fmt: skip
        if speculative:
            self.args += ["--speculative-config", json.dumps(speculative)]
        if num_blocks:
            self.args += ["--num-gpu-blocks-override", str(num_blocks)]
        if max_num_batched_tokens:
            self.args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        self.args += list(extra_args)
        self.env = server_env(kv_space_gib)
        self.dtype, self.max_model_len = dtype, max_model_len
        self.proc = None
        self.start_seconds = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        t0 = time.time()
        with open(self.log_path, "w") as log:
            # its own session, so that the engine core and worker it forks are in the process group
            # whose id is this PID: stop() can then end them too if the server dies without them
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        try:
            deadline = t0 + self.start_timeout
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log_tail()}")
                if self.get("/health", timeout=2)[0] == 200:
                    break
                if time.time() > deadline:
                    raise RuntimeError(
                        f"the server did not start in {self.start_timeout} s:\n{self.log_tail()}"
                    )
                time.sleep(1)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.time() - t0

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        try:  # anything left of its process group (ours: the group id is the PID we started)
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars=6000):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def log_lines(self, *needles):
        with open(self.log_path, errors="replace") as f:
            return [line.rstrip() for line in f if any(n in line for n in needles)]

    def get(self, path, timeout=10):
        """(HTTP status, body); status None when the server did not answer."""
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                return resp.status, resp.read().decode(errors="replace")
            finally:
                conn.close()
        except (OSError, http.client.HTTPException) as e:
            return None, repr(e)

    def post(self, body, timeout=300):
        """POST /v1/completions with ``body`` (a dict, or bytes sent as they are): (status, parsed
        JSON or the raw text)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode(errors="replace")
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text
        finally:
            conn.close()

    def metrics(self):
        """/metrics parsed (a Metrics)."""
        status, text = self.get("/metrics", timeout=30)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {text[:500]}")
        return Metrics.parse(text)

    def wait_idle(self, timeout=60):
        """Waits until vLLM reports nothing running or waiting (cancelled requests are aborted
        asynchronously, and the gauges are refreshed per engine step); returns the last metrics."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0:
                return m
            if time.time() > deadline:
                return m
            time.sleep(0.5)


class Metrics:
    """Prometheus text samples: ``get(name, **labels)`` sums the samples of ``name`` whose labels
    include ``labels`` (0 when there are none)."""

    def __init__(self, samples=()):
        self.samples = list(samples)  # (name, {label: value}, float)

    @classmethod
    def parse(cls, text):
        samples = []
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            name, _, labels = head.partition("{")
            pairs = {}
            for item in labels.rstrip("}").split(","):  # vLLM's label values hold no commas
                key, _, val = item.partition("=")
                if key:
                    pairs[key.strip()] = val.strip().strip('"')
            try:
                samples.append((name, pairs, float(value)))
            except ValueError:
                continue
        return cls(samples)

    def get(self, name, **labels):
        return sum(
            v for n, ls, v in self.samples if n == name and all(ls.get(k) == x for k, x in labels.items())
        )

    def __bool__(self):
        return bool(self.samples)


# ----------------------------------------------------------------------------------------------------
# requests


@dataclass
class Request:
    index: int
    prompt: list
    max_tokens: int
    stream: bool
    cancel_after: int | None = None  # streamed chunks to read before closing the socket
    after_cancel: bool = False  # sent by its client right after that client's cancelled request
    ignore_eos: bool = False  # generate max_tokens tokens whatever the model emits


@dataclass
class Outcome:
    request: Request
    status: str = "not sent"  # completed / cancelled / error / not sent
    http_status: int | None = None
    error: str = ""
    prompt_ids: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    latency: float = 0.0
    first_chunk: float | None = None
    chunks: int = 0
    started: float = 0.0
    problems: list = field(default_factory=list)  # protocol inconsistencies, reported by check()


def _prompt_length(rng, max_prompt):
    # log-uniform: most requests short (decode-heavy steps, many slots turning over), some long
    # (chunked prefills next to decodes)
    return max(1, min(max_prompt, int(math.exp(rng.uniform(0, math.log(max_prompt + 1))))))


def make_jobs(
    n,
    seed=0,
    max_prompt=1000,
    max_tokens=(4, 16),
    cancel_fraction=0.1,
    cancel_tokens=256,
    block_edge=None,
    repeats=0.0,
):
    """``n`` requests in jobs (lists a client sends one after another): single requests, and pairs of
    a streamed request cancelled after one or two chunks and its follow-up (alternately a one-token
    prompt, which starts from zeroed state, and a short one). Every tenth single request has a
    one-token prompt. Cancelled requests ask for ``cancel_tokens`` tokens so that they are still
    running when the socket closes: the disconnect travels through a busy API server to the engine,
    and a request that finished first would prove nothing about the abort (``max_prompt`` plus
    ``cancel_tokens`` must stay within max-model-len).

    ``block_edge`` (the KV block size): prompts end 1 to 4 tokens short of a block edge, so that each
    request needs a new block within its first decode steps; with a pool the admitted prompts fill,
    that is what makes vLLM preempt (admission checks only that the prompt fits).

    ``repeats``: the fraction of prompts that repeat a pattern of 2 to 4 words, which n-gram
    speculation drafts from and the model may follow (random prompts give drafts that are rejected:
    the accepted path, num_accepted_tokens > 1, needs repetition)."""
    rng = random.Random(seed)

    def prompt(length):
        if block_edge and length > 1:
            length = max(1, min(max_prompt, -(-length // block_edge) * block_edge) - rng.randint(1, 4))
        if length > 4 and rng.random() < repeats:
            pattern = [rng.randrange(*WORD_IDS) for _ in range(rng.randint(2, 4))]
            return (pattern * length)[:length]
        return [rng.randrange(*WORD_IDS) for _ in range(length)]

    n_cancel = max(1, round(n * cancel_fraction)) if cancel_fraction > 0 else 0
    jobs, index = [], 0
    for c in range(n_cancel):
        cancelled = Request(
            index, prompt(_prompt_length(rng, max_prompt)), cancel_tokens, True, cancel_after=1 + c % 2
        )
        follow = Request(
            index + 1,
            prompt(1 if c % 2 == 0 else rng.randint(2, 32)),
            rng.randint(*max_tokens),
            stream=c % 4 < 2,
            after_cancel=True,
        )
        jobs.append([cancelled, follow])
        index += 2
    single = 0
    while index < n:
        length = 1 if single % 10 == 0 else _prompt_length(rng, max_prompt)
        jobs.append([Request(index, prompt(length), rng.randint(*max_tokens), stream=rng.random() < 0.5)])
        index += 1
        single += 1
    rng.shuffle(jobs)
    return jobs


def _body(req):
    return {
        "model": MODEL,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": req.stream,
        **({"ignore_eos": True} if req.ignore_eos else {}),
    }


def _take(out, choice):
    """Appends a choice's (or a streamed chunk's) tokens and log-probabilities to ``out``."""
    ids = choice.get("token_ids") or []
    lp = choice.get("logprobs") or {}
    lps = lp.get("token_logprobs") or []
    names = lp.get("tokens") or []
    if len(ids) != len(lps) or names != [f"token_id:{t}" for t in ids]:
        out.problems.append(f"token ids {ids} vs logprobs {lp}")
    out.token_ids += ids
    out.logprobs += lps
    if choice.get("prompt_token_ids"):
        out.prompt_ids = list(choice["prompt_token_ids"])
    if choice.get("finish_reason") is not None:
        out.finish_reason = choice["finish_reason"]


def send(port, req, timeout=300):
    """Sends one request; returns its Outcome. A cancellation closes the socket mid-stream, which is
    what a client that goes away does (vLLM sees the disconnect and aborts the request)."""
    out = Outcome(req, started=time.time())
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(_body(req)), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.http_status = resp.status
        if resp.status != 200:
            out.status, out.error = "error", resp.read().decode(errors="replace")[:2000]
            return out
        if not req.stream:
            data = json.loads(resp.read())
            _take(out, data["choices"][0])
            if data["usage"]["completion_tokens"] != len(out.token_ids):
                out.problems.append(f"usage {data['usage']} but {len(out.token_ids)} tokens")
            out.status = "completed"
            return out
        done = False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: ") :]
            if payload == b"[DONE]":
                done = True
                break
            data = json.loads(payload)
            if "error" in data:  # an error raised after the 200 comes in the stream
                out.status, out.error = "error", json.dumps(data)[:2000]
                return out
            for choice in data.get("choices", []):
                _take(out, choice)
            out.chunks += 1
            if out.first_chunk is None:
                out.first_chunk = time.perf_counter() - t0
            if req.cancel_after and out.chunks >= req.cancel_after and out.finish_reason is None:
                conn.sock.shutdown(socket.SHUT_RDWR)
                out.status = "cancelled"
                return out
        if done and out.finish_reason is not None:
            out.status = "completed"
        else:
            out.status, out.error = "error", f"stream ended without [DONE] or finish_reason ({done})"
        return out
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        out.status, out.error = "error", f"{type(e).__name__}: {e}"
        return out
    finally:
        out.latency = time.perf_counter() - t0
        conn.close()


@dataclass
class LoadResult:
    outcomes: list
    wall: float
    metrics_before: "Metrics"
    metrics_after: "Metrics"
    health_failures: list
    server_alive: bool
    health_after: tuple

    def delta(self, name, **labels):
        return self.metrics_after.get(name, **labels) - self.metrics_before.get(name, **labels)


def run_load(server, jobs, clients=16, time_limit=600, request_timeout=300, health_every=1.0):
    """Sends ``jobs`` from ``clients`` threads (each takes the next job and sends its requests in
    order). No job starts after ``time_limit`` seconds; its requests stay "not sent", which check()
    reports. A monitor polls the process and /health during the load."""
    before = server.metrics()
    outcomes = {}
    lock = threading.Lock()
    pending = list(jobs)
    t0 = time.time()
    health_failures = []
    stop = threading.Event()

    def client():
        while True:
            with lock:
                if not pending or time.time() - t0 > time_limit:
                    return
                job = pending.pop(0)
            for req in job:
                out = send(server.port, req, request_timeout)
                with lock:
                    outcomes[req.index] = out

    def monitor():
        while not stop.wait(health_every):
            if not server.alive():
                health_failures.append((time.time() - t0, "process exited"))
                return
            status, text = server.get("/health", timeout=30)
            if status != 200:
                health_failures.append((time.time() - t0, f"/health: {status} {text[:200]}"))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    watch = threading.Thread(target=monitor, daemon=True)
    watch.start()
    for t in threads:
        t.start()
    # a bound on the whole load: jobs start until time_limit, and a request started then has its
    # socket timeout (per read) to finish
    deadline = t0 + time_limit + 2 * request_timeout
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    wall = time.time() - t0
    stop.set()
    watch.join(60)
    alive = server.alive()
    health = server.get("/health", timeout=30)
    after = server.wait_idle() if alive else Metrics()
    all_requests = [req for job in jobs for req in job]
    result = [outcomes.get(req.index, Outcome(req)) for req in all_requests]
    return LoadResult(result, wall, before, after, health_failures, alive, health)


# ----------------------------------------------------------------------------------------------------
# the float32 reference and the checks


def reference(checkpoint, sequences, timeout=1800):
    """engine_run.reference (transformers' float32 model) on ``sequences``, in its own process (vLLM's
    config classes must not be registered with transformers there). The sequences go through a file:
    engine_run.py's command line takes them in one argument, which Linux caps at 128 KiB."""
    unique = sorted({tuple(s) for s in sequences}, key=len)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump([list(s) for s in unique], f)
        code = (
            "import json, sys\n"
            f"sys.path.insert(0, {HERE!r})\n"
            "import engine_run\n"
            "result = engine_run.reference(sys.argv[1], json.load(open(sys.argv[2])))\n"
            "json.dump(result, open(sys.argv[3], 'w'))\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, checkpoint, src, dst],
            capture_output=True,
            text=True,
            env={**server_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the reference failed:\n{proc.stderr[-4000:]}")
        with open(dst) as f:
            found = dict(zip(unique, json.load(f), strict=True))
    return [found[tuple(s)] for s in sequences]


@dataclass
class Report:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    not_sent: int = 0
    after_cancel_checked: int = 0
    tokens_checked: int = 0
    generated_tokens: int = 0
    worst_logprob_error: float = 0.0
    worst_greedy_gap: float = 0.0  # reference's top log-probability minus that of the token chosen
    tokens_per_s: float = 0.0
    p50: float = 0.0
    p99: float = 0.0
    preemptions: float = 0.0
    aborted_by_server: float = 0.0  # vLLM 0.32 counts none (kept to show it)
    reference_seconds: float = 0.0
    spec_drafts: float = 0.0
    spec_accepted: float = 0.0
    cancelled_but_finished: int = 0  # cancelled by the client, but finished by the server first
    finished_by_server: float = 0.0
    failures: list = field(default_factory=list)
    # (request, worst error vs the reference, worst difference from its solo run): requests outside
    # the reference bounds that are outside them when served alone too (check's ``solo``)
    solo_rechecked: list = field(default_factory=list)

    def row(self):
        return {
            "requests": self.requests,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "errors": self.errors + self.not_sent,
            "tokens/s": round(self.tokens_per_s, 1),
            "p50 s": round(self.p50, 2),
            "p99 s": round(self.p99, 2),
            "preemptions": int(self.preemptions),
            "drafts": int(self.spec_drafts),
            "accepted": int(self.spec_accepted),
            "worst |dlogp|": f"{self.worst_logprob_error:.2e}",
            "worst greedy gap": f"{self.worst_greedy_gap:.2e}",
            "solo rechecked": len(self.solo_rechecked),
            "failures": len(self.failures),
        }


def _percentile(values, q):
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def check(checkpoint, server, load, tol, greedy_tol=None, solo=False):
    """All checks on one load; returns a Report whose ``failures`` lists every violation (empty: all
    passed). ``tol`` bounds each token's log-probability error against the reference; ``greedy_tol``
    bounds how far below the reference's top log-probability a greedy token may be (FP32_TOL for a
    float32 server; 2 * BF16_TOL for bf16, where each of the two log-probabilities may be off by
    BF16_TOL and near-ties flip).

    ``solo`` (for a bf16 server): a request outside those bounds is served again alone on the idle
    server; it passes when its solo run is outside them too (the excess is then bf16 rounding of that
    prompt, not the load) and the load run has the solo run's tokens, each log-probability within
    ``tol`` of the solo run's (two bf16 computations of the same request). These are listed in
    ``Report.solo_rechecked``. A float32 server gets no such leeway."""
    rep = Report(requests=len(load.outcomes))
    fail = rep.failures.append
    greedy_tol = tol if greedy_tol is None else greedy_tol

    # the server alive throughout and at the end, and idle
    if not load.server_alive:
        fail("the server process exited")
    if load.health_failures:
        fail(f"/health failed during the load: {load.health_failures[:5]}")
    if load.health_after[0] != 200:
        fail(f"/health after the load: {load.health_after}")
    running = load.metrics_after.get("vllm:num_requests_running")
    waiting = load.metrics_after.get("vllm:num_requests_waiting")
    if running != 0 or waiting != 0:
        fail(f"after the load the server still has {running} running and {waiting} waiting requests")

    # nothing lost: every request completed or deliberately cancelled, whole
    for out in load.outcomes:
        req = out.request
        if out.status == "completed":
            rep.completed += 1
        elif out.status == "cancelled":
            rep.cancelled += 1
        elif out.status == "error":
            rep.errors += 1
            fail(f"request {req.index} ({len(req.prompt)} tokens, stream={req.stream}): HTTP "
                 f"{out.http_status} {out.error[:500]}")  # fmt: skip
        else:
            rep.not_sent += 1
        if out.status == "cancelled" and not req.cancel_after:
            fail(f"request {req.index} counted as cancelled but was not cancelled")
        if out.status == "completed" and req.cancel_after:
            # finished (EOS) before its cancellation: not lost, but no cancellation happened
            pass
        if out.problems:
            fail(f"request {req.index}: {out.problems[:3]}")
        if out.status == "completed":
            if out.prompt_ids != req.prompt:
                fail(f"request {req.index}: prompt_token_ids {out.prompt_ids[:10]}... differ from the prompt")
            expected = req.max_tokens if out.finish_reason == "length" else None
            if expected is not None and len(out.token_ids) != expected:
                fail(f"request {req.index}: {len(out.token_ids)} tokens for max_tokens {req.max_tokens}")
            if out.finish_reason not in ("length", "stop"):
                fail(f"request {req.index}: finish_reason {out.finish_reason}")
    if rep.not_sent:
        fail(f"{rep.not_sent} requests not sent within the time limit")

    # the server's own accounting agrees with the clients': each completed request finished once,
    # each cancelled one was aborted (the counters are cumulative: the load's difference)
    success = "vllm:request_success_total"
    rep.finished_by_server = load.delta(success, finished_reason="length") + load.delta(
        success, finished_reason="stop"
    )
    rep.aborted_by_server = load.delta(success, finished_reason="abort")
    server_errors = load.delta(success, finished_reason="error")
    if server_errors:
        fail(f"the server counted {server_errors} requests finished with an error")
    # vLLM 0.32 does not count aborted requests there; a cancelled request asks for more tokens than
    # it reads before closing, so one the server did not abort shows as finished ("length"). Under
    # load that is a race, not a defect: the engine keeps generating while the API server's event loop
    # (one thread among the engine's) waits for a core, and with the cores contended the disconnect
    # can arrive after all the tokens were generated (2026-12-07, Zen 5, two busy processes beside
    # the fp32 load: 3 of 4 cancelled requests finished in 2 of 4 runs; alone, 0 of 4 in 9 runs). So
    # the load only bounds the count (no request finished that no client sent); check_cancellation
    # tests the abort itself on an idle server, where it has no race to lose.
    rep.cancelled_but_finished = int(rep.finished_by_server - rep.completed)
    if load.metrics_after and not 0 <= rep.cancelled_but_finished <= rep.cancelled:
        fail(
            f"the server finished {rep.finished_by_server:g} requests; the clients completed "
            f"{rep.completed} and cancelled {rep.cancelled}"
        )
    rep.preemptions = load.delta("vllm:num_preemptions_total")
    rep.spec_drafts = load.delta("vllm:spec_decode_num_drafts_total")
    rep.spec_accepted = load.delta("vllm:spec_decode_num_accepted_tokens_total")

    # throughput and latency of the completed requests
    done = [o for o in load.outcomes if o.status == "completed"]
    rep.generated_tokens = sum(len(o.token_ids) for o in load.outcomes)
    rep.tokens_per_s = rep.generated_tokens / load.wall if load.wall else 0.0
    rep.p50 = _percentile([o.latency for o in done], 0.50)
    rep.p99 = _percentile([o.latency for o in done], 0.99)

    # every token received, cancelled requests' included, against the float32 reference
    checked = [o for o in load.outcomes if o.status in ("completed", "cancelled") and o.token_ids]
    t0 = time.time()
    refs = reference(checkpoint, [o.request.prompt + o.token_ids for o in checked])
    rep.reference_seconds = time.time() - t0
    for out, ref in zip(checked, refs, strict=True):
        n = len(out.token_ids)
        ref_lp, ref_top = ref["logprobs"][-n:], ref["top"][-n:]
        errors = [abs(a - b) for a, b in zip(out.logprobs, ref_lp, strict=True)]
        gaps = [t - b for t, b in zip(ref_top, ref_lp, strict=True)]
        rep.tokens_checked += n
        rep.worst_logprob_error = max(rep.worst_logprob_error, *errors)
        rep.worst_greedy_gap = max(rep.worst_greedy_gap, *gaps)
        if out.request.after_cancel:
            rep.after_cancel_checked += 1
        tag = f"request {out.request.index} ({len(out.request.prompt)}-token prompt, {out.status}"
        tag += ", right after a cancellation)" if out.request.after_cancel else ")"
        if max(errors) <= tol and max(gaps) <= greedy_tol:
            continue
        why = f"{tag}: log-probability errors {[round(e, 4) for e in errors]} (tolerance {tol}), "
        why += f"greedy gaps {[round(g, 4) for g in gaps]} (tolerance {greedy_tol})"
        if not solo:
            fail(why)
            continue
        alone = send(server.port, Request(out.request.index, out.request.prompt, n, stream=False))
        if alone.status != "completed" or alone.token_ids != out.token_ids:
            fail(f"{why}; served alone: {alone.status} {alone.error[:300]} tokens {alone.token_ids}")
            continue
        solo_errors = [abs(a - b) for a, b in zip(alone.logprobs, ref_lp, strict=True)]
        solo_gaps = [t - b for t, b in zip(ref_top, ref_lp, strict=True)]  # same tokens, same gaps
        vs_solo = [abs(a - b) for a, b in zip(out.logprobs, alone.logprobs, strict=True)]
        if max(solo_errors) <= tol and max(solo_gaps) <= greedy_tol:
            fail(f"{why}; served alone it is within them (errors {[round(e, 4) for e in solo_errors]})")
        elif max(vs_solo) > tol:
            fail(f"{why}; against its solo run: {[round(e, 4) for e in vs_solo]}")
        else:
            rep.solo_rechecked.append((out.request.index, round(max(errors), 4), round(max(vs_solo), 4)))
    return rep


def bad_requests(max_model_len):
    """Requests the server must refuse with a 4xx and a message: (name, body)."""
    return [
        ("empty string prompt", {"model": MODEL, "prompt": "", "max_tokens": 4}),
        ("empty token list", {"model": MODEL, "prompt": [], "max_tokens": 4}),
        ("empty streamed prompt", {"model": MODEL, "prompt": "", "max_tokens": 4, "stream": True}),
        ("prompt past max-model-len", {"model": MODEL, "prompt": [5] * (max_model_len + 1), "max_tokens": 4}),
        ("token id past the vocabulary", {"model": MODEL, "prompt": [5, 128], "max_tokens": 4}),
        ("negative token id", {"model": MODEL, "prompt": [5, -1], "max_tokens": 4}),
        ("max_tokens 0", {"model": MODEL, "prompt": [5, 6], "max_tokens": 0}),
        ("too many logprobs", {"model": MODEL, "prompt": [5, 6], "max_tokens": 4, "logprobs": 1000}),
        ("unknown model", {"model": "nope", "prompt": [5, 6], "max_tokens": 4}),
        ("malformed JSON", b'{"model": "tiny-kimi", "prompt": [5, 6'),
    ]


def check_bad_requests(checkpoint, server, tol):
    """Each bad request gets a 4xx with an error message, and the next good request is served and
    matches the reference. Returns a list of failures (empty: all passed)."""
    failures = []
    good = [[7, 8, 9, 10, 11], [12], [13, 14, 15]]
    served = []
    for i, (name, body) in enumerate(bad_requests(server.max_model_len)):
        status, answer = server.post(body, timeout=120)
        message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
        if not (status and 400 <= status < 500 and message):
            failures.append(f"{name}: HTTP {status} {str(answer)[:500]} (wanted a 4xx with a message)")
        if not server.alive():
            failures.append(f"{name}: the server exited:\n{server.log_tail()}")
            return failures
        req = Request(10_000 + i, good[i % len(good)], 6, stream=i % 2 == 1)
        out = send(server.port, req, timeout=120)
        if out.status != "completed":
            failures.append(f"the good request after '{name}': {out.status} {out.http_status} {out.error}")
        else:
            served.append(out)
    refs = reference(checkpoint, [o.request.prompt + o.token_ids for o in served])
    for out, ref in zip(served, refs, strict=True):
        errors = [
            abs(a - b) for a, b in zip(out.logprobs, ref["logprobs"][-len(out.token_ids) :], strict=True)
        ]
        if max(errors) > tol:
            failures.append(f"good request {out.request.prompt}: log-probability errors {errors}")
    return failures


def check_cancellation(server, prompt_lengths=(1, 600), at_headers=(False, True)):
    """On an idle server, each cancellation is an abort: a streamed request for every token the
    context has room for, its socket closed after the first chunk (or, ``at_headers``, right after
    the response headers, while the prompt may still be computed), must leave the server with
    nothing running or waiting and its finished count unchanged (vLLM 0.32 counts no abort there).
    Alone on 2 Zen 5 cores the engine had generated 0 to 5 of the ~1000 tokens when the abort came;
    with two busy processes beside the server, the first cancellation after a load waited 3 s for
    the API server's event loop and ran to 514 tokens (the tiny model makes ~500 a second), or to
    the end. Returns a list of failures (empty: all passed)."""
    failures = []
    generated = "vllm:generation_tokens_total"
    finished = "vllm:request_success_total"
    for n, length in enumerate(prompt_lengths):
        prompt = [WORD_IDS[0] + i % (WORD_IDS[1] - WORD_IDS[0]) for i in range(length)]
        for early in at_headers:
            label = f"a {len(prompt)}-token prompt cancelled " + (
                "right after the response headers" if early else "after one chunk"
            )
            asked = server.max_model_len - len(prompt)
            before = server.wait_idle()
            req = Request(20_000 + 2 * n + early, prompt, asked, stream=True, cancel_after=1, ignore_eos=True)
            if early:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
                try:
                    conn.request(
                        "POST",
                        "/v1/completions",
                        json.dumps(_body(req)),
                        {"Content-Type": "application/json"},
                    )
                    resp = conn.getresponse()
                    if resp.status != 200:
                        failures.append(f"{label}: HTTP {resp.status}")
                        continue
                    conn.sock.shutdown(socket.SHUT_RDWR)
                finally:
                    conn.close()
            else:
                out = send(server.port, req, timeout=120)
                if out.status != "cancelled":
                    failures.append(f"{label}: {out.status} {out.http_status} {out.error}")
                    continue
            after = server.wait_idle()
            running = after.get("vllm:num_requests_running") + after.get("vllm:num_requests_waiting")
            more_finished = sum(
                after.get(finished, finished_reason=r) - before.get(finished, finished_reason=r)
                for r in ("length", "stop")
            )
            tokens = after.get(generated) - before.get(generated)
            if running:
                failures.append(f"{label}: {running:g} requests still running or waiting")
            if more_finished:
                failures.append(
                    f"{label}: the server finished it ({tokens:g} of {asked} tokens) instead of aborting it"
                )
            if not server.alive():
                failures.append(f"{label}: the server exited:\n{server.log_tail()}")
                return failures
    return failures


def print_table(rows, file=sys.stdout):
    """rows: [(configuration name, Report.row() dict)]."""
    if not rows:
        return
    headers = ["configuration", *rows[0][1].keys()]
    cells = [[name, *(str(v) for v in row.values())] for name, row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)), file=file)
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)), file=file)
