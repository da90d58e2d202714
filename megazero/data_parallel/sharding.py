"""ZeRO sharding strategies (Rajbhandari et al., SC'20, sec. 5) behind one sharded-buffer interface.

A :class:`ShardedBuffer` is one flat buffer of one model chunk's parameters (one dtype, tied
or not, laid out by :class:`~megazero.data_parallel.grad_buffer.GradBuffer`) plus their
gradient storage. It is the public interface the optimizer, clipping and checkpointing use:

- ``owned()``: the ranges this rank owns, ``(world, local, grad view)`` per bucket;
- ``params_flat``: the model parameters themselves (each parameter's ``.data`` is a view of
  it, as in Megatron-LM's ``param_and_grad_buffer``), so an fp32 model's parameters ARE the
  fp32 main params the optimizer updates (no second copy);
- ``gather_params(fill_shard, ...)``: how updated parameters come back to every DP rank.

What differs per ZeRO stage lives in one :class:`ShardingStrategy` subclass each (N = DP size,
Psi = elements of the buffer), chosen once by
:func:`megazero.data_parallel.stages.make_strategy`; each extends its stage's
:class:`~megazero.data_parallel.policy.ShardingPolicy` (what is sharded, staged and gathered,
the paper's formula: the answers the config and the planner read without processes):

- :class:`Stage0` (plain DP): full gradient buffer (Psi), SUM all-reduce per bucket in the
  last micro-batch, every rank owns every bucket; parameters are updated in place.
- :class:`Stage1` (P_os): full gradient buffer, SUM reduce-scatter per bucket in the last
  micro-batch; each rank owns its 1/N shard of every bucket; parameters all-gathered.
- :class:`Stage2` (P_os+g): only the Psi/N gradient shard persists; each micro-batch stages
  a bucket, reduce-scatters it as soon as it is complete and adds the rank's shard in.

- :class:`~megazero.data_parallel.zero3.Stage3` (P_os+g+p): ZeRO-2's gradients plus a 1/N
  parameter shard; ``gather``/``release`` around each gather unit's forward and backward
  (``zero3_gather``: per layer, prefetched).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megazero import collectives as C
from megazero.data_parallel.grad_buffer import GradBuffer, Range
from megazero.data_parallel.policy import Replicated, ShardGradients, ShardingPolicy, ShardOptimizer


@dataclass(frozen=True)
class OwnedRange:
    """One owned run of a buffer: ``world`` range in the flat buffer, ``local`` range in this
    rank's optimizer coordinates (== world at stage 0), ``grad`` its 1-D reduced gradient
    (valid after ``DataParallel.finish_grad_sync``)."""

    world: Range
    local: Range
    grad: torch.Tensor


def divide(t: torch.Tensor, n: int) -> None:
    """``t /= n`` in place, skipped at ``n == 1`` (x / 1 is x: a pass over the gradient saved
    per bucket at dp 1)."""
    if n != 1:
        t.div_(n)


class ShardingStrategy(ShardingPolicy):
    """What one ZeRO stage stores and communicates; stateless apart from its settings.

    The policy's answers (``stage``, ``shards_optimizer``: owned gradients are disjoint over DP,
    so norms sum over the whole world; ``shards_grads``; ``shards_params``: parameters gathered
    around each unit's compute; ``staging_slots``; ``formula_bytes``) come from the stage's
    :class:`~megazero.data_parallel.policy.ShardingPolicy`; ``reduces_each_microbatch`` (reduce
    every micro-batch during backward, not once in the last one) is the mechanics' own.
    """

    reduces_each_microbatch = False

    def init_params(self, buf: "ShardedBuffer", values: Callable) -> None:
        """Give ``buf`` its parameter storage and values, one parameter at a time: here the full
        flat buffer ``params_flat`` (world coordinates, zero padding), each parameter's
        ``.data`` becoming its view. ``values(p)`` is ``p``'s value (its ``.data``, or an
        unmaterialized stage's ``initial_partition``). ZeRO-3 keeps its shard only."""
        layout = buf.layout
        buf.params_flat = torch.zeros(layout.padded_numel, dtype=buf.param_dtype, device=buf.device)
        for p in layout.params:
            r = layout.param_range[id(p)]
            buf.params_flat[r.start : r.end].copy_(values(p).reshape(-1))
            p.data = buf.params_flat[r.start : r.end].view_as(p)

    def gather(self, buf: "ShardedBuffer", group) -> None:
        """Make ``buf``'s parameters whole before compute (ZeRO-3)."""

    def release(self, buf: "ShardedBuffer") -> None:
        """Drop what ``gather`` made after compute (ZeRO-3)."""

    def shard_on_host(self, buf: "ShardedBuffer"):
        """Context in which ``buf``'s parameter storage holds its values (always, but for ZeRO-3
        shards on NVMe)."""
        return contextlib.nullcontext()

    def owned_param_view(self, buf: "ShardedBuffer", own) -> torch.Tensor:
        """1-D view of the model parameters of an owned run (model dtype)."""
        return buf.params_flat[own.world.start : own.world.end]

    # -- what this rank owns ----------------------------------------------------------------
    def owned_ranges(self, layout: GradBuffer) -> list[tuple[Range, Range]]:
        """``(world, local)`` per bucket: this rank's shard of every bucket."""
        return [(b.shard_world, b.shard_local) for b in layout.buckets]

    def owned_numel(self, layout: GradBuffer) -> int:
        return layout.shard_numel

    # -- gradient storage --------------------------------------------------------------------
    def allocate_grads(self, layout: GradBuffer, dtype: torch.dtype, device) -> torch.Tensor:
        """Persistent gradient storage: the full buffer (world coordinates)."""
        return torch.zeros(layout.padded_numel, dtype=dtype, device=device)

    def grad_view(self, buf: "ShardedBuffer", world: Range, local: Range) -> torch.Tensor:
        return buf.grads[world.start : world.end]

    def accumulate(self, buf: "ShardedBuffer", param, flat: torch.Tensor, stage_piece) -> None:
        """Add ``param``'s gradient ``flat`` (1-D) into the storage; ``stage_piece(buf, k, pr,
        flat)`` copies its part of bucket ``k`` into a staging buffer (stage 2)."""
        pr = buf.layout.param_range[id(param)]
        buf.grads[pr.start : pr.end].add_(flat)

    def start_reduce(self, buf: "ShardedBuffer", k: int, group, async_op: bool):
        """Start bucket ``k``'s DP reduction; returns ``(work handle or None, staged)``."""
        raise NotImplementedError

    def finish_reduce(self, buf: "ShardedBuffer", k: int, staged, dp_size: int) -> None:
        """After the reduction of bucket ``k`` completed: sum the shard over the replica group
        (hybrid sharding), divide by N / add into the shard."""
        b = buf.layout.buckets[k]
        shard = buf.grads[b.shard_world.start : b.shard_world.end]
        C.all_reduce_sum(shard, buf.replica_group)
        divide(shard, dp_size)

    def finish_sync(self, buf: "ShardedBuffer", dp_size: int) -> None:
        """After every bucket of the step was reduced (stage 2 sums its shard over the replica
        group and divides it once)."""

    def needs_flush(self, buf: "ShardedBuffer", k: int) -> bool:
        """Bucket ``k`` still needs a reduction when the step's gradients are flushed."""
        return True

    def in_flight_limit(self, overlap: bool, buckets_in_flight: int, pending: int) -> int:
        """Reductions left waiting after one is started (0: wait at once)."""
        return pending if overlap else 0

    # -- parameters --------------------------------------------------------------------------
    def gather_params(self, buf: "ShardedBuffer", fill_shard: Callable, chunk_numel: int, group, dp_size: int) -> int:
        """Bring every DP rank the updated parameters of ``buf``; returns the temporary bytes.

        ``fill_shard(a, b, out)`` writes this rank's updated values of local range ``[a, b)``
        (model dtype) into ``out``. Gathers in pieces of ``chunk_numel`` elements per rank
        (``allgather_bucket_size / N``), writing straight into ``buf.params_flat``.
        """
        layout, dtype = buf.layout, buf.params_flat.dtype
        per_rank = max(1, min(chunk_numel, layout.shard_numel))
        shard = torch.empty(per_rank, dtype=dtype, device=buf.params_flat.device)
        out = torch.empty(per_rank * dp_size, dtype=dtype, device=shard.device)
        for a in range(0, layout.shard_numel, per_rank):
            b = min(a + per_rank, layout.shard_numel)
            fill_shard(a, b, shard[: b - a])
            C.all_gather_into(out[: (b - a) * dp_size], shard[: b - a], group)  # rank-major
            for rank in range(dp_size):
                for world, local in layout.local_to_world(Range(a, b), rank):
                    src = rank * (b - a) + local.start - a
                    buf.params_flat[world.start : world.end].copy_(out[src : src + world.size])
        return (shard.numel() + out.numel()) * shard.element_size()

    def gather_bound_bytes(self, buf: "ShardedBuffer", chunk_numel: int, dp_size: int) -> int:
        """The temporary bytes ``gather_params`` uses (its return value)."""
        per_rank = max(1, min(chunk_numel, buf.layout.shard_numel))
        return per_rank * (dp_size + 1) * buf.param_dtype.itemsize


