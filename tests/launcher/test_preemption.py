"""Preemption, bad values and restarts end to end: scripts/pretrain_gpt.sh -> torchrun -> train.py.

Real launches (gloo ranks on CPU, a tiny GPT on mock data, fp32, dropout on): a stop requested by
a signal saves at one step boundary on every rank and the resumed run continues bit for bit; a
NaN names where it appeared; torchrun restarts a group after a rank is killed. The seconds from
each fault to the end (or the resume) are printed (pytest -s) for the notes. The uninterrupted
runs the launched ones are compared with are not launched: ``_uninterrupted`` forks their ranks
and calls megazero.training.main, which saves each launch's imports of torch. Nor are the runs whose part
is megazero.training.main's alone: the resumes after a stop (a launch resumes in tests/launcher/test_launcher.py and
in the restart test here), --skip-bad-batches and the asynchronous saves that are not killed.
"""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support.distributed import forked_train_main as _uninterrupted
from tests.support.distributed import train_main_forked
from tests.support.launch import TINY, pids_of, start_launch, train_records
from tests.support.paths import REPO
from tests.support.ports import with_master_port
from tests.support.preemption import BASE, launch_env

pytestmark = pytest.mark.slow

NO_TRACEBACK = ("Traceback", "ChildFailedError", "torch.distributed.elastic")


def _last_records(run_dir) -> dict:
    """iteration -> its last train record (a resumed or restarted run logs some iterations twice)."""
    return {r["iteration"]: r for r in train_records(run_dir)}


def _wait_for(cond, proc, what: str, timeout: float = 480.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, f"the launcher ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _interrupt_after_two_steps(proc, run, send, timeout: float = 120.0):
    """Wait until the launcher ``proc`` has logged 2 steps in ``run``, call ``send()`` (a signal),
    wait for the launcher's end: (stdout, stderr, seconds from the signal to the end). The
    launcher is killed if any of it fails."""
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists() and len(train_records(run)) >= 2, proc, "2 steps")
        send()
        sent = time.monotonic()
        out, err = proc.communicate(timeout=timeout)
        return out, err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()


@contextlib.contextmanager
def _background(args, run_dir, env=None):
    """The launcher on ``args`` in the background (output piped), killed on the way out if it
    still runs: independent launches of one test overlap (one core is idle while a 1-rank run
    imports torch, both while a run waits out a timeout)."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("MEGAZERO_VENV", None)
    cmd = ["bash", str(REPO / "scripts" / "pretrain_gpt.sh"), *with_master_port(args), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _finish(proc, timeout: float = 600) -> subprocess.CompletedProcess:
    """Wait for a ``_background`` launch: its status and output, as ``launch`` returns them."""
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _same_losses(a: dict, b: dict, iterations) -> None:
    for it in iterations:  # bit-identical: the JSON floats are the exact float32 -> float64 values
        assert (a[it]["loss"], a[it]["grad_norm"]) == (b[it]["loss"], b[it]["grad_norm"]), it


@pytest.fixture
def one_thread(monkeypatch):
    """OMP_NUM_THREADS=1 for this test's launches: the thread count of ``_uninterrupted``'s ranks,
    so that launched and forked runs are bit for bit comparable on any number of cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.parametrize(
    "layout", [[], ["--tp", "2", "--pp", "2", "--dp", "2", "--zero-stage", "1"]], ids=["1x1x1", "2x2x2"]
)
def test_sigterm_to_the_launcher_saves_and_the_resumed_run_is_bit_identical(tmp_path, layout, one_thread):
    args = BASE + layout
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    with _uninterrupted(args, tmp_path / "full") as uninterrupted:
        proc = start_launch(args + ["--save", str(ckpt)], run)
        out, err, took = _interrupt_after_two_steps(proc, run, lambda: proc.send_signal(signal.SIGTERM))
        uninterrupted()
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:] + err[-2000:]
    stop = int((ckpt / "latest").read_text())
    assert 2 <= stop < 12
    line = (
        f"[megazero] stopped after iteration {stop} (SIGTERM): checkpoint {ckpt}/iter_{stop:07d}; "
        f"to resume, run the same command with --load {ckpt}"
    )
    assert line in err.splitlines(), err[-3000:]
    assert not any(t in out + err for t in NO_TRACEBACK), err[-3000:]
    assert pids_of(run) == [] and pids_of(run, agent=True) == []
    print(f"\nSIGTERM to the launcher ({layout or '1x1x1'}): every rank exited {took:.1f} s later; line: {line}")
    # the resume (megazero.training.main's, not the launcher's: a launch resumes in test_launcher.py) on forked ranks
    again = train_main_forked(args + ["--save", str(ckpt), "--load", str(ckpt)], run)
    assert f"resumed from {ckpt} at iteration {stop}" in again
    _same_losses(_last_records(tmp_path / "full"), _last_records(run), range(stop + 1, 13))


