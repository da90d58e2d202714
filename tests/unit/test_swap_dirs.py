"""NVMe swap folders: owners recorded, stale folders swept, live ones kept, a full disk named.

A swap folder whose process was killed is removed by the next sweep (one line each), one whose
process runs (another job on the same disk) or that was made on another host is kept; a write
that fails with ENOSPC while the optimizer state or the ZeRO-3 shards are written ends in a
SwapError naming ``--offload-nvme-path``, and the folder is gone.
"""

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from megazero.offload.swap import SwapError
from megazero.process_groups import ProcessGroups
from tests.support.paths import REPO

MAKER = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from megazero.offload.swap_dirs import make_swap_dir
make_swap_dir(sys.argv[2], sys.argv[3])
open(os.path.join(sys.argv[2], sys.argv[3], "optimizer_state.swp"), "wb").write(b"x" * 8192)
print("made", flush=True)
if sys.argv[4] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()   # a live owner: runs until the test closes its stdin
"""


def _owner(root, name, die):
    """A process that makes swap folder ``name`` under ``root`` and is killed (``die``) or runs on."""
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKER, str(REPO), str(root), name, "die" if die else "live"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "made\n"
    if die:
        assert proc.wait(timeout=60) == -signal.SIGKILL
    return proc


def test_sweep_removes_the_folders_of_killed_processes_and_keeps_live_and_foreign_ones(tmp_path):
    from megazero.offload.swap_dirs import OWNER_FILE, read_owner, sweep_stale

    root = tmp_path / "swap"
    dead = [_owner(root, f"megazero-{'a' * 32}-rank{r}", die=True) for r in (0, 1)]
    live = _owner(root, f"megazero-{'b' * 32}-rank0", die=False)
    try:
        foreign = root / f"megazero-{'c' * 32}-rank0"  # made on another node sharing the disk
        foreign.mkdir()
        (foreign / OWNER_FILE).write_text(json.dumps(dict(host="another-node", boot="x", pid=1, start=1)))
        # a container on this machine with the same host name: the dead pid means nothing here
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        other_ns = dict(host=os.uname().nodename, boot=boot, pidns="pid:[1]", pid=dead[0].pid, start=1)
        container = root / f"megazero-{'d' * 32}-rank0"
        container.mkdir()
        (container / OWNER_FILE).write_text(json.dumps(other_ns))
        alien = root / "megazero-notes"  # no owner record: not a swap folder of ours
        alien.mkdir()
        lines = []
        removed = sweep_stale(str(root), log=lines.append)
        assert removed == [str(root / f"megazero-{'a' * 32}-rank{r}") for r in (0, 1)]
        assert lines == [
            f"[megazero] removed the stale NVMe swap folder {path} (its process, pid {p.pid} on "
            f"{os.uname().nodename}, is gone)"
            for path, p in zip(removed, dead)
        ]
        kept = [f"megazero-{'b' * 32}-rank0", foreign.name, container.name, alien.name]
        assert sorted(os.listdir(root)) == sorted(kept)
        assert read_owner(str(root / f"megazero-{'b' * 32}-rank0"))["pid"] == live.pid
        assert sweep_stale(str(root), log=lines.append) == []  # a second sweep finds nothing
    finally:
        live.stdin.close()
        live.wait(timeout=60)
    # its owner ended (without removing it): now it is stale too
    assert sweep_stale(str(root), log=lambda _: None) == [str(root / f"megazero-{'b' * 32}-rank0")]


def test_make_swap_dir_records_this_process_and_refuses_a_path_under_a_file(tmp_path):
    from megazero.offload.swap_dirs import make_swap_dir, read_owner, sweep_stale

    folder = make_swap_dir(str(tmp_path / "new" / "dir"), "megazero-x-rank3")
    owner = read_owner(folder)
    assert (owner["pid"], owner["host"]) == (os.getpid(), os.uname().nodename)
    assert sweep_stale(str(tmp_path / "new" / "dir"), log=print) == []  # this process runs
    (tmp_path / "f").write_text("")
    with pytest.raises(SwapError, match=r"^--offload-nvme-path .*/f/swap: cannot make the swap folder .*fix: "):
        make_swap_dir(str(tmp_path / "f" / "swap"), "megazero-y-rank0")


def _no_space(fd, buffers, offset):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["optimizer", "params"])
def test_a_full_disk_names_the_flag_and_leaves_no_folder(tmp_path, monkeypatch, where):
    """ENOSPC on the first write of the optimizer state (``--offload-optimizer nvme``) or of a
    ZeRO-3 parameter shard (``--offload-param nvme``): SwapError naming --offload-nvme-path and
    the fix, raised by the constructor, and the rank's swap folder is removed at once."""
    from megazero.data_parallel.ddp import DataParallel
    from megazero.data_parallel.zero3_gather import Zero3Options
    from megazero.offload.param_swap import ParamSwapOptions
    from megazero.optim.nvme import NvmeOffloadOptimizer
    from model.build import zero3_units
    from model.gpt import GPTStage
    from tests.support.zero import build, tiny_cfg

    groups, root = ProcessGroups.single(), tmp_path / "swap"
    monkeypatch.setattr(os, "pwritev", _no_space)
    msg = (
        rf"^--offload-nvme-path {root}: cannot write the swap file {root}/megazero-[0-9a-f]{{32}}-rank0"
        rf"{'-params/params' if where == 'params' else '/optimizer_state'}\.swp \(No space left on device\); "
        r"fix: free space there or point it at a disk with more room, then resume from the last checkpoint$"
    )
    with pytest.raises(SwapError, match=msg):
        if where == "optimizer":
            _, ddp, _ = build(tiny_cfg(), groups, 1, True)
            NvmeOffloadOptimizer(ddp, groups, nvme_path=str(root), lr=1e-3)
        else:
            cfg = tiny_cfg()
            model = GPTStage(cfg, groups, range(cfg.num_layers), True, True, 1)
            DataParallel(
                [model],
                groups,
                zero_stage=3,
                bucket_size=1000,
                overlap_comm=False,
                units=[zero3_units(model)],
                zero3=Zero3Options(param_swap=ParamSwapOptions(str(root), max_in_cpu=0)),
            )
    assert os.listdir(root) == []


def test_a_disk_that_fills_during_a_step_names_the_flag(tmp_path, monkeypatch):
    """ENOSPC on a write-back of the optimizer step (the state was written at start): the step
    raises SwapError naming --offload-nvme-path and the fix (main prints it as one line, exit 1);
    closing removes the folder."""
    from megazero.optim.nvme import NvmeOffloadOptimizer
    from tests.support.zero import build, make_batches, tiny_cfg, train

    groups, root, cfg = ProcessGroups.single(), tmp_path / "swap", tiny_cfg()
    model, ddp, _ = build(cfg, groups, 1, True)
    opt = NvmeOffloadOptimizer(ddp, groups, nvme_path=str(root), lr=1e-3, sub_group_size=500)
    batches = make_batches(cfg, 2)
    train(model, ddp, opt, groups, batches[:1], 1, steps=1)
    monkeypatch.setattr(os, "pwritev", _no_space)
    with pytest.raises(SwapError, match=rf"^--offload-nvme-path {root}: cannot write the swap file .*No space left"):
        train(model, ddp, opt, groups, batches[1:], 1, steps=1)
    opt.close()
    assert os.listdir(root) == []
