"""PyTorch's NCCL flight recorder: where each rank's collectives stood when a run hung.

Under NCCL a collective that never finishes is found by ProcessGroupNCCL's watchdog thread,
which ends the process itself (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, default 3: tear down) before
Python sees an exception, so megazero's own failure reports (``resilience.write_failure``) are
not written. And ``Work.wait()`` does not block the host under NCCL (it only orders the
current stream after the collective), so ``collectives.recent``, the Python ring buffer, holds
the order in which operations were *enqueued*: its last entry is the last one queued, not the
one that hung. The flight recorder is torch's C++ ring buffer of every collective with its
state as the watchdog saw it on the GPU (``scheduled``, ``started``, ``completed``); with the
variables of ``env`` the watchdog writes it to a file on a timeout, and tells the other ranks
through the store to write theirs (PyTorch docs, "Flight Recorder for Debugging Stuck Jobs").

Variables (torch's names, read when a ProcessGroupNCCL is created, so set before
``init_process_group``; torch >= 2.7 also reads them as ``TORCH_FR_BUFFER_SIZE`` and
``TORCH_FR_DUMP_TEMP_FILE``, a value set under either name is kept):

- ``TORCH_NCCL_TRACE_BUFFER_SIZE``: entries kept (0, torch's default, records nothing);
- ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: write the buffer on a watchdog timeout or NCCL error;
- ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``: file prefix; global rank R writes ``<prefix>R``;
- ``TORCH_NCCL_ENABLE_TIMING=1``: a start event per collective, without which no entry is ever
  ``started`` (the watchdog then sees only scheduled and completed).

Dump format (a pickled dict, ``version`` "2.x", as ``FlightRecorder::dump`` writes it and
``torch._C._distributed_c10d._dump_fr_trace()`` returns it; read by torch's own analyser in
``torch/distributed/flight_recorder/components/loader.py``): ``pg_config`` (group name ->
``name``, ``desc``, ``ranks`` as a string ``"[0, 1]"``), ``pg_status`` (group name ->
``last_enqueued_collective``, ``last_started_collective``, ``last_completed_collective``:
sequence numbers, -1 for none) and ``entries``, oldest first, each with ``process_group``
(name, desc), ``collective_seq_id``, ``p2p_seq_id``, ``is_p2p``, ``profiling_name`` (e.g.
``"nccl:all_reduce"``), ``input_sizes``, ``input_dtypes``, ``state``, ``time_created_ns`` and more.
"""

from __future__ import annotations

import os
import pickle
from typing import Mapping, MutableMapping, Optional

#: the dump folder inside the run directory, and the file prefix (rank R writes ``rank_R``)
DUMP_DIR, PREFIX = "nccl_trace", "rank_"
#: entries per rank: the collectives and p2p operations of several steps of a large pipeline
BUFFER_SIZE = 2000
#: variable -> the other name torch reads it under (either set keeps the user's value)
_ALIASES = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "TORCH_FR_DUMP_TEMP_FILE",
}


def env(run_dir: str) -> dict[str, str]:
    """The variables that make every rank's NCCL watchdog dump its flight recorder into
    ``<run_dir>/nccl_trace/rank_<R>`` on a timeout."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(BUFFER_SIZE),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(os.path.abspath(run_dir), DUMP_DIR, PREFIX),
        "TORCH_NCCL_ENABLE_TIMING": "1",
    }


def enable(run_dir: str, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set in ``environ`` each variable of ``env`` the user has not set (under either name) and
    create the dump folder (torch writes no folders); returns the variables set."""
    os.makedirs(os.path.join(run_dir, DUMP_DIR), exist_ok=True)
    added = {k: v for k, v in env(run_dir).items() if k not in environ and _ALIASES.get(k, k) not in environ}
    environ.update(added)
    return added


