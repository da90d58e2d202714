"""Replay of what ``executor.run_schedule`` does, for the bubble the executor should measure.

``schedules.simulate`` is the textbook model: an action starts as soon as its stage is free
and its input is computed, communication is free. The executor differs in two ways this
module models (pure Python, no communication):

1. Exchanges. The actions are grouped (``executor.exchange_groups``); before group k a stage
   posts, in ONE batched exchange, the sends of group k-1's outputs and the receives of group
   k's inputs, and waits for all of them (``p2p.StageLinks.exchange``). A send is matched
   when its receiver posts the receive (gloo and NCCL both hand a message over once both
   sides have posted it), so an exchange posted at time ``t`` completes at ``max(t, the
   posting times of the peers' matching exchanges) + latency`` (``latency``: one message's
   transfer, 0 when the exchange has nothing to move). Under the interleaved schedule a
   forward's output therefore leaves only after the backward grouped with it, and that
   forward waits for the backward's gradient too.
2. Costs per action. ``cost(stage, action)`` gives each chunk-forward ("F") and
   chunk-backward ("B") of each stage and micro-batch its own duration, so the first and the
   last stage can carry the embedding and the LM head with the loss, and a measured step can
   be replayed with its own durations.

The step ends when every stage has completed its last exchange (the loss broadcast that
follows in ``run_schedule`` is not modelled). Busy time is the sum of a stage's action costs,
idle time the rest of the makespan (waiting and exchanging), and the bubble fraction
``sum(idle) / (pp * makespan)`` as in ``simulate``.
"""

from __future__ import annotations

from typing import Callable, Union

from megazero.pipeline.executor import comm_plan, exchange_groups
from megazero.pipeline.schedules import Action, ScheduleError, SimResult, check_actions, is_split, peak_inflight_of


def _plan(schedules, pp_size: int, vp_size: int, layout: str = "interleaved"):
    """Per stage, per exchange k (0..groups): the tags it sends and receives; and per tag the
    (stage, exchange) that sends and receives it."""
    plans, where = [], {}
    for s, sched in enumerate(schedules):
        groups = exchange_groups(sched)
        ex = [([], []) for _ in range(len(groups) + 1)]  # (sends, recvs)
        for k, group in enumerate(groups):
            for i in group:
                recv, send = comm_plan(sched[i], s, pp_size, vp_size, layout)
                recv = None if recv and recv[0] == "self" else recv  # no exchange within a stage
                send = None if send and send[0] == "self" else send
                if recv:
                    ex[k][1].append(recv[2])
                    where.setdefault(recv[2], {})["recv"] = (s, k)
                if send:
                    ex[k + 1][0].append(send[2])
                    where.setdefault(send[2], {})["send"] = (s, k + 1)
        plans.append((groups, ex))
    return plans, where


def simulate_executor(
    schedules: list[list[Action]],
    pp_size: int,
    vp_size: int,
    cost: Callable[[int, Action], float],
    latency: Union[float, Callable[[int], float]] = 0.0,
    layout: str = "interleaved",
) -> SimResult:
    """Replay the executor's exchanges (module docstring); times in ``cost``'s unit.

    Args: ``schedules`` (one ``build_schedule`` list per stage), ``pp_size``, ``vp_size``,
    ``cost(stage, action)`` (duration of one action), ``latency`` (added to every
    exchange that moves a message; a callable gets the exchange's number of messages),
    ``layout`` (``partition.chunk_layout``; a message between two chunks of one stage is
    handed over locally, without an exchange). Returns a ``schedules.SimResult`` whose ``finish[s][k]``
    is the completion time of stage ``s``'s exchange ``k``. Raises ScheduleError for invalid
    schedules or when the exchanges deadlock.
    """
    if len(schedules) != pp_size:
        raise ScheduleError(f"{len(schedules)} schedules for {pp_size} stages")
    check_actions(schedules, vp_size)
    plans, where = _plan(schedules, pp_size, vp_size, layout)
    eager = any(is_split(sched) for sched in schedules)
    post = [[0.0] for _ in range(pp_size)]  # post[s][k]: when stage s posts exchange k
    done: list[list[float]] = [[] for _ in range(pp_size)]
    busy = [0.0] * pp_size

    def peer_post(tag, side):
        s, k = where[tag][side]
        return post[s][k] if k < len(post[s]) else None

    while any(len(done[s]) < len(plans[s][1]) for s in range(pp_size)):
        progressed = False
        for s in range(pp_size):
            groups, ex = plans[s]
            while len(done[s]) < len(ex):
                k = len(done[s])
                sends, recvs = ex[k]
                # zero-bubble schedules: sends are posted without waiting (executor.run_schedule)
                peers = ([] if eager else [peer_post(t, "recv") for t in sends]) + [peer_post(t, "send") for t in recvs]
                if any(p is None for p in peers):
                    break
                lat = 0.0 if not peers else latency(len(peers)) if callable(latency) else latency
                t = max([post[s][k]] + peers) + lat
                done[s].append(t)
                if k < len(groups):
                    work = sum(cost(s, schedules[s][i]) for i in groups[k])
                    busy[s] += work
                    post[s].append(t + work)
                progressed = True
        if not progressed:
            raise ScheduleError(
                "deadlock: stages wait at exchanges "
                + ", ".join(f"{s}:{len(done[s])}" for s in range(pp_size) if len(done[s]) < len(plans[s][1]))
            )
    makespan = max(d[-1] for d in done)
    idle = [makespan - b for b in busy]
    return SimResult(
        makespan=makespan,
        bubble_fraction=sum(idle) / (pp_size * makespan),
        peak_inflight=[peak_inflight_of(sched) for sched in schedules],
        busy=busy,
        idle=idle,
        finish=done,
    )
