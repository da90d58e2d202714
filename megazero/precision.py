"""Mixed precision: the dtype policy, casting a model, overflow checks and fp16 loss scaling.

Mixed-precision training (Micikevicius et al. 2018, "Mixed Precision Training"): the model
computes in fp16 or bf16 while the optimizer keeps fp32 main params and Adam moments. fp16's
narrow exponent range needs loss scaling: the loss is multiplied by ``scale`` before backward,
gradients are unscaled before the step, and a step whose gradients hold inf/NaN is skipped.

The dynamic scaler follows DeepSpeed's documented ``fp16`` settings (``loss_scale`` 0 =
dynamic, ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``min_loss_scale``,
``consecutive_hysteresis``), see :class:`DynamicLossScaler`. The overflow check here is local;
the optimizer makes every rank of the world agree on it (max-reduce of the flag) before
calling ``update``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn


def model_dtype(fp16: bool, bf16: bool) -> torch.dtype:
    """The dtype of model params, activations and gradients: fp16, bf16 or fp32.

    Raises:
        ValueError: both ``fp16`` and ``bf16`` are set.
    """
    if fp16 and bf16:
        raise ValueError("--fp16 and --bf16 are both set; choose one (bf16 needs no loss scaling)")
    return torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32


@dataclass(frozen=True)
class DtypePolicy:
    """Which dtype each kind of model state uses.

    Attributes:
        model: params, activations and gradients of the model (fp16, bf16 or fp32).
        main: main params and Adam moments held by the optimizer (always fp32).
        grad_reduce: dtype of the flat gradient buffers that DP reduces (fp32 when
            ``accumulate_allreduce_grads_in_fp32``, else ``model``).
    """

    model: torch.dtype
    main: torch.dtype
    grad_reduce: torch.dtype

    @classmethod
    def from_flags(cls, fp16: bool, bf16: bool, grads_in_fp32: bool = True) -> "DtypePolicy":
        """Policy for ``--fp16`` / ``--bf16``; raises ValueError as :func:`model_dtype`."""
        model = model_dtype(fp16, bf16)
        return cls(model=model, main=torch.float32, grad_reduce=torch.float32 if grads_in_fp32 else model)

    @property
    def needs_loss_scaling(self) -> bool:
        return self.model == torch.float16


def cast_model_(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the floating-point params and buffers of ``model`` to ``dtype`` in place; returns it.

    The ``nn.Parameter`` objects are kept (only ``.data`` changes), so partition tags and any
    references held elsewhere stay valid. Integer tensors are left alone.
    """
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)
    return model


def _by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


#: dtypes that ``torch._amp_foreach_non_finite_check_and_unscale_`` takes on every device: its
#: CUDA kernel dispatches on float, double and half only and refuses bf16 ("... not
#: implemented for 'BFloat16'", pytorch#127176, open), so bf16 takes :func:`_check_and_unscale_ops_`.
AMP_KERNEL_DTYPES = (torch.float16, torch.float32, torch.float64)


