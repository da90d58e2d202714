"""The GPU check's runner (``bash scripts/gpu_check.sh`` calls it): a fixed plan of steps, each a
command run under its own time budget, its output in its own log, a summary after every step.

Made for a GPU machine lent for minutes, where the first run is the only run: a step that fails
or overruns its budget does not stop the others, and everything needed to diagnose afterwards
is in one folder (``--out``, default ``runs/gpu_check-<UTC date-time>``):

- ``<step>.log``: the step's stdout and stderr;
- ``summary.txt`` / ``summary.json``: per step its status (``pass``, ``fail``, ``timeout``,
  ``skip``), wall time, budget, exit code, the key numbers read from its log and, for a step
  that did not pass, its last log line; rewritten after every step, so a run killed from
  outside still leaves the steps it finished;
- what the steps write themselves (profiler traces, ``probes.json``, ``sweep.json``, the
  training runs' ``metrics.jsonl``).

When the environment variable ``OUT`` names a folder (the device machine returns what is
under it), the summaries are copied to ``$OUT/<folder name>/`` and the whole folder packed into
``$OUT/<folder name>.tar.gz`` after every step (:func:`mirror`).

A step's key numbers are the ``gpu_check key NAME VALUE`` lines of its log (the probes print
them), plus what :data:`PATTERNS` reads from the tools' own report lines (pytest's counts,
the matmul peak, the MFU line). The matmul peak of step ``peak`` is what the MFU steps read
from ``summary.json``. Each step's budget is cut to what is left of ``--budget-s`` (default
540 s: one 10-minute command with room for start-up); a step with under 5 s left is skipped.

SIGTERM (a machine's command limit) stops the running step, records it as ``timeout`` and the
rest as not run, and writes the summary before the runner exits. A failed step's note is its
last line naming an error (an exception, ``error:``), else its last line.

The exit status is 0 when no step failed or timed out, 1 otherwise (after running them all),
2 for a bad argument. ``--dry-run`` prints the plan (each step's budget and command, and why a
step would be skipped) and runs nothing; ``--ngpu`` stands for the machine's GPU count there.
``--plan FILE`` replaces the built-in plan by a JSON list of ``{"name", "budget_s", "argv"}``
(how the runner itself is tested on CPU).

    bash scripts/gpu_check.sh [--dry-run] [--out DIR] [--only STEP,...] [--budget-s 540]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

BUDGET_S = 540
KEY_LINE = re.compile(r"^gpu_check key (\w+) (\S+)\s*$")
NUM = r"([0-9.]+)"
PATTERNS = {  # step name prefix -> (key, regex over the log) for tools that do not print key lines
    "peak": [("matmul_sustained_tflops", r"^matmul peak \w+: n \d+, [0-9.]+ ms, " + NUM + " TFLOP/s")],
    "kernels": [("matmul_sustained_tflops", r"^matmul peak \w+: n \d+, [0-9.]+ ms, " + NUM + " TFLOP/s")],
    "cuda-tests": [(k, r"\b(\d+) " + k + r"\b") for k in ("passed", "failed", "skipped", "deselected")]
    + [("errors", r"\b(\d+) errors?\b")],
    "mfu": [
        ("ms_per_iteration", r"^throughput: .*?: " + NUM + " ms/iteration"),
        ("tokens_per_s", r"^throughput: .*?, " + NUM + " tokens/s"),
        ("tflops_per_device", r"^throughput: .*?, " + NUM + " TFLOP/s/device"),
        ("mfu_measured_peak_pct", r"MFU " + NUM + "% of the measured matmul peak"),
        ("mfu_datasheet_peak_pct", NUM + "% of the data-sheet peak"),
    ],
}


@dataclass
class Step:
    """One command of the plan: ``argv`` run under ``budget_s`` seconds; ``min_gpus`` GPUs needed
    (fewer: skipped and said why)."""

    name: str
    budget_s: int
    argv: list[str]
    min_gpus: int = 1
    what: str = ""


@dataclass
class Outcome:
    """A step's record in the summary: status pass / fail / timeout / skip, wall seconds, the
    budget it ran under, its exit code (None when it did not run) and its key numbers."""

    name: str
    status: str
    wall_s: float = 0.0
    budget_s: float = 0.0
    rc: Optional[int] = None
    keys: dict = field(default_factory=dict)
    note: str = ""


def builtin_plan(out: str, py: str) -> list[Step]:
    """The steps in the order they run: what matters most first (the 1.3B MFU runs and the
    CUDA-marked tests), multi-GPU steps where there are GPUs for them, then the probes."""
    probe = [py, "-m", "scripts.gpu_probe"]
    peak = [py, "-m", "scripts.bench.bench_kernels", "--device", "cuda", "--dtype", "bf16"]
    steps = [
        Step("versions", 25, probe + ["versions"], what="torch / CUDA / NCCL / apex versions, the GPUs"),
        Step(
            "peak",
            30,
            peak + ["--peak-only", "--matmul", "8192", "--peak-iters", "20", "--peak-warmup", "5"],
            what="sustained bf16 matmul peak: median of 20 timed 8192^3",
        ),
        Step("mfu-gpt2", 75, probe + ["mfu", "--block", "gpt2", "--out", out], what="1.3B GPT-2 block, bf16"),
        Step("mfu-llama", 75, probe + ["mfu", "--block", "llama", "--out", out], what="1.3B LLaMA-GQA block, bf16"),
        Step(
            "cuda-tests",
            75,
            [py, "-m", "pytest", "-q", "-rfEs", "-m", "cuda", "-p", "no:cacheprovider", "tests/"]
            + ["--junitxml", os.path.join(out, "cuda-tests.xml")],
            what="pytest -m cuda",
        ),
        Step(
            "nccl-smoke",
            45,
            [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            + ["-m", "scripts.gpu_probe", "nccl-smoke"],
            min_gpus=2,
            what="all-reduce, reduce-scatter, all-gather over NCCL",
        ),
    ]
    for name, gpus, flags in LAYOUTS:
        steps.append(
            Step(
                f"layout-{name}",
                60,
                probe + ["layout", "--name", name, "--out", out, "--"] + flags,
                min_gpus=gpus,
                what="losses on the GPUs vs the same layout on CPU ranks",
            )
        )
    steps += [
        Step("probes", 45, probe + ["kernels", "--out", out], what="SDPA backends, grouped GEMM, host syncs"),
        Step(
            "sweep",
            100,
            [py, "-m", "scripts.gpu_sweep", "--out", out],
            what="features on the GPU vs CPU losses",
        ),
        Step("fp8", 40, fp8_argv(py), what="FP8 (hybrid, tensorwise) vs bf16: tokens/s, loss within 2 %"),
        Step("kernels", 30, peak + ["--peak-iters", "5"], what="fused kernels vs their references"),
        Step(
            "offload",
            30,
            [py, "-m", "scripts.bench.bench_offload", "--device", "cuda", "--stage", "2", "--steps", "6", "--bf16"],
            what="ZeRO-2 bf16 with and without --offload-optimizer cpu",
        ),
    ]
    return steps


def fp8_argv(py: str) -> list[str]:
    """Step ``fp8``: ``scripts/bench/bench_fp8.py`` on the GPU, bf16 against ``--fp8-format hybrid
    --fp8-recipe tensorwise``, 30 steps each of a 4-layer GPT (hidden 256, seq 256, micro-batch 8)
    from the same seed on the stdlib's ``email`` package (a 1024-token tokenizer trained in a
    temporary folder in about a second); ``--check``: tokens/s and losses as key lines, exit 1 when
    the FP8 loss after 30 steps is off bf16's by more than 2 %."""
    bench = [py, "-m", "scripts.bench.bench_fp8", "--device", "cuda", "--check", "--tolerance", "0.02"]
    bench += ["--steps", "30", "--chunk", "5", "--warmup", "3", "--fp8-format", "hybrid", "--recipes", "tensorwise"]
    bench += ["--muon", "off", "--hidden-size", "256", "--num-layers", "4", "--heads", "4", "--seq-length", "256"]
    return bench + ["--micro-batch-size", "8", "--corpus-package", "email", "--vocab-size", "1024"]


