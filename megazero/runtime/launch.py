"""How this process was launched, and the checks of the machine made before any process group.

``read_launch_env`` reads torchrun's environment; ``check_device`` refuses a ``--device`` or
``--kernels`` the machine cannot run (docs/design.md, contract 3: before the first collective, one
line, exit code 2); ``watch_parent`` ends a rank whose torchrun died without stopping it.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from megazero.config import Config
from megazero.ops.backend import select_backend


@dataclass
class Launch:
    """What the launcher tells this process: ranks and the world size."""

    rank: int
    local_rank: int
    world_size: int


def read_launch_env() -> Launch:
    """torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE); one process without it."""
    return Launch(rank=int(os.environ.get("RANK", 0)), local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                  world_size=int(os.environ.get("WORLD_SIZE", 1)))


class DeviceError(ValueError):
    """--device / --kernels that this machine cannot run (found before any process group)."""


def uses_cuda(cfg: Config) -> bool:
    """``--device cuda``, or ``auto`` on a machine with a visible GPU."""
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())


def check_device(cfg: Config, ranks_per_node: int) -> None:
    """Raise DeviceError when ``--device cuda`` has no GPU, this node runs more ranks than it
    has GPUs (one GPU per rank), or ``--kernels`` cannot run on the device."""
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA device is visible on this machine; fix: --device cpu "
                          "(or auto, which takes a GPU when there is one)")
    if uses_cuda(cfg) and torch.cuda.device_count() < ranks_per_node:
        raise DeviceError(f"{ranks_per_node} ranks on this node but {torch.cuda.device_count()} GPUs (one per "
                          f"rank); fix: fewer ranks per node (--nnodes, --tp/--pp/--dp) or --device cpu")
    try:
        select_backend(cfg.optim.kernels, torch.device("cuda" if uses_cuda(cfg) else "cpu"))
    except ValueError as e:
        raise DeviceError(str(e)) from None


def _alive(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no such process, or no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def watch_parent(interval_s: float = 1.0) -> None:
    """Exit (SIGTERM to this process) when torchrun or the megazero launcher dies, e.g. killed
    with -9, so no rank trains on unattended. A daemon thread compares ``os.getppid()`` with
    its first value and checks that ``MEGAZERO_LAUNCHER_PID`` (set by pretrain_gpt.sh) lives."""
    parent = os.getppid()
    launcher = int(os.environ.get("MEGAZERO_LAUNCHER_PID", "0") or 0)

    def loop():
        while True:
            time.sleep(interval_s)
            gone = parent if os.getppid() != parent else launcher if launcher and not _alive(launcher) else None
            if gone is not None:
                print(f"[megazero] rank {os.environ.get('RANK', 0)}: the launcher (pid {gone}) is gone; "
                      f"exiting", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return
    threading.Thread(target=loop, name="megazero-watch-parent", daemon=True).start()
