import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Nothing may be fetched from a hub: every Hugging Face piece in these tests is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def hub_folder(tmp_path_factory):
    """The installed package written as a kernels hub repository folder (python -m kda.hub)."""
    from kda import hub

    folder = tmp_path_factory.mktemp("kda_hub")
    hub.build(folder)
    return folder


@pytest.fixture(scope="session")
def model_reports(hub_folder):
    """A family's transformers models run on kda's hub layers ({model: report}): the family's check of
    harness.MODEL_CHECKS, in its own process (transformers must not see fla there), once a session."""
    from harness import MODEL_CHECKS

    reports = {}

    def of(family):
        if family.name not in reports:
            check, timeout, _ = MODEL_CHECKS[family.name]
            result = subprocess.run(
                [sys.executable, str(Path(__file__).with_name(check)), str(hub_folder)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            assert result.returncode == 0, result.stderr[-4000:]
            reports[family.name] = json.loads(result.stdout.strip().splitlines()[-1])
        return reports[family.name]

    return of


@pytest.fixture
def report(model_reports, family, model):
    """The report of one model of a family (parametrize with harness.family_models)."""
    return model_reports(family)[model]
