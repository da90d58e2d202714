"""Layout-independent sharded checkpoints: owned pieces of full tensors by name, written atomically.

Format of ``<save>/iter_0000100/`` (docs/design.md, contract 4):

- a ``torch.distributed.checkpoint`` (DCP) directory (``.metadata`` plus ``__<rank>_0.distcp``
  files) holding, for every parameter of the model, its fp32 main parameter and Adam moments
  under the keys ``"<name>/main_param"``, ``"<name>/exp_avg"``, ``"<name>/exp_avg_sq"``, each
  with the FULL (unpartitioned) shape. Each rank writes only the runs its optimizer owns (its
  ZeRO shard of its tensor-parallel partition) as chunks with their offsets in the full
  tensor (``checkpoint_shards``); replicated copies (TP-replicated parameters, every DP rank
  at ZeRO-0, the second copy of a weight tied across stages) are written once. The older
  format (one full-tensor chunk per key) reads through the same path.
- ``meta.pt`` (rank 0): iteration, consumed samples, optimizer counters and loss-scaler
  state, the layout it was saved under, and caller extras (e.g. the data position).
- ``rng_<rank>.pt``: each rank's dropout RNG state (restored only under the same layout;
  under another layout every rank re-seeds by ``random.resume_seed``).

Every file of the directory (the tensor files, ``.metadata`` and every ``rng_<rank>.pt``) is
listed in ``meta.pt`` with its size and CRC-32: ``peek`` checks that each exists with its
size, ``peek(verify=True)`` (the launcher's preflight) also its CRC-32, so a missing,
truncated or foreign (another run's) file is a CheckpointError naming it before any rank
starts.

Nothing is gathered: saving hands DCP views of the optimizer's own state; loading under any
other (tp, pp, dp, ZeRO stage 0-3, offload, bucket size) reads, through DCP's resharding,
only the saved pieces that overlap this rank's owned runs, straight into its main params and
moments, then refreshes the model parameters. Memory: a rank holds its own shards plus at
most one bucket (one saved chunk while reading) and DCP's plans; ``--async-save`` adds one
staged host copy of the own shards, one buffer (``stage_chunks``), page-locked on CUDA and
reused by the next save (``CheckpointManager``).

Atomicity: every file is written under ``iter_X.tmp`` (fsynced: DCP's ``sync_files``, and
``_atomic_save`` for the small files) and the directory is renamed to ``iter_X`` only after
all ranks finished; then ``latest`` (the iteration number) is replaced atomically, with the
directories fsynced in between so the order survives a power loss. A crash mid-save leaves
the previous checkpoint and ``latest`` intact; an iteration saved twice keeps its old copy
(``iter_X.old``) until the new one is in.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
import zlib
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from megazero import tags
from megazero.process_groups import ProcessGroups

if TYPE_CHECKING:
    from megazero.offload.host_memory import HostArena

# torch.distributed.checkpoint (and checkpoint_shards, whose planners subclass DCP's) is
# imported where a checkpoint is read or written, not with this module: importing it pulls
# in torch.distributed.tensor, about 1 s of CPU in every process that imports train.


def _dcp():
    """``torch.distributed.checkpoint``, imported on first use."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _shards():
    """``megazero.checkpoint.shards``, imported on first use (it imports DCP)."""
    from megazero.checkpoint import shards as checkpoint_shards

    return checkpoint_shards


