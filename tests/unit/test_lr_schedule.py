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


def _megatron_wsd(it, style, lr=LR, min_lr=MIN_LR, warmup=W, decay=D, wsd=30):
    """Megatron-LM's OptimizerParamScheduler.get_lr for WSD, written out in iterations."""
    if it <= warmup:
        return lr * it / warmup
    if it > decay:
        return min_lr
    start = decay - wsd
    if it <= start:
        return lr
    r = (it - start) / wsd
    coeff = {
        "linear": 1 - r,
        "cosine": 0.5 * (math.cos(math.pi * r) + 1),
        "exponential": 2 * 0.5**r - 1,
        "minus_sqrt": 1 - math.sqrt(r),
    }[style]
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize("style", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_wsd_equals_megatron_at_every_iteration(style):
    s = LRSchedule(LR, MIN_LR, W, D, "WSD", wsd_decay_iters=30, wsd_decay_style=style)
    for it in range(0, D + 20):
        assert s(it) == pytest.approx(_megatron_wsd(it, style), rel=1e-12, abs=0), it
    assert s(W + 1) == LR and s(D - 30) == LR  # the stable phase holds the peak
    assert s(D) == pytest.approx(MIN_LR, rel=1e-12) and s(D - 29) < LR


def test_wsd_bad_settings_raise():
    with pytest.raises(ValueError, match="--lr-wsd-decay-iters"):
        LRSchedule(LR, MIN_LR, W, D, "WSD")
    with pytest.raises(ValueError, match="--lr-wsd-decay-iters"):
        LRSchedule(LR, MIN_LR, W, D, "WSD", wsd_decay_iters=D - W + 1)
    with pytest.raises(ValueError, match="--lr-wsd-decay-style 'step'"):
        LRSchedule(LR, MIN_LR, W, D, "WSD", wsd_decay_iters=5, wsd_decay_style="step")


def test_wsd_config_needs_its_phase(capsys):
    from megazero.config import config_from_argv

    base = [
        "--mock-data",
        "--train-iters",
        "20",
        "--lr-warmup-iters",
        "4",
        "--lr-decay-style",
        "WSD",
        "--device",
        "cpu",
    ]
    with pytest.raises(SystemExit) as e:
        config_from_argv(base, 1)
    assert e.value.code == 2 and "--lr-wsd-decay-iters" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config_from_argv(base + ["--lr-wsd-decay-iters", "17"], 1)
    assert "between 1 and --lr-decay-iters 20 - --lr-warmup-iters 4" in capsys.readouterr().err
    cfg = config_from_argv(base + ["--lr-wsd-decay-iters", "16", "--lr-wsd-decay-style", "minus_sqrt"], 1)
    assert (cfg.optim.lr_wsd_decay_iters, cfg.optim.lr_wsd_decay_style) == (16, "minus_sqrt")


def _wsd_lrs(rank, world, argv, steps, save=None, load=None):

    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    cfg = config_from_argv(argv + (["--load", load] if load else []), world)
    trainer = build_trainer(cfg, data=training.prepare_run(cfg))
    cfg = trainer.cfg
    if load:
        trainer.load_checkpoint(load)
    out = []
    for _ in range(steps):
        batches = trainer.next_batches()
        v = trainer.train_step(batches).values
        out.append((v["iteration"], v["lr"], v["loss"]))
    if save:
        trainer.save_checkpoint(save)
    return out


def test_wsd_training_follows_the_formula_and_survives_a_resume(tmp_path):
    from tests.support.distributed import run_distributed

    argv = [
        "--mock-data",
        "--vocab-size",
        "64",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "8",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "8",
        "--lr",
        "1e-2",
        "--min-lr",
        "1e-3",
        "--lr-warmup-iters",
        "2",
        "--lr-decay-style",
        "WSD",
        "--lr-wsd-decay-iters",
        "4",
        "--lr-wsd-decay-style",
        "cosine",
        "--eval-iters",
        "0",
        "--make-vocab-size-divisible-by",
        "8",
        "--device",
        "cpu",
    ]
    whole = run_distributed(_wsd_lrs, 1, argv, 8)[0]
    for it, lr, _ in whole:  # train_step uses the schedule at iteration + 1 (warm-up above 0)
        assert lr == pytest.approx(_megatron_wsd(it, "cosine", 1e-2, 1e-3, 2, 8, 4), rel=1e-12), it
    first = run_distributed(_wsd_lrs, 1, argv, 4, save=str(tmp_path))[0]
    rest = run_distributed(_wsd_lrs, 1, argv, 4, load=str(tmp_path))[0]
    assert first + rest == whole  # same iterations, learning rates and losses, bit for bit
