"""Shared pytest set-up: the two lanes, the ``cuda`` marker, and the trainer imported once in the
pytest process.

Lanes: every test under tests/layouts/ (multi-rank equivalence sweeps) and tests/launcher/ (real
launches) is marked ``slow``, as is any test marked so by hand; the quick lane
(``bash scripts/test.sh --lane quick``) runs the rest. A test marked ``cuda`` is skipped without
CUDA. Under ``MEGAZERO_TEST_SHARD=I/N`` (scripts/test.sh's slow lane) this process keeps only the
test files of shard I (tests/support/shards.py); under ``MEGAZERO_TEST_TIMES=PATH`` it writes each
test file's seconds to PATH.

The repository root is on ``sys.path`` through pytest's rootdir-based import of the ``tests``
package (tests/__init__.py and one per folder). ``tests.support.distributed.run_distributed``
forks its ranks, so a module imported here is already loaded in every rank: importing the
trainer and torch.distributed.checkpoint (which megazero imports only when a checkpoint is read
or written) costs about 2 s of CPU per process, 7 s per set of 4 ranks on a 2-core machine, when
each rank does it itself."""

import os
from pathlib import Path

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


def pytest_configure(config):
    from tests.support.shards import TimesRecorder

    if os.environ.get("MEGAZERO_TEST_TIMES"):
        config.pluginmanager.register(TimesRecorder(os.environ["MEGAZERO_TEST_TIMES"]), "megazero_times")


def keep_shard(config, items):
    """Deselect the tests of the files that are not this shard's (``MEGAZERO_TEST_SHARD``)."""
    from tests.support.shards import SHARD_ENV, assign, parse_shard

    try:
        shard = parse_shard(os.environ.get(SHARD_ENV))
    except ValueError as e:
        pytest.exit(f"megazero: {e}", returncode=2)
    if shard is None:
        return
    index, count = shard
    # a file's name relative to the repository root, as in tests/support/slow_times.txt (absolute outside it)
    name = {item: Path(os.path.relpath(item.path, config.rootpath)).as_posix() for item in items}
    name = {item: n if not n.startswith("../") else item.path.as_posix() for item, n in name.items()}
    plan = assign({name[item] for item in items if "slow" in item.keywords}, count)
    kept = [item for item in items if plan.get(name[item], 0) == index - 1]
    config.hook.pytest_deselected(items=[item for item in items if plan.get(name[item], 0) != index - 1])
    items[:] = kept


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        if item.path.parent.name in SLOW_FOLDERS and item.path.parent.parent.name == "tests":
            item.add_marker(pytest.mark.slow)
    keep_shard(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
