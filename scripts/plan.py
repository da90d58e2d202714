"""Memory plan of a megazero run, without launching it (megazero/planning/memory.py, megazero/planning/activations.py).

    python scripts/plan.py [train.py flags] [--world-size N]
        the plan per pipeline stage: parameters, ZeRO model states, activations, temporaries, peak;
    python scripts/plan.py [train.py flags] --world-size N --measure [--measure-steps K]
        runs K steps on N gloo ranks on this CPU and prints each rank's predicted and measured peak;
    python scripts/plan.py [model flags] --devices N --device-memory GiB [--top K]
        the layouts (tp, cp with its comm type, pp, dp, ZeRO stage and shard size, recomputation) whose predicted
        peak fits, smallest first, with the data-parallel bytes each rank sends off its node per step
        (--gpus-per-node, default 8).

Measured peak (CPU): the rank's peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` at the baseline) minus its resident memory at the baseline, taken
after torch's kernels and autograd engine have run once on tiny tensors and before the model
is built: the bytes the run allocates, not the runtime's own. glibc's malloc keeps freed
blocks unless their size passes the mmap threshold, so the script re-executes itself with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megazero import training  # noqa: E402
from data.indexed_dataset import DataError  # noqa: E402
from data.tokenizer import load_tokenizer  # noqa: E402
from megazero.config import MOCK_VOCAB_SIZE, ConfigError, config_from_argv, parse_args  # noqa: E402
from megazero.config.shape import check_context_parallel  # noqa: E402
from megazero.planning.memory import gib  # noqa: E402
from megazero.planning import plan  # noqa: E402
from megazero.planning.plan import plan_memory, plan_stages  # noqa: E402
from megazero.runtime.launch import uses_cuda  # noqa: E402
from model.build import build_gpt_config, build_peak_bytes  # noqa: E402

MiB = 2**20
RECOMPUTE = {"none": [], "selective": ["--recompute-granularity", "selective"],
             "full": ["--recompute-granularity", "full", "--recompute-method", "uniform"]}


def vocab_of(cfg) -> int:
    """The vocabulary the run would have: --vocab-size, the mock default, or --tokenizer-model's.

    A plan reads no data; without any of the three it exits 2 with one line naming --vocab-size.
    """
    if cfg.data.vocab_size is not None:
        return cfg.data.vocab_size
    if cfg.train.mock_data:
        return MOCK_VOCAB_SIZE
    if cfg.data.tokenizer_model is None:
        print("megazero: config error: the plan needs the vocabulary size; fix: give --vocab-size N "
              "(or --tokenizer-model, or --mock-data)", file=sys.stderr, flush=True)
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
        lines.append(f"model build, stage {r}: peak {b.peak / MiB:.1f} MiB = kept {b.resident / MiB:.1f} MiB + "
                     f"one tensor in flight {b.in_flight / MiB:.1f} MiB (largest full tensor "
                     f"{b.full / MiB:.1f} MiB)")
    return "\n".join(lines)


def plan_table(cfg, vocab: int) -> str:
    """One row per pipeline stage: Psi, model states, activations, temporaries, peak (MiB).

    With --cp > 1 two more columns name what one layer's cp attention holds at once (part of the
    activations where it is the larger transient): its K/V buffers (the ring's K/V current and
    next with the dK/dV and dQ accumulators, or the all-to-all buffers) and the ring's block
    scores (``megazero.planning.activations.context_parallel_bytes``).
    """
    cp = cfg.parallel.cp > 1
    rows = [f"{'stage':>5} {'params':>14} {'states MiB':>11} {'activ. MiB':>11} {'temps MiB':>10} "
            f"{'peak MiB':>10}" + (f" {'cp K/V bufs MiB':>16} {'ring blocks MiB':>16}" if cp else "")]
    for e in plan_stages(cfg, build_gpt_config(cfg, vocab), on_cuda=uses_cuda(cfg)):
        rows.append(f"{e.stage:>5} {e.params:>14,} {e.model_state_bytes / MiB:>11.1f} "
                    f"{e.activation_bytes / MiB:>11.1f} {e.temporary_bytes / MiB:>10.1f} {e.total_bytes / MiB:>10.1f}"
                    + (f" {e.cp_attention.kv_buffers / MiB:>16.1f} {e.cp_attention.scores / MiB:>16.1f}" if cp else ""))
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
    trainer = training.build_trainer(cfg, data=run, groups=groups)   # the peak counts the model from here on
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
    """Re-execute this script with glibc's mmap threshold fixed (see the module docstring)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable] + sys.argv)


