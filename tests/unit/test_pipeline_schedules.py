"""Pure tests of pipeline partitioning, schedules and their communication plan (no processes)."""

import pytest

from megazero.pipeline.executor import comm_plan, exchange_groups
from megazero.pipeline.partition import (
    PartitionError,
    is_post_process,
    is_pre_process,
    layer_ids,
    parse_layer_split,
    validate_partition,
)
from megazero.pipeline.schedules import Action, ScheduleError, build_schedule, last_backward_index, simulate

CASES = [(kind, p, m) for kind in ("gpipe", "1f1b") for p in (2, 4, 8) for m in (1, 4, 8, 32)]
INTERLEAVED = [(p, m) for p in (2, 4, 8) for m in (1, 4, 8, 32) if m % p == 0]


def _all(kind, m, p, v=1):
    return [build_schedule(kind, m, p, r, v) for r in range(p)]


# -- partition -----------------------------------------------------------------------------
def test_layer_ids_contiguous_and_interleaved():
    assert layer_ids(8, 2, 0) == [0, 1, 2, 3] and layer_ids(8, 2, 1) == [4, 5, 6, 7]
    # Megatron's interleaved layout: chunk v of stage p holds block v*pp + p
    assert [layer_ids(8, 2, 0, 2, v) for v in range(2)] == [[0, 1], [4, 5]]
    assert [layer_ids(8, 2, 1, 2, v) for v in range(2)] == [[2, 3], [6, 7]]
    assert layer_ids(12, 3, 2, 2, 1) == [10, 11]
    for p, v in ((4, 1), (2, 3), (4, 2)):
        got = sorted(i for r in range(p) for c in range(v) for i in layer_ids(24, p, r, v, c))
        assert got == list(range(24))
    assert layer_ids(5, 2, 0, layer_split=[2, 3]) == [0, 1]
    assert layer_ids(5, 2, 1, layer_split=parse_layer_split("2,3")) == [2, 3, 4]


def test_pre_and_post_process_chunks():
    assert is_pre_process(0, 0) and not is_pre_process(0, 1) and not is_pre_process(1, 0)
    assert is_post_process(3, 4, 1, 2) and not is_post_process(3, 4, 0, 2)
    assert not is_post_process(2, 4) and is_post_process(0, 1)


@pytest.mark.parametrize(
    "args, names",
    [
        ((10, 4, 1, None), ["--num-layers 10", "--pp 4", "--virtual-pipeline-size 1", "12", "8"]),
        ((8, 2, 3, None), ["--num-layers 8", "--pp 2", "--virtual-pipeline-size 3", "12"]),
        ((5, 2, 1, [2, 2]), ["--pipeline-layer-split", "sums to 4", "--num-layers is 5"]),
        ((5, 2, 1, [5, 0]), ["--pipeline-layer-split", ">= 1 layer"]),
        ((6, 2, 1, [1, 2, 3]), ["--pipeline-layer-split", "3 entries", "--pp is 2"]),
        ((8, 2, 2, [4, 4]), ["--pipeline-layer-split", "--virtual-pipeline-size 2"]),
        ((8, 1, 2, None), ["--virtual-pipeline-size 2", "--pp >= 2"]),
    ],
)
def test_partition_errors_name_the_flags(args, names):
    with pytest.raises(PartitionError) as err:
        validate_partition(*args)
    for name in names:
        assert name in str(err.value)
    with pytest.raises(PartitionError):  # layer_ids checks the same rules
        layer_ids(args[0], args[1], 0, args[2], 0, args[3])
    assert issubclass(PartitionError, ValueError)
    with pytest.raises(PartitionError, match="--pipeline-layer-split"):
        parse_layer_split("2,x")


# -- schedules -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind, p, m", CASES)
def test_bubble_fraction_gpipe_and_1f1b(kind, p, m):
    res = simulate(_all(kind, m, p), p, forward_cost=1.0, backward_cost=2.0)
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert res.makespan == pytest.approx(3.0 * (m + p - 1))


@pytest.mark.parametrize("p, m", INTERLEAVED)
def test_bubble_fraction_interleaved(p, m):
    v = 2
    res = simulate(_all("interleaved", m, p, v), p, v, forward_cost=1.0, backward_cost=2.0)
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
    assert res.busy == pytest.approx([3.0 * m] * p)


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 32), (8, 32)])
def test_1f1b_bounds_activations_gpipe_does_not(p, m):
    one_f = simulate(_all("1f1b", m, p), p).peak_inflight
    gpipe = simulate(_all("gpipe", m, p), p).peak_inflight
    assert one_f[0] == p and max(one_f) <= p
    assert one_f == [min(p - r, m) for r in range(p)]
    assert gpipe == [m] * p


