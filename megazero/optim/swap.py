"""Swap files of the NVMe-offloaded optimizer state (ZeRO-Infinity, Rajbhandari et al. 2021).

One :class:`SwapFile` per rank and run holds this rank's fp32 optimizer state, sub-group after
sub-group: for the sub-group of local elements ``[a, b)`` the bytes ``main[a:b]``,
``exp_avg[a:b]``, ``exp_avg_sq[a:b]`` (``12 (b - a)`` bytes) start at ``HEADER + 12 a``. The
first ``HEADER`` bytes hold a header (magic, the run id, the element count), so a file that is
missing, truncated or from another run is found by :meth:`SwapFile.check` and named in one
line (:class:`SwapError`). I/O is ``os.preadv`` / ``os.pwritev`` straight into / out of
preallocated host tensors (no page-cache tricks, no memmap), on whatever thread calls it; the
optimizer runs it on a small thread pool (``megazero/optim/nvme.py``). Every byte moved is
counted in :class:`IoCounter`.
"""
from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

import torch

HEADER = 4096                       # bytes before the state (one page)
MAGIC = b"MZSWAP1\0"
_FORMAT = "<8s32sq"                 # magic, run id (hex), elements
BYTES_PER_ELEMENT = 12              # fp32 main param + exp_avg + exp_avg_sq


class SwapError(RuntimeError):
    """A swap file failed its check or an I/O call. ``local``: the file is this rank's (the
    message names it); False on the ranks that only learnt that another rank's file failed."""

    def __init__(self, message: str, local: bool = True):
        super().__init__(message)
        self.local = local


@dataclass
class IoCounter:
    """Bytes read from and written to swap files (thread-safe adds)."""

    read: int = 0
    written: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()

    def add(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.read += read
            self.written += written


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory (no copy)."""
    return memoryview(t.numpy()).cast("B")


class SwapFile:
    """This rank's swap file: ``numel`` elements of 12 bytes after a header.

    Created fresh (``O_EXCL``: an existing file is an error, never reused) at ``path`` with
    the header of ``run_id``, sized ``HEADER + 12 numel`` bytes (sparse until written).
    ``read(a, out)`` / ``write(a, src)`` move ``out.numel()`` fp32 values at element offset
    ``12 a / 4`` words, i.e. the sub-group that starts at local element ``a`` (``out`` holds
    main, exp_avg, exp_avg_sq of it, ``3 (b - a)`` fp32). Raises SwapError naming the file on
    a short read or write.
    """

    def __init__(self, path: str, numel: int, run_id: str, counter: IoCounter):
        self.path, self.numel, self.run_id, self.counter = path, numel, run_id, counter
        self.size = HEADER + BYTES_PER_ELEMENT * numel
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        header = struct.pack(_FORMAT, MAGIC, run_id.encode(), numel)
        os.pwrite(self.fd, header.ljust(HEADER, b"\0"), 0)
        os.ftruncate(self.fd, self.size)
        self.inode = os.fstat(self.fd).st_ino

    def check(self) -> None:
        """Raise SwapError (one line naming the file) when the file at ``path`` is missing,
        shorter than ``HEADER + 12 numel`` bytes, or holds another run's header."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise SwapError(f"NVMe swap file {self.path} is missing (deleted during the run); "
                            "the optimizer state in it is lost: resume from the last checkpoint") from None
        if st.st_size >= HEADER:
            with open(self.path, "rb") as f:   # the header, read from the path (not our descriptor)
                magic, run, numel = struct.unpack(_FORMAT, f.read(struct.calcsize(_FORMAT)))
            run = run.rstrip(b"\0").decode(errors="replace")
            if (magic, run, numel) != (MAGIC, self.run_id, self.numel):
                raise SwapError(f"NVMe swap file {self.path} is from another run (run id {run!r}, {numel} "
                                f"elements; this run {self.run_id!r}, {self.numel}): resume from the last "
                                "checkpoint")
        if st.st_size < self.size:
            raise SwapError(f"NVMe swap file {self.path} is truncated ({st.st_size} bytes, expected "
                            f"{self.size}): resume from the last checkpoint")

    def read(self, start: int, out: torch.Tensor) -> None:
        self._io(os.preadv, start, out, "read")
        self.counter.add(read=out.numel() * 4)

    def write(self, start: int, src: torch.Tensor) -> None:
        self._io(os.pwritev, start, src, "write")
        self.counter.add(written=src.numel() * 4)

    def _io(self, call, start: int, t: torch.Tensor, what: str) -> None:
        view, offset = _bytes_view(t), HEADER + BYTES_PER_ELEMENT * start
        done = 0
        while done < len(view):
            n = call(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise SwapError(f"NVMe swap file {self.path}: short {what} at byte {offset + done} "
                                f"({done} of {len(view)} bytes; truncated?): resume from the last checkpoint")
            done += n

    def close(self, remove: bool = True) -> None:
        """Close the descriptor and (``remove``) delete the file; safe to call twice."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            if remove and os.path.exists(self.path) and os.stat(self.path).st_ino == self.inode:
                os.remove(self.path)
