"""The folders NVMe swap files live in: checked before launch, made with their owner, swept when stale.

Each rank makes its own swap folder under ``--offload-nvme-path``
(``megazero-<run id>-rank<r>`` for the optimizer state, ``...-params`` for ZeRO-3's
parameter shards) and removes it when it closes. A rank that is killed (SIGKILL, a node's OOM
killer, torchrun ending the survivors after a peer died) removes nothing, so every folder
records its owner in ``owner.json``: the host name, the boot id
(``/proc/sys/kernel/random/boot_id``), the pid namespace and the pid and start time (clock
ticks after boot, field 22 of ``/proc/<pid>/stat``) of the process that made it. The folder is
made under a hidden temporary name and renamed into place with its owner file in it, so no
``megazero-*`` folder is ever seen without an owner.

:func:`sweep_stale` removes the folders whose owner is gone: same host and another boot id (the
machine restarted), or same boot and the pid is not running (or runs another process: its start
time differs). A folder made on another host or in another pid namespace is never touched (a
disk shared between nodes or containers: its owner cannot be checked from here), nor one whose
owner runs. The launcher sweeps before the
ranks start and after they end (``scripts/pretrain_gpt.sh``), and local rank 0 of every attempt
sweeps before the first swap file is made (the folders of an attempt torchrun restarted after
a rank died).

:func:`check_nvme_path` refuses a path that cannot hold the swap files (not a directory, not
creatable, not writable, too little free space) before any rank starts (docs/design.md,
contract 3). Standard library only: the launcher imports it without torch.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import uuid
from typing import Callable, Optional

PREFIX = "megazero-"
OWNER_FILE = "owner.json"
FLAG = "--offload-nvme-path"


class SwapError(RuntimeError):
    """A swap file or folder failed its check or an I/O call. ``local``: the file is this
    rank's (the message names it); False on the ranks that only learnt that another rank's file
    failed."""

    def __init__(self, message: str, local: bool = True):
        super().__init__(message)
        self.local = local


class NvmePathError(ValueError):
    """``--offload-nvme-path`` cannot hold the swap files (found before any rank starts)."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _stat_fields(pid: int) -> Optional[list[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def owner_record(pid: Optional[int] = None) -> dict:
    """``{"host", "boot", "pidns", "pid", "start"}`` of process ``pid`` (default: this one, whose
    pid namespace ``pidns`` is); ``start`` is its start time in clock ticks after boot (None
    without ``/proc``)."""
    pid = os.getpid() if pid is None else pid
    fields = _stat_fields(pid)
    start = int(fields[19]) if fields else None
    return dict(host=socket.gethostname(), boot=_boot_id(), pidns=_pid_namespace(), pid=pid, start=start)


def owner_gone(owner: dict) -> bool:
    """True when the process that ``owner`` (an :func:`owner_record`) describes is known to be
    gone: same host, and another boot, or (same pid namespace) its pid not running (a zombie
    counts as gone) or running with another start time (the pid was reused). False for another
    host or another pid namespace (a container with the same host name): unknown."""
    if owner.get("host") != socket.gethostname():
        return False
    if owner.get("boot") and _boot_id() and owner["boot"] != _boot_id():
        return True
    if owner.get("pidns", "") != _pid_namespace():
        return False
    pid = int(owner.get("pid", 0))
    if pid <= 0:
        return False
    fields = _stat_fields(pid)
    if fields is None:  # no such process (or no /proc: ask the kernel)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    if fields[0] == "Z":
        return True
    return owner.get("start") is not None and int(fields[19]) != owner["start"]


