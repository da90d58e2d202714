"""Pipeline schedules as data: the ordered forward/backward actions of one stage.

A schedule is a ``list[Action]`` per stage; it does no communication (the executor in
``executor.py`` derives the sends and receives from it). Kinds:

- ``none``: no pipelining (pp 1): F0 B0 F1 B1 ... (gradient accumulation).
- ``gpipe`` (Huang et al. 2019, GPipe): all forwards, then all backwards. Stage 0 keeps
  the activations of all ``m`` micro-batches alive.
- ``1f1b`` (Narayanan et al. 2021, PipeDream-Flush, sec. 2.2.1): stage ``p`` runs
  ``min(pp - p - 1, m)`` warm-up forwards, then alternates one forward and one backward
  (steady phase), then runs the remaining backwards (cool-down). At most ``pp``
  micro-batches are in flight on a stage; the bubble equals GPipe's.
- ``interleaved`` (Narayanan et al. 2021, sec. 2.2.2): each stage holds ``V`` model chunks;
  Megatron-LM's order: forwards go through chunk 0 for ``pp`` micro-batches, then chunk 1
  for the same ``pp`` micro-batches, ...; backwards visit the chunks in reverse. Warm-up of
  ``(pp - p - 1) * 2 + (V - 1) * pp`` chunk-forwards (capped at ``m * V``), then 1F1B over
  chunk-micro-batches. Needs ``m % pp == 0``. The bubble shrinks by ``V``.

- ``zb-h1`` and ``zb-v`` (Qi et al. 2024, zero bubble; ``zero_bubble.py``): the backward
  split into "B" (input gradient) and "W" (weight gradient); zb-v holds two chunks per stage
  in a V (``partition.chunk_layout``).

``simulate`` replays the schedules of all stages with a cost per action, checking that the
schedules are executable (no backward before its forward, cross-stage order without
deadlock) and measuring makespan, bubble and the activations kept alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megazero.pipeline.partition import stage_of, virtual_stage
from megazero.pipeline.zero_bubble import zb_h1, zb_v

KINDS = ("none", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
ZERO_BUBBLE = ("zb-h1", "zb-v")


class ScheduleError(ValueError):
    """A schedule that cannot run: missing or repeated actions, bad order, or deadlock."""


@dataclass(frozen=True)
class Action:
    """One step of a stage: forward ("F"), backward ("B"; under a zero-bubble schedule only
    the input gradient) or weight gradient ("W", zero-bubble only) of ``microbatch`` through
    model chunk ``chunk``, in phase "warmup", "steady" or "cooldown" (GPipe: forwards are
    warm-up, backwards cool-down; "none": every action is steady)."""

    kind: str
    microbatch: int
    chunk: int = 0
    phase: str = "steady"

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}, {self.phase})"


def build_schedule(kind: str, num_microbatches: int, pp_size: int, pp_rank: int, vp_size: int = 1) -> list[Action]:
    """The ordered actions of stage ``pp_rank`` for one training step.

    Raises ValueError when ``kind`` is unknown, sizes are below 1, ``none`` is used with
    ``pp_size > 1``, ``vp_size > 1`` with a non-interleaved kind (zb-v needs exactly 2), a
    zero-bubble kind runs at ``pp_size`` 1, or interleaved gets
    ``num_microbatches % pp_size != 0`` (the fix: choose --global-batch-size /
    (--micro-batch-size x dp) as a multiple of --pp).
    """
    m, p, r = num_microbatches, pp_size, pp_rank
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; choose one of {KINDS}")
    if m < 1 or p < 1 or not 0 <= r < p or vp_size < 1:
        raise ValueError(
            f"bad schedule sizes: num_microbatches {m}, pp {p}, pp_rank {r}, virtual-pipeline-size {vp_size}"
        )
    if kind in ZERO_BUBBLE:
        return _zero_bubble(kind, m, p, r, vp_size)
    if kind != "interleaved" and vp_size != 1:
        raise ValueError(f"--virtual-pipeline-size {vp_size} needs the interleaved schedule (got {kind!r})")
    if kind == "none":
        if p != 1:
            raise ValueError(
                f"schedule 'none' runs without pipelining; --pp is {p}: choose '1f1b', 'gpipe' or 'interleaved'"
            )
        return [a for i in range(m) for a in (Action("F", i), Action("B", i))]
    if kind == "gpipe":
        return [Action("F", i, 0, "warmup") for i in range(m)] + [Action("B", i, 0, "cooldown") for i in range(m)]
    if kind == "1f1b":
        return _one_f_one_b(m, min(p - r - 1, m), lambda k, fwd: (k, 0))
    return _interleaved(m, p, r, vp_size)


def _zero_bubble(kind: str, m: int, p: int, r: int, vp_size: int) -> list[Action]:
    if p < 2:
        raise ValueError(
            f"--pipeline-schedule {kind} needs --pp >= 2 (got --pp {p}); fix: use --pipeline-schedule 1f1b"
        )
    want = 2 if kind == "zb-v" else 1
    if vp_size != want:
        raise ValueError(
            f"--pipeline-schedule {kind} runs {want} model chunk(s) per stage, got --virtual-pipeline-size {vp_size}"
        )
    rows = [zb_h1(m, p, r)] if kind == "zb-h1" else [zb_v(m, p)[r]]
    return [Action(*a) for a in rows[0]]


def _one_f_one_b(total: int, warmup: int, unit) -> list[Action]:
    """PipeDream-Flush order over ``total`` units; ``unit(k, forward) -> (mb, chunk)``."""
    out = [Action("F", *unit(k, True), "warmup") for k in range(warmup)]
    for i in range(total - warmup):
        out.append(Action("F", *unit(warmup + i, True), "steady"))
        out.append(Action("B", *unit(i, False), "steady"))
    out += [Action("B", *unit(k, False), "cooldown") for k in range(total - warmup, total)]
    return out


def _interleaved(m: int, p: int, r: int, v: int) -> list[Action]:
    if v < 2:
        raise ValueError("the interleaved schedule needs --virtual-pipeline-size >= 2")
    if m % p != 0:
        raise ValueError(
            f"the interleaved schedule needs the number of micro-batches ({m} = "
            f"--global-batch-size / (--micro-batch-size x dp)) to be a multiple of --pp {p}: "
            f"change --global-batch-size or --micro-batch-size"
        )

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)  # p*v chunk-forwards per group of p micro-batches
        chunk = within // p
        return group * p + within % p, (chunk if forward else v - 1 - chunk)

    warmup = min((p - r - 1) * 2 + (v - 1) * p, m * v)
    return _one_f_one_b(m * v, warmup, unit)


def forward_only_schedule(num_microbatches: int, vp_size: int = 1) -> list[Action]:
    """Evaluation: every micro-batch's forward through each chunk in turn, no backward.

    Each stage runs F(mb, chunk) for mb in order and, inside it, chunk in order; a
    micro-batch walks the virtual stages 0, 1, ... in sequence, so no stage waits on a
    message that is sent after its own next receive.
    """
    return [Action("F", mb, c, "warmup") for mb in range(num_microbatches) for c in range(vp_size)]


def is_split(actions: list[Action]) -> bool:
    """True when the backward is split into B and W (a zero-bubble schedule)."""
    return any(a.kind == "W" for a in actions)


def last_backward_index(actions: list[Action]) -> dict[int, int]:
    """chunk -> index in ``actions`` of that chunk's last gradient-producing action: its last
    W under a zero-bubble schedule (the parameters' gradients arrive in W), else its last B."""
    kind = "W" if is_split(actions) else "B"
    return {a.chunk: i for i, a in enumerate(actions) if a.kind == kind}


@dataclass
class SimResult:
    """Outcome of ``simulate``. Times are in the unit of ``forward_cost``.

    ``makespan``: end of the last action; ``busy[s]``/``idle[s]``: compute and idle time of
    stage ``s`` within the makespan; ``bubble_fraction = sum(idle) / (pp * makespan)``;
    ``peak_inflight[s]``: most (micro-batch, chunk) pairs whose activations stage ``s`` holds
    at once (``peak_inflight_of``); ``finish[s][i]``: end time of action ``i`` of stage ``s``.
    """

    makespan: float
    bubble_fraction: float
    peak_inflight: list[int]
    busy: list[float]
    idle: list[float]
    finish: list[list[float]] = field(repr=False)


def simulate(
    schedules: list[list[Action]],
    pp_size: int,
    vp_size: int = 1,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    weight_cost: float = 0.0,
    layout: str = "interleaved",
) -> SimResult:
    """Replay one schedule per stage with zero-cost communication; return timings.

    A chunk-forward costs ``forward_cost / vp_size``; a chunk-backward ``(backward_cost +
    weight_cost) / vp_size``, or, split (zero-bubble), B ``backward_cost / vp_size`` and W
    ``weight_cost / vp_size`` (a chunk holds 1/V of the stage's layers), so every stage
    computes ``m * (forward_cost + backward_cost + weight_cost)`` whatever V is. An action
    starts when its stage is free and its dependencies are done: F of (mb, virtual stage s)
    needs F of (mb, s-1); B of (mb, s) needs B of (mb, s+1); W of (mb, s) needs B of (mb, s);
    virtual stages follow ``layout`` (``partition.virtual_stage``). The bubble fraction is
    the idle share of all stages' time, ``sum(idle) / (pp * makespan)``; with ``m``
    micro-batches it is (pp-1)/(m+pp-1) for GPipe and 1F1B and (pp-1)/(V*m+pp-1) for the
    interleaved schedule.

    Raises ScheduleError naming the stage and action when ``check_actions`` fails or the
    stages deadlock (every unfinished stage waits on an action never reached).
    """
    if len(schedules) != pp_size:
        raise ScheduleError(f"{len(schedules)} schedules for {pp_size} stages")
    check_actions(schedules, vp_size)
    split = any(is_split(sched) for sched in schedules)
    b = backward_cost if split else backward_cost + weight_cost
    cost = {"F": forward_cost / vp_size, "B": b / vp_size, "W": weight_cost / vp_size}
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) -> finish time
    pos, free = [0] * pp_size, [0.0] * pp_size
    finish: list[list[float]] = [[] for _ in range(pp_size)]
    dep_of = lambda a, s: _dependency(a, s, pp_size, vp_size, layout)
    while any(pos[s] < len(schedules[s]) for s in range(pp_size)):
        progressed = False
        for s in range(pp_size):
            while pos[s] < len(schedules[s]):
                a = schedules[s][pos[s]]
                dep = dep_of(a, s)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                free[s] = start + cost[a.kind]
                done[(a.kind, a.microbatch, virtual_stage(s, pp_size, a.chunk, layout))] = free[s]
                finish[s].append(free[s])
                pos[s] += 1
                progressed = True
        if not progressed:
            raise ScheduleError(
                "deadlock: "
                + "; ".join(
                    f"stage {s} waits at {schedules[s][pos[s]]} for "
                    f"{_describe(dep_of(schedules[s][pos[s]], s), pp_size, layout)}"
                    for s in range(pp_size)
                    if pos[s] < len(schedules[s])
                )
            )
    makespan = max(free)
    busy = [sum(cost[a.kind] for a in sched) for sched in schedules]
    idle = [makespan - b for b in busy]
    return SimResult(
        makespan=makespan,
        bubble_fraction=sum(idle) / (pp_size * makespan),
        peak_inflight=[peak_inflight_of(sched) for sched in schedules],
        busy=busy,
        idle=idle,
        finish=finish,
    )


