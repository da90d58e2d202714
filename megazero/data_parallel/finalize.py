"""Finalize model gradients: the reductions beyond data parallelism, in one coalesced step.

After the DP reduction two kinds of gradient are still partial (Megatron-LM's
``finalize_model_grads`` does the same two):

- sequence-parallel parameters (``tags.is_sequence_parallel``: LayerNorm weights and
  row-parallel biases under sequence parallelism) saw only this rank's ``T/tp`` tokens: SUM
  over ``tp`` (Korthikanti et al. 2022, sec. 4.2.2);
- the two copies of a weight tied across pipeline stages (``tags.is_shared_embedding``)
  each hold their stage's share: SUM over ``embedding`` (first and last stage), after which
  both copies apply the same update (Shoeybi et al. 2019; Narayanan et al. 2021, sec. 3).

Each kind is packed into flat staging buffers of at most ``max_numel`` elements and reduced
with one all-reduce per buffer (a piece at least that big is reduced in place). Sums are
linear, so reducing after the DP reduction (on this rank's owned shard under ZeRO) equals
reducing before it, up to summation order. ``DataParallel.finish_grad_sync`` calls
:func:`finalize_model_grads` on its owned gradient runs; a model without ``DataParallel``
(tests, tools) calls :func:`finalize_param_grads` on its ``.grad`` tensors. One code path.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from megazero import collectives as C
from megazero import tags


def _coalesced_all_reduce(tensors: list[torch.Tensor], group, max_numel: Optional[int]) -> int:
    """SUM all-reduce every tensor over ``group``, packed into flat buffers of at most
    ``max_numel`` elements (None: one buffer). Returns the peak staging bytes."""
    if not tensors or C.group_size(group) == 1:
        return 0
    limit = max_numel or sum(t.numel() for t in tensors)
    batch: list[torch.Tensor] = []
    peak = 0

    def flush():
        nonlocal peak
        if not batch:
            return
        flat = torch.cat([t.reshape(-1) for t in batch])  # (sum of numels,)
        peak = max(peak, flat.numel() * flat.element_size())
        C.all_reduce_sum(flat, group)
        offset = 0
        for t in batch:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        batch.clear()

    for t in tensors:
        if t.numel() >= limit and t.is_contiguous():
            C.all_reduce_sum(t, group)
            continue
        if sum(b.numel() for b in batch) + t.numel() > limit:
            flush()
        batch.append(t)
    flush()
    return peak


def finalize_model_grads(
    pieces: Iterable[tuple[torch.nn.Parameter, torch.Tensor]],
    tp_group,
    embedding_group,
    max_numel: Optional[int] = None,
) -> tuple[int, int, int]:
    """SUM the sequence-parallel pieces over ``tp_group`` and the tied-embedding pieces over
    ``embedding_group``, coalesced.

    Args:
        pieces: ``(param, gradient tensor)`` pairs; the tensor is the parameter's gradient or
            a part of it (any shape). Every rank of a group must pass matching pieces in the
            same order (same layout: TP peers, or the first and last stage's tied copies).
        tp_group, embedding_group: process groups (None or size 1: no-op for that kind).
        max_numel: elements per packed buffer (None: everything of one kind in one buffer).

    Returns ``(sequence-parallel pieces, tied pieces, peak staging bytes)``.
    """
    pieces = list(pieces)
    sp = [g for p, g in pieces if tags.is_sequence_parallel(p)]
    tied = [g for p, g in pieces if tags.is_shared_embedding(p)]
    peak = max(_coalesced_all_reduce(sp, tp_group, max_numel), _coalesced_all_reduce(tied, embedding_group, max_numel))
    return len(sp), len(tied), peak


def finalize_param_grads(params: Iterable[torch.nn.Parameter], tp_group, embedding_group=None) -> tuple[int, int]:
    """:func:`finalize_model_grads` on the ``.grad`` of ``params`` (a model without
    ``DataParallel``, whose DP ranks already hold equal gradients).

    A tied parameter without gradient gets a zero one, so its peer's collective matches.
    Returns ``(sequence-parallel gradients, tied gradients)`` reduced.
    """
    pieces = []
    for p in params:
        if tags.is_shared_embedding(p) and p.grad is None and C.group_size(embedding_group) > 1:
            p.grad = torch.zeros_like(p)
        if p.grad is not None:
            pieces.append((p, p.grad))
    n_sp, n_tied, _ = finalize_model_grads(pieces, tp_group, embedding_group)
    return n_sp, (n_tied if C.group_size(embedding_group) > 1 else 0)
