"""The slow lane's shards and rendezvous ports (tests/support/shards.py, tests/support/ports.py):
every slow test file falls to exactly one shard, the split balances the table's seconds, each shard
hands out ports only from its own block, and a run or launch whose port was taken runs once more."""

import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support import distributed
from tests.support.paths import REPO
from tests.support.ports import PORTS_ENV, free_port, launch_with_port, lost_its_port, port_block, with_master_port
from tests.support.shards import DEFAULT_S, SHARD_ENV, TABLE, assign, parse_shard, read_times


def slow_test_files() -> set:
    """Every test file that can hold a slow test: the slow folders' (tests/conftest.py marks them)
    and any other that names the marker."""
    files = {p for folder in ("layouts", "launcher") for p in (REPO / "tests" / folder).glob("test_*.py")}
    files |= {p for p in (REPO / "tests").rglob("test_*.py") if "mark.slow" in p.read_text()}
    return {p.relative_to(REPO).as_posix() for p in files}


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_every_slow_test_file_falls_to_exactly_one_shard(shards):
    files = slow_test_files()
    assert len(files) > 50  # the real lane, not an empty glob
    plan = assign(files, shards)
    assert set(plan) == files and set(plan.values()) == set(range(shards))
    assert assign(sorted(files, reverse=True), shards) == plan  # the same set, any order: the same split
    # each shard's own selection, as tests/conftest.py makes it, put back together: each file once
    kept = [f for s in range(shards) for f in files if plan[f] == s]
    assert sorted(kept) == sorted(files)


def test_the_split_balances_the_tables_seconds():
    times, files = read_times(), slow_test_files()
    plan = assign(files, 2, times)
    load = [sum(times.get(f, DEFAULT_S) for f in files if plan[f] == s) for s in (0, 1)]
    # longest first onto the lighter shard: the shards differ by at most the longest file
    assert abs(load[0] - load[1]) <= max(times.values())
    longest = max(files, key=lambda f: times.get(f, DEFAULT_S))
    assert plan[longest] == 0  # the longest file goes first, to shard 1
    assert assign(["b", "a", "c"], 2, {"a": 5, "b": 3, "c": 3}) == {"a": 0, "b": 1, "c": 1}


def test_the_table_names_only_files_that_exist():
    times = read_times(TABLE)
    assert len(times) > 50 and all(s >= 0 for s in times.values())
    assert [f for f in times if not (REPO / f).is_file()] == []


@pytest.mark.parametrize("value", ["2", "0/2", "3/2", "a/b", "1/0"])
def test_a_bad_shard_is_one_line_naming_the_variable(value):
    with pytest.raises(ValueError, match=rf"^{SHARD_ENV}=.* is not a shard; fix: I/N with 1 <= I <= N"):
        parse_shard(value)
    assert parse_shard(" 2/3 ") == (2, 3) and parse_shard("") is None


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_free_port_hands_out_only_its_blocks_ports_in_turn_skipping_a_busy_one(monkeypatch):
    # four free ports in a row below the shards' blocks and the kernel's range; the first held busy
    first = next(p for p in range(7000, 9000, 4) if all(_bindable(p + i) for i in range(4)))
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        monkeypatch.setenv(PORTS_ENV, f"{first}-{first + 3}")
        ports = [free_port() for _ in range(6)]
    assert first not in ports and set(ports) == {first + 1, first + 2, first + 3}
    assert ports[3:] == ports[:3]  # round the block in turn: no port twice before the others
    monkeypatch.setenv(PORTS_ENV, "10000-9999")
    with pytest.raises(ValueError, match=rf"^{PORTS_ENV}='10000-9999' is not a port block; fix: FIRST-LAST"):
        free_port()
    assert port_block("10000-14999") == (10000, 14999) and port_block("") is None


def test_with_master_port_adds_one_from_the_block_unless_args_name_one(monkeypatch):
    monkeypatch.setenv(PORTS_ENV, "15000-19999")
    args = with_master_port(["--tp", "2"])
    assert args[:3] == ["--tp", "2", "--master-port"] and 15000 <= int(args[3]) <= 19999
    assert with_master_port(["--master-port", "23456"]) == ["--master-port", "23456"]


def test_a_launch_that_lost_its_port_runs_once_more_on_a_fresh_one(monkeypatch):
    monkeypatch.setenv(PORTS_ENV, "15000-19999")
    calls = []

    def run(argv):
        calls.append(argv)
        port = argv[argv.index("--master-port") + 1]
        err = f"megazero: config error: --master-port {port} is already in use" if len(calls) == 1 else ""
        return subprocess.CompletedProcess(argv, 2 if err else 0, "", err)

    assert launch_with_port(run, ["--tp", "2"]).returncode == 0
    assert len(calls) == 2 and calls[0][3] != calls[1][3]
    calls.clear()  # a port the test chose itself: its failure is the result
    assert launch_with_port(run, ["--master-port", "12345"]).returncode == 2 and len(calls) == 1
    assert lost_its_port("torch.distributed.DistNetworkError: ... name: EADDRINUSE, message: address already in use")
    assert not lost_its_port("megazero: config error: --tp 3 does not divide")


def _rank_of(rank, world):
    return (rank, world)


def test_a_run_whose_port_was_taken_runs_once_more_on_a_fresh_one(monkeypatch):
    """Rank 0's store finds the port taken (another program bound it after the check): the run
    starts again on the next port and returns what the ranks return."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        handed = []

        def port():
            handed.append(held.getsockname()[1] if not handed else free_port())
            return handed[-1]

        monkeypatch.setattr(distributed, "free_port", port)
        assert distributed.run_distributed(_rank_of, 1, timeout_s=60) == [(0, 1)]
    assert len(handed) == 2 and handed[0] != handed[1]  # the taken port first, then a fresh one


def test_the_slow_lane_runs_sharded_by_default_and_whole_on_request():
    script = Path(REPO / "scripts" / "test.sh").read_text()
    assert re.search(r"SHARDS=\$\{MEGAZERO_TEST_SHARDS:-2\}", script)
    assert 'MEGAZERO_TEST_SHARD="$i/$SHARDS" MEGAZERO_TEST_PORTS=' in script
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "test.sh"), "--lane", "slow"],
        env={"MEGAZERO_TEST_SHARDS": "0", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "megazero: MEGAZERO_TEST_SHARDS=0 is not a shard count; fix: a whole number from 1 to 8 "
        "(1 runs the slow lane as one pytest process)\n"
    )
