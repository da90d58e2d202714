"""NVMe offload end to end: an unusable --offload-nvme-path stops before any rank starts, and no
swap folder outlives its run.

- a path that is a file, under a file, read-only, or on a disk with less free space than the
  planner's swap bytes for this node's ranks: the preflight (what the launcher runs before
  torchrun) returns 2 with one line naming --offload-nvme-path and the fix, and leaves nothing;
- a real launch (2 gloo ranks, ZeRO-3, optimizer and parameters on NVMe: four swap folders)
  whose rank 1 is killed with SIGKILL leaves no ``megazero-*`` folder: the launcher sweeps them
  after torchrun ends;
- a later run's preflight sweeps the folder of an earlier crashed run and keeps the folder of a
  run still alive;
- with ``--max-restarts 1`` the restarted attempt's local rank 0 sweeps the killed attempt's
  folders before it makes its own, and the run ends with none.
"""

import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO
from tests.support.preemption import BASE, launch_env

TINY = [
    "--mock-data",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--make-vocab-size-divisible-by",
    "8",
    "--train-iters",
    "2",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
    "--zero-stage",
    "1",
    "--offload-optimizer",
    "nvme",
]


def _preflight(path, capsys) -> str:
    """training.preflight on TINY with ``--offload-nvme-path path``: asserts exit code 2 and one
    line on stderr; returns it."""
    from megazero import training

    code = training.preflight(TINY + ["--offload-nvme-path", str(path)], 1)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err


def test_a_path_that_is_a_file(tmp_path, capsys):
    (tmp_path / "swap").write_text("notes")
    err = _preflight(tmp_path / "swap", capsys)
    assert err == (
        f"megazero: config error: --offload-nvme-path {tmp_path}/swap is a file, not a directory; "
        "fix: point --offload-nvme-path at a directory\n"
    )
    assert os.listdir(tmp_path) == ["swap"] and (tmp_path / "swap").read_text() == "notes"


def test_a_path_under_a_file_cannot_be_created(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    err = _preflight(tmp_path / "f" / "a" / "swap", capsys)
    assert err == (
        f"megazero: config error: --offload-nvme-path {tmp_path}/f/a/swap is under {tmp_path}/f, which is a "
        "file, not a directory; fix: point --offload-nvme-path at a directory\n"
    )
    assert os.listdir(tmp_path) == ["f"]


def test_a_read_only_directory(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        try:
            (ro / "probe").write_text("")
        except PermissionError:
            pass
        else:
            pytest.skip("running as root: a mode of 0555 does not stop writing (the file cases cover the rest)")
        err = _preflight(ro / "swap", capsys)
        assert err == (
            f"megazero: config error: --offload-nvme-path {ro}/swap is not usable for the swap files "
            "(Permission denied); fix: point --offload-nvme-path at a writable directory\n"
        )
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o755)


def test_a_disk_with_too_little_room_for_the_planned_swap_files(tmp_path, capsys, monkeypatch):
    """Free space below 12 bytes per owned element (fp32 main param and two moments, 1 rank:
    every parameter) plus the file's 4 KiB header: the one line gives both numbers; the directory
    the check made for its probe is gone again."""
    import shutil

    from megazero.config import config_from_argv
    from megazero.config.schema import MOCK_VOCAB_SIZE
    from megazero.planning.plan import plan_memory
    from model.build import build_gpt_config

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=5000))
    err = _preflight(tmp_path / "new", capsys)
    cfg = config_from_argv(TINY + ["--offload-nvme-path", str(tmp_path / "new")], 1)
    params = plan_memory(cfg, build_gpt_config(cfg, MOCK_VOCAB_SIZE)).params
    need = 4096 + 12 * params
    assert err == (
        f"megazero: config error: --offload-nvme-path {tmp_path}/new has 5,000 bytes (0.00 GiB) free, the swap "
        f"files of this node's ranks need about {need:,} bytes (0.00 GiB); fix: free space there or point "
        "--offload-nvme-path at a disk with more room\n"
    )
    assert os.listdir(tmp_path) == []


