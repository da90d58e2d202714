"""Weights that live in host memory and come to the device only while they are used.

A frozen model that runs once per step (post-training's reference model) needs its weights on
the device for that forward pass alone. :class:`HostResident` copies the storages of its
parameters into one host allocation (``host_memory.HostArena``, page-locked on CUDA so that the
copies are asynchronous) and resizes each device storage to 0 bytes: the parameters keep their
shapes, every view of them stays valid, and they hold no device memory. ``on_device()`` gives
the storages their bytes back and copies the weights in for the ``with`` block, then frees them
again. Outside the block a parameter has no memory at all: reading it is a crash (a null
storage), never a stale value, so only code inside the block may touch it.

Cost per use: one host-to-device copy of ``nbytes``; device memory outside the block: none.
This is OpenRLHF's ``--ref_reward_offload`` and DeepSpeed-Chat's reference ``offload`` done
without an optimizer engine: the weights never change, so nothing is copied back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from megazero.offload.host_memory import HostArena, can_pin


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostResident:
    """The weights of ``params`` (tensors on ``device``; several may share a storage) kept in
    host memory between uses (module docstring).

    Attributes: ``nbytes`` (bytes copied in per use; the storages' total), ``pinned`` (whether
    the host copy is page-locked: a CUDA device with CUDA available).
    Raises whatever page-locking raises (``HostArena``)."""

    def __init__(self, params: Iterable[torch.Tensor], device: torch.device):
        unique: dict[int, torch.UntypedStorage] = {}
        for p in params:
            st = p.untyped_storage()
            unique.setdefault(st.data_ptr(), st)
        self.storages = list(unique.values())
        self.pinned = can_pin(device)
        self.arena = HostArena([st.nbytes() for st in self.storages], torch.uint8, pin=self.pinned)
        self.nbytes = self.arena.nbytes
        for st, part in zip(self.storages, self.arena.parts):
            part.copy_(_byte_view(st))
        self.resident = True
        self.release()

    def release(self) -> None:
        """Free the device storages (0 bytes each); the host copy stays."""
        for st in self.storages:
            st.resize_(0)
        self.resident = False

    def acquire(self) -> None:
        """Give each device storage its bytes back and copy the host copy in (asynchronous
        from pinned memory; the same stream's later kernels see it)."""
        for st, part in zip(self.storages, self.arena.parts):
            st.resize_(part.numel())
            _byte_view(st).copy_(part, non_blocking=self.pinned)
        self.resident = True

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The weights on the device for the block, freed after it (also on an exception)."""
        self.acquire()
        try:
            yield
        finally:
            self.release()
