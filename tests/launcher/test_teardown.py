"""A finished run leaves nothing running when its interpreter exits.

A finished ZeRO-3 run with full recomputation and prefetching sometimes died after its
summary with ``terminate called without an active exception`` (SIGABRT, no Python frame:
interpreter shutdown). The gradient hooks that ``DataParallel`` registers live in autograd's
C++ state, where Python's garbage collector cannot see the cycle parameter -> hook ->
DataParallel -> model -> parameter, so the model and every process group it references
survived ``destroy_process_group``: 6 process groups and their 18 gloo threads (worker and
transport loops) were still running when the interpreter shut down, and a worker that
dropped the last reference to a Python-owned tensor then needs the GIL of an interpreter
that is going away. ``Trainer.close`` and ``main``'s teardown end them while Python is alive;
this test asserts that no gloo thread outlives ``training.main`` on any rank (it fails on the
code before the fix: 18 threads per rank).
"""

import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO

ROOT = REPO
F1 = [
    "--mock-data",
    "--dp",
    "2",
    "--zero-stage",
    "3",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "2",
    "--zero3-max-reuse-distance",
    "0",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "4",
    "--eval-iters",
    "0",
    "--log-interval",
    "2",
]

WRAPPER = """
import os, sys
sys.path.insert(0, sys.argv[1])
from megazero import training
from megazero.training import loop

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)

during = []
inner = loop.run_loop
def counting_loop(*args):   # the groups exist while the loop runs
    during.append(len(gloo_threads()))
    return inner(*args)
loop.run_loop = counting_loop   # train() calls the loop module's run_loop
rc = training.main(sys.argv[3:])
with open(os.path.join(sys.argv[2], "teardown_" + os.environ["RANK"]), "w") as f:   # one file a rank
    f.write(f"{rc} {during} {gloo_threads()}")
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to list threads")
def test_no_gloo_thread_outlives_a_finished_run(tmp_path):
    script = tmp_path / "wrapper.py"
    script.write_text(WRAPPER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(ROOT),
        str(tmp_path),
        *F1,
        "--run-dir",
        str(tmp_path / "run"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [(tmp_path / f"teardown_{r}").read_text() for r in range(2)]
    for line in lines:
        rc, during, after = line.split(" ", 2)
        assert rc == "0" and int(during.strip("[]")) > 0, line  # groups (and their threads) existed
        assert after == "[]", line  # ... and none is left at exit
