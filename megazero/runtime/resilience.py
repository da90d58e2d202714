"""Stopping on request and on bad values, and restarting: what a rank agrees on at a step boundary.

Preemption (docs/design.md, contract 4). ``StopSignals`` turns SIGTERM, SIGINT and SIGUSR1 into a
flag (the handler only records the signal, so a signal that lands inside a collective or a
checkpoint write interrupts nothing). Once per iteration each rank adds its flags to the
small all-reduce that already averages the loss (``agree``: one SUM over the world of
``[loss share, SIGTERM, SIGINT, SIGUSR1, time limit]``), so every rank learns in the same
iteration that some rank was asked to stop, and all stop after that same step, save when
``--save`` is given, and end. This is Megatron-LM's ``--exit-signal-handler`` (whose
``DistributedSignalHandler`` all-gathers the flags in a separate collective) done without an
extra collective; ``--exit-duration-in-mins`` (each rank's own clock, agreed the same way) and
``--exit-interval`` (an iteration count, known everywhere) are Megatron's flags.

A deliberate end writes ``stop.json`` into the run directory (``write_stop_record``): the
reason, the iteration, the checkpoint and the exit status. Under torchrun the ranks then exit
with 0, so torchrun neither restarts the group nor prints a failure report; the launcher
(scripts/pretrain_gpt.sh) reads the record, prints one line and exits with the recorded status:
128 + the signal's number for a signal (as a shell reports a process ended by that signal),
0 for ``--exit-interval`` / ``--exit-duration-in-mins`` (as Megatron-LM), 1 for non-finite values,
2 for a run none of whose steps had a loss token (``no-loss-tokens``: the data, not the model, is
wrong). For the two failures the ranks print the error line and the launcher only exits.

Bad values. ``locate_non_finite`` reads, from every rank, the first micro-batch whose forward
output was non-finite while its input was finite, and names the earliest such place (micro-batch,
then pipeline stage, then tensor-parallel rank): a NaN made there flows into every later stage,
so only its origin has a finite input.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Optional

import torch

from megazero import collectives as C
from megazero.process_groups import ProcessGroups
from megazero.runtime import flight_recorder

#: the signals that request a stop, in the order of the slots of ``agree``'s vector.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

#: launcher exit status of each stop reason (also returned by ``megazero.training.main`` without torchrun).
EXIT_INTERVAL_STATUS = 0
NON_FINITE_STATUS = 1
NO_LOSS_TOKENS_STATUS = 2
#: the stop reasons that are failures: nothing is saved for them and the ranks print the error line.
FAILED_STOPS = {"non-finite": NON_FINITE_STATUS, "no-loss-tokens": NO_LOSS_TOKENS_STATUS}


class StopSignals:
    """Record SIGTERM / SIGINT / SIGUSR1 instead of dying; ``pending`` is the first one seen.

    ``install`` must run in the main thread (Python delivers signals there). A repeated signal
    changes nothing: stopping is idempotent, so a scheduler's SIGTERM to every process and the
    launcher's forwarded copy of it ask for one stop. ``restore`` puts back the previous handlers.
    """

    def __init__(self):
        self.pending: Optional[int] = None
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.pending is None:
            self.pending = signum

    def install(self) -> "StopSignals":
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


@dataclass
class StopClock:
    """``--exit-duration-in-mins`` measured on this rank's clock from ``start`` (time.monotonic)."""

    limit_min: Optional[float]
    start: float

    def expired(self) -> bool:
        return self.limit_min is not None and time.monotonic() - self.start >= 60.0 * self.limit_min


def local_flags(signals: Optional[StopSignals], clock: Optional[StopClock]) -> list[float]:
    """This rank's ``[SIGTERM, SIGINT, SIGUSR1, time limit]`` flags (0.0 or 1.0)."""
    pending = signals.pending if signals is not None else None
    return [float(pending == s) for s in STOP_SIGNALS] + [float(clock is not None and clock.expired())]


