"""NCCL's completion order on gloo ranks: asynchronous collectives that land only at ``wait()``.

gloo runs an asynchronous collective on its own thread and usually finishes it long before the
host asks, so code that reads a collective's output before ``work.wait()`` (or writes its input)
sees the finished result on gloo and stale or torn data on NCCL, where the collective runs on a
CUDA stream that the host only orders against at ``wait()`` (docs/design.md, contract 6). While
this mode is on (``deferred_collectives()``, or ``MEGAZERO_TEST_DEFERRED_COLLECTIVES=1`` in the
environment of ``run_distributed`` / ``forked_train_main`` ranks):

- a collective called with ``async_op=True`` (``all_reduce``, ``all_gather_into_tensor`` /
  ``all_gather_single``, ``reduce_scatter_tensor`` / ``reduce_scatter_single``, ``all_gather``,
  ``broadcast``, ``all_to_all_single``) does nothing at the call but poison its output and
  returns a ``DeferredWork`` whose ``wait()`` runs the real, synchronous collective: a read of the
  output before the wait sees the old buffer, and a write to the input before the wait changes
  what is sent, as on NCCL. A synchronous call completes at the call, as before;
- poisoning: at the call, the floating-point output is filled with NaN, so a read before the wait
  is loud rather than merely stale. Where the output aliases the input (the in-place ZeRO
  all-gather: this rank's shard lies inside the output) only the elements outside the input are
  poisoned; an in-place ``all_reduce``, and a reduce-scatter whose output lies inside its input,
  are not poisoned (the buffer holds the input until the wait);
- ``batch_isend_irecv`` (pipeline p2p, ring attention) is posted for real at the call (a deferred
  send would deadlock a receiver that blocks before the sender waits), but each receive lands in a
  private buffer copied into the caller's at ``wait()`` (the caller's buffer is NaN until then),
  and each send goes from a snapshot taken at the call; ``wait()`` raises ``RuntimeError`` when a
  sent tensor was written between the call and the wait (on NCCL that write races the send).

``is_completed()`` is False until ``wait()``; ``get_future()`` lands the operation at once and
returns a finished future (no deferral there; megazero uses none).
``counts`` holds the asynchronous calls deferred and the waits that ran them, per operation.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections import Counter

import torch
import torch.distributed as dist

ENV = "MEGAZERO_TEST_DEFERRED_COLLECTIVES"

#: ``counts["all_gather_into_tensor"]``: asynchronous calls deferred; ``counts["wait"]``: waits that
#: ran a deferred collective; ``counts["p2p"]``: deferred p2p batches.
counts: Counter = Counter()

# name -> (output argument, input argument): the output is poisoned unless it is the input
_COLLECTIVES = {
    "all_reduce": ("tensor", "tensor"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "all_gather_single": ("output_tensor", "input_tensor"),
    "reduce_scatter_tensor": ("output", "input"),
    "reduce_scatter_single": ("output", "input"),
    "all_gather": ("tensor_list", "tensor"),
    "broadcast": ("tensor", None),
    "all_to_all_single": ("output", "input"),
}


class DeferredWork:
    """A work handle whose operation runs (or lands) at the first ``wait()``."""

    def __init__(self, land, value=()):
        self._land, self._done, self._value = land, False, list(value)

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._done = True
            counts["wait"] += 1
            self._land()
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        """A future already done: the operation runs now (a future has no hook at its wait;
        torch's DDP comm hooks use one, megazero none); its value is the output tensors, as
        gloo's."""
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._value)
        return fut


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


@torch.no_grad()
def poison(out: torch.Tensor, inp) -> None:
    """Fill floating-point ``out`` with NaN, except the elements of ``inp`` when it lies inside
    ``out`` (both contiguous); ``out`` overlapping ``inp`` any other way is left as it is."""
    if not out.is_floating_point() or out.numel() == 0:
        return
    if inp is None or inp.numel() == 0 or inp.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
        out.fill_(float("nan"))
        return
    (o0, o1), (i0, i1) = _span(out), _span(inp)
    if i1 <= o0 or o1 <= i0:  # same storage, no overlap
        out.fill_(float("nan"))
    elif out.is_contiguous() and inp.is_contiguous() and o0 <= i0 and i1 <= o1 and out.dtype == inp.dtype:
        flat, a = out.view(-1), (i0 - o0) // out.element_size()
        flat[:a].fill_(float("nan"))
        flat[a + inp.numel() :].fill_(float("nan"))


