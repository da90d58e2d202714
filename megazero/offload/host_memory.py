"""Page-locked host memory as one exactly-sized allocation per offloaded buffer.

``torch.empty(n, pin_memory=True)`` goes through CUDA's caching host allocator
(``at::cuda::CachingHostAllocator``), which rounds every request up to a power of two and
keeps the block cached: 16 bytes per owned element of offloaded optimizer state can pin up
to 32, and each of the four state tensors (and each ZeRO-3 gather unit's parameter shard) is
rounded on its own. A :class:`HostArena` instead allocates ordinary host memory of exactly
the bytes asked for (torch's CPU allocator aligns the start, it does not round the size),
carves it into the parts the caller names, and page-locks that one range in place with
``cudaHostRegister`` (CUDA Runtime API, "Memory Management"), called through
``torch.cuda.cudart()``. The pinned bytes are then the arena's bytes, which is what
``pinned_bytes`` reports; ``cudaHostUnregister`` runs when the arena is freed.

Registered memory is what CUDA needs for asynchronous copies (``cudaMemcpyAsync`` from
page-locked memory; ``Tensor.is_pinned()`` is True for it), so ``non_blocking=True`` copies
to and from the parts are truly asynchronous.
"""

from __future__ import annotations

import weakref
from typing import Optional, Protocol, Sequence

import torch


class Registrar(Protocol):
    """Page-locks and releases a host address range (``cudaHostRegister`` on CUDA; tests pass
    a recorder so the arena logic runs on a CPU-only machine)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaRegistrar:
    """``cudaHostRegister(ptr, nbytes, cudaHostRegisterDefault)`` / ``cudaHostUnregister``."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Raises ``torch.cuda.CudaError`` when the driver refuses (e.g. the locked-memory
        limit, ``ulimit -l``, is lower than ``nbytes``)."""
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))

    def unregister(self, ptr: int) -> None:
        # at interpreter exit the CUDA context may already be gone; the error is moot then
        torch.cuda.cudart().cudaHostUnregister(ptr)


def can_pin(device: torch.device) -> bool:
    """Whether host memory for a model on ``device`` can be page-locked here: a CUDA model
    on a machine where CUDA is available (never on a CPU-only machine)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


class HostArena:
    """One host allocation of exactly ``sum(sizes)`` elements of ``dtype``, zero-filled and
    split into ``parts`` (1-D views, in order), page-locked as a whole when ``pin``.

    Args:
        sizes: elements of each part (>= 0).
        dtype: element type of every part.
        pin: page-lock the allocation (needs CUDA; see :func:`can_pin`).
        registrar: what pins it (default :class:`CudaRegistrar`).

    Attributes: ``flat`` (the whole allocation, 1-D), ``parts``, ``nbytes`` (exact size in
    bytes), ``pinned_bytes`` (``nbytes`` when pinned, else 0).

    Raises ValueError for a negative size; whatever the registrar raises when pinning fails.
    """

    def __init__(self, sizes: Sequence[int], dtype: torch.dtype, *, pin: bool, registrar: Optional[Registrar] = None):
        if any(n < 0 for n in sizes):
            raise ValueError(f"HostArena: part sizes must be >= 0, got {list(sizes)}")
        # the one intentional host allocation of offload: pinned below when CUDA is there
        self.flat = torch.zeros(sum(sizes), dtype=dtype, device="cpu")
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.parts, start = [], 0
        for n in sizes:
            self.parts.append(self.flat[start : start + n])
            start += n
        self.pinned_bytes = 0
        if pin and self.nbytes:
            registrar = registrar or CudaRegistrar()
            ptr = self.flat.data_ptr()
            registrar.register(ptr, self.nbytes)
            self.pinned_bytes = self.nbytes
            # runs before ``flat`` is released (weak references are cleared first)
            weakref.finalize(self, registrar.unregister, ptr)