@pytest.fixture(scope="module")
def exit_interval_run(tmp_path_factory):
    """The launch of the --exit-interval test (1 rank, stops after iteration 4 with --save),
    started by the SIGUSR1 test so that the two overlap; returns (finished launch, its run
    directory, its checkpoint directory)."""
    d = tmp_path_factory.mktemp("exit_interval")
    with _background(BASE + ["--exit-interval", "4", "--save", str(d / "ckpt")], d / "run") as proc:
        yield lambda: (_finish(proc, timeout=300), d / "run", d / "ckpt")


@pytest.mark.usefixtures("exit_interval_run")
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGUSR1 to one of two ranks: both stop after the same iteration and one checkpoint holds both."""
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    proc = start_launch([a if a != "12" else "400" for a in BASE] + ["--dp", "2", "--save", str(ckpt)], run)
    victims = []
    out, err, took = _interrupt_after_two_steps(
        proc, run, lambda: (victims.append(max(pids_of(run))), os.kill(victims[0], signal.SIGUSR1))
    )
    victim = victims[0]
    record = json.loads((run / "stop.json").read_text())
    stop = record["iteration"]
    assert record["reason"] == "SIGUSR1" and proc.returncode == 128 + signal.SIGUSR1, err[-2000:]
    assert int((ckpt / "latest").read_text()) == stop
    assert sorted(p.name for p in (ckpt / f"iter_{stop:07d}").iterdir() if p.name.startswith("rng_")) == [
        "rng_0.pt",
        "rng_1.pt",
    ]
    assert f"[megazero] stopped after iteration {stop} (SIGUSR1): checkpoint {ckpt}/iter_{stop:07d}" in err
    assert not any(t in out + err for t in NO_TRACEBACK), err[-3000:]
    print(f"\nSIGUSR1 to rank pid {victim}: every rank exited {took:.1f} s later")


def test_exit_interval_saves_and_exits_with_status_0(exit_interval_run):
    out, run, ckpt = exit_interval_run()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert (
        f"[megazero] stopped after iteration 4 (--exit-interval): checkpoint {ckpt}/iter_0000004; "
        f"to resume, run the same command with --load {ckpt}"
    ) in out.stderr
    assert [r["iteration"] for r in train_records(run)] == [1, 2, 3, 4]
    assert (ckpt / "latest").read_text().strip() == "4"


def test_a_rank_killed_mid_run_is_restarted_and_the_run_equals_the_uninterrupted_one(tmp_path, one_thread):
    """kill -9 of rank 1 at iteration 7 of 12 (test hook) with --max-restarts 1 --save D --load D
    --save-interval 5: torchrun restarts the group, which resumes at 5 and finishes; iterations
    6-12 equal the uninterrupted run and the restart is in the log and the metrics file."""
    args = BASE + ["--dp", "2"]
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    env = dict(os.environ, MEGAZERO_TEST_FAULT="kill:7:1")
    start = time.monotonic()
    with _uninterrupted(args, tmp_path / "full") as uninterrupted:
        out = launch_env(
            args
            + [
                "--max-restarts",
                "1",
                "--save",
                str(ckpt),
                "--load",
                str(ckpt),
                "--save-interval",
                "5",
                "--distributed-timeout-s",
                "60",
            ],
            run,
            env,
        )
        uninterrupted()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = (
        "[megazero] restart 1 of --max-restarts 1: resumed at iteration 5; 1 trained iteration(s) lost "
        "(the last logged was 6)"
    )
    assert line in out.stdout, out.stdout[-3000:]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    [restart] = [r for r in records if r["kind"] == "restart"]
    assert (restart["restart"], restart["resumed_iteration"], restart["iterations_lost"]) == (1, 5, 1)
    assert [r["iteration"] for r in records if r["kind"] == "train"] == list(range(1, 7)) + list(range(6, 13))
    _same_losses(_last_records(tmp_path / "full"), _last_records(run), range(6, 13))
    resumed_at = next(r["wall_time"] for r in records if r["kind"] == "restart")
    killed_at = next(r["wall_time"] for r in records if r["kind"] == "train" and r["iteration"] == 6)
    print(
        f"\nkill -9 of rank 1 at iteration 7: resumed {resumed_at - killed_at:.1f} s after iteration 6 was "
        f"logged ({time.monotonic() - start:.0f} s in all); line: {line}"
    )


def test_async_save_every_iteration_trains_the_same_and_a_kill_mid_save_keeps_the_previous_latest(tmp_path, one_thread):
    """--async-save --save-interval 1 logs the losses of synchronous saves; rank 1 killed (-9)
    inside the background write of iteration 2's checkpoint of a launched run, after its file is
    written, leaves latest = 1, which loads and verifies, and the resumed run continues from it
    and logs the losses of the uninterrupted run. Only the killed run is launched (the launcher
    names the rank that failed); the synchronous, the asynchronous and the resumed runs are
    megazero.training.main on forked ranks."""
    from megazero import checkpoint

    args = [a if a != "12" else "4" for a in BASE] + ["--dp", "2", "--save-interval", "1"]
    # rank 1 SIGKILLs itself inside the background write of iteration 2's checkpoint, once its
    # tensor file is on disk: latest stays 1, which loads, and the run resumes from it. The
    # synchronous and the asynchronous runs go on beside it.
    env = dict(os.environ, MEGAZERO_TEST_FAULT="savekill:2:1")
    c3 = tmp_path / "c3"
    with (
        _uninterrupted(args + ["--save", str(tmp_path / "c1")], tmp_path / "sync") as sync,
        _uninterrupted(args + ["--save", str(tmp_path / "c2"), "--async-save"], tmp_path / "async") as both,
    ):
        killed = launch_env(
            args + ["--save", str(c3), "--async-save", "--distributed-timeout-s", "30"], tmp_path / "killed", env
        )
        sync()
        both()  # every rank exited 0
    _same_losses(_last_records(tmp_path / "sync"), _last_records(tmp_path / "async"), range(1, 5))
    assert (tmp_path / "c2" / "latest").read_text().strip() == "4"
    log = (tmp_path / "async" / "ranks.log").read_text()
    assert f"[megazero] saving checkpoint {tmp_path}/c2/iter_0000004 (in the background, training blocked " in log
    assert f"[megazero] checkpoint {tmp_path}/c2/iter_0000004 is complete (waited " in log
    assert killed.returncode != 0 and "training failed" in killed.stderr, killed.stderr[-2000:]
    assert "[megazero] rank 1 failed first (" in killed.stderr, killed.stderr[-3000:]
    assert list((c3 / "iter_0000002.tmp").glob("*.distcp")), "the kill came before any file was written"
    assert not (c3 / "iter_0000002").exists() and (c3 / "latest").read_text().strip() == "1"
    assert checkpoint.peek(str(c3), verify=True)["iteration"] == 1
    again = train_main_forked(args + ["--save", str(c3), "--load", str(c3), "--async-save"], tmp_path / "again")
    assert f"resumed from {c3} at iteration 1" in again, again[-2000:]
    _same_losses(_last_records(tmp_path / "sync"), _last_records(tmp_path / "again"), range(2, 5))
    assert (c3 / "latest").read_text().strip() == "4"


def _rank_of(pid: int) -> int:
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK="))[5:])


#: an operation of the ring buffer in words (collectives.describe), between ranks 0 and 1: the
#: optimizer's fp32 collectives, or the fp64 loss / stop all-reduce of the next iteration (with
#: --overlap-param-gather nothing blocks rank 0 after the step, so it may get that far)
OP = r"(all_reduce|all_gather|reduce_scatter|broadcast) #\d+ over ranks \[0, 1\], shape \(\d+,\) (float32|float64)"


class _Later:
    """A run that one test starts where it leaves the machine idle and another test checks
    (started then, when the first did not): ``start()``, then ``result()`` (waited for once)."""

    def __init__(self, start):
        self._start, self._wait, self._result = start, None, None

    def start(self) -> None:
        if self._wait is None:
            self._wait = self._start()

    def result(self):
        self.start()
        if self._result is None:
            self._result = self._wait()
        return self._result


NAN = [a if a != "12" else "5" for a in BASE] + ["--tp", "2", "--pp", "2"]
NAN_FAULT = {"MEGAZERO_TEST_FAULT": "nan:3:1:1"}  # micro-batch 1 of iteration 3 on rank 1


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory):
    """The NaN test's runs (started by the SIGSTOP test while it waits out the timeouts): the
    launch that stops, and --skip-bad-batches 1 on forked ranks (megazero.training.main's handling).
    ``result()``: (the finished launch, the directory of both run directories)."""
    d = tmp_path_factory.mktemp("nan")
    with contextlib.ExitStack() as stack:

        def start():
            skipping = stack.enter_context(_uninterrupted(NAN + ["--skip-bad-batches", "1"], d / "skip", env=NAN_FAULT))
            stopping = stack.enter_context(_background(NAN, d / "stop", dict(os.environ, **NAN_FAULT)))

            def wait():
                stopped = _finish(stopping)
                skipping()  # every rank exited 0
                return stopped, d

            return wait

        yield _Later(start)


TWO_NODES = [a if a != "12" else "4" for a in BASE] + ["--tp", "2", "--dp", "2"]


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory):
    """The two-node test's runs (started by the SIGSTOP test while it waits out the timeouts):
    TWO_NODES on one node (4 forked ranks) and launched as two nodes, --nnodes 2 --node-rank
    0/1 --rdzv-backend c10d on 127.0.0.1. ``result()``: (the two launches' output, the
    one-node run directory, the two-node run directory)."""
    from tests.support.ports import free_port

    d = tmp_path_factory.mktemp("two_nodes")
    with contextlib.ExitStack() as stack:

        def start():
            one = stack.enter_context(_uninterrupted(TWO_NODES, d / "one"))
            nodes = [
                "--nnodes",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(free_port()),
                "--rdzv-backend",
                "c10d",
            ]
            env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
            env.pop("MEGAZERO_VENV", None)
            procs = [
                subprocess.Popen(
                    [
                        "bash",
                        "scripts/pretrain_gpt.sh",
                        *TWO_NODES,
                        *nodes,
                        "--node-rank",
                        str(r),
                        "--run-dir",
                        str(d / "two"),
                    ],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for r in (0, 1)
            ]
            stack.callback(lambda: [p.kill() for p in procs if p.poll() is None])

            def wait():
                outs = [p.communicate(timeout=600)[0] for p in procs]
                one()
                return [(p.returncode, o) for p, o in zip(procs, outs)], d / "one", d / "two"

            return wait

        yield _Later(start)


HYBRID = TINY + ["--dp", "4", "--zero-stage", "2", "--zero-shard-size", "2"]


@pytest.fixture(scope="module")
def hybrid_node_runs(tmp_path_factory):
    """tests/layouts/test_hybrid_shard.py's two-node run (started by the SIGSTOP test while it waits out
    the timeouts): HYBRID's settings on one forked rank, and launched as two nodes of two ranks
    (the static rendezvous, the default). ``result()``: (the launches' (status, stdout, stderr),
    the one-rank run directory, node 0's run directory)."""
    from tests.support.ports import free_port

    d = tmp_path_factory.mktemp("hybrid_nodes")
    with contextlib.ExitStack() as stack:

        def start():
            one = stack.enter_context(_uninterrupted(TINY, d / "one"))
            flags = HYBRID + ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
            procs = [start_launch(flags + ["--node-rank", str(r)], d / f"node{r}") for r in (0, 1)]
            stack.callback(lambda: [p.kill() for p in procs if p.poll() is None])

            def wait():
                outs = [p.communicate(timeout=600) for p in procs]
                one()
                return [(p.returncode, *o) for p, o in zip(procs, outs)], d / "one", d / "node0"

            return wait

        yield _Later(start)


@pytest.fixture(scope="module")
def killed_rank_run(tmp_path_factory):
    """The launch of the kill -9 test below (rank 1 of 2 kills itself at the start of iteration
    3, --distributed-timeout-s 20), started by the SIGSTOP test so that it runs while that test
    waits out its timeouts; returns (finished launch, its run directory, seconds from its start)."""
    run = tmp_path_factory.mktemp("killed_rank") / "run"
    env = dict(os.environ, MEGAZERO_TEST_FAULT="kill:3:1")
    start = time.monotonic()
    with _background(
        [a if a != "12" else "5" for a in BASE] + ["--dp", "2", "--distributed-timeout-s", "20"], run, env
    ) as proc:
        yield lambda: (_finish(proc, timeout=300), run, time.monotonic() - start)


def test_a_stopped_rank_is_named_with_the_operation_the_others_waited_in(
    tmp_path, killed_rank_run, nan_runs, two_node_runs, hybrid_node_runs
):
    """SIGSTOP to rank 1 of 2: rank 0's collective fails (--distributed-timeout-s 10), it writes
    its failure report, torchrun ends the stopped rank (SIGKILL, in its summary), and the launcher
    names rank 1 with that signal and the operation rank 0 waited in. While it waits out the
    timeout and torchrun's grace period, the NaN and the two two-node tests' runs start."""
    run = tmp_path / "run"
    proc = start_launch([a if a != "12" else "400" for a in BASE] + ["--dp", "2", "--distributed-timeout-s", "10"], run)
    victim = None
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists() and len(train_records(run)) >= 2, proc, "2 steps")
        victim = next(p for p in pids_of(run) if _rank_of(p) == 1)
        os.kill(victim, signal.SIGSTOP)
        sent = time.monotonic()
        nan_runs.start()
        two_node_runs.start()
        hybrid_node_runs.start()
        out, err = proc.communicate(timeout=240)
        took = time.monotonic() - sent
    finally:
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, err[-2000:]
    named = [x for x in err.splitlines() if x.startswith("[megazero] rank")]
    print("\n".join(named))
    assert len(named) == 1 and re.fullmatch(
        r"\[megazero\] rank 1 failed first \(signal 9 \(SIGKILL\), exit code -9, from torchrun's report\); the "
        rf"others waited in {OP} during the .+ at iteration \d+ \(reports: .+/failures\)",
        named[0],
    ), err[-3000:]
    assert re.search(rf"megazero: rank 0: a collective failed in the .+ at iteration \d+, waiting in {OP}: ", err), err[
        -3000:
    ]
    print(f"\nSIGSTOP to rank 1: the launcher ended {took:.1f} s later; line: {named[0]}")


