"""Run a function on N gloo ranks on CPU (loopback) and collect what each rank returns.

``run_distributed(fn, world_size, *args)`` forks ``world_size`` processes; each initialises
``torch.distributed`` with the gloo backend on 127.0.0.1, calls ``fn(rank, world_size,
*args, **kwargs)`` and sends back its return value (which must pickle). The first rank to
fail makes the call raise ``RankError`` carrying that rank's traceback; the others are
killed. A run longer than ``timeout_s`` seconds raises ``TimeoutError`` (no hang). With
``MEGAZERO_TEST_DEFERRED_COLLECTIVES=1`` in the environment the ranks run with NCCL's completion
order (asynchronous collectives land only at ``wait()``: tests/support/deferred.py).

fork is used instead of spawn: starting 8 ranks then costs no re-import of torch, which is
most of the start-up time on a 2-core machine.

``forked_train_main(args, run_dir)`` forks the ranks of a whole ``training.main`` run (torchrun's
variables, no launcher) in the background, for the reference runs launched ones are compared with.

The rendezvous port comes from ``tests.support.ports.free_port`` (this shard's own block of ports
under scripts/test.sh); a run whose rank 0 finds it taken when its store binds runs once more on a
fresh one.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from tests.support.ports import free_port, lost_its_port


class RankError(RuntimeError):
    """An exception raised inside a spawned rank; the message holds its traceback."""


class _PortTaken(Exception):
    """Rank 0's rendezvous store found its port taken: nothing ran yet, the run may start again."""


def _child(fn, rank, world_size, port, results, collective_timeout_s, args, kwargs):
    import torch
    import torch.distributed as dist

    from tests.support.deferred import install_from_env

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
        )
    except BaseException:  # the rendezvous itself failed (a taken port is retried by the parent)
        results.put((rank, False, "init:" + traceback.format_exc()))
        return
    try:
        with contextlib.ExitStack() as stack:
            install_from_env(stack)  # MEGAZERO_TEST_DEFERRED_COLLECTIVES=1: NCCL's completion order
            out = fn(rank, world_size, *args, **kwargs)
        dist.barrier()  # nobody tears down connections a peer is still reading from
        # plain pickle: tensors travel by value, not as shared-memory handles that die with the rank
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(
    fn, world_size: int, *args, timeout_s: float = 180.0, collective_timeout_s: float = 60.0, **kwargs
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the list of per-rank return values, indexed by rank.
    Raises RankError (first failing rank's traceback) or TimeoutError after ``timeout_s``. A run
    whose rendezvous port was taken before rank 0's store bound it runs once more on a fresh port.
    """
    try:
        return _run_once(fn, world_size, args, kwargs, timeout_s, collective_timeout_s, retry=True)
    except _PortTaken:
        return _run_once(fn, world_size, args, kwargs, timeout_s, collective_timeout_s, retry=False)


def _run_once(fn, world_size: int, args, kwargs, timeout_s: float, collective_timeout_s: float, retry: bool) -> list:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child, daemon=True, args=(fn, r, world_size, port, results, collective_timeout_s, args, kwargs)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"run_distributed: ranks {sorted(set(range(world_size)) - set(out))}"
                    f" did not finish within {timeout_s:.0f} s"
                )
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None) and r not in out
                ]
                if dead:
                    raise RankError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if not ok and value.startswith("init:"):
                value = value[len("init:") :]
                if retry and lost_its_port(value):
                    raise _PortTaken(port)
            if not ok:
                raise RankError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


def _train_main_rank(args, rank: int, world: int, port: int, log: str, env: dict) -> None:
    """One rank of ``forked_train_main``: torchrun's variables (and ``env``), one thread, ``training.main``."""
    import torch

    from megazero import training
    from tests.support.deferred import install_from_env

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # Python-level streams onto the log too: under pytest they are its capture objects
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        MEGAZERO_RANKS_PER_NODE=str(world),
        MEGAZERO_PREFLIGHT_DONE="1",
        OMP_NUM_THREADS="1",
        **env,
    )
    torch.set_num_threads(1)
    code = 1
    try:
        with contextlib.ExitStack() as stack:
            install_from_env(stack)
            code = training.main(list(args))
    except BaseException:  # the traceback goes to the log, the status to the parent
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@contextlib.contextmanager
def forked_train_main(args, run_dir, env=None):
    """A run of ``training.main(args + ["--run-dir", run_dir])`` on forked ranks, in the background:
    what torchrun's ranks run, with torchrun's variables and one thread each (OMP_NUM_THREADS=1;
    a launch compared bit for bit with it needs the same), world size from --tp/--cp/--pp/--dp.
    For the reference runs that launched ones are compared with: a launch through
    scripts/pretrain_gpt.sh imports torch in its preflight, in torchrun and in every rank (some
    4 CPU-s each), a forked rank inherits the imports. Yields a function that waits for the ranks
    (``timeout`` seconds) and asserts they exited 0; their output goes to RUN_DIR/ranks.log. The
    ranks still alive on the way out are killed. A rank 0 that finds the rendezvous port taken starts
    the run once more on a fresh port (the log restarts). ``env``: more variables for the ranks (a test
    hook's ``MEGAZERO_TEST_FAULT``). A run that is not about the launcher (a resume, a fault
    inside training.main) runs this way instead of a launch."""
    size = {f: int(args[args.index(f) + 1]) if f in args else 1 for f in ("--tp", "--cp", "--pp", "--dp")}
    world = size["--tp"] * size["--cp"] * size["--pp"] * size["--dp"]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    log = Path(run_dir) / "ranks.log"
    argv = list(args) + ["--run-dir", str(run_dir)]
    procs = _fork_ranks(argv, world, str(log), dict(env or {}))

    def finished(timeout: float = 600):
        deadline, retried = time.monotonic() + timeout, False
        while time.monotonic() < deadline:
            failed = any(proc.exitcode not in (0, None) for proc in procs)
            if failed and not retried and log.exists() and lost_its_port(log.read_text(errors="replace")):
                _kill(procs)
                log.unlink()
                procs[:], retried = _fork_ranks(argv, world, str(log), dict(env or {})), True
            elif not any(proc.is_alive() for proc in procs):
                break
            time.sleep(0.2)
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        codes = [proc.exitcode for proc in procs]
        assert codes == [0] * world, f"forked training.main: exit codes {codes}: " + log.read_text()[-3000:]

    try:
        yield finished
    finally:
        _kill(procs)


def _fork_ranks(argv, world: int, log: str, env: dict) -> list:
    """``world`` forked ranks of ``training.main(argv)`` on a fresh rendezvous port, started."""
    port, ctx = free_port(), mp.get_context("fork")
    procs = [ctx.Process(target=_train_main_rank, args=(argv, r, world, port, log, env)) for r in range(world)]
    for proc in procs:
        proc.start()
    return procs


def _kill(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def train_main_forked(args, run_dir, env=None, timeout: float = 600) -> str:
    """``forked_train_main`` run to its end (every rank exits 0, else AssertionError with the
    log's tail); returns the ranks' output (RUN_DIR/ranks.log)."""
    with forked_train_main(args, run_dir, env) as finished:
        finished(timeout)
    return (Path(run_dir) / "ranks.log").read_text()
