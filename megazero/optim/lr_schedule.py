"""Learning-rate schedule: linear warm-up, then cosine, linear or warmup-stable-decay (WSD)
decay to ``min_lr``.

The formulas of Megatron-LM's ``OptimizerParamScheduler.get_lr`` (warm-up from 0; decay
measured in absolute iterations, so ``decay_iters`` includes the warm-up); cosine decay is
SGDR's (Loshchilov & Hutter 2017, eq. 5) without restarts. WSD (Hu et al. 2024, "MiniCPM",
section 4; Megatron's ``--lr-decay-style WSD``) holds the peak after the warm-up and anneals
only over the last ``wsd_decay_iters`` iterations before ``decay_iters``, in one of
Megatron's four annealing shapes (``--lr-wsd-decay-style``).
"""

from __future__ import annotations

import math
from typing import Optional

DECAY_STYLES = ("cosine", "linear", "constant", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def wsd_coefficient(ratio: float, style: str) -> float:
    """Fraction of ``lr - min_lr`` left at ``ratio`` in [0, 1] of the WSD annealing phase.

    Megatron's shapes: linear ``1 - r``; cosine ``(1 + cos(pi r)) / 2``; exponential
    ``2 * 0.5**r - 1``; minus_sqrt ``1 - sqrt(r)``. Each is 1 at r = 0 and 0 at r = 1.
    """
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * ratio))
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"--lr-wsd-decay-style {style!r} is unknown; choose one of {', '.join(WSD_DECAY_STYLES)}")


class LRSchedule:
    """Learning rate as a pure function of the iteration (0-based count of finished steps).

    With ``W = warmup_iters``, ``D = decay_iters``, ``it`` the iteration::

        it <= W (and W > 0):  lr * it / W                                   (warm-up from 0)
        W < it <= D:          p = (it - W) / (D - W)
                              cosine:   min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * p))
                              linear:   min_lr + (lr - min_lr) * (1 - p)
                              WSD:      A = D - wsd_decay_iters; 1 up to A, then
                                        wsd_coefficient((it - A) / wsd_decay_iters)
                                        (the coefficient multiplies lr - min_lr)
        it > D:               min_lr
        constant style:       lr after the warm-up, for every it > W (no decay)

    Args:
        lr: peak learning rate, reached at the end of the warm-up.
        min_lr: floor of the decay (0 <= min_lr <= lr).
        warmup_iters: number of warm-up iterations (0: none).
        decay_iters: iteration at which the decay reaches ``min_lr`` (absolute, counts the
            warm-up); must exceed ``warmup_iters`` for the decaying styles.
        decay_style: ``"cosine"``, ``"linear"``, ``"constant"`` or ``"WSD"``.
        wsd_decay_iters: length of WSD's annealing phase, ending at ``decay_iters``
            (1 <= it <= decay_iters - warmup_iters); WSD only.
        wsd_decay_style: WSD's annealing shape, one of ``WSD_DECAY_STYLES``.

    Raises:
        ValueError: unknown ``decay_style``, ``min_lr > lr``, a negative value,
            ``decay_iters <= warmup_iters`` for a decaying style, or a WSD phase that is
            missing or does not fit after the warm-up; the message names the flag.
    """

    def __init__(
        self,
        lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int,
        decay_style: str = "cosine",
        wsd_decay_iters: Optional[int] = None,
        wsd_decay_style: str = "exponential",
    ):
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {decay_style!r} is unknown; choose one of {', '.join(DECAY_STYLES)}")
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
        if decay_style == "WSD":
            _check_wsd(warmup_iters, decay_iters, wsd_decay_iters, wsd_decay_style)
        self.wsd_decay_iters = wsd_decay_iters
        self.wsd_decay_style = wsd_decay_style
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
        if self.decay_style == "WSD":
            anneal_start = self.decay_iters - self.wsd_decay_iters
            coeff = (
                1.0
                if iteration <= anneal_start
                else wsd_coefficient((iteration - anneal_start) / self.wsd_decay_iters, self.wsd_decay_style)
            )
        elif self.decay_style == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            coeff = 1.0 - progress
        return self.min_lr + (self.lr - self.min_lr) * coeff

    def __repr__(self) -> str:
        return (
            f"LRSchedule(lr={self.lr}, min_lr={self.min_lr}, warmup_iters={self.warmup_iters}, "
            f"decay_iters={self.decay_iters}, decay_style={self.decay_style!r}, "
            f"wsd_decay_iters={self.wsd_decay_iters}, wsd_decay_style={self.wsd_decay_style!r})"
        )


def _check_wsd(warmup_iters: int, decay_iters: int, wsd_decay_iters: Optional[int], style: str) -> None:
    """WSD needs an annealing phase that fits between the warm-up and ``decay_iters``."""
    if style not in WSD_DECAY_STYLES:
        raise ValueError(f"--lr-wsd-decay-style {style!r} is unknown; choose one of {', '.join(WSD_DECAY_STYLES)}")
    if wsd_decay_iters is None or not 1 <= wsd_decay_iters <= decay_iters - warmup_iters:
        raise ValueError(
            f"--lr-decay-style WSD needs 1 <= --lr-wsd-decay-iters <= --lr-decay-iters {decay_iters} - "
            f"--lr-warmup-iters {warmup_iters} (the annealing phase ends at --lr-decay-iters and starts "
            f"after the warm-up), got {wsd_decay_iters}; fix: give --lr-wsd-decay-iters in that range"
        )
