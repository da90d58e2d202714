"""megazero against torch's data-parallel peers: the same GPT, data and hyper-parameters.

Systems, each on the same gloo ranks (dp = world size), pairs compared:

- ``megazero-zero0`` / ``ddp`` (``torch.nn.parallel.DistributedDataParallel``);
- ``megazero-zero1`` / ``zero-redundancy-optimizer`` (DDP + ``torch.distributed.optim.
  ZeroRedundancyOptimizer`` over AdamW: optimizer states sharded, ZeRO-1);
- ``megazero-zero2`` / ``fsdp2`` (``torch.distributed.fsdp.fully_shard`` per transformer layer
  and the root; it shards parameters too, i.e. ZeRO-3, the nearest torch peer of ZeRO-2).

Every system trains a ``model.gpt.GPTStage`` built from the same seed (identical weights), on
the same random token batches, with AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay
0.1), gradient clipping at 1.0, ``--accum`` micro-batches per step (the peers skip the
gradient sync on all but the last: ``no_sync`` / ``set_requires_gradient_sync``), fp32.
Rounds are interleaved (round r runs every system in turn, ``--steps`` timed steps after one
warm-up step each); the median step time of a system is over all its timed steps of all
rounds, the spread is the range of its per-round medians. Model-state bytes per rank are the
parameters, gradients and optimizer states this rank holds after a step (``to_local()``
shards for FSDP2). DeepSpeed and Megatron-core are not run (not installed here).

    python scripts/bench_peers.py --rounds 5 --steps 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0
PAIRS = (("megazero-zero0", "ddp"), ("megazero-zero1", "zero-redundancy-optimizer"),
         ("megazero-zero2", "fsdp2"))


def _model(args, groups):
    from model.config import GPTConfig
    from model.gpt import GPTStage

    cfg = GPTConfig(vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden,
                    num_attention_heads=args.heads, seq_length=args.seq, hidden_dropout=0.0,
                    attention_dropout=0.0, make_vocab_size_divisible_by=8)
    return GPTStage(cfg, groups, range(args.layers), True, True, 1234)


def _megazero(args, groups, stage):
    """(step function, model-state bytes function) of megazero at ZeRO ``stage``."""
    from megazero import collectives as C
    from megazero.data_parallel.ddp import DataParallel
    from megazero.optim.zero import DistributedOptimizer

    model = _model(args, groups)
    ddp = DataParallel([model], groups, zero_stage=stage, bucket_size=args.hidden ** 2,
                       overlap_comm=True)
    opt = DistributedOptimizer(ddp, groups, lr=ADAMW["lr"], beta1=ADAMW["betas"][0],
                               beta2=ADAMW["betas"][1], eps=ADAMW["eps"],
                               weight_decay=ADAMW["weight_decay"], clip_grad=CLIP,
                               allgather_bucket_size=args.hidden ** 2)

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
        s = opt.model_state_bytes()
        return s["total"] - s["buckets"]
    return step, state


def _peer(args, groups, kind):
    """(step function, model-state bytes function) of a torch peer."""
    import contextlib

    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = _model(args, groups)
    if kind == "fsdp2":
        for layer in model.layers.values():
            fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.hidden ** 2 * 4 / 2 ** 20)
    if kind == "zero-redundancy-optimizer":
        opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    else:
        opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)

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
        tensors += [local(v) for s in inner.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.numel() > 1]
        return sum(t.numel() * t.element_size() for t in tensors)
    return step, state


SYSTEMS = ("megazero-zero0", "ddp", "megazero-zero1", "zero-redundancy-optimizer",
           "megazero-zero2", "fsdp2")


def run_rank(rank: int, world: int, args) -> dict:
    """Interleaved rounds on every rank; returns per system: per-round step times (s), the
    last loss, model-state bytes."""
    import torch
    import torch.distributed as dist

    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology

    groups = ProcessGroups.build(Topology(tp=1, pp=1, dp=world))
    gen = torch.Generator().manual_seed(5)
    data = torch.randint(0, args.vocab, (4, world, args.accum, args.micro, args.seq + 1), generator=gen)
    micro_batches = [[(d[:, :-1], d[:, 1:]) for d in data[i, rank]] for i in range(len(data))]
    systems = {}
    for name in SYSTEMS:
        stage = int(name[-1]) if name.startswith("megazero") else None
        systems[name] = _megazero(args, groups, stage) if stage is not None else _peer(args, groups, name)
    out = {name: dict(times=[], loss=None, state=None) for name in SYSTEMS}
    steps_done = 0
    for _ in range(args.rounds):
        for name in SYSTEMS:
            step, state = systems[name]
            times = []
            for k in range(args.steps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                loss = step(micro_batches[(steps_done + k) % len(micro_batches)])
                if k > 0:
                    times.append(time.perf_counter() - t0)
            out[name]["times"].append(times)
            out[name]["loss"] = loss
            out[name]["state"] = state()
        steps_done += args.steps + 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (all data-parallel)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per system per round")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4, help="micro-batch size per rank")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    args = ap.parse_args(argv)
    from tests.distributed import run_distributed

    res = run_distributed(run_rank, args.world, args, timeout_s=3600, collective_timeout_s=1800)
    r0 = res[0]
    print(f"world {args.world}, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"vocab {args.vocab}, micro-batch {args.micro} x {args.accum} per rank, fp32, "
          f"{args.rounds} interleaved rounds x {args.steps} timed steps")
    print("| system | median ms/step | per-round medians min-max | model-state MiB per rank (max) | "
          "loss after the last step |")
    print("|---|---|---|---|---|")
    med = {}
    for name in SYSTEMS:
        times = [t for rnd in r0[name]["times"] for t in rnd]
        rounds = [statistics.median(rnd) for rnd in r0[name]["times"]]
        med[name] = (statistics.median(times), rounds)
        state = max(r[name]["state"] for r in res) / 2 ** 20
        print(f"| {name} | {1e3 * med[name][0]:.1f} | {1e3 * min(rounds):.1f}-{1e3 * max(rounds):.1f} | "
              f"{state:.2f} | {r0[name]['loss']:.6f} |")
    for ours, peer in PAIRS:
        per_round = [a / b for a, b in zip(med[ours][1], med[peer][1])]
        print(f"per-round ratios {ours}/{peer}: " + ", ".join(f"{x:.3f}" for x in per_round))
    for ours, peer in PAIRS:
        print(f"ratio {ours}/{peer}: {med[ours][0] / med[peer][0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