class Stage0(Replicated, ShardingStrategy):
    """Plain data parallelism: every rank keeps and updates everything."""

    def owned_ranges(self, layout):
        return [(b.range, b.range) for b in layout.buckets]

    def owned_numel(self, layout):
        return layout.padded_numel

    def start_reduce(self, buf, k, group, async_op):
        r = buf.layout.buckets[k].range
        return C.all_reduce_sum(buf.grads[r.start : r.end], group, async_op), None

    def finish_reduce(self, buf, k, staged, dp_size):
        r = buf.layout.buckets[k].range
        divide(buf.grads[r.start : r.end], dp_size)

    def gather_params(self, buf, fill_shard, chunk_numel, group, dp_size):
        """Every rank owns everything: write the updated values in place (nothing when the
        main params are the model params)."""
        if not buf.main_is_param:
            n = buf.layout.padded_numel
            fill_shard(0, n, buf.params_flat[:n])
        return 0

    def gather_bound_bytes(self, buf, chunk_numel, dp_size):
        return 0


class Stage1(ShardOptimizer, ShardingStrategy):
    """ZeRO-1 (P_os): full gradient buffer, reduce-scatter in the last micro-batch."""

    def start_reduce(self, buf, k, group, async_op):
        b = buf.layout.buckets[k]
        return C.reduce_scatter_sum(
            buf.grads[b.shard_world.start : b.shard_world.end], buf.grads[b.range.start : b.range.end], group, async_op
        ), None