def read_owner(folder: str) -> Optional[dict]:
    """The owner record of a swap folder, or None when it has none (not made by megazero)."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else None
    except (OSError, ValueError):
        return None


def make_swap_dir(nvme_path: str, name: str) -> str:
    """Make ``<nvme_path>/<name>`` (``name`` starts with ``megazero-``) with this process's
    owner record in it, atomically (made under a hidden name, then renamed); ``nvme_path`` is
    created when absent. Returns the folder. Raises SwapError naming ``--offload-nvme-path``
    and the fix when it cannot be made (nothing is left behind)."""
    folder = os.path.join(nvme_path, name)
    tmp = os.path.join(nvme_path, f".{PREFIX}tmp-{uuid.uuid4().hex}")
    try:
        os.makedirs(nvme_path, exist_ok=True)
        os.mkdir(tmp)
        with open(os.path.join(tmp, OWNER_FILE), "w") as f:
            json.dump(owner_record(), f)
        os.rename(tmp, folder)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SwapError(f"{FLAG} {nvme_path}: cannot make the swap folder {folder} ({e.strerror}); {_fix(e)}") from None
    return folder


def remove_swap_dir(folder: str) -> None:
    """Remove a swap folder, its owner file last (a removal cut short leaves a folder a later
    sweep still recognises); a folder already gone is no error."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for n in names:
        if n != OWNER_FILE:
            p = os.path.join(folder, n)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else _unlink(p)
    _unlink(os.path.join(folder, OWNER_FILE))
    try:
        os.rmdir(folder)
    except OSError:
        pass


def _unlink(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def sweep_stale(nvme_path: str, log: Callable[[str], None] = print) -> list[str]:
    """Remove every swap folder under ``nvme_path`` (``megazero-*``, and the hidden ones of a
    folder being made or swept) whose owner is gone (:func:`owner_gone`), logging one line per
    folder. A folder is claimed by renaming it first, so two sweepers never both remove (and
    log) it. Folders without an owner record, of a running owner or of another host are kept.
    Returns the folders removed (their names before the claim); nothing when the path is
    missing or unreadable."""
    try:
        names = sorted(os.listdir(nvme_path))
    except OSError:
        return []
    removed = []
    for name in names:
        if not (name.startswith(PREFIX) or name.startswith("." + PREFIX)):
            continue
        folder = os.path.join(nvme_path, name)
        owner = read_owner(folder)
        if owner is None or not owner_gone(owner):
            continue
        claimed = os.path.join(nvme_path, f".{PREFIX}sweep-{uuid.uuid4().hex}")
        try:
            os.rename(folder, claimed)
        except OSError:  # another sweeper took it, or it is not ours to move
            continue
        remove_swap_dir(claimed)
        removed.append(folder)
        log(
            f"[megazero] removed the stale NVMe swap folder {folder} (its process, pid {owner.get('pid')} "
            f"on {owner.get('host')}, is gone)"
        )
    return removed


def _fix(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return f"fix: free space there or point {FLAG} at a disk with more room"
    return f"fix: point {FLAG} at a writable directory"


def check_nvme_path(path: str, need_bytes: int = 0, keep: bool = False) -> None:
    """Raise NvmePathError (one line naming ``--offload-nvme-path`` and the fix) when ``path``
    cannot hold the swap files: it, or the part of it that exists, is a file; it cannot be
    created; a probe file cannot be written and removed in it (read-only, no permission, full);
    or it has fewer than ``need_bytes`` bytes free. Folders it creates for the probe are removed
    again unless ``keep`` (and always on an error), so a refused path leaves nothing behind."""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe.rstrip("/"))
    if probe and not os.path.isdir(probe):
        what = "is a file" if probe == path else f"is under {probe}, which is a file"
        raise NvmePathError(f"{FLAG} {path} {what}, not a directory; fix: point {FLAG} at a directory")
    created = []
    try:
        for d in _missing_ancestors(path):
            os.mkdir(d)
            created.append(d)
        _probe_write(path)
        free = shutil.disk_usage(path).free
    except OSError as e:
        _remove(created)
        raise NvmePathError(f"{FLAG} {path} is not usable for the swap files ({e.strerror}); {_fix(e)}") from None
    if free < need_bytes:
        _remove(created)
        raise NvmePathError(
            f"{FLAG} {path} has {_size(free)} free, the swap files of this node's ranks need about "
            f"{_size(need_bytes)}; fix: free space there or point {FLAG} at a disk with more room"
        )
    if not keep:
        _remove(created)


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"


def _missing_ancestors(path: str) -> list[str]:
    out = []
    p = os.path.abspath(path)
    while not os.path.exists(p):
        out.append(p)
        p = os.path.dirname(p)
    return out[::-1]


def _probe_write(path: str) -> None:
    probe = os.path.join(path, f".{PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        _unlink(probe)


def _remove(created: list[str]) -> None:
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            pass
