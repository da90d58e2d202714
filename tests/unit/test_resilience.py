"""megazero.runtime.resilience without a launcher: signals become one agreed stop, bad values get a place.

The agreement and the NaN location run on real gloo ranks (tests/support/distributed.py) through
``training.Trainer``; the rest is pure.
"""

import json
import os
import signal

import pytest
import torch

from megazero.runtime import resilience as R
from tests.support.distributed import run_distributed


def test_a_signal_is_recorded_once_and_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGUSR1)
    s = R.StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
        assert s.pending == signal.SIGUSR1
        assert R.local_flags(s, None) == [0.0, 0.0, 1.0, 0.0]
    finally:
        s.restore()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_the_time_limit_counts_from_the_start():
    assert R.StopClock(None, 0.0).expired() is False
    assert R.StopClock(1.0, __import__("time").monotonic() - 61).expired() is True
    assert R.local_flags(None, R.StopClock(1.0, __import__("time").monotonic())) == [0.0] * 4


def test_exit_statuses_are_the_documented_ones():
    assert [R.stop_status(r) for r in ("SIGTERM", "SIGINT", "SIGUSR1", "time", "interval", "non-finite")] == [
        143,
        130,
        138,
        0,
        0,
        1,
    ]


def test_the_stop_record_is_written_whole(tmp_path):
    path = R.write_stop_record(str(tmp_path / "run"), reason="SIGTERM", iteration=7, checkpoint="/c/iter_0000007")
    assert json.loads(open(path).read()) == dict(
        reason="SIGTERM", iteration=7, checkpoint="/c/iter_0000007", status=143, message=""
    )
    assert os.listdir(tmp_path / "run") == ["stop.json"]


def test_the_origin_is_the_earliest_micro_batch_then_stage():
    later_stage = R.encode_place(R.Place(0, 1, 0, 0, 0))
    origin = R.encode_place(R.Place(0, 0, 0, 1, 0))
    other_micro = R.encode_place(R.Place(1, 0, 0, 0, 1))
    none = R.encode_place(None)
    assert R.locate_non_finite([none, later_stage, other_micro, origin]) == R.Place(0, 0, 0, 1, 0)
    assert R.locate_non_finite([none, none]) is None


def test_sample_indices_follow_the_sampler():
    from data.samplers import get_micro_batches

    class Numbered:  # sample i is [i, i, ..., i]
        def __len__(self):
            return 1000

        def __getitem__(self, i):
            return [i] * 5

    consumed, gbs, dp, mbs = 40, 16, 2, 2
    for dp_rank in range(dp):
        micro = get_micro_batches(Numbered(), consumed, gbs, mbs, dp_rank, dp)
        for m, (tokens, _) in enumerate(micro):
            assert list(R.sample_range(consumed, gbs, dp_rank, dp, m, mbs)) == tokens[:, 0].tolist()


def test_the_non_finite_line_names_everything():
    line = R.describe_non_finite(3, R.Place(2, 1, 0, 1, 0), range(52, 54), vp_size=1)
    assert line == (
        "non-finite loss/gradient at iteration 3: it first appeared in the forward pass of pipeline "
        "stage 1 (tensor-parallel rank 1, data-parallel rank 0, micro-batch 2), on training samples "
        "52-53"
    )
    assert "backward" in R.describe_non_finite(3, None, None, vp_size=1)


@pytest.mark.parametrize(
    "text,err",
    [("nan:3", "KIND:ITERATION:RANK"), ("boom:1:2", "KIND nan, kill, term, savekill, swaptrunc or paramtrunc")],
)
def test_a_bad_fault_spec_is_refused(text, err):
    with pytest.raises(ValueError, match=err):
        R.parse_fault(text)
    assert R.parse_fault("nan:3:5:1") == ("nan", 3, 5, 1) and R.parse_fault("kill:7:1") == ("kill", 7, 1, 0)


ARGV = [
    "--mock-data",
    "--vocab-size",
    "101",
    "--num-layers",
    "2",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "8",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--train-iters",
    "4",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
    "--make-vocab-size-divisible-by",
    "8",
    "--tp",
    "2",
    "--pp",
    "2",
]


def _steps(rank, world, stop_rank, fault):
    from megazero.config import config_from_argv
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training import build_trainer

    cfg = config_from_argv(ARGV, world)
    asked = [False]
    trainer = build_trainer(
        cfg,
        groups=ProcessGroups.build(Topology(tp=2, pp=2, dp=cfg.parallel.dp)),
        fault=fault,
        stop_flags=lambda: [0.0, 0.0, float(asked[0]), 0.0],
    )
    out = []
    for step in range(1, 4):
        asked[0] = rank == stop_rank and step == 2  # as if SIGUSR1 came to this rank during step 2
        step_out = trainer.train_step(trainer.next_batches())
        line = trainer.locate_bad_step() if step_out.bad_step else None
        out.append((step_out.values["loss"], step_out.stop_reason, step_out.bad_step, line))
    return out


