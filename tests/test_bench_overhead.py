"""scripts/bench_overhead.py at tiny shapes: megazero's Trainer and the plain PyTorch loop train
the same model on the same batches, so their losses agree step by step (the comparison the
benchmark's ratio rests on), and the ratio line is printed."""
import re

from scripts import bench_overhead


def test_plain_loop_and_trainer_train_the_same_model(capsys):
    out = bench_overhead.main(["--steps", "3", "--warmup", "1", "--hidden-size", "32", "--num-layers", "2",
                               "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "2",
                               "--vocab-size", "128", "--lr", "1e-3"])
    assert len(out["loss_diffs"]) == 4
    assert max(out["loss_diffs"]) < 1e-6, out["loss_diffs"]
    assert out["ratio"] > 0
    assert re.search(r"ratio megazero / plain: [\d.]+ +\(target <= 1.02\)", capsys.readouterr().out)
