"""ProcessGroups: the tp / dp / pp / model-parallel / embedding groups of one rank, built once.

Every module that communicates takes this object (or the one group it needs) as an argument;
there is no global registry. ``ProcessGroups.single()`` describes a one-process run with no
torch.distributed at all: every group is ``None`` and every collective in
``megazero.collectives`` is a no-op on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megazero.topology import Coord, Topology

Group = Optional[dist.ProcessGroup]


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's place in the 3D grid and its communication groups.

    Fields ``tp``, ``dp``, ``pp``, ``mp``, ``embedding`` are process groups (``None`` in a
    single-process run). ``world`` is the default group (``None`` without distributed).
    """

    topology: Topology
    rank: int
    tp: Group = None
    dp: Group = None
    pp: Group = None
    mp: Group = None
    embedding: Group = None
    world: Group = None

    @staticmethod
    def single() -> "ProcessGroups":
        """A one-rank layout that needs no ``torch.distributed`` initialisation."""
        return ProcessGroups(topology=Topology(1, 1, 1), rank=0)

    @staticmethod
    def build(topology: Topology, timeout_s: float = 300.0) -> "ProcessGroups":
        """Create every group of ``topology`` (collective: all ranks must call it).

        Requires ``torch.distributed`` to be initialised with ``world_size ==
        topology.world_size``. Raises ValueError naming both numbers otherwise.
        """
        if not dist.is_initialized():
            if topology.world_size == 1:
                return ProcessGroups.single()
            raise ValueError("torch.distributed is not initialised but tp*pp*dp > 1")
        world = dist.get_world_size()
        if world != topology.world_size:
            raise ValueError(
                f"world size {world} != tp*pp*dp = {topology.tp}*{topology.pp}*{topology.dp}"
                f" = {topology.world_size}; launch tp*pp*dp processes")
        rank = dist.get_rank()
        timeout = timedelta(seconds=timeout_s)
        mine = {}
        # new_group is collective over the world: every rank creates every group, same order.
        for kind, groups in (("tp", topology.tp_groups()), ("dp", topology.dp_groups()),
                             ("pp", topology.pp_groups()), ("mp", topology.mp_groups()),
                             ("embedding", topology.embedding_groups())):
            for ranks in groups:
                g = dist.new_group(ranks=ranks, timeout=timeout)
                if rank in ranks:
                    mine[kind] = g
        return ProcessGroups(topology=topology, rank=rank, world=dist.group.WORLD, **mine)

    # -- coordinates ---------------------------------------------------------------------
    @property
    def coord(self) -> Coord:
        return self.topology.coord(self.rank)

    @property
    def tp_size(self) -> int:
        return self.topology.tp

    @property
    def dp_size(self) -> int:
        return self.topology.dp

    @property
    def pp_size(self) -> int:
        return self.topology.pp

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_stage_rank(self) -> Optional[int]:
        """Global rank of the next pipeline stage (same tp, dp), ``None`` on the last stage."""
        if self.is_last_stage:
            return None
        c = self.coord
        return self.topology.rank(c.tp, c.dp, c.pp + 1)

    @property
    def prev_stage_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage, ``None`` on the first stage."""
        if self.is_first_stage:
            return None
        c = self.coord
        return self.topology.rank(c.tp, c.dp, c.pp - 1)

    def describe(self) -> str:
        """One line for the start-up log, e.g. ``rank 5: tp 1/2 dp 0/2 pp 1/2``."""
        c = self.coord
        return (f"rank {self.rank}: tp {c.tp}/{self.tp_size} dp {c.dp}/{self.dp_size} "
                f"pp {c.pp}/{self.pp_size}")
