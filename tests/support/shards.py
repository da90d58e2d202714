"""Shards of the slow lane: which of scripts/test.sh's pytest processes runs which test file.

scripts/test.sh runs the slow lane as N pytest processes side by side (``MEGAZERO_TEST_SHARDS``,
default 2): the multi-rank tests wait on loopback communication much of the time, so one process
leaves the 2 cores partly idle. Shard I of N (``MEGAZERO_TEST_SHARD=I/N``, I from 1) collects the
whole lane like the others and keeps the tests of the files ``assign`` gives it (tests/conftest.py
deselects the rest). ``assign`` depends only on the set of files that hold selected slow tests,
which every shard collects alike, so each such file runs in exactly one shard; a file without slow
tests stays in shard 1. The split is by file, so a module's fixtures are built once.

The split is longest-processing-time first (Graham, "Bounds on multiprocessing timing anomalies",
1969): files by their seconds in ``slow_times.txt``, longest first, each onto the shard with the
fewest seconds so far. A file the table lacks counts ``DEFAULT_S``. A sharded lane writes each
file's measured seconds in the same format (``TimesRecorder``), to refresh the table with.
"""

from __future__ import annotations

import re
from pathlib import Path

SHARD_ENV = "MEGAZERO_TEST_SHARD"
TABLE = Path(__file__).with_name("slow_times.txt")
DEFAULT_S = 10.0


def parse_shard(value: str | None) -> tuple[int, int] | None:
    """(I, N) from ``MEGAZERO_TEST_SHARD``'s ``I/N`` (1 <= I <= N), None for an unset or empty value.

    Raises ValueError with one line naming the variable and the fix."""
    if not value:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", value)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(
            f"{SHARD_ENV}={value!r} is not a shard; fix: I/N with 1 <= I <= N, e.g. 1/2 (scripts/test.sh sets it)"
        )
    return int(m.group(1)), int(m.group(2))


def read_times(path: Path = TABLE) -> dict[str, float]:
    """File (relative to the repository root) -> seconds, from lines ``SECONDS PATH`` ('#' starts a comment)."""
    times = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            seconds, name = line.split()
            times[name] = float(seconds)
    return times


def assign(files, shards: int, times: dict[str, float] | None = None) -> dict[str, int]:
    """File -> shard index (0 .. shards-1) for the test files ``files``: longest first onto the
    least loaded shard (ties: the lower index). The same set of files gives the same answer in
    any order."""
    times = read_times() if times is None else times
    load = [0.0] * shards
    plan = {}
    for name in sorted(set(files), key=lambda f: (-times.get(f, DEFAULT_S), f)):
        shard = min(range(shards), key=lambda s: (load[s], s))
        plan[name] = shard
        load[shard] += times.get(name, DEFAULT_S)
    return plan


class TimesRecorder:
    """A pytest plugin that adds up each test file's seconds (set-up, call and teardown of its
    tests) and writes them at the session's end to ``path`` in ``slow_times.txt``'s format."""

    def __init__(self, path):
        self.path = Path(path)
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::", 1)[0]
        self.seconds[name] = self.seconds.get(name, 0.0) + report.duration

    def pytest_sessionfinish(self):
        rows = sorted(self.seconds.items(), key=lambda kv: (-kv[1], kv[0]))
        self.path.write_text("".join(f"{s:.0f} {name}\n" for name, s in rows))
