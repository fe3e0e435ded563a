"""Skips the tests marked cuda where there is no CUDA GPU or no CuPy (their reason says how to install it)."""

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
