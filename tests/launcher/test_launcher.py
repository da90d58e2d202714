"""The front door end to end: scripts/pretrain_gpt.sh -> torchrun -> train.py -> logs.

Runs real launches (gloo ranks on CPU, a tiny GPT on mock data): two layouts log the same
losses for the same global batch, the TensorBoard event files load with TensorBoard's own
EventAccumulator and hold the documented scalars, and a bad setting stops the launcher with
exit code 2 and one line naming it, before any rank starts.
"""

import math
import os
import subprocess
import sys

import pytest

from tests.support.launch import ROOT, TINY, pids_of, start_launch, train_records
from tests.support.ports import launch_with_port


def launch(args, run_dir=None, timeout=300):
    """The launcher on ``args`` to its end, on a rendezvous port of this shard's block (``launch_with_port``)."""
    env = dict(os.environ)
    # scripts/env.sh takes the Python on PATH when it has the dependencies: this one
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("MEGAZERO_VENV", None)
    tail = [] if run_dir is None else ["--run-dir", str(run_dir)]

    def run(argv):
        cmd = ["bash", str(ROOT / "scripts" / "pretrain_gpt.sh"), *argv, *tail]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    return launch_with_port(run, args)


@pytest.mark.slow
def test_two_layouts_log_the_same_losses_and_tensorboard_holds_them(tmp_path):
    """The 3D layout launched; the one-rank run it is compared with runs megazero.training.main on a forked
    rank beside it (``forked_train_main``: not a second launch, whose imports cost more than it)."""
    from tests.support.distributed import forked_train_main

    with forked_train_main(TINY, tmp_path / "tp1") as one:
        three_d = launch(TINY + ["--tp", "2", "--pp", "2", "--dp", "2", "--zero-stage", "2"], tmp_path / "3d")
        one()
    assert three_d.returncode == 0, three_d.stdout[-3000:] + three_d.stderr[-3000:]
    a, b = train_records(tmp_path / "tp1"), train_records(tmp_path / "3d")
    assert [r["iteration"] for r in a] == list(range(1, 7)) == [r["iteration"] for r in b]
    for x, y in zip(a, b):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-5), (x["loss"], y["loss"])
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=1e-4)
    assert "final validation loss" in three_d.stdout and "tensorboard --logdir" in three_d.stdout
    assert "formula" in three_d.stdout  # every rank reports model-state bytes beside ZeRO's formula

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "3d" / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/loss_scale",
        "train/skipped_iterations",
        "perf/tokens_per_s",
        "perf/tflops_per_device",
        "memory/model_state_bytes",
        "memory/peak_bytes",
        "valid/loss",
        "valid/ppl",
    ):
        assert tag in tags, tag
    logged = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(logged) == list(range(1, 7))
    for r in b:  # TensorBoard stores float32
        assert math.isclose(logged[r["iteration"]], r["loss"], rel_tol=1e-6)
    assert [e.step for e in acc.Scalars("valid/loss")] == [3, 6]
    assert any("config" in t for t in acc.Tags()["tensors"])


