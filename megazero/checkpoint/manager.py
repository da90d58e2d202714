"""The run's checkpoint manager and its counters: what a run saves, when, and how it resumes.

``RunState`` holds the counters of a run (iteration, consumed samples, skipped iterations,
bad batches, evaluation round); they are written into and read from a checkpoint's
``meta.pt`` here and nowhere else. ``CheckpointManager`` owns the save in flight
(``--async-save``), the keep-N pruning setting and the resume, so the Trainer only says
*save now* or *resume from there* (the shape of torchtitan's CheckpointManager; the format
itself is :mod:`megazero.checkpoint.core`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero.checkpoint import core
from megazero.offload.host_memory import HostArena, can_pin
from megazero.process_groups import ProcessGroups


@dataclass
class RunState:
    """The counters of a run, saved with every checkpoint and restored on resume.

    ``iteration`` (completed optimizer steps), ``consumed_samples`` (samples of the global
    batches trained on, across data-parallel ranks; it fixes the data position),
    ``skipped_iterations`` (steps the optimizer skipped: fp16 overflow or a non-finite
    gradient), ``bad_batches`` (of those, steps counted against ``--skip-bad-batches``),
    ``eval_round`` (validation rounds done: the next one reads the next validation batches).
    """

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    bad_batches: int = 0
    eval_round: int = 0

    def advance(self, global_batch_size: int, skipped: bool) -> None:
        """One optimizer step done on ``global_batch_size`` samples (``skipped``: not applied)."""
        self.iteration += 1
        self.consumed_samples += global_batch_size
        self.skipped_iterations += int(skipped)

    def to_meta(self) -> dict:
        """The counters kept in ``meta.pt``'s ``extra`` (the iteration is ``meta["iteration"]``)."""
        return dict(
            consumed_samples=self.consumed_samples,
            skipped_iterations=self.skipped_iterations,
            bad_batches=self.bad_batches,
            eval_round=self.eval_round,
        )

    @staticmethod
    def from_meta(meta: dict) -> "RunState":
        """The counters of a loaded checkpoint's ``meta`` (``bad_batches`` 0 in older ones)."""
        extra = meta["extra"]
        return RunState(
            iteration=meta["iteration"],
            consumed_samples=extra["consumed_samples"],
            skipped_iterations=extra["skipped_iterations"],
            bad_batches=extra.get("bad_batches", 0),
            eval_round=extra["eval_round"],
        )


class CheckpointManager:
    """Saves and resumes one run's checkpoints (collective: every rank calls every method).

    Args: ``groups`` (the run's ProcessGroups); ``keep`` (``--keep-latest-checkpoints``: 0
    keeps all, N > 0 deletes older ones once ``latest`` names the new one); ``async_save``
    (``--async-save``: the files are written in the background through a gloo group of
    their own, so that thread's collectives never interleave with the training loop's);
    ``log`` (a callable taking a record kind and fields, e.g. ``Monitor.log_record``, or None).

    Attributes: ``pending`` (the background save in flight, or None) and ``pending_path``.
    """

    def __init__(
        self,
        groups: ProcessGroups,
        *,
        keep: int = 0,
        async_save: bool = False,
        log: Optional[Callable[[str, dict], None]] = None,
    ):
        self.groups, self.keep, self.log = groups, keep, log
        self.async_group = (
            None if not async_save else ("local" if groups.world is None else dist.new_group(backend="gloo"))
        )
        self.pending: Optional[core.PendingSave] = None
        self.pending_path: Optional[str] = None
        self.staging = None  # the background saves' host buffer, reused while its size holds

    def _staging(self, numel: int, device: torch.device):
        """One exactly-sized host buffer for a background save's copy, page-locked when the
        state is on CUDA; the next save reuses it (``save`` finishes the previous one first)."""
        if self.staging is None or self.staging.flat.numel() != numel:
            self.staging = None  # free (and unregister) the old one before the new one
            self.staging = HostArena([numel], torch.float32, pin=can_pin(device))
        return self.staging

    def save(
        self,
        root: str,
        state: RunState,
        optimizer,
        chunks,
        *,
        rng_states: Optional[dict],
        extra: dict,
        after_write: Optional[Callable[[], None]] = None,
        wait: bool = False,
    ) -> str:
        """Write the checkpoint of ``state.iteration`` under ``root``; returns its directory.

        The previous background save is finished first. ``extra`` (picklable) joins the
        counters in ``meta.pt``. With ``async_save`` the files are written in the background
        (finished by the next save, ``finish`` or ``wait``); the seconds the loop was blocked
        are printed by rank 0 and logged as a ``checkpoint`` record.
        """
        self.finish()
        t0 = time.perf_counter()
        out = core.save(
            root,
            state.iteration,
            optimizer,
            chunks,
            self.groups,
            rng_states=rng_states,
            extra=dict(state.to_meta(), **extra),
            keep=self.keep,
            async_group=self.async_group,
            after_write=after_write,
            staging=self._staging,
        )
        blocked = time.perf_counter() - t0
        path = core.iteration_dir(root, state.iteration)
        if isinstance(out, core.PendingSave):
            self.pending, self.pending_path = out, path
        if self.groups.rank == 0:
            how = "in the background, " if self.pending is not None else ""
            print(f"[megazero] saving checkpoint {path} ({how}training blocked {blocked:.3f} s)", flush=True)
        if self.log is not None:
            self.log(
                "checkpoint", dict(iteration=state.iteration, blocked_s=blocked, background=self.pending is not None)
            )
        if wait:
            self.finish()
        return path

    def finish(self) -> None:
        """Wait for the background save, if any, and move ``latest`` to it."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.wait()
        if self.groups.rank == 0:
            print(
                f"[megazero] checkpoint {self.pending_path} is complete (waited {pending.waited_s:.3f} s)", flush=True
            )

    def resume(
        self,
        root: str,
        optimizer,
        chunks,
        *,
        real_rows: Optional[Callable[[str], Optional[int]]] = None,
        weights_only: bool = False,
        fresh: tuple = (),
    ) -> Optional[tuple[RunState, dict]]:
        """Load the latest checkpoint under ``root`` (saved under any layout) into ``optimizer``.

        Returns ``(RunState, meta)`` (``meta`` as :func:`megazero.checkpoint.core.load`
        returns it, with this rank's ``rng_state`` or None when the layout differs), or None
        when ``root`` holds no checkpoint yet. ``weights_only`` (``--finetune``): the weights
        alone, and a fresh ``RunState``; ``fresh`` as ``core.load`` takes it. Raises
        CheckpointError as ``core.load`` does.
        """
        if core.latest_iteration(root) is None:
            return None
        meta = core.load(
            root, optimizer, chunks, self.groups, real_rows=real_rows, weights_only=weights_only, fresh=fresh
        )
        return (RunState() if weights_only else RunState.from_meta(meta)), meta