class Stage2(ShardGradients, ShardingStrategy):
    """ZeRO-2 (P_os+g): per micro-batch staging buckets, a persistent gradient shard."""

    reduces_each_microbatch = True

    def allocate_grads(self, layout, dtype, device):
        return torch.zeros(layout.shard_numel, dtype=dtype, device=device)  # local coords

    def grad_view(self, buf, world, local):
        return buf.grads[local.start : local.end]

    def accumulate(self, buf, param, flat, stage_piece):
        pr = buf.layout.param_range[id(param)]
        for k in buf.layout.param_buckets[id(param)]:
            stage_piece(buf, k, pr, flat)

    def start_reduce(self, buf, k, group, async_op):
        b = buf.layout.buckets[k]
        staged = buf.staging.pop(k)  # the next micro-batch stages into another buffer
        off = b.shard_world.start - b.range.start
        return C.reduce_scatter_sum(staged[off : off + b.shard_size], staged, group, async_op), staged

    def finish_reduce(self, buf, k, staged, dp_size):
        b = buf.layout.buckets[k]
        off = b.shard_world.start - b.range.start
        buf.grads[b.shard_local.start : b.shard_local.end].add_(staged[off : off + b.shard_size])

    def finish_sync(self, buf, dp_size):
        C.all_reduce_sum(buf.grads, buf.replica_group)  # hybrid sharding; no-op when flat
        divide(buf.grads, dp_size)

    def needs_flush(self, buf, k):
        return k in buf.staging

    def in_flight_limit(self, overlap, buckets_in_flight, pending):
        return buckets_in_flight if overlap else 0


def _own_values(p: torch.Tensor) -> torch.Tensor:
    """``p``'s own values; ValueError for a placeholder (zero strides: one value repeated)."""
    if p.numel() > 1 and not any(p.stride()):
        raise ValueError(
            f"parameter of shape {tuple(p.shape)} is a placeholder holding no values; "
            "give DataParallel its initial_values (model.build.initial_values)"
        )
    return p.data


