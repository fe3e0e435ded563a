"""Skips the tests marked cuda where there is no CUDA GPU or no CuPy (their reason says how to install it), seeds
torch's default generators before each test, so that no test depends on which tests ran before it, and keeps the
Hopper kernels' disk cache in a directory of the session's, not the user's."""

import importlib.util

import pytest
import torch


def _cuda_ready():
    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def pytest_collection_modifyitems(config, items):
    if _cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy (pip install -e '.[cuda]')")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seed_torch():
    """Each test starts from the same state of torch's default generators (a module's weights drawn unseeded are then
    the same whichever tests ran before)."""
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def hopper_cache(tmp_path_factory):
    """transducer.hopper's compiled kernels written to and loaded from a directory of this session's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRANSDUCER_HOPPER_CACHE", str(tmp_path_factory.mktemp("hopper-cache")))
        yield
