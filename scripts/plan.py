"""Memory plan of a megazero run, without launching it (megazero/planning/memory.py,
megazero/planning/activations.py; the layout search: megazero/planning/search.py). Run from the
repository root:

    python -m scripts.plan [train.py flags] [--world-size N]
        the plan per pipeline stage: parameters, ZeRO model states, activations, temporaries, peak;
    python -m scripts.plan [train.py flags] --world-size N --measure [--measure-steps K]
        runs K steps on N gloo ranks on this CPU and prints each rank's predicted and measured peak;
    python -m scripts.plan [model flags] --devices N --device-memory GiB [--top K]
        the layouts (tp, cp with its comm type, pp, dp, ZeRO stage and shard size, recomputation) whose predicted
        peak fits, smallest first, with the data-parallel bytes each rank sends off its node per step
        (--gpus-per-node, default 8).

Measured peak (CPU): the rank's peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` at the baseline) minus its resident memory at the baseline, taken
after torch's kernels and autograd engine have run once on tiny tensors and before the model
is built: the bytes the run allocates, not the runtime's own. glibc's malloc keeps freed
blocks unless their size passes the mmap threshold, so the script re-executes itself with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set.

API: ``main(argv)`` takes the command line as a list (without the program name) and returns the
exit status. The benchmarks of scripts/bench/ also use ``measure``, ``vocab_of`` and
``ensure_mmap_threshold``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Optional

import torch

from data.indexed_dataset import DataError
from data.tokenizer import load_tokenizer
from megazero import training
from megazero.config import MOCK_VOCAB_SIZE, config_from_argv, world_size_of
from megazero.planning import plan
from megazero.planning.memory import gib
from megazero.planning.plan import plan_memory, plan_stages
from megazero.planning.search import dp_internode_bytes, layouts
from megazero.runtime.launch import uses_cuda
from model.build import build_gpt_config, build_peak_bytes

MiB = 2**20


def vocab_of(cfg) -> int:
    """The vocabulary the run would have: --vocab-size, the mock default, or --tokenizer-model's.

    A plan reads no data; without any of the three it exits 2 with one line naming --vocab-size.
    """
    if cfg.data.vocab_size is not None:
        return cfg.data.vocab_size
    if cfg.train.mock_data:
        return MOCK_VOCAB_SIZE
    if cfg.data.tokenizer_model is None:
        print(
            "megazero: config error: the plan needs the vocabulary size; fix: give --vocab-size N "
            "(or --tokenizer-model, or --mock-data)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)
    try:
        return load_tokenizer(cfg.data.tokenizer_model, cfg.data.tokenizer_type).vocab_size
    except DataError as e:
        print(f"megazero: data error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def build_table(cfg, vocab: int) -> str:
    """One line per pipeline stage: what building its model holds at most on one rank, in MiB
    (``model.build.build_peak_bytes``: each full tensor made, cut to this rank's partition
    (its ZeRO-3 shard) and freed before the next), the kept partitions and the largest
    transient (one full fp32 tensor, its cut and its copy in the model dtype)."""
    gcfg = build_gpt_config(cfg, vocab)
    where = "cuda" if uses_cuda(cfg) else "cpu"
    lines = []
    for r in range(cfg.parallel.pp):
        b = build_peak_bytes(cfg, gcfg, r, where)
        lines.append(
            f"model build, stage {r}: peak {b.peak / MiB:.1f} MiB = kept {b.resident / MiB:.1f} MiB + "
            f"one tensor in flight {b.in_flight / MiB:.1f} MiB (largest full tensor "
            f"{b.full / MiB:.1f} MiB)"
        )
    return "\n".join(lines)


def plan_table(cfg, vocab: int) -> str:
    """One row per pipeline stage: Psi, model states, activations, temporaries, peak (MiB).

    With --cp > 1 two more columns name what one layer's cp attention holds at once (part of the
    activations where it is the larger transient): its K/V buffers (the ring's K/V current and
    next with the dK/dV and dQ accumulators, or the all-to-all buffers) and the ring's block
    scores (``megazero.planning.activations.context_parallel_bytes``).
    """
    cp = cfg.parallel.cp > 1
    rows = [
        f"{'stage':>5} {'params':>14} {'states MiB':>11} {'activ. MiB':>11} {'temps MiB':>10} "
        f"{'peak MiB':>10}" + (f" {'cp K/V bufs MiB':>16} {'ring blocks MiB':>16}" if cp else "")
    ]
    for e in plan_stages(cfg, build_gpt_config(cfg, vocab), on_cuda=uses_cuda(cfg)):
        rows.append(
            f"{e.stage:>5} {e.params:>14,} {e.model_state_bytes / MiB:>11.1f} "
            f"{e.activation_bytes / MiB:>11.1f} {e.temporary_bytes / MiB:>10.1f} {e.total_bytes / MiB:>10.1f}"
            + (f" {e.cp_attention.kv_buffers / MiB:>16.1f} {e.cp_attention.scores / MiB:>16.1f}" if cp else "")
        )
    return "\n".join(rows)


# -- measuring on CPU ranks -----------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _warm_up() -> None:
    """Run the kinds of kernels a step uses once on tiny tensors (their runtime is not counted)."""
    import torch.nn.functional as F

    x = torch.randn(2, 8, 16, requires_grad=True)
    w = torch.randn(48, 16, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in F.linear(F.layer_norm(x, (16,)), w).view(2, 8, 3, 4, 4).unbind(2))
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
    y = y + F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = F.gelu(y.transpose(1, 2).reshape(2, 8, 16)) * torch.empty(2, 8, 16).bernoulli_(0.5)
    loss = F.cross_entropy(y.reshape(16, 16).float(), torch.zeros(16, dtype=torch.long))
    # with explicit output gradients, as the pipeline and recomputation call it: its first call
    # imports torch's symbolic-shape module (sympy, about 30 MiB resident)
    torch.autograd.backward([loss], [torch.ones_like(loss)])
    torch._foreach_add_([w.detach()], [w.grad])


def measure_rank(rank: int, world: int, argv: list[str], steps: int) -> tuple[int, int]:
    """(pp rank, measured peak bytes) of this rank after ``steps`` training steps."""
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology

    cfg = config_from_argv(argv, world, print_warnings=False)
    run = training.build_data(cfg)
    train_ds = run.train
    p = cfg.parallel
    groups = ProcessGroups.build(Topology(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp))
    gbs = cfg.train.global_batch_size
    batches = [training.dp_micro_batches(train_ds, s * gbs, cfg, groups, "cpu") for s in range(steps)]
    _warm_up()
    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    trainer = training.build_trainer(cfg, data=run, groups=groups)  # the peak counts the model from here on
    for b in batches:
        trainer.train_step(b)
    return groups.pp_rank, _status("VmHWM") - base


def measure(argv: list[str], world: int, steps: int) -> list[tuple[int, float, float]]:
    """(rank, predicted, measured) peak bytes of every rank of a CPU run of ``argv``."""
    from tests.support.distributed import run_distributed

    cfg = config_from_argv(argv, world, print_warnings=False)
    predicted = plan_stages(cfg, build_gpt_config(cfg, vocab_of(cfg)), on_cuda=uses_cuda(cfg))
    out = run_distributed(measure_rank, world, argv, steps, timeout_s=3600, collective_timeout_s=1800)
    return [(r, predicted[pp_rank].total_bytes, float(peak)) for r, (pp_rank, peak) in enumerate(out)]


def ensure_mmap_threshold() -> None:
    """Re-execute the running command (``python -m <main module> ...``, also a benchmark's that
    calls this) with glibc's mmap threshold fixed (see the module docstring)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, "-m", sys.modules["__main__"].__spec__.name, *sys.argv[1:]])