def agree(loss: torch.Tensor, flags: list[float], groups: ProcessGroups) -> tuple[float, Optional[str]]:
    """Global mean loss of the step and the stop reason every rank agrees on (collective).

    ``loss`` (0-d, any float dtype; fp64 from the schedule) is this data-parallel replica's loss, the same on all its
    ranks (the
    pipeline broadcast it); one rank per replica (last stage, tp rank 0) contributes it, so the
    SUM over the world divided by dp is the mean over replicas, as ``all_reduce_mean`` over dp
    gave. ``flags`` from ``local_flags``. Returns (loss as a Python float, reason) with reason
    None, ``"SIGTERM"``, ``"SIGINT"``, ``"SIGUSR1"`` (the first slot any rank set) or
    ``"time"``; both come from one read of the device (the only one the caller needs). The
    vector is built on the device (zeros, the loss copied in, a fill per raised flag): no copy
    from a Python list, which on CUDA is a blocking copy from pageable memory every step.
    """
    # fp64 on every rank (the same dtype everywhere, or the all-reduce mismatches): the loss
    # sum over replicas keeps its precision
    mine = groups.is_last_stage and groups.tp_rank == 0
    v = torch.zeros(1 + len(flags), dtype=torch.float64, device=loss.device)
    if mine:
        v[:1].copy_(loss.detach().reshape(1))
    for i, raised in enumerate(flags):
        if raised:
            v[1 + i].fill_(raised)  # a kernel argument, no host-to-device copy
    C.all_reduce_sum(v, groups.world)
    values = v.tolist()  # the one device sync: loss and flags together
    mean = values[0] / groups.dp_size if groups.dp_size > 1 else values[0]  # fp64, as on the device
    names = [signal.Signals(s).name for s in STOP_SIGNALS] + ["time"]
    reason = next((n for n, x in zip(names, values[1:]) if x > 0), None)
    return mean, reason


def stop_status(reason: str) -> int:
    """Exit status of a deliberate end: 128 + signal number, 0 for interval/time, 1 for bad
    values, 2 for a run without a loss token (``FAILED_STOPS``)."""
    if reason.startswith("SIG"):
        return 128 + int(signal.Signals[reason])
    return FAILED_STOPS.get(reason, EXIT_INTERVAL_STATUS)


def write_stop_record(
    run_dir: str, *, reason: str, iteration: int, checkpoint: Optional[str], message: str = ""
) -> str:
    """Write ``<run_dir>/stop.json`` atomically (temporary name, then rename); returns its path.

    Fields: ``reason`` (``SIGTERM``/``SIGINT``/``SIGUSR1``, ``time``, ``interval`` or
    ``non-finite``, ``no-loss-tokens``), ``iteration`` (the last completed step), ``checkpoint`` (directory or
    None), ``status`` (``stop_status``), ``message``. Several writers (one per node) write
    the same content, each through its own temporary name.
    """
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "stop.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(
            dict(
                reason=reason, iteration=iteration, checkpoint=checkpoint, status=stop_status(reason), message=message
            ),
            f,
        )
    os.replace(tmp, path)
    return path


# -- non-finite values ----------------------------------------------------------------------
@dataclass(frozen=True)
class Place:
    """Where a value first became non-finite: micro-batch on its data-parallel rank, stage, ranks."""

    microbatch: int
    pp_rank: int
    chunk: int
    tp_rank: int
    dp_rank: int

    def order(self) -> tuple:
        return (self.microbatch, self.chunk, self.pp_rank, self.tp_rank, self.dp_rank)


NO_PLACE = -1


def encode_place(place: Optional[Place]) -> list[int]:
    """Five ints for an all-gather (all ``NO_PLACE`` when this rank saw only finite outputs)."""
    if place is None:
        return [NO_PLACE] * 5
    return [place.microbatch, place.pp_rank, place.chunk, place.tp_rank, place.dp_rank]


def locate_non_finite(gathered: list[list[int]]) -> Optional[Place]:
    """The origin among every rank's ``encode_place``: earliest micro-batch, then model chunk
    (virtual stage), then pipeline stage, then tp and dp rank; None when every forward was finite
    (the non-finite values then first appeared in the backward pass)."""
    places = [Place(*g) for g in gathered if g[0] != NO_PLACE]
    return min(places, key=Place.order) if places else None


