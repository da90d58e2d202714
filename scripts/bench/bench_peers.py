"""megazero against its peers: the same GPT, data and hyper-parameters on the same ranks.

Data-parallel pairs (dp = world size, a small GPT: ``--layers --hidden ...``):

- ``megazero-zero0`` / ``ddp`` (``torch.nn.parallel.DistributedDataParallel``) and
  ``deepspeed-zero0``;
- ``megazero-zero1`` / ``zero-redundancy-optimizer`` (DDP + ``torch.distributed.optim.
  ZeroRedundancyOptimizer`` over AdamW: optimizer states sharded, ZeRO-1) and
  ``deepspeed-zero1``;
- ``megazero-zero2`` / ``fsdp2`` (``torch.distributed.fsdp.fully_shard`` per transformer layer
  and the root; it shards parameters too, i.e. ZeRO-3, the nearest torch peer of ZeRO-2) and
  ``deepspeed-zero2``.

- ``floor``: the same model's forward and backward on the same micro-batches, nothing else (no
  gradient sync, no clipping, no optimizer step). Every data-parallel system runs exactly this
  computation plus its own synchronisation and update, so ``floor`` bounds them all from below:
  ``floor/peer`` is the smallest ratio megazero could reach against that peer, and
  ``(megazero - floor) / (peer - floor)`` compares what each adds to the computation (its
  overhead: communication not hidden, clipping, the optimizer step).

megazero runs as ``train.py`` does by default: ``overlap_comm`` and, at ZeRO-1/2,
``--overlap-param-gather``; ``--sync-param-gather`` adds ``megazero-zero1-sync-gather`` and
``megazero-zero2-sync-gather`` (the parameter all-gather waited for inside the step) with their
own ratio lines.

Tensor-parallel pair (tp = world size, a GPT where compute dominates: ``--tp-layers
--tp-hidden ...``, 25.8M parameters by default): ``megazero-tp2`` / ``megatron-core-tp2``
(Megatron-core's ``GPTModel``, loaded with megazero's initial weights). ``--tp-layers 0``
leaves the pair out.

DeepSpeed and Megatron-core are benchmark-only optional dependencies
(``scripts/bench/bench_peers_optional.py``): a peer that is not importable is skipped with one line
saying so. Every system trains ``model.gpt.GPTStage`` weights built from the same seed, on the
same random token batches, with AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on
the matrices and none on biases and norms: megazero's parameter groups, ``adamw_groups``),
gradient clipping at 1.0 and several micro-batches per step (the peers skip the gradient sync
on all but the last: ``no_sync`` / ``set_requires_gradient_sync`` / DeepSpeed's
accumulation boundary), fp32. Rounds are interleaved (round r runs every system in turn,
``--steps`` timed steps after one warm-up step each); the median step time of a system is over
all its timed steps of all rounds, the spread is the range of its per-round medians. The last
lines are ``ratio megazero-zero1/deepspeed-zero1: 0.97`` (median step times) and ``overhead
megazero-zero1/deepspeed-zero1: 0.79`` (each system's median over the floor's, divided).
Model-state bytes per rank are the parameters, gradients and optimizer states this rank holds
after a step (``to_local()`` shards for FSDP2, every distinct storage DeepSpeed's engine holds).

Every rank keeps freed heap memory for reuse by default (``--allocator keep``: glibc's
``M_TOP_PAD``, ``scripts.bench.bench_overhead.keep_freed_memory``), the footing of a caching
allocator, so no system's step is weighed by the page faults of memory glibc handed back to the
kernel (a sixth of a step on this machine with the defaults); ``--allocator system`` keeps
glibc's defaults.

    python -m scripts.bench.bench_peers --rounds 5 --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0
OVERLAP_PAIRS = (("megazero-zero1", "megazero-zero1-sync-gather"), ("megazero-zero2", "megazero-zero2-sync-gather"))
PAIRS = (
    ("megazero-zero0", "ddp"),
    ("megazero-zero0", "deepspeed-zero0"),
    ("megazero-zero1", "zero-redundancy-optimizer"),
    ("megazero-zero1", "deepspeed-zero1"),
    ("megazero-zero2", "fsdp2"),
    ("megazero-zero2", "deepspeed-zero2"),
    ("megazero-tp2", "megatron-core-tp2"),
)
DP_SYSTEMS = (
    "floor",
    "megazero-zero0",
    "ddp",
    "deepspeed-zero0",
    "megazero-zero1",
    "zero-redundancy-optimizer",
    "deepspeed-zero1",
    "megazero-zero2",
    "fsdp2",
    "deepspeed-zero2",
)
TP_SYSTEMS = ("megazero-tp2", "megatron-core-tp2")
OPTIONAL = {
    "deepspeed-zero0": "deepspeed",
    "deepspeed-zero1": "deepspeed",
    "deepspeed-zero2": "deepspeed",
    "megatron-core-tp2": "megatron-core",
}


def peer_gpt_config(args):
    from model.config import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        make_vocab_size_divisible_by=8,
    )


def peer_model(args, groups):
    from model.gpt import GPTStage

    return GPTStage(peer_gpt_config(args), groups, range(args.layers), True, True, 1234)


#: Default ``--bucket-size``: 2^20 elements (4 MiB fp32), below DDP's 25 MiB and Megatron-core's
#: 4e7 elements. At hidden size squared (megazero's default, 65,536 elements for the default
#: model) every system pays gloo's per-call latency 53 times a step (docs/performance.md).
DEFAULT_BUCKET = 1 << 20


def bucket_size(args) -> int:
    """Gradient-reduction and parameter all-gather bucket of every system, elements:
    ``--bucket-size``, else ``DEFAULT_BUCKET``."""
    return getattr(args, "bucket_size", None) or DEFAULT_BUCKET


def tp_args(args) -> argparse.Namespace:
    """The tensor-parallel pair's sizes (``--tp-*``) under the names the runners read."""
    return argparse.Namespace(
        layers=args.tp_layers,
        hidden=args.tp_hidden,
        heads=args.tp_heads,
        seq=args.tp_seq,
        vocab=args.vocab,
        micro=args.tp_micro,
        accum=args.tp_accum,
        bucket_size=getattr(args, "bucket_size", None),
    )


