"""Run control: how a run may end early (signals, wall-clock limit, agreed stop, non-finite
steps, the test hook's faults), what it writes when it does, and restarts after a failure."""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from data.gpt_dataset import parse_data_path
from megazero.config import Config
from megazero.runtime import resilience
from megazero.runtime.launch import Launch
from megazero.runtime.monitor import Monitor
from megazero.training.trainer import Trainer


@dataclass
class RunControl:
    """How a run may end early (megazero/runtime/resilience.py): the signals caught, the wall-clock limit,
    whether this rank writes ``stop.json`` (one per node), the restart count and a test fault."""

    signals: Optional[resilience.StopSignals] = None
    clock: Optional[resilience.StopClock] = None
    writes_record: bool = True
    restart: int = 0
    fault: Optional[tuple] = None
    trail: resilience.Trail = field(default_factory=resilience.Trail)

    def flags(self) -> list[float]:
        return resilience.local_flags(self.signals, self.clock)


def inject_fault(control: RunControl, trainer: Trainer) -> None:
    """The test hook's ``kill`` / ``term`` / ``swaptrunc`` / ``paramtrunc`` fault, at the start of
    its iteration (first attempt)."""
    f = control.fault
    if (
        f is not None
        and f[0] in ("swaptrunc", "paramtrunc")
        and f[1:3] == (trainer.state.iteration + 1, trainer.groups.rank)
    ):
        path = trainer.optimizer.swap_path if f[0] == "swaptrunc" else trainer.ddp.param_swap.swap_path
        os.truncate(path, os.path.getsize(path) - 12)
    if (
        f is not None
        and f[0] in ("kill", "term")
        and f[1:3] == (trainer.state.iteration + 1, trainer.groups.rank)
        and control.restart == 0
    ):
        os.kill(os.getpid(), signal.SIGKILL if f[0] == "kill" else signal.SIGTERM)


def report_restart(cfg: Config, control: RunControl, resumed: Optional[int], monitor: Monitor) -> None:
    """After torchrun restarted the group: restarts so far and the iterations lost, from the
    last iteration the metrics file logged before the failure (exact with --log-interval 1)."""
    if control.restart == 0 or not monitor.is_logging_rank:
        return
    path = os.path.join(cfg.log.run_dir, cfg.log.metrics_file or "")
    logged = [json.loads(x) for x in open(path)] if cfg.log.metrics_file and os.path.exists(path) else []
    last = max([r["iteration"] for r in logged if r.get("kind") == "train"] + [resumed or 0])
    lost = last - (resumed or 0)
    print(
        f"[megazero] restart {control.restart} of --max-restarts {cfg.train.max_restarts}: resumed at "
        f"iteration {resumed or 0}; {lost} trained iteration(s) lost (the last logged was {last})",
        flush=True,
    )
    monitor.log_record(
        "restart",
        dict(restart=control.restart, resumed_iteration=resumed or 0, last_logged_iteration=last, iterations_lost=lost),
    )


def handle_bad_step(trainer: Trainer, monitor: Monitor) -> Optional[str]:
    """A step with a non-finite loss or gradient (already skipped by the optimizer): count it
    against --skip-bad-batches, or return the error line that ends the run."""
    line, budget, state = trainer.locate_bad_step(), trainer.cfg.train.skip_bad_batches, trainer.state
    if state.bad_batches < budget:
        state.bad_batches += 1
        if trainer.groups.rank == 0:
            print(
                f"[megazero] skipped iteration {state.iteration}: {line} ({state.bad_batches} of "
                f"--skip-bad-batches {budget} used)",
                flush=True,
            )
        monitor.log_record("bad_batch", dict(iteration=state.iteration, message=line, bad_batches=state.bad_batches))
        return None
    line += "; fix: inspect those samples, lower --lr, or --skip-bad-batches N to skip such steps"
    if trainer.groups.rank == 0:
        print(f"megazero: training error: {line}", file=sys.stderr, flush=True)
    return line


#: empty steps of a run that get a warning line each; later ones are counted and recorded only.
EMPTY_STEP_WARNINGS = 10


