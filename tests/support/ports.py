"""Rendezvous ports for the tests: ``free_port``, ``with_master_port`` and ``lost_its_port``.

scripts/test.sh runs the slow lane as shards, pytest processes side by side (tests/support/shards.py).
Each shard gets its own block of ports in ``MEGAZERO_TEST_PORTS=FIRST-LAST``; the blocks are
disjoint and lie below 20000, that is below the kernel's ephemeral range (32768-60999 on Linux, where
gloo's own listening sockets and every outgoing connection get their ports) and below the 20000-39999
that scripts/pretrain_gpt.sh draws from when it is given no --master-port. So a port one shard hands
out is never one the other shard hands out, and never one the kernel hands anyone: two shards cannot
meet on a rendezvous port, by construction. Within one process the ports go round the block in
turn, each checked free by a bind first, so a port is handed out again only after the whole block
has gone by. Without ``MEGAZERO_TEST_PORTS`` (pytest run by hand, one process) the kernel picks a
free port, as before.

A port can still be taken between the check and the rendezvous store's own bind by a program outside
the test suite; the callers then run once more on a fresh port (``lost_its_port`` recognises the
failure)."""

from __future__ import annotations

import os
import re
import socket

PORTS_ENV = "MEGAZERO_TEST_PORTS"

# the failures of a rendezvous store whose port was taken: torch's TCPStore (EADDRINUSE), Python's
# socket (errno 98) and scripts/pretrain_gpt.sh's own check of --master-port
_LOST = re.compile(r"EADDRINUSE|address already in use|--master-port \d+ is already in use", re.IGNORECASE)

_cursor = {"pid": None, "next": 0}


def port_block(value: str | None = None) -> tuple[int, int] | None:
    """The (first, last) ports of ``MEGAZERO_TEST_PORTS`` (or ``value``), None when unset.

    Raises ValueError with one line naming the variable and the fix when it is not FIRST-LAST
    with 1024 <= FIRST <= LAST <= 65535."""
    value = os.environ.get(PORTS_ENV) if value is None else value
    if not value:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
    first, last = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
    if not 1024 <= first <= last <= 65535:
        raise ValueError(
            f"{PORTS_ENV}={value!r} is not a port block; fix: FIRST-LAST with 1024 <= FIRST <= LAST <= 65535,"
            " e.g. 10000-14999 (or unset it to let the kernel pick)"
        )
    return first, last


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a rendezvous store: the next free one of this process's
    turn round ``MEGAZERO_TEST_PORTS`` when set, else one the kernel picks.

    Raises RuntimeError when every port of the block is busy."""
    block = port_block()
    if block is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    first, last = block
    size = last - first + 1
    if _cursor["pid"] != os.getpid():  # a forked child starts elsewhere in the block than its parent
        _cursor.update(pid=os.getpid(), next=os.getpid() * 7919 % size)
    for _ in range(size):
        port = first + _cursor["next"] % size
        _cursor["next"] = (_cursor["next"] + 1) % size
        if _bindable(port):
            return port
    raise RuntimeError(f"{PORTS_ENV}={first}-{last}: every port of the block is in use; fix: give a larger block")


def with_master_port(args) -> list:
    """``args`` for scripts/pretrain_gpt.sh with ``--master-port`` from ``free_port`` added, unless
    they name one already (a test of the port itself, the nodes of a multi-node launch)."""
    args = [str(a) for a in args]
    return args if "--master-port" in args else [*args, "--master-port", str(free_port())]


def lost_its_port(text: str) -> bool:
    """Whether ``text`` (a rank's traceback, a launch's output) is a rendezvous store that found
    its port taken."""
    return bool(_LOST.search(text))


def launch_with_port(run, args):
    """``run(args)``, a launch of scripts/pretrain_gpt.sh run to its end (a CompletedProcess), with
    ``with_master_port``'s port; when that port was taken before torchrun's store bound it, once more
    on a fresh port. ``args`` that name --master-port themselves run once, as they are."""
    if "--master-port" in args:
        return run(list(args))
    out = run(with_master_port(args))
    if out.returncode != 0 and lost_its_port((out.stdout or "") + (out.stderr or "")):
        out = run(with_master_port(args))
    return out
