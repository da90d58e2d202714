"""A torch.profiler trace of a window of training steps, one file per chosen rank.

Megatron-LM's ``--profile --profile-step-start S --profile-step-end E --profile-ranks R...``:
steps ``S .. E-1`` (1-based iterations) are recorded on each listed global rank with
``torch.profiler`` (CPU, and CUDA when the device is a GPU, with shapes and memory) and
written by ``torch.profiler.tensorboard_trace_handler`` as
``RUN_DIR/profile/rank<R>.<timestamp>.pt.trace.json``: a Chrome-trace file that Perfetto
(ui.perfetto.dev) and chrome://tracing open, and that TensorBoard's profiler plugin reads
with ``--logdir RUN_DIR/profile``. The profiler runs only inside the window, so the other
steps pay nothing.
"""

from __future__ import annotations

import os
from typing import Optional

import torch


class StepProfiler:
    """Starts the profiler before step ``start`` and writes the trace after step ``end - 1``.

    Args:
        out_dir: folder of the traces (created when the first trace is written).
        rank: this process's global rank (names the trace file).
        start, end: the window ``[start, end)`` of 1-based iterations; a run resumed inside
            the window profiles its remaining steps, one resumed after it nothing.
        enabled: False makes every method a no-op (ranks not in ``--profile-ranks``).

    Call ``before_step(iteration)`` right before running ``iteration`` and ``after_step(
    iteration)`` right after it, then ``close()`` at the end of training.
    """

    def __init__(self, out_dir: str, rank: int, start: int, end: int, enabled: bool = True):
        self.out_dir, self.rank, self.start, self.end = out_dir, rank, start, end
        self.enabled = enabled
        self._prof: Optional[torch.profiler.profile] = None
        self._step: Optional[torch.profiler.record_function] = None

    def before_step(self, iteration: int) -> None:
        if self.enabled and self._prof is None and self.start <= iteration < self.end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            handler = torch.profiler.tensorboard_trace_handler(self.out_dir, worker_name=f"rank{self.rank}")
            self._prof = torch.profiler.profile(
                activities=activities, record_shapes=True, profile_memory=True, on_trace_ready=handler
            )
            self._prof.start()
        if self._prof is not None:  # TensorBoard's plugin splits the trace at these ranges
            self._step = torch.profiler.record_function(f"ProfilerStep#{iteration}")
            self._step.__enter__()

    def after_step(self, iteration: int) -> None:
        if self._prof is not None:
            self._step.__exit__(None, None, None)
            self._step = None
            if iteration >= self.end - 1:
                self.close()

    def close(self) -> None:
        """Stop and write the trace (when recording); the profiler is then done for the run."""
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
            self.enabled = False


def step_profiler(run_dir: str, rank: int, profile: bool, start: int, end: int, ranks: list[str]) -> StepProfiler:
    """The profiler of this rank for ``--profile`` (enabled only on the ranks listed)."""
    return StepProfiler(os.path.join(run_dir, "profile"), rank, start, end, enabled=profile and str(rank) in ranks)
