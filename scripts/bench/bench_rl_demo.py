"""The RL demo's check (``bash scripts/rl_demo.sh``): the held-out curve of a ``--post-train grpo``
run against its start.

    python -m scripts.bench.bench_rl_demo --metrics RUN_DIR/metrics.jsonl [--steps 40] \\
        [--min-rise 0.2] [--length-tolerance 0.2]

Reads the run's ``"valid"`` records (one per ``validation at iteration N`` line: mean sampled and
greedy ``--reward`` over the held-out prompts, the accuracy with ``--reward exact``, and the mean
sampled response length in tokens), prints them as a Markdown table, then one line: ``PASS`` or
``FAIL``, the sampled accuracy's rise from iteration 0 to the last validation at or before
``--steps``, the greedy accuracy there against iteration 0, and the largest deviation of the
mean length from iteration 0's along the way. It passes when the rise is at least
``--min-rise`` (absolute), the greedy accuracy is not lower than at the start and every
length is within ``--length-tolerance`` (a share) of the start's. Exit code 0 on PASS, 1 on
FAIL, 2 when the file has no curve starting at iteration 0 (a run without ``--eval-iters``, a
held-out ``--split`` share, or resumed past 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Point:
    """One held-out validation: ``iteration``, ``sampled`` and ``greedy`` mean reward, ``length``
    (mean sampled response tokens)."""

    iteration: int
    sampled: float
    greedy: float
    length: float


@dataclass(frozen=True)
class Verdict:
    """``judge``'s result: ``rise`` (sampled, end minus start), ``greedy_change`` (end minus
    start), ``worst_length_ratio`` (the point's length over the start's farthest from 1),
    ``end`` (the iteration compared with 0) and ``passed``."""

    rise: float
    greedy_change: float
    worst_length_ratio: float
    end: int
    passed: bool

    def line(self) -> str:
        word = "PASS" if self.passed else "FAIL"
        return (
            f"{word}: sampled accuracy rise {self.rise:+.3f} by iteration {self.end}, greedy change "
            f"{self.greedy_change:+.3f}, response length ratio {self.worst_length_ratio:.3f} (farthest from 1)"
        )


def read_curve(path: str) -> list[Point]:
    """The held-out points of a metrics file (JSON lines; records of other kinds skipped), by
    iteration; a later record of the same iteration (a resumed run) replaces the earlier."""
    points = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "valid" and "sampled_reward" in r:
                it = int(r["iteration"])
                values = (float(r[k]) for k in ("sampled_reward", "greedy_reward", "sampled_length"))
                points[it] = Point(it, *values)
    return [points[k] for k in sorted(points)]


def judge(curve: list[Point], steps: int = 40, min_rise: float = 0.2, length_tolerance: float = 0.2) -> Verdict:
    """The demo's criteria (module docstring) over the points up to iteration ``steps``.
    Raises ValueError when the curve has no iteration 0 or no later point."""
    shown = [p for p in curve if p.iteration <= steps]
    if not shown or shown[0].iteration != 0 or len(shown) < 2:
        raise ValueError("the curve needs a validation at iteration 0 and one after it (--eval-iters K > 0)")
    start, end = shown[0], shown[-1]
    ratios = [p.length / start.length if start.length else float("inf") for p in shown]
    worst = max(ratios, key=lambda r: abs(r - 1))
    rise, greedy = end.sampled - start.sampled, end.greedy - start.greedy
    ok = rise >= min_rise and greedy >= 0 and abs(worst - 1) <= length_tolerance
    return Verdict(rise, greedy, worst, end.iteration, ok)


def table(curve: list[Point]) -> str:
    """The curve as a Markdown table (accuracies with ``--reward exact``)."""
    rows = ["| iteration | sampled accuracy | greedy accuracy | mean length (tokens) |", "|---|---|---|---|"]
    rows += [f"| {p.iteration} | {p.sampled:.3f} | {p.greedy:.3f} | {p.length:.2f} |" for p in curve]
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.bench_rl_demo", description=__doc__.split("\n")[0])
    p.add_argument("--metrics", required=True, help="RUN_DIR/metrics.jsonl of a --post-train grpo run")
    p.add_argument("--steps", type=int, default=40, help="the last iteration compared with iteration 0")
    p.add_argument("--min-rise", type=float, default=0.2, help="least rise of the sampled accuracy (absolute)")
    p.add_argument("--length-tolerance", type=float, default=0.2, help="largest relative change of the mean length")
    args = p.parse_args(argv)
    curve = read_curve(args.metrics)
    print(table(curve))
    try:
        verdict = judge(curve, args.steps, args.min_rise, args.length_tolerance)
    except ValueError as e:
        print(f"bench_rl_demo: {args.metrics}: {e}", file=sys.stderr)
        return 2
    print(verdict.line())
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