def _env(tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("MEGAZERO_VENV", None)
    return env


def test_the_launcher_stops_on_a_file_with_one_line(tmp_path):
    (tmp_path / "swap").write_text("")
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "pretrain_gpt.sh"), *TINY, "--offload-nvme-path", str(tmp_path / "swap")]
        + ["--run-dir", str(tmp_path / "run")],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr == (
        f"megazero: config error: --offload-nvme-path {tmp_path}/swap is a file, not a directory; "
        "fix: point --offload-nvme-path at a directory\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["swap"]


NVME = [a if a != "12" else "4" for a in BASE] + [
    "--dp",
    "2",
    "--zero-stage",
    "3",
    "--offload-optimizer",
    "nvme",
    "--offload-param",
    "nvme",
    "--offload-param-max-in-cpu",
    "0",
    "--zero3-param-persistence-threshold",
    "0",
]

MAKER = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from megazero.offload.swap_dirs import make_swap_dir
make_swap_dir(sys.argv[2], sys.argv[3])
print("made", flush=True)
if sys.argv[4] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()
"""


def _folder_of(swap, name, die):
    """A process that makes swap folder ``name`` and is killed (an earlier crashed run) or runs on
    (another job on the same disk, until its stdin is closed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKER, str(REPO), str(swap), name, "die" if die else "live"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "made\n"
    if die:
        proc.wait(timeout=60)
    return proc


def _removed(text):
    return [x for x in text.splitlines() if x.startswith("[megazero] removed the stale NVMe swap folder ")]


def test_a_killed_rank_leaves_no_swap_folder(tmp_path):
    """SIGKILL of rank 1 at iteration 3 (test hook): torchrun ends rank 0, the launcher exits 1
    and then removes all four folders (two a rank), one line each."""
    swap = tmp_path / "swap"
    env = dict(_env(tmp_path), MEGAZERO_TEST_FAULT="kill:3:1")
    out = launch_env(NVME + ["--offload-nvme-path", str(swap), "--distributed-timeout-s", "30"], tmp_path / "run", env)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert os.listdir(swap) == []
    after = _removed(out.stderr)
    assert sorted(x.split()[7].rsplit("-rank", 1)[1] for x in after) == ["0", "0-params", "1", "1-params"], after


def test_a_later_run_sweeps_a_crashed_runs_folders_and_keeps_a_live_runs(tmp_path, capsys):
    """The preflight (the launcher's, before any rank starts) over a folder of a run whose
    process was killed and one of a job still running: the first goes with one line, the second
    stays; the preflight passes."""
    from megazero import training
    from megazero.offload.swap_dirs import read_owner

    swap = tmp_path / "swap"
    crashed = _folder_of(swap, f"megazero-{'a' * 32}-rank0", die=True)
    live = _folder_of(swap, f"megazero-{'b' * 32}-rank0-params", die=False)
    try:
        assert training.preflight(TINY + ["--offload-nvme-path", str(swap)], 1) == 0
        assert _removed(capsys.readouterr().out) == [
            f"[megazero] removed the stale NVMe swap folder {swap}/megazero-{'a' * 32}-rank0 (its process, pid "
            f"{crashed.pid} on {os.uname().nodename}, is gone)"
        ]
        assert os.listdir(swap) == [f"megazero-{'b' * 32}-rank0-params"]
        assert read_owner(str(swap / f"megazero-{'b' * 32}-rank0-params"))["pid"] == live.pid
    finally:
        live.stdin.close()
        live.wait(timeout=60)


def test_a_restart_sweeps_the_killed_attempts_folders_and_the_run_leaves_none(tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    env = dict(_env(tmp_path), MEGAZERO_TEST_FAULT="kill:3:1")
    flags = ["--offload-nvme-path", str(swap), "--distributed-timeout-s", "30", "--max-restarts", "1"]
    flags += ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2"]
    out = launch_env(NVME + flags, tmp_path / "run", env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    restart = out.stdout.index("[megazero] restart 1 of --max-restarts 1")
    swept = _removed(out.stdout)
    assert len(swept) == 4, out.stdout[-3000:]
    assert all(out.stdout.index(x) < restart for x in swept)  # before the restarted attempt trained
    assert _removed(out.stderr) == [] and os.listdir(swap) == []
