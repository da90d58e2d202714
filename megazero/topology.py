"""Pure rank arithmetic over an ordered list of named parallel dimensions.

A layout is a list of dimensions, innermost first; today ``ORDER = "tp-cp-dp-pp"``. A
rank's index in dimension ``i`` is ``(rank // stride_i) % size_i`` with ``stride_i`` the
product of the sizes before it, and the rank is ``sum(index_i * stride_i)``. For
"tp-cp-dp-pp":

    tp_rank = rank % tp
    cp_rank = (rank // tp) % cp
    dp_rank = (rank // (tp * cp)) % dp
    pp_rank = rank // (tp * cp * dp)

Tensor-parallel ranks are innermost (adjacent global ranks, so one TP group sits on one node
and its all-reduces stay on NVLink), then context-parallel (the ring of K/V blocks, next
closest), then data-parallel, then pipeline stages outermost, as in Megatron-LM (Narayanan
et al. 2021, sec. 3.3; Megatron core's ``RankGenerator`` orders "tp-cp-ep-dp-pp" the same way).
A group over a subset S of the dimensions is the set of ranks that differ from a rank only in S (the idea of torch's
``DeviceMesh``): the TP group is the
group over ``("tp",)``, the model-parallel group the one over ``("tp", "pp")``, the ranks
holding replicas of the same parameters (gradients reduced, ZeRO sharded) the one over
``("dp", "cp")``.

Every group the trainer builds is a row of ``GROUP_TABLE``: a name (the ``ProcessGroups`` field),
a family, the dimensions ``over`` it lives in and a rule that picks this rank's members out of
its group over them (``GroupRow``). Three families, one code path (``Topology.row_group``):

- *dense*: the group over a set of dimensions (``all``), and the embedding group, the first and
  last member along ``pp`` (``ends``: the holders of tied embedding copies);
- *expert*: expert parallelism carved out of the dp x cp replicas by the size ``ep``;
- *hybrid*: hybrid sharding's ZeRO shard group and its replica group, carved by ``zero_shard``,
  and the expert parameters' shard group, carved by ``expert_zero_shard`` inside the ``edp`` group.

A carved row splits the rank's group over ``over`` (or, with ``within``, the rank's group of that
other row; sorted, so a member's position is its index among those ranks) into ``k``-rank
blocks of consecutive positions (``block``: the same ``position // k``) or into the ranks ``k``
positions apart (``stride``: the same ``position % k``). The ``fold`` rule keeps the members that
hold the same partition of the same experts: the same ``tp_rank % etp`` and the same ``ep_rank``
(expert-data parallelism, below). A row with ``when`` is built only when that property of the
topology holds (``ep > 1``, ``hybrid``, ``expert_hybrid``); else its field is the group of its
``otherwise`` row, or None.

A new dimension is data: its name in ``ORDER`` (``Topology(cp=2)`` works, every other size
defaulting to 1) and its groups as rows of ``GROUP_TABLE``; ``ProcessGroups`` gets a field per
row without further code. ``Topology(order=...)`` builds any other order without touching
``ORDER``. Since cp and dp are adjacent, the layout with dp and cp merged into one "dp" of size
``dp * cp`` (index ``cp_rank + cp * dp_rank``) numbers the ranks the same way:
``replica_topology``.

Expert parallelism is no dimension of its own: ``Topology(..., ep=EP)`` carves it out of the
replica ranks, as Megatron-LM's expert rank order "tp-ep-dp-pp" does. With the replica index
``r' = cp_rank + cp * dp_rank`` (``replica_index``, the rank's position in its ``dp_cp`` group),
``ep_rank = r' % EP`` (which E/EP experts the rank holds) and ``edp_rank = r' // EP`` (expert
data parallel: the replicas of those experts); the ``ep`` group is a block of EP replicas, the
``edp`` group the ``dp * cp / EP`` replicas EP apart. At EP = 1 the ep group is the rank alone
and the edp group is ``dp_cp``.

Expert tensor parallelism (Megatron-LM's ``--expert-tensor-parallel-size``, "MoE parallel
folding", Liu et al. 2025, arXiv 2504.14960, sec. 3) slices each expert over ``etp`` of the tp
ranks (``etp`` divides tp; None = tp): ``etp_rank = tp_rank % etp``, so the etp groups are blocks
of etp consecutive tp ranks and the ``tp / etp`` ranks with the same etp rank hold the same
expert partition. Those are folded into the expert-data-parallel group: with etp < tp, ``edp`` is
the ``(tp / etp) x dp x cp / EP`` ranks of the same ``tp_rank % etp`` and ``ep_rank`` (Megatron's
edp = world / (etp x EP x pp)), ordered by ``(r' // EP, tp_rank // etp)``:
``edp_rank = (r' // EP) x tp / etp + tp_rank // etp``. At etp = tp it is the group above.

Hybrid sharding (torchtitan's ``data_parallel_shard_degree``, DeepSpeed's MiCS
``mics_shard_size``, Megatron's distributed-optimizer instances) is the same arithmetic with
``Topology(..., zero_shard=S)`` for EP: ZeRO's state is sharded over a block of S consecutive
replicas (``zero_shard_rank = r' % S``: reduce-scatter, all-gather) and replicated across the
dp x cp / S blocks (``zero_replica_rank = r' // S``: all-reduce of the shards). With
tp-cp-dp-pp and S = GPUs per node / (tp x cp) a shard group is one node. S = dp x cp (the
default) is flat ZeRO: the shard group is ``dp_cp`` and there is no replica group.

Hybrid sharding with expert parallelism (Megatron-LM's partial expert-data-parallel groups of
``--num-distributed-optimizer-instances``): expert state is sharded over the edp ranks inside
one dense shard group, ``S_e = S / EP`` of them (``expert_zero_shard``; S must be a multiple of
EP), and replicated over the same ``dp x cp / S`` replica count as the dense state. With
``e = edp_rank``, ``expert_zero_shard_rank = e % S_e`` and ``expert_zero_replica_rank = e // S_e
= r' // S``: the expert state's replica group IS ``zero_replica`` (the ranks with the same
``r' % S`` share ``ep_rank`` and ``e % S_e``), so it needs no row of its own. Flat (S = dp x cp)
the expert shard group is the edp group.

This module imports no torch.distributed; it is the one place where the order is written.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence, Union

ORDER = "tp-cp-dp-pp"
"""The dimensions of ``Topology(...)``, innermost first, joined by "-"."""

FAMILIES = ("dense", "expert", "hybrid")
"""The families of ``GROUP_TABLE``'s rows (module docstring)."""

