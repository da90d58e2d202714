"""Real launches of scripts/pretrain_gpt.sh: TINY flags, start_launch, pids_of (a run's rank
processes) and train_records (its metrics file)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO
from tests.support.ports import with_master_port

ROOT = REPO


TINY = [
    "--mock-data",
    "--vocab-size",
    "301",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "6",
    "--log-interval",
    "1",
    "--eval-interval",
    "3",
    "--eval-iters",
    "1",
    "--make-vocab-size-divisible-by",
    "8",
]


def train_records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def pids_of(run_dir, agent: bool = False):
    """PIDs of the train.py ranks, or of torchrun's agent (``agent``), of the launch into ``run_dir``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        is_agent = b"torch.distributed.run" in cmd
        if str(run_dir).encode() in cmd and is_agent == agent and any(c.endswith(b"train.py") for c in cmd):
            pids.append(int(pid))
    return pids


def start_launch(args, run_dir, capture=True):
    """The launcher in the background for the kill tests (``capture``: pipe its output, else drop it),
    on a rendezvous port of this shard's block unless ``args`` name one (``with_master_port``)."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("MEGAZERO_VENV", None)
    cmd = ["bash", str(ROOT / "scripts" / "pretrain_gpt.sh"), *with_master_port(args), "--run-dir", str(run_dir)]
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out, text=True)
