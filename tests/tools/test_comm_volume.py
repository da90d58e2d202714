"""Communication volume equals theory: bytes counted in megazero/collectives.py for one
training step of each layout in scripts/bench/bench_comm.py (DP ZeRO-0/1/2, TP with and without
sequence parallelism, pipeline GPipe / 1F1B / interleaved, TP x ZeRO-2, context parallelism:
cp 2 ring and all-to-all on two ranks, tp 2 x cp 2 with SP on four, hybrid sharding dp 4 with
S 2 at ZeRO-1/2 on four, with the bytes crossing shard groups) equal the closed-form
functions there, kind by kind, on every rank; with expert parallelism, the world's all-to-all
bytes equal their closed form. One spawn per world size runs all its cases."""

import pytest

from scripts.bench import bench_comm as B


def _check(world):
    rows = B.measure([c for c in B.CASES if c[1] == world])
    assert len(rows) == world * sum(c[1] == world for c in B.CASES)
    for name, rank, _, counted, theory in rows:
        assert counted == theory, f"{name} rank {rank}: counted {counted}, theory {theory}"


def test_counted_bytes_equal_theory_on_two_ranks():
    _check(2)


@pytest.mark.slow
def test_counted_bytes_equal_theory_on_four_ranks():
    _check(4)


def test_theory_relations():
    """The closed forms relate as the papers say: SP moves the same [B, T, H] payloads as
    reduce-scatters that TP moved as all-reduces; ZeRO-2 reduce-scatters m times ZeRO-1."""
    s = B.shape_of(tp=2, global_batch=4)
    tp, sp = B.theory_tp(s, 0), B.theory_tp_sp(s, 0)
    ce = s.m * B.cross_entropy_bytes(s)
    assert sp["reduce_scatter"] == tp["all_reduce"] - ce - B.scalars(s, 0)["all_reduce"]
    assert sp["all_gather"] * s.tp == sp["reduce_scatter"]
    d = B.shape_of(dp=2)
    assert B.theory_zero2(d, 0)["reduce_scatter"] == d.m * B.theory_zero1(d, 0)["reduce_scatter"]
    assert B.theory_zero1(d, 0)["all_gather"] * d.dp == B.theory_zero1(d, 0)["reduce_scatter"]
    # context parallelism: the replicas are dp x cp, so cp 2 all-reduces the gradient buffer as
    # dp 2 does; its ring moves "send" bytes where a2a moves "all_to_all" ones; tp 2 x cp 2 runs
    # tp 2's sequence-parallel collectives on half the tokens of each sequence
    c, a = B.shape_of(cp=2, global_batch=4), B.shape_of(cp=2, cp_comm="a2a", global_batch=4)
    dp2 = B.shape_of(dp=2, global_batch=8)
    assert B.theory_cp(c, 0)["all_reduce"] == B.theory_dp_zero0(dp2, 0)["all_reduce"] and dp2.m == c.m
    assert set(B.theory_cp(c, 0)) == {"send", "all_reduce"} and set(B.theory_cp(a, 0)) == {"all_to_all", "all_reduce"}
    tc = B.theory_cp(B.shape_of(tp=2, cp=2, global_batch=4), 0)
    assert 2 * tc["reduce_scatter"] == sp["reduce_scatter"] and 2 * tc["all_gather"] == sp["all_gather"]


def test_moe_all_to_all_bytes_equal_theory_on_four_ranks():
    """Expert parallelism (dp 4 at EP 2 and 4, tp 2 dp 2 at EP 2, dropless): the world's
    all-to-all bytes of a step equal ``tp dp L M 8E + 16 H tp K`` (scripts/bench/bench_comm.py)."""
    from scripts.bench.bench_comm import measure_moe

    for name, counted, theory in measure_moe():
        assert counted == theory, (name, counted, theory)