def systems_to_run(args) -> tuple[list, list]:
    """(systems that run, one line per optional package whose systems are skipped)."""
    from scripts.bench.bench_peers_optional import peer_available

    names = list(DP_SYSTEMS) + (list(TP_SYSTEMS) if args.tp_layers > 0 else [])
    if getattr(args, "sync_param_gather", False):
        for ours, sync in OVERLAP_PAIRS:
            names.insert(names.index(ours) + 1, sync)
    skipped = {}
    for name in names:
        pkg = OPTIONAL.get(name)
        if pkg is not None and not (args.optional and peer_available(pkg)):
            skipped.setdefault(pkg, []).append(name)
    why = "not importable" if args.optional else "--no-optional-peers"
    lines = [f"skipped {pkg} ({why}): {' '.join(n)}" for pkg, n in skipped.items()]
    return [n for n in names if not any(n in v for v in skipped.values())], lines


def _megazero(args, groups, stage, overlap_param_gather=None):
    """(step function, model-state bytes function) of megazero at ZeRO ``stage``;
    ``overlap_param_gather`` None: train.py's default (on at stages 1 and 2)."""
    from megazero.data_parallel.ddp import DataParallel
    from megazero.optim.zero import DistributedOptimizer

    model = peer_model(args, groups)
    ddp = DataParallel([model], groups, zero_stage=stage, bucket_size=bucket_size(args), overlap_comm=True)
    opt = DistributedOptimizer(
        ddp,
        groups,
        lr=ADAMW["lr"],
        beta1=ADAMW["betas"][0],
        beta2=ADAMW["betas"][1],
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
        clip_grad=CLIP,
        allgather_bucket_size=bucket_size(args),
        overlap_param_gather=(stage in (1, 2) if overlap_param_gather is None else overlap_param_gather),
    )

    def step(micro):
        ddp.zero_grad()
        total = 0.0
        for m, (t, l) in enumerate(micro):
            loss = model(t, l).sum() / (len(micro) * l.numel())
            ddp.before_backward(0, m == len(micro) - 1)
            loss.backward()
            total += loss.item()
        opt.step()
        return total

    def state():
        opt.wait_param_gather()  # nothing left in flight when the ranks compare or exit
        s = opt.model_state_bytes()
        return s["total"] - s["buckets"]

    return step, state


