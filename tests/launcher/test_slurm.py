"""scripts/pretrain_gpt.slurm and megazero/runtime/slurm.py: SLURM's variables -> the launcher's flags.

The parsing is pure; the sbatch script itself runs with a stand-in ``srun`` (runs the task once
on this machine) and a stand-in launcher that prints the flags it was given.
"""

import os
import shutil
import subprocess
import sys

import pytest

from megazero.runtime.slurm import SlurmError, expand_nodelist, launcher_flags, main
from tests.support.paths import REPO

ROOT = REPO


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("a,b,c", ["a", "b", "c"]),
        ("gpu-[1,3-4]", ["gpu-1", "gpu-3", "gpu-4"]),
        ("gpu-[1,3-4],cpu07", ["gpu-1", "gpu-3", "gpu-4", "cpu07"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
        ("single", ["single"]),
    ],
)
def test_node_lists_expand_like_scontrol(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text,err",
    [
        ("node[01-03", "unbalanced"),
        ("node[3-1]", "backwards"),
        ("n[a-b]", "cannot read the range"),
        ("a,,b", "empty host"),
    ],
)
def test_a_bad_node_list_is_named(text, err):
    with pytest.raises(SlurmError, match=err):
        expand_nodelist(text)


def test_flags_for_one_node():
    env = dict(SLURM_JOB_NODELIST="gpu-[1,3-4]", SLURM_JOB_NUM_NODES="3", SLURM_NODEID="2", SLURM_JOB_ID="77")
    assert launcher_flags(env) == ["--nnodes", "3", "--node-rank", "2", "--master-addr", "gpu-1", "--rdzv-id", "77"]
    with pytest.raises(SlurmError, match="SLURM_NODEID='3' is not a node number below 3"):
        launcher_flags(dict(env, SLURM_NODEID="3"))
    with pytest.raises(SlurmError, match="names 3 hosts"):
        launcher_flags(dict(env, SLURM_JOB_NUM_NODES="2"))


def test_outside_slurm_one_line_and_exit_code_2(capsys):
    assert main({}) == 2
    assert capsys.readouterr().err.strip() == (
        "megazero: config error: SLURM_JOB_NODELIST is not set: run this inside a SLURM allocation (sbatch/srun)"
    )


def test_the_sbatch_script_starts_the_launcher_with_the_node_flags(tmp_path):
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "megazero" / "runtime").mkdir(parents=True)
    for rel in ("scripts/env.sh", "megazero/__init__.py", "megazero/runtime/__init__.py", "megazero/runtime/slurm.py"):
        shutil.copy(ROOT / rel, root / rel)
    (root / "scripts" / "pretrain_gpt.sh").write_text('echo "LAUNCH $*"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun stand-in: drop its own options, run the task once here
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(root),
        SLURM_JOB_NODELIST="node[01-03]",
        SLURM_JOB_NUM_NODES="3",
        SLURM_NODEID="1",
        SLURM_JOB_ID="4242",
    )
    env.pop("MEGAZERO_VENV", None)
    env.pop("MEGAZERO_ROOT", None)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "pretrain_gpt.slurm"), "--tp", "2", "--save", "/c"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "LAUNCH --nnodes 3 --node-rank 1 --master-addr node01 --rdzv-id 4242 "
        "--rdzv-backend c10d --run-dir runs/slurm-4242 --tp 2 --save /c"
    )
