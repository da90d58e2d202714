"""ZeRO-Infinity's NVMe offload of the optimizer state (Rajbhandari et al., SC'21, sec. 5-6).

:class:`NvmeOffloadOptimizer` is :class:`~megazero.optim.offload.HostOffloadOptimizer` (the
Adam step on the host, same phases, same arithmetic, same checkpoint format) with the fp32
optimizer state of the owned elements in a swap file instead of host memory: main params (4
bytes), exp_avg and exp_avg_sq (8 bytes) = 12 bytes per owned element (``megazero/offload/swap.py``
for the file). As in cpu offload the host keeps its own fp32 main copy even for an fp32 model
(the device params are written from it after the update), so an fp32 model swaps the same 12
bytes per element as a bf16 one.

The step (after the stage's reductions, the overflow flag and the norm, as in the base class):

1. every rank checks its swap file (present, full size, this run's header), then one MAX
   all-reduce of a failure flag over the world: a bad file stops every rank (SwapError; the
   rank that owns the file names it in one line), none waits in a later collective;
2. the owned gradients are copied to the host fp32 gradient copy (``host_grads``, 4 bytes per
   owned element, in memory as with cpu offload), unscaled and clipped there;
3. the owned local range is cut into sub-groups of ``sub_group_size`` elements (DeepSpeed's
   ``zero_optimization.sub_group_size``); sub-group k is read into pool buffer ``k %
   buffer_count`` (``3 x sub_group_size`` fp32), updated by AdamW (one multi-tensor call per
   weight-decay value), its main params written into the model's owned runs, and written
   back. The read of k + 1 is issued before the update of k and the write of k after it, on a
   thread pool of ``aio.thread_count`` threads, so I/O overlaps the update; a buffer is
   reused only after its write finished. Sub-groups are cut only where an AdamW run (a
   parameter's owned elements of one weight decay inside one bucket) starts, so every run is
   one tensor of one multi-tensor call as in cpu offload, and the CPU kernel's vectorised body
   and scalar tail fall on the same elements: bit for bit cpu offload's values. Host memory
   for the state is the pool: ``min(buffer_count, sub-groups) x 12 x`` the longest
   sub-group's elements (DeepSpeed's default ``sub_group_size`` of 1e9 makes one sub-group
   of a small model, so one buffer as large as cpu offload's state: set it smaller);
4. the stage's parameter all-gather, as without offload.

Bytes per step (``step_io``): every owned element's 12 bytes are read once and written once,
``2 x 12 x owned`` in all (owned: this rank's local elements, shard padding included).

Checkpoints (``owned_state``, ``state_dict``): the whole state is swapped into host tensors
(``12 x owned`` bytes, held until the next step or ``refresh_model_params``; sub-group at a
time is not done yet) and served as views, so the checkpoint format is the base class's: a
run saved with nvme resumes with cpu offload or none and the other way round. Writing into
those views (a load) is followed by ``refresh_model_params``, which writes them to the file.

With ZeRO-3's parameter shards on NVMe too (``--offload-param nvme``,
``megazero/offload/param_swap.py``) the model's owned runs of a swapped shard are written
while the sub-groups are walked (``_param_runs``): the shard gets a zero-filled slot at its
first run and is written to its own swap file at its last (local order is shard order, so one
shard is held at a time), and ``_shard_filler`` gives None for it (nothing left to fill).

The swap directory ``<nvme_path>/megazero-<run id>-rank<r>`` is created fresh for each
optimizer, with its owner recorded (``megazero/offload/swap_dirs.py``), and removed with its
file by :meth:`close` (or when the optimizer is collected, or at interpreter exit); the folder
of a killed rank is swept by the launcher or the next run. A write that fails (a full disk) is
a SwapError naming ``--offload-nvme-path``.
"""

from __future__ import annotations

