"""ZeRO-1/2 parameter all-gather overlapped with the next forward (``--overlap-param-gather``).

Megatron-core's ``overlap_param_gather``
(``megatron/core/distributed/param_and_grad_buffer.py``,
``megatron/core/distributed/distributed_data_parallel.py``): after the optimizer step of
iteration k each rank holds the updated values of its shard only. Instead of all-gathering every bucket before the step
returns, :meth:`ParamGatherOverlap.start` issues one asynchronous all-gather per bucket, in
the order the next forward needs them, and forward pre-hooks wait for a bucket just before
the first module of iteration k+1 that uses its parameters runs.

The all-gather of bucket ``k`` (world range ``[s, e)``, shard ``n = (e - s) / N``) is done in
place: rank r's updated values lie at ``params_flat[s + r n, s + (r + 1) n)`` (its shard in
world coordinates, ``grad_buffer.py``), which is exactly where a rank-major all-gather of
``N`` shards into ``params_flat[s:e]`` reads rank r's input, so no temporary buffer is
needed. Every element is copied, not computed: the parameters are bit-identical to the
synchronous ``ShardingStrategy.gather_params``, and the bytes on the wire are the same
(``Psi`` elements per step).

Issue and wait order: for each model chunk in order, the buckets in the order of the chunk's
``parameters()`` (registration order, which is forward order), weights tied across pipeline
stages (their own buffer, ``DataParallel``) first, because the first stage's embedding uses
them before anything else. Waits are in issue order: a hook that needs the i-th bucket waits
for buckets 0..i.

Where the hooks go: on the module whose forward *reads* a parameter, not the one that registers
it. A pre-hook on a module that is never called, or whose parameters its parent reads directly
(``F.linear(x, self.router.weight)``), waits too late: on NCCL the read sees the bucket before
its all-gather landed (gloo finishes early and hides it; tests/support/deferred.py does not).
So hooks sit on every module that directly owns parameters, except that a module that declares
``reads_descendant_parameters = True`` (its forward reads its submodules' parameters itself:
the MoE layer's router, experts and shared expert, ``model/moe.py``) or is compiled with
``torch.compile`` (``nn.Module.compile``) counts as one module owning all its parameters: one
hook waits for every bucket of its subtree, and nothing below it is hooked (so no hook runs
inside a compiled region; the hook of a compiled module is ``torch.compiler.disable``-d, a graph
break at its start; every hook is, once torch._dynamo is imported). The tied buffer is waited
for by a
pre-hook on the chunk itself, because the last stage's head reads the embedding weight
without calling the embedding module. Before anything else reads the parameters (the next
optimizer step, a checkpoint save, an evaluation, the end of training) call
:meth:`ParamGatherOverlap.wait_all`.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from torch import nn

from megazero import collectives as C


class ParamGatherOverlap:
    """Asynchronous per-bucket all-gather of updated parameters, waited for by forward pre-hooks.

    Args: ``chunks`` (this rank's model chunks, in order), ``buffers`` (the
    ``DataParallel.buffers``: ``ShardedBuffer`` objects of ZeRO stage 1 or 2), ``group`` (the DP
    group, for a buffer that names no group of its own; expert buffers gather over theirs).
    Attributes: ``order`` (list of ``(buffer, bucket index)`` in issue order),
    ``waits`` (buckets waited for by a forward pre-hook since construction), ``waits_all``
    (buckets waited for by ``wait_all``), ``starts`` (calls of ``start``).

    Raises ValueError when a buffer's strategy is not ZeRO stage 1 or 2 (stage 0 updates the
    parameters in place; stage 3 gathers them itself before each forward).
    """

    def __init__(self, chunks: list[nn.Module], buffers: list, group):
        for buf in buffers:
            if not buf.strategy.gathers_after_step:
                raise ValueError(
                    f"overlap_param_gather needs ZeRO stage 1 or 2, got stage "
                    f"{buf.strategy.stage}; fix: --overlap-param-gather off"
                )
        self.group, self.waits, self.waits_all, self.starts = group, 0, 0, 0
        where = {}  # id(param) -> (buffer, bucket indices)
        for buf in buffers:
            for p in buf.layout.params:
                where[id(p)] = (buf, buf.layout.param_buckets[id(p)])
        self.order: list[tuple] = []
        self._position: dict[tuple[int, int], int] = {}
        for cid, chunk in enumerate(chunks):
            for buf in buffers:
                if buf.chunk_id == cid and buf.shared:
                    self._append(buf, range(len(buf.layout.buckets)))
            for p in chunk.parameters():
                if id(p) in where:
                    self._append(*where[id(p)])
        for buf in buffers:  # buckets no parameter of any chunk reached (none expected)
            self._append(buf, range(len(buf.layout.buckets)))
        self._pending: list = []  # work handles (None when done), in ``order``
        self._next = 0  # first position not yet waited for
        for cid, chunk in enumerate(chunks):
            self._hook_chunk(cid, chunk, buffers, where)

    def _append(self, buf, buckets) -> None:
        for k in buckets:
            if (id(buf), k) not in self._position:
                self._position[(id(buf), k)] = len(self.order)
                self.order.append((buf, k))

    def _hook_chunk(self, cid: int, chunk: nn.Module, buffers: list, where: dict) -> None:
        shared = [
            self._position[(id(b), k)]
            for b in buffers
            if b.chunk_id == cid and b.shared
            for k in range(len(b.layout.buckets))
        ]
        if shared:
            self._register(chunk, max(shared))
        for module in self._hook_modules(chunk):
            params = module.parameters() if reads_subtree(module) else module.parameters(recurse=False)
            needed = [
                self._position[(id(where[id(p)][0]), k)] for p in params if id(p) in where for k in where[id(p)][1]
            ]
            if needed:
                self._register(module, max(needed))

    @staticmethod
    def _hook_modules(root: nn.Module):
        """``root`` and its descendants, not descending into modules that read their whole
        subtree's parameters (``reads_subtree``)."""
        stack = [root]
        while stack:
            m = stack.pop()
            yield m
            if not reads_subtree(m):
                stack.extend(m.children())

    def _register(self, module: nn.Module, position: int) -> None:
        def hook(_module, _args):
            self._wait_upto(position, by_hook=True)

        module.register_forward_pre_hook(eager_hook(module, hook))

    @torch.no_grad()
    def start(self, fills: dict[int, Optional[Callable]]) -> None:
        """Issue every bucket's all-gather asynchronously, in ``order``.

        ``fills[id(buffer)]``: ``fill(a, b, out)`` writing this rank's updated values of local
        range ``[a, b)`` into ``out`` (model dtype), or None when the buffer's parameters are
        already the updated values (fp32 main params). Raises RuntimeError when gathers of
        the previous ``start`` are still pending.
        """
        if self.pending():
            raise RuntimeError("ParamGatherOverlap.start with all-gathers still pending: call wait_all() first")
        self.starts += 1
        self._pending, self._next = [], 0
        for buf, k in self.order:
            b = buf.layout.buckets[k]
            shard = buf.params_flat[b.shard_world.start : b.shard_world.end]
            fill = fills.get(id(buf))
            if fill is not None:
                fill(b.shard_local.start, b.shard_local.end, shard)
            full = buf.params_flat[b.range.start : b.range.end]
            group = self.group if buf.group is None else buf.group
            self._pending.append(C.all_gather_into(full, shard, group, async_op=True))

    def pending(self) -> int:
        """All-gathers issued and not yet waited for."""
        return len(self._pending) - self._next

    def _wait_upto(self, position: int, by_hook: bool) -> None:
        while self._next <= position and self._next < len(self._pending):
            work, self._pending[self._next] = self._pending[self._next], None
            if work is not None:
                work.wait()
            self._next += 1
            if by_hook:
                self.waits += 1
            else:
                self.waits_all += 1

    def wait_all(self) -> None:
        """Wait for every pending all-gather (before the parameters are read or updated)."""
        self._wait_upto(len(self._pending) - 1, by_hook=False)