# -- searching layouts ----------------------------------------------------------------------
def fitting_layouts(
    argv: list[str], devices: int, device_gib: float, gpus_per_node: int = 8
) -> list[tuple[float, tuple, float]]:
    """(predicted peak bytes, layout, data-parallel bytes off the node per rank and step:
    ``dp_internode_bytes``) of every layout whose peak fits ``device_gib``, smallest peak first."""
    fits, vocab = [], None
    for layout, full in layouts(argv, devices, gpus_per_node=gpus_per_node):
        cfg = config_from_argv(full, devices, print_warnings=False, needs_data=False)
        vocab = vocab or vocab_of(cfg)
        est = plan_memory(cfg, build_gpt_config(cfg, vocab), on_cuda=uses_cuda(cfg))
        if est.total_bytes <= device_gib * 2**30:
            tp, cp, _, _, dp, zero, shard, _ = layout
            widths = plan.layout_settings(cfg, False)
            p_bytes, g_bytes = widths["param_bytes"], widths["grad_bytes"]
            off = dp_internode_bytes(
                est.params,
                zero,
                dp * cp,
                shard,
                tp,
                gpus_per_node,
                cfg.train.gradient_accumulation_steps,
                p_bytes,
                g_bytes,
            )
            fits.append((est.total_bytes, layout, off))
    return sorted(fits)