def unscale_and_check_(tensors: Iterable[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply ``tensors`` in place by ``inv_scale`` and flag inf/NaN.

    fp16, fp32 and fp64 use ``torch._amp_foreach_non_finite_check_and_unscale_`` (the kernel
    of ``torch.amp.GradScaler``), one launch per (device, dtype), as GradScaler groups them.
    bf16, which that kernel refuses on CUDA, uses ``_check_and_unscale_ops_`` on every device
    (the CPU suite runs the path a GPU runs). Floating tensors of any shape; the check sees the
    values before the multiplication, as the kernel's does.

    Returns:
        A one-element fp32 tensor on the first tensor's device (CPU when there are none):
        1.0 when any element was inf or NaN, else 0.0. No host synchronisation, so the
        caller can all-reduce (max) it across the world first.
    """
    groups = _by_device_and_dtype(tensors)
    first = next(iter(groups), (torch.device("cpu"),))[0]
    found = torch.zeros(1, dtype=torch.float32, device=first)
    for (device, dtype), group in groups.items():
        found_here = torch.zeros(1, dtype=torch.float32, device=device)
        if dtype in AMP_KERNEL_DTYPES:
            inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, inv)
        else:
            _check_and_unscale_ops_(group, found_here, inv_scale)
        found = torch.maximum(found, found_here.to(first))
    return found


def _check_and_unscale_ops_(group: list[torch.Tensor], found: torch.Tensor, inv_scale: float) -> None:
    """The AMP kernel's work with plain torch ops (any dtype, any device): set ``found`` (fp32,
    one element) to 1.0 when an element of ``group`` is inf or NaN, then multiply in place.

    Each tensor's fp64 sum is non-finite exactly when one of its elements is: NaN propagates
    through addition, an inf stays inf (or meets -inf and makes NaN), and finite bf16 or fp32
    values (below 3.4e38 each) cannot overflow an fp64 sum of fewer than 5e269 of them. One
    reduction per tensor, no temporary of the tensor's size, no host synchronisation.
    """
    sums = torch.stack([t.sum(dtype=torch.float64) for t in group])
    found.copy_(torch.logical_not(torch.isfinite(sums).all()).to(found.dtype).reshape(found.shape))
    if inv_scale != 1.0:
        torch._foreach_mul_(group, inv_scale)


def non_finite_flag(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """As :func:`unscale_and_check_` with ``inv_scale = 1`` (values unchanged): the inf/NaN flag."""
    return unscale_and_check_(tensors, 1.0)


def has_inf_or_nan(tensors: Iterable[torch.Tensor]) -> bool:
    """True when any element of ``tensors`` is inf or NaN (local to this process; syncs once)."""
    return bool(non_finite_flag(tensors).item() > 0)


class LossScaleError(RuntimeError):
    """Training cannot continue: gradients overflow even at the smallest allowed loss scale."""


class _LossScalerBase:
    """Skip bookkeeping shared by the static and dynamic scalers."""

    def __init__(self, scale: float, min_loss_scale: float, max_consecutive_skips: int | None):
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1 or None, got {max_consecutive_skips}")
        self.scale = float(scale)
        self.min_loss_scale = float(min_loss_scale)
        self.max_consecutive_skips = max_consecutive_skips
        self.hysteresis_left = 1
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.skips_at_min_scale = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (call backward on the result)."""
        return loss * self.scale

    def _count(self, overflow: bool) -> None:
        """Update skip counters for this iteration; raise when stuck at the minimum scale."""
        if not overflow:
            self.consecutive_skips = 0
            self.skips_at_min_scale = 0
            return
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.scale <= self.min_loss_scale:
            self.skips_at_min_scale += 1
        limit = self.max_consecutive_skips
        if limit is not None and self.skips_at_min_scale >= limit:
            raise LossScaleError(
                f"fp16 gradients overflowed (inf/NaN) in {self.skips_at_min_scale} consecutive "
                f"steps at the minimum loss scale {self.scale:g} (min_loss_scale="
                f"{self.min_loss_scale:g}, max_consecutive_skips={limit}); {self.skipped_steps} "
                "steps skipped in total. The model diverged or fp16 cannot represent it: train "
                "in --bf16, lower --lr (or lengthen --lr-warmup-iters), enable --clip-grad, or "
                "raise max_consecutive_skips to wait longer."
            )

    def state_dict(self) -> dict:
        """Plain Python values; saved with the optimizer so a resume continues identically."""
        return dict(
            scale=self.scale,
            hysteresis_left=self.hysteresis_left,
            skipped_steps=self.skipped_steps,
            consecutive_skips=self.consecutive_skips,
            skips_at_min_scale=self.skips_at_min_scale,
        )

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.skips_at_min_scale = int(state.get("skips_at_min_scale", 0))


class StaticLossScaler(_LossScalerBase):
    """A fixed loss scale (DeepSpeed ``fp16.loss_scale`` > 0): ``scale`` never changes.

    An overflowed step is still skipped and counted; ``max_consecutive_skips`` consecutive
    overflows raise :class:`LossScaleError` (the scale is its own minimum).
    """

    def __init__(self, scale: float, max_consecutive_skips: int | None = None):
        if not scale > 0:
            raise ValueError(f"static loss_scale must be > 0, got {scale} (0 means dynamic)")
        super().__init__(scale, scale, max_consecutive_skips)

    def update(self, overflow: bool) -> None:
        """Record whether this iteration's gradients overflowed (the step is then skipped)."""
        self._count(overflow)


class DynamicLossScaler(_LossScalerBase):
    """fp16 dynamic loss scaling with hysteresis, as DeepSpeed documents its ``fp16`` block.

    Rules, applied by ``update(overflow)`` once per iteration (after the world agreed on
    ``overflow``):

    1. The scale starts at ``2 ** initial_scale_power``; ``hysteresis_left`` at ``hysteresis``.
    2. Overflow (the step is skipped): if ``hysteresis == 1`` or ``hysteresis_left == 1`` the
       scale is halved, but not below ``min_loss_scale``; otherwise ``hysteresis_left`` drops
       by one and the scale is kept ("delayed shift").
    3. No overflow: with ``consecutive_hysteresis``, ``hysteresis_left`` is refilled to
       ``hysteresis`` at once. After ``loss_scale_window`` consecutive iterations without an
       overflow the scale doubles, the count restarts, and (without ``consecutive_hysteresis``)
       ``hysteresis_left`` is refilled.
    4. ``max_consecutive_skips`` consecutive overflows at ``min_loss_scale`` raise
       :class:`LossScaleError` (None: never).

    Rule 3 follows DeepSpeed's documentation ("number of consecutive iterations without an
    overflow to wait before increasing the loss scale"); DeepSpeed's code doubles one clean
    iteration later (``stable_interval = iterations since the last overflow - 1``).
    """

    def __init__(
        self,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
        max_consecutive_skips: int | None = None,
    ):
        if loss_scale_window < 1 or hysteresis < 1:
            raise ValueError(f"loss_scale_window ({loss_scale_window}) and hysteresis ({hysteresis}) must be >= 1")
        if not min_loss_scale > 0:
            raise ValueError(f"min_loss_scale must be > 0, got {min_loss_scale}")
        super().__init__(max(2.0**initial_scale_power, min_loss_scale), min_loss_scale, max_consecutive_skips)
        self.loss_scale_window = loss_scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.hysteresis_left = hysteresis
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        """Apply rules 2-4 for one iteration. Raises LossScaleError (rule 4)."""
        self._count(overflow)
        if overflow:
            self.clean_steps = 0
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, self.min_loss_scale)
            else:
                self.hysteresis_left -= 1
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        self.clean_steps += 1
        if self.clean_steps == self.loss_scale_window:
            self.scale *= 2.0
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return dict(super().state_dict(), clean_steps=self.clean_steps)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.clean_steps = int(state.get("clean_steps", 0))