class ShardedBuffer:
    """One flat parameter buffer, its gradient storage and backward bookkeeping.

    Args: ``layout`` (the GradBuffer), ``chunk_id`` (model chunk), ``shared`` (weights tied
    across pipeline stages), ``strategy``, ``grad_dtype``, ``values`` (a parameter's initial
    value, default its ``.data``; asked for one parameter at a time). The constructor copies
    every parameter into ``params_flat`` (world coordinates, model dtype) and makes the
    parameter's ``.data`` a view of it (``strategy.init_params``; ZeRO-3 copies only this rank's
    shard). ``main_is_param``: the parameters are fp32, so the optimizer updates them in place
    as its main params. ``device``: where the parameters live (that of the first parameter).
    ``group``: the data-parallel group the buffer is reduced and sharded over (its size is the
    layout's ``dp_size``; the expert-data-parallel group for expert parameters); ``divisor``:
    what the summed gradient is divided by (the number of replicas whose losses it sums;
    default the group size); ``replica_group``: hybrid sharding's group holding the other copies
    of this rank's shards (their reduced gradients SUM all-reduced over it), None when flat;
    ``replica_rank`` this rank's index in it (0 when flat: the copy the norm and checkpoints count).
    """

    def __init__(
        self,
        layout: GradBuffer,
        chunk_id: int,
        shared: bool,
        strategy: ShardingStrategy,
        grad_dtype: torch.dtype,
        values: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        *,
        group=None,
        divisor: Optional[int] = None,
        replica_group=None,
    ):
        self.layout, self.chunk_id, self.shared, self.strategy = layout, chunk_id, shared, strategy
        self.group, self.divisor = group, layout.dp_size if divisor is None else divisor
        self.replica_group, self.replica_rank = replica_group, C.group_rank(replica_group)
        first = layout.params[0]
        self.param_dtype, self.device = first.dtype, first.device
        self.main_is_param = first.dtype == torch.float32
        self.params_flat = self.params_shard = None  # stage 3: the shard, local coordinates
        with torch.no_grad():
            strategy.init_params(self, values or _own_values)
        self.grads = strategy.allocate_grads(layout, grad_dtype, self.device)
        self.staging: dict[int, torch.Tensor] = {}  # stage 2: bucket index -> [bucket size]
        self.next_issue = 0
        self.solo = False  # set by DataParallel: no rank to reduce with, the hooks only store
        self.untouched: set = set()  # solo: id of each parameter whose range holds no gradient of this step yet
        self.reset_tracking()

    def reset_tracking(self) -> None:
        self.seen = [set() for _ in self.layout.buckets]
        self.num_ready = 0
        self.ready = [False] * len(self.layout.buckets)

    def owned(self) -> list[OwnedRange]:
        """This rank's owned runs with their reduced gradients, in local order."""
        return [
            OwnedRange(w, l, self.strategy.grad_view(self, w, l)) for w, l in self.strategy.owned_ranges(self.layout)
        ]

    def owned_numel(self) -> int:
        return self.strategy.owned_numel(self.layout)

    def owned_param_values(self, own: OwnedRange) -> torch.Tensor:
        """1-D view of the model parameters of owned run ``own`` (the shard at ZeRO-3)."""
        return self.strategy.owned_param_view(self, own)

    def param_values(self, world: Range) -> torch.Tensor:
        """1-D view of the model parameters in world range ``world`` (model dtype)."""
        return self.params_flat[world.start : world.end]

    def grad_bytes(self) -> int:
        return self.grads.numel() * self.grads.element_size()

    def param_bytes(self) -> int:
        """Bytes of parameter storage held now (full buffer and/or ZeRO-3 shard)."""
        return sum(t.numel() * t.element_size() for t in (self.params_flat, self.params_shard) if t is not None)

    def gather_params(self, fill_shard: Callable, chunk_numel: int) -> int:
        """See :meth:`ShardingStrategy.gather_params` (over this buffer's ``group``); returns
        the temporary bytes used."""
        return self.strategy.gather_params(self, fill_shard, chunk_numel, self.group, self.layout.dp_size)
