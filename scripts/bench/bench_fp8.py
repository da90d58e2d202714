"""FP8 GEMMs against bf16, and Muon against AdamW: the loss after ``--steps`` steps on the embedded
corpus from the same seed, with step times measured in interleaved rounds.

The FP8 part trains one small GPT three (or more) times, in bf16 and with ``--fp8-format
FORMAT --fp8-recipe R`` for each recipe of ``--recipes`` (docs/precision.md): the same
weights (``--seed``), the same batches in the same order, the same learning-rate schedule. Printed
per run: the loss at the last step, the mean of the last 10 losses, the last loss over bf16's
(the bar: within ``--tolerance``, 2 %), the median step time and tokens/s. The runs take
turns in rounds of ``--chunk`` steps each, the order rotated every round, so that machine noise
hits every run alike; the spread is the lowest and highest per-round median. The FP8 GEMMs are
emulated (quantise, then exact sums in fp64; megazero/ops/fp8.py) on every device, and bf16
matmuls are slow on many CPUs: the times say what the emulation costs against that bf16, not what
FP8 kernels would gain.

The Muon part (``--muon on``) trains the same model in fp32 with ``--optimizer adam`` and with
``--optimizer muon --muon-adjust-lr match_rms_adamw`` (so one ``--lr`` suits both; Moonshot,
arXiv 2502.16982), interleaved the same way: the last loss, the optimizer step's median time
(``DistributedOptimizer.step``, Newton-Schulz included) and the model-state bytes
(``model_state_bytes()["total"]``: Muon keeps no second moment for the hidden matrices).

Data: the embedded default corpus that ``bash scripts/pretrain_gpt.sh`` trains on, prepared once
under ``--data-dir`` (``data.prepare``; default ``$MEGAZERO_DATA_DIR`` or ``<repo>/.cache/data``,
as the launcher). ``--corpus-package NAME`` takes one standard-library package instead (with a
smaller ``--vocab-size``, e.g. ``email`` and 1024: prepared in about a second, in a temporary folder
unless ``--data-dir`` is given), as the GPU check and the test do. ``--check`` prints ``gpu_check
key`` lines and exits 1 when an FP8 run misses the tolerance (``scripts/gpu_check.py``'s step
``fp8``).

    python -m scripts.bench.bench_fp8 [--steps 200] [--chunk 20] [--recipes tensorwise,blockwise] \\
        [--fp8-format hybrid] [--muon on] [--device cpu] [--data-dir DIR] [--corpus-package NAME]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from data.corpus import stdlib_root
from data.indexed_dataset import DataError
from data.prepare import prepare
from megazero.config import ConfigError
from megazero.training import build_trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Run:
    """One trainer stepping through its own copy of the run's batch sequence; records every
    step's loss and wall time, and the optimizer step's time."""

    def __init__(self, name: str, argv: list[str], device: str):
        self.name = name
        self.trainer = build_trainer(argv, 1, device=device)
        cfg = self.trainer.cfg
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.optimizer_s: list[float] = []
        opt = self.trainer.optimizer
        inner = opt.step

        def timed_step(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.optimizer_s.append(time.perf_counter() - t0)
            return out

        opt.step = timed_step  # this instance only: the optimizer's own time inside the step

    def step(self) -> None:
        """One training step on the next global batch (the loss is a host float: the step has
        finished on the device when it returns)."""
        batches = self.trainer.next_batches()
        t0 = time.perf_counter()
        out = self.trainer.train_step(batches).values
        self.step_s.append(time.perf_counter() - t0)
        self.losses.append(float(out["loss"]))


def interleave(runs: list[Run], steps: int, chunk: int) -> list[list[int]]:
    """Train every run ``steps`` steps, in rounds of ``chunk`` steps each, the order rotated by one
    every round. Returns per round the indices (into each run's ``step_s``) of its steps."""
    rounds, done = [], 0
    while done < steps:
        n = min(chunk, steps - done)
        r = len(rounds)
        for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
            for _ in range(n):
                run.step()
        rounds.append(list(range(done, done + n)))
        done += n
    return rounds


def timing(run: Run, rounds: list[list[int]], warmup: int, times=None) -> tuple[float, float, float]:
    """(median, lowest and highest per-round median) of ``times`` (default the step times) in
    seconds, leaving out the first ``warmup`` steps."""
    times = run.step_s if times is None else times
    per_round = [[times[i] for i in r if i >= warmup] for r in rounds]
    per_round = [x for x in per_round if x]
    medians = [statistics.median(x) for x in per_round]
    return statistics.median([t for x in per_round for t in x]), min(medians), max(medians)


def corpus_flags(a: argparse.Namespace, tmp: str) -> tuple[list[str], str]:
    """(data flags, a description) of the prepared corpus (module docstring); a
    ``--corpus-package`` without ``--data-dir`` is prepared under ``tmp``."""
    root = os.path.join(stdlib_root(), a.corpus_package) if a.corpus_package else None
    if root is not None and not os.path.isdir(root):
        print(
            f"bench_fp8: --corpus-package {a.corpus_package}: no such folder {root}; fix: name a "
            "standard-library package (e.g. email) or leave the flag out",
            file=sys.stderr,
        )
        raise SystemExit(2)
    launcher_dir = os.environ.get("MEGAZERO_DATA_DIR") or os.path.join(REPO, ".cache", "data")
    data_dir = a.data_dir or (tmp if root else launcher_dir)
    got = prepare(data_dir, a.vocab_size, 2, root, 300 if root else 100, log=lambda m: None)
    what = f"stdlib package {a.corpus_package}" if root else f"the embedded stdlib corpus under {data_dir}"
    return ["--data-path", got["data_path"], "--tokenizer-model", got["tokenizer_model"], "--split", "1"], what


def model_flags(a: argparse.Namespace, steps: int) -> list[str]:
    """train.py flags shared by every run."""
    size = ["--hidden-size", a.hidden_size, "--num-layers", a.num_layers, "--num-attention-heads", a.heads]
    size += ["--seq-length", a.seq_length, "--micro-batch-size", a.micro_batch_size, "--train-iters", steps]
    sched = ["--lr", a.lr, "--min-lr", a.lr / 10, "--lr-warmup-iters", max(1, steps // 10)]
    sched += ["--lr-decay-style", "cosine", "--clip-grad", "1.0", "--seed", a.seed]
    return [str(x) for x in size + sched] + ["--eval-iters", "0", "--device", a.device]


def fp8_runs(a: argparse.Namespace, base: list[str]) -> list[Run]:
    """bf16, then one FP8 run per recipe."""
    runs = [Run("bf16", base + ["--bf16"], a.device)]
    for recipe in a.recipes.split(","):
        flags = ["--bf16", "--fp8-format", a.fp8_format, "--fp8-recipe", recipe]
        name = f"fp8 {a.fp8_format} {recipe}"
        if recipe == "blockwise":
            flags += ["--fp8-block", str(a.fp8_block)]
            name += f" {a.fp8_block}"
        runs.append(Run(name, base + flags, a.device))
    return runs


def report_fp8(runs: list[Run], rounds, a: argparse.Namespace) -> dict:
    """Print the FP8 table and verdict; returns its numbers."""
    ref = runs[0].losses[-1]
    print(f"{'run':<24} {'loss@' + str(a.steps):>9} {'last-10 mean':>12} {'/ bf16':>7} {'ms/step':>8} "
          f"{'round min-max':>15} {'tokens/s':>9}")  # fmt: skip
    out = {"loss": {}, "ratio": {}, "tokens_per_s": {}}
    for run in runs:
        med, lo, hi = timing(run, rounds, a.warmup)
        last, mean10 = run.losses[-1], statistics.fmean(run.losses[-10:])
        ratio, tps = last / ref, run.tokens_per_step / med
        out["loss"][run.name], out["ratio"][run.name], out["tokens_per_s"][run.name] = last, ratio, tps
        print(f"{run.name:<24} {last:>9.4f} {mean10:>12.4f} {ratio:>7.4f} {med * 1e3:>8.1f} "
              f"{lo * 1e3:>7.1f}-{hi * 1e3:<7.1f} {tps:>9.0f}")  # fmt: skip
    worst = max((abs(r - 1) for name, r in out["ratio"].items() if name != "bf16"), default=0.0)
    out["passed"] = worst <= a.tolerance
    verdict = "PASS" if out["passed"] else "FAIL"
    tol = f"{a.tolerance * 100:g} %"
    print(f"FP8 loss within {tol} of bf16 at step {a.steps}: {verdict} (largest |ratio - 1| {worst:.4f})")
    if a.device == "cpu":
        print(
            f"{a.device} numbers: the FP8 GEMMs are emulated (quantise, exact fp64 sums), "
            "not FP8 kernels: not a measure of FP8's speed"
        )
    return out


def report_muon(runs: list[Run], rounds, a: argparse.Namespace) -> dict:
    """Print the AdamW / Muon table; returns its numbers."""
    print(f"{'optimizer (fp32)':<24} {'loss@' + str(a.steps):>9} {'last-10 mean':>12} {'opt ms':>7} "
          f"{'round min-max':>15} {'model-state bytes':>18} {'B/param':>8}")  # fmt: skip
    out = {}
    for run in runs:
        med, lo, hi = timing(run, rounds, a.warmup, run.optimizer_s)
        states = run.trainer.optimizer.model_state_bytes()["total"]
        params = sum(p.numel() for c in run.trainer.chunks for p in c.parameters())
        out[run.name] = {"loss": run.losses[-1], "optimizer_s": med, "model_state_bytes": states, "params": params}
        print(f"{run.name:<24} {run.losses[-1]:>9.4f} {statistics.fmean(run.losses[-10:]):>12.4f} "
              f"{med * 1e3:>7.2f} {lo * 1e3:>7.2f}-{hi * 1e3:<7.2f} {states:>18,} {states / params:>8.2f}")  # fmt: skip
    return out


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps of every run")
    ap.add_argument("--chunk", type=int, default=20, help="steps of each run per interleaved round")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the times")
    ap.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default="hybrid")
    ap.add_argument("--recipes", default="tensorwise,blockwise", help="comma-separated --fp8-recipe values")
    ap.add_argument("--fp8-block", type=int, default=32, help="--fp8-block of the blockwise run")
    ap.add_argument("--muon", choices=("on", "off"), default="on", help="also AdamW against Muon (fp32)")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4, help="--num-attention-heads")
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine to lr / 10)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--data-dir",
        help="where the corpus is or is prepared (default: $MEGAZERO_DATA_DIR or <repo>/.cache/data; "
        "with --corpus-package a temporary folder)",
    )
    ap.add_argument("--corpus-package", help="one stdlib package as the corpus (e.g. email)")
    ap.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary of --data-dir")
    ap.add_argument("--tolerance", type=float, default=0.02, help="largest |FP8 loss / bf16 loss - 1|")
    ap.add_argument("--check", action="store_true", help="gpu_check key lines; exit 1 on FAIL")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    """Run the benchmark (``argv``: flags, default ``sys.argv[1:]``); prints the tables and returns
    ``{"fp8": {"loss", "ratio", "tokens_per_s": per run name, "passed"}, "muon": {run name:
    {"loss", "optimizer_s", "model_state_bytes", "params"}}, "status": the exit status}`` (``muon`` empty
    with ``--muon off``; ``status`` 1 only with ``--check`` and an FP8 run off by more than
    ``--tolerance``)."""
    a = parse(argv)
    with tempfile.TemporaryDirectory(prefix="bench_fp8-") as tmp:
        data, what = corpus_flags(a, tmp)
        return run_all(a, data, what)