# the multi-GPU layouts: name, GPUs needed, pretrain_gpt.sh flags beyond the probe's small model
LAYOUTS = [
    ("tp2-sp", 2, ["--tp", "2", "--sequence-parallel"]),
    ("pp2", 2, ["--pp", "2"]),
    ("dp2-zero1-overlap", 2, ["--dp", "2", "--zero-stage", "1", "--overlap-param-gather", "on"]),
    ("cp2", 2, ["--cp", "2"]),
    ("tp2-pp2-dp2", 8, ["--tp", "2", "--pp", "2", "--dp", "2", "--zero-stage", "2"]),
]


def read_keys(name: str, log_text: str) -> dict:
    """The key numbers of a step's log: its ``gpu_check key NAME VALUE`` lines (the last of a
    name wins), and the :data:`PATTERNS` of the step's name prefix (the last match wins)."""
    keys = {}
    for pattern_name, patterns in PATTERNS.items():
        if name == pattern_name or name.startswith(pattern_name + "-"):
            for key, regex in patterns:
                found = re.findall(regex, log_text, flags=re.M)
                if found:
                    keys[key] = _number(found[-1])
    for line in log_text.splitlines():
        m = KEY_LINE.match(line)
        if m:
            keys[m.group(1)] = _number(m.group(2))
    return keys


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def last_line(path: str) -> str:
    """The line that most likely says why a step failed: its last line naming an error (a
    traceback's exception, ``error:``), else its last line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [x.strip() for x in f.read()[-50000:].splitlines() if x.strip()]
    except OSError:
        return ""
    errors = [x for x in lines if re.match(r"^(\w+\.)*\w*(Error|Exception)\b|.*\berror: |^FAILED", x)]
    return (errors or lines or [""])[-1][:300]


OUTSIDE = "the check was terminated from outside (SIGTERM)"


class Terminated(Exception):
    """SIGTERM reached the runner (the machine's command limit): the running step is stopped,
    recorded as timed out, and the summary written before the runner exits."""


_TERM = {"received": False, "in_step": False}


def _terminated(signum, frame):
    _TERM["received"] = True
    if _TERM["in_step"]:  # stop the step; between steps the loop sees the flag
        raise Terminated()


def run_step(step: Step, out: str, budget_s: float) -> Outcome:
    """Run ``step.argv`` in its own process group with stdout and stderr to ``out/<name>.log``;
    past ``budget_s`` the group gets SIGTERM, then SIGKILL 10 s later (status ``timeout``)."""
    log = os.path.join(out, f"{step.name}.log")
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        f.write(f"$ {shlex.join(step.argv)}\n")
        f.flush()
        try:
            proc = subprocess.Popen(step.argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            f.write(f"gpu_check: could not start the step: {e}\n")
            return Outcome(step.name, "fail", time.monotonic() - start, budget_s, None, {}, str(e))
        outside = False
        try:
            rc, status = proc.wait(timeout=budget_s), None
        except subprocess.TimeoutExpired:
            rc, status = _stop(proc), "timeout"
            f.write(f"\ngpu_check: step {step.name} stopped after its budget of {budget_s:.0f} s\n")
        except Terminated:
            rc, status, outside = _stop(proc), "timeout", True
            f.write(f"\ngpu_check: the check was terminated from outside during step {step.name}\n")
        wall = time.monotonic() - start
    status = status or ("pass" if rc == 0 else "fail")
    with open(log, encoding="utf-8", errors="replace") as f:
        keys = read_keys(step.name, f.read())
    note = OUTSIDE if outside else "" if status == "pass" else last_line(log)
    return Outcome(step.name, status, wall, budget_s, rc, keys, note)


def _stop(proc: subprocess.Popen) -> int:
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return -9


def write_summary(out: str, outcomes: list[Outcome], header: dict) -> int:
    """Write ``summary.json`` and ``summary.txt`` of ``outcomes`` under ``out``; returns the
    exit status the run ends with: 1 when a step failed or timed out, else 0."""
    bad = [o for o in outcomes if o.status in ("fail", "timeout")]
    result = f"FAIL ({len(bad)} of {len(outcomes)} steps: " + ", ".join(f"{o.name} {o.status}" for o in bad) + ")"
    result = result if bad else "PASS"
    record = dict(header, result=result, steps=[vars(o) for o in outcomes])
    with open(os.path.join(out, "summary.json.tmp"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(os.path.join(out, "summary.json.tmp"), os.path.join(out, "summary.json"))
    lines = [" ".join(f"{k} {v}" for k, v in header.items())]
    lines.append(f"{'step':<24} {'status':<8} {'wall_s':>7} {'budget_s':>8}  key numbers / last line")
    for o in outcomes:
        keys = " ".join(f"{k}={v}" for k, v in o.keys.items())
        lines.append(f"{o.name:<24} {o.status:<8} {o.wall_s:>7.1f} {o.budget_s:>8.0f}  {keys}")
        if o.note:
            lines.append(f"{'':<24} {o.note}")
    lines.append(f"result: {result}")
    with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return 1 if bad else 0


MIRROR_FILE_CAP = 8 << 20  # bytes: a larger file (a long profiler trace) stays out of the archive


def mirror(out: str) -> None:
    """Return ``out`` through ``$OUT``: ``$OUT/<basename>/summary.txt`` and ``summary.json`` as
    they are, and everything in ``out`` as ``$OUT/<basename>.tar.gz`` (files over
    :data:`MIRROR_FILE_CAP` left out and named in ``left_out.txt`` beside the summaries).

    One archive instead of a copy of the folder, because a lending machine returns only a few
    files (the workplace's device tool: 8 files, 16 MiB each, 2 folders deep)."""
    import tarfile

    dest_root = os.environ.get("OUT")
    if not dest_root:
        return
    name = os.path.basename(os.path.abspath(out))
    dest = os.path.join(dest_root, name)
    here, there = os.path.realpath(out), os.path.realpath(dest_root)
    if os.path.commonpath([here, there]) in (here, there):  # --out under $OUT already, or $OUT itself
        return
    os.makedirs(dest, exist_ok=True)
    for summary in ("summary.txt", "summary.json"):
        if os.path.exists(os.path.join(out, summary)):
            shutil.copy2(os.path.join(out, summary), os.path.join(dest, summary))
    left_out = []
    tmp = os.path.join(dest_root, f".{name}.tar.gz.part")
    with tarfile.open(tmp, "w:gz") as tar:
        for folder, _, files in os.walk(out):
            for f in sorted(files):
                path = os.path.join(folder, f)
                rel = os.path.join(name, os.path.relpath(path, out))
                if os.path.getsize(path) > MIRROR_FILE_CAP:
                    left_out.append(f"{rel} ({os.path.getsize(path)} bytes)")
                else:
                    tar.add(path, arcname=rel)
    os.replace(tmp, os.path.join(dest_root, name + ".tar.gz"))
    if left_out:
        with open(os.path.join(dest, "left_out.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(left_out) + "\n")


def skip_reason(step: Step, gpus: Optional[int], left_s: float) -> str:
    if gpus is not None and gpus < step.min_gpus:
        return f"needs {step.min_gpus} GPUs, the machine has {gpus}"
    if gpus is None and step.min_gpus > 1:
        return "GPU count unknown (the versions step did not report it)"
    if left_s < 5:
        return f"out of the total budget ({left_s:.0f} s left)"
    return ""


def print_plan(steps: list[Step], gpus: int, out: str, budget_s: float) -> None:
    print(f"gpu_check plan: {gpus} GPU(s), total budget {budget_s:.0f} s, output {out}")
    planned = 0
    for i, step in enumerate(steps, 1):
        why = skip_reason(step, gpus, budget_s - planned)
        if why:
            print(f"{i:>2}. {step.name:<24} skip: {why}")
            continue
        budget = min(step.budget_s, budget_s - planned)
        planned += budget
        print(f"{i:>2}. {step.name:<24} {budget:>4.0f} s  {step.what}")
        print(f"    + {shlex.join(step.argv)}")
    print(f"step budgets: {planned:.0f} s of {budget_s:.0f} s")
    print("== gpu_check dry run: nothing ran")


def load_plan(path: str) -> list[Step]:
    with open(path, encoding="utf-8") as f:
        return [Step(s["name"], s["budget_s"], list(s["argv"]), s.get("min_gpus", 1)) for s in json.load(f)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run nothing, touch no GPU")
    ap.add_argument("--out", help="output folder (default runs/gpu_check-<UTC date-time>)")
    ap.add_argument("--only", help="comma-separated step names to run (the rest are skipped)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all steps together")
    ap.add_argument("--ngpu", type=int, help="GPUs of the machine (dry run; default: what the versions step finds)")
    ap.add_argument("--plan", help="JSON list of steps replacing the built-in plan (testing)")
    args = ap.parse_args(argv)
    out = args.out or os.path.join("runs", "gpu_check-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    try:
        steps = load_plan(args.plan) if args.plan else builtin_plan(out, sys.executable)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"gpu_check: --plan {args.plan}: not a JSON list of name/budget_s/argv steps ({e})", file=sys.stderr)
        return 2
    only = set(args.only.split(",")) if args.only else None
    if only and only - {s.name for s in steps}:
        known = ", ".join(s.name for s in steps)
        unknown = sorted(only - {s.name for s in steps})
        print(f"gpu_check: --only names unknown steps {unknown}; the steps: {known}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_plan([s for s in steps if not only or s.name in only], args.ngpu or 1, out, args.budget_s)
        return 0
    return run_plan(steps, out, args.budget_s, only, args.ngpu)


def run_plan(steps: list[Step], out: str, budget_s: float, only: Optional[set], gpus: Optional[int]) -> int:
    """Run every step (module docstring); returns the exit status."""
    os.makedirs(out, exist_ok=True)
    start = time.monotonic()
    header = {"gpu_check": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "out": out, "budget_s": budget_s}
    outcomes: list[Outcome] = []
    status = 0
    signal.signal(signal.SIGTERM, _terminated)
    for step in steps:
        if _TERM["received"]:
            outcomes.append(Outcome(step.name, "skip", note="not run: " + OUTSIDE))
            status = write_summary(out, outcomes, header)
            continue
        left = budget_s - (time.monotonic() - start)
        why = "not in --only" if only and step.name not in only else skip_reason(step, gpus, left)
        if why:
            outcome = Outcome(step.name, "skip", note=why)
        else:
            print(
                f"== {step.name} ({min(step.budget_s, left):.0f} s): {step.what or shlex.join(step.argv)}", flush=True
            )
            _TERM["in_step"] = True
            try:
                outcome = run_step(step, out, min(step.budget_s, left))
            finally:
                _TERM["in_step"] = False
            if step.name == "versions" and gpus is None:
                gpus = outcome.keys.get("gpus")
        outcomes.append(outcome)
        print(f"   {outcome.status} {outcome.wall_s:.1f} s {outcome.keys or ''} {outcome.note}".rstrip(), flush=True)
        header["gpus"] = gpus
        header["wall_s"] = round(time.monotonic() - start, 1)
        status = write_summary(out, outcomes, header)
        mirror(out)
    with open(os.path.join(out, "summary.txt"), encoding="utf-8") as f:
        print(f.read(), end="")
    return status


if __name__ == "__main__":
    sys.exit(main())