RULES = ("all", "ends", "block", "stride", "fold")
"""How a ``GroupRow`` picks members out of a rank's group over its dimensions (module docstring)."""


@dataclass(frozen=True)
class GroupRow:
    """One kind of process group: a row of ``GROUP_TABLE`` and a field of ``ProcessGroups``.

    ``name``: the field (``"dp_cp"``); ``family``: ``"dense"``, ``"expert"`` or ``"hybrid"``;
    ``over``: the dimensions the group lives in (one absent from a layout's order has size 1
    there and is skipped); ``rule``: one of ``RULES``; ``by``: the ``Topology`` attribute whose
    value is the ``k`` of a ``block`` / ``stride`` row (``"ep"``, ``"zero_shard"``); ``when``: a
    boolean ``Topology`` property without which the row is not built (None: always built);
    ``otherwise``: the row whose group stands in when not built (None: the field is None);
    ``within``: carve the block / stride out of the rank's group of this other row instead of
    its group over ``over`` (the expert shard group inside the ``edp`` group).
    """

    name: str
    family: str
    over: tuple[str, ...]
    rule: str = "all"
    by: Optional[str] = None
    when: Optional[str] = None
    otherwise: Optional[str] = None
    within: Optional[str] = None

    def __post_init__(self):
        """Raises ValueError for an unknown family or rule, or ``by`` / ``within`` given to the wrong rule."""
        if self.family not in FAMILIES:
            raise ValueError(f"group row {self.name!r}: family {self.family!r} must be one of {FAMILIES}")
        carved = self.rule in ("block", "stride")
        if self.rule not in RULES or carved != (self.by is not None) or (self.within and not carved):
            raise ValueError(
                f"group row {self.name!r}: rule {self.rule!r} must be one of {RULES}, "
                f"with `by` exactly for block and stride (and `within` only for them)"
            )


