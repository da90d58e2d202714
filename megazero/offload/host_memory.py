"""Page-locked host memory as one allocation of whole pages per offloaded buffer.

``torch.empty(n, pin_memory=True)`` goes through CUDA's caching host allocator
(``at::cuda::CachingHostAllocator``), which rounds every request up to a power of two and
keeps the block cached: 16 bytes per owned element of offloaded optimizer state can pin up
to 32, and each of the four state tensors (and each ZeRO-3 gather unit's parameter shard) is
rounded on its own. A :class:`HostArena` instead allocates ordinary host memory, carves it
into the parts the caller names, and page-locks it in place with ``cudaHostRegister`` (CUDA
Runtime API, "Memory Management"), called through ``torch.cuda.cudart()``;
``cudaHostUnregister`` runs when the arena is freed.

The driver locks whole pages, so the registered range is page-aligned and a whole number of
pages (``page_range``): an arena to be pinned takes its parts from the first page boundary of
an allocation one page longer than its bytes rounded up to pages, and registers exactly those
pages. Two arenas therefore never share a page (each registered page lies inside its own
allocation); registering byte ranges as they came from torch's allocator (64-byte aligned)
put a small arena's page inside another one's, and the driver refuses a second registration
of a page (``cudaErrorHostMemoryAlreadyRegistered``), which ZeRO-3 parameter offload (one arena
per gather unit), NVMe offload and ``--async-save`` staging hit. ``pinned_bytes`` reports the
registered bytes: the parts' bytes rounded up to pages (at most one page more per arena; the
unregistered alignment slack is at most another).

Registered memory is what CUDA needs for asynchronous copies (``cudaMemcpyAsync`` from
page-locked memory; ``Tensor.is_pinned()`` is True for it), so ``non_blocking=True`` copies
to and from the parts are truly asynchronous.
"""

from __future__ import annotations

import os
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


def page_bytes() -> int:
    """The host page size in bytes (``os.sysconf("SC_PAGE_SIZE")``; 4096 where that is unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return 4096


def page_range(ptr: int, nbytes: int, page: int) -> tuple[int, int]:
    """``(start, length)`` in bytes of the whole pages covering ``[ptr, ptr + nbytes)``:
    ``start`` rounded down and the end rounded up to a multiple of ``page``."""
    start = ptr - ptr % page
    end = -(-(ptr + nbytes) // page) * page
    return start, end - start


class HostArena:
    """One host allocation of ``sum(sizes)`` elements of ``dtype``, zero-filled and split
    into ``parts`` (1-D views, in order), page-locked as whole pages when ``pin``.

    Args:
        sizes: elements of each part (>= 0).
        dtype: element type of every part.
        pin: page-lock the allocation (needs CUDA; see :func:`can_pin`); the parts then start
            on a page boundary and the registered range is their bytes rounded up to whole
            pages (module docstring).
        registrar: what pins it (default :class:`CudaRegistrar`).
        page: the page size in bytes (default :func:`page_bytes`).

    Attributes: ``flat`` (the parts end to end, 1-D), ``parts``, ``nbytes`` (the parts'
    bytes), ``pinned_bytes`` (the registered bytes, ``nbytes`` rounded up to whole pages,
    when pinned; else 0).

    Raises ValueError for a negative size; whatever the registrar raises when pinning fails.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        dtype: torch.dtype,
        *,
        pin: bool,
        registrar: Optional[Registrar] = None,
        page: Optional[int] = None,
    ):
        if any(n < 0 for n in sizes):
            raise ValueError(f"HostArena: part sizes must be >= 0, got {list(sizes)}")
        numel = sum(sizes)
        self.nbytes = numel * dtype.itemsize
        self.pinned_bytes = 0
        pin = pin and self.nbytes > 0
        page = page or page_bytes()
        span = -(-self.nbytes // page) * page  # whole pages
        # the one intentional host allocation of offload: pinned below when CUDA is there
        if pin:  # one page of slack so that the parts can start on a page boundary
            raw = torch.zeros(span + page, dtype=torch.uint8, device="cpu")
            skip = -raw.data_ptr() % page
            self.flat = raw[skip : skip + self.nbytes].view(dtype)
        else:
            self.flat = torch.zeros(numel, dtype=dtype, device="cpu")
        self.parts, start = [], 0
        for n in sizes:
            self.parts.append(self.flat[start : start + n])
            start += n
        if pin:
            registrar = registrar or CudaRegistrar()
            ptr, length = page_range(self.flat.data_ptr(), self.nbytes, page)
            registrar.register(ptr, length)
            self.pinned_bytes = length
            # runs before ``flat`` is released (weak references are cleared first)
            weakref.finalize(self, registrar.unregister, ptr)
