"""``main``: one rank's whole run, as ``train.py`` and torchrun's ranks call it (the package re-exports it
as ``megazero.training.main``)."""

from __future__ import annotations

import gc
import os
import sys
import time

import torch.distributed as dist

from megazero import checkpoint
from megazero.config import config_from_argv, resolve_run_dir
from megazero.offload.swap import SwapError
from megazero.planning import memory
from megazero.precision import LossScaleError
from megazero.runtime import resilience
from megazero.runtime.launch import bind_device, check_device, read_launch_env, watch_parent
from megazero.training.control import is_collective_failure, run_control
from megazero.training.loop import train
from megazero.training.startup import (
    START_ERRORS,
    check_memory,
    check_nvme,
    prepare_run,
    report_start_error,
    resume_warnings,
    setup_groups,
    sweep_nvme,
)


def main(argv=None) -> int:
    """Train; returns the exit status: 0, 1 (training error), 2 (bad setting, data or checkpoint),
    or after an early stop its documented status (resilience.stop_status) -- 0 under torchrun,
    whose launcher reads that status from stop.json, so torchrun neither restarts nor reports."""
    start = time.monotonic()
    signals = resilience.StopSignals().install()  # from now on a signal asks for a stop, see train()
    launch = read_launch_env()
    argv = sys.argv[1:] if argv is None else argv
    # Everything that can be wrong with the settings, the data or the checkpoint is found
    # here, on every rank, before any process group exists (docs/design.md, contract 3). The
    # launcher already printed the config warnings in its preflight.
    quiet = launch.rank != 0 or os.environ.get("MEGAZERO_PREFLIGHT_DONE") == "1"
    cfg = config_from_argv(argv, launch.world_size, print_warnings=not quiet)
    # Same directory on every rank: the launcher passes --run-dir; torchrun's run id otherwise.
    resolve_run_dir(cfg, os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        watch_parent()
    try:
        check_device(cfg, memory.ranks_per_node())
        device = bind_device(cfg, launch)  # before anything opens a CUDA context (the memory check does)
        # the checksums are read once: by the launcher's preflight, else by rank 0
        verify = launch.rank == 0 and os.environ.get("MEGAZERO_PREFLIGHT_DONE") != "1"
        data = prepare_run(cfg, verify=verify)
        plan = check_memory(cfg, data.vocab_size, verbose=not quiet)
        if launch.local_rank == 0:  # one sweeper per node: e.g. the folders of the attempt torchrun restarted
            sweep_nvme(cfg)
        check_nvme(cfg, plan, keep=True, room=launch.local_rank == 0)  # room counted once swept
    except START_ERRORS as e:
        return report_start_error(e)
    for w in resume_warnings(cfg, data.resume) if not quiet else []:
        print(f"megazero: warning: {w}", file=sys.stderr, flush=True)
    groups = setup_groups(cfg, launch, device)
    control = run_control(cfg, launch, signals, start)
    try:
        result = train(cfg, groups, device, data, control)
        if dist.is_initialized():
            dist.barrier()  # nobody tears down connections a peer is still reading from
        if "stop" in result:
            return 0 if "TORCHELASTIC_RUN_ID" in os.environ else result["status"]
    except SwapError as e:  # an NVMe swap file failed its check: every rank stops in the same step
        if e.local:  # the rank whose file it is names it
            print(f"megazero: training error: {e}", file=sys.stderr, flush=True)
        return 1
    except LossScaleError as e:  # every rank skips the same steps, so all of them stop here
        if launch.rank == 0:
            print(f"megazero: training error: {e}", file=sys.stderr, flush=True)
        return 1
    except checkpoint.CheckpointError as e:  # a tensor file that fails to read: DCP tells every rank
        if launch.rank == 0:
            report_start_error(e)
        return 2
    except RuntimeError as e:  # a collective failed: a peer died, was stopped or hung
        if launch.world_size == 1 or not is_collective_failure(e):
            raise
        print(resilience.write_failure(cfg.log.run_dir, launch.rank, control.trail, e), file=sys.stderr, flush=True)
        os._exit(1)  # no teardown: it would wait on the peer that failed
    finally:
        groups = None  # train() has closed and dropped the Trainer: these are the last references
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # the model's reference cycles go, and with them every process group, whose
        # destructor joins its worker threads now, not during interpreter shutdown
    return 0
