"""LRSchedule values at chosen iterations equal the closed-form formulas; bad settings raise."""
import math

import pytest

from megazero.optim.lr_schedule import LRSchedule

LR, MIN_LR, W, D = 3e-4, 3e-5, 10, 110  # decay runs over iterations 10..110 (100 iterations)


def test_warmup_is_linear_from_zero():
    s = LRSchedule(LR, MIN_LR, W, D, "cosine")
    for it in (0, 1, 5, 10):
        assert s(it) == pytest.approx(LR * it / W, rel=1e-12, abs=0)
    assert s(0) == 0.0


@pytest.mark.parametrize("it", [11, 35, 60, 85, 109, 110])
def test_cosine_decay(it):
    s = LRSchedule(LR, MIN_LR, W, D, "cosine")
    progress = (it - W) / (D - W)
    expected = MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))
    assert s(it) == pytest.approx(expected, rel=1e-12)


def test_cosine_landmarks():
    s = LRSchedule(LR, MIN_LR, W, D, "cosine")
    assert s(60) == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)  # half way: the midpoint
    assert s(D) == pytest.approx(MIN_LR, rel=1e-12)
    assert s(D + 1) == MIN_LR and s(10 * D) == MIN_LR


@pytest.mark.parametrize("it", [11, 35, 60, 110])
def test_linear_decay(it):
    s = LRSchedule(LR, MIN_LR, W, D, "linear")
    expected = LR - (LR - MIN_LR) * (it - W) / (D - W)
    assert s(it) == pytest.approx(expected, rel=1e-12)
    assert s(D + 5) == MIN_LR


def test_constant_style_and_no_warmup():
    s = LRSchedule(LR, MIN_LR, W, D, "constant")
    assert [s(it) for it in (5, 11, D, 5 * D)] == [pytest.approx(LR / 2), LR, LR, LR]
    s0 = LRSchedule(LR, 0.0, 0, 100, "cosine")
    assert s0(0) == pytest.approx(LR) and s0(50) == pytest.approx(LR / 2)


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="--min-lr"):
        LRSchedule(1e-4, 1e-3, 0, 10, "cosine")
    with pytest.raises(ValueError, match="--lr-decay-style 'exp'"):
        LRSchedule(1e-4, 0.0, 0, 10, "exp")
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        LRSchedule(1e-4, 0.0, 10, 10, "linear")
    with pytest.raises(ValueError, match="iteration"):
        LRSchedule(1e-4, 0.0, 1, 10)(-1)