def _checkpoint_exception() -> type:
    """DCP's CheckpointException: a BaseException, not an Exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit this model."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    """The iteration in ``<root>/latest``, or None when there is no checkpoint yet.

    Raises CheckpointError when ``latest`` is unreadable or names a missing directory.
    """
    path = os.path.join(root, "latest")
    if not os.path.exists(path):
        name, parent = os.path.basename(os.path.normpath(root)), os.path.dirname(os.path.normpath(root))
        if name.startswith("iter_") and os.path.exists(os.path.join(root, "meta.pt")):
            raise CheckpointError(
                f"{root} is one iteration inside a checkpoint directory; fix: --load "
                f"{parent or '.'} (its 'latest' file names the iteration to resume)"
            )
        found = saved_iterations(root)
        if found:
            raise CheckpointError(
                f"{root} holds checkpoints {found} but no 'latest' file; fix: write the "
                f"iteration to resume (e.g. {found[-1]}) into {path}"
            )
        return None
    try:
        with open(path) as f:
            it = int(f.read().strip())
        if it < 0:
            raise ValueError(it)
    except (ValueError, UnicodeDecodeError, OSError):  # also a directory named 'latest'
        raise CheckpointError(
            f"{path} does not hold an iteration number; fix: delete it or "
            f"write the iteration of a complete iter_* directory"
        ) from None
    if not os.path.isdir(iteration_dir(root, it)):
        raise CheckpointError(f"{path} names iteration {it} but {iteration_dir(root, it)} is missing")
    return it


def _load_file(path: str, weights_only: bool):
    """torch.load with a CheckpointError naming the file when it is missing or unreadable."""
    if not os.path.exists(path):
        raise CheckpointError(
            f"{path} is missing: the checkpoint is incomplete; fix: load an earlier "
            f"iter_* directory (write its number into 'latest')"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # torch raises RuntimeError, EOFError, pickle errors ... for a bad file
        raise CheckpointError(
            f"{path} is unreadable ({type(e).__name__}: {str(e)[:120]}); fix: load an "
            f"earlier iter_* directory (write its number into 'latest')"
        ) from None


def _read_metadata(d: str):
    """DCP metadata of checkpoint directory ``d``; CheckpointError naming the file if unreadable."""
    path = os.path.join(d, ".metadata")
    if not os.path.exists(path):
        raise CheckpointError(
            f"{path} is missing: the checkpoint {d} is incomplete or from an older "
            f"format; fix: load an earlier iter_* directory (write its number into 'latest')"
        )
    try:
        return _dcp().FileSystemReader(d).read_metadata()
    except Exception as e:  # pickle, EOF, ... on a damaged file
        raise CheckpointError(
            f"{path} is unreadable ({type(e).__name__}: {str(e)[:120]}); fix: load an "
            f"earlier iter_* directory (write its number into 'latest')"
        ) from None


def file_checksum(path: str) -> list:
    """``[size in bytes, CRC-32]`` of the file at ``path`` (read in 16 MiB blocks)."""
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            crc = zlib.crc32(block, crc)
    return [os.path.getsize(path), crc]


def peek(root: str, verify: bool = False) -> Optional[dict]:
    """The ``meta.pt`` of the latest checkpoint under ``root`` (None when there is none yet).

    Reads only small files and checks that every tensor file the DCP metadata names is there
    and long enough, that every file listed in ``meta.pt`` (tensor files, ``.metadata``, each
    ``rng_<rank>.pt``) has its saved size, and reads every ``rng_<rank>.pt`` of the saved
    layout, so a broken checkpoint is reported before any process group exists. ``verify``
    also reads every listed file and compares its CRC-32 with the one recorded at save time
    (the launcher's preflight does this once, before any rank starts).
    Raises CheckpointError naming the file.
    """
    it = latest_iteration(root)
    if it is None:
        return None
    d = iteration_dir(root, it)
    meta = _load_file(os.path.join(d, "meta.pt"), weights_only=False)
    needed: dict = {}  # file -> bytes the metadata says it holds
    for info in _read_metadata(d).storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        path = os.path.join(d, rel)
        have = os.path.getsize(path) if os.path.exists(path) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"has {have} bytes, the metadata needs {size}"
            raise CheckpointError(
                f"{path} {what}: the checkpoint {d} is incomplete; fix: load an "
                f"earlier iter_* directory (write its number into 'latest')"
            )
    _check_listed_files(d, meta, verify)
    return meta


def rng_files(layout: dict) -> list[str]:
    """Names of the per-rank dropout RNG files of a checkpoint saved under ``layout``."""
    return [f"rng_{r}.pt" for r in range(layout["tp"] * layout["pp"] * layout["dp"])]


def _check_listed_files(d: str, meta: dict, verify: bool) -> None:
    """Every ``rng_<rank>.pt`` of the saved layout is there and readable; every file listed in
    ``meta["files"]`` has its saved size (and, with ``verify``, its CRC-32).
    Raises CheckpointError naming the first bad file."""
    fix = "fix: load an earlier iter_* directory (write its number into 'latest')"
    for name, (size, crc) in sorted(meta.get("files", {}).items()):
        path = os.path.join(d, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing: the checkpoint {d} is incomplete; {fix}")
        got = file_checksum(path) if verify else [os.path.getsize(path), crc]
        if got != [size, crc]:
            now, was = (
                (f"size {got[0]} and CRC-32 {got[1]:08x}", f"size {size} and CRC-32 {crc:08x}")
                if verify
                else (f"size {got[0]}", f"size {size}")
            )
            raise CheckpointError(
                f"{path} has {now}, saved as {was}: the file was damaged or replaced after "
                f"saving (truncated, or from another run); {fix}"
            )
    for name in rng_files(meta["layout"]):  # small: read them all (older checkpoints list none)
        _load_file(os.path.join(d, name), weights_only=False)


def _barrier(groups: ProcessGroups) -> None:
    if groups.world is not None:
        dist.barrier(group=groups.world)


def _fsync_dir(path: str) -> None:
    """Make renames and new entries in directory ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_save(obj, path: str) -> None:
    """``torch.save`` to a temporary name, fsync its bytes, then rename onto ``path``.

    After a crash (or power loss) ``path`` is either absent or complete, never truncated.
    """
    with open(path + ".tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _chunks_to_write(optimizer, groups: ProcessGroups) -> tuple[dict, dict]:
    """(``{key: [Chunk]}``, ``{key: full shape}``): the owned runs this rank writes (replicated
    copies once, ``checkpoint_shards.writes_here``: an expert-parallel parameter once per ep
    rank, by its first expert-data-parallel replica; under hybrid sharding by the first replica
    of the shards, ``groups.zero_replica_rank == 0``, which is also the expert state's replica
    rank ``edp_rank // (S / EP)``), views of the optimizer's state. The chunks are boxes of the
    full tensors whatever S, so a checkpoint loads at any other S and EP."""
    shards = _shards()
    sharded = optimizer.ddp.strategy.shards_optimizer
    mine, params = shards.owned_chunks(
        optimizer,
        groups,
        select=lambda p: (
            groups.zero_replica_rank == 0
            and shards.writes_here(
                p, groups.tp_rank, groups.edp_rank if tags.is_expert_parallel(p) else groups.dp_rank, sharded
            )
        ),
    )
    return mine, {f"{name}/{k}": shape for name, (_, shape) in params.items() for k in shards.STATE_KEYS}


def saved_iterations(root: str) -> list[int]:
    """Iterations of the complete ``iter_*`` directories under ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(
        int(n[5:])
        for n in os.listdir(root)
        if n.startswith("iter_") and n[5:].isdigit() and os.path.isdir(os.path.join(root, n))
    )


def prune(root: str, keep: int, current: int) -> list[int]:
    """Delete all but the ``keep`` newest checkpoints up to ``current`` (0 = keep all).

    Checkpoints after ``current`` are never touched, nor is ``current`` itself. Returns the
    iterations deleted. Call only after ``latest`` points at ``current``.
    """
    if keep <= 0:
        return []
    older = [it for it in saved_iterations(root) if it < current]
    doomed = older[: max(len(older) - (keep - 1), 0)]
    for it in doomed:
        shutil.rmtree(iteration_dir(root, it))
    return doomed


class PendingSave:
    """A checkpoint whose tensor files DCP's ``async_save`` is still writing in the background.

    ``wait()`` (collective: every rank calls it, in the same order as its other collectives)
    waits for this rank's files, then finishes the checkpoint as ``save`` does (checksums,
    ``meta.pt``, rename, ``latest``), so ``latest`` moves only once every rank's part is on
    disk; a crash before that leaves the previous ``latest``. Returns the final directory and
    sets ``waited_s`` (seconds the caller was blocked in ``wait``).
    """

    def __init__(self, future, finish: Callable[[], str]):
        self._future, self._finish, self.waited_s = future, finish, 0.0

    def wait(self) -> str:
        import time

        t0 = time.perf_counter()
        self._future.result()  # this rank's files are written and fsynced (sync_files)
        final = self._finish()  # collective: every rank's files are in before the rename
        self.waited_s = time.perf_counter() - t0
        return final


_writer_with_hook: Optional[type] = None


def _writer_with_hook_class() -> type:
    """DCP's file writer that calls ``after_write()`` once this rank's tensor files are written
    (the class is made on first use: its base class is DCP's)."""
    global _writer_with_hook
    if _writer_with_hook is None:

        class _WriterWithHook(_dcp().FileSystemWriter):
            def __init__(self, path: str, after_write: Callable[[], None], **kwargs):
                super().__init__(path, **kwargs)
                self._after_write = after_write

            def write_data(self, plan, planner):
                done = super().write_data(plan, planner)
                done.wait()
                self._after_write()
                return done

        _writer_with_hook = _WriterWithHook
    return _writer_with_hook


def stage_chunks(mine: dict, staging: Callable[[int, torch.device], "HostArena"]) -> dict:
    """Host copies of every chunk of ``mine`` (``{key: [Chunk]}``) in ONE staging buffer.

    ``staging(numel, device)`` gives a :class:`~megazero.offload.host_memory.HostArena`
    of ``numel`` fp32 elements (the sum over the chunks; ``device`` is where the chunks
    live); each chunk becomes a view of it. From a GPU into a pinned arena the copies are
    asynchronous, followed by one wait on the stream, instead of one blocking device-to-host
    copy per chunk. Returns the same structure with the staged views.
    """
    flat = [c for cs in mine.values() for c in cs]
    if not flat:
        return mine
    device = flat[0].tensor.device
    arena = staging(sum(c.tensor.numel() for c in flat), device)
    non_blocking, pos, out = arena.pinned_bytes > 0, 0, {}
    for key, cs in mine.items():
        out[key] = []
        for c in cs:
            n = c.tensor.numel()
            dst = arena.flat[pos : pos + n].view(c.tensor.shape)
            dst.copy_(c.tensor.detach(), non_blocking=non_blocking)
            out[key].append(dataclasses.replace(c, tensor=dst))
            pos += n
    if non_blocking and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # DCP's writer thread reads them next
    return out


def host_staging(numel: int, device: torch.device) -> "HostArena":
    """A fresh, unpinned staging arena (``save`` without a manager's reusable one)."""
    from megazero.offload.host_memory import HostArena

    return HostArena([numel], torch.float32, pin=False)


def save(
    root: str,
    iteration: int,
    optimizer,
    chunks,
    groups: ProcessGroups,
    *,
    rng_states: Optional[dict] = None,
    extra: Optional[dict] = None,
    keep: int = 0,
    async_group=None,
    after_write: Optional[Callable[[], None]] = None,
    staging: Optional[Callable[[int, torch.device], "HostArena"]] = None,
):
    """Write the checkpoint of ``iteration`` under ``root`` (collective: every rank calls it).

    Returns the final directory. ``extra`` (picklable) goes into ``meta.pt``. With ``keep``
    > 0, older checkpoints beyond the ``keep`` newest are deleted once ``latest`` names
    this one (``prune``). With ``async_group`` (a gloo group of every rank that nothing else
    uses, or the string ``"local"`` for a single process) the gathered full tensors are handed
    to DCP's ``async_save`` and a ``PendingSave`` is returned at once; call its ``wait()``
    before the next save and at the end; the copy is staged in one host buffer from
    ``staging`` (:func:`stage_chunks`; default a fresh unpinned one per save). ``after_write``
    (tests: a fault injected mid-save) runs
    where the tensor files of this rank have just been written, before DCP's metadata and
    ``_finish_save`` (in the background with ``async_group``).
    """
    dcp, shards = _dcp(), _shards()
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    if groups.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(groups)
    mine, sizes = _chunks_to_write(optimizer, groups)
    if async_group is not None:  # training goes on: DCP writes a staged copy of this rank's shards
        mine = stage_chunks(mine, staging or host_staging)
    planner = shards.SavePlanner(mine, sizes)
    meta = None
    if groups.rank == 0:  # the counters of this iteration, before training moves them on
        meta = dict(
            iteration=iteration,
            layout=dict(tp=groups.tp_size, pp=groups.pp_size, dp=groups.dp_size),
            optimizer=optimizer.counters(),
            extra=extra or {},
        )
    writer = (
        dcp.FileSystemWriter(tmp, sync_files=True)
        if after_write is None
        else _writer_with_hook_class()(tmp, after_write, sync_files=True)
    )

    def finish() -> str:
        return _finish_save(root, iteration, tmp, final, groups, rng_states, meta, keep)

    if async_group is None:
        dcp.save({}, storage_writer=writer, planner=planner, process_group=groups.world, no_dist=groups.world is None)
        return finish()
    local = async_group == "local"
    future = dcp.async_save(
        {}, storage_writer=writer, planner=planner, process_group=None if local else async_group, no_dist=local
    )
    return PendingSave(future, finish)


def _finish_save(
    root: str,
    iteration: int,
    tmp: str,
    final: str,
    groups: ProcessGroups,
    rng_states: Optional[dict],
    meta: Optional[dict],
    keep: int,
) -> str:
    """Checksums, rng and meta files, then rename and ``latest`` (collective; after the tensors)."""
    # Each rank checksums the tensor file it wrote (DCP names it after the global rank);
    # rank 0 records them all in meta.pt, so damage after saving is found before a resume.
    mine, rng = f"__{groups.rank}_0.distcp", f"rng_{groups.rank}.pt"
    _atomic_save(rng_states or {}, os.path.join(tmp, rng))
    sums = {mine: file_checksum(os.path.join(tmp, mine))} if os.path.exists(os.path.join(tmp, mine)) else {}
    sums[rng] = file_checksum(os.path.join(tmp, rng))
    if groups.world is not None:
        gathered = [None] * groups.world_size
        dist.all_gather_object(gathered, sums, group=groups.world)
        sums = {k: v for part in gathered for k, v in part.items()}
    if groups.rank == 0:
        meta = dict(meta, files=dict(sums, **{".metadata": file_checksum(os.path.join(tmp, ".metadata"))}))
        _atomic_save(meta, os.path.join(tmp, "meta.pt"))
    _barrier(groups)
    if groups.rank == 0:
        publish(root, iteration, tmp)
        prune(root, keep, iteration)
    _barrier(groups)
    return final


def publish(root: str, iteration: int, tmp: str) -> str:
    """Rename the complete directory ``tmp`` to ``iter_<iteration>`` under ``root`` and point
    ``latest`` at it, fsyncing in between (one process); returns the final directory. An
    existing ``iter_<iteration>`` is kept as ``.old`` until the new one is in."""
    final = iteration_dir(root, iteration)
    _fsync_dir(tmp)  # every file's entry is on disk before the directory gets its name
    old = final + ".old"
    if os.path.exists(final):  # the same iteration saved again: keep the old copy until replaced
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)  # the new iter_* name is on disk before 'latest' points at it
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load(
    root: str,
    optimizer,
    chunks,
    groups: ProcessGroups,
    *,
    real_rows: Optional[Callable[[str], Optional[int]]] = None,
    weights_only: bool = False,
    fresh: tuple = (),
) -> dict:
    """Load the latest checkpoint under ``root`` into ``optimizer`` (and so the model).

    Every rank reads, through DCP, only the saved pieces that overlap its own owned runs
    (``checkpoint_shards``), straight into the optimizer's fp32 main params and moments, then
    the model params are refreshed (``refresh_model_params``); parameter all-gathers still in
    flight from the last step are waited for first. ``chunks`` (the model chunks)
    is kept for the callers; the optimizer knows its parameters. ``real_rows(name)`` (None:
    all) is the number of leading rows (dim 0) of a parameter that hold data, e.g. the
    vocabulary size of a padded vocabulary tensor: those rows are read, the rows after them
    zeroed, so a checkpoint saved with another vocabulary padding loads. Returns ``meta``
    plus ``rng_state`` (this rank's saved RNG, or None when the layout differs).
    ``weights_only`` (``--finetune``) reads the main parameters alone: the moments, the
    optimizer's counters and the RNG state stay as they are (``rng_state`` None). ``fresh``:
    with ``weights_only``, parameter names the checkpoint may lack, which then keep their
    initial values (a reward model's value head, started from a language model's checkpoint).
    Raises CheckpointError when there is no complete checkpoint, a tensor is missing or has
    another shape, a tensor file fails to read, or (same layout) this rank's
    ``rng_<rank>.pt`` is missing or unreadable. Collective (DCP's planning, the all-gather).
    """
    it = latest_iteration(root)
    if it is None:
        raise CheckpointError(f"no checkpoint under {root} (no 'latest' file)")
    d = iteration_dir(root, it)
    meta = _load_file(os.path.join(d, "meta.pt"), weights_only=False)
    saved = _read_metadata(d).state_dict_metadata
    dcp, shards, CheckpointException = _dcp(), _shards(), _checkpoint_exception()
    mine, params = shards.owned_chunks(optimizer, groups)
    keys = shards.STATE_KEYS[:1] if weights_only else shards.STATE_KEYS
    absent = {n for n in fresh if weights_only and f"{n}/{keys[0]}" not in saved}
    mine = {k: v for k, v in mine.items() if k.rsplit("/", 1)[-1] in keys and k.rsplit("/", 1)[0] not in absent}
    for name, (_, shape) in params.items():
        if name in absent:
            continue
        rows = None if real_rows is None else real_rows(name)
        for k in keys:
            key = f"{name}/{k}"
            _check_fits(d, saved, key, name, shape, rows)
            if rows is not None:
                mine[key] = _clip_rows(mine.get(key, []), rows)
    # DCP writes into the optimizer's state, which is the model's own flat buffer where the
    # main params are the params (fp32): the overlapped all-gathers of the last step must
    # land first, or one finishing later overwrites loaded values (a CI flake showed it)
    optimizer.wait_param_gather()
    try:
        dcp.load(
            {},
            storage_reader=dcp.FileSystemReader(d),
            planner=shards.LoadPlanner(mine),
            process_group=groups.world,
            no_dist=groups.world is None,
        )
    except (Exception, CheckpointException) as e:  # a damaged .distcp file (DCP gathers every rank's failure)
        raise _read_error(d, e) from None
    if not weights_only:
        optimizer.load_counters(meta["optimizer"])
    optimizer.refresh_model_params()
    same_layout = meta["layout"] == dict(tp=groups.tp_size, pp=groups.pp_size, dp=groups.dp_size)
    rng_path = os.path.join(d, f"rng_{groups.rank}.pt")
    meta["rng_state"] = _load_file(rng_path, weights_only=False) if same_layout and not weights_only else None
    meta["same_layout"] = same_layout
    meta["directory"] = d
    return meta


def _check_fits(d: str, saved: dict, key: str, name: str, shape: tuple, rows: Optional[int]) -> None:
    """CheckpointError unless ``saved`` (DCP metadata of ``d``) holds ``key`` with the full
    shape ``shape``, or, for a vocabulary tensor (``rows``: its real rows), another padding
    of at least ``rows`` rows."""
    if key not in saved:
        raise CheckpointError(
            f"{d} has no state for parameter {name!r}: it was saved from "
            f"another model; fix: load a checkpoint of this model"
        )
    have = tuple(saved[key].size)
    fits = have == shape or (rows is not None and have[1:] == shape[1:] and min(have[0], shape[0]) >= rows)
    if not fits:
        raise CheckpointError(f"{name}: the checkpoint holds {have}, the model has {shape}; fix: same model sizes")


def _read_error(d: str, e: BaseException) -> CheckpointError:
    """The CheckpointError for a failed DCP read of ``d`` (a damaged .distcp file): the first
    rank's own exception when DCP gathered every rank's failure."""
    if isinstance(e, _checkpoint_exception()) and e.failures:
        _, (e, _) = min(e.failures.items(), key=lambda kv: kv[0])
    first_line = (str(e).strip().splitlines() or [""])[0][:160]
    return CheckpointError(
        f"{d}: reading the tensors failed ({type(e).__name__}: {first_line}); "
        f"fix: load an earlier iter_* directory (write its number into 'latest')"
    )


def _clip_rows(chunks: list, rows: int) -> list:
    """``chunks`` cut to rows ``< rows`` of dim 0; the rows at or after ``rows`` are zeroed now
    (they are not read)."""
    shards, out = _shards(), []
    with torch.no_grad():
        for c in chunks:
            keep = max(0, min(c.sizes[0], rows - c.offsets[0]))
            c.tensor.narrow(0, keep, c.sizes[0] - keep).zero_()
            if keep:
                out.append(shards.Chunk(c.offsets, (keep,) + tuple(c.sizes[1:]), c.tensor.narrow(0, 0, keep)))
    return out


def read_full_weights(root: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, canonical name -> full fp32 main parameter) of the latest checkpoint under
    ``root``, read in one process without any process group (offline conversion; it holds
    every full tensor, so a tensor-parallel rank reads ``read_partitions`` instead).

    Raises CheckpointError when there is no checkpoint or a file is unreadable.
    """
    meta, _, full = read_full_tensors(root, "/main_param")
    return meta, {k[: -len("/main_param")]: t for k, t in full.items()}


def read_partitions(
    root: str,
    params: dict[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
    real_rows: Optional[Callable[[str], Optional[int]]] = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, name -> this tensor-parallel rank's partition of the fp32 main parameter) of the
    latest checkpoint under ``root``, saved under any layout, read in one process without a
    process group (generation, evaluation: every process one tp rank).

    ``params``: name -> the parameter as this rank holds it (its shape and partition tags;
    placeholders do, e.g. ``model.gpt.GPTStage(materialize=False)``). Each partition, a new
    fp32 CPU tensor of its parameter's shape, is read through DCP straight from the saved
    pieces that overlap it (``shards.partition_chunks``; DCP's resharding), so the memory is
    the rank's own partitions plus one saved chunk at a time (at most one full tensor), where
    ``read_full_weights`` holds every full tensor. ``real_rows(name)`` as for ``load``: a
    vocabulary tensor's rows at or past it are zero and its saved padding may differ.

    Raises CheckpointError when there is no checkpoint, a tensor is missing or has another
    shape, or a file is unreadable.
    """
    meta = peek(root)
    if meta is None:
        raise CheckpointError(f"no checkpoint under {root} (no 'latest' file); fix: give the --save directory of a run")
    d = iteration_dir(root, meta["iteration"])
    saved = _read_metadata(d).state_dict_metadata
    dcp, shards, CheckpointException = _dcp(), _shards(), _checkpoint_exception()
    parts, mine = {}, {}
    for name, p in params.items():
        key, rows = f"{name}/main_param", None if real_rows is None else real_rows(name)
        _check_fits(d, saved, key, name, shards.global_shape(p, tp_size), rows)
        parts[name] = torch.zeros(p.shape, dtype=torch.float32, device="cpu")
        chunks = shards.partition_chunks(p, parts[name], tp_rank, tp_size)
        mine[key] = chunks if rows is None else _clip_rows(chunks, rows)
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({}, storage_reader=dcp.FileSystemReader(d), planner=shards.LoadPlanner(mine), no_dist=True)
    except (Exception, CheckpointException) as e:
        raise _read_error(d, e) from None
    return meta, parts


def read_full_tensors(root: str, suffix: str = "") -> tuple[dict, str, dict[str, torch.Tensor]]:
    """(meta, iteration directory, key -> FULL tensor) of the latest checkpoint under ``root``
    for every key ending in ``suffix``, assembled from the saved shards of any layout in one
    process (no process group; holds every full tensor: offline use only).

    Raises CheckpointError when there is no checkpoint or a file is missing or unreadable.
    """
    meta = peek(root)
    if meta is None:
        raise CheckpointError(f"no checkpoint under {root} (no 'latest' file); fix: give the --save directory of a run")
    d = iteration_dir(root, meta["iteration"])
    saved = _read_metadata(d).state_dict_metadata
    full = {
        k: torch.empty(v.size, dtype=v.properties.dtype, device="cpu") for k, v in saved.items() if k.endswith(suffix)
    }
    dcp, CheckpointException = _dcp(), _checkpoint_exception()
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(full, storage_reader=dcp.FileSystemReader(d), no_dist=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"{d}: reading the tensors failed ({type(e).__name__}); fix: load an "
            f"earlier iter_* directory (write its number into 'latest')"
        ) from None
    return meta, d, full