GROUP_TABLE: tuple[GroupRow, ...] = (
    #        name            family    over          rule      by            when               otherwise  within
    GroupRow("tp", "dense", ("tp",)),
    GroupRow("dp", "dense", ("dp",)),
    GroupRow("pp", "dense", ("pp",)),
    GroupRow("mp", "dense", ("tp", "pp")),
    GroupRow("cp", "dense", ("cp",)),
    GroupRow("dp_cp", "dense", ("dp", "cp")),
    GroupRow("embedding", "dense", ("pp",), "ends"),
    GroupRow("ep", "expert", ("dp", "cp"), "block", "ep", "expert_parallel"),
    GroupRow("edp", "expert", ("tp", "dp", "cp"), "fold", None, "experts_apart", "dp_cp"),
    GroupRow("zero_shard", "hybrid", ("dp", "cp"), "block", "zero_shard", "hybrid"),
    GroupRow("zero_replica", "hybrid", ("dp", "cp"), "stride", "zero_shard", "hybrid"),
    GroupRow("expert_zero_shard", "hybrid", ("dp", "cp"), "block", "expert_zero_shard", "expert_hybrid", "edp", "edp"),
)
"""Every process group, in the order ``ProcessGroups.build`` creates them (module docstring)."""

ROWS: dict[str, GroupRow] = {row.name: row for row in GROUP_TABLE}

GROUPS: dict[str, tuple[str, ...]] = {r.name: r.over for r in GROUP_TABLE if r.rule == "all"}
"""The groups over a set of dimensions (a view of ``GROUP_TABLE``): name -> dimensions."""

EXPERT_GROUPS = tuple(r.name for r in GROUP_TABLE if r.family == "expert")
"""Groups carved out of the dp x cp replicas by expert parallelism (a view of ``GROUP_TABLE``)."""

HYBRID_GROUPS = tuple(r.name for r in GROUP_TABLE if r.family == "hybrid")
"""Groups of hybrid sharding: ZeRO shards inside ``zero_shard``, replicated over ``zero_replica``."""

Over = Union[str, Sequence[str]]  # "dp", "dp-cp" or ("dp", "cp")


@dataclass(frozen=True)
class Dim:
    """One parallel dimension: its name (``"tp"``) and its size (number of ranks along it)."""

    name: str
    size: int


@dataclass(frozen=True, init=False, repr=False)
class Coord(Mapping):
    """Position of one rank: an index per dimension, innermost first.

    Read by attribute (``c.tp``) or key (``c["tp"]``); ``dict(c)`` and ``topology.rank(**c)``
    work since a Coord is a mapping from dimension name to index.
    """

    index: tuple[tuple[str, int], ...]

    def __init__(self, **index: int):
        object.__setattr__(self, "index", tuple(index.items()))

    def __getattr__(self, name: str) -> int:
        if not name.startswith("_") and name != "index":
            for n, i in self.__dict__.get("index", ()):
                if n == name:
                    return i
        raise AttributeError(f"{type(self).__name__} has no attribute or dimension {name!r}")

    def __getitem__(self, name: str) -> int:
        for n, i in self.index:
            if n == name:
                return i
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (n for n, _ in self.index)

    def __len__(self) -> int:
        return len(self.index)

    def replace(self, **changes: int) -> "Coord":
        """The same position with the given indices changed; ValueError on an unknown name."""
        for name in changes:
            if name not in self:
                raise ValueError(f"unknown dimension {name!r}: {self} has {list(self)}")
        return Coord(**{n: changes.get(n, i) for n, i in self.index})

    def __repr__(self) -> str:
        return "Coord(" + ", ".join(f"{n}={i}" for n, i in self.index) + ")"


