"""Shared pytest set-up: the ``cuda`` marker skips without CUDA, and the trainer imported once in
the pytest process.

The repository root is on ``sys.path`` through pytest's rootdir-based import of the ``tests``
package (tests/__init__.py and one per folder). ``tests.support.distributed.run_distributed``
forks its ranks, so a module imported here is already loaded in every rank: importing the
trainer and torch.distributed.checkpoint (which megazero imports only when a checkpoint is read
or written) costs about 2 s of CPU per process, 7 s per set of 4 ranks on a 2-core machine, when
each rank does it itself."""
import megazero.checkpoint.shards  # noqa: F401  (torch.distributed.checkpoint)
import megazero.training  # noqa: F401
import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
