import os

import pytest

from shardwire.state import STATE_ENV

# fixtures the tests of several folders share: worker_pool, two_workers; model_file and reference (recovery);
# browser and page (the web page's tests); taught_models (the chat tests)
pytest_plugins = ["runs", "recovery", "browser", "taught"]


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
