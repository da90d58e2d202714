"""The feature sweep of ``scripts/gpu_check.sh``: short runs of a small GPT on the GPU, each
compared with the same run on CPU, in one process through ``megazero.training.build_trainer``.

Each feature of :data:`FEATURES` trains ``BASE`` (2 layers, hidden 64, 4 steps of 2
micro-batches, fp32, mock data) with its flags on both devices and compares the per-step losses:
the largest relative difference must be under the feature's tolerance, 1e-4 in fp32 (CUDA and
CPU kernels sum in other orders; at world size 1 every feature is the plain model's arithmetic),
3e-2 where only the GPU run is bf16 or fp16 (one bf16 rounding is 2^-8 relative). The resume
features train 2 steps on one device, save (``--async-save``), load the checkpoint on the other
device and train 2 more: the 4 losses against the uninterrupted CPU run. ``torch.compile``
(``--compile``) runs on the GPU only, against the eager CPU run. ``dpo`` and ``rm`` train the
post-training modes on 16 preference pairs written with a small tokenizer in a temporary folder.

A feature that raises is recorded as failed with its error, and the next one runs. Results go
to ``OUT/sweep.json`` after every feature and to ``gpu_check key sweep_FEATURE pass|fail`` lines.
``--device cpu`` runs the "GPU" side on CPU as well (how the sweep is tested without a GPU).

    python -m scripts.gpu_sweep --out DIR [--features dense,zero1,...] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
BASE += ["--vocab-size", "256", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4"]
BASE += ["--lr", "1e-3", "--seed", "7", "--mock-data", "--eval-iters", "0", "--log-interval", "1"]
STEPS = 4
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
# name, flags on both devices, flags on the GPU only, relative tolerance; NVME stands for a temporary folder
FEATURES = [
    ("dense", [], [], 1e-4),
    ("zero1", ["--zero-stage", "1"], [], 1e-4),
    ("zero2", ["--zero-stage", "2"], [], 1e-4),
    ("zero3", ["--zero-stage", "3"], [], 1e-4),
    ("offload-cpu", ["--zero-stage", "1", "--offload-optimizer", "cpu"], [], 1e-4),
    ("offload-nvme", ["--zero-stage", "1", "--offload-optimizer", "nvme", "--offload-nvme-path", "NVME"], [], 1e-4),
    ("resume-gpu-to-cpu", [], [], 1e-4),
    ("resume-cpu-to-gpu", [], [], 1e-4),
    ("zero3-offload-param", ["--zero-stage", "3", "--offload-param", "cpu", "--offload-optimizer", "cpu"], [], 1e-4),
    ("moe", ["--num-experts", "4", "--moe-router-topk", "2"], [], 1e-4),
    # no biases: the experts' grouped GEMM, in bf16 on the GPU where its check passes
    ("moe-grouped-bf16", ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"], ["--bf16"], 3e-2),
    ("recompute-full", RECOMPUTE, [], 1e-4),
    ("recompute-selective", ["--recompute-granularity", "selective"], [], 1e-4),
    ("bf16", [], ["--bf16"], 3e-2),
    ("fp16", [], ["--fp16"], 3e-2),
    ("compile", [], ["--compile"], 1e-4),
    # post-training on preference pairs (PAIRS: a tokenizer and pairs made in a temporary folder)
    ("dpo", ["PAIRS", "--post-train", "dpo"], [], 1e-4),
    ("rm", ["PAIRS", "--post-train", "rm"], [], 1e-4),
    # the reference model in pinned host memory, copied in for its pass (storages resized on CUDA)
    ("dpo-ref-offload", ["PAIRS", "--post-train", "dpo"], ["--ref-offload"], 1e-4),
]
PAIRS_BASE = [f for f in BASE if f not in ("--mock-data", "--vocab-size", "256")] + [
    "--make-vocab-size-divisible-by",
    "8",
]


def train(device: str, flags: list[str], steps: int, save: str = "", load: str = "") -> list[float]:
    """Losses of ``steps`` steps of ``BASE + flags`` on ``device``; ``load``: resume from that
    checkpoint first; ``save``: save one after the last step (waiting for an async save)."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    base = PAIRS_BASE if "--data-path" in flags else BASE
    argv = base + flags + ["--device", device] + (["--load", load] if load else [])
    cfg = config_from_argv(argv, 1)
    trainer = build_trainer(cfg, data=training.prepare_run(cfg), device=device)
    if load:
        trainer.load_checkpoint(load)
    losses = [trainer.train_step(trainer.next_batches()).values["loss"] for _ in range(steps)]
    if save:
        trainer.save_checkpoint(save)
        trainer.finish_save()
    trainer.close()
    return losses