def data_name(cfg: Config) -> str:
    """The training data as the command line named it (``--data-path`` prefixes, or mock data)."""
    if cfg.train.mock_data:
        return "--mock-data"
    return "--data-path " + " ".join(prefix for _, prefix in parse_data_path(cfg.data.data_path))


def report_empty_step(trainer: Trainer, monitor: Monitor, empty_steps: int) -> None:
    """A step whose global batch had no loss token, which the optimizer skipped
    (``Trainer.train_step``, ``StepOutcome.empty``): an ``empty_batch`` record, and for the first
    ``EMPTY_STEP_WARNINGS`` of the run a warning naming the iteration and its samples.
    ``empty_steps`` counts this run's empty steps, this one included."""
    state, cfg = trainer.state, trainer.cfg
    last = state.consumed_samples - 1
    first = state.consumed_samples - cfg.train.global_batch_size
    monitor.log_record("empty_batch", dict(iteration=state.iteration, first_sample=first, last_sample=last))
    if trainer.groups.rank != 0 or empty_steps > EMPTY_STEP_WARNINGS:
        return
    more = " (later empty steps are counted without a warning)" if empty_steps == EMPTY_STEP_WARNINGS else ""
    print(
        f"megazero: warning: iteration {state.iteration} skipped: its global batch (samples {first}..{last} "
        f"of {data_name(cfg)}) has no loss token, so the optimizer step was not taken (counted in "
        f"'skipped iterations'){more}",
        file=sys.stderr,
        flush=True,
    )


def no_loss_tokens_line(cfg: Config, steps: int) -> str:
    """The error that ends a run none of whose ``steps`` steps had a loss token (exit 2)."""
    return (
        f"none of the {steps} steps of this run had a loss token: every target of {data_name(cfg)} is "
        f"masked (SFT prompts that fill --seq-length {cfg.model.seq_length}, or --eod-mask-loss on "
        "one-token documents); fix: check the data's loss masks, or raise --seq-length so that the "
        "responses fit"
    )


def finish_stop(trainer: Trainer, control: RunControl, reason: str, saved: Optional[str], message: str = "") -> dict:
    """End the run early at this step boundary: save (with --save, unless just saved), write
    stop.json, say so. Returns train()'s result with ``stop`` and ``status``."""
    s, it = trainer.cfg.train, trainer.state.iteration
    failed = reason in resilience.FAILED_STOPS
    if not failed and s.save and saved is None:
        saved = trainer.save_checkpoint(s.save)
    trainer.finish_save()  # the checkpoint is complete before the run ends
    trainer.optimizer.wait_param_gather()
    path = saved if not failed else None
    if control.writes_record:
        resilience.write_stop_record(
            trainer.cfg.log.run_dir, reason=reason, iteration=it, checkpoint=path, message=message
        )
    if trainer.groups.rank == 0 and not failed:
        where = f"checkpoint saved in {path}" if path else "nothing saved (no --save)"
        print(f"[megazero] stopping after iteration {it} ({reason}): {where}", flush=True)
    return dict(iteration=it, stop=reason, status=resilience.stop_status(reason))


def run_control(cfg: Config, launch: Launch, signals: resilience.StopSignals, start: float) -> RunControl:
    """The RunControl of this rank: its signals and clock, one stop.json writer per node
    (local rank 0), torchrun's restart count and the test hook ``MEGAZERO_TEST_FAULT``."""
    return RunControl(
        signals=signals,
        clock=resilience.StopClock(cfg.train.exit_duration_in_mins, start),
        writes_record=launch.local_rank == 0,
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        fault=resilience.parse_fault(os.environ.get("MEGAZERO_TEST_FAULT", "")),
    )


def is_collective_failure(e: BaseException) -> bool:
    """True for gloo/NCCL errors of a peer that disappeared or a collective that timed out
    (gloo's asynchronous ``Work.wait`` says "Application timeout caused pair closure")."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        k in text
        for k in (
            "Connection reset",
            "Connection closed",
            "timed out",
            "Timed out",
            "timeout",
            "pair closure",
            "gloo",
            "NCCL",
        )
    )
