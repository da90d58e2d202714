"""Swap files of the NVMe-offloaded optimizer state (ZeRO-Infinity, Rajbhandari et al. 2021).

One :class:`SwapFile` per rank and run holds this rank's fp32 optimizer state, sub-group after
sub-group (``element_bytes`` 12; ZeRO-3's parameter shards use one with ``element_bytes`` 1,
addressed in bytes: ``megazero/offload/param_swap.py``): for the sub-group of local elements ``[a, b)`` the bytes
``main[a:b]``,
``exp_avg[a:b]``, ``exp_avg_sq[a:b]`` (``12 (b - a)`` bytes) start at ``HEADER + 12 a``. The
first ``HEADER`` bytes hold a header (magic, the run id, the element count), so a file that is
missing, truncated or from another run is found by :meth:`SwapFile.check` and named in one
line (:class:`SwapError`). I/O is ``os.preadv`` / ``os.pwritev`` straight into / out of
preallocated host tensors (no page-cache tricks, no memmap), on whatever thread calls it; the
optimizer runs it on a small thread pool (``megazero/optim/nvme.py``). Every byte moved is
counted in :class:`IoCounter`. :func:`check_everywhere` is the step's collective check.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
from dataclasses import dataclass

import torch

from megazero import collectives as C
from megazero.offload.swap_dirs import FLAG, SwapError

HEADER = 4096  # bytes before the state (one page)
MAGIC = b"MZSWAP1\0"
_FORMAT = "<8s32sq"  # magic, run id (hex), elements
BYTES_PER_ELEMENT = 12  # fp32 main param + exp_avg + exp_avg_sq


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
    """A writable byte view of a contiguous host tensor's memory (no copy; any dtype). Through
    ctypes, not ``Tensor.numpy()``, which marks the storage non-resizable for good (ZeRO-3's
    swapped parameter shards resize theirs); valid while ``t`` is alive and not resized."""
    if not t.is_contiguous():
        raise ValueError("swap I/O needs a contiguous host tensor")
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def check_everywhere(file: "SwapFile", group, device) -> None:
    """Every rank checks its ``file`` (:meth:`SwapFile.check`), then one MAX all-reduce of a
    failure flag over ``group`` (the world): a bad file stops every rank in the same call, the
    owner naming it (SwapError, ``local`` True), the others with ``local`` False; none is left
    waiting in a later collective."""
    err = None
    try:
        file.check()
    except SwapError as e:
        err = e
    flag = torch.tensor([0.0 if err is None else 1.0], device=device)
    C.all_reduce_max(flag, group)
    if err is not None:
        raise err
    if flag.item() > 0:
        raise SwapError("another rank's NVMe swap file failed its check (that rank names it)", local=False)


class SwapFile:
    """This rank's swap file: ``numel`` elements of ``element_bytes`` bytes after a header.

    Created fresh (``O_EXCL``: an existing file is an error, never reused) at ``path`` with
    the header of ``run_id``, sized ``HEADER + element_bytes x numel`` bytes (sparse until
    written). ``read(a, out)`` / ``write(a, src)`` move ``out``'s bytes at byte
    ``HEADER + element_bytes x a``: with the default 12, the sub-group that starts at local
    element ``a`` (``out`` holds main, exp_avg, exp_avg_sq of it, ``3 (b - a)`` fp32).
    :meth:`grow` enlarges the file (new header, new size). Raises SwapError naming the file on
    a short read or write.
    """

    def __init__(self, path: str, numel: int, run_id: str, counter: IoCounter, element_bytes: int = BYTES_PER_ELEMENT):
        self.path, self.run_id, self.counter = path, run_id, counter
        self.element_bytes = element_bytes
        self.fd = None
        self.fd = self._os(os.open, "create", path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.grow(numel)
        self.inode = os.fstat(self.fd).st_ino

    def grow(self, numel: int) -> None:
        """Make the file hold ``numel`` elements: header rewritten, size ``HEADER +
        element_bytes x numel`` (the bytes already written stay)."""
        self.numel, self.size = numel, HEADER + self.element_bytes * numel
        header = struct.pack(_FORMAT, MAGIC, self.run_id.encode(), numel)
        self._os(os.pwrite, "write", self.fd, header.ljust(HEADER, b"\0"), 0)
        self._os(os.ftruncate, "resize", self.fd, self.size)

    def _os(self, call, what: str, *args):
        """``call(*args)``; an OSError (a full disk: ENOSPC, a read-only one, an I/O error)
        becomes a SwapError naming the file, ``--offload-nvme-path`` and the fix."""
        try:
            return call(*args)
        except OSError as e:
            root = os.path.dirname(os.path.dirname(self.path))
            fix = (
                "free space there or point it at a disk with more room" if e.errno == errno.ENOSPC else "check the disk"
            )
            raise SwapError(
                f"{FLAG} {root}: cannot {what} the swap file {self.path} ({e.strerror}); fix: {fix}, "
                "then resume from the last checkpoint"
            ) from None

    def check(self) -> None:
        """Raise SwapError (one line naming the file) when the file at ``path`` is missing,
        shorter than ``HEADER + element_bytes x numel`` bytes, or holds another run's header."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise SwapError(
                f"NVMe swap file {self.path} is missing (deleted during the run); "
                "the optimizer state in it is lost: resume from the last checkpoint"
            ) from None
        if st.st_size >= HEADER:
            with open(self.path, "rb") as f:  # the header, read from the path (not our descriptor)
                magic, run, numel = struct.unpack(_FORMAT, f.read(struct.calcsize(_FORMAT)))
            run = run.rstrip(b"\0").decode(errors="replace")
            if (magic, run, numel) != (MAGIC, self.run_id, self.numel):
                raise SwapError(
                    f"NVMe swap file {self.path} is from another run (run id {run!r}, {numel} "
                    f"elements; this run {self.run_id!r}, {self.numel}): resume from the last "
                    "checkpoint"
                )
        if st.st_size < self.size:
            raise SwapError(
                f"NVMe swap file {self.path} is truncated ({st.st_size} bytes, expected "
                f"{self.size}): resume from the last checkpoint"
            )

    def read(self, start: int, out: torch.Tensor) -> None:
        self.counter.add(read=self._io(os.preadv, start, out, "read"))

    def write(self, start: int, src: torch.Tensor) -> None:
        self.counter.add(written=self._io(os.pwritev, start, src, "write"))

    def _io(self, call, start: int, t: torch.Tensor, what: str) -> int:
        view, offset = _bytes_view(t), HEADER + self.element_bytes * start
        done = 0
        while done < len(view):
            n = self._os(call, what, self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise SwapError(
                    f"NVMe swap file {self.path}: short {what} at byte {offset + done} "
                    f"({done} of {len(view)} bytes; truncated?): resume from the last checkpoint"
                )
            done += n
        return done

    def close(self, remove: bool = True) -> None:
        """Close the descriptor and (``remove``) delete the file; safe to call twice."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            if remove and os.path.exists(self.path) and os.stat(self.path).st_ino == self.inode:
                os.remove(self.path)
