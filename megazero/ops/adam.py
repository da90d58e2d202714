"""One AdamW step on flat fp32 shards (the ZeRO rank's runs of main params and moments),
one tensor (:func:`adam_step`) or a list of them in one multi-tensor call
(:func:`adam_step_lists`, what the optimizer uses: one call per buffer and weight decay).

Semantics are ``torch.optim.AdamW`` (Loshchilov & Hutter 2019, "Decoupled Weight Decay
Regularization", Algorithm 2, with Kingma & Ba's bias correction), at step ``t`` (1-based)::

    param    *= 1 - lr * weight_decay                         (decoupled decay, first)
    exp_avg   = beta1 * exp_avg    + (1 - beta1) * grad
    exp_avg_sq= beta2 * exp_avg_sq + (1 - beta2) * grad^2
    param    -= lr / (1 - beta1^t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)

Which function each backend calls:

- ``"apex"``: ``apex.multi_tensor_apply.multi_tensor_applier(amp_C.multi_tensor_adam, ...)``
  with ``adam_w_mode=1`` and ``bias_correction=1``, the kernel ``apex.optimizers.FusedAdam``
  launches; CUDA only.
- ``"torch"``: ``torch._fused_adamw_`` (``aten::_fused_adamw_``), the kernel
  ``torch.optim.AdamW(fused=True)`` calls; it has CPU and CUDA implementations in torch >= 2.4.
  The step count goes in as a 0-d fp32 tensor already holding ``t``, one per call, shared by
  every tensor of the list (``torch.optim.AdamW`` increments its ``state_steps`` before the
  call; the kernel only reads them).
- ``"reference"``: the four lines above in plain in-place tensor ops, in the same order as
  ``torch.optim.adamw``'s single-tensor path (``foreach=False, fused=False``), tensor by tensor.

A per-element ``weight_decay`` tensor (e.g. ``mask * wd``: no decay on biases and norms) is
applied by the same ``param *= 1 - lr * weight_decay`` before a kernel called with
``weight_decay=0``; this is exact because AdamW decays the parameter before, and independently
of, the moment update.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from megazero.ops.backend import select_backend


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float | torch.Tensor,
    backend: str = "auto",
) -> None:
    """Apply one AdamW step in place to ``param``, ``exp_avg`` and ``exp_avg_sq``.

    Args:
        param, grad, exp_avg, exp_avg_sq: tensors of one shape (flat ``[N]`` fp32 shard) on one
            device; ``grad`` is read only (already unscaled and clipped).
        step: the 1-based step count ``t`` of this update (bias correction).
        lr: learning rate; beta1, beta2, eps: Adam hyper-parameters.
        weight_decay: decoupled weight-decay coefficient, a float or a tensor broadcastable to
            ``param`` (per-element coefficient, e.g. a 0/1 mask times the coefficient).
        backend: ``"auto"``, ``"apex"``, ``"torch"`` or ``"reference"`` (module docstring).

    Raises:
        ValueError: shapes differ, ``step < 1``, or the backend cannot run here
            (see :func:`megazero.ops.backend.select_backend`).
    """
    if isinstance(weight_decay, torch.Tensor):
        _check([param], [grad], [exp_avg], [exp_avg_sq], step)
        select_backend(backend, param.device)  # refuse before touching param
        param.mul_(1.0 - lr * weight_decay.to(param.dtype))
        weight_decay = 0.0
    adam_step_lists(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        backend=backend,
    )


def adam_step_lists(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    backend: str = "auto",
) -> None:
    """One AdamW step in place on every ``params[i]`` with ``grads[i]`` and its moments: one
    multi-tensor kernel call for the whole list (``"torch"``, ``"apex"``; the reference
    backend loops).

    The update of each element depends on that element, ``step`` and the hyper-parameters
    only, so a list call gives bit for bit the values of one :func:`adam_step` per tensor;
    what it saves is the launches (on CUDA one host call, a few kernels per ~36 tensors).

    Args:
        params, grads, exp_avgs, exp_avg_sqs: equally long lists of fp32 tensors, the i-th of
            each of one shape, all on one device (e.g. 1-D views of a flat shard).
        step, lr, beta1, beta2, eps: as :func:`adam_step`.
        weight_decay: one float for the whole list (tensors with another coefficient go into
            another call).
        backend: as :func:`adam_step`.

    Raises:
        ValueError: the lists differ in length, a pair of shapes differs, ``step < 1``, or the
            backend cannot run here.
    """
    _check(params, grads, exp_avgs, exp_avg_sqs, step)
    if not params:
        return
    kernel = select_backend(backend, params[0].device)
    hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=float(weight_decay))
    {"apex": _apex, "torch": _torch_fused, "reference": _reference}[kernel](
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), **hyper
    )


def _check(params, grads, exp_avgs, exp_avg_sqs, step: int) -> None:
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)):
        raise ValueError(
            f"adam_step: list lengths differ: {len(params)} params, {len(grads)} grads, "
            f"{len(exp_avgs)} exp_avg, {len(exp_avg_sqs)} exp_avg_sq"
        )
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        if not (param.shape == grad.shape == exp_avg.shape == exp_avg_sq.shape):
            raise ValueError(
                f"adam_step: shapes differ: param {tuple(param.shape)}, grad {tuple(grad.shape)}, "
                f"exp_avg {tuple(exp_avg.shape)}, exp_avg_sq {tuple(exp_avg_sq.shape)}"
            )
    if step < 1:
        raise ValueError(f"adam_step: step must be >= 1 (1-based), got {step}")


def _reference(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        if weight_decay != 0.0:
            param.mul_(1.0 - lr * weight_decay)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def _torch_fused(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    # the kernel reads one step tensor per parameter and never writes it: one shared 0-d
    # tensor serves the whole list (torch.optim.AdamW keeps one per parameter because it
    # increments them)
    state_step = torch.full((), float(step), dtype=torch.float32, device=params[0].device)
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        [state_step] * len(params),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


def _apex(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    noop_flag = torch.zeros(1, dtype=torch.int32, device=params[0].device)
    adam_w_mode, bias_correction = 1, 1
    # tensor lists in the kernel's order: grads, params, exp_avgs, exp_avg_sqs
    multi_tensor_applier(
        amp_C.multi_tensor_adam,
        noop_flag,
        [grads, params, exp_avgs, exp_avg_sqs],
        lr,
        beta1,
        beta2,
        eps,
        step,
        adam_w_mode,
        bias_correction,
        weight_decay,
    )
