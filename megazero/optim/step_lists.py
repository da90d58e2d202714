"""The tensor lists of the optimizer step, built once when the optimizer is constructed.

A rank owns one run of every bucket of every buffer (its shard, or the whole bucket at ZeRO-0;
a :class:`Piece`). Launching the unscale, the clip and AdamW piece by piece, and AdamW once
per run of equal weight decay inside a piece, cost one kernel per (bucket x decay run): about
500 fused-Adam calls per step on the 1.3B check model, plus ~5 norm kernels per counted range
(found on the 1.3B check model). Instead every tensor those kernels touch is a view fixed for the
optimizer's life (gradient storage, main params, moments), so the views are taken once and
grouped into lists for multi-tensor kernels (``torch._foreach_*``, ``torch._fused_adamw_``,
apex's ``multi_tensor_adam``): per :class:`Window` of consecutive pieces of one buffer, one
``_foreach_mul_`` for the unscale, one for the clip and one AdamW call per weight-decay value
present (at most 2). Each element's arithmetic is the per-piece one, so the values are bit
for bit those of the per-piece calls.

A window is the whole buffer when the gradients AdamW reads are persistent fp32 tensors (fp32
gradient storage updated in place; the offloaded optimizer's host copy). Gradients in the
model dtype (``--grads-in-model-dtype``) are first copied into an fp32 scratch of one piece
(the memory bound ``bucket_bound_bytes`` promises no more); a window is then one piece
(``limit`` elements, ``DistributedOptimizer._scratch_size``), still one AdamW call per decay
value instead of one per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megazero.data_parallel.grad_buffer import Range
from megazero.data_parallel.sharding import ShardedBuffer


@dataclass
class Piece:
    """One owned bucket (or bucket shard) of a buffer: gradient, main params, moment offsets."""

    buffer: ShardedBuffer
    world: Range  # world range in the buffer
    offset: int  # optimizer-local start of this piece (moments)
    grad: torch.Tensor  # 1-D view of the reduced gradient
    main: torch.Tensor  # 1-D fp32 main params (a view of the model params in fp32)
    adam: list  # [(piece-relative Range, decays: bool)]
    counted: list  # piece-relative Ranges that count in the norm


@dataclass
class AdamList:
    """The operands of one multi-tensor AdamW call: runs with one weight-decay setting."""

    decays: bool
    params: list = field(default_factory=list)  # fp32 main-param views
    grads: list = field(default_factory=list)  # fp32 gradient views (unscaled, clipped)
    exp_avgs: list = field(default_factory=list)
    exp_avg_sqs: list = field(default_factory=list)


@dataclass
class Window:
    """Consecutive pieces of one buffer updated together.

    ``sources``: the reduced gradients to copy into ``work`` first (empty when ``work`` is the
    gradient storage itself); ``work``: one fp32 gradient tensor per piece, unscaled and
    clipped in place; ``adam``: one :class:`AdamList` per weight-decay value present.
    """

    sources: list
    work: list
    adam: list


def merge_runs(segments: list[tuple[Range, bool]]) -> list[tuple[Range, bool]]:
    """Join adjacent ``(Range, flag)`` segments with equal flags."""
    out: list[tuple[Range, bool]] = []
    for r, flag in segments:
        if out and out[-1][1] == flag and out[-1][0].end == r.start:
            out[-1] = (Range(out[-1][0].start, r.end), flag)
        else:
            out.append((r, flag))
    return out


WorkOf = Callable[[Piece, int], tuple[Optional[torch.Tensor], torch.Tensor]]


def build_windows(
    pieces: list[Piece], work_of: WorkOf, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, limit: Optional[int]
) -> list[Window]:
    """Windows over ``pieces`` (one buffer's, in local order).

    ``work_of(piece, position)`` gives ``(source or None, fp32 work tensor)`` for a piece
    starting ``position`` elements into its window; ``exp_avg``/``exp_avg_sq`` are the
    optimizer's local-coordinate moments; ``limit``: most elements per window (None: no
    limit; a piece larger than it gets a window of its own).
    """
    out, group, used = [], [], 0
    for pc in pieces:
        n = pc.grad.numel()
        if group and limit is not None and used + n > limit:
            out.append(_window(group, work_of, exp_avg, exp_avg_sq))
            group, used = [], 0
        group.append((pc, used))
        used += n
    if group:
        out.append(_window(group, work_of, exp_avg, exp_avg_sq))
    return out


def _window(group, work_of: WorkOf, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> Window:
    sources, work = [], []
    lists = {True: AdamList(True), False: AdamList(False)}
    for pc, position in group:
        source, g = work_of(pc, position)
        if source is not None:
            sources.append(source)
        work.append(g)
        for r, decays in pc.adam:
            s, e, a = pc.offset + r.start, pc.offset + r.end, lists[decays]
            a.params.append(pc.main[r.start : r.end])
            a.grads.append(g[r.start : r.end])
            a.exp_avgs.append(exp_avg[s:e])
            a.exp_avg_sqs.append(exp_avg_sq[s:e])
    return Window(sources, work, [a for a in lists.values() if a.params])


def counted_views(pieces: list[Piece]) -> list[torch.Tensor]:
    """The gradient views that count in the global norm (``Piece.counted``), in order, views
    that follow each other in memory joined into one (ZeRO-0/1 buckets of one buffer, ZeRO-2
    shards): the CPU norm then takes a whole buffer's rows in one call, where pieces of at most
    ``clip.SMALL`` elements each were upcast to fp64 whole (81 calls a step on bench_overhead's
    model at its hidden^2 buckets), and CUDA's multi-tensor call gets fewer tensors."""
    return join_adjacent([pc.grad[r.start : r.end] for pc in pieces for r in pc.counted])


def join_adjacent(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """``views`` (1-D, contiguous) with each run of views that continue one another in one
    storage replaced by a single view of the run (same storage, no copy), in order."""
    out: list[torch.Tensor] = []
    for v in views:
        u = out[-1] if out else None
        if (
            u is not None
            and v.dim() == u.dim() == 1
            and u.is_contiguous()
            and v.is_contiguous()
            and u.dtype == v.dtype
            and u.device == v.device
            and u.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
            and u.storage_offset() + u.numel() == v.storage_offset()
        ):
            out[-1] = u.as_strided((u.numel() + v.numel(),), (1,), u.storage_offset())
        else:
            out.append(v)
    return out
