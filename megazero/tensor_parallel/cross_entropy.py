"""Cross-entropy over a vocabulary split across tensor-parallel ranks.

The logits are never gathered (Shoeybi et al. 2019, sec. 3, "parallel cross entropy"):
each rank holds ``[B, T, V_pad/tp]``, and three per-token scalars are combined over TP:

1. the global maximum (all-reduce MAX) is subtracted for numerical stability;
2. one SUM all-reduce of a stacked ``[3, B, T]`` tensor gives the sum of ``exp``, the
   target's (shifted) logit, and the sum of the real-vocabulary logits (label smoothing);
3. ``loss = (1 - eps) * (log Z - x_target) + eps * (log Z - mean_j x_j)`` over the real
   vocabulary, which is ``torch.nn.functional.cross_entropy(label_smoothing=eps)``.

Columns whose global index is ``>= vocab_size`` (vocabulary padding) are set to ``-inf``
before the softmax, so they carry no probability and get exactly zero gradient
(docs/design.md, contract 1). The backward pass is local: ``softmax - (1-eps) one_hot -
eps/V`` on this rank's columns, with no communication. With one TP rank the function is
``torch.nn.functional.cross_entropy`` on the real-vocabulary columns.
"""

from __future__ import annotations

import torch

from megazero import collectives as C
from megazero.collectives import Group


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, eps, vocab_size):
        rank, part = C.group_rank(group), logits.shape[-1]
        start = rank * part
        cols = torch.arange(start, start + part, device=logits.device)  # (V/tp,) global ids
        padded = cols >= vocab_size
        x = logits.to(_compute_dtype(logits.dtype)).masked_fill(padded, float("-inf"))

        gmax = x.max(dim=-1).values  # (B, T)
        C.all_reduce_max(gmax, group)
        x = x - gmax.unsqueeze(-1)  # (B, T, V/tp)
        exp = x.exp()  # padded -> 0

        mine = (target >= start) & (target < start + part)  # (B, T)
        local_t = (target - start).masked_fill(~mine, 0)
        x_t = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack([exp.sum(-1), x_t, x.masked_fill(padded, 0.0).sum(-1)])  # (3, B, T)
        C.all_reduce_sum(sums, group)
        sum_exp, x_target, sum_x = sums.unbind(0)

        log_z = sum_exp.log()
        loss = log_z - x_target
        if eps > 0:
            loss = (1.0 - eps) * loss + eps * (log_z - sum_x / vocab_size)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, in place
        ctx.save_for_backward(exp, local_t, mine, padded)
        ctx.eps, ctx.vocab_size, ctx.in_dtype = eps, vocab_size, logits.dtype
        return loss.float() if loss.dtype != torch.float64 else loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, padded = ctx.saved_tensors
        eps, vocab_size = ctx.eps, ctx.vocab_size
        grad = softmax.clone()  # (B, T, V/tp)
        hit = mine.to(grad.dtype) * (1.0 - eps)  # (B, T)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit.unsqueeze(-1))
        if eps > 0:
            grad -= (eps / vocab_size) * (~padded).to(grad.dtype)
        grad *= grad_loss.unsqueeze(-1).to(grad.dtype)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    *,
    vocab_size: int,
    padded_vocab_size: int,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross-entropy of one vocabulary partition of the logits.

    Args:
        logits: ``[B, T, V_pad/tp]``, this TP rank's contiguous slice of the padded
            vocabulary (rank ``r`` holds columns ``[r*V_pad/tp, (r+1)*V_pad/tp)``).
        target: ``[B, T]`` int64 token ids in ``[0, vocab_size)``, identical on TP ranks.
        group: the tensor-parallel group (``None`` = one rank holding the full vocabulary).
        vocab_size: the real vocabulary; columns at or past it are padding.
        padded_vocab_size: the full padded vocabulary, ``tp`` times this rank's columns.
        label_smoothing: ``eps`` in ``[0, 1)``, spread over the ``vocab_size`` real tokens.

    Both sizes are required: with defaults derived from ``logits``, replicated (gathered)
    logits passed at ``tp > 1`` looked like a vocabulary ``tp`` times larger and the loss
    came out ``ln(tp)`` too high (the kind of Megatron's gathered-logits issue). Required,
    they make that call a ValueError.

    Returns:
        ``[B, T]`` loss in nats, fp32 (float64 for float64 logits), identical on every
        TP rank. Matches ``F.cross_entropy(full_logits[..., :vocab_size], target,
        reduction="none", label_smoothing=eps)``.

    Raises:
        ValueError: when ``logits.shape[-1] * tp != padded_vocab_size`` (e.g. a replicated
            full-vocabulary tensor was passed), when ``vocab_size > padded_vocab_size``, when
            ``target`` is not ``logits.shape[:-1]``, or when ``label_smoothing`` is outside
            ``[0, 1)``.
    """
    tp = C.group_size(group)
    part = logits.shape[-1]
    if part * tp != padded_vocab_size:
        raise ValueError(
            f"vocab_parallel_cross_entropy: expected logits of shape [B, T, "
            f"{padded_vocab_size // tp}] (padded_vocab_size {padded_vocab_size} / tensor-"
            f"parallel size {tp}), got {list(logits.shape)}; pass this rank's vocabulary "
            f"partition, not the full or gathered logits"
        )
    if not 0 < vocab_size <= padded_vocab_size:
        raise ValueError(
            f"vocab_parallel_cross_entropy: vocab_size {vocab_size} must be in "
            f"[1, padded_vocab_size {padded_vocab_size}]"
        )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: target shape {list(target.shape)} "
            f"!= logits shape without the vocabulary {list(logits.shape[:-1])}"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if tp == 1:
        # One rank holds the whole vocabulary: plain math, as every layer at size 1.
        # Dropping the padded columns before torch's fused cross-entropy gives them exactly
        # zero gradient.
        x = logits[..., :vocab_size].float() if logits.dtype != torch.float64 else logits[..., :vocab_size]
        return torch.nn.functional.cross_entropy(
            x.flatten(0, -2), target.flatten(), reduction="none", label_smoothing=label_smoothing
        ).view(target.shape)
    return _VocabParallelCE.apply(logits, target, group, float(label_smoothing), vocab_size)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    *,
    vocab_size: int,
    padded_vocab_size: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token ``log p(target | prefix)`` of ``softmax(logits / temperature)`` over the real
    vocabulary, from one vocabulary partition of the logits: the post-training primitive (DPO's
    and the reward model's sequence log-probabilities, PPO/GRPO's ratios), the negative of
    :func:`vocab_parallel_cross_entropy` without label smoothing on the scaled logits, so the
    logits are never gathered and the backward stays local.

    Args:
        logits: ``[B, T, V_pad/tp]``, this TP rank's contiguous slice of the padded vocabulary.
        target: ``[B, T]`` int64 token ids in ``[0, vocab_size)``, identical on TP ranks.
        group: the tensor-parallel group (``None`` = one rank holding the full vocabulary).
        vocab_size, padded_vocab_size: as :func:`vocab_parallel_cross_entropy`.
        temperature: the sampler's temperature (> 0): a rollout drawn at ``T`` is scored at
            ``T`` too, or the first PPO ratio is not 1 (the trap verl and OpenRLHF users met).

    Returns:
        ``[B, T]`` log-probabilities (nats, <= 0), fp32 (float64 for float64 logits), identical
        on every TP rank; equal to ``F.log_softmax(full_logits[..., :vocab_size] / temperature,
        -1).gather(-1, target)``.

    Raises:
        ValueError: as :func:`vocab_parallel_cross_entropy`, and for ``temperature <= 0``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits if temperature == 1.0 else logits / temperature
    return -vocab_parallel_cross_entropy(
        scaled, target, group, vocab_size=vocab_size, padded_vocab_size=padded_vocab_size
    )