def test_schedule_shapes_and_phases():
    assert [str(a)[:6] for a in build_schedule("none", 2, 1, 0)] == ["F(mb=0", "B(mb=0", "F(mb=1", "B(mb=1"]
    s = build_schedule("1f1b", 4, 4, 1)
    assert [(a.kind, a.microbatch, a.phase) for a in s] == [
        ("F", 0, "warmup"),
        ("F", 1, "warmup"),
        ("F", 2, "steady"),
        ("B", 0, "steady"),
        ("F", 3, "steady"),
        ("B", 1, "steady"),
        ("B", 2, "cooldown"),
        ("B", 3, "cooldown"),
    ]
    s = build_schedule("interleaved", 2, 2, 1, 2)  # warm-up (2-1-1)*2 + 1*2 = 2
    assert [(a.kind, a.microbatch, a.chunk) for a in s] == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 0, 1),
        ("B", 0, 1),
        ("F", 1, 1),
        ("B", 1, 1),
        ("B", 0, 0),
        ("B", 1, 0),
    ]
    assert last_backward_index(s) == {1: 5, 0: 7}


def test_build_schedule_errors():
    with pytest.raises(ValueError, match="--global-batch-size.*--micro-batch-size"):
        build_schedule("interleaved", 6, 4, 0, 2)
    with pytest.raises(ValueError, match="--pp is 2"):
        build_schedule("none", 4, 2, 0)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zigzag", 4, 2, 0)
    with pytest.raises(ValueError, match="--virtual-pipeline-size 2"):
        build_schedule("1f1b", 4, 2, 0, 2)


def test_simulator_rejects_backward_before_forward():
    bad = [
        [Action("F", 0), Action("B", 1), Action("F", 1), Action("B", 0)],
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
    ]
    with pytest.raises(ScheduleError, match=r"stage 0: B\(mb=1, chunk=0.*before its forward"):
        simulate(bad, 2)


def test_simulator_rejects_missing_and_duplicate_actions():
    with pytest.raises(ScheduleError, match=r"stage 1: forwards without backward: \[\(1, 0\)\]"):
        simulate([build_schedule("1f1b", 2, 2, 0), [Action("F", 0), Action("B", 0), Action("F", 1)]], 2)
    with pytest.raises(ScheduleError, match=r"stage 0: F\(mb=0.*twice"):
        simulate([[Action("F", 0), Action("F", 0)], [Action("F", 0)]], 2)


def test_simulator_detects_cross_stage_deadlock():
    # Stage 0 wants B0 before F1; stage 1 wants F1 before B0: a cycle.
    bad = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)],
    ]
    with pytest.raises(ScheduleError) as err:
        simulate(bad, 2)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "stage 0 waits at B(mb=0, chunk=0" in msg and "for B(mb=0, chunk=0) on stage 1" in msg
    assert "stage 1 waits at F(mb=1, chunk=0" in msg and "for F(mb=1, chunk=0) on stage 0" in msg


# -- communication plan of the executor ------------------------------------------------------
def _exchanges(kind, m, p, v):
    """Per stage, the executor's batched exchanges: exchange i = sends of action group i-1
    plus the receives of group i; each op is (peer stage, tag, "send"/"recv")."""
    out = []
    for r in range(p):
        actions = build_schedule(kind, m, p, r, v)
        batches, pending = [], []
        for group in exchange_groups(actions):
            plans = [comm_plan(actions[i], r, p, v) for i in group]
            batches.append(pending + [(rc[1], rc[2], "recv") for rc, _ in plans if rc])
            pending = [(sd[1], sd[2], "send") for _, sd in plans if sd]
        out.append(batches + [pending])
    return out


ALL_KINDS = (
    [("1f1b", p, m, 1) for p, m in ((2, 8), (4, 8), (8, 4))]
    + [("gpipe", p, m, 1) for p, m in ((2, 8), (4, 3))]
    + [("interleaved", p, m, v) for p, m, v in ((2, 8, 2), (4, 8, 2), (4, 4, 2), (3, 6, 3), (8, 16, 2))]
)


@pytest.mark.parametrize("kind, p, m, v", ALL_KINDS)
def test_messages_match_in_posting_order(kind, p, m, v):
    """NCCL ignores tags: between two stages, the k-th send must meet the k-th receive."""
    sent, got = {}, {}
    for r, batches in enumerate(_exchanges(kind, m, p, v)):
        for peer, tag, op in (o for b in batches for o in b):
            (sent if op == "send" else got).setdefault((r, peer) if op == "send" else (peer, r), []).append(tag)
    assert sent == got and len(sent) > 0


@pytest.mark.parametrize("kind, p, m, v", ALL_KINDS)
def test_exchanges_complete_with_blocking_sends(kind, p, m, v):
    """Model NCCL's rendezvous: a batch completes only once every op's peer has posted its
    matching op (peer's batch reached). Every stage must get through all its batches."""
    ex = _exchanges(kind, m, p, v)
    where = {(r, op, peer, tag): i for r, bs in enumerate(ex) for i, b in enumerate(bs) for peer, tag, op in b}
    pos = [0] * p
    while any(pos[r] < len(ex[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if pos[r] < len(ex[r]) and all(
                pos[peer] >= where[(peer, "recv" if op == "send" else "send", r, tag)]
                for peer, tag, op in ex[r][pos[r]]
            ):
                pos[r] += 1
                moved = True
        assert moved, f"blocking exchanges deadlock at batches {pos}"