import os
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.sharding import ShardedBuffer
from megazero.offload.host_memory import HostArena
from megazero.offload.swap import BYTES_PER_ELEMENT, IoCounter, SwapFile, check_everywhere
from megazero.offload.swap_dirs import make_swap_dir, remove_swap_dir
from megazero.ops.adam import adam_step_lists
from megazero.optim.offload import HostOffloadOptimizer
from megazero.optim.zero import DistributedOptimizer
from megazero.process_groups import ProcessGroups

SWAP_NAME = "optimizer_state.swp"


def _cleanup(files: list, pool: ThreadPoolExecutor, directory: str) -> None:
    pool.shutdown(wait=True)
    for f in files:
        f.close(remove=True)
    remove_swap_dir(directory)


def cut_sub_groups(numel: int, starts: list[int], size: int) -> list[tuple[int, int]]:
    """Consecutive ``(start, end)`` ranges covering ``[0, numel)``, cut only at ``starts``
    (where an AdamW run begins), each the longest of at most ``size`` elements, or one run
    alone when it is longer (DeepSpeed's sub-groups are whole parameters the same way). Runs
    stay whole, so each is one tensor of one multi-tensor AdamW call, as in cpu offload: the
    CPU kernel's vectorised body and scalar tail then fall on the same elements, bit for bit."""
    cuts = [c for c in starts if 0 < c < numel] + [numel]
    out, a, i = [], 0, 0
    while a < numel:
        j = i
        while j + 1 < len(cuts) and cuts[j + 1] - a <= size:
            j += 1
        out.append((a, cuts[j]))
        a, i = cuts[j], j + 1
    return out or [(0, 0)]


