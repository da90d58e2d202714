"""Data parallelism with ZeRO-1/2 gradient handling (Rajbhandari et al., SC'20, sec. 5).

Backward hooks (``register_post_accumulate_grad_hook``) move every gradient into flat
storage laid out by :class:`~megazero.data_parallel.grad_buffer.GradBuffer` and set
``param.grad = None``. What the storage is and when it is reduced over the DP group
depends on the ZeRO stage (N = DP size, Psi = elements of this rank's model chunks):

- stage 0 (plain DP): one full buffer (Psi elements) accumulates every micro-batch; in the
  last micro-batch it is SUM all-reduced and divided by N (every rank keeps all of it).
- stage 1 (P_os): the same full buffer; in the last micro-batch each bucket is SUM
  reduce-scattered in place, so rank r's shard of the bucket holds the reduced sum; / N.
- stage 2 (P_os+g): no full buffer. A bucket's staging buffer is allocated when its first
  gradient of a micro-batch arrives and reduce-scattered as soon as it is complete in EVERY
  micro-batch; the rank's shard is added into the persistent gradient shard (Psi/N
  elements, local coordinates) and the staging buffer is freed. At most
  ``buckets_in_flight`` staged buckets wait for their reduction at a time, so gradient
  memory is one shard plus a few buckets. ZeRO-2 therefore pays one reduce-scatter of the
  whole buffer per micro-batch; stages 0 and 1 pay one all-reduce / reduce-scatter per step.

With ``overlap_comm`` a reduction starts (``async_op=True``) as soon as its bucket is
complete and the ones before it have started (buckets start in order on every rank, so
the DP ranks' collectives match); the handles are waited in ``finish_grad_sync``.
Without it every reduction is synchronous (stage 2: in the hook; stages 0/1: in
``finish_grad_sync``). Both do the same arithmetic in the same order: results are
bit-identical. All reductions are SUM then divide by N (never ``ReduceOp.AVG``).

Sequence-parallel parameters (``tags.is_sequence_parallel``) have their gradient SUM
all-reduced over TP in the hook first (Korthikanti et al. 2022, sec. 4.2.2). Weights tied
across pipeline stages (``tags.is_shared_embedding``) get a buffer of their own, laid out
identically on the first and last stage, whose DP-reduced (sharded) gradient is then SUM
all-reduced over ``groups.embedding`` range for range.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import torch
from torch import nn

from megazero import collectives as C
from megazero.data_parallel.grad_buffer import GradBuffer, Range
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel import tags


class _Storage:
    """Gradient storage and per-micro-batch bookkeeping of one GradBuffer."""

    def __init__(self, layout: GradBuffer, chunk_id: int, shared: bool, stage: int,
                 grad_dtype: torch.dtype, device):
        self.layout, self.chunk_id, self.shared = layout, chunk_id, shared
        self.full: Optional[torch.Tensor] = None     # world coordinates (stages 0, 1)
        self.shard: Optional[torch.Tensor] = None    # local coordinates (stage 2)
        if stage < 2:
            self.full = torch.zeros(layout.padded_numel, dtype=grad_dtype, device=device)
        else:
            self.shard = torch.zeros(layout.shard_numel, dtype=grad_dtype, device=device)
        self.staging: dict[int, torch.Tensor] = {}   # stage 2: bucket index -> [bucket size]
        self.next_issue = 0
        self.reset_tracking()

    def reset_tracking(self) -> None:
        self.seen = [set() for _ in self.layout.buckets]
        self.num_ready = 0
        self.ready = [False] * len(self.layout.buckets)


class DataParallel:
    """Gradient synchronisation over the DP group for this rank's model chunks.

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage), in order.
        groups: process groups (uses ``dp``, ``tp``, ``embedding``).
        zero_stage: 0 (all-reduce), 1 (reduce-scatter, full gradient buffer) or 2
            (reduce-scatter per micro-batch, gradient shard only).
        bucket_size: elements per bucket (rounded up to a multiple of the DP size).
        overlap_comm: start reductions asynchronously during backward.
        grad_dtype: dtype of gradient storage and of the reductions (fp32 default).
        buckets_in_flight: stage 2: staged buckets waiting for their reduction at most.

    Call ``zero_grad()`` at the start of a step, ``before_backward(chunk_id,
    is_last_microbatch)`` before each backward (needed for overlap in stages 0/1 and for
    parameters left unused by a micro-batch under stage 2), ``finish_grad_sync()`` after
    the last backward. Raises ValueError for a bad stage, bucket size or in-flight count.
    """

    def __init__(self, chunks: list[nn.Module], groups: ProcessGroups, *, zero_stage: int,
                 bucket_size: int, overlap_comm: bool, grad_dtype: torch.dtype = torch.float32,
                 buckets_in_flight: int = 2):
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2, got {zero_stage} (stage 3 is "
                             "not supported)")
        if bucket_size < 1 or buckets_in_flight < 1:
            raise ValueError(f"bucket_size ({bucket_size}) and buckets_in_flight "
                             f"({buckets_in_flight}) must be >= 1")
        self.chunks, self.groups = list(chunks), groups
        self.stage, self.overlap, self.grad_dtype = zero_stage, overlap_comm, grad_dtype
        self.dp_size, self.dp_rank = C.group_size(groups.dp), C.group_rank(groups.dp)
        self.buckets_in_flight = buckets_in_flight
        self.storages: list[_Storage] = []
        self._owner: dict[int, _Storage] = {}
        self._index: dict[int, int] = {}
        self.params: list[nn.Parameter] = []
        for cid, chunk in enumerate(self.chunks):
            self._add_chunk(cid, chunk, bucket_size)
        self._is_last = [False] * len(self.chunks)
        self._pending: deque = deque()   # (storage, bucket index, work handle, staging)
        self._synced = False
        self._staging_bytes = self.peak_staging_bytes = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _add_chunk(self, cid: int, chunk: nn.Module, bucket_size: int) -> None:
        params = [p for p in chunk.parameters() if p.requires_grad and id(p) not in self._owner]
        groups: dict[tuple, list] = {}
        for p in params:
            groups.setdefault((tags.is_shared_embedding(p), p.dtype), []).append(p)
        for (shared, _), members in groups.items():
            layout = GradBuffer(members, bucket_size, self.dp_size, self.dp_rank)
            st = _Storage(layout, cid, shared, self.stage, self.grad_dtype, members[0].device)
            self.storages.append(st)
            for i, p in enumerate(layout.params):
                self._owner[id(p)], self._index[id(p)] = st, i
        self.params.extend(params)

    # -- backward side -------------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        grad, param.grad = param.grad, None
        if tags.is_sequence_parallel(param):
            C.all_reduce_sum(grad, self.groups.tp)
        st = self._owner[id(param)]
        flat = grad.reshape(-1)                               # (numel,)
        pr = st.layout.param_range[id(param)]
        with torch.no_grad():
            if st.full is not None:
                st.full[pr.start:pr.end].add_(flat)
            else:
                for k in st.layout.param_buckets[id(param)]:
                    self._stage_piece(st, k, pr, flat)
        idx = self._index[id(param)]
        for k in st.layout.param_buckets[id(param)]:
            st.seen[k].add(idx)
            if len(st.seen[k]) == len(st.layout.buckets[k].params) and not st.ready[k]:
                st.ready[k] = True
                st.num_ready += 1
        self._issue_ready(st)

    def _stage_piece(self, st: _Storage, k: int, pr: Range, flat: torch.Tensor) -> None:
        bucket = st.layout.buckets[k].range
        if k not in st.staging:
            st.staging[k] = torch.zeros(bucket.size, dtype=self.grad_dtype, device=flat.device)
            self._staging_bytes += st.staging[k].numel() * st.staging[k].element_size()
            self.peak_staging_bytes = max(self.peak_staging_bytes, self._staging_bytes)
        part = pr.intersect(bucket)
        st.staging[k][part.start - bucket.start:part.end - bucket.start].add_(
            flat[part.start - pr.start:part.end - pr.start])

    def _issue_ready(self, st: _Storage) -> None:
        n = len(st.layout.buckets)
        issuing = self.stage == 2 or (self.overlap and self._is_last[st.chunk_id])
        while issuing and st.next_issue < n and st.ready[st.next_issue]:
            self._issue(st, st.next_issue)
            st.next_issue += 1
        if st.num_ready == n:   # this micro-batch's backward is complete for this buffer
            st.reset_tracking()
            if self.stage == 2:
                st.next_issue = 0

    def _issue(self, st: _Storage, k: int) -> None:
        b, group, async_op = st.layout.buckets[k], self.groups.dp, self.overlap
        staged = None
        if self.stage == 0:
            work = C.all_reduce_sum(st.full[b.range.start:b.range.end], group, async_op)
        elif self.stage == 1:
            work = C.reduce_scatter_sum(st.full[b.shard_world.start:b.shard_world.end],
                                        st.full[b.range.start:b.range.end], group, async_op)
        else:
            staged = st.staging.pop(k)   # the next micro-batch stages into a new one
            off = b.shard_world.start - b.range.start
            work = C.reduce_scatter_sum(staged[off:off + b.shard_size], staged, group, async_op)
        self._pending.append((st, k, work, staged))
        if not self.overlap:
            limit = 0
        else:
            limit = self.buckets_in_flight if self.stage == 2 else len(self._pending)
        while len(self._pending) > limit:
            self._retire()

    def _retire(self) -> None:
        st, k, work, staged = self._pending.popleft()
        if work is not None:
            work.wait()
        b = st.layout.buckets[k]
        with torch.no_grad():
            if self.stage == 0:
                st.full[b.range.start:b.range.end].div_(self.dp_size)
            elif self.stage == 1:
                st.full[b.shard_world.start:b.shard_world.end].div_(self.dp_size)
            else:
                off = b.shard_world.start - b.range.start
                st.shard[b.shard_local.start:b.shard_local.end].add_(
                    staged[off:off + b.shard_size])
                self._staging_bytes -= staged.numel() * staged.element_size()

    def _flush(self, st: _Storage) -> None:
        """Start every reduction of ``st`` not yet started (stage 2: only staged buckets)."""
        for k in range(st.next_issue, len(st.layout.buckets)):
            if self.stage < 2 or k in st.staging:
                self._issue(st, k)
        st.next_issue = len(st.layout.buckets) if self.stage < 2 else 0
        st.reset_tracking()

    # -- step side -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start a step: zero the gradient storage and the bookkeeping.

        Raises RuntimeError when reductions of the previous step are still in flight.
        """
        if self._pending:
            raise RuntimeError("zero_grad() with gradient reductions in flight: call "
                               "finish_grad_sync() (or optimizer.step()) first")
        for st in self.storages:
            (st.full if st.full is not None else st.shard).zero_()
            st.staging.clear()
            st.next_issue = 0
            st.reset_tracking()
        for p in self.params:
            p.grad = None
        self._is_last = [False] * len(self.chunks)
        self._synced = False
        self._staging_bytes = self.peak_staging_bytes = 0

    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        """Called before each backward of chunk ``chunk_id``; ZeRO-2 first reduces any
        bucket a previous micro-batch left incomplete (a parameter without gradient)."""
        self._is_last[chunk_id] = is_last_microbatch
        for st in self.storages:
            if st.chunk_id != chunk_id:
                continue
            if self.stage == 2:
                self._flush(st)
            else:
                st.reset_tracking()

    def finish_grad_sync(self) -> None:
        """Wait for every DP reduction, divide by N, then sum tied weights over
        ``groups.embedding``. Idempotent until the next ``zero_grad``."""
        if self._synced:
            return
        for st in self.storages:
            if st.next_issue < len(st.layout.buckets) or self.stage == 2:
                self._flush(st)
        while self._pending:
            self._retire()
        for st in self.storages:
            if st.shard is not None:
                st.shard.div_(self.dp_size)
            if st.shared:
                for _, _, view in self.owned_grads(st):
                    C.all_reduce_sum(view, self.groups.embedding)
        self._synced = True

    def owned_grads(self, st: _Storage) -> list[tuple[Range, Range, torch.Tensor]]:
        """This rank's reduced gradient of ``st``: ``(world range, local range, 1-D view)``
        pieces (stage 0: the whole buffer). Valid after ``finish_grad_sync``."""
        out = []
        for world, local in st.layout.owned_pieces(self.stage):
            if st.full is not None:
                out.append((world, local, st.full[world.start:world.end]))
            else:
                out.append((world, local, st.shard[local.start:local.end]))
        return out

    def grad_bytes(self) -> int:
        """Bytes of persistent gradient storage on this rank (full buffers or shards)."""
        return sum(t.numel() * t.element_size() for st in self.storages
                   for t in (st.full, st.shard) if t is not None)