def test_a_killed_rank_is_named_with_its_signal_and_the_operation_the_others_waited_in(killed_rank_run):
    """kill -9 of rank 1 of 2 at the start of iteration 3: rank 0's collective fails, it writes
    its report, and the launcher names rank 1 with SIGKILL from torchrun's summary (kept in
    RUN_DIR/torchrun.log) and the operation rank 0 waited in."""
    done, run, took = killed_rank_run()
    named = [x for x in done.stderr.splitlines() if x.startswith("[megazero] rank")]
    print("\n".join(named), f"\nkill -9 of rank 1: the launcher ended {took:.1f} s after start")
    assert done.returncode != 0 and "Root Cause" in (run / "torchrun.log").read_text()
    # the operation's sequence number and shape follow the model and the bucket sizes: matched by form
    assert len(named) == 1 and re.fullmatch(
        r"\[megazero\] rank 1 failed first \(signal 9 \(SIGKILL\), exit code -9, from torchrun's report\); "
        r"the others waited in all_reduce #\d+ over ranks \[0, 1\], shape \(\d+,\) float32 during the optimizer step "
        r"\(gradient reduction, overflow all-reduce, norm, parameter all-gather\) at iteration 3 "
        + re.escape(f"(reports: {run}/failures)"),
        named[0],
    ), done.stderr[-3000:]


