"""ZeRO-3 gather schedule: per-unit all-gathers, prefetch, release (DeepSpeed's stage3_* knobs).

A *gather unit* is a module given by the caller (a transformer layer, the embedding, the
head; megazero never imports the model, so ``train.py`` names them) or, per model chunk, the
chunk's remaining parameters. Each unit has its own sharded buffer(s) (``zero3.Stage3``).
Parameters with fewer elements than ``param_persistence_threshold`` form one buffer per
chunk that stays whole (ZeRO-2 style: sharded gradients and optimizer state, all-gathered
after the step), as DeepSpeed's persistent parameters.

Around a unit's forward (module pre-hook / hook) and backward (a gradient hook on the unit's
output, fired just before the unit's backward) its parameters are gathered; after the
forward they are released unless ``reshard_after_forward`` is off or the unit is used again
(its backward) within ``max_reuse_distance`` elements of other units' parameters; after the
backward (every gradient of the unit arrived) they are released when resharding.

Prefetch (DeepSpeed's parameter trace / FSDP2's one-ahead prefetch): the order of units in a
chunk's first forward is recorded; once known, gathering unit i issues asynchronous
all-gathers for the next units (forward order, reversed in backward) up to
``prefetch_bucket_size`` elements, so unit i+1's gather is in flight while unit i computes.
``max_live_parameters`` bounds the gathered elements: a prefetch that would pass it is not
issued, and a gather on demand first releases gathered units not in use (lowest trace
position first). Every decision depends only on the module structure and the schedule,
which are the same on all DP ranks, so the collectives match; gathering only copies values,
so every setting gives bit-identical results.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from megazero.data_parallel.param_gather import eager_hook
from megazero.offload.param_swap import ParamSwapOptions


@dataclass(frozen=True)
class Zero3Options:
    """ZeRO-3 settings, in elements as DeepSpeed's ``zero_optimization.stage3_*`` keys.

    ``prefetch_bucket_size``: elements prefetched ahead of the computing unit (0: none);
    ``max_live_parameters``: bound on gathered elements at any time (see module docstring);
    ``param_persistence_threshold``: parameters with fewer elements stay whole;
    ``max_reuse_distance``: a unit used again within this many elements stays gathered;
    ``reshard_after_forward``: release after the forward (else keep until the step's end);
    ``offload_param``: parameter shards in host memory between uses;
    ``fp8_param_gather``: the FP8 GEMMs' weights all-gathered as e4m3 bytes with the scale of the
    whole weight (:mod:`megazero.data_parallel.zero3_fp8`; Megatron-LM's ``--fp8-param-gather``);
    ``param_swap``: parameter shards in NVMe swap files between uses
    (:class:`~megazero.offload.param_swap.ParamSwapOptions`; None: not on NVMe).
    Defaults are DeepSpeed's, except the persistence threshold (DeepSpeed 100,000; here 0 so
    that a bare ``DataParallel`` shards every parameter; ``train.py`` passes the flag).
    """

    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    param_persistence_threshold: int = 0
    max_reuse_distance: int = 1_000_000_000
    reshard_after_forward: bool = True
    offload_param: bool = False
    param_swap: Optional[ParamSwapOptions] = None
    fp8_param_gather: bool = False


@dataclass(eq=False)
class Unit:
    """One gather unit: its buffers, elements (padded), chunk and place in the forward trace."""

    chunk_id: int
    module: Optional[nn.Module]  # None: the chunk's remaining parameters
    buffers: list = field(default_factory=list)
    numel: int = 0
    nbytes: int = 0  # gathered bytes (FP8 buffers: one per element)
    position: int = -1  # index in the chunk's forward trace
    in_forward: int = 0  # forwards running now
    in_backward: bool = False  # backward started, gradients not all arrived
    done: set = field(default_factory=set)  # buffers whose gradients all arrived


def split_units(params: list, modules: list, threshold: int):
    """Group a chunk's ``params`` into ``(persistent, [(module or None, params)])``: those with
    fewer than ``threshold`` elements, then each module's parameters (first module wins),
    then the rest (module ``None``). Order inside each group follows ``params``."""
    persistent = [p for p in params if p.numel() < threshold]
    taken, groups = {id(p) for p in persistent}, []
    for m in modules:
        mine = {id(p) for p in m.parameters()}
        members = [p for p in params if id(p) in mine and id(p) not in taken]
        taken |= {id(p) for p in members}
        if members:
            groups.append((m, members))
    rest = [p for p in params if id(p) not in taken]
    return persistent, groups + ([(None, rest)] if rest else [])


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Zero3Gather:
    """The gather/prefetch/release schedule of one ``DataParallel`` at ZeRO-3.

    Args: ``ddp`` (its ``strategy``, each buffer's ``group``, byte counters), ``options``
    (:class:`Zero3Options`). Attributes: ``units``, ``live`` (gathered or in-flight
    elements now), ``live_bytes`` (their bytes: one per element of an FP8-gathered buffer),
    ``peak_live`` (its high-water mark), ``prefetches`` (units prefetched).
    """

    def __init__(self, ddp, options: Zero3Options):
        self.ddp, self.opt = ddp, options
        self.units: list[Unit] = []
        self.trace: dict[int, list[Unit]] = {}
        self.traced: set[int] = set()  # chunks whose forward trace is complete
        self._unit_of: dict[int, Unit] = {}
        self.live = self.peak_live = self.prefetches = 0
        self.live_bytes = 0  # bytes of the gathered or in-flight units now
        self.itemsize = 0

    def add_chunk(self, chunk: nn.Module, chunk_id: int) -> None:
        """Mark the chunk's forward trace complete after its first forward."""
        chunk.register_forward_hook(lambda m, a, out, c=chunk_id: self.traced.add(c))

    def add_unit(self, chunk: nn.Module, chunk_id: int, module, buffers: list) -> None:
        """Register a unit's buffers and its hooks (``module`` None: the chunk's own hooks)."""
        u = Unit(chunk_id, module, list(buffers), sum(b.layout.padded_numel for b in buffers))
        u.nbytes = sum(self.ddp.strategy.gathered_nbytes(b) for b in buffers)
        self.itemsize = max(self.itemsize, *(b.param_dtype.itemsize for b in buffers))
        self.units.append(u)
        for b in buffers:
            self._unit_of[id(b)] = u
        target = chunk if module is None else module
        target.register_forward_pre_hook(eager_hook(target, lambda m, a, u=u: self._pre_forward(u)))
        target.register_forward_hook(eager_hook(target, lambda m, a, out, u=u: self._post_forward(u, out)))

    # -- gather / release ------------------------------------------------------------------
    def _gathered(self, u: Unit) -> bool:
        return any(b.params_flat is not None or b.pending_gather is not None for b in u.buffers)

    def _start(self, u: Unit, async_op: bool) -> None:
        if self._gathered(u):
            return
        for b in u.buffers:
            self.ddp.strategy.start_gather(b, b.group, async_op)
        self.live += u.numel
        self.live_bytes += u.nbytes
        self.peak_live = max(self.peak_live, self.live)
        ddp = self.ddp
        ddp.peak_temp_bytes = max(ddp.peak_temp_bytes, ddp._temp_bytes + self.live_bytes)

    def _gather(self, u: Unit) -> None:
        """Gather ``u`` now (waiting for its prefetch if one is in flight)."""
        if not self._gathered(u):
            self._make_room(u)
        self._start(u, async_op=False)
        for b in u.buffers:
            self.ddp.strategy.finish_gather(b)

    def release(self, u: Unit) -> None:
        if self._gathered(u):
            self.live -= u.numel
            self.live_bytes -= u.nbytes
        for b in u.buffers:
            self.ddp.strategy.release(b)

    def release_all(self) -> None:
        """Step end: every unit back to its shard."""
        for u in self.units:
            u.in_forward, u.in_backward = 0, False
            u.done.clear()
            self.release(u)

    @contextlib.contextmanager
    def holding(self):
        """Every unit gathered once on entry, kept through the block and released on exit: the
        many forwards without gradients of a rollout (one per decoded token) then cost one
        all-gather of each unit instead of one per token (the re-gathering of TRL #3858).
        Collective over each buffer's group. Units held count as in use, so
        ``max_live_parameters`` does not release them: the whole model is live meanwhile.
        Nothing gathered outlives the block, so an update after it cannot leave stale copies."""
        for u in self.units:
            self._gather(u)
            u.in_forward += 1
        try:
            yield self
        finally:
            for u in self.units:
                u.in_forward -= 1
                if u.in_forward == 0 and not u.in_backward:
                    self.release(u)

    def _busy(self, u: Unit) -> bool:
        return u.in_forward > 0 or u.in_backward

    def _make_room(self, need: Unit) -> None:
        """Release idle gathered units (lowest trace position first) until ``need`` fits
        under ``max_live_parameters`` or none is left to release."""
        idle = sorted(
            (u for u in self.units if u is not need and self._gathered(u) and not self._busy(u)),
            key=lambda u: (u.chunk_id, u.position),
        )
        for u in idle:
            if self.live + need.numel <= self.opt.max_live_parameters:
                return
            self.release(u)

    def _prefetch(self, u: Unit, backward: bool) -> None:
        """Start the all-gathers of the units after ``u`` in the chunk's trace (before it
        in backward) up to ``prefetch_bucket_size`` elements, within ``max_live_parameters``."""
        order = self.trace.get(u.chunk_id, [])
        if self.opt.prefetch_bucket_size <= 0 or u.chunk_id not in self.traced or u.position < 0:
            return
        nxt = order[: u.position][::-1] if backward else order[u.position + 1 :]
        budget = self.opt.prefetch_bucket_size
        for v in nxt:
            if self._gathered(v):
                continue
            if v.numel > budget or self.live + v.numel > self.opt.max_live_parameters:
                return
            budget -= v.numel
            self._start(v, async_op=True)
            self.prefetches += 1

    # -- hooks -----------------------------------------------------------------------------
    def _pre_forward(self, u: Unit) -> None:
        backward = _in_backward()  # a recomputed forward runs inside the backward
        cid = u.chunk_id
        if u.module is not None and cid not in self.traced and not backward and u.position < 0:
            u.position = len(self.trace.setdefault(cid, []))
            self.trace[cid].append(u)
        self._gather(u)
        u.in_forward += 1
        self._prefetch(u, backward)

    def _post_forward(self, u: Unit, out) -> None:
        u.in_forward -= 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, u=u: self._pre_backward(u))
        if u.in_forward == 0 and not u.in_backward and not self._keep_after_forward(u):
            self.release(u)

    def _keep_after_forward(self, u: Unit) -> bool:
        """Stay gathered for the backward: no resharding, a recomputed forward (its backward
        follows at once), or reuse within ``max_reuse_distance`` elements (the units after
        ``u`` in the trace are gathered before ``u``'s backward)."""
        if not self.opt.reshard_after_forward or _in_backward():
            return True
        if not torch.is_grad_enabled():  # no backward follows (evaluation, generation)
            return False
        if u.module is None:  # the chunk's own parameters: its backward comes next
            return self.opt.max_reuse_distance >= 0
        if u.chunk_id not in self.traced:
            return False
        distance = sum(v.numel for v in self.trace[u.chunk_id][u.position + 1 :])
        return distance <= self.opt.max_reuse_distance

    def _pre_backward(self, u: Unit) -> None:
        self._gather(u)
        u.in_backward = True
        self._prefetch(u, backward=True)

    def after_backward(self, buf) -> None:
        """Every gradient of ``buf`` arrived in this micro-batch: once the whole unit is done,
        release it when resharding (else it stays until the step's end)."""
        u = self._unit_of.get(id(buf))
        if u is None:
            return
        u.done.add(id(buf))
        if len(u.done) < len(u.buffers):
            return
        u.done.clear()
        u.in_backward = False
        if self.opt.reshard_after_forward and u.in_forward == 0:
            self.release(u)