def _dependency(a: Action, stage: int, pp_size: int, vp_size: int, layout: str = "interleaved"):
    """(kind, mb, virtual stage) that must finish before ``a`` may start, or None."""
    s = virtual_stage(stage, pp_size, a.chunk, layout)
    if a.kind == "F":
        return ("F", a.microbatch, s - 1) if s > 0 else None
    if a.kind == "W":
        return ("B", a.microbatch, s)
    return ("B", a.microbatch, s + 1) if s < pp_size * vp_size - 1 else None


def _describe(dep, pp_size: int, layout: str = "interleaved") -> str:
    kind, mb, s = dep
    stage, chunk = stage_of(s, pp_size, layout)
    return f"{kind}(mb={mb}, chunk={chunk}) on stage {stage}"


def check_actions(schedules: list[list[Action]], vp_size: int) -> None:
    """Each stage (one action list per pipeline rank) runs every (micro-batch, chunk) exactly
    once as F and once as B, F before B, and all stages run the same set. A split backward
    (any "W" on a stage) also runs each once as W, after its B, and each chunk's W's in
    micro-batch order (the order 1F1B accumulates gradients in: ``weight_grad.py``). Raises
    ScheduleError naming the stage and the action otherwise."""
    expected = None
    for s, sched in enumerate(schedules):
        seen: dict[str, set] = {"F": set(), "B": set(), "W": set()}
        last_w: dict[int, int] = {}
        for a in sched:
            key = (a.microbatch, a.chunk)
            if a.kind not in seen or not 0 <= a.chunk < vp_size:
                raise ScheduleError(f"stage {s}: invalid action {a}")
            if key in seen[a.kind]:
                raise ScheduleError(f"stage {s}: {a} appears twice")
            before = {"B": ("F", "forward"), "W": ("B", "backward (B)")}.get(a.kind)
            if before and key not in seen[before[0]]:
                raise ScheduleError(f"stage {s}: {a} runs before its {before[1]}")
            if a.kind == "W":
                if a.microbatch < last_w.get(a.chunk, -1):
                    raise ScheduleError(
                        f"stage {s}: {a} after W of micro-batch {last_w[a.chunk]}: weight gradients out of order"
                    )
                last_w[a.chunk] = a.microbatch
            seen[a.kind].add(key)
        if seen["F"] != seen["B"]:
            raise ScheduleError(f"stage {s}: forwards without backward: {sorted(seen['F'] - seen['B'])}")
        if seen["W"] and seen["W"] != seen["B"]:
            raise ScheduleError(f"stage {s}: backwards without W: {sorted(seen['B'] - seen['W'])}")
        if expected is not None and seen["F"] != expected:
            raise ScheduleError(
                f"stage {s} runs micro-batches/chunks {sorted(seen['F'])}, stage 0 runs {sorted(expected)}"
            )
        expected = seen["F"]


