"""Launches for the preemption tests: BASE flags and launch_env (a launch's environment)."""

import os
import subprocess
import sys

from tests.support.launch import TINY
from tests.support.paths import REPO
from tests.support.ports import launch_with_port

BASE = [a if a != "6" else "12" for a in TINY] + ["--eval-iters", "0", "--hidden-dropout", "0.1"]


def launch_env(args, run_dir, env, timeout=600):
    """The launcher on ``args`` to its end with environment ``env``, on a rendezvous port of this
    shard's block (``launch_with_port``)."""
    env = dict(env, PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    env.pop("MEGAZERO_VENV", None)

    def run(argv):
        cmd = ["bash", str(REPO / "scripts" / "pretrain_gpt.sh"), *argv, "--run-dir", str(run_dir)]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)

    return launch_with_port(run, args)
