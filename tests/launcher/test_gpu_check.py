"""scripts/gpu_check.sh on CPU: its plan on one GPU, two and eight (the dry run), the runner going
on past a failing and a timed-out step and summarising all of them, the feature sweep with CPU
standing for the GPU, the MFU line against both peaks (scripts/bench/run_throughput.py), and
scripts/env.sh refusing to pip-install without a network. The kernel and sustained-peak parts
are in tests/tools/test_bench_kernels.py."""

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time

import pytest

from megazero.config import config_from_argv
from tests.support.paths import REPO

ROOT = REPO


def _bash(script, env, timeout=120, args=()):
    full = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    full.pop("MEGAZERO_VENV", None)  # env.sh then takes this Python, which has the dependencies
    full.update(env)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dry_run(gpus: int, *args, **env) -> list[str]:
    out = _bash("gpu_check.sh", dict(GPU_CHECK_DRY_RUN="1", GPU_CHECK_NGPU=str(gpus), **env), args=list(args))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout.splitlines()


def _plan(lines):
    """name -> (budget seconds or 'skip: why', the command's words) of each step of a dry run."""
    steps, name = {}, None
    for line in lines:
        m = re.match(r" ?\d+\. (\S+) +(?:(\d+) s  .*|(skip: .*))$", line)
        if m:
            name = m.group(1)
            steps[name] = (int(m.group(2)) if m.group(2) else m.group(3), None)
        elif line.startswith("    + ") and name:
            steps[name] = (steps[name][0], shlex.split(line[6:]))
    return steps


def test_the_plan_of_one_gpu_runs_mfu_and_cuda_tests_first_within_nine_minutes():
    lines = dry_run(1, "--out", "o")  # GPU_CHECK_DRY_RUN=1, an alias of --dry-run
    assert lines == dry_run(1, "--dry-run", "--out", "o") and lines[-1] == "== gpu_check dry run: nothing ran"
    assert lines[0] == "gpu_check plan: 1 GPU(s), total budget 540 s, output o"
    steps = _plan(lines)
    assert list(steps)[:5] == ["versions", "peak", "mfu-gpt2", "mfu-llama", "cuda-tests"], list(steps)
    run = {n: b for n, (b, _) in steps.items() if isinstance(b, int)}
    assert set(run) == {"versions", "peak", "mfu-gpt2", "mfu-llama", "cuda-tests", "probes", "sweep"} | {
        "fp8",
        "kernels",
        "offload",
    }
    assert sum(run.values()) <= 540 and lines[-2] == f"step budgets: {sum(run.values())} s of 540 s"
    assert steps["nccl-smoke"][0] == "skip: needs 2 GPUs, the machine has 1"
    assert steps["layout-tp2-pp2-dp2"][0] == "skip: needs 8 GPUs, the machine has 1"
    peak = " ".join(steps["peak"][1])  # the sustained peak: the median of 20 timed 8192^3 after warm-up
    assert "-m scripts.bench.bench_kernels --device cuda --dtype bf16 --peak-only --matmul 8192 --peak-iters 20" in peak
    assert steps["mfu-llama"][1][-4:-2] == ["--block", "llama"]
    fp8 = " ".join(steps["fp8"][1])  # bf16 against hybrid tensorwise, 30 steps on CUDA, pass/fail at 2 %
    assert "-m scripts.bench.bench_fp8 --device cuda --check --tolerance 0.02 --steps 30" in fp8
    assert "--fp8-format hybrid --recipes tensorwise --muon off" in fp8


def test_two_gpus_add_nccl_and_the_layouts_whose_flags_parse():
    steps = _plan(dry_run(2, "--budget-s", "2000"))
    layouts = {
        n[7:]: argv[argv.index("--") + 1 :] for n, (b, argv) in steps.items() if n.startswith("layout-") and argv
    }
    assert list(layouts) == ["tp2-sp", "pp2", "dp2-zero1-overlap", "cp2"], steps
    for name, flags in layouts.items():
        p = config_from_argv(["--mock-data"] + flags, 2).parallel  # every flag exists, the layout fits 2 ranks
        assert {"tp2-sp": p.tp == 2 and p.sequence_parallel, "pp2": p.pp == 2, "cp2": p.cp == 2}.get(name, p.dp == 2), (
            name
        )
    assert isinstance(steps["nccl-smoke"][0], int)
    tight = _plan(dry_run(2, "--budget-s", "300"))  # the last steps give way when the budget is short
    assert tight["offload"][0].startswith("skip: out of the total budget"), tight["offload"]


def test_every_python_module_of_the_plan_exists():
    import importlib.util

    lines = dry_run(8, "--budget-s", "5000")
    words = [w for _, (_, w) in _plan(lines).items() if w]
    modules = {w[i + 1] for w in words for i, x in enumerate(w) if x == "-m" and w[i - 1] != "-rfEs"}  # not a marker
    assert {"scripts.gpu_probe", "scripts.gpu_sweep", "scripts.bench.bench_kernels", "pytest"} <= modules
    assert [m for m in sorted(modules) if importlib.util.find_spec(m) is None] == []


