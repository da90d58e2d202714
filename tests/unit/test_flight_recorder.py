"""NCCL's flight recorder read back (megazero/runtime/flight_recorder.py) on CPU.

The dumps are written by torch itself: gloo ranks record into the same C++ flight recorder
(``TORCH_NCCL_TRACE_BUFFER_SIZE``) and ``torch._C._distributed_c10d._dump_fr_trace()`` returns
the pickle that NCCL's watchdog writes to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`` on a timeout.
Rank 0 enqueues one all-reduce more than rank 1 before both dump, as a rank that is elsewhere
leaves its group's collective hanging. gloo leaves every entry ``scheduled``; the states NCCL's
watchdog would have set (completed, started) are then written into the same dumps.
"""

import os
import pickle
import re

import pytest
import torch

from megazero.runtime import flight_recorder as FR
from megazero.runtime import resilience as R
from tests.support.distributed import run_distributed


def test_enable_sets_what_the_user_did_not_and_makes_the_folder(tmp_path):
    environ = {"TORCH_FR_BUFFER_SIZE": "50"}  # the newer name of the buffer size: kept
    added = FR.enable(str(tmp_path), environ)
    prefix = os.path.join(str(tmp_path), "nccl_trace", "rank_")
    assert added == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_NCCL_ENABLE_TIMING": "1",
    }
    assert environ["TORCH_FR_BUFFER_SIZE"] == "50" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ
    assert (tmp_path / "nccl_trace").is_dir()
    assert FR.enable(str(tmp_path), environ) == {}  # idempotent
    assert FR.env(str(tmp_path))["TORCH_NCCL_TRACE_BUFFER_SIZE"] == str(FR.BUFFER_SIZE)


def _dump_with_one_rank_behind(rank, world):
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology

    groups = ProcessGroups.build(Topology(dp=2))
    dist.all_reduce(torch.ones(4), group=groups.dp)
    late = dist.all_reduce(torch.ones(3), group=groups.dp, async_op=True) if rank == 0 else None
    dump = c10d._dump_fr_trace()  # what the watchdog writes on a timeout, now
    if rank == 1:
        dist.all_reduce(torch.ones(3), group=groups.dp)  # the late collective, so the run ends
    else:
        late.wait()
    return dump


@pytest.fixture(scope="module")
def torch_dumps():
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        pytest.skip("this torch has no _dump_fr_trace (older than 2.8)")
    old = os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "64"  # read by the forked ranks' first group
    try:
        return run_distributed(_dump_with_one_rank_behind, 2)
    finally:
        os.environ.pop("TORCH_NCCL_TRACE_BUFFER_SIZE") if old is None else os.environ.update(
            TORCH_NCCL_TRACE_BUFFER_SIZE=old
        )


def _write(run_dir, dumps):
    folder = run_dir / FR.DUMP_DIR
    folder.mkdir(exist_ok=True)
    for rank, raw in enumerate(dumps):
        (folder / f"{FR.PREFIX}{rank}").write_bytes(raw if isinstance(raw, bytes) else pickle.dumps(raw))
    (folder / "rank_1.tmp").write_bytes(b"not a dump")  # ignored: not rank_<R>
    return folder


def test_a_torch_dump_names_the_rank_that_never_enqueued_the_collective(tmp_path, torch_dumps):
    folder = _write(tmp_path, torch_dumps)
    dumps = FR.read_dumps(str(folder))
    assert sorted(dumps) == [0, 1] and dumps[0]["version"].startswith("2.")
    entries = dumps[0]["entries"]
    assert [e["collective_seq_id"] for e in entries] == [1, 2] and entries[0]["process_group"][1] == "dp"
    assert entries[1]["input_sizes"] == [[3]] and entries[1]["profiling_name"].endswith("all_reduce")
    assert re.fullmatch(
        r"rank\(s\) 1 \(at #1\) never enqueued collective #2 of dp \(group \d+\)", FR.behind(dumps)[0]
    ), FR.behind(dumps)
    line = R.name_culprits(str(tmp_path), 2)  # no megazero report, no torchrun log: the dumps alone
    assert line.startswith(f"[megazero] NCCL flight recorder ({folder}): rank(s) 1 (at #1) never enqueued")


def test_nccl_states_give_each_ranks_last_completed_and_started_collective(tmp_path, torch_dumps):
    """The states NCCL's watchdog records: rank 0 completed #1 and started #2 (its peer never
    came), rank 1 completed #1; with megazero's own report of rank 1 the launcher prints both."""
    d0, d1 = (pickle.loads(raw) for raw in torch_dumps)
    d0["entries"][0]["state"], d0["entries"][1]["state"] = "completed", "started"
    d1["entries"][0]["state"] = "completed"
    _write(tmp_path, [d0, d1])
    dp = FR.entry_group(d0["entries"][0])
    trail = R.Trail()
    trail.enter(3, "the optimizer step")
    R.write_failure(str(tmp_path), 1, trail, RuntimeError("NCCL watchdog timeout"))
    first, second = R.name_culprits(str(tmp_path), 2).split("\n")
    assert first.startswith("[megazero] rank(s) 0 failed first (no report: killed, stopped or hung)")
    assert second.endswith(
        f"rank 0: last completed all_reduce #1 of {dp}, sizes [[4]] Float; started, not completed: "
        f"all_reduce #2 of {dp}, sizes [[3]] Float; rank 1: last completed all_reduce #1 of {dp}, sizes [[4]] Float"
    )
    assert R.name_culprits(str(tmp_path / "empty"), 2) is None
