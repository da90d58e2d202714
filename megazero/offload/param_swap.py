"""ZeRO-3 parameter shards on NVMe (ZeRO-Infinity's ``offload_param: {device: nvme}``).

Rajbhandari et al. 2021 (SC'21, sec. 5) keep the model-dtype parameter shards in NVMe swap
files and bring each into host memory only while it is needed. Here one :class:`ParamSwapper`
per rank (owned by the ZeRO-3 strategy, ``zero3.Stage3.param_swap``) holds a swap file
(``megazero/offload/swap.py``'s :class:`~megazero.offload.swap.SwapFile`, addressed in bytes: the
same header with run id and size, the same missing / truncated / foreign checks, the same
pread/pwrite and byte counter) into which every gather unit's shard is written once it is
built, in build order, at byte offset ``buf.swap_at``.

Residency: the first shards (in build order) whose elements sum to at most ``max_in_cpu`` stay
in host memory for the whole run (DeepSpeed's ``offload_param.max_in_cpu``), as with
``--offload-param cpu``; the others are *swapped*: ``buf.params_shard`` keeps its shape but its
storage is resized to 0 bytes, so every view taken of it (the optimizer's owned-run views)
stays valid and holds no memory. A swapped shard gets its memory back by :meth:`acquire` (read
from the file, or zero-filled when it is about to be overwritten whole) and loses it by
:meth:`drop`. At most ``buffer_count`` shards hold memory at once (the pool's slots; DeepSpeed's
``offload_param.buffer_count``), each at most ``buffer_size`` elements (a larger shard is a
ValueError at build naming the setting, as DeepSpeed asserts), so the swapped shards occupy at
most ``buffer_count x min(buffer_size, largest shard) x p`` bytes of host memory on top of the
``max_in_cpu`` resident ones. A slot is taken when a gather starts (``Stage3.start_gather``)
and given back when the all-gather finished (``finish_gather``): the shard is not modified
between steps, so nothing is written then. When every slot is taken, the oldest holder's
all-gather is waited for and its slot freed first (the same on every rank: the order of
gathers is).

After the optimizer step each swapped shard is rebuilt from the optimizer's fp32 main params
(zero-filled slot, the owned runs cast in, padding stays 0), written back and dropped: the
optimizer's own main copy is what the update changes, so the shard is written, never read,
in the step. Bytes per step with M micro-batches and the default schedule (each unit gathered
once per micro-batch, kept for its backward): read ``M x p x S``, written ``p x S``, S the
swapped elements (this rank's ZeRO-3 shard elements minus the ``max_in_cpu`` resident ones).

Memory comes from torch's host allocator on each acquire (storage resize), not from one
preallocated pinned arena: on CUDA the host-to-device copy of a swapped shard is not from
page-locked memory (cpu offload's shards are). Checkpoints never read the swap file (they
hold the optimizer's fp32 state), so runs save and resume across none, cpu and nvme.
"""

from __future__ import annotations

import os
import uuid
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from megazero.offload.swap import IoCounter, SwapFile, check_everywhere
from megazero.offload.swap_dirs import make_swap_dir, remove_swap_dir

SWAP_NAME = "params.swp"


@dataclass(frozen=True)
class ParamSwapOptions:
    """DeepSpeed's ``offload_param`` block with ``device: nvme`` (DeepSpeed's defaults).

    ``nvme_path``: directory the rank's swap directory is made in; ``buffer_count``: shards in
    host memory at once; ``buffer_size``: most elements of one swapped shard;
    ``max_in_cpu``: elements of shards that stay in host memory, never swapped.
    """

    nvme_path: str
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000


