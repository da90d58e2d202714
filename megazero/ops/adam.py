"""One AdamW step on a flat fp32 shard (the ZeRO rank's Range of main params and moments).

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
  The step count goes in as a one-element fp32 tensor already holding ``t``
  (``torch.optim.AdamW`` increments its ``state_steps`` before the call).
- ``"reference"``: the four lines above in plain in-place tensor ops, in the same order as
  ``torch.optim.adamw``'s single-tensor path (``foreach=False, fused=False``).

A per-element ``weight_decay`` tensor (e.g. ``mask * wd``: no decay on biases and norms) is
applied by the same ``param *= 1 - lr * weight_decay`` before a kernel called with
``weight_decay=0``; this is exact because AdamW decays the parameter before, and independently
of, the moment update.
"""
from __future__ import annotations

import math

import torch

from megazero.ops.backend import select_backend


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float | torch.Tensor, backend: str = "auto") -> None:
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
    if not (param.shape == grad.shape == exp_avg.shape == exp_avg_sq.shape):
        raise ValueError(
            f"adam_step: shapes differ: param {tuple(param.shape)}, grad {tuple(grad.shape)}, "
            f"exp_avg {tuple(exp_avg.shape)}, exp_avg_sq {tuple(exp_avg_sq.shape)}"
        )
    if step < 1:
        raise ValueError(f"adam_step: step must be >= 1 (1-based), got {step}")
    kernel = select_backend(backend, param.device)
    if isinstance(weight_decay, torch.Tensor):
        param.mul_(1.0 - lr * weight_decay.to(param.dtype))
        weight_decay = 0.0
    hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=float(weight_decay))
    {"apex": _apex, "torch": _torch_fused, "reference": _reference}[kernel](
        param, grad, exp_avg, exp_avg_sq, **hyper)


def _reference(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay):
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1 ** step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _torch_fused(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay):
    state_step = torch.full((), float(step), dtype=torch.float32, device=param.device)
    torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [state_step],
                        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                        amsgrad=False, maximize=False)


def _apex(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay):
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    noop_flag = torch.zeros(1, dtype=torch.int32, device=param.device)
    adam_w_mode, bias_correction = 1, 1
    # tensor lists in the kernel's order: grads, params, exp_avgs, exp_avg_sqs
    multi_tensor_applier(amp_C.multi_tensor_adam, noop_flag,
                         [[grad], [param], [exp_avg], [exp_avg_sq]],
                         lr, beta1, beta2, eps, step, adam_w_mode, bias_correction, weight_decay)