# -- searching layouts ----------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _cp_options(base, tp: int, ranks: int) -> list[tuple[int, str]]:
    """(cp, comm type) pairs for ``ranks`` = devices / (tp x pp): cp = 1, and every divisor cp > 1
    of ``ranks`` that ``shape.check_context_parallel`` accepts (2 cp divides the sequence, with
    SP cp x tp does, a2a needs the heads divisible by tp x cp), with p2p and a2a. None at cp > 1
    when the run has attention dropout or --compile, which context parallelism refuses
    (``config.checks._check_context_parallel``)."""
    m = base.model
    options = [(1, "p2p")]
    if m.attention_dropout > 0 or base.train.compile:
        return options
    for cp in (d for d in _divisors(ranks) if d > 1):
        for comm in ("p2p", "a2a"):
            try:
                check_context_parallel(seq_length=m.seq_length, cp=cp, tp=tp, sequence_parallel=tp > 1,
                                       comm_type=comm, num_attention_heads=m.num_attention_heads,
                                       num_query_groups=m.num_query_groups if m.group_query_attention else None)
            except ConfigError:
                continue
            options.append((cp, comm))
    return options


def _shard_options(zero: int, replicas: int, tp: int, gpus_per_node: int) -> list[int]:
    """ZeRO shard sizes S searched: the flat dp x cp (``replicas``), and at stages >= 1 one node's
    replicas (``gpus_per_node / tp``: consecutive replicas r' = cp_rank + cp dp_rank are tp global
    ranks apart) when that divides ``replicas`` and is smaller: hybrid sharding, whose
    all-gathers and reduce-scatters stay inside the node."""
    node = gpus_per_node // tp if gpus_per_node % tp == 0 else 0
    hybrid = zero >= 1 and 1 <= node < replicas and replicas % node == 0
    return [replicas, node] if hybrid else [replicas]


def dp_internode_bytes(psi: float, zero: int, replicas: int, shard: int, tp: int, gpus_per_node: int,
                       num_microbatches: int, param_bytes: int, grad_bytes: int) -> float:
    """Bytes per rank and step the data-parallel collectives hand to groups that span nodes (the
    payload ``megazero.collectives.counter`` counts), ranks filling nodes of ``gpus_per_node`` in
    order. n consecutive replicas are ``tp x n`` consecutive ranks, so a group of them spans nodes
    when ``tp x n > gpus_per_node``. ZeRO-0: the all-reduce of the g Psi buffer; ZeRO-1/2: the
    shard group's reduce-scatter (g Psi, per micro-batch at stage 2) and all-gather (p Psi / S)
    when that group spans nodes, plus hybrid sharding's all-reduce of the shard (g Psi / S) over
    the replica group when that one does. Psi unpadded (each buffer pads < N elements)."""
    spans = lambda n: tp * n > gpus_per_node   # noqa: E731
    if zero == 0:
        return grad_bytes * psi if spans(replicas) else 0.0
    inside = (num_microbatches if zero == 2 else 1) * grad_bytes * psi + param_bytes * psi / shard
    across = grad_bytes * psi / shard if shard < replicas and spans(replicas) else 0.0
    return (inside if spans(shard) else 0.0) + across