class NvmeOffloadOptimizer(HostOffloadOptimizer):
    """:class:`HostOffloadOptimizer` whose fp32 main params and moments live in a swap file.

    Args: those of :class:`HostOffloadOptimizer`, plus ``nvme_path`` (directory the swap
    directory is made in; created if absent), ``buffer_count`` (host buffers in the pool,
    >= 1; DeepSpeed's ``offload_optimizer.buffer_count``), ``sub_group_size`` (elements per
    swapped sub-group, >= 1) and ``io_threads`` (threads doing the file I/O, >= 1; DeepSpeed's
    ``aio.thread_count``). Raises ValueError for a count below 1, SwapError (naming
    ``--offload-nvme-path``, the swap folder removed) when the folder cannot be made or the
    first write of the state fails (a full disk).

    Attributes: ``swap_path`` (the file), ``sub_groups`` (``(start, end)`` local ranges),
    ``io`` (an :class:`IoCounter` of every byte moved), ``step_io`` (``{"read", "written"}``
    bytes of the last step).
    """

    HOST_PARTS = ("host_params", "host_grads", "swap_buffers", "resident_state")

    def __init__(
        self,
        ddp: DataParallel,
        groups: ProcessGroups,
        *,
        nvme_path: str,
        buffer_count: int = 4,
        sub_group_size: int = 1_000_000_000,
        io_threads: int = 1,
        **kwargs,
    ):
        if min(buffer_count, sub_group_size, io_threads) < 1:
            raise ValueError(
                f"buffer_count ({buffer_count}), sub_group_size ({sub_group_size}) and "
                f"io_threads ({io_threads}) must be >= 1"
            )
        self.buffer_count, self.sub_group_size = buffer_count, sub_group_size
        self.run_id = uuid.uuid4().hex
        self.swap_dir = make_swap_dir(nvme_path, f"megazero-{self.run_id}-rank{groups.rank}")
        self.io, self.step_io, self._resident = IoCounter(), {"read": 0, "written": 0}, None
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="megazero-swap")
        self._files: list[SwapFile] = []
        self._finalizer = weakref.finalize(self, _cleanup, self._files, self._pool, self.swap_dir)
        try:
            super().__init__(ddp, groups, **kwargs)
            self._plan_sub_groups()
            self._init_main_params()
        except BaseException:  # e.g. a full disk (SwapError): the folder goes now, not at exit
            self._finalizer()
            raise

    # -- hooks of the base classes -------------------------------------------------------
    def _allocate_state(self, main_numel: int, numel: int) -> tuple[torch.Tensor, ...]:
        """The host gradient copy in an arena (pinned when asked; the buffer pool gets its own
        once the sub-groups are known, ``_plan_sub_groups``); the state itself is in the swap file, so ``(main,
        exp_avg, exp_avg_sq)`` are meta tensors:
        they only carry the local coordinates the base class slices views of."""
        self.numel = numel
        self.arena = HostArena([numel], torch.float32, pin=self.pin_memory, registrar=self.registrar)
        (self.host_grads,) = self.arena.parts
        self.swap_path = os.path.join(self.swap_dir, SWAP_NAME)
        self.file = SwapFile(self.swap_path, numel, self.run_id, self.io)
        self._files.append(self.file)
        return tuple(torch.empty(n, dtype=torch.float32, device="meta") for n in (main_numel, numel, numel))

    def _init_main_params(self) -> None:
        if not hasattr(self, "sub_groups"):
            return  # called by the base constructor before the plan exists; done at its end

        def first(k, main, m, v):
            m.zero_()
            v.zero_()
            self._param_runs(k, lambda view, lo, hi: main[lo:hi].copy_(view), write=False)

        self._walk(first, read=False)

    def _plan_sub_groups(self) -> None:
        """Sub-group ranges and, per sub-group, its AdamW runs ``(start, end, decays)`` and the
        model's owned parameter runs ``(view, lo, hi)`` (``lo, hi`` relative to the sub-group)."""
        runs = [(pc.offset + r.start, pc.offset + r.end, d) for pc in self.pieces for r, d in pc.adam]
        self.sub_groups = cut_sub_groups(self.numel, sorted({s for s, _, _ in runs}), self.sub_group_size)
        longest = max(b - a for a, b in self.sub_groups)
        # a buffer past the number of sub-groups would never be used: at most one per sub-group
        self.buffer_count = min(self.buffer_count, len(self.sub_groups))
        self.pool_arena = HostArena(
            [3 * longest] * self.buffer_count, torch.float32, pin=self.pin_memory, registrar=self.registrar
        )
        self.buffers = self.pool_arena.parts
        owned = []
        for i, buf in enumerate(self.ddp.buffers):
            with buf.strategy.shard_on_host(buf):  # views of a swapped shard are taken while it is held
                owned += [
                    (
                        self.offsets[i] + own.local.start,
                        buf.owned_param_values(own),
                        buf,
                        self.offsets[i] + buf.owned_numel(),
                    )
                    for own in buf.owned()
                ]
        self._sg_adam, self._sg_params = [], []
        for a, b in self.sub_groups:
            self._sg_adam.append([(max(s, a), min(e, b), d) for s, e, d in runs if s < b and e > a])
            # (view, lo, hi, swapped buffer or None, whether the run ends that buffer's shard)
            pieces = []
            for s, view, buf, end in owned:
                if s < b and s + view.numel() > a:
                    with buf.strategy.shard_on_host(buf):
                        pieces.append(
                            (
                                view[max(s, a) - s : min(s + view.numel(), b) - s],
                                max(s, a) - a,
                                min(s + view.numel(), b) - a,
                                buf if getattr(buf, "swapped", False) else None,
                                min(s + view.numel(), b) == end,
                            )
                        )
            self._sg_params.append(pieces)

    def _param_runs(self, k: int, fn: Callable, write: bool) -> None:
        """``fn(view, lo, hi)`` on each model-parameter run of sub-group ``k`` in local order. A
        ZeRO-3 shard on NVMe (``--offload-param nvme``) is given a slot at its first run (read
        from its swap file when not ``write``, zero-filled when ``write``: its runs cover it
        whole, padding included) and, at its last, written back (``write``) and dropped; runs
        are in local order, so one shard is held at a time."""
        swap = self.ddp.param_swap
        for view, lo, hi, buf, last in self._sg_params[k]:
            if buf is not None:
                swap.acquire(buf, read=not write, evict=self.ddp.strategy.finish_gather)
            fn(view, lo, hi)
            if buf is not None and last:
                if write:
                    swap.write_back(buf)
                swap.drop(buf)

    def _walk(self, fn: Callable, read: bool = True, write: bool = True) -> None:
        """``fn(k, main, exp_avg, exp_avg_sq)`` on each sub-group's state in a pool buffer, in
        order: read of k + 1 in flight during ``fn`` of k, write of k behind it; a buffer is
        refilled only after its last write finished. Raises the first I/O error (SwapError)."""
        n, nb, reads, writes = len(self.sub_groups), self.buffer_count, {}, {}

        def slot(j):
            a, b = self.sub_groups[j]
            return self.buffers[j % nb][: 3 * (b - a)]

        def fetch(j):
            if j >= n or j in reads:
                return
            if j - nb in writes:
                writes.pop(j - nb).result()
            reads[j] = self._pool.submit(self.file.read, self.sub_groups[j][0], slot(j)) if read else None

        try:
            fetch(0)
            for k in range(n):
                if reads[k] is not None:
                    reads[k].result()
                if nb > 1:
                    fetch(k + 1)
                a, b = self.sub_groups[k]
                buf, size = slot(k), b - a
                fn(k, buf[:size], buf[size : 2 * size], buf[2 * size :])
                if write:
                    writes[k] = self._pool.submit(self.file.write, a, buf)
                fetch(k + 1)
        finally:
            for f in [f for f in reads.values() if f is not None] + list(writes.values()):
                f.result()

    def _check_files(self) -> None:
        """Every rank checks its file, then one MAX all-reduce of the failure: all ranks stop."""
        check_everywhere(self.file, self.groups.world, self.device)

    def _update(self, scale: float, coef: float, lr: float) -> None:
        """Check the files; gradients to the host, unscale, clip; then AdamW sub-group by
        sub-group through the buffer pool, writing each updated main into the model."""
        self._resident = None  # a checkpoint's swapped-in copy (read only unless refreshed)
        self._check_files()
        for win in self.windows:
            torch._foreach_copy_(win.work, win.sources, non_blocking=self.pin_memory)
        if self.pin_memory and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for win in self.windows:
            if scale != 1.0:
                torch._foreach_mul_(win.work, 1.0 / scale)
            if coef < 1.0:
                torch._foreach_mul_(win.work, coef)
        read0, written0 = self.io.read, self.io.written
        # the updated runs go to a CUDA model from the pinned pool buffer without blocking each
        async_h2d = self.pin_memory and self.device.type == "cuda"

        def adam(k, main, m, v):
            a = self.sub_groups[k][0]
            for decays in (True, False):
                runs = [(s - a, e - a, s, e) for s, e, d in self._sg_adam[k] if d == decays]
                if runs:
                    adam_step_lists(
                        [main[x:y] for x, y, _, _ in runs],
                        [self.host_grads[s:e] for _, _, s, e in runs],
                        [m[x:y] for x, y, _, _ in runs],
                        [v[x:y] for x, y, _, _ in runs],
                        step=self.step_count,
                        lr=lr,
                        beta1=self.beta1,
                        beta2=self.beta2,
                        eps=self.eps,
                        weight_decay=self.weight_decay if decays else 0.0,
                        backend=self.adam_backend,
                    )
            self._param_runs(k, lambda view, lo, hi: view.copy_(main[lo:hi], non_blocking=async_h2d), write=True)
            if async_h2d:  # one wait per sub-group, not one blocking copy per run: the pool buffer is refilled next
                torch.cuda.current_stream(self.device).synchronize()

        self._walk(adam)
        self.step_io = {"read": self.io.read - read0, "written": self.io.written - written0}

    @torch.no_grad()
    def _update_model_params(self) -> None:
        """The model's owned runs already hold the update (written in ``_update``, or by
        ``refresh_model_params``): only the stage's gather."""
        DistributedOptimizer._update_model_params(self)

    def _shard_filler(self, buf: ShardedBuffer, mbase):
        if buf.strategy.shards_params:
            return None  # ZeRO-3: the owned runs are the shard, written in _update (_param_runs)
        return DistributedOptimizer._shard_filler(self, buf, None)  # from the model's owned runs

    # -- checkpoint state ----------------------------------------------------------------
    def _swap_in(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole owned state as host tensors (read from the file once, then kept)."""
        if self._resident is None:
            whole = [torch.empty(self.numel, dtype=torch.float32, device="cpu") for _ in range(3)]

            def take(k, *parts):
                a, b = self.sub_groups[k]
                for dst, src in zip(whole, parts):
                    dst[a:b].copy_(src)

            self._walk(take, write=False)
            self._resident = tuple(whole)
        return self._resident

    def owned_state(self):
        """As the base class, views of the swapped-in state (:meth:`_swap_in`); after writing
        them call ``refresh_model_params``, which writes them to the swap file."""
        main, exp_avg, exp_avg_sq = self._swap_in()
        names = {id(p): n for chunk in self.ddp.chunks for n, p in chunk.named_parameters()}
        for pc in self.pieces:
            for p, pr, wr in pc.buffer.layout.param_pieces(pc.world):
                s = pc.offset + wr.start - pc.world.start
                e = s + pr.size
                yield names[id(p)], p, pr, main[s:e], exp_avg[s:e], exp_avg_sq[s:e]

    @property
    def main_param(self) -> torch.Tensor:
        return self._swap_in()[0].clone()

    @torch.no_grad()
    def refresh_model_params(self) -> None:
        """Write a swapped-in state (a load) back to the file, the main params into the model's
        owned runs, then the stage's gather (collective at stages 1/2)."""
        self.wait_param_gather()
        if self._resident is not None:
            whole, self._resident = self._resident, None

            def put(k, *parts):
                a, b = self.sub_groups[k]
                for dst, src in zip(parts, whole):
                    dst.copy_(src[a:b])
                self._param_runs(k, lambda view, lo, hi: view.copy_(parts[0][lo:hi]), write=True)

            self._walk(put, read=False)
        else:

            def params(k, main, *_):
                self._param_runs(k, lambda view, lo, hi: view.copy_(main[lo:hi]), write=True)

            self._walk(params, write=False)
        self._update_model_params()
        self.wait_param_gather()

    def pinned_bytes(self) -> int:
        """The gradient copy's and the buffer pool's arenas (when pinned) plus ZeRO-3's
        ``offload_param`` shards."""
        return super().pinned_bytes() + self.pool_arena.pinned_bytes

    def close(self) -> None:
        """Remove the swap directory and its file (the state in it is gone); idempotent."""
        self._finalizer()

    # -- accounting ----------------------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """The stage's device parts, ``host_grads`` and the buffer pool (``swap_buffers``); the
        fp32 state is in the file (``main_params``/``exp_avg``/``exp_avg_sq`` 0 bytes here),
        ``resident_state`` the whole state while swapped in for a checkpoint."""
        out = DistributedOptimizer.model_state_bytes(self)
        del out["total"]
        out.update(
            main_params=0,
            exp_avg=0,
            exp_avg_sq=0,
            host_grads=4 * self.numel,
            swap_buffers=4 * sum(b.numel() for b in self.buffers),
            resident_state=0 if self._resident is None else 12 * self.numel,
        )
        out["total"] = sum(out.values())
        return out

    def formula(self) -> dict:
        """Cpu offload's formula with the 12 bytes per owned element of state replaced by the
        buffer pool (``buffer_count x 12 x min(sub_group_size, owned)`` bytes)."""
        got = super().formula()
        pool = 4 * sum(b.numel() for b in self.buffers)
        total = got["total"] - BYTES_PER_ELEMENT * self.numel + pool
        return dict(
            total=total,
            main_bytes=0,
            note=got["note"]
            + (f"; state in NVMe swap files ({BYTES_PER_ELEMENT * self.numel} bytes), host buffer pool {pool} bytes"),
        )