def _deferred_collective(name: str, real):
    signature = inspect.signature(real)
    out_arg, in_arg = _COLLECTIVES[name]

    def collective(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if not bound.arguments.get("async_op", False):
            return real(*args, **kwargs)
        counts[name] += 1
        out = bound.arguments[out_arg]
        outputs = out if isinstance(out, list) else [out]
        if name == "broadcast" and _broadcast_source(bound.arguments) == dist.get_rank():
            outputs = []  # the source's tensor is the input
        if out_arg != in_arg:
            for t in outputs:
                poison(t, bound.arguments.get(in_arg) if in_arg else None)
        bound.arguments["async_op"] = False
        return DeferredWork(lambda: real(*bound.args, **bound.kwargs), out if isinstance(out, list) else [out])

    collective.__name__ = collective.__qualname__ = name
    collective.deferred_real = real
    return collective


def _broadcast_source(arguments: dict) -> int:
    """The global rank a ``broadcast`` call sends from (``src``, or ``group_src`` in its group)."""
    if arguments.get("src") is not None:
        return arguments["src"]
    return dist.get_global_rank(arguments.get("group") or dist.group.WORLD, arguments["group_src"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _deferred_batch(real):
    def batch_isend_irecv(p2p_op_list):
        counts["p2p"] += 1
        posted, sends, recvs = [], [], []
        for op in p2p_op_list:
            if op.op is dist.isend:
                sent = op.tensor.detach().clone()
                sends.append((op.tensor, sent))
            else:
                sent = torch.empty_like(op.tensor)
                recvs.append((op.tensor, sent))
                poison(op.tensor, None)
            posted.append(dist.P2POp(op.op, sent, group=op.group, tag=op.tag, group_peer=op.group_peer))
        works = real(posted)

        def land():
            for w in works:
                w.wait()
            with torch.no_grad():
                for mine, got in recvs:
                    mine.copy_(got)
            for mine, sent in sends:
                if not torch.equal(_bits(mine), _bits(sent)):
                    raise RuntimeError(
                        f"deferred collectives: a tensor {tuple(mine.shape)} {mine.dtype} was written after its isend"
                        " was posted and before its wait (on NCCL the send may read either value)"
                    )

        shared = DeferredWork(land)
        return [_Member(shared) for _ in p2p_op_list]

    batch_isend_irecv.deferred_real = real
    return batch_isend_irecv


class _Member(DeferredWork):
    """One operation's handle of a batch: waiting any of them lands the whole batch."""

    def __init__(self, shared: DeferredWork):
        self._shared = shared

    def wait(self, timeout=None) -> bool:
        return self._shared.wait(timeout)

    def is_completed(self) -> bool:
        return self._shared.is_completed()

    def is_success(self) -> bool:
        return self._shared.is_success()


def _targets():
    """(module, attribute, replacement) of every entry point megazero reaches collectives by."""
    from megazero import collectives as C

    out = []
    for name in _COLLECTIVES:
        real = getattr(dist, name, None)
        if real is not None:
            out.append((dist, name, _deferred_collective(name, real)))
    wrapped = {getattr(dist, n, None): r for _, n, r in out}
    for attr in ("ALL_GATHER_OP", "REDUCE_SCATTER_OP"):  # bound at import time
        out.append((C, attr, wrapped[getattr(C, attr)]))
    out.append((dist, "batch_isend_irecv", _deferred_batch(dist.batch_isend_irecv)))
    return out


@contextlib.contextmanager
def deferred_collectives():
    """Inside the block, asynchronous collectives land only at ``wait()`` (module docstring);
    on the way out the real functions are put back. Not reentrant."""
    targets = _targets()
    saved = [(m, a, getattr(m, a)) for m, a, _ in targets]
    if any(hasattr(old, "deferred_real") for _, _, old in saved):
        raise RuntimeError("deferred_collectives is already on")
    try:
        for module, attr, new in targets:
            setattr(module, attr, new)
        yield counts
    finally:
        for module, attr, old in saved:
            setattr(module, attr, old)


def install_from_env(stack: contextlib.ExitStack) -> bool:
    """Enter ``deferred_collectives()`` on ``stack`` when ``MEGAZERO_TEST_DEFERRED_COLLECTIVES`` is
    ``1`` (what ``run_distributed``'s ranks do); returns whether it did."""
    if os.environ.get(ENV) != "1":
        return False
    stack.enter_context(deferred_collectives())
    return True
