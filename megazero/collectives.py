"""Thin collective wrappers: explicit group, no-op at group size 1, SUM then divide.

Conventions (docs/design.md, "Conventions" 10):
- every function takes the group explicitly; ``None`` means "this rank alone" (a
  single-process run) and the call returns at once;
- averages are a SUM all-reduce followed by a division, never ``ReduceOp.AVG``;
- tensors are allocated on the input's device; nothing here calls ``torch.cuda``;
- bytes put on the wire are counted per kind in ``counter`` (gloo emulates some collectives,
  so volume is counted from the call, not inferred from timings). Counted bytes are the
  payload of this rank's input tensor(s), ``numel * element_size``;
- every call that reaches the wire is also appended to ``recent``, a bounded ring buffer of
  ``(operation, ranks, sequence number, shape, dtype)`` (pipeline/p2p.py adds its sends and
  receives), so that a rank whose collective fails can name the operation it was waiting in
  (megazero/runtime/resilience.py ``write_failure``).
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter, deque
from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

#: bytes passed to each kind of collective by this process, e.g. ``counter["all_reduce"]``.
counter: Counter = Counter()

#: bytes per ``(kind, ranks)``: ``counter`` split by the group's global ranks (sorted tuple), so
#: the bytes crossing given groups (hybrid sharding's replica all-reduce) are counted apart.
by_group: Counter = Counter()

#: calls that reached the wire, per kind, counted with ``counter`` (gloo pays a latency per
#: call, so the number of collectives matters beside their bytes; tests/layouts/test_buckets.py).
calls: Counter = Counter()

#: this process's last operations on the wire, oldest first: ``(op, ranks, seq, shape, dtype)``
#: with ``ranks`` the global ranks of the group (the peer for ``send``/``recv``), ``seq`` this
#: process's running count of recorded operations (1, 2, ...), ``shape`` a tuple, ``dtype`` e.g.
#: ``"float32"``. Bounded (``maxlen``), one tuple per call, in the order the calls were
#: *enqueued*, not completed: under NCCL an async op (and ``Work.wait``, which does not block
#: the host) leaves later ones queued behind a collective that hangs; NCCL's flight recorder
#: knows which one (megazero/runtime/flight_recorder.py).
recent: deque = deque(maxlen=32)
_seq = itertools.count(1)


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This rank's index inside ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def record(op: str, ranks: tuple, t: torch.Tensor) -> None:
    """Append one operation to ``recent`` (``ranks``: global ranks of the group, or the peer)."""
    recent.append((op, tuple(ranks), next(_seq), tuple(t.shape), str(t.dtype).replace("torch.", "")))


def keep_bookkeeping_out_of_compiled_graphs() -> None:
    """Make ``record`` and the byte counting run eagerly when called from a region that
    ``torch.compile`` traces (``--compile``: a tensor-parallel layer's collectives run inside
    its compiled forward and backward).

    Traced, ``record``'s running sequence number is a value dynamo guards on, so every call
    of the layer failed the guard and recompiled it, and after ``torch._dynamo.config.
    recompile_limit`` (8) recompilations the layer ran uncompiled. ``torch.compiler.disable``
    ends the traced graph before the bookkeeping and starts a new one after it (a graph break
    at each collective, where no fusion is possible anyway); every collective is still
    counted and recorded. Called by ``model.build.compile_layers`` before compiling (not at import:
    ``torch.compiler.disable`` imports torch._dynamo, about 2 s of CPU an eager run never
    needs). Idempotent.
    """
    global record, _count
    if not getattr(record, "_megazero_eager", False):
        record, _count = torch.compiler.disable(record), torch.compiler.disable(_count)
        record._megazero_eager = True


def describe(entry: tuple) -> str:
    """One ``recent`` entry in words, e.g. ``all_reduce #57 over ranks [0, 1], shape (5,) float32``."""
    op, ranks, seq, shape, dtype = entry
    where = (
        f"{'to' if op == 'send' else 'from'} rank {ranks[0]}" if op in ("send", "recv") else f"over ranks {list(ranks)}"
    )
    return f"{op} #{seq} {where}, shape {shape} {dtype}"


_group_ranks = weakref.WeakKeyDictionary()
"""group -> (its global ranks in group-rank order, the same sorted): ``_count``'s lookups, made once
per group (``dist.get_process_group_ranks`` walks the group's rank map on every call). Weak keys:
a destroyed group is not kept alive (nor its gloo threads) by this cache."""


def group_ranks(group) -> tuple:
    """The global ranks of ``group`` in group-rank order (a process group, not ``None``),
    looked up once per group."""
    return _ranks_of(group)[0]