def layouts(argv: list[str], devices: int, max_tp: int = 8, gpus_per_node: int = 8):
    """Every (tp, cp, cp comm type, pp, dp, ZeRO stage, ZeRO shard size S, recomputation) of
    ``devices`` ranks the model allows, as (label, argv); tp a power of two up to ``max_tp`` (one
    node), sequence parallel when tp > 1, cp as ``_cp_options`` gives it (the comm type "-" at cp
    1), S the flat dp x cp or one node of ``gpus_per_node`` (``_shard_options``)."""
    base = config_from_argv(argv + ["--tp", "1", "--pp", "1", "--dp", "1"], 1, print_warnings=False,
                            needs_data=False)
    m, t = base.model, base.train
    for tp in (d for d in (1, 2, 4, 8, 16) if d <= max_tp and devices % d == 0):
        if m.num_attention_heads % tp or m.ffn_hidden_size % tp:
            continue
        for pp in (d for d in _divisors(m.num_layers) if devices % (tp * d) == 0):
            for cp, comm in _cp_options(base, tp, devices // (tp * pp)):
                dp = devices // (tp * pp * cp)
                if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp):
                    continue
                extra = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp)]
                extra += ["--cp", str(cp), "--cp-comm-type", comm] if cp > 1 else []
                extra += ["--sequence-parallel"] if tp > 1 else []
                for zero in (0, 1, 2):
                    for shard in _shard_options(zero, dp * cp, tp, gpus_per_node):
                        hybrid = ["--zero-shard-size", str(shard)] if shard < dp * cp else []
                        for name, flags in RECOMPUTE.items():
                            label = (tp, cp, comm if cp > 1 else "-", pp, dp, zero, shard, name)
                            yield label, argv + extra + ["--zero-stage", str(zero)] + hybrid + flags


def fitting_layouts(argv: list[str], devices: int, device_gib: float,
                    gpus_per_node: int = 8) -> list[tuple[float, tuple, float]]:
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
            off = dp_internode_bytes(est.params, zero, dp * cp, shard, tp, gpus_per_node,
                                     cfg.train.gradient_accumulation_steps, p_bytes, g_bytes)
            fits.append((est.total_bytes, layout, off))
    return sorted(fits)


def main(argv: Optional[list[str]] = None) -> int:
    """Plan (or measure, or search layouts for) the run of ``argv`` (default: the command line)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=None, help="ranks (default: tp x cp x pp x dp of the flags)")
    ap.add_argument("--measure", action="store_true", help="run on CPU gloo ranks and measure each rank's peak")
    ap.add_argument("--measure-steps", type=int, default=3)
    ap.add_argument("--devices", type=int, default=None, help="list layouts of this many devices that fit")
    ap.add_argument("--device-memory", type=float, default=80.0, help="GiB per device (with --devices)")
    ap.add_argument("--top", type=int, default=20, help="layouts listed (with --devices)")
    ap.add_argument("--gpus-per-node", type=int, default=8,
                    help="with --devices: ranks per node (hybrid sharding's one-node S, off-node bytes)")
    own, argv = ap.parse_known_args(argv)
    if own.devices is not None:
        fits = fitting_layouts(argv, own.devices, own.device_memory, own.gpus_per_node)
        print(f"{len(fits)} layouts of {own.devices} devices fit in {own.device_memory:g} GiB; smallest peak first:")
        print(f"{'tp':>3} {'cp':>4} {'comm':>4} {'pp':>3} {'dp':>5} {'zero':>4} {'shard':>5} {'recompute':>10} "
              f"{'peak per rank':>14} {'dp_off_node_GiB/step':>20}")
        for peak, (tp, cp, comm, pp, dp, zero, shard, rc), off in fits[:own.top]:
            print(f"{tp:>3} {cp:>4} {comm:>4} {pp:>3} {dp:>5} {zero:>4} {shard:>5} {rc:>10} {gib(peak):>14} "
                  f"{off / 2**30:>20.2f}")
        return 0 if fits else 1
    world = own.world_size or _world_of(argv)
    cfg = config_from_argv(argv, world, needs_data=own.measure)  # only --measure reads the data
    vocab = vocab_of(cfg)
    print(plan_table(cfg, vocab))
    print("\n" + build_table(cfg, vocab))
    if own.measure:
        print(f"\n{'rank':>4} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7}")
        for r, want, got in measure(argv + ["--device", "cpu"], world, own.measure_steps):
            print(f"{r:>4} {want / MiB:>14.1f} {got / MiB:>13.1f} {(want - got) / got:>+7.1%}")
    return 0


def _world_of(argv: list[str]) -> int:
    """tp x cp x pp x dp as the flags give them (any of their names, e.g. --tp or
    --tensor-model-parallel-size; 1 when absent). A flag that does not parse gives 1 here and
    its error from ``config_from_argv``, which reads the same argv next."""
    try:
        p = parse_args(argv).parallel
    except (ConfigError, SystemExit):
        return 1
    return p.tp * p.cp * p.pp * (p.dp or 1)


if __name__ == "__main__":
    if "--measure" in sys.argv:
        ensure_mmap_threshold()
    sys.exit(main())