NO_CUDA = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--tp", "3"], "--tp 3"),
        (["--pp", "3"], "--pp"),
        (["--zero-stage", "4"], "--zero-stage 4 is out of range"),
        (["--fp16", "--bf16"], "--bf16"),
        (["--nnodes", "0"], "--nnodes must be a whole number >= 1"),
        (["--tp", "08"], "--tp must be a whole number >= 1, got '08'"),
        (["--node-rank", "3"], "--node-rank 3 is not below --nnodes 1"),
        (["--master-port", "99999"], "--master-port must be a port number"),
        (["--distributed-timeout-s", "1e15"], "--distributed-timeout-s"),
        (
            ["--max-restarts", "1"],
            "--max-restarts 1 cannot resume this run",
        ),  # read by the launcher, refused before torchrun
        pytest.param(["--device", "cuda"], "--device cuda: no CUDA device", marks=NO_CUDA),
        pytest.param(["--kernels", "apex"], "--kernels apex needs a CUDA device", marks=NO_CUDA),
    ],
)
def test_bad_setting_stops_the_launcher_with_exit_code_2(tmp_path, args, needle):
    out = launch(TINY + args, tmp_path / "bad", timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [l for l in out.stderr.splitlines() if l.startswith("megazero: ") and " error: " in l]
    assert len(errors) == 1 and needle in errors[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "bad").exists()  # nothing was started or written


def test_master_port_in_use_stops_the_launcher_with_exit_code_2(tmp_path):
    import socket

    with socket.socket() as s:  # another service holds the port
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        out = launch(TINY + ["--master-port", str(port)], tmp_path / "busy", timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"--master-port {port} is already in use" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "busy").exists()


@pytest.mark.slow
def test_a_deepspeed_sequence_parallel_size_launches_ulysses_without_a_cp_flag(tmp_path):
    """A DeepSpeed JSON with ``sequence_parallel_size: 2`` and no --cp: the launcher starts the
    two ranks it asks for and forwards no --cp of its own (which used to conflict with the
    file), and the run is DeepSpeed-Ulysses (--cp 2 --cp-comm-type a2a), loss for loss exactly,
    not the ring, which differs in the last bits; a --cp 2 beside the file means the same."""
    import json

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 2}))
    short = TINY[: TINY.index("--train-iters")] + ["--train-iters", "2", "--eval-iters", "0"]
    runs = {
        "ds": short + ["--deepspeed-config", str(ds)],
        "a2a": short + ["--cp", "2", "--cp-comm-type", "a2a"],
        "ds+cp": short + ["--cp", "2", "--deepspeed-config", str(ds)],
    }
    losses = {}
    for name, args in runs.items():
        out = launch(args, tmp_path / name, timeout=180)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert "launching 2 process(es) on this node (tp=1 cp=2 pp=1 dp=1" in out.stdout, out.stdout[-2000:]
        losses[name] = [r["loss"] for r in train_records(tmp_path / name)]
    assert len(losses["a2a"]) == 2 and losses["ds"] == losses["a2a"] == losses["ds+cp"], losses


@pytest.fixture(scope="module")
def lone_node(tmp_path_factory):
    """One launch for the two tests below: --tp 2 --nnodes 2 with only node 0 started (its
    output, the seconds it took)."""
    import time

    start = time.monotonic()
    out = launch(
        TINY + ["--tp", "2", "--nnodes", "2", "--distributed-timeout-s", "3"],
        tmp_path_factory.mktemp("alone") / "run",
        timeout=120,
    )
    return out, time.monotonic() - start


def test_a_node_that_never_joins_ends_the_launch_after_the_timeout(lone_node):
    """--nnodes 2 with only node 0 started: torchrun's rendezvous gives up after
    --distributed-timeout-s instead of waiting forever (docs/design.md, contract 3)."""
    out, took = lone_node
    assert out.returncode != 0 and took < 90, out.stdout[-2000:] + out.stderr[-2000:]
    assert "training failed" in out.stderr and "--distributed-timeout-s 3" in out.stderr, out.stderr[-2000:]


def test_the_launcher_exports_cuda_device_max_connections_for_tensor_parallel_overlap(lone_node):
    """--tp 2 (async tensor-parallel all-reduce): the preflight's decision is exported before
    torchrun starts (the value printed is read back from the launcher's environment; a value
    the user set is kept: tests/unit/test_cuda_init.py). The launch itself ends at once (node 1 of
    --nnodes 2 never joins: the launch of the test above)."""
    out, _ = lone_node
    assert (
        "[megazero] CUDA_DEVICE_MAX_CONNECTIONS=1 (the async tensor-parallel input-gradient reduction "
        "(--tp 2) overlaps" in out.stdout
    ), out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_and_its_checkpoint_resumes(tmp_path):
    """kill -9 of one rank mid-run: the launcher exits non-zero within seconds (torchrun stops
    the other ranks), the last complete checkpoint is intact and a relaunch resumes from it."""
    import signal
    import time

    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = [a if a != "6" else "400" for a in TINY] + [
        "--dp",
        "2",
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--save-interval",
        "2",
        "--eval-interval",
        "1000",
        "--keep-latest-checkpoints",
        "1",
    ]
    proc = start_launch(args, run_dir)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "latest").exists() or len(train_records(run_dir)) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.2)
        pids = pids_of(run_dir)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and time.monotonic() - killed_at < 60
    assert "training failed" in err, err[-2000:]
    assert pids_of(run_dir) == []  # no rank left behind
    saved = int((ckpt / "latest").read_text())
    assert saved >= 2 and saved % 2 == 0
    assert sorted(p.name for p in ckpt.glob("iter_???????")) == [f"iter_{saved:07d}"]  # --keep-latest 1
    again = launch([a if a != "400" else str(saved + 2) for a in args], run_dir)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resumed from {ckpt} at iteration {saved}" in again.stdout
    assert [r["iteration"] for r in train_records(run_dir)][-2:] == [saved + 1, saved + 2]


