"""scripts/bench/bench_overhead.py at tiny shapes: megazero's Trainer and the plain PyTorch loop train
the same model on the same batches, so their losses agree step by step (the comparison the
benchmark's ratio rests on), and the ratio line is printed."""

import re
import subprocess
import sys

import pytest

from scripts.bench import bench_overhead
from tests.support.paths import REPO


def test_plain_loop_and_trainer_train_the_same_model(capsys):
    out = bench_overhead.main(
        [
            "--steps",
            "3",
            "--warmup",
            "1",
            "--hidden-size",
            "32",
            "--num-layers",
            "2",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "32",
            "--micro-batch-size",
            "2",
            "--vocab-size",
            "128",
            "--lr",
            "1e-3",
            "--allocator",
            "system",
        ]
    )
    assert len(out["loss_diffs"]) == 4
    assert max(out["loss_diffs"]) < 1e-6, out["loss_diffs"]
    assert out["ratio"] > 0
    printed = capsys.readouterr().out
    assert re.search(r"ratio megazero / plain: [\d.]+ +\(target <= 1.02\)", printed)
    assert "allocator: glibc defaults" in printed and out["allocator"] == "glibc defaults"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_sets_glibc_top_pad():
    """--allocator keep (the default) takes effect: glibc accepts M_TOP_PAD (in a child process,
    so this test process keeps its allocator as it was)."""
    code = "from scripts.bench import bench_overhead as b; print(b.keep_freed_memory(), b.TOP_PAD)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=str(REPO))
    assert out.stdout.split() == ["True", str(1 << 30)], out.stdout + out.stderr
