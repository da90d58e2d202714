"""megazero.pipeline.replay.simulate_executor: the executor's exchanges replayed. With free
communication and the textbook 1:2 costs it gives the textbook bubble of every schedule; each
exchange's hand-over time adds to it as derived by hand; bad schedules are refused."""

import pytest

from megazero.pipeline.replay import simulate_executor
from megazero.pipeline.schedules import Action, ScheduleError, build_schedule, simulate


def _scheds(kind, m, pp, vp):
    return [build_schedule(kind, m, pp, r, vp) for r in range(pp)]


@pytest.mark.parametrize("kind,vp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("pp", [2, 4])
def test_free_exchanges_give_the_textbook_bubble(kind, vp, pp):
    m = 8
    got = simulate_executor(_scheds(kind, m, pp, vp), pp, vp, lambda s, a: (1.0 if a.kind == "F" else 2.0) / vp)
    want = (pp - 1) / (m + pp - 1) if vp == 1 else (pp - 1) / (vp * m + pp - 1)
    assert got.bubble_fraction == pytest.approx(want, abs=1e-12)
    assert got.bubble_fraction == pytest.approx(simulate(_scheds(kind, m, pp, vp), pp, vp).bubble_fraction)
    assert got.busy == [3.0 * m] * pp


def test_hand_over_time_by_hand():
    """pp 2, one micro-batch, F = 1, B = 2, hand-over L: stage 0's F ends at 1 and stage 1
    receives the activation at 1 + L; stage 1 runs F and B and posts the gradient at 4 + L;
    stage 0's exchange (its activation out, the gradient in) completes at 4 + 2L, its B ends at
    6 + 2L: bubble (2 (6 + 2L) - 6) / (2 (6 + 2L))."""
    for L in (0.0, 0.5, 3.0):
        got = simulate_executor(_scheds("1f1b", 1, 2, 1), 2, 1, lambda s, a: 1.0 if a.kind == "F" else 2.0, L)
        assert got.makespan == pytest.approx(6 + 2 * L)
        assert got.bubble_fraction == pytest.approx((6 + 4 * L) / (12 + 4 * L))
        by_messages = simulate_executor(
            _scheds("1f1b", 1, 2, 1), 2, 1, lambda s, a: 1.0 if a.kind == "F" else 2.0, {1: L, 2: L}.__getitem__
        )
        assert by_messages.makespan == got.makespan  # the same hand-over for 1 and 2 messages


def test_stage_costs_move_the_bubble():
    """A last stage twice as slow (the LM head) idles the first stage while it computes."""
    scheds = _scheds("1f1b", 4, 2, 1)
    even = simulate_executor(scheds, 2, 1, lambda s, a: 1.0 if a.kind == "F" else 2.0)
    slow = simulate_executor(scheds, 2, 1, lambda s, a: (1.0 if a.kind == "F" else 2.0) * (1 + s))
    assert slow.busy == [12.0, 24.0] and slow.bubble_fraction > even.bubble_fraction
    assert slow.makespan >= 24.0 + 3.0  # stage 1 cannot start before stage 0's first F


def test_bad_schedule_is_refused():
    with pytest.raises(ScheduleError, match="appears twice"):
        simulate_executor([[Action("F", 0, 0), Action("F", 0, 0)]], 1, 1, lambda s, a: 1.0)
