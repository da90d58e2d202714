"""Each pipeline stage's measured busy and idle time beside the simulated bubble fraction.

For GPipe, 1F1B, the interleaved schedule (V = 2) and the zero-bubble ZB-H1 and ZB-V at pp 2
and 4, gloo ranks on this machine run forward and backward of a GPT (8 layers, hidden 192,
sequence 128, micro-batch 4, untied output layer as ZB-V needs, so every stage and chunk holds
whole layers) in interleaved rounds (each round runs every schedule once, so a change of load
touches them alike; the step-time column is the median over rounds with its spread) through
``megazero.pipeline.executor.run_schedule``,
which records each action's start and end (``busy=``) and each p2p exchange's posting and
completion (``exchanges=``). A step spans from the earliest stage's start (after a barrier)
to the latest stage's end; a stage is busy while it runs a forward or backward and idle
otherwise (waiting on a neighbour, exchanging). The measured bubble is
``sum(idle) / (pp * makespan)`` (``schedules.simulate``'s definition).

The comparison is with ``megazero.pipeline.replay.simulate_executor``, which models what the
executor does: its grouped exchanges (a stage posts the sends of one group with the
receives of the next and waits for all; a message moves once both sides posted it), each
action costing what it took on its stage in that step (so the embedding on the first stage
and the LM head and loss on the last are in), and every exchange costing the step's median
hand-over time of exchanges moving as many messages (completion minus the latest posting of
its messages: transfer and wake-up of a waiting rank, 1-10 ms on a loaded CPU). Each measured step is replayed; the
table shows the
medians over the steps and the per-step difference. Two textbook columns follow:
``schedules.simulate`` with one median forward / backward cost and free communication, and
the F : B : W = 1 : 1 : 1 costs, whose bubble is (pp-1)/(m+pp-1) for 1F1B, (pp-1)/(V m+pp-1)
interleaved. Under zb-* sends do not wait (only receives are replayed against their peers). Every
rank runs one torch thread (``tests.support.distributed``). On a shared CPU the ranks also compete
for cores: see docs/performance.md.

    python -m scripts.bench.bench_pipeline [--steps 5] [--micro-batches 8] [--pp 2 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))
MODEL = dict(
    vocab_size=128,
    num_layers=8,
    hidden_size=192,
    num_attention_heads=4,
    seq_length=128,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    make_vocab_size_divisible_by=8,
    tie_embeddings=False,
)  # zb-v needs untied
MICRO_BATCH = 4


def stage_times(rank: int, world: int, micro_batches: int, steps: int) -> list[dict]:
    """On every rank, for each schedule: per measured step, this stage's start, end and
    busy seconds, and its forward / backward action durations (the first step warms up)."""
    import time

    import torch
    import torch.distributed as dist

    from megazero.pipeline.executor import make_forward_step, run_schedule
    from megazero.pipeline.partition import chunk_layout, is_post_process, is_pre_process, layer_ids
    from megazero.pipeline.schedules import build_schedule
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from model.config import GPTConfig
    from model.gpt import GPTStage

    cfg = GPTConfig(**MODEL)
    groups = ProcessGroups.build(Topology(tp=1, pp=world, dp=1))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batches, MICRO_BATCH, cfg.seq_length + 1), generator=gen)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    setups = []
    for kind, vp in SCHEDULES:
        layout = chunk_layout(kind)
        chunks = [
            GPTStage(
                cfg,
                groups,
                layer_ids(cfg.num_layers, world, rank, vp, v, layout=layout),
                is_pre_process(rank, v),
                is_post_process(rank, world, v, vp, layout),
                7,
            )
            for v in range(vp)
        ]
        setups.append((kind, vp, layout, chunks, build_schedule(kind, micro_batches, world, rank, vp)))
    step = make_forward_step(micro_batches * MICRO_BATCH * cfg.seq_length)
    out = [dict(kind=kind, vp=vp, steps=[]) for kind, vp in SCHEDULES]
    for i in range(steps + 1):  # interleaved rounds: each round runs every schedule once
        for j, (kind, vp, layout, chunks, actions) in enumerate(setups):
            for c in chunks:
                c.zero_grad(set_to_none=True)
            busy, exchanges = [], []
            dist.barrier()
            t0 = time.perf_counter()
            run_schedule(
                actions,
                chunks,
                step,
                batches,
                groups,
                tensor_shape=(MICRO_BATCH, cfg.seq_length, cfg.hidden_size),
                dtype=torch.float32,
                num_microbatches=micro_batches,
                vp_size=vp,
                busy=busy,
                exchanges=exchanges,
                layout=layout,
                schedule_of=lambda q, k=kind, v=vp: build_schedule(k, micro_batches, world, q, v),
            )
            t1 = time.perf_counter()
            if i > 0:
                out[j]["steps"].append(
                    dict(
                        start=t0,
                        end=t1,
                        busy=sum(e - s for _, s, e in busy),
                        **{k: [e - s for kk, s, e in busy if kk == k] for k in "FBW"},
                        actions={(a.kind, a.microbatch, a.chunk): e - s for a, (_, s, e) in zip(actions, busy)},
                        exchanges=exchanges,
                    )
                )
    return out


def exchange_latency(recs: list[dict], eager: bool = False) -> dict[int, float]:
    """Median time (s) an exchange of one measured step took after its last message was posted
    on both sides, ``done - max(own post, the peers' posts of its messages)``, over the
    exchanges of every stage with the same number of messages (``recs``: the step's record
    of each stage): the hand-over and wake-up the replay adds per exchange. ``eager``
    (zero-bubble schedules): sends do not wait, only receives count."""
    posted, got = {}, {}  # (tag, "send" / "recv") -> post time; messages -> durations
    for x in recs:
        for post, _, sent, received in x["exchanges"]:
            posted.update({(t, "send"): post for t in sent})
            posted.update({(t, "recv"): post for t in received})
    for x in recs:
        for post, done, sent, received in x["exchanges"]:
            if eager and not received:
                continue
            peers = ([] if eager else [posted[(t, "recv")] for t in sent]) + [posted[(t, "send")] for t in received]
            got.setdefault(len(peers), []).append(done - max([post] + peers))
    return {n: statistics.median(v) for n, v in got.items()}


def replay_step(recs: list[dict], scheds, pp: int, vp: int, layout: str = "interleaved") -> tuple[float, dict]:
    """``(bubble, latency by messages)``: ``replay.simulate_executor`` of one measured step,
    each action costing what it took in that step, each exchange the step's median
    hand-over time of exchanges with as many messages."""
    from megazero.pipeline.replay import simulate_executor
    from megazero.pipeline.schedules import is_split

    latency = exchange_latency(recs, eager=is_split(scheds[0]))
    cost = lambda s, a: recs[s]["actions"][(a.kind, a.microbatch, a.chunk)]
    lat = lambda n: latency.get(n, 0.0)
    return simulate_executor(scheds, pp, vp, cost, lat, layout=layout).bubble_fraction, latency


def summarize(per_rank: list[list[dict]], pp: int, micro_batches: int) -> list[dict]:
    """One row per schedule: per-stage median busy / idle ms, measured bubble, the executor
    replay of each measured step and the per-step difference (medians over the steps)."""
    from megazero.pipeline.partition import chunk_layout
    from megazero.pipeline.schedules import build_schedule, simulate

    rows = []
    for j, (kind, vp) in enumerate(SCHEDULES):
        scheds = [build_schedule(kind, micro_batches, pp, r, vp) for r in range(pp)]
        layout = chunk_layout(kind)
        steps = len(per_rank[0][j]["steps"])
        bubbles, replays, lat, busy, idle = [], [], {}, [[] for _ in range(pp)], [[] for _ in range(pp)]
        spans = []
        for k in range(steps):
            recs = [per_rank[r][j]["steps"][k] for r in range(pp)]
            span = max(x["end"] for x in recs) - min(x["start"] for x in recs)
            spans.append(span)
            for r, x in enumerate(recs):
                busy[r].append(x["busy"])
                idle[r].append(span - x["busy"])
            bubbles.append(sum(span - x["busy"] for x in recs) / (pp * span))
            replay, latency = replay_step(recs, scheds, pp, vp, layout)
            replays.append(replay)
            for n, v in latency.items():
                lat.setdefault(n, []).append(v)
        diffs = [m - r for m, r in zip(bubbles, replays)]
        f = statistics.median(d for r in per_rank for s in r[j]["steps"] for d in s["F"])
        b = statistics.median(d for r in per_rank for s in r[j]["steps"] for d in s["B"])
        ws = [d for r in per_rank for s in r[j]["steps"] for d in s["W"]]
        w = statistics.median(ws) if ws else 0.0
        sim = simulate(
            scheds, pp, vp, forward_cost=f * vp, backward_cost=b * vp, weight_cost=w * vp, layout=layout
        ).bubble_fraction
        rows.append(
            dict(
                kind=kind,
                vp=vp,
                pp=pp,
                measured=statistics.median(bubbles),
                spread=(min(bubbles), max(bubbles)),
                simulated=sim,
                textbook=simulate(scheds, pp, vp, backward_cost=1.0, weight_cost=1.0, layout=layout).bubble_fraction,
                step_ms=statistics.median(spans) * 1e3,
                step_spread=(min(spans) * 1e3, max(spans) * 1e3),
                w_ms=w * 1e3,
                replay=statistics.median(replays),
                latency_ms={n: statistics.median(v) * 1e3 for n, v in sorted(lat.items())},
                diff=statistics.median(diffs),
                diff_spread=(min(diffs), max(diffs)),
                busy=[statistics.median(x) * 1e3 for x in busy],
                idle=[statistics.median(x) * 1e3 for x in idle],
                f_ms=f * 1e3,
                b_ms=b * 1e3,
            )
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="measured steps after one warm-up")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args(argv)
    from tests.support.distributed import run_distributed

    print(f"load average {os.getloadavg()[0]:.1f} at the start")
    print(
        "| pp | schedule | step ms (min-max) | F / B (/ W) ms per chunk | busy ms per stage | "
        "idle ms per stage | measured bubble (min-max) | executor replay (hand-over) | "
        "difference pp (min-max) | textbook model, measured costs | textbook 1:1:1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for pp in args.pp:
        per_rank = run_distributed(
            stage_times, pp, args.micro_batches, args.steps, timeout_s=1800, collective_timeout_s=600
        )
        for row in summarize(per_rank, pp, args.micro_batches):
            diff = 100 * row["diff"]
            worst = max(worst, abs(diff))
            name = row["kind"] + (f" V={row['vp']}" if row["vp"] > 1 else "")
            wcol = f" / {row['w_ms']:.1f}" if row["w_ms"] else ""
            print(
                f"| {pp} | {name} | {row['step_ms']:.0f} ({row['step_spread'][0]:.0f}-"
                f"{row['step_spread'][1]:.0f}) | {row['f_ms']:.1f} / {row['b_ms']:.1f}{wcol} | "
                f"{' / '.join(f'{x:.0f}' for x in row['busy'])} | "
                f"{' / '.join(f'{x:.0f}' for x in row['idle'])} | "
                f"{100 * row['measured']:.1f}% ({100 * row['spread'][0]:.1f}-"
                f"{100 * row['spread'][1]:.1f}) | {100 * row['replay']:.1f}% "
                f"({' / '.join(f'{v:.1f}' for v in row['latency_ms'].values())} ms for "
                f"{' / '.join(str(n) for n in row['latency_ms'])} messages) | {diff:+.1f} "
                f"({100 * row['diff_spread'][0]:+.1f} to "
                f"{100 * row['diff_spread'][1]:+.1f}) | {100 * row['simulated']:.1f}% | "
                f"{100 * row['textbook']:.1f}% |",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"largest |measured - executor replay|: {worst:.1f} percentage points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
