"""scripts/bench/bench_kernels.py (the kernel part of scripts/gpu_check.sh), on CPU at tiny shapes:
one line per kernel in the documented format, and a fused kernel that disagrees with its
reference is refused before it is timed."""

import argparse
import re

import pytest
import torch

from scripts.bench import bench_kernels as K
from tests.support.paths import REPO

LINE = re.compile(
    r"kernel (\w+) \[[\d, ]+\]( fp32)? (fwd\+bwd|step): reference [\d.]+ ms, "
    r"(torch|apex|sdpa) [\d.]+ ms, speed-up [\d.]+x"
)


def test_report_lines_follow_the_documented_format():
    args = argparse.Namespace(
        device="cpu", dtype="fp32", matmul=64, tokens=32, hidden=16, heads=2, seq=16, adam_numel=100, iters=1
    )
    lines = K.run(args)
    assert re.fullmatch(r"matmul peak fp32: n 64, [\d.]+ ms, [\d.]+ TFLOP/s", lines[0]), lines[0]
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


def test_gpu_check_parses_and_reads_the_measured_peak():
    """gpu_check.sh is valid bash, and its sed takes the TFLOP/s figure of bench_kernels' line."""
    import subprocess

    script = REPO / "scripts" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    sed = re.search(r"PEAK=\$\(sed -n '([^']+)'", script.read_text()).group(1)
    args = argparse.Namespace(
        device="cpu", dtype="bf16", matmul=64, tokens=32, hidden=16, heads=2, seq=16, adam_numel=100, iters=1
    )
    line = K.run(args)[0]
    got = subprocess.run(
        ["sed", "-n", sed], input=line + "\n", capture_output=True, text=True, check=True
    ).stdout.strip()
    assert got == line.split(", ")[-1].split()[0] and float(got) >= 0, (line, got)
