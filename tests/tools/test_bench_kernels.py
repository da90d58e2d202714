"""scripts/bench/bench_kernels.py (the kernel part of scripts/gpu_check.sh), on CPU at tiny shapes:
one line per kernel in the documented format, and a fused kernel that disagrees with its
reference is refused before it is timed."""

import argparse
import re

import pytest
import torch

from scripts.bench import bench_kernels as K

PEAK = (
    r"matmul peak fp32: n 64, [\d.]+ ms, [\d.]+ TFLOP/s \(median of 3 after 1 warm-up; best [\d.]+ ms, [\d.]+ TFLOP/s\)"
)
LINE = re.compile(
    r"kernel (\w+) \[[\d, ]+\]( fp32)? (fwd\+bwd|step): reference [\d.]+ ms, "
    r"(torch|apex|sdpa) [\d.]+ ms, speed-up [\d.]+x"
)


def test_report_lines_follow_the_documented_format():
    args = argparse.Namespace(
        device="cpu",
        dtype="fp32",
        matmul=64,
        tokens=32,
        hidden=16,
        heads=2,
        seq=16,
        adam_numel=100,
        iters=1,
        peak_iters=3,
        peak_warmup=1,
        peak_only=False,
    )
    lines = K.run(args)
    assert re.fullmatch(PEAK, lines[0]), lines[0]
    assert [LINE.fullmatch(line).group(1) for line in lines[1:]] == ["layer_norm", "rms_norm", "adam", "attention"], (
        lines
    )


def test_a_wrong_kernel_is_named():
    want = torch.ones(4)
    K.check_close("layer_norm", want.clone(), want)
    with pytest.raises(ValueError, match="kernel layer_norm: fused output differs"):
        K.check_close("layer_norm", want + 0.01, want)


def test_bad_shapes_exit_2(capsys):
    assert K.main(["--device", "cpu", "--tokens", "100", "--seq", "64"]) == 2
    assert "--tokens (100) must be a multiple of --seq (64)" in capsys.readouterr().err


def test_run_throughput_medians_after_the_warm_up(tmp_path, capsys):
    from scripts.bench import run_throughput as R

    recs = [
        {
            "kind": "train",
            "iteration": i,
            "iteration_time_s": t,
            "tokens_per_s": 8192 / t,
            "tflops_per_device": 100.0 * i,
            "mfu": 0.1 * i,
        }
        for i, t in [(1, 9.0), (2, 0.5), (3, 0.25), (4, 0.5), (5, 1.0)]
    ]
    recs.insert(2, {"kind": "valid", "iteration": 2, "loss": 1.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(__import__("json").dumps(r) for r in recs))
    assert R.main([str(tmp_path), "--skip", "1"]) == 0
    # medians of iterations 2-5: time (0.5+0.5)/2, tokens/s (16384+16384)/2, 350, 35 %
    assert capsys.readouterr().out.strip() == (
        "throughput: iterations 2-5 of 5 (median): 500.0 ms/iteration, 16384.0 tokens/s, "
        "350.0 TFLOP/s/device, MFU 35.00%"
    )
    assert R.main([str(tmp_path), "--skip", "5"]) == 2
    assert "5 logged training iterations, none left after --skip 5" in capsys.readouterr().err


def test_the_matmul_peak_is_the_median_not_a_boost_burst(monkeypatch):
    """One fast product among slow ones (a clock boost) does not set the peak: the median of the
    timed products does, 2 n^3 FLOP over it."""
    timings = iter([5.0, 1.0, 5.0, 4.0, 6.0])  # ms of each timed product; 1.0 is the burst
    monkeypatch.setattr(K, "time_ms", lambda *a, **k: next(timings))
    ms, tflops = K.matmul_peak(64, torch.float32, torch.device("cpu"), 5)[:2]
    assert (ms, tflops) == (5.0, 2 * 64**3 / 5e-3 / 1e12)
    assert K.sustained_peak([3.0, 1.0, 2.0, 100.0], 1e12) == (2.5, 1e12 / 2.5e-3 / 1e12)
    with pytest.raises(ValueError, match="needs positive timings"):
        K.sustained_peak([], 1.0)


def test_the_peak_of_real_products_is_their_median_on_cpu():
    n, flop = 32, 2.0 * 32**3
    ms, tflops, best = K.matmul_peak(n, torch.float32, torch.device("cpu"), 7, warmup=1)
    assert best <= ms and tflops == pytest.approx(flop / (ms * 1e-3) / 1e12, rel=1e-12)