def sample_range(
    consumed: int, global_batch_size: int, dp_rank: int, dp_size: int, microbatch: int, micro_batch_size: int
) -> range:
    """Training-set sample indices of one micro-batch (the order of data/samplers.py)."""
    start = consumed + dp_rank * (global_batch_size // dp_size) + microbatch * micro_batch_size
    return range(start, start + micro_batch_size)


def describe_non_finite(iteration: int, place: Optional[Place], samples: Optional[range], vp_size: int) -> str:
    """The one line naming where a non-finite loss or gradient first appeared."""
    if place is None:
        return (
            f"non-finite gradient at iteration {iteration}: every forward value was finite, so it first "
            f"appeared in the backward pass"
        )
    chunk = f", model chunk {place.chunk}" if vp_size > 1 else ""
    return (
        f"non-finite loss/gradient at iteration {iteration}: it first appeared in the forward pass of "
        f"pipeline stage {place.pp_rank}{chunk} (tensor-parallel rank {place.tp_rank}, data-parallel rank "
        f"{place.dp_rank}, micro-batch {place.microbatch}), on training samples "
        f"{samples.start}-{samples.stop - 1}"
    )


def parse_fault(text: str) -> Optional[tuple[str, int, int, int]]:
    """A test hook's fault ``KIND:ITERATION:RANK[:MICROBATCH]`` -> (kind, iteration, rank, micro).

    Kinds: ``nan`` (multiply the forward output of that micro-batch by NaN), ``kill`` (SIGKILL
    this rank at the start of that iteration, first attempt only), ``term`` (SIGTERM it there),
    ``savekill`` (SIGKILL it inside the background write of that iteration's ``--async-save``,
    once its tensor files are written and before the checkpoint is finished), ``swaptrunc``
    (cut the last 12 bytes off that rank's NVMe swap file at the start of that iteration),
    ``paramtrunc`` (the same to its ZeRO-3 parameter swap file).
    Tests set it through the environment (``MEGAZERO_TEST_FAULT``); it is no user setting.
    Raises ValueError for another shape.
    """
    if not text:
        return None
    parts = text.split(":")
    if parts[0] not in ("nan", "kill", "term", "savekill", "swaptrunc", "paramtrunc") or len(parts) not in (3, 4):
        raise ValueError(
            f"MEGAZERO_TEST_FAULT={text!r}: expected KIND:ITERATION:RANK[:MICROBATCH] "
            f"with KIND nan, kill, term, savekill, swaptrunc or paramtrunc"
        )
    nums = [int(x) for x in parts[1:]]
    return parts[0], nums[0], nums[1], nums[2] if len(nums) == 3 else 0


class ForwardWatch:
    """A ``forward_step`` hook: which forward inputs and outputs of this step were finite.

    Call ``begin(iteration, batches)`` before the step's schedule and ``watch(batch, chunk,
    input_tensor, output)`` on every forward (it returns the output, NaN-filled where the test
    fault ``("nan", iteration, rank, microbatch)`` says so). The checks stay on the device
    (no synchronisation) until ``first_place`` is asked, which happens only after a bad step.
    """

    def __init__(self, chunks: list, groups: ProcessGroups, fault: Optional[tuple] = None):
        self.chunks, self.groups, self.fault = chunks, groups, fault
        self.iteration, self._index, self._records = 0, {}, []

    def begin(self, iteration: int, batches: list) -> None:
        self.iteration, self._index, self._records = iteration, {id(b): i for i, b in enumerate(batches)}, []

    def watch(self, batch, chunk, input_tensor: Optional[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        micro = self._index.get(id(batch), 0)
        v = next(i for i, c in enumerate(self.chunks) if c is chunk)
        if (
            self.fault is not None
            and self.fault[0] == "nan"
            and self.fault[1:] == (self.iteration, self.groups.rank, micro)
        ):
            output = output * float("nan")
        ok_in = torch.isfinite(input_tensor).all() if input_tensor is not None else None
        self._records.append((micro, v, ok_in, torch.isfinite(output.detach()).all()))
        return output

    def first_place(self) -> Optional[Place]:
        """The earliest (micro-batch, chunk) of this rank with a finite input and a non-finite output."""
        for micro, v, ok_in, ok_out in sorted(self._records, key=lambda r: (r[0], r[1])):
            if (ok_in is None or bool(ok_in)) and not bool(ok_out):
                g = self.groups
                return Place(micro, g.pp_rank, v, g.tp_rank, g.dp_rank)
        return None


# -- named culprits ---------------------------------------------------------------------------
class Trail:
    """A ring buffer of this rank's last ``size`` communication phases: (iteration, phase, time).

    The trainer enters a phase before each collective region of a step (pipeline schedule with
    its p2p, optimizer step with the gradient reduction, the loss/stop all-reduce, checkpoint),
    so when a collective fails the last entry is the operation this rank was waiting in.
    """

    def __init__(self, size: int = 16):
        from collections import deque

        self.entries = deque(maxlen=size)

    def enter(self, iteration: int, phase: str) -> None:
        self.entries.append((iteration, phase, time.time()))

    @property
    def last(self) -> tuple:
        return self.entries[-1] if self.entries else (0, "start-up (process groups, model, checkpoint)", time.time())


def write_failure(run_dir: str, rank: int, trail: Trail, error: BaseException) -> str:
    """Write ``<run_dir>/failures/rank_<rank>.json`` and return the one line this rank prints.

    The report holds the phase trail, the error's first line, ``operation`` (the last entry of
    ``collectives.recent`` in words: the last collective or send/receive this rank enqueued,
    which under gloo, whose ``Work.wait`` blocks, is the one it was waiting in, but under NCCL
    may be a later one queued behind it; the flight recorder's dumps tell which one hung) and
    ``ops``, the whole ring buffer (op, ranks, seq, shape, dtype per entry).
    """
    it, phase, _ = trail.last
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    ops = list(C.recent)
    op = C.describe(ops[-1]) if ops else "no recorded operation"
    os.makedirs(os.path.join(run_dir, "failures"), exist_ok=True)
    path = os.path.join(run_dir, "failures", f"rank_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(
            dict(
                rank=rank,
                iteration=it,
                phase=phase,
                operation=op,
                error=first,
                trail=[dict(iteration=i, phase=p, time=t) for i, p, t in trail.entries],
                ops=[dict(op=o, ranks=list(r), seq=q, shape=list(sh), dtype=d) for o, r, q, sh, d in ops],
            ),
            f,
        )
    os.replace(path + ".tmp", path)
    return f"megazero: rank {rank}: a collective failed in {phase} at iteration {it}, waiting in {op}: {first}"


_ENTRY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank.*?exitcode\s*:\s*(-?\d+).*?traceback\s*:\s*([^\n]*)", re.S)


def torchrun_failures(text: str) -> dict[int, str]:
    """Global rank -> how it ended, from torchrun's failure summary (its ``rank : R (local_rank:
    ...)``, ``exitcode : X (pid: ...)`` and ``traceback : Signal N (SIGX) ...`` lines), e.g.
    ``"signal 9 (SIGKILL), exit code -9"`` or ``"exit code 1"``; the root cause comes first.
    Empty when ``text`` holds no summary."""
    out: dict[int, str] = {}
    root = text.rfind("Root Cause")
    for chunk in (text[root:], text) if root >= 0 else ():
        for rank, code, tb in _ENTRY.findall(chunk):
            sig = re.match(r"Signal (\d+) \((SIG\w+)\)", tb.strip())
            out.setdefault(int(rank), (f"signal {sig[1]} ({sig[2]}), " if sig else "") + f"exit code {code}")
    return out


def name_culprits(run_dir: str, world_size: int) -> Optional[str]:
    """The launcher's lines after a failed run: the rank that failed first and what the others
    waited in, then what NCCL's flight recorder saw; None when neither the failure reports,
    torchrun's summary nor a flight-recorder dump say anything.

    The first to fail are the ranks that wrote no report (killed, stopped or hung), each with its
    exit code or signal from torchrun's summary (``<run_dir>/torchrun.log``) when it is listed
    there; when every rank reported, torchrun's root cause. The others' operation (the last one
    they enqueued), phase and iteration come from their reports. Under NCCL the watchdog ends a
    timed-out rank before it can write a report; its dump (``<run_dir>/nccl_trace/rank_R``,
    ``flight_recorder.describe_dumps``) names the ranks that never enqueued a collective the
    others of its group did, and each rank's last completed and started collective.
    """
    ours = _culprits_from_reports(run_dir, world_size)
    dumps = flight_recorder.describe_dumps(os.path.join(run_dir, flight_recorder.DUMP_DIR))
    lines = [x for x in (ours, dumps and f"[megazero] {dumps}") if x]
    return "\n".join(lines) or None


def _culprits_from_reports(run_dir: str, world_size: int) -> Optional[str]:
    """``name_culprits``' first line: from megazero's failure reports and torchrun's summary."""
    d = os.path.join(run_dir, "failures")
    reports = (
        [json.load(open(os.path.join(d, n))) for n in sorted(os.listdir(d)) if n.endswith(".json")]
        if os.path.isdir(d)
        else []
    )
    log = os.path.join(run_dir, "torchrun.log")
    ended = torchrun_failures(open(log, errors="replace").read()) if os.path.isfile(log) else {}
    silent = sorted(set(range(world_size)) - {r["rank"] for r in reports}) if reports else []
    if silent:
        unknown = [r for r in silent if r not in ended]
        first = "; ".join(
            [f"rank {r} failed first ({ended[r]}, from torchrun's report)" for r in silent if r in ended]
            + [f"rank(s) {', '.join(map(str, unknown))} failed first (no report: killed, stopped or hung)"]
            * bool(unknown)
        )
    elif ended:
        r = next(iter(ended))
        first = f"rank {r} failed first ({ended[r]}, from torchrun's report)"
    elif reports:
        first = "every rank reported a failed collective"
    else:
        return None
    if not reports:
        return f"[megazero] {first}"
    waited = sorted({(r["iteration"], r.get("operation", "?"), r["phase"]) for r in reports})
    where = "; ".join(f"{o} during {p} at iteration {i}" for i, o, p in waited)
    return f"[megazero] {first}; the others waited in {where} (reports: {d})"
