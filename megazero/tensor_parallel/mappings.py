"""Communication at the borders of tensor-parallel regions, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, sec. 3, fig. 3) names two conjugate operators:
``f`` is the identity forward and an all-reduce backward (entering a partitioned region
from a replicated one), ``g`` is an all-reduce forward and the identity backward (leaving
it). Splitting and gathering along the hidden (last) dimension move between a replicated
and a partitioned activation.

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) replaces the all-reduce ``g``
by a reduce-scatter along the sequence, and ``f`` by an all-gather along the sequence, so
that LayerNorm and dropout run on ``T/tp`` tokens per rank; each is the other's conjugate.

Every function takes its process group explicitly (``None`` or a size-1 group = this rank
alone; the function is then the identity). Tensors are batch-first ``[B, T, H]``; the
sequence dimension is 1, the hidden dimension is the last. Collectives go through
``megazero.collectives`` (SUM only, bytes counted there).
"""

from __future__ import annotations

from typing import Optional

import torch

from megazero import collectives as C
from megazero.collectives import Group

SEQ_DIM = 1


def _check_divisible(x: torch.Tensor, dim: int, size: int, what: str) -> None:
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"{what}: dimension {dim} of shape {tuple(x.shape)} has size "
            f"{x.shape[dim]}, not divisible by the tensor-parallel size {size}"
        )


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim``: ``[.., D, ..] -> [.., D/tp, ..]``."""
    size = C.group_size(group)
    if size == 1:
        return x
    _check_divisible(x, dim, size, "split")
    return x.chunk(size, dim=dim)[C.group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order: ``D -> D*tp``."""
    size = C.group_size(group)
    if size == 1:
        return x
    flat = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    C.all_gather_into(flat, x.contiguous().view(-1), group)
    stacked = flat.view(size, *x.shape)  # (tp, *x.shape), rank-major
    full = stacked.movedim(0, dim)  # (.., tp, D, ..)
    shape = list(x.shape)
    shape[dim] *= size
    return full.reshape(shape).contiguous()  # (.., tp*D, ..)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """SUM over ranks, then keep this rank's chunk along ``dim``: ``D -> D/tp``."""
    size = C.group_size(group)
    if size == 1:
        return x
    _check_divisible(x, dim, size, "reduce-scatter")
    front = x.movedim(dim, 0).contiguous()  # (D, ..): rank i's chunk is contiguous
    out = torch.empty((front.shape[0] // size, *front.shape[1:]), dtype=x.dtype, device=x.device)  # (D/tp, ..)
    C.reduce_scatter_sum(out.view(-1), front.view(-1), group)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """SUM of ``x`` over ranks, out of place (the input is left untouched)."""
    if C.group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    C.all_reduce_sum(out, group)
    return out


class _CopyToRegion(torch.autograd.Function):
    """Identity forward (cast to ``wide`` when given: exact for a wider float); backward SUM all-reduce
    of the gradient in its own dtype, then cast back to the input's."""

    @staticmethod
    def forward(ctx, x, group, wide=None):
        ctx.group, ctx.dtype = group, x.dtype
        return x.view_as(x) if wide is None else x.to(wide)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group).to(ctx.dtype), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSplit(torch.autograd.Function):
    """Forward all-gather along ``dim``; backward split (or reduce-scatter if asked)."""

    @staticmethod
    def forward(ctx, x, dim, group, grad_reduce_scatter, wide=None):
        ctx.dim, ctx.group, ctx.grad_reduce_scatter, ctx.dtype = dim, group, grad_reduce_scatter, x.dtype
        out = _gather(x, dim, group)
        return out if wide is None else out.to(wide)  # gathered in x's dtype, widened after

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_reduce_scatter:
            return _reduce_scatter(grad, ctx.dim, ctx.group).to(ctx.dtype), None, None, None, None
        return _split(grad, ctx.dim, ctx.group).to(ctx.dtype), None, None, None, None


class _SplitGather(torch.autograd.Function):
    """Forward split along ``dim``; backward all-gather."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterGather(torch.autograd.Function):
    """Forward reduce-scatter along ``dim``; backward all-gather."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


def _single(group: Group) -> bool:
    return C.group_size(group) == 1


def copy_to_tp_region(x: torch.Tensor, group: Group, wide: Optional[torch.dtype] = None) -> torch.Tensor:
    """Megatron's ``f``: identity forward, SUM all-reduce of the gradient backward.

    Any shape; output has the shape of ``x``. ``wide`` (a float dtype at least as wide as
    ``x``'s): the output is ``x`` cast to it (exactly) and the gradient is all-reduced in it,
    then cast back to ``x``'s dtype (the FP8 emulation's exact partial sums, ``megazero.ops.fp8``).
    """
    if _single(group):
        return x if wide is None else x.to(wide)
    return _CopyToRegion.apply(x, group, wide)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's ``g``: SUM all-reduce forward, identity backward. Any shape."""
    return x if _single(group) else _ReduceFromRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim: ``[.., H/tp] -> [.., H]``; backward keeps this rank's chunk."""
    return x if _single(group) else _GatherSplit.apply(x, x.dim() - 1, group, False)


def scatter_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's chunk of the last dim: ``[.., H] -> [.., H/tp]``; backward all-gather.

    Raises ValueError when ``H`` is not divisible by the group size.
    """
    return x if _single(group) else _SplitGather.apply(x, x.dim() - 1, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's sequence chunk: ``[B, T, H] -> [B, T/tp, H]``; backward all-gather.

    Raises ValueError when ``T`` is not divisible by the group size.
    """
    return x if _single(group) else _SplitGather.apply(x, SEQ_DIM, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group, grad_reduce_scatter: bool = True, wide: Optional[torch.dtype] = None
) -> torch.Tensor:
    """All-gather the sequence: ``[B, T/tp, H] -> [B, T, H]``.

    Backward: SUM reduce-scatter along the sequence when ``grad_reduce_scatter`` (the
    gathered tensor feeds a partitioned layer, so each rank holds a partial gradient,
    Korthikanti et al. 2022, sec. 4.2.2), else keep this rank's chunk of the gradient.
    ``wide``: gathered in ``x``'s dtype, then cast to ``wide``; the gradient is reduce-scattered
    in ``wide`` and cast back (as :func:`copy_to_tp_region`).
    """
    if _single(group):
        return x if wide is None else x.to(wide)
    return _GatherSplit.apply(x, SEQ_DIM, group, grad_reduce_scatter, wide)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """SUM over ranks and keep this rank's sequence chunk: ``[B, T, H] -> [B, T/tp, H]``.

    Backward all-gathers the gradient along the sequence. Raises ValueError when ``T`` is
    not divisible by the group size.
    """
    return x if _single(group) else _ReduceScatterGather.apply(x, SEQ_DIM, group)
