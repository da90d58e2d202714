"""Shared pytest set-up: the two lanes, the ``cuda`` marker, and the trainer imported once in the
pytest process.

Lanes: every test under tests/layouts/ (multi-rank equivalence sweeps) and tests/launcher/ (real
launches) is marked ``slow``, as is any test marked so by hand; the quick lane
(``bash scripts/test.sh --lane quick``) runs the rest. A test marked ``cuda`` is skipped without
CUDA.

The repository root is on ``sys.path`` through pytest's rootdir-based import of the ``tests``
package (tests/__init__.py and one per folder). ``tests.support.distributed.run_distributed``
forks its ranks, so a module imported here is already loaded in every rank: importing the
trainer and torch.distributed.checkpoint (which megazero imports only when a checkpoint is read
or written) costs about 2 s of CPU per process, 7 s per set of 4 ranks on a 2-core machine, when
each rank does it itself."""

import pytest

import megazero.checkpoint.shards  # torch.distributed.checkpoint, inherited by forked ranks
import megazero.training  # noqa: F401

# the fixtures that tests in several modules share (a test module imports no other test module)
pytest_plugins = [
    "tests.support.generate",
    "tests.support.hf_convert",
    "tests.support.hf_families",
    "tests.support.layouts",
]


SLOW_FOLDERS = ("layouts", "launcher")


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        if item.path.parent.name in SLOW_FOLDERS and item.path.parent.parent.name == "tests":
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