def test_a_nan_stops_with_one_line_and_skip_bad_batches_skips_it(nan_runs):
    """NaN in micro-batch 1 of iteration 3 on rank 1 (tp rank 1 of stage 0) of tp2 x pp2: the
    launched run stops with status 1 and a line naming iteration, stage, ranks and samples; with
    --skip-bad-batches 1 (megazero.training.main's handling: forked ranks beside the launch) the run
    completes with one skipped step."""
    stopped, d = nan_runs.result()
    skipped = (d / "skip" / "ranks.log").read_text()
    assert stopped.returncode == 1, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    line = (
        "megazero: training error: non-finite loss/gradient at iteration 3: it first appeared in the forward "
        "pass of pipeline stage 0 (tensor-parallel rank 1, data-parallel rank 0, micro-batch 1), on training "
        "samples 18-19; fix: inspect those samples, lower --lr, or --skip-bad-batches N to skip such steps"
    )
    assert [x for x in stopped.stderr.splitlines() if "non-finite" in x] == [line], stopped.stderr[-3000:]
    assert not any(t in stopped.stdout + stopped.stderr for t in NO_TRACEBACK), stopped.stderr[-3000:]
    assert "[megazero] skipped iteration 3: non-finite loss/gradient at iteration 3" in skipped, skipped[-3000:]
    records = train_records(d / "skip")
    assert [r["skipped_iterations"] for r in records] == [0, 0, 1, 1, 1]
    assert records[2]["loss"] is None and all(r["loss"] is not None for r in records[3:])


