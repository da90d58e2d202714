"""Learning-rate schedule: linear warm-up, then cosine or linear decay to ``min_lr``.

The formulas of Megatron-LM's ``OptimizerParamScheduler.get_lr`` (warm-up from 0; decay
measured in absolute iterations, so ``decay_iters`` includes the warm-up); cosine decay is
SGDR's (Loshchilov & Hutter 2017, eq. 5) without restarts.
"""
from __future__ import annotations

import math

DECAY_STYLES = ("cosine", "linear", "constant")


class LRSchedule:
    """Learning rate as a pure function of the iteration (0-based count of finished steps).

    With ``W = warmup_iters``, ``D = decay_iters``, ``it`` the iteration::

        it <= W (and W > 0):  lr * it / W                                   (warm-up from 0)
        W < it <= D:          p = (it - W) / (D - W)
                              cosine:   min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * p))
                              linear:   min_lr + (lr - min_lr) * (1 - p)
        it > D:               min_lr
        constant style:       lr after the warm-up, for every it > W (no decay)

    Args:
        lr: peak learning rate, reached at the end of the warm-up.
        min_lr: floor of the decay (0 <= min_lr <= lr).
        warmup_iters: number of warm-up iterations (0: none).
        decay_iters: iteration at which the decay reaches ``min_lr`` (absolute, counts the
            warm-up); must exceed ``warmup_iters`` for the decaying styles.
        decay_style: ``"cosine"``, ``"linear"`` or ``"constant"``.

    Raises:
        ValueError: unknown ``decay_style``, ``min_lr > lr``, a negative value, or
            ``decay_iters <= warmup_iters`` for a decaying style; the message names the flag.
    """

    def __init__(self, lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                 decay_style: str = "cosine"):
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {decay_style!r} is unknown; choose one of "
                             f"{', '.join(DECAY_STYLES)}")
        if lr < 0 or min_lr < 0:
            raise ValueError(f"--lr ({lr}) and --min-lr ({min_lr}) must be >= 0")
        if min_lr > lr:
            raise ValueError(f"--min-lr ({min_lr}) is larger than --lr ({lr}); lower --min-lr")
        if warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {warmup_iters}")
        if decay_style != "constant" and decay_iters <= warmup_iters:
            raise ValueError(
                f"--lr-decay-iters ({decay_iters}) must be larger than --lr-warmup-iters "
                f"({warmup_iters}) for --lr-decay-style {decay_style}; raise --lr-decay-iters "
                "(or --train-iters, its default) or use --lr-decay-style constant"
            )
        self.lr = lr
        self.min_lr = min_lr
        self.warmup_iters = warmup_iters
        self.decay_iters = decay_iters
        self.decay_style = decay_style

    def __call__(self, iteration: int) -> float:
        """Learning rate for ``iteration`` (>= 0). Raises ValueError on a negative iteration."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.lr * iteration / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if iteration > self.decay_iters:
            return self.min_lr
        progress = (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            coeff = 1.0 - progress
        return self.min_lr + (self.lr - self.min_lr) * coeff

    def __repr__(self) -> str:
        return (f"LRSchedule(lr={self.lr}, min_lr={self.min_lr}, warmup_iters={self.warmup_iters}, "
                f"decay_iters={self.decay_iters}, decay_style={self.decay_style!r})")
