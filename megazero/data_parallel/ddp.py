"""Data parallelism with ZeRO gradient handling (Rajbhandari et al., SC'20, sec. 5).

Backward hooks (``register_post_accumulate_grad_hook``) move every gradient into the flat
storage of its :class:`~megazero.data_parallel.sharding.ShardedBuffer` and set
``param.grad = None``. What the storage is and when it is reduced over the DP group is the
ZeRO stage's :class:`~megazero.data_parallel.sharding.ShardingStrategy` (N = DP size, Psi =
elements of this rank's model chunks): stage 0 all-reduces a full buffer and stage 1
reduce-scatters it, once per step in the last micro-batch; stage 2 keeps only a Psi/N
gradient shard and reduce-scatters a staged bucket as soon as it is complete in EVERY
micro-batch. A bucket that lies inside one parameter is reduce-scattered straight from
autograd's gradient; the others are staged in buffers from a free list (a retired bucket's
buffer is reused by the next one; the list is freed when the step's gradients are synced),
so gradient memory is one shard plus the few buckets in flight.

With ``overlap_comm`` a reduction starts (``async_op=True``) as soon as its bucket is
complete and the ones before it have started (buckets start in order on every rank, so
the DP ranks' collectives match); the handles are waited in ``finish_grad_sync``.
Without it every reduction is synchronous. Both do the same arithmetic in the same order:
results are bit-identical. All reductions are SUM then divide by N (never ``ReduceOp.AVG``).

``finish_grad_sync`` ends with one "finalize model grads" step
(:mod:`megazero.data_parallel.finalize`): the sequence-parallel gradients summed over TP
and the tied-embedding gradients over ``groups.embedding``, coalesced, on the owned runs.
Weights tied across pipeline stages get a buffer of their own, laid out identically on the
first and last stage, so the two copies' owned runs match range for range.

Expert parallelism: the routed experts' parameters (``tags.is_expert_parallel``) get
buffers of their own, reduced and sharded over ``groups.edp`` (the dp x cp / EP ranks holding
the same experts) instead of ``groups.dp``. Their gradient already sums the tokens of the whole
ep group (the dispatch's backward), so it is divided by the full replica count N like every
other gradient: each buffer carries its ``group`` (reduction and sharding) and its ``divisor``
(always N, Megatron-LM's gradient scaling of expert parameters). With expert tensor parallelism
(etp < tp) ``groups.edp`` also holds the tp / etp ranks of the same expert partition, whose
gradients are those of disjoint token ranges (``model/moe.py``): summed with the replicas, and
still divided by N = dp x cp.

Hybrid sharding (MiCS, Zhang et al. 2022, sec. 3; FSDP's HYBRID_SHARD): with
``groups.topology.hybrid`` every buffer's ``group`` is the S-rank ``groups.zero_shard`` and its
``replica_group`` the dp x cp / S-rank ``groups.zero_replica``. Gradients are reduce-scattered
inside the shard group as above; then each reduced shard is SUM all-reduced across the replica
group (stage 1: per bucket as it retires; stages 2/3: the accumulated shard once per step, in
``finish_sync``), and only then divided by the full N. Parameter all-gathers stay inside the
shard group. Expert buffers (``ep > 1`` or etp < tp: ``groups.experts_apart``) do the same inside
``groups.expert_zero_shard`` (the S / EP edp ranks of one shard group, Megatron-LM's partial
expert-data-parallel group) and over the same replica group; flat, that group is ``groups.edp``
(with etp < tp the tp / etp copies of an expert partition folded in) and there is no replica group.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Callable, Optional

import torch
from torch import nn

from megazero import collectives as C
from megazero import tags
from megazero.data_parallel.finalize import finalize_model_grads
from megazero.data_parallel.grad_buffer import GradBuffer, Range
from megazero.data_parallel.policy import BUCKETS_IN_FLIGHT
from megazero.data_parallel.sharding import ShardedBuffer, Stage2
from megazero.data_parallel.stages import make_strategy
from megazero.data_parallel.zero3_fp8 import Fp8GatherStage3
from megazero.data_parallel.zero3_gather import Zero3Gather, Zero3Options, split_units
from megazero.offload.param_swap import ParamSwapper
from megazero.process_groups import ProcessGroups


class DataParallel:
    """Gradient synchronisation over the DP group for this rank's model chunks.

    Args:
        chunks: this rank's model chunks (one per virtual pipeline stage), in order.
        groups: process groups (uses ``dp``, ``tp``, ``embedding``, and ``edp`` for expert-parallel
            parameters).
        zero_stage: 0 (all-reduce), 1 (reduce-scatter, full gradient buffer), 2
            (reduce-scatter per micro-batch, gradient shard only) or 3 (stage 2 plus parameter
            shards, gathered per unit around its forward and backward: ``zero3_gather.py``).
        bucket_size: elements per bucket (rounded up to a multiple of the DP size); also
            bounds the finalize step's packed buffers.
        overlap_comm: start reductions asynchronously during backward.
        grad_dtype: dtype of gradient storage and of the reductions (fp32 default).
        buckets_in_flight: stage 2: started reductions waiting to complete at most.
        reshard_after_forward: stage 3: drop a unit's gathered parameters after its forward
            and gather them again before its backward (True), or keep them gathered from the
            unit's first forward until ``finish_grad_sync`` (False: one all-gather per unit
            and step, held across the step's micro-batches).
        units: stage 3: per chunk, the modules that are gather units, in forward order (e.g.
            the embedding, each transformer layer, the head); the chunk's other parameters are
            one more unit gathered around the whole chunk. ``None``: one unit per chunk.
        zero3: stage 3 settings (:class:`~megazero.data_parallel.zero3_gather.Zero3Options`:
            prefetch, live bound, persistence, reuse distance, parameter offload, FP8 all-gather); its
            ``reshard_after_forward`` is replaced by the argument above.
        initial_values: per chunk, None (its parameters hold their values) or, for a chunk
            whose parameters are placeholders (``model.gpt.GPTStage(materialize=False)``), a
            function from parameter name to its initial value (the stage's
            ``initial_partition``). The buffers ask for one parameter at a time, in buffer
            order; at ZeRO-3 each gather unit is filled and sharded before the next, and only
            the parts in this rank's shards are kept (``zero3.Stage3.init_params``).

    Attributes: ``buffers`` (list[ShardedBuffer], the public interface), ``strategy``,
    ``params``, ``dp_size``, ``peak_temp_bytes`` (staging high-water mark of the last step),
    ``zero3`` (the stage-3 gather schedule, else None).

    Call ``zero_grad()`` at the start of a step, ``before_backward(chunk_id,
    is_last_microbatch)`` before each backward (needed for overlap in stages 0/1 and for
    parameters left unused by a micro-batch under stage 2), ``finish_grad_sync()`` after
    the last backward. Raises ValueError for a bad stage, bucket size or in-flight count.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        groups: ProcessGroups,
        *,
        zero_stage: int,
        bucket_size: int,
        overlap_comm: bool,
        grad_dtype: torch.dtype = torch.float32,
        buckets_in_flight: int = BUCKETS_IN_FLIGHT,
        reshard_after_forward: bool = True,
        units: Optional[list[list[nn.Module]]] = None,
        zero3: Optional[Zero3Options] = None,
        initial_values: Optional[list[Optional[Callable[[str], torch.Tensor]]]] = None,
    ):
        self.reshard_after_forward = reshard_after_forward
        self.strategy = make_strategy(zero_stage)
        self.zero3 = None
        if self.strategy.shards_params:
            opts = replace(zero3 or Zero3Options(), reshard_after_forward=reshard_after_forward)
            if opts.fp8_param_gather:  # the FP8 weights of each unit in buffers gathered as e4m3 bytes
                self.strategy = Fp8GatherStage3(groups.tp)
            self.strategy.offload_param = opts.offload_param or opts.param_swap is not None
            self.strategy.param_swap = (
                None
                if opts.param_swap is None
                # NVMe: swap files
                else ParamSwapper(opts.param_swap, groups.rank)
            )
            self.zero3 = Zero3Gather(self, opts)
        if bucket_size < 1 or buckets_in_flight < 1:
            raise ValueError(f"bucket_size ({bucket_size}) and buckets_in_flight ({buckets_in_flight}) must be >= 1")
        self.chunks, self.groups = list(chunks), groups
        self.overlap, self.grad_dtype = overlap_comm, grad_dtype
        self.dp_size, self.dp_rank = C.group_size(groups.dp), C.group_rank(groups.dp)
        self.buckets_in_flight, self.bucket_size = buckets_in_flight, bucket_size
        self.buffers: list[ShardedBuffer] = []
        self._owner: dict[int, ShardedBuffer] = {}
        self._index: dict[int, int] = {}
        self.params: list[nn.Parameter] = []
        try:
            for cid, chunk in enumerate(self.chunks):
                self._add_chunk(
                    cid,
                    chunk,
                    bucket_size,
                    (units or [[]] * len(chunks))[cid],
                    (initial_values or [None] * len(chunks))[cid],
                )
        except BaseException:  # e.g. a full disk under the parameter swap file: its folder goes now
            if getattr(self.strategy, "param_swap", None) is not None:
                self.strategy.param_swap.close()
            raise
        self._is_last = [False] * len(self.chunks)
        self._pending: deque = deque()  # (buffer, bucket index, work handle, staged)
        self._free: list[torch.Tensor] = []  # staging buffers to reuse (stage 2)
        self._pool: set[int] = set()  # data_ptr of every staging buffer of this step
        self._synced = False
        self._temp_bytes = self.peak_temp_bytes = 0
        # held by autograd in C++, where Python's garbage collector cannot see the cycle
        # parameter -> hook -> self -> chunks -> parameter: ``close`` removes them
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    @property
    def _gathered_bytes(self) -> int:
        """ZeRO-3: bytes of parameters gathered (or being gathered) beyond the shards."""
        return 0 if self.zero3 is None else self.zero3.live_bytes

    @property
    def stage(self) -> int:
        return self.strategy.stage

    def _add_chunk(
        self,
        cid: int,
        chunk: nn.Module,
        bucket_size: int,
        units: list,
        initial_value: Optional[Callable[[str], torch.Tensor]],
    ) -> None:
        params = [p for p in chunk.parameters() if p.requires_grad and id(p) not in self._owner]
        values = None
        if initial_value is not None:
            names = {id(p): name for name, p in chunk.named_parameters()}
            values = lambda p: initial_value(names[id(p)])
        if self.zero3 is None:
            self._add_buffers(cid, params, bucket_size, self.strategy, values)
        else:  # ZeRO-3: small parameters stay whole (ZeRO-2 buffer), one buffer set per unit
            persistent, groups = split_units(params, units, self.zero3.opt.param_persistence_threshold)
            self._add_buffers(cid, persistent, bucket_size, Stage2(), values)
            self.zero3.add_chunk(chunk, cid)
            for module, members in groups:
                self.zero3.add_unit(
                    chunk, cid, module, self._add_buffers(cid, members, bucket_size, self.strategy, values)
                )
        if values is not None:
            left = [name for name, p in chunk.named_parameters() if id(p) not in self._owner]
            if left:
                raise ValueError(
                    f"chunk {cid}: parameters {left[:3]} are placeholders that no buffer "
                    "fills (requires_grad=False); materialize the stage first"
                )
        self.params.extend(params)

    def _add_buffers(self, cid: int, params: list, bucket_size: int, strategy, values=None) -> list:
        """One ShardedBuffer per (tied across stages, dtype, expert-parallel, FP8-gathered) group of
        ``params``, its values from ``values(p)`` (default: each parameter's own)."""
        groups: dict[tuple, list] = {}
        fp8 = isinstance(strategy, Fp8GatherStage3)
        for p in params:
            key = (tags.is_shared_embedding(p), p.dtype, tags.is_expert_parallel(p), fp8 and tags.is_fp8_weight(p))
            groups.setdefault(key, []).append(p)
        made = []
        for (shared, _, expert, _), members in groups.items():
            if expert and self.groups.experts_apart:  # edp, or its S / EP ranks in one shard group
                group, replica = self.groups.expert_zero_shard, self.groups.zero_replica
            else:  # hybrid sharding: shard over S ranks, all-reduce the shards over the rest
                group, replica = self.groups.zero_shard_group, self.groups.zero_replica
            layout = GradBuffer(members, bucket_size, C.group_size(group), C.group_rank(group))
            buf = ShardedBuffer(
                layout,
                cid,
                shared,
                strategy,
                self.grad_dtype,
                values,
                group=group,
                divisor=self.dp_size,
                replica_group=replica,
            )
            # nothing to reduce: one rank, no replica, no division, gradients kept whole in the
            # buffer (stages 0/1). The hook then only stores the gradient, copied over the
            # range on its first micro-batch (no zeroing pass) and added after; ranges without
            # a gradient are zeroed in finish_grad_sync (a plain loop's cost)
            buf.solo = (
                layout.dp_size == 1
                and replica is None
                and buf.divisor == 1
                and not strategy.reduces_each_microbatch
                and self.zero3 is None
            )
            self.buffers.append(buf)
            made.append(buf)
            for i, p in enumerate(layout.params):
                self._owner[id(p)], self._index[id(p)] = buf, i
        return made

    # -- backward side -------------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        grad, param.grad = param.grad, None
        buf = self._owner[id(param)]
        if buf.solo:  # no bucket to reduce: storing the gradient is the whole step
            pr = buf.layout.param_range[id(param)]
            with torch.no_grad():
                if id(param) in buf.untouched:  # the step's first gradient: written, not added
                    buf.untouched.discard(id(param))
                    buf.grads[pr.start : pr.end].copy_(grad.reshape(-1))
                else:
                    buf.grads[pr.start : pr.end].add_(grad.reshape(-1))
            return
        with torch.no_grad():
            self.strategy.accumulate(buf, param, grad.reshape(-1), self._stage_piece)
        idx = self._index[id(param)]
        for k in buf.layout.param_buckets[id(param)]:
            buf.seen[k].add(idx)
            if len(buf.seen[k]) == len(buf.layout.buckets[k].params) and not buf.ready[k]:
                buf.ready[k] = True
                buf.num_ready += 1
        self._issue_ready(buf)

    def _stage_piece(self, buf: ShardedBuffer, k: int, pr: Range, flat: torch.Tensor) -> None:
        bucket = buf.layout.buckets[k].range
        if pr.start <= bucket.start and bucket.end <= pr.end and flat.dtype == self.grad_dtype:
            # the bucket is this gradient alone: reduce-scatter it where autograd put it
            buf.staging[k] = flat[bucket.start - pr.start : bucket.end - pr.start]
            return
        if k not in buf.staging:
            buf.staging[k] = self._take_staging(bucket.size, flat.device)
        part = pr.intersect(bucket)
        buf.staging[k][part.start - bucket.start : part.end - bucket.start].add_(
            flat[part.start - pr.start : part.end - pr.start]
        )

    def _take_staging(self, numel: int, device) -> torch.Tensor:
        """A zeroed ``[numel]`` staging view: a reused buffer when one is free."""
        if self._free:
            return self._free.pop()[:numel].zero_()
        t = torch.zeros(self._largest_bucket(), dtype=self.grad_dtype, device=device)
        self._pool.add(t.data_ptr())
        self._temp_bytes += t.numel() * t.element_size()
        self.peak_temp_bytes = max(self.peak_temp_bytes, self._temp_bytes + self._gathered_bytes)
        return t[:numel]

    def _largest_bucket(self) -> int:
        """Elements of the largest bucket of any buffer: the size of a staging buffer. A bucket
        never exceeds its buffer, so a bucket size above the model's gradient (e.g. DeepSpeed's
        2e8) costs the size of the gradient, not of the setting."""
        return max(bk.range.size for b in self.buffers for bk in b.layout.buckets)

    def _issue_ready(self, buf: ShardedBuffer) -> None:
        n = len(buf.layout.buckets)
        each = self.strategy.reduces_each_microbatch
        issuing = each or (self.overlap and self._is_last[buf.chunk_id])
        while issuing and buf.next_issue < n and buf.ready[buf.next_issue]:
            self._issue(buf, buf.next_issue)
            buf.next_issue += 1
        if buf.num_ready == n:  # this micro-batch's backward is complete for this buffer
            buf.reset_tracking()
            if self.zero3 is not None:
                self.zero3.after_backward(buf)
            if each:
                buf.next_issue = 0

    def _issue(self, buf: ShardedBuffer, k: int) -> None:
        work, staged = self.strategy.start_reduce(buf, k, buf.group, self.overlap)
        self._pending.append((buf, k, work, staged))
        limit = self.strategy.in_flight_limit(self.overlap, self.buckets_in_flight, len(self._pending))
        while len(self._pending) > limit:
            self._retire()

    def _retire(self) -> None:
        buf, k, work, staged = self._pending.popleft()
        if work is not None:
            work.wait()
        with torch.no_grad():
            self.strategy.finish_reduce(buf, k, staged, buf.divisor)
        base = None if staged is None else staged._base
        if base is not None and base.data_ptr() in self._pool:
            self._free.append(base)

    def _flush(self, buf: ShardedBuffer) -> None:
        """Start every reduction of ``buf`` not yet started (stage 2: only staged buckets)."""
        n = len(buf.layout.buckets)
        for k in range(buf.next_issue, n):
            if self.strategy.needs_flush(buf, k):
                self._issue(buf, k)
        buf.next_issue = 0 if self.strategy.reduces_each_microbatch else n
        buf.reset_tracking()

    # -- step side -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start a step: zero the gradient storage and the bookkeeping (a buffer with nothing to
        reduce, ``solo``, is not zeroed: each range is overwritten by its first gradient, and
        ``finish_grad_sync`` zeroes the ranges that got none).

        ZeRO-3 parameter shards on NVMe: every rank checks its swap file, one MAX all-reduce
        over the world (``param_swap.ParamSwapper.check``). Raises RuntimeError when reductions
        of the previous step are still in flight; SwapError on every rank for a bad swap file.
        """
        if self._pending:
            raise RuntimeError(
                "zero_grad() with gradient reductions in flight: call finish_grad_sync() (or optimizer.step()) first"
            )
        if self.param_swap is not None:
            self.param_swap.check(self.groups.world, self.params[0].device)
        for buf in self.buffers:
            if buf.solo:  # the first gradient of each parameter overwrites its range (_on_grad)
                buf.untouched = set(buf.layout.param_range)
            else:
                buf.grads.zero_()
            buf.staging.clear()
            buf.next_issue = 0
            buf.reset_tracking()
        for p in self.params:
            p.grad = None
        self._is_last = [False] * len(self.chunks)
        self._synced = False
        self._free.clear()
        self._pool.clear()
        self._temp_bytes = self.peak_temp_bytes = 0

    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        """Called before each backward of chunk ``chunk_id``; ZeRO-2 first reduces any
        bucket a previous micro-batch left incomplete (a parameter without gradient)."""
        self._is_last[chunk_id] = is_last_microbatch
        for buf in self.buffers:
            if buf.chunk_id != chunk_id:
                continue
            if self.strategy.reduces_each_microbatch:
                self._flush(buf)
            else:
                buf.reset_tracking()

    def finish_grad_sync(self) -> None:
        """Wait for every DP reduction, divide by N, free the staging buffers, then finalize
        the model grads (SP over TP, tied weights over ``groups.embedding``). Idempotent
        until the next ``zero_grad``."""
        if self._synced:
            return
        for buf in self.buffers:
            if buf.solo:  # nothing to reduce; a parameter without a gradient this step gets zeros
                with torch.no_grad():
                    for key in buf.untouched:
                        pr = buf.layout.param_range[key]
                        buf.grads[pr.start : pr.end].zero_()
                buf.untouched = set()
                continue
            if buf.next_issue < len(buf.layout.buckets) or self.strategy.reduces_each_microbatch:
                self._flush(buf)
        while self._pending:
            self._retire()
        self._free.clear()
        self._pool.clear()
        self._temp_bytes = 0
        if self.zero3 is not None:
            self.zero3.release_all()
        for buf in self.buffers:
            self.strategy.finish_sync(buf, buf.divisor)
        tied_here = self._sum_tied_on_rank()
        *_, peak = finalize_model_grads(
            self._owned_param_grads(), self.groups.tp, None if tied_here else self.groups.embedding, self.bucket_size
        )
        self.peak_temp_bytes = max(self.peak_temp_bytes, peak)
        self._synced = True

    def close(self) -> None:
        """End of the run: wait for any reduction still in flight and remove the gradient hooks.

        The hooks live in autograd's C++ state, so without this the model, these buffers and
        the process groups they reference are never freed and their gloo/NCCL worker threads
        outlive ``destroy_process_group`` into interpreter shutdown."""
        while self._pending:  # normally empty: finish_grad_sync retires every reduction
            work = self._pending.popleft()[2]
            if work is not None:
                work.wait()
        if self.zero3 is not None:
            self.zero3.release_all()  # waits for every prefetched all-gather
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.param_swap is not None:
            self.param_swap.close()  # the parameter swap file and its directory

    @property
    def param_swap(self):
        """ZeRO-3 ``offload_param`` nvme: the rank's :class:`ParamSwapper`, else None."""
        return getattr(self.strategy, "param_swap", None)

    def _sum_tied_on_rank(self) -> bool:
        """V layout (zb-v): both copies of the tied word embedding sit on this rank, the
        input's in chunk 0 and the output layer's in chunk 1, in buffers of one layout. Their
        owned gradients are summed here and written to both (what the embedding group's
        all-reduce does between two stages; a sum of two is the same in either order), and
        True is returned so that the group's all-reduce leaves them out (the last stage holds
        no copy). False when the copies are on two stages."""
        shared = [b for b in self.buffers if b.shared]
        by_chunk = [[b for b in shared if b.chunk_id == c] for c in sorted({b.chunk_id for b in shared})]
        if len(by_chunk) != 2:
            return False
        with torch.no_grad():
            for a, b in zip(*by_chunk):
                if [p.shape for p in a.layout.params] != [p.shape for p in b.layout.params]:
                    raise ValueError("tied embedding copies of chunks 0 and 1 have different layouts")
                for own_a, own_b in zip(a.owned(), b.owned()):
                    own_a.grad.add_(own_b.grad)
                    own_b.grad.copy_(own_a.grad)
        return True

    def _owned_param_grads(self):
        """``(param, gradient view)`` for every parameter run this rank owns."""
        for buf in self.buffers:
            for own in buf.owned():
                for p, _, wr in buf.layout.param_pieces(own.world):
                    yield p, own.grad[wr.start - own.world.start : wr.end - own.world.start]

    def staging_bound_bytes(self) -> int:
        """Most staging bytes the backward holds: stage 2 ``buckets_in_flight + 2`` buckets
        (those waiting for their reduction, the one being filled and the one just completed)
        when gradients arrive in buffer order, i.e. reverse registration order; else 0."""
        slots = self.strategy.staging_slots(self.buckets_in_flight)
        return slots * self._largest_bucket() * self.grad_dtype.itemsize

    def finalize_bound_bytes(self) -> int:
        """Most bytes of the finalize step's packed buffer: min(bucket, the owned elements of
        sequence-parallel (tp > 1) and tied (embedding group > 1) parameters) gradients."""
        tp, emb = C.group_size(self.groups.tp) > 1, C.group_size(self.groups.embedding) > 1
        numel = sum(
            g.numel()
            for p, g in self._owned_param_grads()
            if (tp and tags.is_sequence_parallel(p)) or (emb and tags.is_shared_embedding(p))
        )
        return min(self.bucket_size, numel) * self.grad_dtype.itemsize

    def grad_bytes(self) -> int:
        """Bytes of persistent gradient storage on this rank (full buffers or shards)."""
        return sum(buf.grad_bytes() for buf in self.buffers)

    def param_bytes(self) -> int:
        """Bytes of persistent model-parameter storage on this rank (model dtype, padded):
        the flat buffers, or the shards at ZeRO-3 (gathered parameters are temporaries)."""
        return (
            sum(
                b.param_bytes() if b.params_shard is None else b.params_shard.numel() * b.params_shard.element_size()
                for b in self.buffers
                if not getattr(b, "swapped", False)
            )
            + self._swap_pool_bytes()
        )

    def _swap_pool_bytes(self) -> int:
        return 0 if self.param_swap is None else self.param_swap.pool_bytes()

    def host_param_bytes(self) -> int:
        """Bytes of the parameter shards kept in host memory (ZeRO-3 ``offload_param``; on
        NVMe the ``max_in_cpu`` resident shards plus the bound of the swap pool's slots)."""
        return (
            sum(
                b.params_shard.numel() * b.params_shard.element_size()
                for b in self.buffers
                if getattr(b, "offloaded", False) and not getattr(b, "swapped", False)
            )
            + self._swap_pool_bytes()
        )

    def pinned_bytes(self) -> int:
        """Bytes of page-locked host memory held by the buffers (the ZeRO-3 ``offload_param``
        shards' arenas; 0 without CUDA or without offload)."""
        return sum(b.host_arena.pinned_bytes for b in self.buffers if getattr(b, "host_arena", None) is not None)

    def gathered_bound_bytes(self) -> int:
        """ZeRO-3: most bytes of gathered parameters: ``max_live_parameters``, or what is in
        use at once when that is more (a chunk's remaining parameters and two units: the one
        computing and the one whose backward is finishing), never more than all units."""
        if self.zero3 is None:
            return 0
        units = self.zero3.units
        rest = max((u.numel for u in units if u.module is None), default=0)
        top = sorted((u.numel for u in units if u.module is not None), reverse=True)[:2]
        live = max(self.zero3.opt.max_live_parameters, rest + sum(top))
        return min(live, sum(u.numel for u in units)) * self.zero3.itemsize
