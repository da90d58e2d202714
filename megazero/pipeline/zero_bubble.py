"""Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR): the
backward is split into B (input gradient, what the previous stage waits for) and W (weight
gradient, what nobody waits for; ``weight_grad.py``), and W fills the bubbles.

- ``zb-h1`` (sec. 3.1, "ZB-H1"): 1F1B's warm-up of ``pp - r - 1`` forwards on stage ``r``,
  then F and B alternate as in 1F1B, while stage ``r`` keeps up to ``r`` weight passes pending
  (a W runs after a B as soon as more than ``r`` are pending), and the pending W's close the
  cool-down. The last stage, which 1F1B leaves idle longest at the end, defers the most.
  With F = B = W each stage idles ``pp - 1`` units instead of 1F1B's ``3 (pp - 1)``: a third
  of the bubble; makespan ``3 m + pp - 1`` for ``m >= pp``. A micro-batch holds its
  activations from F to W, so stage ``r`` holds ``pp - r - 1 + 1 + r = pp`` at most: 1F1B's
  peak (stage 0's ``pp``) on every stage.
- ``zb-v`` (sec. 5, "ZB-V"): two model chunks per stage in a V (``partition.py``, layout
  "v"); the order is made by list scheduling with unit costs (F = B = W = 1 per chunk):
  whenever a stage is free it runs an available B, else a forward of chunk 1, else of chunk
  0 (while fewer than ``2 pp`` chunk-activations are alive: the activation memory of 1F1B's
  first stage, each chunk holding half a stage's layers), else a pending W; ties go to the
  lowest micro-batch. At unit costs every stage is busy from its first forward to the end
  but for the start-up delay: bubble ``(pp - 1) / (6 m + pp - 1)`` (4 % at pp 2, m 4).

  That is a lower bound for any schedule with a synchronous step boundary: stage ``pp - 1``
  can start nothing before micro-batch 0 has passed the ``pp - 1`` chunk-forwards ahead of
  it (everything it runs depends on that chain), and every stage has ``6 m`` unit actions
  (F, B, W of two chunks per micro-batch), so the makespan is at least ``6 m + pp - 1`` and
  the idle fraction ``1 - 6 m / makespan`` at least ``(pp - 1) / (6 m + pp - 1)``. The list
  schedule attains it at pp 2-4 for every m >= pp (tests/unit/test_zero_bubble.py; at pp 8 it
  misses by a few units at m 9, 10, 13). The paper's "zero bubble" for ZB-V counts this
  parallelogram as free because its optimizer post-validation ("bypassing optimizer
  synchronizations") lets the next
  iteration's forwards start while the last stage finishes; megazero's step (gradient norm,
  optimizer) is synchronous, so it is a bubble here. Hence "< 5 % at m = 2 pp" holds at pp
  2 (4 %) but not at pp 3 (5.3 %) or pp 4 (5.9 % at m 8): below 5 % needs
  ``m > 19 (pp - 1) / 6``, m >= 10 at pp 4.

Both run each chunk's W's in micro-batch order, so every parameter's gradient is accumulated
in the order 1F1B accumulates it (``weight_grad.py``: bit-identical gradients).
"""

from __future__ import annotations

from megazero.pipeline.partition import virtual_stage


def _phases(actions: list[tuple]) -> list[tuple]:
    """Attach phases: before the first B "warmup", after the last F "cooldown", else "steady"."""
    first_b = next(i for i, a in enumerate(actions) if a[0] == "B")
    last_f = max(i for i, a in enumerate(actions) if a[0] == "F")
    return [(*a, "warmup" if i < first_b else "cooldown" if i > last_f else "steady") for i, a in enumerate(actions)]


def zb_h1(m: int, p: int, r: int) -> list[tuple]:
    """ZB-H1 of stage ``r``: ``(kind, microbatch, chunk, phase)`` tuples (module docstring)."""
    warmup = min(p - r - 1, m)
    out, next_w = [("F", i, 0) for i in range(warmup)], 0
    for i in range(m - warmup):
        out += [("F", warmup + i, 0), ("B", i, 0)]
        if i + 1 - next_w > r:
            out.append(("W", next_w, 0))
            next_w += 1
    for i in range(m - warmup, m):
        out.append(("B", i, 0))
        if i + 1 - next_w > r:
            out.append(("W", next_w, 0))
            next_w += 1
    out += [("W", k, 0) for k in range(next_w, m)]
    return _phases(out)


def zb_v(m: int, p: int) -> list[list[tuple]]:
    """ZB-V of every stage (one list per stage; module docstring). Pure and deterministic,
    so each rank computes the same orders and keeps its own."""
    last = 2 * p - 1
    done: dict[tuple, int] = {}  # (kind, mb, virtual stage) -> finish time
    nxt = [dict.fromkeys(("F0", "F1", "B0", "B1", "W0", "W1"), 0) for _ in range(p)]
    alive, out = [0] * p, [[] for _ in range(p)]
    t = 0
    while any(len(o) < 6 * m for o in out):
        for r in range(p):
            a = _zb_v_pick(r, t, m, p, last, nxt[r], done, alive[r] < 2 * p)
            if a is None:
                continue
            kind, mb, c = a
            done[(kind, mb, virtual_stage(r, p, c, "v"))] = t + 1
            nxt[r][f"{kind}{c}"] += 1
            alive[r] += {"F": 1, "B": 0, "W": -1}[kind]
            out[r].append(a)
        t += 1
        if t > 12 * m * p + 8 * p:  # every action is placed well before this at unit cost
            raise RuntimeError(f"zb-v list scheduling made no progress (m {m}, pp {p})")
    return [_phases(o) for o in out]


def _zb_v_pick(r, t, m, p, last, nxt, done, may_forward):
    """The action stage ``r`` starts at time ``t`` (unit costs), or None to wait."""

    def ready(key):
        return done.get(key, t + 1) <= t

    def avail(kind, c):
        mb = nxt[f"{kind}{c}"]
        if mb >= m:
            return None
        v = virtual_stage(r, p, c, "v")
        if kind == "F":
            ok = may_forward and (v == 0 or ready(("F", mb, v - 1)))
        elif kind == "B":
            ok = ready(("F", mb, v)) if v == last else ready(("B", mb, v + 1))
        else:
            ok = ready(("B", mb, v))
        return (kind, mb, c) if ok else None

    for options in ((("B", 0), ("B", 1)), (("F", 1),), (("F", 0),), (("W", 1), ("W", 0))):
        found = [a for a in (avail(k, c) for k, c in options) if a is not None]
        if found:
            return min(found, key=lambda a: (a[1], -a[2] if a[0] == "W" else a[2]))
    return None