def _cleanup(file: SwapFile, directory: str) -> None:
    file.close(remove=True)
    remove_swap_dir(directory)


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class ParamSwapper:
    """One rank's parameter swap file and its slot pool (module docstring).

    Args: ``opts`` (:class:`ParamSwapOptions`), ``rank`` (global rank, names the directory).
    Raises ValueError for a count or size below 1 or a negative ``max_in_cpu``; SwapError
    naming ``--offload-nvme-path`` when the folder or file cannot be made (nothing left behind)
    or a shard cannot be written (a full disk).

    Attributes: ``swap_dir``, ``swap_path``, ``io`` (:class:`~megazero.offload.swap.IoCounter`,
    every byte moved), ``swapped`` / ``resident`` (buffers in the file / kept in memory),
    ``peak_slots`` (most shards held at once), ``largest`` (elements of the largest swapped
    shard).
    """

    def __init__(self, opts: ParamSwapOptions, rank: int):
        if min(opts.buffer_count, opts.buffer_size) < 1 or opts.max_in_cpu < 0:
            raise ValueError(
                f"offload_param buffer_count ({opts.buffer_count}) and buffer_size "
                f"({opts.buffer_size}) must be >= 1, max_in_cpu ({opts.max_in_cpu}) >= 0"
            )
        self.opts = opts
        self.run_id = uuid.uuid4().hex
        self.swap_dir = make_swap_dir(opts.nvme_path, f"megazero-{self.run_id}-rank{rank}-params")
        self.swap_path = os.path.join(self.swap_dir, SWAP_NAME)
        self.io = IoCounter()
        try:
            self.file = SwapFile(self.swap_path, 0, self.run_id, self.io, element_bytes=1)
        except BaseException:
            remove_swap_dir(self.swap_dir)
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self.file, self.swap_dir)
        self.swapped: list = []
        self.resident: list = []
        self.holders: list = []  # buffers holding a slot, oldest first
        self.resident_numel = self.peak_slots = self.largest = 0

    def add(self, buf) -> None:
        """Place ``buf``'s freshly built ``params_shard`` (host memory, whole): resident while
        the resident elements stay within ``max_in_cpu``, else written to the end of the file
        and its memory freed. Sets ``buf.swapped``. Raises ValueError naming ``buffer_size``
        when the shard is larger."""
        shard, n = buf.params_shard, buf.params_shard.numel()
        if self.resident_numel + n <= self.opts.max_in_cpu:
            self.resident_numel += n
            self.resident.append(buf)
            buf.swapped = False
            return
        if n > self.opts.buffer_size:
            raise ValueError(
                f"offload_param buffer_size {self.opts.buffer_size} is smaller than a ZeRO-3 "
                f"parameter shard ({n} elements); fix: --offload-param-buffer-size {n} or more"
            )
        buf.swap_at, buf.swapped = self.file.numel, True
        self.file.grow(self.file.numel + shard.numel() * shard.element_size())
        self.file.write(buf.swap_at, shard)
        shard.untyped_storage().resize_(0)
        self.swapped.append(buf)
        self.largest = max(self.largest, n)

    def held(self, buf) -> bool:
        return any(b is buf for b in self.holders)

    def acquire(self, buf, read: bool, evict: Callable) -> None:
        """Give swapped ``buf`` a slot: memory, read from the file (``read``) or zero-filled.
        With every slot taken, ``evict(oldest holder)`` first (it must end in :meth:`drop`)."""
        if self.held(buf):
            return
        while len(self.holders) >= self.opts.buffer_count:
            oldest = self.holders[0]
            evict(oldest)
            self.drop(oldest)  # no-op when evict dropped it
        shard = buf.params_shard
        shard.untyped_storage().resize_(shard.numel() * shard.element_size())
        if read:
            self.file.read(buf.swap_at, shard)
        else:
            shard.zero_()
        self.holders.append(buf)
        self.peak_slots = max(self.peak_slots, len(self.holders))

    def drop(self, buf) -> None:
        """Free a held shard's memory (its views stay valid); no-op when not held."""
        if self.held(buf):
            self.holders = [b for b in self.holders if b is not buf]
            buf.params_shard.untyped_storage().resize_(0)

    def write_back(self, buf) -> None:
        """Write held ``buf``'s shard to its place in the file."""
        self.file.write(buf.swap_at, buf.params_shard)

    @contextmanager
    def reading(self, buf, evict: Callable):
        """Hold ``buf``'s shard (read from the file) inside the block; a resident or already held
        shard is left as it is."""
        take = getattr(buf, "swapped", False) and not self.held(buf)
        if take:
            self.acquire(buf, read=True, evict=evict)
        try:
            yield
        finally:
            if take:
                self.drop(buf)

    def check(self, group, device) -> None:
        """The collective file check of the step (``swap.check_everywhere``)."""
        check_everywhere(self.file, group, device)

    def pool_bytes(self) -> int:
        """Bound on the host bytes of the swapped shards: ``min(buffer_count, swapped shards)
        x`` the largest swapped shard's bytes (the ``max_in_cpu`` resident ones are apart)."""
        size = max((b.params_shard.numel() * b.params_shard.element_size() for b in self.swapped), default=0)
        return min(self.opts.buffer_count, len(self.swapped)) * size

    def held_bytes(self) -> int:
        """Host bytes the swapped shards hold now."""
        return sum(_storage_bytes(b.params_shard) for b in self.swapped)

    def close(self) -> None:
        """Remove the swap directory and its file; idempotent."""
        self._finalizer()
