"""ProcessGroups: the tp / cp / dp / pp / model-parallel / replica / embedding groups of one rank.

Every module that communicates takes this object (or the one group it needs) as an argument;
there is no global registry. ``ProcessGroups.single()`` describes a one-process run with no
torch.distributed at all: every group is ``None`` and every collective in
``megazero.collectives`` is a no-op on it. ``build`` creates the groups named in
``megazero.topology.GROUPS`` and the embedding group, so each of them is a field here.
``replicas()`` is the view the data-parallel machinery (gradient reduction, ZeRO, the
optimizer, checkpoint shards) takes: cp folded into dp, its ``dp`` the ``dp_cp`` group.
With expert parallelism (``topology.ep > 1``) ``ep`` is the group the MoE layers dispatch
tokens over and ``edp`` the group expert parameters are reduced and sharded over. With hybrid
sharding (``topology.hybrid``) ZeRO shards over ``zero_shard_group`` (``zero_shard``, S ranks) and
all-reduces the shards over ``zero_replica``; flat, ``zero_shard_group`` is ``dp``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megazero.topology import EXPERT_GROUPS, GROUPS, HYBRID_GROUPS, Coord, Topology

Group = Optional[dist.ProcessGroup]


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's place in the layout and its communication groups.

    Fields ``tp``, ``dp``, ``pp``, ``mp``, ``cp``, ``dp_cp`` (one per name in ``GROUPS``) and
    ``embedding`` are process groups (``None`` in a single-process run; ``embedding`` also on a
    middle stage). Two kinds with the same members share one group (``dp_cp`` is ``dp`` when
    cp == 1). ``ep`` and ``edp`` (expert parallel, expert data parallel; megazero/topology.py)
    exist when ``topology.ep > 1``; else ``ep`` is None (the rank alone) and ``edp`` is ``dp_cp``.
    ``zero_shard`` and ``zero_replica`` (hybrid sharding, megazero/topology.py) exist when
    ``topology.hybrid``; else both are None and ZeRO shards over ``dp`` (``zero_shard_group``).
    ``world`` is the default group (``None`` without distributed).
    """

    topology: Topology
    rank: int
    tp: Group = None
    dp: Group = None
    pp: Group = None
    mp: Group = None
    cp: Group = None
    dp_cp: Group = None
    embedding: Group = None
    world: Group = None
    ep: Group = None
    edp: Group = None
    zero_shard: Group = None
    zero_replica: Group = None

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
            raise ValueError(f"torch.distributed is not initialised but {_product(topology)} > 1")
        world = dist.get_world_size()
        if world != topology.world_size:
            raise ValueError(
                f"world size {world} != {_product(topology)} = "
                f"{'*'.join(str(d.size) for d in topology.dims)} = {topology.world_size}; "
                f"launch {_product(topology)} processes")
        rank = dist.get_rank()
        timeout = timedelta(seconds=timeout_s)
        mine, made = {}, {}
        # new_group is collective over the world: every rank creates every group, same order;
        # a member list already made (dp_cp at cp 1) is not made twice. The group's kind is its
        # description, which NCCL's flight-recorder dumps show (megazero/runtime/flight_recorder.py).
        named = "group_desc" in inspect.signature(dist.new_group).parameters
        for kind in (*GROUPS, "embedding", *(EXPERT_GROUPS if topology.ep > 1 else ()),
                     *(HYBRID_GROUPS if topology.hybrid else ())):
            for ranks in topology.named_groups(kind):
                if tuple(ranks) not in made:
                    made[tuple(ranks)] = dist.new_group(ranks=ranks, timeout=timeout,
                                                        **({"group_desc": kind} if named else {}))
                if rank in ranks:
                    mine[kind] = made[tuple(ranks)]
        mine.setdefault("edp", mine["dp_cp"])
        return ProcessGroups(topology=topology, rank=rank, world=dist.group.WORLD, **mine)

    # -- coordinates ---------------------------------------------------------------------
    @property
    def coord(self) -> Coord:
        return self.topology.coord(self.rank)

    @property
    def tp_size(self) -> int:
        return self.topology.size("tp")

    @property
    def dp_size(self) -> int:
        return self.topology.size("dp")

    @property
    def pp_size(self) -> int:
        return self.topology.size("pp")

    @property
    def cp_size(self) -> int:
        """Context-parallel size (1 when the layout has no cp dimension)."""
        return self.topology.size("cp") if "cp" in self.topology.names else 1

    @property
    def cp_rank(self) -> int:
        return self.coord.cp if "cp" in self.topology.names else 0

    @property
    def cp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's cp group in cp-rank order (the ring's members)."""
        if self.cp_size == 1:
            return (self.rank,)
        return tuple(self.topology.group(self.rank, "cp"))

    def replicas(self) -> "ProcessGroups":
        """The same rank with cp folded into dp (``Topology.replica_topology``): ``dp`` is
        the ``dp_cp`` group, ``dp_size`` is dp x cp, ``dp_rank`` is ``cp_rank + cp * dp_rank``.
        Gradients are reduced and ZeRO shards over it; at cp == 1 it is ``self``."""
        if self.cp_size == 1:
            return self
        return ProcessGroups(topology=self.topology.replica_topology(), rank=self.rank,
                             tp=self.tp, dp=self.dp_cp, pp=self.pp, mp=self.mp,
                             cp=None, dp_cp=self.dp_cp, embedding=self.embedding,
                             world=self.world, ep=self.ep, edp=self.edp,
                             zero_shard=self.zero_shard, zero_replica=self.zero_replica)

    @property
    def zero_shard_group(self) -> Group:
        """The group ZeRO shards over: ``zero_shard`` under hybrid sharding, else ``dp``."""
        return self.zero_shard if self.topology.hybrid else self.dp

    @property
    def zero_shard_size(self) -> int:
        """S: ranks one ZeRO shard set is spread over (dp x cp when flat)."""
        return self.topology.zero_shard

    @property
    def zero_replica_rank(self) -> int:
        """Which copy of the sharded ZeRO state this rank holds (0 when flat)."""
        return self.topology.zero_replica_rank(self.rank)

    @property
    def ep_size(self) -> int:
        """Expert-parallel size (1 without expert parallelism)."""
        return self.topology.ep

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank: it holds experts ``[ep_rank E/ep, (ep_rank+1) E/ep)``."""
        return self.topology.ep_rank(self.rank)

    @property
    def edp_size(self) -> int:
        """Expert-data-parallel size: dp x cp / ep."""
        return self.topology.size("dp") * self.cp_size // self.topology.ep

    @property
    def edp_rank(self) -> int:
        return self.topology.edp_rank(self.rank)

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
        """Global rank of the next pipeline stage (same other coordinates), ``None`` on the
        last stage."""
        if self.is_last_stage:
            return None
        return self.topology.rank(**self.coord.replace(pp=self.pp_rank + 1))

    @property
    def prev_stage_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage, ``None`` on the first stage."""
        if self.is_first_stage:
            return None
        return self.topology.rank(**self.coord.replace(pp=self.pp_rank - 1))

    def describe(self) -> str:
        """One line for the start-up log, e.g. ``rank 5: tp 1/2 dp 0/2 pp 1/2``."""
        c = self.coord
        return f"rank {self.rank}: " + " ".join(f"{d.name} {c[d.name]}/{d.size}"
                                                  for d in self.topology.dims
                                                  if d.size > 1 or d.name in ("tp", "dp", "pp"))


def _product(topology: Topology) -> str:
    """``"tp*dp*pp"``: the dimensions whose product is the world size (cp where > 1)."""
    return "*".join(d.name for d in topology.dims if d.size > 1 or d.name != "cp")
