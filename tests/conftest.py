import os
from pathlib import Path

import pytest

from shardwire.state import STATE_ENV

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARDWIRE_SHARED", REPO.parent / "shared"))


def shared_path(*parts: str) -> Path:
    """A file under ../shared, or a clean skip when this checkout has none."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (the shared folder beside the checkout)")
    return path


@pytest.fixture(autouse=True, scope="session")
def own_state_dir(tmp_path_factory):
    """Workers' certificates and coordinators' known hosts go to a folder of the test run's own,
    never the user's; every worker the tests start shares one certificate, as on one machine."""
    os.environ[STATE_ENV] = str(tmp_path_factory.mktemp("state"))


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tests run beside worker processes on few cores; spinning OpenMP threads would starve them."""
    import torch

    torch.set_num_threads(1)