def main(argv: Optional[list[str]] = None) -> int:
    """Plan (or measure, or search layouts for) the run of ``argv`` (default: the command line)."""
    ap = argparse.ArgumentParser(
        prog="python -m scripts.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world-size", type=int, default=None, help="ranks (default: tp x cp x pp x dp of the flags)")
    ap.add_argument("--measure", action="store_true", help="run on CPU gloo ranks and measure each rank's peak")
    ap.add_argument("--measure-steps", type=int, default=3)
    ap.add_argument("--devices", type=int, default=None, help="list layouts of this many devices that fit")
    ap.add_argument("--device-memory", type=float, default=80.0, help="GiB per device (with --devices)")
    ap.add_argument("--top", type=int, default=20, help="layouts listed (with --devices)")
    ap.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="with --devices: ranks per node (hybrid sharding's one-node S, off-node bytes)",
    )
    own, argv = ap.parse_known_args(argv)
    if own.devices is not None:
        fits = fitting_layouts(argv, own.devices, own.device_memory, own.gpus_per_node)
        print(f"{len(fits)} layouts of {own.devices} devices fit in {own.device_memory:g} GiB; smallest peak first:")
        print(
            f"{'tp':>3} {'cp':>4} {'comm':>4} {'pp':>3} {'dp':>5} {'zero':>4} {'shard':>5} {'recompute':>10} "
            f"{'peak per rank':>14} {'dp_off_node_GiB/step':>20}"
        )
        for peak, (tp, cp, comm, pp, dp, zero, shard, rc), off in fits[: own.top]:
            print(
                f"{tp:>3} {cp:>4} {comm:>4} {pp:>3} {dp:>5} {zero:>4} {shard:>5} {rc:>10} {gib(peak):>14} "
                f"{off / 2**30:>20.2f}"
            )
        return 0 if fits else 1
    world = own.world_size or world_size_of(argv)
    cfg = config_from_argv(argv, world, needs_data=own.measure)  # only --measure reads the data
    vocab = vocab_of(cfg)
    print(plan_table(cfg, vocab))
    print("\n" + build_table(cfg, vocab))
    if own.measure:
        print(f"\n{'rank':>4} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7}")
        for r, want, got in measure(argv + ["--device", "cpu"], world, own.measure_steps):
            print(f"{r:>4} {want / MiB:>14.1f} {got / MiB:>13.1f} {(want - got) / got:>+7.1%}")
    return 0


if __name__ == "__main__":
    if "--measure" in sys.argv:
        ensure_mmap_threshold()
    sys.exit(main())