@dataclass(frozen=True, init=False, repr=False)
class Topology:
    """A layout of ``world_size = prod(sizes)`` ranks over named dimensions, innermost first,
    the expert-parallel size ``ep`` carved out of the dp x cp replicas and the ZeRO shard size
    ``zero_shard`` (S; None = dp x cp, flat ZeRO) of hybrid sharding (module docstring).

    ``Topology(tp, pp, dp)`` (the positional order of the command line's ``--tp/--pp/--dp``)
    lays them out in ``ORDER``; ``Topology(order="tp-cp-dp-pp", tp=2, cp=2)`` any other
    order, a dimension without a size having size 1. A dimension's size reads as an
    attribute: ``t.tp``, ``t.cp``.

    Raises:
        ValueError: a size below 1 (``--tp must be >= 1, got 0``), a size for a dimension
            the order does not have, an order that repeats a name, or an ``ep`` / ``zero_shard``
            that does not divide dp x cp (naming ``--expert-model-parallel-size`` /
            ``--zero-shard-size``), a ``zero_shard`` that is no multiple of ``ep``, an ``etp``
            that does not divide tp (naming ``--expert-tensor-parallel-size``), or etp < tp with
            hybrid sharding.
    """

    dims: tuple[Dim, ...]
    ep: int = 1
    zero_shard: int = 1
    etp: int = 1

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        *,
        order: str = ORDER,
        ep: int = 1,
        zero_shard: Optional[int] = None,
        etp: Optional[int] = None,
        **sizes: int,
    ):
        names = order.split("-")
        if len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
            raise ValueError(f"order {order!r} must name distinct dimensions, e.g. {ORDER!r}")
        unknown = [n for n in sizes if n not in names]
        unknown += [n for n, s in (("tp", tp), ("pp", pp), ("dp", dp)) if n not in names and s != 1]
        if unknown:
            raise ValueError(f"unknown dimension {unknown[0]!r}: order {order!r} has {names}")
        sizes.update(tp=tp, pp=pp, dp=dp)
        dims = tuple(Dim(n, sizes.get(n, 1)) for n in names)
        for d in dims:
            if d.size < 1:
                raise ValueError(f"--{d.name} must be >= 1, got {d.size}")
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "ep", ep)
        replicas = self._size_or_1("dp") * self._size_or_1("cp")
        if ep < 1 or replicas % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} must be >= 1 and divide dp x cp = {replicas}")
        shard = replicas if zero_shard is None else zero_shard
        if shard < 1 or replicas % shard:
            raise ValueError(f"--zero-shard-size {shard} must be >= 1 and divide dp x cp = {replicas}")
        if shard % ep:
            raise ValueError(
                f"--zero-shard-size {shard} must be a multiple of --expert-model-parallel-size {ep} "
                "(expert state shards over S / EP expert-data-parallel ranks)"
            )
        object.__setattr__(self, "zero_shard", shard)
        tp_size = self._size_or_1("tp")
        etp = tp_size if etp is None else etp
        if etp < 1 or tp_size % etp:
            raise ValueError(f"--expert-tensor-parallel-size {etp} must be >= 1 and divide --tp {tp_size}")
        if etp < tp_size and shard < replicas:
            raise ValueError(
                f"--expert-tensor-parallel-size {etp} below --tp {tp_size} with --zero-shard-size {shard} "
                "is not supported (the folded expert-data-parallel group has no shard groups)"
            )
        object.__setattr__(self, "etp", etp)

    # -- sizes and coordinates -----------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def order(self) -> str:
        """The dimensions innermost first, e.g. ``"tp-cp-dp-pp"``."""
        return "-".join(self.names)

    def size(self, name: str) -> int:
        """Size of dimension ``name``; ValueError naming it when the layout has no such one."""
        return self.dims[self._index_of(name)].size

    def __getattr__(self, name: str) -> int:
        if not name.startswith("_") and name != "dims":
            for d in self.__dict__.get("dims", ()):
                if d.name == name:
                    return d.size
        raise AttributeError(f"{type(self).__name__} has no attribute or dimension {name!r}")

    @property
    def world_size(self) -> int:
        return _prod(d.size for d in self.dims)

    def coord(self, rank: int) -> Coord:
        """Coordinates of global ``rank``. Raises ValueError when rank is outside the world."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return Coord(**{d.name: (rank // s) % d.size for d, s in zip(self.dims, self._strides())})

    def rank(self, *index: int, **named: int) -> int:
        """Global rank at the given coordinates, positional in the order (``rank(tp, dp, pp)``)
        or by name (``rank(tp=1, pp=0)``, ``rank(**coord)``); a dimension not given is 0.
        Library code passes names: positions shift when a dimension joins the order.

        Raises ValueError on an unknown dimension or a coordinate outside the layout.
        """
        if len(index) > len(self.dims):
            raise ValueError(f"{len(index)} coordinates for the {len(self.dims)} dimensions of {self}")
        at = dict(zip(self.names, index))
        for name, i in named.items():
            self._index_of(name)
            if name in at:
                raise ValueError(f"coordinate {name} given twice")
            at[name] = i
        at = {d.name: at.get(d.name, 0) for d in self.dims}
        if not all(0 <= at[d.name] < d.size for d in self.dims):
            where = ", ".join(f"{n}={i}" for n, i in at.items())
            raise ValueError(f"coordinate ({where}) outside {self}")
        return sum(at[d.name] * s for d, s in zip(self.dims, self._strides()))

    # -- groups --------------------------------------------------------------------------
    def group(self, rank: int, over: Over) -> list[int]:
        """The sorted global ranks that differ from ``rank`` only in the dimensions ``over``.

        ``over`` is a name, names joined by "-" or a sequence of names; ValueError on an
        unknown one. Over no dimension the group is ``[rank]``, over all of them the world.
        """
        c, strides = self.coord(rank), self._strides()
        base = rank - sum(c[self.names[i]] * strides[i] for i in self._indices(over))
        return [base + o for o in self._offsets(over)]

    def groups(self, over: Over) -> list[list[int]]:
        """Every group over ``over``: a partition of the world, ordered by lowest member."""
        offsets, seen, out = self._offsets(over), set(), []
        for r in range(self.world_size):
            if r not in seen:  # r is the lowest member of a group not yet listed
                out.append([r + o for o in offsets])
                seen.update(out[-1])
        return out

    # -- the rows of GROUP_TABLE -------------------------------------------------------------
    def row_group(self, rank: int, row: GroupRow) -> list[int]:
        """``rank``'s group of kind ``row`` (module docstring), sorted. For an ``ends`` row on a
        middle stage it is the group of the end stages, which ``rank`` is not in; with pp == 1
        the rank alone (the tie is inside one module)."""
        if row.within is not None:  # sorted: a member's position is its index here
            members = self.row_group(rank, ROWS[row.within])
        else:
            members = self.group(rank, self.present(row.over))
        if row.rule == "all":
            return members
        if row.rule == "ends":
            return sorted({members[0], members[-1]})
        if row.rule == "fold":
            mine = self._expert_slot(rank)
            return [m for m in members if self._expert_slot(m) == mine]
        k, at = getattr(self, row.by), members.index(rank)
        if row.rule == "block":
            return members[at - at % k : at - at % k + k]
        return members[at % k :: k]  # stride

    def row_groups(self, row: GroupRow) -> list[list[int]]:
        """Every group of kind ``row``, ordered by lowest member: a partition of the world, but
        for an ``ends`` row (a partition of the first and last stages' ranks)."""
        if row.rule == "all":
            return self.groups(self.present(row.over))
        return _unique(self.row_group(r, row) for r in range(self.world_size))

    def builds(self, row: GroupRow) -> bool:
        """Whether ``ProcessGroups.build`` creates the groups of ``row`` here (its ``when``)."""
        return row.when is None or bool(getattr(self, row.when))

    def present(self, over: Over) -> tuple[str, ...]:
        """The dimensions of ``over`` this layout has (an absent one has size 1: a no-op)."""
        names = over.split("-") if isinstance(over, str) else over
        return tuple(n for n in names if n in self.names)

    def named_groups(self, kind: str) -> list[list[int]]:
        """All groups of ``kind``, a row name in ``GROUP_TABLE``; ValueError otherwise."""
        if kind not in ROWS:
            raise ValueError(f"unknown group {kind!r}: known are {list(ROWS)}")
        return self.row_groups(ROWS[kind])

    def embedding_group(self, rank: int) -> list[int]:
        """First and last stage at this rank's other coordinates: the holders of tied
        embedding copies (the ``embedding`` row)."""
        return self.row_group(rank, ROWS["embedding"])

    def embedding_groups(self) -> list[list[int]]:
        return self.named_groups("embedding")

    def replica_index(self, rank: int) -> int:
        """The rank's position in its (sorted) ``dp_cp`` group: ``cp_rank + cp * dp_rank`` with
        cp inside dp (``ORDER``)."""
        return self.group(rank, self.present(("dp", "cp"))).index(rank)

    # -- expert parallelism ----------------------------------------------------------------
    @property
    def expert_parallel(self) -> bool:
        """Experts are spread over more than one rank (``ep > 1``): the expert rows are built."""
        return self.ep > 1

    @property
    def experts_apart(self) -> bool:
        """Expert parameters reduce over a group of their own (``edp``): EP > 1, or etp < tp
        (the tp / etp replicas of an expert partition folded in)."""
        return self.ep > 1 or self.etp < self._size_or_1("tp")

    def etp_rank(self, rank: int) -> int:
        """Expert-tensor-parallel rank ``tp_rank % etp``: which of the etp partitions of each expert."""
        return self.coord(rank)["tp"] % self.etp if "tp" in self.names else 0

    def _expert_slot(self, rank: int) -> tuple[int, int]:
        """(etp rank, ep rank): the expert partition a rank holds (beside its pp stage)."""
        return self.etp_rank(rank), self.ep_rank(rank)

    def ep_rank(self, rank: int) -> int:
        """Expert-parallel rank ``r' % ep``: the rank holds experts ``[ep_rank E/ep, (ep_rank+1) E/ep)``."""
        return self.replica_index(rank) % self.ep

    def edp_rank(self, rank: int) -> int:
        """Expert-data-parallel rank ``(r' // ep) x tp / etp + tp_rank // etp`` (index among the
        replicas of the same expert partition; ``r' // ep`` at etp = tp)."""
        tp_rank = self.coord(rank)["tp"] if "tp" in self.names else 0
        return self.replica_index(rank) // self.ep * (self._size_or_1("tp") // self.etp) + tp_rank // self.etp

    def expert_group(self, rank: int, kind: str) -> list[int]:
        """The ``"ep"`` or ``"edp"`` group of ``rank`` (module docstring), in increasing global
        rank, which is increasing ep (edp) rank. ValueError for another kind."""
        if kind not in EXPERT_GROUPS:
            raise ValueError(f"unknown expert group {kind!r}: one of {EXPERT_GROUPS}")
        return self.row_group(rank, ROWS[kind])

    # -- hybrid sharding ---------------------------------------------------------------------
    @property
    def hybrid(self) -> bool:
        """ZeRO shards over fewer ranks than the dp x cp replicas (``zero_shard < dp x cp``)."""
        return self.zero_shard < self._size_or_1("dp") * self._size_or_1("cp")

    def zero_shard_rank(self, rank: int) -> int:
        """``r' % S``: the rank's index in its ZeRO shard group."""
        return self.replica_index(rank) % self.zero_shard

    def zero_replica_rank(self, rank: int) -> int:
        """``r' // S``: which replica of the sharded state the rank holds (0 when flat)."""
        return self.replica_index(rank) // self.zero_shard

    def zero_group(self, rank: int, kind: str) -> list[int]:
        """The ``"zero_shard"``, ``"zero_replica"`` or ``"expert_zero_shard"`` group of ``rank``
        (module docstring), in increasing global rank; flat, the shard group is the ``dp_cp``
        group and the expert one the ``edp`` group. ValueError for another kind."""
        if kind not in HYBRID_GROUPS:
            raise ValueError(f"unknown hybrid-sharding group {kind!r}: one of {HYBRID_GROUPS}")
        return self.row_group(rank, ROWS[kind])

    @property
    def expert_zero_shard(self) -> int:
        """S_e = S / EP: the edp ranks one expert shard set is spread over (the edp size when flat,
        (tp / etp) x dp x cp / EP with folded experts; hybrid sharding refuses etp < tp)."""
        return self.zero_shard // self.ep * (self._size_or_1("tp") // self.etp)

    @property
    def expert_hybrid(self) -> bool:
        """Hybrid sharding with expert parallelism: the ``expert_zero_shard`` row is built."""
        return self.hybrid and self.expert_parallel

    def expert_zero_shard_rank(self, rank: int) -> int:
        """``edp_rank % S_e``: the rank's index in its expert shard group."""
        return self.edp_rank(rank) % self.expert_zero_shard

    def expert_zero_replica_rank(self, rank: int) -> int:
        """``edp_rank // S_e``: which replica of the sharded expert state the rank holds (0 when
        flat); equal to ``zero_replica_rank`` (``r' // S``: one replica group for both)."""
        return self.edp_rank(rank) // self.expert_zero_shard

    # The named groups of the three dimensions every caller knows: the group containing
    # ``rank`` (sorted), and all groups of a kind.
    def tp_group(self, rank: int) -> list[int]:
        return self.group(rank, GROUPS["tp"])

    def dp_group(self, rank: int) -> list[int]:
        return self.group(rank, GROUPS["dp"])

    def pp_group(self, rank: int) -> list[int]:
        return self.group(rank, GROUPS["pp"])

    def mp_group(self, rank: int) -> list[int]:
        """Model-parallel group: all tp x pp ranks that hold one replica of the model."""
        return self.group(rank, GROUPS["mp"])

    def replica_topology(self) -> "Topology":
        """This layout with cp folded into dp: ``Topology(tp, pp, dp * cp)`` in ``ORDER``.

        Every rank keeps its number, and its "dp" group there is its ``dp_cp`` group here:
        the ranks whose parameters are replicas (Megatron-LM's distributed optimizer shards
        over data x context parallel the same way). Raises ValueError when cp and dp are not
        adjacent in the order (the merged numbering would differ).
        """
        names = self.names
        if "cp" not in names:
            return self
        i = names.index("cp")
        if i + 1 >= len(names) or names[i + 1] != "dp":
            raise ValueError(f"replica_topology needs cp right inside dp, {self} has {self.order!r}")
        sizes = {d.name: d.size for d in self.dims if d.name not in ("cp", "dp")}
        sizes["dp"] = self.size("dp") * self.size("cp")
        return Topology(
            order="-".join(n for n in names if n != "cp"), ep=self.ep, zero_shard=self.zero_shard, etp=self.etp, **sizes
        )

    def tp_groups(self) -> list[list[int]]:
        return self.named_groups("tp")

    def dp_groups(self) -> list[list[int]]:
        return self.named_groups("dp")

    def pp_groups(self) -> list[list[int]]:
        return self.named_groups("pp")

    def mp_groups(self) -> list[list[int]]:
        return self.named_groups("mp")

    # -- helpers -------------------------------------------------------------------------
    def __repr__(self) -> str:
        sizes = ", ".join(f"{d.name}={d.size}" for d in self.dims)
        order = (
            ""
            if self.order == ORDER or "cp" not in self.names and self.order == "tp-dp-pp"
            else f", order={self.order!r}"
        )
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        ep += f", zero_shard={self.zero_shard}" if self.hybrid else ""
        ep += f", etp={self.etp}" if self.etp < self._size_or_1("tp") else ""
        return f"Topology({sizes}{ep}{order})"

    def _size_or_1(self, name: str) -> int:
        return self.size(name) if name in self.names else 1

    def _index_of(self, name: str) -> int:
        for i, d in enumerate(self.dims):
            if d.name == name:
                return i
        raise ValueError(f"unknown dimension {name!r}: {self} has {list(self.names)}")

    def _indices(self, over: Over) -> list[int]:
        names = over.split("-") if isinstance(over, str) else over
        return sorted({self._index_of(n) for n in names})

    def _strides(self) -> list[int]:
        return [_prod(d.size for d in self.dims[:i]) for i in range(len(self.dims))]

    def _offsets(self, over: Over) -> list[int]:
        """Sorted offsets from a group's lowest member to each member, for groups over ``over``."""
        strides, idx = self._strides(), self._indices(over)
        steps = [[j * strides[i] for j in range(self.dims[i].size)] for i in idx]
        return sorted(sum(p) for p in itertools.product(*steps))


def _prod(xs: Iterable[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _unique(groups: Iterable[list[int]]) -> list[list[int]]:
    seen, out = set(), []
    for g in groups:
        if tuple(g) not in seen:
            seen.add(tuple(g))
            out.append(list(g))
    return out
