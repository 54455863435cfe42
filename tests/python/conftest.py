import os

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