def test_a_failing_a_timed_out_and_a_passing_step_all_run_and_are_summarised(tmp_path):
    """Every step runs whatever the one before did; summary.txt/json hold each status, wall time
    and key numbers (a ``gpu_check key`` line, bench_kernels' sustained peak), a failed step its
    last line; the exit status is 1; the folder is mirrored to $OUT."""
    py = sys.executable
    plan = [
        dict(name="broken", budget_s=30, argv=[py, "-c", "print('gpu_check key seen 3'); raise SystemExit('boom')"]),
        dict(name="slow", budget_s=2, argv=[py, "-c", "import time; print('started', flush=True); time.sleep(60)"]),
        dict(
            name="peak",
            budget_s=60,
            argv=[py, "-m", "scripts.bench.bench_kernels", "--device", "cpu", "--peak-only", "--matmul", "32"]
            + ["--peak-iters", "3", "--dtype", "fp32"],
        ),
        dict(name="wide", budget_s=30, argv=[py, "-c", "pass"], min_gpus=2),
    ]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out, mirror = tmp_path / "check", tmp_path / "returned"
    mirror.mkdir()
    args = ["--plan", str(tmp_path / "plan.json"), "--out", str(out), "--ngpu", "1"]
    t0 = time.monotonic()
    res = _bash("gpu_check.sh", dict(OUT=str(mirror)), args=args)
    assert res.returncode == 1, res.stdout + res.stderr
    assert time.monotonic() - t0 < 50  # the sleeping step was stopped at its 2 s budget
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert [(n, s["status"]) for n, s in steps.items()] == [
        ("broken", "fail"),
        ("slow", "timeout"),
        ("peak", "pass"),
        ("wide", "skip"),
    ]
    assert steps["broken"]["keys"] == {"seen": 3} and steps["broken"]["note"] == "boom" and steps["broken"]["rc"] == 1
    assert 2 <= steps["slow"]["wall_s"] < 40 and "started" in (out / "slow.log").read_text()
    peak_line = (out / "peak.log").read_text().splitlines()[1]
    assert steps["peak"]["keys"] == {"matmul_sustained_tflops": float(peak_line.split(", ")[2].split()[0])}
    assert steps["wide"]["note"] == "needs 2 GPUs, the machine has 1"
    assert summary["result"] == "FAIL (2 of 4 steps: broken fail, slow timeout)"
    text = (out / "summary.txt").read_text()
    assert text.splitlines()[-1] == "result: FAIL (2 of 4 steps: broken fail, slow timeout)"
    assert re.search(r"^slow +timeout +[\d.]+ +2 ", text, re.M) and "\n" + " " * 25 + "boom\n" in text, text
    assert (mirror / "check" / "summary.json").read_text() == (out / "summary.json").read_text()
    with tarfile.open(mirror / "check.tar.gz") as tar:
        assert tar.extractfile("check/broken.log").read() == (out / "broken.log").read_bytes()
        assert sorted(tar.getnames()) == sorted("check/" + p.name for p in out.iterdir())


def test_a_check_terminated_from_outside_still_leaves_its_summary(tmp_path):
    """SIGTERM (a machine's command limit) during a step: the step's process group is stopped
    and recorded, the steps after it are marked as not run, the error line of the failed step
    before it is kept, and the exit status is 1."""
    py = sys.executable
    fails = "import sys; print('Traceback'); print('RuntimeError: CUDA out of memory'); print('after'); sys.exit(3)"
    plan = [
        dict(name="oom", budget_s=30, argv=[py, "-c", fails]),
        dict(name="long", budget_s=120, argv=[py, "-c", "import time; time.sleep(100)"]),
        dict(name="later", budget_s=30, argv=[py, "-c", "pass"]),
    ]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "check"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--plan", str(tmp_path / "plan.json"), "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (out / "long.log").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    proc.terminate()  # gpu_check.sh execs the runner: this is its SIGTERM
    assert proc.wait(timeout=60) == 1
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert [(s["name"], s["status"], s["note"]) for s in steps] == [
        ("oom", "fail", "RuntimeError: CUDA out of memory"),
        ("long", "timeout", "the check was terminated from outside (SIGTERM)"),
        ("later", "skip", "not run: the check was terminated from outside (SIGTERM)"),
    ]
    assert steps[1]["wall_s"] < 50


def test_a_bad_plan_or_step_name_exits_2(tmp_path):
    (tmp_path / "plan.json").write_text("{not json")
    res = _bash("gpu_check.sh", {}, args=["--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "o")])
    assert res.returncode == 2 and res.stderr.startswith(f"gpu_check: --plan {tmp_path / 'plan.json'}: not a JSON")
    res = _bash("gpu_check.sh", {}, args=["--dry-run", "--only", "mfu"])
    assert res.returncode == 2 and "--only names unknown steps ['mfu']" in res.stderr


def test_the_sweep_compares_runs_and_resumes_across_devices_on_cpu(tmp_path):
    """The sweep's machinery with CPU standing for the GPU: a plain run and a checkpoint saved
    in the background by one run and resumed by another agree with the uninterrupted run."""
    res = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_sweep", "--device", "cpu", "--out", str(tmp_path)]
        + ["--features", "dense,resume-gpu-to-cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads((tmp_path / "sweep.json").read_text())
    assert list(got) == ["dense", "resume-gpu-to-cpu"] and all(r["ok"] and r["max_rel_diff"] == 0 for r in got.values())
    assert len(got["resume-gpu-to-cpu"]["device"]) == 4 and "gpu_check key sweep_dense pass" in res.stdout


def test_the_attention_and_grouped_gemm_probes_on_cpu(tmp_path):
    """The kernel probes with CPU standing for the GPU: each of the 8 attention cases is read off
    the profiler as CPU's flash kernel, and the grouped GEMM equals the per-expert loop."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.gpu_probe",
            "kernels",
            "--device",
            "cpu",
            "--seq",
            "32",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads((tmp_path / "probes.json").read_text())
    cases = [f"{d}-{g}-{m}" for d in ("bfloat16", "float32") for g in ("mha", "gqa") for m in ("causal", "docs")]
    assert [(c["case"], c["backend"]) for c in got["sdpa"]] == [(c, "flash") for c in cases]
    assert got["grouped_mm"] == {"uneven": "equal", "empty-expert": "equal"} and got["failures"] == []
    assert "gpu_check key sdpa_float32_gqa_docs flash" in res.stdout.splitlines()


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
