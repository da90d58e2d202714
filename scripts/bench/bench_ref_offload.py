"""DPO with the reference model kept in host memory (``--ref-offload``) against it kept on the
device: step time, the reference's device and host bytes, and the memory plan's count.

One process (dp 1) trains ``--post-train dpo`` on the pairs ``--data-path`` (``python -m
data.preference``'s, e.g. those ``bash scripts/post_train_demo.sh`` writes under
``.cache/data/post_train/pref``) in interleaved rounds: each round builds the trainer once per
variant (the order alternating between rounds), runs one warm-up step and ``--steps`` timed
steps, and closes it. Prints per variant the median step time over all rounds with the spread of
the rounds' medians (min..max), their ratio (offload / on device), the bytes the reference's
parameter storages hold on the device after a step and in the host copy, the plan's
``reference_bytes`` for this device and for a GPU, and the largest loss difference between the
variants at the same step (they must be equal: the copy is exact). Exits 1 when the losses differ
or the offloaded reference holds device bytes between steps.

    python -m scripts.bench.bench_ref_offload --data-path PREF --tokenizer-model M \\
        [--device cuda] [--rounds 5] [--steps 4] [--hidden-size 256] [--num-layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from megazero import training
from megazero.config import config_from_argv
from megazero.planning.plan import plan_memory
from megazero.training import build_trainer
from model.build import build_gpt_config

MIB = 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_round(argv: list, steps: int, device: torch.device) -> dict:
    """Build, warm up one step, time ``steps`` steps; the losses, step times (s) and the
    reference's device / host bytes after the last step."""
    cfg = config_from_argv(argv, 1)
    trainer = build_trainer(cfg, data=training.prepare_run(cfg), device=device)
    losses, times = [], []
    try:
        for step in range(steps + 1):
            batches = trainer.next_batches()
            _sync(device)
            t0 = time.perf_counter()
            losses.append(trainer.train_step(batches).values["loss"])
            _sync(device)
            if step:
                times.append(time.perf_counter() - t0)
        params = [p for c in trainer.post.chunks for p in c.parameters()]
        held = sum(p.untyped_storage().nbytes() for p in params)
        host = trainer.post.resident.nbytes if trainer.post.resident is not None else 0
        built = sum(p.numel() * p.element_size() for p in params)
    finally:
        trainer.close()
    return dict(losses=losses, times=times, held=held, host=host, built=built)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-path", required=True, help="python -m data.preference's output prefix")
    ap.add_argument("--tokenizer-model", required=True)
    ap.add_argument("--tokenizer-type", default="SentencePieceTokenizer")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=256)
    a = ap.parse_args()
    device = torch.device(a.device)
    base = [
        "--post-train", "dpo", "--data-path", a.data_path, "--tokenizer-model", a.tokenizer_model,
        "--tokenizer-type", a.tokenizer_type, "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", "4", "--seq-length", str(a.seq_length), "--micro-batch-size", "8",
        "--global-batch-size", "16", "--train-iters", str(a.steps + 1), "--lr", "1e-4", "--eval-iters", "0",
        "--device", device.type, "--seed", "3",
    ]  # fmt: skip
    variants = {"on device": base, "--ref-offload": base + ["--ref-offload"]}
    runs: dict = {k: [] for k in variants}
    for r in range(a.rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in order:
            runs[name].append(one_round(variants[name], a.steps, device))

    cfg = config_from_argv(base, 1)
    gcfg = build_gpt_config(cfg, training.build_data(cfg).vocab_size)
    med = {}
    print(f"device {device}, {a.rounds} interleaved rounds of {a.steps} timed steps each")
    for name, rs in runs.items():
        times = [t for r in rs for t in r["times"]]
        per_round = [statistics.median(r["times"]) for r in rs]
        med[name] = statistics.median(times)
        last = rs[-1]
        print(
            f"{name:>14}: median step {med[name] * 1e3:8.1f} ms "
            f"(rounds {min(per_round) * 1e3:.1f}..{max(per_round) * 1e3:.1f}); "
            f"reference {last['built'] / MIB:.2f} MiB built, {last['held'] / MIB:.2f} MiB held on the device "
            f"between steps, {last['host'] / MIB:.2f} MiB in host memory"
        )
    for on_cuda in (device.type == "cuda", True):
        for name, argv in variants.items():
            ref = plan_memory(config_from_argv(argv, 1), gcfg, on_cuda=on_cuda).reference_bytes
            print(f"plan ({'GPU' if on_cuda else 'CPU'}) {name:>14}: reference {ref / MIB:.2f} MiB")
    print(f"ratio --ref-offload / on device (median step time): {med['--ref-offload'] / med['on device']:.3f}")
    diff = max(
        abs(x - y) / abs(y)
        for ra, rb in zip(runs["--ref-offload"], runs["on device"])
        for x, y in zip(ra["losses"], rb["losses"])
    )
    print(f"largest relative loss difference between the variants: {diff:.2e}")
    ok = diff == 0.0 and all(r["held"] == 0 for r in runs["--ref-offload"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