def peak_inflight_of(sched: list[Action]) -> int:
    """The most micro-batches (x chunks) one stage's action list holds activations for at
    once: from F to B, or to W when the backward is split (B leaves the saved tensors that W
    reads, ``weight_grad.py``)."""
    release = "W" if is_split(sched) else "B"
    alive = peak = 0
    for a in sched:
        alive += 1 if a.kind == "F" else -1 if a.kind == release else 0
        peak = max(peak, alive)
    return peak


def inflight_pairs_of(sched: list[Action]) -> tuple[tuple[int, int], ...]:
    """What one stage's action list holds at the moments that can be its memory peak: the
    pairs ``(kept, awaiting_weight)`` after each action, ``kept`` the (micro-batch, chunk)
    pairs between F and B (all their activations), ``awaiting_weight`` those between B and
    W (a split backward's weight-operator inputs and output gradients, ``weight_grad.py``),
    reduced to the pairs no other pair exceeds in both (so the planner's maximum over them
    is the peak whatever the bytes of each). ``((peak_inflight_of, 0),)`` without W."""
    kept = waiting = 0
    seen = set()
    for a in sched:
        kept += {"F": 1, "B": -1}.get(a.kind, 0)
        waiting += {"B": 1, "W": -1}.get(a.kind, 0) if is_split(sched) else 0
        seen.add((kept, waiting))
    return tuple(sorted(p for p in seen if not any(o != p and o[0] >= p[0] and o[1] >= p[1] for o in seen)))