def _ranks_of(group) -> tuple:
    got = _group_ranks.get(group)
    if got is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        got = _group_ranks[group] = (ranks, tuple(sorted(ranks)))
    return got


def _count(kind: str, t: torch.Tensor, group: Group) -> None:
    nbytes = t.numel() * t.element_size()
    counter[kind] += nbytes
    calls[kind] += 1
    ranks, ordered = _ranks_of(group)
    by_group[(kind, ordered)] += nbytes
    record(kind, ranks, t)


def count_send(t: torch.Tensor, peer: int) -> None:
    """Count a point-to-point send of ``t`` to global rank ``peer`` (``counter["send"]``, bytes,
    and ``recent``): ``pipeline.p2p`` posts its sends itself (batched ``isend``/``irecv``), so
    it reports them here."""
    counter["send"] += t.numel() * t.element_size()
    record("send", (peer,), t)


def all_reduce_sum(t: torch.Tensor, group: Group, async_op: bool = False):
    """In-place SUM all-reduce of ``t`` over ``group``; returns the work handle if async."""
    if group_size(group) == 1:
        return None
    _count("all_reduce", t, group)
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_mean(t: torch.Tensor, group: Group) -> torch.Tensor:
    """In-place mean over ``group`` as SUM then divide by the group size; returns ``t``."""
    n = group_size(group)
    if n > 1:
        all_reduce_sum(t, group)
        t.div_(n)
    return t


def all_reduce_max(t: torch.Tensor, group: Group) -> torch.Tensor:
    """In-place MAX all-reduce (used for overflow flags and loss-scale agreement)."""
    if group_size(group) > 1:
        _count("all_reduce", t, group)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


# torch 2.13 renamed the flat-tensor collectives (the old names warn on every call); older
# releases (megazero supports torch >= 2.4) only have the old names. Same arguments, same result.
ALL_GATHER_OP = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_OP = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False):
    """Gather equal 1-D shards: ``out[i*n:(i+1)*n] = shard of group rank i`` (n = shard.numel()).

    Raises ValueError when ``out.numel() != n * group_size``.
    """
    size = group_size(group)
    if out.numel() != shard.numel() * size:
        raise ValueError(f"all_gather_into: out has {out.numel()} elements, expected {shard.numel()} x {size}")
    if size == 1:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return None
    _count("all_gather", shard, group)
    return ALL_GATHER_OP(out, shard, group=group, async_op=async_op)


def reduce_scatter_sum(shard_out: torch.Tensor, full: torch.Tensor, group: Group, async_op: bool = False):
    """SUM reduce-scatter of 1-D ``full`` into equal shards; rank i receives slice i.

    Raises ValueError when ``full.numel() != shard_out.numel() * group_size``.
    """
    size = group_size(group)
    if full.numel() != shard_out.numel() * size:
        raise ValueError(
            f"reduce_scatter_sum: input has {full.numel()} elements, expected {shard_out.numel()} x {size}"
        )
    if size == 1:
        if shard_out.data_ptr() != full.data_ptr():
            shard_out.copy_(full)
        return None
    _count("reduce_scatter", full, group)
    return REDUCE_SCATTER_OP(shard_out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_to_all_single(
    out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group
) -> torch.Tensor:
    """Variable-size all-to-all along dim 0: rows ``[sum(in_splits[:j]), +in_splits[j])`` of
    ``inp`` go to group rank j, which receives them at the rank's place in ``out`` (``out_splits``
    rows from each rank, in group-rank order). Counted as ``counter["all_to_all"]``, the bytes of
    ``inp`` (the rows kept on this rank included). At size 1 ``out`` is a copy of ``inp``.
    Raises ValueError when the splits do not add up to the row counts. Returns ``out``."""
    if sum(in_splits) != inp.shape[0] or sum(out_splits) != out.shape[0]:
        raise ValueError(
            f"all_to_all_single: splits {in_splits} -> {out_splits} do not match {inp.shape[0]} -> {out.shape[0]} rows"
        )
    if group_size(group) == 1:
        return out.copy_(inp)
    _count("all_to_all", inp, group)
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)
    return out


def all_gather_list(t: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """All ranks' copies of ``t`` (same shape everywhere), in group-rank order."""
    size = group_size(group)
    if size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    _count("all_gather", t, group)
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def broadcast(t: torch.Tensor, src_global_rank: int, group: Group) -> torch.Tensor:
    """In-place broadcast from global rank ``src_global_rank`` to ``group``; returns ``t``."""
    if group_size(group) > 1:
        _count("broadcast", t, group)
        dist.broadcast(t, src=src_global_rank, group=group)
    return t