def read_dumps(folder: str) -> dict[int, dict]:
    """Global rank -> its unpickled dump, for every ``rank_<R>`` file in ``folder`` (empty when
    there is none). A file that does not unpickle to a dict with ``entries`` (cut short by the
    kill that followed it) is skipped."""
    dumps: dict[int, dict] = {}
    if not os.path.isdir(folder):
        return dumps
    for name in sorted(os.listdir(folder)):
        if not (name.startswith(PREFIX) and name[len(PREFIX) :].isdigit()):
            continue
        try:
            with open(os.path.join(folder, name), "rb") as f:
                dump = pickle.load(f)  # written by this run's own ranks
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError):
            continue
        if isinstance(dump, dict) and isinstance(dump.get("entries"), list):
            dumps[int(name[len(PREFIX) :])] = dump
    return dumps


def entry_group(entry: Mapping) -> str:
    name, desc = (list(entry.get("process_group") or ("?", "undefined")) + ["undefined"])[:2]
    return f"{desc} (group {name})" if desc not in ("undefined", "") else f"group {name}"


def _describe(entry: Mapping) -> str:
    """``all_reduce #58 of dp (group 3), sizes [[5]] Float``."""
    op = str(entry.get("profiling_name", "?")).split(":")[-1]
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    dtypes = ",".join(entry.get("input_dtypes") or [])
    return f"{op} #{seq} of {entry_group(entry)}, sizes {entry.get('input_sizes')} {dtypes}".rstrip()


def last_by_state(dump: Mapping) -> dict[str, Optional[dict]]:
    """The newest entry of one rank's dump in each state: ``completed``, ``started`` (running on
    the GPU, not completed) and ``scheduled`` (queued, not started)."""
    out: dict[str, Optional[dict]] = {"completed": None, "started": None, "scheduled": None}
    for e in dump["entries"]:
        if e.get("state") in out:
            out[e["state"]] = e
    return out


def behind(dumps: Mapping[int, Mapping]) -> list[str]:
    """Ranks that never enqueued a collective the others of its group did: per group (the keys
    of ``pg_status``, each group's ``pg_id``, the same on every rank since every rank creates
    every group in one order), the ranks whose ``last_enqueued_collective`` is below the
    group's highest, in words. Such a rank was elsewhere, usually the culprit of the hang."""
    enqueued: dict[str, dict[int, int]] = {}
    words: dict[str, str] = {}
    for rank, dump in dumps.items():
        words.update({str(e.get("pg_id")): entry_group(e) for e in dump["entries"]})
        for pg_id, status in (dump.get("pg_status") or {}).items():
            enqueued.setdefault(pg_id, {})[rank] = int(status.get("last_enqueued_collective", -1))
    lines = []
    for pg_id, seqs in sorted(enqueued.items()):
        top = max(seqs.values())
        late = sorted(r for r, q in seqs.items() if q < top)
        if late and top > 0:
            ranks = ", ".join(f"{r} (at #{seqs[r]})" for r in late)
            lines.append(f"rank(s) {ranks} never enqueued collective #{top} of {words.get(pg_id, 'group id ' + pg_id)}")
    return lines


def describe_dumps(folder: str) -> Optional[str]:
    """One line from the dumps in ``folder``: the ranks that fell behind (``behind``), then per
    rank its last completed collective and the newest one it had started (or only queued) and
    not completed. None without dumps."""
    dumps = read_dumps(folder)
    if not dumps:
        return None
    per_rank = []
    for rank, dump in sorted(dumps.items()):
        last = last_by_state(dump)
        line = f"rank {rank}: last completed {_describe(last['completed']) if last['completed'] else 'none'}"
        if last["started"] is not None:
            line += f"; started, not completed: {_describe(last['started'])}"
        elif last["scheduled"] is not None:
            line += f"; queued, not started: {_describe(last['scheduled'])}"
        per_rank.append(line)
    return f"NCCL flight recorder ({folder}): " + "; ".join(behind(dumps) + per_rank)
