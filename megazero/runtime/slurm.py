"""The launcher's multi-node flags from SLURM's environment (used by scripts/pretrain_gpt.slurm).

``python -m megazero.runtime.slurm`` prints, one per line, ``--nnodes N --node-rank R --master-addr A
--rdzv-id J`` for the node it runs on: the master address is the first host of
``SLURM_JOB_NODELIST`` (SLURM's compressed host list, e.g. ``node[01-03]``, ``a,b,c``,
``gpu-[1,3-4]``, ``rack[1-2]-n[1-2]``; expanded as ``scontrol show hostnames`` does, zero
padding kept), the node rank is ``SLURM_NODEID`` and the node count ``SLURM_JOB_NUM_NODES``
(or ``SLURM_NNODES``, else the list's length). Standard library only; no process starts.
"""

from __future__ import annotations

import re
import sys
from typing import Mapping


class SlurmError(ValueError):
    """A SLURM variable that is missing or cannot be read."""


def _expand_range(body: str) -> list[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]`` (the width of the first bound is kept)."""
    out = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise SlurmError(f"cannot read the range [{body}] of a SLURM node list")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise SlurmError(f"range {part} of a SLURM node list runs backwards")
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return out


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise SlurmError(f"unbalanced brackets in the SLURM node list {text!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise SlurmError(f"unbalanced brackets in the SLURM node list {text!r}")
    return parts + [cur]


def expand_nodelist(text: str) -> list[str]:
    """Host names of a SLURM node list, in order. Raises SlurmError for an unreadable list."""
    hosts = []
    for item in _split_top(text.strip()):
        if not item:
            raise SlurmError(f"empty host name in the SLURM node list {text!r}")
        names = [""]
        for prefix, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if not prefix and not body:
                continue
            names = [n + prefix + x for n in names for x in (_expand_range(body) if body else [""])]
        hosts += names
    return hosts


def launcher_flags(env: Mapping[str, str]) -> list[str]:
    """pretrain_gpt.sh flags for this node from SLURM's variables. Raises SlurmError naming
    a missing or inconsistent variable."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("SLURM_JOB_NODELIST is not set: run this inside a SLURM allocation (sbatch/srun)")
    hosts = expand_nodelist(nodelist)
    nnodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or len(hosts))
    if nnodes != len(hosts):
        raise SlurmError(f"SLURM_JOB_NUM_NODES={nnodes} but SLURM_JOB_NODELIST={nodelist} names {len(hosts)} hosts")
    node = env.get("SLURM_NODEID")
    if node is None or not node.isdigit() or int(node) >= nnodes:
        raise SlurmError(
            f"SLURM_NODEID={node!r} is not a node number below {nnodes}: start one task per node "
            "(srun --ntasks-per-node=1)"
        )
    return [
        "--nnodes",
        str(nnodes),
        "--node-rank",
        node,
        "--master-addr",
        hosts[0],
        "--rdzv-id",
        env.get("SLURM_JOB_ID", "megazero"),
    ]


def main(env: Mapping[str, str]) -> int:
    try:
        print("\n".join(launcher_flags(env)))
    except SlurmError as e:
        print(f"megazero: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import os

    sys.exit(main(os.environ))