def run_all(a: argparse.Namespace, data: list[str], what: str) -> dict:
    """``main``'s runs and report on the prepared corpus ``data`` (its flags)."""
    base = data + model_flags(a, a.steps)
    runs = fp8_runs(a, base)
    print(
        f"GPT {a.num_layers} layers, hidden {a.hidden_size}, {a.heads} heads, seq {a.seq_length}, micro-batch "
        f"{a.micro_batch_size}, vocab {runs[0].trainer.data.vocab_size}; {what}; {a.steps} steps from seed {a.seed}, "
        f"same batches; rounds of {a.chunk} steps, order rotated; device {a.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    rounds = interleave(runs, a.steps, a.chunk)
    result = {"fp8": report_fp8(runs, rounds, a), "muon": {}, "status": 0}
    if a.muon == "on":
        opt = [Run("adam", base, a.device)]
        opt.append(Run("muon", base + ["--optimizer", "muon", "--muon-adjust-lr", "match_rms_adamw"], a.device))
        result["muon"] = report_muon(opt, interleave(opt, a.steps, a.chunk), a)
    if a.check:
        fp8 = result["fp8"]
        for name in fp8["ratio"]:
            key = name.replace(" ", "_")
            print(f"gpu_check key tokens_per_s_{key} {fp8['tokens_per_s'][name]:.0f}")
            print(f"gpu_check key loss_{key} {fp8['loss'][name]:.4f}")
        worst = max(fp8["ratio"].values(), key=lambda r: abs(r - 1))
        print(f"gpu_check key fp8_loss_ratio {worst:.4f}")
        print(f"gpu_check key fp8_tolerance {a.tolerance:g}")
        print(f"gpu_check key fp8_loss_check {'pass' if fp8['passed'] else 'fail'}")
        result["status"] = 0 if fp8["passed"] else 1
    return result


if __name__ == "__main__":
    try:
        sys.exit(main()["status"])
    except (ConfigError, DataError) as e:  # a bad flag of a run, an unusable corpus: one line
        print(f"bench_fp8: {e}", file=sys.stderr)
        sys.exit(2)