def test_two_launchers_as_two_nodes_train_like_one_node(two_node_runs):
    """--nnodes 2 --node-rank 0/1 --master-addr 127.0.0.1 --rdzv-backend c10d (tp 2, dp 2: one
    tp pair per "node") logs the losses of the same layout launched on one node. The static
    rendezvous (the default) of two loopback nodes is the hybrid-shard test below (dp 4, one ZeRO
    shard group per node)."""
    nodes, one, two = two_node_runs.result()
    assert [rc for rc, _ in nodes] == [0, 0], nodes[0][1][-2000:] + nodes[1][1][-2000:]
    assert all("launching 2 process(es) on this node (tp=2 pp=1 dp=2, nnodes=2)" in o for _, o in nodes)
    a, b = _last_records(one), _last_records(two)
    assert sorted(b) == [1, 2, 3, 4]
    for it in a:
        assert a[it]["loss"] == pytest.approx(b[it]["loss"], rel=1e-6, abs=0), it


def test_two_loopback_nodes_with_hybrid_shards_train_like_one_process(hybrid_node_runs):
    """(tests/layouts/test_hybrid_shard.py's) scripts/pretrain_gpt.sh --nnodes 2 on this
    machine (node ranks 0 and 1, two ranks each, one static rendezvous, the default, on
    127.0.0.1): dp 4 with --zero-shard-size 2 (one shard group per node, ZeRO-2) logs the
    losses of the single-process run of the same settings within 1e-5."""
    nodes, one, node0 = hybrid_node_runs.result()
    assert [rc for rc, _, _ in nodes] == [0, 0], [err[-3000:] for _, _, err in nodes]
    assert all("launching 2 process(es) on this node (tp=1 pp=1 dp=4, nnodes=2)" in out for _, out, _ in nodes), nodes
    a, b = train_records(one), train_records(node0)
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-5), (x["loss"], y["loss"])
