"""Peak process memory per rank for ZeRO 0, 1, 2 (and 3) (data parallel on CPU gloo ranks).

Each run forks ``--dp`` fresh rank processes that build ``training.Trainer`` (the real training
path: GPT stage, DataParallel with the default buckets, DistributedOptimizer), train
``--steps`` steps on mock data and report the peak resident set size (``VmHWM`` of
``/proc/self/status``), the resident size before the model was built, and the model-state
bytes against the ZeRO formula. Stages (``--stages``, default 0,1,2) alternate round by round (0, 1, 2, 0, 1, 2, ...) so
machine noise hits all alike; the table shows, per stage, the model-state bytes per
parameter (measured = formula), the temporaries and their bound, and the median over rounds
of the largest peak over ranks. ``--zero-shard-size S`` adds a hybrid-sharding row (state
sharded over S ranks, replicated over dp / S; formula with N = S) beside each stage >= 1.

    python -m scripts.bench.bench_memory [--dp 2] [--rounds 3] [--steps 4] [--bf16] [--stages 2,3] [--zero-shard-size S]
        [--zero3-prefetch-bucket-size N] [--zero3-max-reuse-distance N] ...
        [--offload none,cpu,nvme [--sub-group-size N] [--offload-nvme-path DIR]]
        [--offload-param none,cpu,nvme [--offload-param-buffer-count N] [--offload-param-max-in-cpu N]]

``--offload cpu,nvme`` runs each stage with the optimizer offloaded to host memory and to NVMe
swap files: the two peaks differ by about the owned fp32 state (12 bytes per owned element)
minus the swap buffer pool (the last column). ``--offload-param cpu,nvme`` adds, at stage 3
with an offloaded optimizer, the parameter shards in host memory and in swap files: those two
peaks differ by about the swapped shards (p bytes per swapped element) minus the slots
(``--offload-param-buffer-count`` x the largest shard; the column after it).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile

import torch

from data.samplers import get_micro_batches
from megazero.data_parallel.policy import sharding_policy
from megazero.optim.zero import zero_formula_bytes
from megazero.training import build_trainer
from tests.support.distributed import run_distributed

MIB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rank(rank: int, world: int, argv: list, steps: int) -> dict:
    """One rank: build the trainer, train ``steps`` steps, report memory (bytes)."""
    before = _status_kib("VmRSS") * 1024
    trainer = build_trainer(argv, world)
    cfg, groups, train_ds = trainer.cfg, trainer.groups, trainer.data.train
    n = groups.zero_shard_size  # N of the formula: dp, or S under hybrid sharding
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    for step in range(steps):
        trainer.train_step(get_micro_batches(train_ds, step * gbs, gbs, mbs, groups.dp_rank, world))
    opt = trainer.optimizer
    got = opt.model_state_bytes()
    swap = trainer.ddp.param_swap
    params_saved = (
        0
        if swap is None
        else (sum(b.params_shard.numel() * b.params_shard.element_size() for b in swap.swapped) - swap.pool_bytes())
    )
    trainer.close()  # NVMe offload: the swap files go
    psi = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    padded = sum(b.layout.padded_numel for b in trainer.ddp.buffers)
    p_bytes, g_bytes = trainer.dtype.itemsize, trainer.ddp.grad_dtype.itemsize
    # ZeRO-3: parameters under the persistence threshold stay whole ((N - 1) / N more bytes)
    shards_params = sharding_policy(cfg.zero.stage).shards_params
    whole = sum(b.layout.padded_numel for b in trainer.ddp.buffers if shards_params and not b.strategy.shards_params)
    offloaded = cfg.zero.offload_optimizer != "none"
    formula = (
        opt.formula()["total"]
        if offloaded
        # the offload formulas (offload.py, nvme.py)
        else zero_formula_bytes(padded, n, cfg.zero.stage, p_bytes, g_bytes) + p_bytes * whole * (n - 1) / n
    )
    owned = sum(b.layout.padded_numel // b.layout.dp_size for b in trainer.ddp.buffers)
    return dict(
        psi=psi,
        states=got["total"] - got["buckets"],
        buckets=got["buckets"],
        bound=opt.bucket_bound_bytes(),
        before=before,
        peak=_status_kib("VmHWM") * 1024,
        formula=formula,
        owned_state=12 * owned,
        pool=got.get("swap_buffers", 0),
        params_saved=params_saved,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--num-layers", type=int, default=7)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=6400)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--stages", default="0,1,2", help="comma-separated ZeRO stages to compare (0-3)")
    ap.add_argument("--zero3-reshard-after-forward", default="auto", choices=("auto", "on", "off"))
    ap.add_argument(
        "--zero-shard-size",
        type=int,
        default=None,
        help="also run each stage >= 1 with hybrid sharding over S ranks (a row 'stage/S')",
    )
    ap.add_argument(
        "--offload",
        default="none",
        help="comma-separated --offload-optimizer values to run at "
        "each stage (none, cpu, nvme; cpu and nvme need a stage >= 1)",
    )
    ap.add_argument("--offload-nvme-path", default=None, help="swap directory for nvme (default: a temporary one)")
    ap.add_argument("--sub-group-size", type=int, default=1_000_000, help="elements per swapped sub-group (nvme)")
    ap.add_argument("--offload-nvme-buffer-count", type=int, default=4)
    ap.add_argument(
        "--offload-param",
        default="none",
        help="comma-separated --offload-param values (none, cpu, "
        "nvme); cpu and nvme run at stage 3 with an offloaded optimizer only",
    )
    ap.add_argument("--offload-param-buffer-count", type=int, default=2)
    ap.add_argument("--offload-param-max-in-cpu", type=int, default=0)
    knobs = ("prefetch-bucket-size", "max-live-parameters", "param-persistence-threshold", "max-reuse-distance")
    for k in knobs:  # ZeRO-3 knobs (elements); train.py's defaults when not given
        ap.add_argument(f"--zero3-{k}", type=int, default=None)
    a = ap.parse_args()
    given = [(k, getattr(a, "zero3_" + k.replace("-", "_"))) for k in knobs]
    given = [(k, v) for k, v in given if v is not None]
    base = (
        [
            "--mock-data",
            "--vocab-size",
            str(a.vocab_size),
            "--hidden-size",
            str(a.hidden_size),
            "--num-layers",
            str(a.num_layers),
            "--num-attention-heads",
            str(a.num_attention_heads),
            "--seq-length",
            str(a.seq_length),
            "--micro-batch-size",
            str(a.micro_batch_size),
            "--train-iters",
            str(a.steps),
            "--eval-iters",
            "0",
            "--device",
            "cpu",
            "--dp",
            str(a.dp),
            "--clip-grad",
            "1.0",
            "--zero3-reshard-after-forward",
            a.zero3_reshard_after_forward,
        ]
        + (["--bf16"] if a.bf16 else [])
        + [x for k, v in given for x in (f"--zero3-{k}", str(v))]
    )
    swap = a.offload_nvme_path or tempfile.mkdtemp(prefix="megazero-bench-")
    offload = {
        "none": [],
        "cpu": ["--offload-optimizer", "cpu"],
        "nvme": [
            "--offload-optimizer",
            "nvme",
            "--offload-nvme-path",
            swap,
            "--sub-group-size",
            str(a.sub_group_size),
            "--offload-nvme-buffer-count",
            str(a.offload_nvme_buffer_count),
        ],
    }
    param = {
        "none": [],
        "cpu": ["--offload-param", "cpu"],
        "nvme": [
            "--offload-param",
            "nvme",
            "--offload-nvme-path",
            swap,
            "--offload-param-buffer-count",
            str(a.offload_param_buffer_count),
            "--offload-param-max-in-cpu",
            str(a.offload_param_max_in_cpu),
        ],
    }
    shards = [None] + ([] if a.zero_shard_size is None else [a.zero_shard_size])
    runs: dict[tuple, list] = {
        (int(s), shard, o, po): []
        for s in a.stages.split(",")
        for shard in shards
        for o in a.offload.split(",")
        for po in a.offload_param.split(",")
        if (shard is None or int(s) >= 1) and (po == "none" or (int(s) == 3 and o != "none"))
    }
    for _ in range(a.rounds):
        for stage, shard, off, poff in runs:
            argv = (
                base
                + ["--zero-stage", str(stage)]
                + offload[off]
                + param[poff]
                + ([] if shard is None else ["--zero-shard-size", str(shard)])
            )
            runs[stage, shard, off, poff].append(run_distributed(_rank, a.dp, argv, a.steps, timeout_s=1800))
    psi = next(iter(runs.values()))[0][0]["psi"]
    print(
        f"GPT: {a.num_layers} layers, hidden {a.hidden_size}, vocab {a.vocab_size}, seq {a.seq_length}, "
        f"micro-batch {a.micro_batch_size}; Psi = {psi} parameters; {'bf16' if a.bf16 else 'fp32'}; "
        f"dp {a.dp}; ZeRO-3 reshard after forward {a.zero3_reshard_after_forward}"
        f"{''.join(f', {k} {v}' for k, v in given)}; {a.steps} steps; {a.rounds} interleaved rounds; "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        "| ZeRO | optimizer offload | parameter offload | model states B/param (measured = formula) "
        "| temporaries MiB (bound) | RSS before model MiB | peak RSS MiB (median of rounds, max over ranks) "
        "| peak - before MiB | owned fp32 state (12 B x owned) - buffer pool MiB "
        "| swapped parameter shards - slots MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (stage, shard, off, poff), rounds in runs.items():
        r0 = rounds[0][0]
        # offload at ZeRO-3: the offload formulas do not count the whole (persistent) small buffers
        assert (off != "none" and stage == 3) or all(r["states"] == r["formula"] for rs in rounds for r in rs), (
            "states differ from the formula"
        )
        peak = statistics.median(max(r["peak"] for r in rs) for rs in rounds)
        before = statistics.median(max(r["before"] for r in rs) for rs in rounds)
        saved = f"{(r0['owned_state'] - r0['pool']) / MIB:.1f}" if off == "nvme" else ""
        psaved = f"{r0['params_saved'] / MIB:.1f}" if poff == "nvme" else ""
        print(
            f"| {stage}{'' if shard is None else f' S={shard}'} | {off} | {poff} | "
            f"{r0['states'] / psi:.2f} ({r0['formula'] / psi:.2f}) | "
            f"{r0['buckets'] / MIB:.2f} ({r0['bound'] / MIB:.2f}) | {before / MIB:.0f} | "
            f"{peak / MIB:.0f} | {(peak - before) / MIB:.0f} | {saved} | {psaved} |"
        )
    if a.offload_nvme_path is None:
        shutil.rmtree(swap, ignore_errors=True)


if __name__ == "__main__":
    main()
