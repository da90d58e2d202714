"""Shared pytest set-up: the repository root on sys.path, the ``cuda`` marker skips without CUDA."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
