"""Shared pytest set-up: the repository root on sys.path, the ``cuda`` marker skips without CUDA,
and the trainer imported once in the pytest process.

``tests.distributed.run_distributed`` forks its ranks, so a module imported here is already
loaded in every rank: importing ``train`` and torch.distributed.checkpoint (which megazero
imports only when a checkpoint is read or written) costs about 2 s of CPU per process, 7 s
per set of 4 ranks on a 2-core machine, when each rank does it itself."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megazero.checkpoint.shards  # noqa: E402,F401  (torch.distributed.checkpoint)
from megazero import training  # noqa: F401


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
