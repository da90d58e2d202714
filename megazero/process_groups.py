"""ProcessGroups: this rank's place in the layout and one process group per row of the topology's table.

Every module that communicates takes this object (or the one group it needs) as an argument;
there is no global registry. The fields are generated from ``megazero.topology.GROUP_TABLE``:
``topology`` and ``rank``, then one group per row (``tp``, ``dp``, ``pp``, ``mp``, ``cp``,
``dp_cp``, ``embedding``, ``ep``, ``edp``, ``zero_shard``, ``zero_replica``,
``expert_zero_shard``), then ``world``; a
new row is a new field with no code here. ``ProcessGroups.single()`` describes a one-process run
with no torch.distributed at all: every group is ``None`` and every collective in
``megazero.collectives`` is a no-op on it. ``replicas()`` is the view the data-parallel
machinery (gradient reduction, ZeRO, the optimizer, checkpoint shards) takes: cp folded into
dp, its ``dp`` the ``dp_cp`` group. With expert parallelism (``topology.ep > 1``) ``ep`` is the
group the MoE layers dispatch tokens over and ``edp`` the group expert parameters are reduced
and sharded over; with expert tensor parallelism (etp < tp) ``edp`` also folds in the tp / etp
ranks holding the same expert partition. With hybrid sharding (``topology.hybrid``) ZeRO shards over
``zero_shard_group`` (``zero_shard``, S ranks) and all-reduces the shards over
``zero_replica``; flat, ``zero_shard_group`` is ``dp``. Both together, expert parameters shard
over ``expert_zero_shard`` (the S / EP edp ranks inside one shard group; ``edp`` when flat) and
all-reduce over the same ``zero_replica``.
"""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megazero.topology import GROUP_TABLE, ROWS, Coord, Topology

Group = Optional[dist.ProcessGroup]