def _is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def reads_subtree(module: nn.Module) -> bool:
    """Whether ``module``'s forward is where its whole subtree's parameters are read, so that a
    forward pre-hook waiting for their buckets belongs on it and on nothing below: a module
    compiled with ``nn.Module.compile`` (its submodules run inside the compiled region), or one
    whose class sets ``reads_descendant_parameters = True`` (its forward reads the parameters
    of submodules it does not call, e.g. ``F.linear(x, self.router.weight)``)."""
    return _is_compiled(module) or bool(getattr(module, "reads_descendant_parameters", False))


def eager_hook(module: nn.Module, hook: Callable) -> Callable:
    """``hook`` (a module forward / pre-forward hook of megazero's machinery) made to run
    eagerly: the hooks of a module compiled with ``nn.Module.compile`` run inside its compiled
    region, so there they are ``torch.compiler.disable``-d (a graph break at their start), and
    so is every hook once ``torch._dynamo`` is imported (something may compile a larger region).
    Otherwise ``hook`` is returned as it is: ``torch.compiler.disable`` imports torch._dynamo,
    about 2 s of CPU an eager run never needs. Used for the overlapped parameter all-gather's
    waits and ZeRO-3's gather / release (``zero3_gather.py``)."""
    if _is_compiled(module) or "torch._dynamo" in sys.modules:
        return torch.compiler.disable(hook)
    return hook