def _floor(args, groups):
    """(step, state) of the compute floor: forward and backward of the same model on the same
    micro-batches, gradients accumulated by autograd and dropped; no sync, no update."""
    model = peer_model(args, groups)

    def step(micro):
        for p in model.parameters():
            p.grad = None
        total = 0.0
        for t, l in micro:
            loss = model(t, l).sum() / (len(micro) * l.numel())
            loss.backward()
            total += loss.item()
        return total

    return step, lambda: sum(p.numel() * p.element_size() for p in model.parameters())


def _peer(args, groups, kind):
    """(step function, model-state bytes function) of a torch peer."""
    import contextlib

    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from scripts.bench.bench_peers_optional import adamw_groups

    model = peer_model(args, groups)
    if kind == "fsdp2":
        for layer in model.layers.values():
            fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_size(args) * 4 / 2**20)
    if kind == "zero-redundancy-optimizer":
        # ZeroRedundancyOptimizer takes one group at construction, the second by add_param_group
        decay, rest = adamw_groups(wrapped.parameters(), ADAMW["weight_decay"])
        opt = ZeroRedundancyOptimizer(decay["params"], optimizer_class=torch.optim.AdamW, **ADAMW)
        opt.add_param_group(rest)
    else:
        opt = torch.optim.AdamW(adamw_groups(wrapped.parameters(), ADAMW["weight_decay"]), **ADAMW)

    def step(micro):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m, (t, l) in enumerate(micro):
            last = m == len(micro) - 1
            if kind == "fsdp2":
                wrapped.set_requires_gradient_sync(last)
                ctx = contextlib.nullcontext()
            else:
                ctx = contextlib.nullcontext() if last else wrapped.no_sync()
            with ctx:
                loss = wrapped(t, l).sum() / (len(micro) * l.numel())
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), CLIP)
        opt.step()
        return total

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def state():
        tensors = [local(p) for p in model.parameters()]
        tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
        inner = opt.optim if kind == "zero-redundancy-optimizer" else opt
        tensors += [
            local(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    return step, state


#: torch.distributed function -> (kind, payload: the first tensor argument, or the last).
COLLECTIVES = {
    "all_reduce": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "reduce": ("reduce", 0),
    "all_gather": ("all_gather", -1),
    "all_gather_into_tensor": ("all_gather", -1),
    "all_gather_single": ("all_gather", -1),
    "reduce_scatter_tensor": ("reduce_scatter", -1),
    "reduce_scatter_single": ("reduce_scatter", -1),
}


@contextlib.contextmanager
def count_collectives(out: dict):
    """Count, while inside, each collective called through torch.distributed's Python functions
    (and megazero.collectives' bound all-gather / reduce-scatter): ``out[kind] = [calls,
    bytes]``, bytes = the payload tensor's ``numel x element_size`` (the input of a gather or
    scatter, as ``megazero.collectives.counter``). DDP's reducer calls gloo from C++: unseen."""
    import torch
    import torch.distributed as dist

    from megazero import collectives as C

    def wrap(fn, kind, which):
        def counted(*a, **k):
            tensors = [t for t in (*a, *k.values()) if isinstance(t, torch.Tensor)]
            calls_bytes = out.setdefault(kind, [0, 0])
            calls_bytes[0] += 1
            calls_bytes[1] += tensors[which].numel() * tensors[which].element_size()
            return fn(*a, **k)

        return counted

    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    bound = {"ALL_GATHER_OP": C.ALL_GATHER_OP, "REDUCE_SCATTER_OP": C.REDUCE_SCATTER_OP}
    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(fn, *COLLECTIVES[name]))
        C.ALL_GATHER_OP = wrap(bound["ALL_GATHER_OP"], "all_gather", -1)
        C.REDUCE_SCATTER_OP = wrap(bound["REDUCE_SCATTER_OP"], "reduce_scatter", -1)
        yield out
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        C.ALL_GATHER_OP, C.REDUCE_SCATTER_OP = bound["ALL_GATHER_OP"], bound["REDUCE_SCATTER_OP"]


def _system(name, args, dp_groups, tp_groups):
    """(step, state) of system ``name`` (one of DP_SYSTEMS / TP_SYSTEMS)."""
    if name == "floor":
        return _floor(args, dp_groups)
    if name.endswith("-sync-gather"):
        return _megazero(args, dp_groups, int(name[len("megazero-zero")]), False)
    if name.startswith("megazero-zero"):
        return _megazero(args, dp_groups, int(name[-1]))
    if name == "megazero-tp2":
        return _megazero(tp_args(args), tp_groups, 0)
    if name.startswith("deepspeed-zero"):
        from scripts.bench.bench_peers_optional import deepspeed_system

        return deepspeed_system(args, peer_model(args, dp_groups), int(name[-1]), ADAMW, CLIP, bucket_size(args))
    if name == "megatron-core-tp2":
        from model.spec import init_full_weights
        from scripts.bench.bench_peers_optional import megatron_core_system

        cfg = peer_gpt_config(tp_args(args))
        full = init_full_weights(cfg, 1234, tp_groups.tp_size)
        return megatron_core_system(tp_args(args), cfg, full, ADAMW, CLIP)
    return _peer(args, dp_groups, name)


def _batches(a, gen, ranks: int, rank: int) -> list:
    """4 steps of ``a.accum`` micro-batches ``(tokens, labels)`` ``[a.micro, a.seq]`` of this
    rank (``ranks`` = 1: the same batches on every rank, as tensor parallelism needs)."""
    import torch

    data = torch.randint(0, a.vocab, (4, ranks, a.accum, a.micro, a.seq + 1), generator=gen)
    return [[(d[:, :-1], d[:, 1:]) for d in data[i, rank % ranks]] for i in range(len(data))]


def run_rank(rank: int, world: int, args, names) -> dict:
    """Interleaved rounds of the systems ``names`` on every rank; returns per system: per-round
    step times (s), the last loss, model-state bytes."""
    import torch
    import torch.distributed as dist

    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from scripts.bench.bench_overhead import keep_freed_memory

    if args.allocator == "keep":  # every system on a caching allocator's footing (bench_overhead)
        keep_freed_memory()
    dp_groups = ProcessGroups.build(Topology(tp=1, pp=1, dp=world))
    tp_groups = ProcessGroups.build(Topology(tp=world, pp=1, dp=1)) if args.tp_layers else None
    gen = torch.Generator().manual_seed(5)
    batches = {"dp": _batches(args, gen, world, rank)}
    if args.tp_layers:
        batches["tp"] = _batches(tp_args(args), gen, 1, rank)
    systems = {name: _system(name, args, dp_groups, tp_groups) for name in names}
    out = {name: dict(times=[], cpu=[], loss=None, state=None, comm={}) for name in names}
    steps_done = 0
    for _ in range(args.rounds):
        for name in names:
            step, state = systems[name]
            micro_batches = batches["tp" if name in TP_SYSTEMS else "dp"]
            times = []
            for k in range(args.steps + 1):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = step(micro_batches[(steps_done + k) % len(micro_batches)])
                if k > 0:
                    times.append(time.perf_counter() - t0)
                    out[name]["cpu"].append(time.process_time() - c0)
            out[name]["times"].append(times)
            out[name]["loss"] = loss
            out[name]["state"] = state()
        steps_done += args.steps + 1
    for name in names:  # one more step, its collectives counted
        with count_collectives(out[name]["comm"]):
            systems[name][0](batches["tp" if name in TP_SYSTEMS else "dp"][0])
            systems[name][1]()  # waits for what the step left in flight
    return out


def tp_theory(a) -> str:
    """Megatron's tensor-parallel communication of one step (Shoeybi et al. 2019, sec. 3;
    ``scripts.bench.bench_comm.theory_tp``): per micro-batch 4 all-reduces of ``[B, T, H]`` fp32 per
    layer (2 forward, 2 backward), the embedding's and the LM head's input gradient's; the
    vocabulary-parallel cross-entropy's few ``[B, T]`` ones come on top."""
    calls = a.accum * (4 * a.layers + 2)
    return (
        f"theory tp (Megatron): {calls} all-reduces of [{a.micro}, {a.seq}, {a.hidden}] fp32 = "
        f"{calls * 4 * a.micro * a.seq * a.hidden / 1e6:.2f} MB, + cross-entropy [B, T] sums/max"
    )


def _comm(counts: dict) -> str:
    return "; ".join(f"{kind} {n} calls {b / 1e6:.2f} MB" for kind, (n, b) in sorted(counts.items()))


def report(res: list, names: list, args=None) -> list[str]:
    """The table, collectives of one step, per-round ratios, losses and final ``ratio
    ours/peer: R`` lines (one per pair whose both systems ran) from ``run_rank``'s results;
    ``args`` adds the tensor-parallel theory line."""
    r0 = res[0]
    lines = [
        "| system | median ms/step | per-round medians min-max | median CPU ms/step | "
        "model-state MiB per rank (max) | loss after the last step |",
        "|---|---|---|---|---|---|",
    ]
    med = {}
    for name in names:
        times = [t for rnd in r0[name]["times"] for t in rnd]
        rounds = [statistics.median(rnd) for rnd in r0[name]["times"]]
        med[name] = (statistics.median(times), rounds)
        state = max(r[name]["state"] for r in res) / 2**20
        lines.append(
            f"| {name} | {1e3 * med[name][0]:.1f} | {1e3 * min(rounds):.1f}-"
            f"{1e3 * max(rounds):.1f} | {1e3 * statistics.median(r0[name]['cpu']):.1f} | "
            f"{state:.2f} | {r0[name]['loss']:.6f} |"
        )
    for name in names:
        unseen = " (+ DDP's C++ reducer, not counted)" if name in ("ddp", "zero-redundancy-optimizer") else ""
        lines.append(f"collectives of one step, {name}: {_comm(r0[name]['comm']) or 'none'}{unseen}")
    if args is not None and "megazero-tp2" in names:
        lines.append(tp_theory(tp_args(args)))
    pairs = [(a, b) for a, b in PAIRS if a in med and b in med]
    for ours, peer in pairs:
        per_round = [a / b for a, b in zip(med[ours][1], med[peer][1])]
        lines.append(
            f"per-round ratios {ours}/{peer}: "
            + ", ".join(f"{x:.3f}" for x in per_round)
            + f" (min {min(per_round):.3f}, max {max(per_round):.3f})"
        )
    for ours, peer in pairs:
        a, b = r0[ours]["loss"], r0[peer]["loss"]
        lines.append(f"loss {ours} {a:.6f} vs {peer} {b:.6f}: relative difference {abs(a - b) / abs(b):.2e}")
    if "floor" in med:
        floor = med["floor"][0]
        for ours, peer in pairs:
            if peer in TP_SYSTEMS:
                continue
            lines.append(
                f"floor/{peer}: {floor / med[peer][0]:.2f} (the lowest {ours}/{peer} "
                f"any system could reach); overhead over the floor {ours} "
                f"{1e3 * (med[ours][0] - floor):.1f} ms vs {peer} "
                f"{1e3 * (med[peer][0] - floor):.1f} ms"
            )
    for ours, sync in OVERLAP_PAIRS:
        if ours in med and sync in med:
            lines.append(f"ratio {ours}/{sync}: {med[ours][0] / med[sync][0]:.2f}")
    for ours, peer in pairs:
        lines.append(f"ratio {ours}/{peer}: {med[ours][0] / med[peer][0]:.2f}")
    if "floor" in med:
        floor = med["floor"][0]
        for ours, peer in pairs:
            if peer in TP_SYSTEMS:
                continue
            over = med[peer][0] - floor  # a noisy round can put a peer at the floor
            value = f"{(med[ours][0] - floor) / over:.2f}" if over > 0 else "n/a (the peer's median is at the floor)"
            lines.append(f"overhead {ours}/{peer}: {value}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (dp for the ZeRO pairs, tp for tp2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per system per round")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary of both models")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch size per rank")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    ap.add_argument(
        "--sync-param-gather",
        action="store_true",
        help="also run megazero ZeRO-1/2 with the parameter all-gather inside the step",
    )
    ap.add_argument(
        "--bucket-size",
        type=int,
        default=None,
        help=f"gradient/all-gather bucket of every system, elements (default {DEFAULT_BUCKET}; "
        "DDP's bucket_cap_mb, DeepSpeed's reduce/allgather_bucket_size)",
    )
    ap.add_argument("--tp-layers", type=int, default=8, help="tp pair's layers (0: no tp pair)")
    ap.add_argument("--tp-hidden", type=int, default=512)
    ap.add_argument("--tp-heads", type=int, default=8)
    ap.add_argument("--tp-seq", type=int, default=128)
    ap.add_argument("--tp-micro", type=int, default=8, help="tp pair's micro-batch size")
    ap.add_argument("--tp-accum", type=int, default=2, help="tp pair's micro-batches per step")
    ap.add_argument(
        "--no-optional-peers",
        dest="optional",
        action="store_false",
        help="skip DeepSpeed and Megatron-core even when they are installed",
    )
    ap.add_argument(
        "--allocator",
        choices=("keep", "system"),
        default="keep",
        help="keep: glibc keeps freed heap memory in every rank (M_TOP_PAD 1 GiB, as a caching "
        "allocator does: scripts.bench.bench_overhead.keep_freed_memory); system: glibc's defaults",
    )
    args = ap.parse_args(argv)
    if args.tp_layers and args.world != 2:
        print(
            f"error: the tp pair runs at tp 2, got --world {args.world}: use --world 2 or --tp-layers 0",
            file=sys.stderr,
        )
        return 2
    from tests.support.distributed import run_distributed

    names, skipped = systems_to_run(args)
    for line in skipped:
        print(line)
    load = os.getloadavg()
    res = run_distributed(run_rank, args.world, args, names, timeout_s=7200, collective_timeout_s=1800)
    print(
        f"world {args.world}, fp32, {args.rounds} interleaved rounds x {args.steps} timed steps; "
        f"dp pairs: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}, "
        f"micro-batch {args.micro} x {args.accum} per rank, bucket {bucket_size(args)}; tp pair: "
        + (
            f"{args.tp_layers} layers, hidden {args.tp_hidden}, heads {args.tp_heads}, seq "
            f"{args.tp_seq}, micro-batch {args.tp_micro} x {args.tp_accum}"
            if args.tp_layers
            else "none"
        )
        + f"; allocator {args.allocator}; load average {load[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after"
    )
    print("\n".join(report(res, names, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