def test_ranks_agree_on_a_stop_asked_of_one_and_the_loss_is_unchanged():
    """tp2 x pp2 x dp2: one rank asks during step 2; all 8 see it after step 2, none before or
    after, and every rank reports the same global loss."""
    runs = run_distributed(_steps, 8, 5, None, timeout_s=300)
    for steps in runs:
        assert [s[1] for s in steps] == [None, "SIGUSR1", None]
        assert [s[0] for s in steps] == [s[0] for s in runs[0]]
        assert not any(s[2] for s in steps)


def test_a_nan_in_one_micro_batch_is_located():
    """NaN injected into the forward output of global rank 1 (stage 0, tp rank 1, dp rank 0),
    micro-batch 2 of step 2: every rank sees a bad step 2 and names the same origin."""
    runs = run_distributed(_steps, 8, -1, ("nan", 2, 1, 2), timeout_s=300)
    for steps in runs:
        assert [s[2] for s in steps] == [False, True, False]
        assert steps[1][3] == (
            "non-finite loss/gradient at iteration 2: it first appeared in the forward pass "
            "of pipeline stage 0 (tensor-parallel rank 1, data-parallel rank 0, micro-batch "
            "2), on training samples 10-10"
        )


SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_04:30:01
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4321)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_04:30:01
  host      : box
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 4322) SIGKILL
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4322
============================================================
"""


def test_torchruns_summary_gives_each_failed_rank_its_code_or_signal():
    assert R.torchrun_failures(SUMMARY) == {3: "signal 9 (SIGKILL), exit code -9", 0: "exit code 1"}
    assert list(R.torchrun_failures(SUMMARY)) == [3, 0]  # the root cause first
    assert R.torchrun_failures("[megazero] training failed") == {}


def test_the_ring_buffer_is_bounded_and_named_in_the_report_and_the_launchers_line(tmp_path, monkeypatch):
    from megazero import collectives as C

    monkeypatch.setattr(C, "recent", type(C.recent)(maxlen=C.recent.maxlen))
    for _ in range(C.recent.maxlen + 5):
        C.record("recv", (2,), torch.zeros(2, 8, dtype=torch.bfloat16))
    C.record("all_reduce", (0, 2), torch.zeros(5))
    assert len(C.recent) == C.recent.maxlen
    seq = C.recent[-1][2]
    assert C.recent[-1] == ("all_reduce", (0, 2), seq, (5,), "float32") and C.recent[-2][2] == seq - 1
    assert C.describe(C.recent[-2]) == f"recv #{seq - 1} from rank 2, shape (2, 8) bfloat16"
    trail = R.Trail()
    trail.enter(7, "the loss / stop all-reduce")
    line = R.write_failure(str(tmp_path), 0, trail, RuntimeError("Connection closed by peer\nmore"))
    op = f"all_reduce #{seq} over ranks [0, 2], shape (5,) float32"
    assert (
        line == f"megazero: rank 0: a collective failed in the loss / stop all-reduce at iteration 7, "
        f"waiting in {op}: Connection closed by peer"
    )
    report = json.loads((tmp_path / "failures" / "rank_0.json").read_text())
    assert report["operation"] == op and len(report["ops"]) == C.recent.maxlen
    assert report["ops"][-1] == dict(op="all_reduce", ranks=[0, 2], seq=seq, shape=[5], dtype="float32")
    R.write_failure(str(tmp_path), 2, trail, RuntimeError("Connection closed by peer"))
    waited = (
        f"the others waited in {op} during the loss / stop all-reduce at iteration 7 (reports: {tmp_path}/failures)"
    )
    assert (
        R.name_culprits(str(tmp_path), 4)
        == f"[megazero] rank(s) 1, 3 failed first (no report: killed, stopped or hung); {waited}"
    )
    (tmp_path / "torchrun.log").write_text(SUMMARY)
    assert R.name_culprits(str(tmp_path), 4) == (
        "[megazero] rank 3 failed first (signal 9 (SIGKILL), exit code -9, from torchrun's report); rank(s) 1 "
        f"failed first (no report: killed, stopped or hung); {waited}"
    )


def test_agree_builds_its_vector_on_the_device_and_reads_each_raised_flag():
    """The loss share and the stop flags travel in one fp64 vector built without a copy from a
    Python list (torch.tensor(flags, device=cuda) blocks the host every step on CUDA): no
    torch.tensor call, the loss kept in fp64, each raised flag's reason returned (first slot wins)."""
    from types import SimpleNamespace
    from unittest import mock

    from megazero.runtime import resilience

    groups = SimpleNamespace(is_last_stage=True, tp_rank=0, world=None, dp_size=1)
    loss = torch.tensor(2.0**-30 + 1.0, dtype=torch.float64)
    with mock.patch.object(torch, "tensor", side_effect=AssertionError("torch.tensor in agree")):
        assert resilience.agree(loss, [0.0, 0.0, 0.0, 0.0], groups) == (2.0**-30 + 1.0, None)
        assert resilience.agree(loss, [0.0, 1.0, 0.0, 1.0], groups) == (2.0**-30 + 1.0, "SIGINT")
        assert resilience.agree(loss, [0.0, 0.0, 0.0, 1.0], groups)[1] == "time"
        other = SimpleNamespace(is_last_stage=False, tp_rank=0, world=None, dp_size=1)
        assert resilience.agree(loss, [1.0, 0.0, 0.0, 0.0], other) == (0.0, "SIGTERM")
