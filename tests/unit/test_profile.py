"""--profile: a torch.profiler trace of the chosen steps, on the chosen ranks only, in the run
directory; bad windows and ranks are config errors naming the flag."""

import glob
import json
import os

import pytest

from tests.support.distributed import run_distributed
from tests.support.layouts import BASE

ARGS = [a if a != "10" else "4" for a in BASE]  # --train-iters 4


def _train(rank, world, argv):
    import torch

    from megazero import training
    from megazero.config import config_from_argv, layout_topology
    from megazero.process_groups import ProcessGroups

    cfg = config_from_argv(argv, world)
    data = training.prepare_run(cfg)
    groups = ProcessGroups.build(layout_topology(cfg))
    return training.train(cfg, groups, torch.device("cpu"), data)["iteration"]


def test_trace_written_for_chosen_ranks_only(tmp_path):
    run = str(tmp_path / "run")
    argv = ARGS + [
        "--dp",
        "2",
        "--run-dir",
        run,
        "--profile",
        "--profile-step-start",
        "2",
        "--profile-step-end",
        "4",
        "--profile-ranks",
        "1",
    ]
    assert run_distributed(_train, 2, argv, timeout_s=300) == [4, 4]
    traces = glob.glob(os.path.join(run, "profile", "*.pt.trace.json"))
    assert [os.path.basename(t).split(".")[0] for t in traces] == ["rank1"]
    events = json.load(open(traces[0]))["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(e.get("name") == "gloo:all_reduce" for e in events)  # the DP gradient all-reduce


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--profile-step-start", "5", "--profile-step-end", "5"], "--profile-step-end 5 must be above"),
        (["--profile-ranks", "2"], "--profile-ranks 2 is not a rank"),
    ],
)
def test_bad_profile_settings_name_the_flag(flags, message, capsys):
    from tests.support.config import fails

    assert message in fails(ARGS + ["--dp", "2", "--profile"] + flags, 2, capsys)
