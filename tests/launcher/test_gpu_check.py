"""scripts/gpu_check.sh on CPU: what it would run on one GPU and on two (its dry run), the MFU
line against both peaks (scripts/bench/run_throughput.py), and scripts/env.sh refusing to pip-install
without a network. The kernel and peak-parsing parts are in tests/tools/test_bench_kernels.py."""

import os
import shlex
import subprocess
import sys

import pytest

from megazero.config import config_from_argv
from tests.support.paths import REPO

ROOT = REPO


def _bash(script, env, timeout=120):
    full = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    full.pop("MEGAZERO_VENV", None)  # env.sh then takes this Python, which has the dependencies
    full.update(env)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout
    )


def dry_run(gpus: int, **env) -> list[str]:
    out = _bash("gpu_check.sh", dict(GPU_CHECK_DRY_RUN="1", GPU_CHECK_NGPU=str(gpus), **env))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout.splitlines()


def _layouts(lines):
    """name -> the pretrain_gpt.sh arguments of each multi-GPU layout of a dry run."""
    out, name = {}, None
    for line in lines:
        if line.startswith("== layout "):
            name = line.split()[2].rstrip(":")
        elif name and line.startswith("+ bash scripts/pretrain_gpt.sh "):
            out[name], name = shlex.split(line)[3:], None
    return out


def test_one_gpu_says_what_it_did_not_test():
    lines = dry_run(1)
    assert "== NCCL: skipped, 1 GPU (at world size 1 every collective returns at once: nothing to test)" in lines
    assert not any("NCCL smoke on" in x or x.startswith("== layout") for x in lines)
    assert lines[-2] == (
        "== not tested: NCCL smoke (1 GPU); multi-GPU layouts: pp 2, dp 2 with evaluation, "
        "ZeRO-1 --overlap-param-gather, tp 2 (1 GPU)"
    )
    assert lines[-1] == "== gpu_check dry run: nothing ran"
    throughput = next(x for x in lines if "scripts.bench.run_throughput" in x)
    assert "--measured-peak-tflops <measured>" in throughput and "--gpu-name NVIDIA" in throughput


def test_two_gpus_run_nccl_and_the_four_layouts_and_each_parses():
    lines = dry_run(2, GPU_CHECK_GIB="40")
    assert "== NCCL smoke on 2 ranks" in lines and not any(x.startswith("== not tested") for x in lines)
    layouts = _layouts(lines)
    assert list(layouts) == ["pp2", "dp2-eval", "zero1-overlap-bf16", "tp2-sp"]
    for name, args in layouts.items():
        args = [a for a in args if a != "--run-dir" and not a.startswith("<tmp>")]
        cfg = config_from_argv(args, 2)  # every flag exists and the layout fits 2 ranks
        assert cfg.train.train_iters == 4 and cfg.train.eval_iters >= 1 and cfg.train.eval_interval == 2, name
        p, z = cfg.parallel, cfg.zero
        assert {
            "pp2": p.pp == 2,
            "dp2-eval": p.dp == 2 and cfg.train.eval_iters == 2,
            "zero1-overlap-bf16": p.dp == 2
            and z.stage == 1
            and z.overlap_param_gather == "on"
            and cfg.precision.bf16
            and not cfg.precision.accumulate_allreduce_grads_in_fp32,
            "tp2-sp": p.tp == 2 and p.sequence_parallel,
        }[name], (name, args)
    assert any("--recompute-granularity full" in x for x in lines)  # 40 GiB < 60: the 1.3B run recomputes
    skipped = dry_run(2, GPU_CHECK_LAYOUTS="0", GPU_CHECK_OFFLOAD="0")
    assert (
        skipped[-2] == "== not tested: multi-GPU layouts (GPU_CHECK_LAYOUTS=0); optimizer offload (GPU_CHECK_OFFLOAD=0)"
    )


def test_every_python_module_of_the_plan_exists():
    """Each ``python -m MODULE`` the dry run prints (the benchmarks under scripts/bench/) names a
    module that imports from the repository root, on one GPU and on two."""
    import importlib.util

    for gpus in (1, 2):
        lines = dry_run(gpus, GPU_CHECK_GIB="40")
        modules = {x.split(" -m ", 1)[1].split()[0] for x in lines if " -m scripts." in x}
        assert {"scripts.bench.bench_kernels", "scripts.bench.run_throughput"} <= modules, modules
        assert [m for m in sorted(modules) if importlib.util.find_spec(m) is None] == []


def test_mfu_against_the_measured_and_the_data_sheet_peak():
    from scripts.bench.run_throughput import mfu_both_ways

    line = mfu_both_ways("throughput: ...", 494.5, 650.0, "NVIDIA H100 80GB HBM3", "bf16")
    assert line == (
        "throughput: ...; MFU 76.08% of the measured matmul peak (650.0 TFLOP/s), 50.00% of the "
        "data-sheet peak (989.0 TFLOP/s, NVIDIA H100 80GB HBM3 bf16)"
    )
    assert mfu_both_ways("t", 10.0, None, "Tesla T4", "bf16") == "t; no data-sheet peak for Tesla T4 bf16"
    assert mfu_both_ways("t", 10.0, None, None, "bf16") == "t"


def test_no_pip_install_without_a_network(tmp_path):
    """A missing environment on a machine whose package index is unreachable: one line, exit 2,
    nothing created or installed."""
    venv = tmp_path / "venv"
    no_source = dict(
        PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL=""
    )  # no pip configuration, an index that answers nothing
    out = _bash("env.sh", dict(MEGAZERO_VENV=str(venv), **no_source))
    assert out.returncode == 2 and not venv.exists(), out.stderr
    assert out.stderr.startswith(
        f"megazero: environment error: MEGAZERO_VENV={venv} does not exist and pip has "
        "no package source (no network, no local wheels), so nothing is installed"
    ), out.stderr


@pytest.mark.parametrize("script", ["gpu_check.sh", "env.sh", "pretrain_gpt.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
