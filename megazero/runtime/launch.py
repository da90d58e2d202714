"""How this process was launched, and the checks of the machine made before any process group.

``read_launch_env`` reads torchrun's environment; ``check_device`` refuses a ``--device`` or
``--kernels`` the machine cannot run (docs/design.md, contract 3: before the first collective, one
line, exit code 2); ``bind_device`` makes this rank's GPU the current device before anything opens
a CUDA context; ``launch_exports`` and ``max_connections_warning`` decide and check
``CUDA_DEVICE_MAX_CONNECTIONS``; ``watch_parent`` ends a rank whose torchrun died without stopping it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from megazero.config import Config
from megazero.data_parallel.policy import sharding_policy
from megazero.ops.backend import select_backend


@dataclass
class Launch:
    """What the launcher tells this process: ranks and the world size."""

    rank: int
    local_rank: int
    world_size: int


def read_launch_env() -> Launch:
    """torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE); one process without it."""
    return Launch(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


class DeviceError(ValueError):
    """--device / --kernels that this machine cannot run (found before any process group)."""


def uses_cuda(cfg: Config) -> bool:
    """``--device cuda``, or ``auto`` on a machine with a visible GPU."""
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())


def check_device(cfg: Config, ranks_per_node: int) -> None:
    """Raise DeviceError when ``--device cuda`` has no GPU, this node runs more ranks than it
    has GPUs (one GPU per rank), or ``--kernels`` cannot run on the device."""
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            "--device cuda: no CUDA device is visible on this machine; fix: --device cpu "
            "(or auto, which takes a GPU when there is one)"
        )
    if uses_cuda(cfg) and torch.cuda.device_count() < ranks_per_node:
        raise DeviceError(
            f"{ranks_per_node} ranks on this node but {torch.cuda.device_count()} GPUs (one per "
            f"rank); fix: fewer ranks per node (--nnodes, --tp/--pp/--dp) or --device cpu"
        )
    try:
        select_backend(cfg.optim.kernels, torch.device("cuda" if uses_cuda(cfg) else "cpu"))
    except ValueError as e:
        raise DeviceError(str(e)) from None


def bind_device(cfg: Config, launch: Launch) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` made the current CUDA device, or the CPU.

    Call it right after ``check_device`` and before anything that opens a CUDA context
    (``torch.cuda.mem_get_info`` in the memory check, a CUDA tensor, ``init_process_group``):
    every call without an explicit device runs on the current device, GPU 0 until this is
    set, so each rank would open a context (hundreds of MiB) on GPU 0 and NCCL would see
    every rank on one GPU. ``torch.cuda.is_available`` / ``device_count`` open none.
    """
    if not uses_cuda(cfg):
        return torch.device("cpu")
    torch.cuda.set_device(launch.local_rank)
    return torch.device("cuda", launch.local_rank)


MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def max_connections_rule(cfg: Config) -> tuple[Optional[str], str]:
    """``(value, reason)``: the ``CUDA_DEVICE_MAX_CONNECTIONS`` this run wants, or None to leave
    CUDA's default (8 hardware work queues per device), and why, in words.

    The rule is Megatron-LM's (``validate_args`` in megatron/training/arguments.py): tensor and
    context parallelism overlap a communication kernel with compute that the host queued after
    it (here the async tensor-parallel all-reduce or reduce-scatter of the input gradient beside
    the weight-gradient matmul, and the ring attention's K/V exchange beside each block). With
    one work queue the GPU starts kernels in the order they were queued, so the communication
    kernel holds its SMs before the matmul fills the device; with several queues the matmul
    may take every SM first and the overlap is lost. FSDP (ZeRO-3 here) wants the opposite:
    its prefetch all-gathers on their own streams need several queues to run beside compute.
    Where both apply Megatron warns and sets nothing; so does megazero. ZeRO-1/2 and plain data
    parallelism overlap on their own streams too and keep CUDA's default. (Megatron skips the
    rule from Blackwell, compute capability 10, on; the launcher decides before any CUDA call
    and reads no capability, so it sets 1 there too.)
    """
    p = cfg.parallel
    overlaps = []
    if p.tp > 1 and p.async_tensor_model_parallel_allreduce and not cfg.train.compile:
        overlaps.append(
            f"the async tensor-parallel input-gradient reduction (--tp {p.tp}"
            f"{', --sequence-parallel' if p.sequence_parallel else ''})"
        )
    if p.cp > 1 and p.cp_comm_type == "p2p":
        overlaps.append(f"the ring attention's K/V exchange (--cp {p.cp})")
    if not overlaps:
        return None, "no tensor- or context-parallel overlap: CUDA's default queues"
    what = " and ".join(overlaps)
    if sharding_policy(cfg.zero.stage).shards_params:
        return None, (
            f"{what} wants {MAX_CONNECTIONS}=1 but ZeRO-3's prefetch all-gathers want several "
            "queues: left to CUDA's default (Megatron-LM decides so with FSDP)"
        )
    return "1", f"{what} overlaps with compute only when kernels start in the order they were queued"


#: the caching allocator's settings (PyTorch's "CUDA memory management" notes; the older name
#: first, the device-neutral one PyTorch 2.9 added second: a value in either is the user's)
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def launch_exports(cfg: Config, environ: Mapping[str, str], cuda: Optional[bool] = None) -> list[tuple[str, str, str]]:
    """``(name, value, reason)`` of each variable the launcher exports for this run, unless
    ``environ`` sets it already (a value the user set wins; ``max_connections_warning`` then
    says what it costs): ``CUDA_DEVICE_MAX_CONNECTIONS`` as ``max_connections_rule`` wants, and
    on CUDA (``cuda``; default: ``--device cuda``, or ``auto`` with a GPU visible)
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: MoE experts, variable-length
    documents and pipeline buffers allocate blocks of ever-changing sizes, which fragment the
    caching allocator's fixed segments; expandable segments grow one mapping instead (PyTorch's
    documented remedy). Inert on a CPU run."""
    out = []
    value, why = max_connections_rule(cfg)
    if value is not None and MAX_CONNECTIONS not in environ:
        out.append((MAX_CONNECTIONS, value, why))
    if cuda is None:
        cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cuda and not any(name in environ for name in ALLOC_CONF):
        out.append(
            (
                ALLOC_CONF[0],
                EXPANDABLE,
                "variable block sizes (experts, documents, pipeline buffers) fragment fixed segments; "
                "expandable segments grow one mapping",
            )
        )
    return out


def max_connections_warning(cfg: Config, environ: Mapping[str, str]) -> Optional[str]:
    """The warning train.py prints on CUDA when ``CUDA_DEVICE_MAX_CONNECTIONS`` does not match
    ``max_connections_rule`` (missing or other than 1 where an overlap needs 1; 1 where ZeRO-3
    wants several queues), else None."""
    value, why = max_connections_rule(cfg)
    have = environ.get(MAX_CONNECTIONS)
    if value == "1" and have != "1":
        return (
            f"{MAX_CONNECTIONS} is {'unset' if have is None else repr(have)}: {why}; fix: export "
            f"{MAX_CONNECTIONS}=1 before the ranks start (scripts/pretrain_gpt.sh does)"
        )
    if value is None and sharding_policy(cfg.zero.stage).shards_params and have == "1" and "ZeRO-3" in why:
        return f"{MAX_CONNECTIONS}=1 serialises ZeRO-3's prefetch all-gathers with compute: {why}"
    return None


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
                print(
                    f"[megazero] rank {os.environ.get('RANK', 0)}: the launcher (pid {gone}) is gone; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=loop, name="megazero-watch-parent", daemon=True).start()