def rel_diff(got: list[float], want: list[float]) -> float:
    """Largest ``|got - want| / |want|`` over the steps; inf when the lists differ in length."""
    if len(got) != len(want) or not want:
        return float("inf")
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def make_pairs(tmp: str) -> list[str]:
    """Flags of 16 arithmetic preference pairs written under ``tmp`` (``python -m
    data.preference``) with a byte-level BPE tokenizer of 300 tokens trained there."""
    from data.preference import preprocess_preference
    from data.tokenizer import train_hf_tokenizer

    texts = [f"# {a} + {b} = {a + b}, not {a * b + 5}" for a in range(10) for b in range(10)]
    tok = train_hf_tokenizer(texts, 300, os.path.join(tmp, "tokenizer.json"))
    rows = [{"prompt": f"# {i % 7} + {i % 3} =", "chosen": f" {i % 7 + i % 3}", "rejected": f" {i % 5 + 5} or so"}
            for i in range(16)]  # fmt: skip
    with open(os.path.join(tmp, "pairs.jsonl"), "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    prefix = os.path.join(tmp, "pref")
    preprocess_preference([os.path.join(tmp, "pairs.jsonl")], tok, prefix, tokenizer_type="HuggingFaceTokenizer")
    return ["--data-path", prefix, "--tokenizer-model", tok, "--tokenizer-type", "HuggingFaceTokenizer", "--split", "1"]


def feature_losses(name: str, both: list[str], gpu_only: list[str], device: str, tmp: str) -> tuple[list, list]:
    """(device losses, CPU losses) of one feature (module docstring)."""
    both = [os.path.join(tmp, "nvme") if f == "NVME" else f for f in both]
    if "PAIRS" in both:
        i = both.index("PAIRS")
        both = both[:i] + make_pairs(tmp) + both[i + 1 :]
    if name.startswith("resume-"):
        first, second = (device, "cpu") if name == "resume-gpu-to-cpu" else ("cpu", device)
        ckpt = os.path.join(tmp, name)
        got = train(first, ["--async-save", "--save", ckpt], 2, save=ckpt) + train(second, [], 2, load=ckpt)
        return got, train("cpu", [], STEPS)
    return train(device, both + gpu_only, STEPS), train("cpu", both, STEPS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder of sweep.json")
    ap.add_argument("--features", help="comma-separated subset of: " + ", ".join(f[0] for f in FEATURES))
    ap.add_argument("--device", default="cuda", help="the device compared with CPU (cpu: test the sweep itself)")
    args = ap.parse_args(argv)
    chosen = args.features.split(",") if args.features else [f[0] for f in FEATURES]
    unknown = sorted(set(chosen) - {f[0] for f in FEATURES})
    if unknown:
        print(f"gpu_sweep: --features names unknown features {unknown}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides (megazero's default)
    torch.set_num_threads(1)  # the CPU side's matmuls are tiny: threads only contend
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for name, both, gpu_only, rtol in (f for f in FEATURES if f[0] in chosen):
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"gpu_sweep-{name}-") as tmp:
            try:
                got, want = feature_losses(name, both, gpu_only, args.device, tmp)
                diff = rel_diff(got, want)
                results[name] = dict(ok=diff <= rtol, max_rel_diff=diff, rtol=rtol, device=got, cpu=want)
            except (Exception, SystemExit) as e:  # recorded (a config error exits); the next feature still runs
                results[name] = dict(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
        r = results[name]
        r["wall_s"] = round(time.monotonic() - start, 1)
        detail = (
            f"max relative difference {r['max_rel_diff']:.2e} (tolerance {rtol:g})" if "error" not in r else r["error"]
        )
        print(f"sweep {name}: {'pass' if r['ok'] else 'FAIL'}, {detail}, {r['wall_s']} s", flush=True)
        print(f"gpu_check key sweep_{name.replace('-', '_')} {'pass' if r['ok'] else 'fail'}", flush=True)
        with open(os.path.join(args.out, "sweep.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    failed = [n for n, r in results.items() if not r["ok"]]
    print(
        f"sweep: {len(results) - len(failed)} of {len(results)} features agree" + (f"; failed: {failed}" * bool(failed))
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
