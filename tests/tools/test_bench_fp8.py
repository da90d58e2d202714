"""scripts/bench/bench_fp8.py at tiny shapes on one stdlib package: every run trains, the printed
ratio is FP8's loss over bf16's, FP8 stays within 2 % of bf16 after 4 steps, Muon's model states
are AdamW's less the second moment of the hidden matrices, and ``--check`` (the GPU check's step
``fp8``) prints its key lines and exits 1 when a run misses the tolerance."""

import math
import re

import pytest

from scripts.bench.bench_fp8 import main

H, LAYERS = 32, 2


@pytest.mark.slow
def test_fp8_against_bf16_and_muon_against_adam(capsys):
    argv = ["--steps", "4", "--chunk", "2", "--warmup", "1", "--recipes", "tensorwise,blockwise"]
    argv += ["--hidden-size", str(H), "--num-layers", str(LAYERS), "--heads", "2", "--seq-length", "32"]
    argv += ["--micro-batch-size", "2", "--corpus-package", "email", "--vocab-size", "512"]
    got = main(argv + ["--check", "--tolerance", "1e-6"])  # a tolerance no run meets: the FAIL path
    fp8, out = got["fp8"], capsys.readouterr().out
    names = ["bf16", "fp8 hybrid tensorwise", "fp8 hybrid blockwise 32"]
    assert list(fp8["loss"]) == names
    assert all(math.isfinite(fp8["loss"][n]) and fp8["tokens_per_s"][n] > 0 for n in names)
    for n in names:
        assert fp8["ratio"][n] == fp8["loss"][n] / fp8["loss"]["bf16"]
        row = re.search(rf"^{n} +{fp8['loss'][n]:.4f} +[\d.]+ +{fp8['ratio'][n]:.4f} +[\d.]+ ", out, re.M)
        assert row, out
    worst = max(abs(fp8["ratio"][n] - 1) for n in names[1:])
    assert 0 < worst < 0.02  # FP8 moves the loss, by less than the 2 % bar
    assert not fp8["passed"] and got["status"] == 1
    assert f"FP8 loss within 0.0001 % of bf16 at step 4: FAIL (largest |ratio - 1| {worst:.4f})" in out
    assert "gpu_check key fp8_loss_check fail" in out and "gpu_check key tokens_per_s_bf16 " in out
    adam, muon = got["muon"]["adam"], got["muon"]["muon"]
    assert adam["params"] == muon["params"] and adam["model_state_bytes"] == 16 * adam["params"]  # fp32 AdamW
    hidden = LAYERS * (3 * H * H + H * H + 4 * H * H + 4 * H * H)  # qkv, proj, fc1, fc2 elements
    assert adam["model_state_bytes"] - muon["model_state_bytes"] == 4 * hidden  # no fp32 exp_avg_sq there
    assert all(math.isfinite(r["loss"]) and r["optimizer_s"] > 0 for r in (adam, muon))