VICTIMS = ("launcher", "launcher -9", "torchrun")


@pytest.fixture(scope="module")
def stopped_launches(tmp_path_factory):
    """The three launches of the test below, side by side (one core idles while a launch
    imports torch, both while the ranks wait to notice their parent gone): each run of dp 2
    reaches 2 logged steps, then its victim is hit (SIGTERM to the launcher, kill -9 of the
    launcher, kill -9 of torchrun). Returns victim -> (train.py ranks before the stop, ranks
    and torchrun agents left 30 s later, the launcher's exit status)."""
    import signal
    import time

    root = tmp_path_factory.mktemp("stop")
    args = [a if a != "6" else "5000" for a in TINY] + ["--dp", "2", "--eval-interval", "1000"]
    runs = {v: (root / f"run{i}", start_launch(args, root / f"run{i}", capture=False)) for i, v in enumerate(VICTIMS)}
    out = {}
    try:
        deadline = time.monotonic() + 120
        for run_dir, proc in runs.values():
            while not (run_dir / "metrics.jsonl").exists() or len(train_records(run_dir)) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, "the run did not get going"
                time.sleep(0.2)
        ranks = {v: len(pids_of(run_dir, agent=False)) for v, (run_dir, _) in runs.items()}
        for victim, (run_dir, proc) in runs.items():
            if victim == "launcher":
                proc.send_signal(signal.SIGTERM)
            elif victim == "launcher -9":  # torchrun survives it; the ranks see the launcher gone
                proc.kill()
                proc.wait()
            else:
                [agent] = pids_of(run_dir, agent=True)
                os.kill(agent, signal.SIGKILL)
        deadline = time.monotonic() + 30
        left = lambda d: pids_of(d, agent=False) + pids_of(d, agent=True)
        while any(left(d) for d, _ in runs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for victim, (run_dir, proc) in runs.items():
            remaining = left(run_dir)
            if not remaining:
                proc.wait(timeout=30)
            out[victim] = ranks[victim], remaining, proc.poll()
    finally:
        for run_dir, proc in runs.values():
            for pid in pids_of(run_dir, agent=False) + pids_of(run_dir, agent=True):
                os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("victim", VICTIMS)
def test_stopping_the_launcher_or_killing_torchrun_stops_every_rank(victim, stopped_launches):
    """SIGTERM to the launcher is passed on to torchrun, which stops the ranks; kill -9 of the
    launcher or of torchrun leaves ranks behind, and each exits within seconds
    (megazero.runtime.launch.watch_parent); then torchrun, its workers gone, ends too."""
    import signal

    ranks, remaining, status = stopped_launches[victim]
    assert ranks == 2
    assert remaining == []  # no train.py rank and no torchrun agent 30 s after the stop
    # the launcher exits with 128 + SIGTERM when stopped, or passes on torchrun's -9 (137)
    assert (
        status
        == {"launcher": 128 + signal.SIGTERM, "launcher -9": -signal.SIGKILL, "torchrun": 128 + signal.SIGKILL}[victim]
    )


def test_help_lists_the_launcher_flags_and_train_flags_once_and_does_nothing_else(tmp_path):
    """``--help`` in a fresh copy of the repository: the launcher's own flags and train.py's,
    each help once, with no data prepared and no run directory made (and well under the minutes that
    preparing data takes: 30 s, a bound loose enough for a loaded machine; it takes about 2 s)."""
    import shutil
    import time

    clone = tmp_path / "clone"
    shutil.copytree(
        ROOT,
        clone,
        ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "runs", "__pycache__", ".pytest_cache", "*.egg-info"),
    )
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("MEGAZERO_VENV", None)
    start = time.monotonic()
    out = subprocess.run(
        ["bash", str(clone / "scripts" / "pretrain_gpt.sh"), "--tp", "2", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - start
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert took < 30.0, took
    for flag in (
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--data-dir",
        "--run-dir",
        "--num-layers",
        "--zero-stage",
        "--data-path",
    ):
        assert flag in out.stdout, flag
    assert out.stdout.count("usage: bash scripts/pretrain_gpt.sh") == 1
    assert out.stdout.count("usage: train.py") == 1
    assert not (clone / ".cache").exists() and not (clone / "runs").exists()
    assert sorted(os.listdir(tmp_path)) == ["clone"]