class _Methods:
    """What ``ProcessGroups`` computes from its fields (the fields are generated below)."""

    @classmethod
    def single(cls) -> "ProcessGroups":
        """A one-rank layout that needs no ``torch.distributed`` initialisation."""
        return cls(topology=Topology(1, 1, 1), rank=0)

    @classmethod
    def build(cls, topology: Topology, timeout_s: float = 300.0) -> "ProcessGroups":
        """Create every group of ``topology`` (collective: all ranks must call it).

        One pass over ``GROUP_TABLE``: each built row's groups are created in the table's
        order on every rank; a row not built (its ``when`` false) gets its ``otherwise`` row's
        group or None. Requires ``torch.distributed`` to be initialised with ``world_size ==
        topology.world_size``. Raises ValueError naming both numbers otherwise.
        """
        if not dist.is_initialized():
            if topology.world_size == 1:
                return cls.single()
            raise ValueError(f"torch.distributed is not initialised but {_product(topology)} > 1")
        world = dist.get_world_size()
        if world != topology.world_size:
            raise ValueError(
                f"world size {world} != {_product(topology)} = "
                f"{'*'.join(str(d.size) for d in topology.dims)} = {topology.world_size}; "
                f"launch {_product(topology)} processes"
            )
        rank = dist.get_rank()
        timeout = timedelta(seconds=timeout_s)
        mine, made = {}, {}
        # new_group is collective over the world: every rank creates every group, same order;
        # a member list already made (dp_cp at cp 1) is not made twice. The group's kind is its
        # description, which NCCL's flight-recorder dumps show (megazero/runtime/flight_recorder.py).
        named = "group_desc" in inspect.signature(dist.new_group).parameters
        for row in filter(topology.builds, GROUP_TABLE):
            for ranks in topology.row_groups(row):
                if tuple(ranks) not in made:
                    made[tuple(ranks)] = dist.new_group(
                        ranks=ranks, timeout=timeout, **({"group_desc": row.name} if named else {})
                    )
                if rank in ranks:
                    mine[row.name] = made[tuple(ranks)]
        for row in GROUP_TABLE:
            if not topology.builds(row) and row.otherwise is not None:
                mine[row.name] = mine.get(row.otherwise)
        return cls(topology=topology, rank=rank, world=dist.group.WORLD, **mine)

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
        """The same rank with the replica dimensions folded into dp (``Topology.replica_topology``):
        ``dp`` is the ``dp_cp`` group, ``dp_size`` is dp x cp, ``dp_rank`` is ``cp_rank + cp *
        dp_rank``. Gradients are reduced and ZeRO shards over it; when every folded dimension has
        size 1 it is ``self``. The folded dimensions are the ``dp_cp`` row's (``GROUP_TABLE``) other
        than dp, so a dimension whose ranks hold replicas joins by widening that row."""
        folded = [d for d in ROWS["dp_cp"].over if d != "dp"]
        if all(self.topology.size(d) == 1 for d in folded):
            return self
        return dataclasses.replace(
            self, topology=self.topology.replica_topology(), dp=self.dp_cp, **dict.fromkeys(folded)
        )

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
        """Expert-data-parallel size: (tp / etp) x dp x cp / ep (dp x cp / ep at etp = tp)."""
        folded = self.tp_size // self.topology.etp
        return folded * self.topology.size("dp") * self.cp_size // self.topology.ep

    @property
    def etp_size(self) -> int:
        """Expert-tensor-parallel size: the tp ranks each expert is sliced over (tp by default)."""
        return self.topology.etp

    @property
    def etp_rank(self) -> int:
        """This rank's partition of every expert: ``tp_rank % etp``."""
        return self.topology.etp_rank(self.rank)

    @property
    def experts_apart(self) -> bool:
        """Expert parameters reduce and shard over ``edp`` (EP > 1 or etp < tp), not ``dp``."""
        return self.topology.experts_apart

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

    def tensor_parallel_only(self) -> "ProcessGroups":
        """The same rank as one tp rank of a whole model: every tp group runs its own copy
        (a model beside the trained one, e.g. ``--reward rm:DIR``'s reward model). The same
        ``tp`` group (tp is innermost, so its members are those of ``Topology(tp, dp=world /
        tp)``'s tp group), ``mp`` = ``tp`` and ``world``; pipeline, context and expert parallel
        size 1, so the copy neither sends between stages nor splits the sequence; every other
        group None (the copies never communicate with each other). ``self`` at tp = world."""
        if self.tp_size == self.world_size:
            return self
        keep = ("topology", "rank", "tp", "world")
        others = {f.name: None for f in dataclasses.fields(self) if f.name not in keep}
        topology = Topology(tp=self.tp_size, dp=self.world_size // self.tp_size)
        return dataclasses.replace(self, topology=topology, **{**others, "mp": self.tp})

    def describe(self) -> str:
        """One line for the start-up log, e.g. ``rank 5: tp 1/2 dp 0/2 pp 1/2``."""
        c = self.coord
        return f"rank {self.rank}: " + " ".join(
            f"{d.name} {c[d.name]}/{d.size}" for d in self.topology.dims if d.size > 1 or d.name in ("tp", "dp", "pp")
        )


_DOC = f"""This rank's place in the layout and its communication groups (frozen).

Fields: ``topology`` (Topology), ``rank`` (global rank), one process group per row of
``GROUP_TABLE`` ({", ".join(row.name for row in GROUP_TABLE)}) and ``world``, the
default group. A group is ``None`` in a single-process run, for a group this rank is not in
(``embedding`` on a middle stage) and for a row the layout does not build (``ep``,
``zero_shard``, ``zero_replica`` without expert parallelism / hybrid sharding; ``edp`` is then
``dp_cp`` at EP 1 and etp = tp, ``expert_zero_shard`` is ``edp`` unless both are on). Two rows
with the same members share one group (``dp_cp`` is ``dp`` when cp == 1).
"""

ProcessGroups = dataclasses.make_dataclass(
    "ProcessGroups",
    [
        ("topology", Topology),
        ("rank", int),
        *((row.name, Group, dataclasses.field(default=None)) for row in GROUP_TABLE),
        ("world", Group, dataclasses.field(default=None)),
    ],
    bases=(_Methods,),
    frozen=True,
    namespace={"__module__": __name__, "__doc__": _DOC},
)


def _product(topology: Topology) -> str:
    """``"tp*dp*pp"``: the dimensions whose product is the world size (cp where > 1)."""
    return "*".join(d.name for d in topology.dims if d.size > 1 or d.name != "cp")
