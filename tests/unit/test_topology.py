"""Rank arithmetic (pure) and the process groups built from it (spawned gloo ranks).

The generic N-dimensional arithmetic is checked against the three-dimension formulas it
replaced (written out below, independently of megazero.topology) for every layout of up to
8 ranks, and a fourth dimension against Megatron-LM's tp-cp-dp-pp arithmetic.
"""

import dataclasses
import itertools

import pytest

from megazero.process_groups import ProcessGroups
from megazero.topology import GROUP_TABLE, GROUPS, Coord, GroupRow, Topology
from tests.support.distributed import run_distributed


def test_order_is_tp_cp_dp_pp():
    t = Topology(tp=2, pp=2, dp=2)
    assert t.order == "tp-cp-dp-pp" and t.cp == 1
    # rank = tp + 2 * (dp + 2 * pp)
    assert [(c.tp, c.dp, c.pp) for c in map(t.coord, range(8))] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 0),
        (1, 1, 0),
        (0, 0, 1),
        (1, 0, 1),
        (0, 1, 1),
        (1, 1, 1),
    ]
    for r in range(8):
        c = t.coord(r)
        assert t.rank(c.tp, c.cp, c.dp, c.pp) == t.rank(tp=c.tp, dp=c.dp, pp=c.pp) == r


def test_replica_topology_folds_cp_into_dp_with_the_same_rank_numbers():
    t = Topology(tp=2, pp=2, dp=3, cp=2)
    rt = t.replica_topology()
    assert rt.order == "tp-dp-pp" and (rt.tp, rt.dp, rt.pp) == (2, 6, 2)
    for r in range(t.world_size):
        c, rc = t.coord(r), rt.coord(r)
        assert (rc.tp, rc.pp, rc.dp) == (c.tp, c.pp, c.cp + 2 * c.dp)
        assert rt.group(r, "dp") == t.group(r, ("dp", "cp"))
    with pytest.raises(ValueError, match="cp right inside dp"):
        Topology(order="tp-dp-cp-pp", cp=2).replica_topology()


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 2, 1), (3, 2, 5)])
def test_groups_partition_the_world(tp, pp, dp):
    t = Topology(tp=tp, pp=pp, dp=dp)
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("mp", tp * pp)):
        groups = getattr(t, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(range(t.world_size))
        assert all(len(g) == size for g in groups)


EXPECTED = {
    (2, 2, 2): dict(
        tp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        dp=[[0, 2], [1, 3], [4, 6], [5, 7]],
        pp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        mp=[[0, 1, 4, 5], [2, 3, 6, 7]],
        embedding=[[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    (1, 4, 2): dict(
        tp=[[r] for r in range(8)],
        dp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        pp=[[0, 2, 4, 6], [1, 3, 5, 7]],
        mp=[[0, 2, 4, 6], [1, 3, 5, 7]],
        embedding=[[0, 6], [1, 7]],
    ),
    (4, 1, 2): dict(
        tp=[[0, 1, 2, 3], [4, 5, 6, 7]],
        dp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        pp=[[r] for r in range(8)],
        mp=[[0, 1, 2, 3], [4, 5, 6, 7]],
        embedding=[[r] for r in range(8)],
    ),
    (2, 2, 1): dict(
        tp=[[0, 1], [2, 3]], dp=[[0], [1], [2], [3]], pp=[[0, 2], [1, 3]], mp=[[0, 1, 2, 3]], embedding=[[0, 2], [1, 3]]
    ),
}


@pytest.mark.parametrize("layout", list(EXPECTED))
def test_documented_members_pure(layout):
    tp, pp, dp = layout
    t = Topology(tp=tp, pp=pp, dp=dp)
    for kind, groups in EXPECTED[layout].items():
        assert getattr(t, f"{kind}_groups")() == groups, kind


# -- the three-dimension arithmetic as it was (order tp-dp-pp), the oracle -----------------


def _old_coord(r, tp, pp, dp):
    return r % tp, (r // tp) % dp, r // (tp * dp)


def _old_rank(t, d, p, tp, pp, dp):
    return t + tp * (d + dp * p)


def _old_group(kind, r, tp, pp, dp):
    t, d, p = _old_coord(r, tp, pp, dp)
    at = lambda t_, d_, p_: _old_rank(t_, d_, p_, tp, pp, dp)
    if kind == "tp":
        return [at(x, d, p) for x in range(tp)]
    if kind == "dp":
        return [at(t, x, p) for x in range(dp)]
    if kind == "pp":
        return [at(t, d, x) for x in range(pp)]
    if kind == "mp":
        return sorted(at(x, d, y) for x in range(tp) for y in range(pp))
    return sorted({at(t, d, 0), at(t, d, pp - 1)})  # embedding


def _old_groups(kind, tp, pp, dp):
    seen, out = set(), []
    for r in range(tp * pp * dp):
        g = _old_group(kind, r, tp, pp, dp)
        if tuple(g) not in seen:
            seen.add(tuple(g))
            out.append(g)
    return out


LAYOUTS = [(tp, pp, dp) for tp, pp, dp in itertools.product(range(1, 9), repeat=3) if tp * pp * dp <= 8]


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_generic_arithmetic_equals_the_three_dimension_formulas(tp, pp, dp):
    t = Topology(tp, pp, dp)  # positional order tp, pp, dp, as the callers use it
    assert (t.tp, t.pp, t.dp, t.world_size) == (tp, pp, dp, tp * pp * dp)
    assert t.order == "tp-cp-dp-pp" and t == Topology(tp=tp, pp=pp, dp=dp, cp=1)
    for r in range(t.world_size):
        c = t.coord(r)
        assert (c.tp, c.dp, c.pp) == _old_coord(r, tp, pp, dp)
        assert c == Coord(tp=c.tp, cp=0, dp=c.dp, pp=c.pp)
        assert t.rank(c.tp, 0, c.dp, c.pp) == t.rank(**c) == r
        for kind in ("tp", "dp", "pp", "mp", "embedding"):
            assert getattr(t, f"{kind}_group")(r) == _old_group(kind, r, tp, pp, dp), (kind, r)
    for kind in ("tp", "dp", "pp", "mp", "embedding"):
        assert getattr(t, f"{kind}_groups")() == _old_groups(kind, tp, pp, dp), kind
        assert t.named_groups(kind) == _old_groups(kind, tp, pp, dp), kind


def test_process_groups_build_creates_the_old_groups_in_the_old_order():
    """``build`` creates the table's rows in order: the dense groups of ``GROUPS``, the
    embedding group, then the expert and hybrid families."""
    assert [*GROUPS, "embedding"] == ["tp", "dp", "pp", "mp", "cp", "dp_cp", "embedding"]
    assert [(r.name, r.family) for r in GROUP_TABLE] == [
        ("tp", "dense"),
        ("dp", "dense"),
        ("pp", "dense"),
        ("mp", "dense"),
        ("cp", "dense"),
        ("dp_cp", "dense"),
        ("embedding", "dense"),
        ("ep", "expert"),
        ("edp", "expert"),
        ("zero_shard", "hybrid"),
        ("zero_replica", "hybrid"),
        ("expert_zero_shard", "hybrid"),
    ]


def test_process_groups_fields_are_exactly_the_table_rows():
    fields = [f.name for f in dataclasses.fields(ProcessGroups)]
    assert fields == ["topology", "rank", *(r.name for r in GROUP_TABLE), "world"]
    single = ProcessGroups.single()
    assert all(getattr(single, r.name) is None for r in GROUP_TABLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        single.tp = None


FAMILY_LAYOUTS = [
    dict(tp=2, pp=2, dp=2),
    dict(tp=1, pp=3, dp=4, cp=2, ep=2, zero_shard=4),  # S a multiple of EP: S_e = S / EP
    dict(tp=2, pp=1, dp=2, cp=3, ep=3, zero_shard=3),
    dict(tp=1, pp=2, dp=12, ep=2, zero_shard=6),
    dict(tp=3, pp=2, dp=2, cp=2, ep=2, zero_shard=2),
    dict(tp=2, pp=2, dp=4, zero_shard=1),
    dict(tp=4, pp=2, dp=2, cp=2, ep=2, etp=2),  # expert tensor parallelism: tp / etp folded into edp
    dict(tp=2, pp=1, dp=3, ep=1, etp=1),
]


@pytest.mark.parametrize("layout", FAMILY_LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_family_row_partitions_the_world(layout):
    """Each row's groups are disjoint and cover the world (the ``ends`` row: the first and last
    stages' ranks), every rank's group is the one of ``row_groups`` holding it, and the sizes
    are the family's: dense the product of its dimensions, carved ``k`` or dp x cp / k, folded
    (tp / etp) x dp x cp / ep."""
    t = Topology(**layout)
    replicas = t.dp * t.cp
    folded = t.tp // t.etp * replicas // t.ep
    for row in GROUP_TABLE:
        groups = t.row_groups(row)
        members = sorted(r for g in groups for r in g)
        ends = [r for r in range(t.world_size) if t.coord(r).pp in (0, t.pp - 1)]
        assert members == (ends if row.rule == "ends" else list(range(t.world_size))), row.name
        for r in range(t.world_size):
            g = t.row_group(r, row)
            assert g in groups and (r in g or row.rule == "ends"), (row.name, r)
        k = getattr(t, row.by) if row.by else None
        size = {
            "all": lambda: _prod_of(t, row.over),
            "ends": lambda: min(t.pp, 2),
            "block": lambda: k,
            "stride": lambda: replicas // k,
            "fold": lambda: folded,
        }[row.rule]()
        assert {len(g) for g in groups} == {size}, row.name
    assert t.named_groups("ep") == [
        t.expert_group(r, "ep") for r in range(t.world_size) if r == t.expert_group(r, "ep")[0]
    ]
    for r in range(t.world_size):  # the carved rows agree with the rank formulas
        assert t.group(r, ("dp", "cp")).index(r) == t.coord(r).cp + t.cp * t.coord(r).dp == t.replica_index(r)
        assert [t.ep_rank(s) for s in t.expert_group(r, "ep")] == list(range(t.ep))
        assert [t.edp_rank(s) for s in t.expert_group(r, "edp")] == list(range(folded))
        assert [t.zero_shard_rank(s) for s in t.zero_group(r, "zero_shard")] == list(range(t.zero_shard))
        assert [t.zero_replica_rank(s) for s in t.zero_group(r, "zero_replica")] == list(
            range(replicas // t.zero_shard)
        )
        # the expert shard group: the edp ranks inside the rank's shard group, S / EP of them
        shard, edp = t.zero_group(r, "zero_shard"), t.expert_group(r, "edp")
        if t.etp < t.tp:  # no hybrid sharding with folded experts: their shard group is edp
            assert t.zero_group(r, "expert_zero_shard") == edp and t.zero_shard == replicas
            continue
        assert t.zero_group(r, "expert_zero_shard") == [s for s in edp if s in shard]
        assert [t.expert_zero_shard_rank(s) for s in t.zero_group(r, "expert_zero_shard")] == list(
            range(t.zero_shard // t.ep)
        )
        assert t.expert_zero_replica_rank(r) == t.zero_replica_rank(r)  # one replica group for both


def _prod_of(t, over):
    out = 1
    for name in over:
        out *= t.size(name)
    return out


def test_a_group_row_checks_its_rule():
    with pytest.raises(ValueError, match="family 'sparse'"):
        GroupRow("x", "sparse", ("dp",))
    with pytest.raises(ValueError, match="rule 'block'"):
        GroupRow("x", "expert", ("dp",), "block")
    with pytest.raises(ValueError, match="rule 'all'"):
        GroupRow("x", "dense", ("dp",), by="ep")
    with pytest.raises(ValueError, match="`within` only for them"):
        GroupRow("x", "dense", ("dp",), within="edp")
    t = Topology(tp=2, dp=4)
    assert t.row_groups(GroupRow("pairs", "hybrid", ("dp",), "block", "tp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_process_groups_coordinates_pure():
    t = Topology(tp=2, pp=2, dp=2)
    g = ProcessGroups(t, rank=5)
    assert g.describe() == "rank 5: tp 1/2 dp 0/2 pp 1/2"
    assert (g.tp_rank, g.dp_rank, g.pp_rank, g.tp_size, g.dp_size, g.pp_size) == (1, 0, 1, 2, 2, 2)
    assert (g.is_first_stage, g.is_last_stage, g.prev_stage_rank, g.next_stage_rank) == (False, True, 1, None)
    assert ProcessGroups(t, rank=1).next_stage_rank == 5
    assert ProcessGroups.single().describe() == "rank 0: tp 0/1 dp 0/1 pp 0/1"


# -- a fourth dimension is one entry --------------------------------------------------------


def test_context_parallel_dimension_follows_megatron_arithmetic():
    """Order tp-cp-dp-pp (Megatron-LM): tp_rank = r % tp, cp_rank = (r // tp) % cp,
    dp_rank = (r // (tp*cp)) % dp, pp_rank = r // (tp*cp*dp); groups over any subset."""
    tp, cp, dp, pp = 2, 2, 3, 2
    t = Topology(order="tp-cp-dp-pp", tp=tp, cp=cp, dp=dp, pp=pp)
    assert t.world_size == 24 and (t.tp, t.cp, t.dp, t.pp) == (tp, cp, dp, pp)
    same = lambda r, s, keep: all(getattr(t.coord(r), n) == getattr(t.coord(s), n) for n in keep)
    for r in range(t.world_size):
        c = t.coord(r)
        assert (c.tp, c.cp, c.dp, c.pp) == (r % tp, (r // tp) % cp, (r // (tp * cp)) % dp, r // (tp * cp * dp))
        assert t.rank(c.tp, c.cp, c.dp, c.pp) == t.rank(**c) == r
        # the group over S: the ranks that agree with r outside S
        for over in [("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp"), ("tp", "pp"), ("tp", "cp", "dp", "pp"), ()]:
            keep = [n for n in t.names if n not in over]
            assert t.group(r, over) == [s for s in range(t.world_size) if same(r, s, keep)]
    assert t.groups("cp") == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
        [16, 18],
        [17, 19],
        [20, 22],
        [21, 23],
    ]
    assert (
        t.groups(("dp", "cp"))
        == t.groups("cp-dp")
        == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11], [12, 14, 16, 18, 20, 22], [13, 15, 17, 19, 21, 23]]
    )
    assert t.dp_group(0) == [0, 4, 8] and t.pp_group(3) == [3, 15]
    assert t.mp_groups()[:2] == [[0, 1, 12, 13], [2, 3, 14, 15]]
    assert t.embedding_group(2) == [2, 14]
    # every named group partitions the world
    for kind in GROUPS:
        assert sorted(r for g in t.named_groups(kind) for r in g) == list(range(24))


def test_errors_name_the_setting():
    with pytest.raises(ValueError, match="--tp must be >= 1, got 0"):
        Topology(tp=0)
    with pytest.raises(ValueError, match="--cp must be >= 1, got 0"):
        Topology(order="tp-cp-dp-pp", cp=0)
    with pytest.raises(ValueError, match="unknown dimension 'cp'"):
        Topology(order="tp-dp-pp", cp=2)  # not in that order
    t = Topology(tp=2, pp=2, dp=2, order="tp-dp-pp")
    with pytest.raises(ValueError, match="unknown dimension 'cp'"):
        t.group(0, ("dp", "cp"))
    with pytest.raises(ValueError, match="unknown dimension 'ep'"):
        t.rank(ep=0)
    with pytest.raises(ValueError, match="unknown dimension 'ep'"):
        t.size("ep")
    with pytest.raises(ValueError, match=r"coordinate \(tp=2, dp=0, pp=0\) outside"):
        t.rank(tp=2)
    with pytest.raises(ValueError, match="rank 8 outside world of size 8"):
        t.coord(8)
    with pytest.raises(ValueError, match="distinct"):
        Topology(order="tp-dp-tp")
    with pytest.raises(AttributeError, match="'cp'"):
        t.cp


def _members(rank, world, layout):
    import torch
    import torch.distributed as dist

    from megazero.process_groups import ProcessGroups

    tp, pp, dp = layout
    groups = ProcessGroups.build(Topology(tp=tp, pp=pp, dp=dp))
    out = {}
    for kind in ("tp", "dp", "pp", "mp", "embedding"):
        g = getattr(groups, kind)
        if g is None:  # a middle stage belongs to no embedding group
            assert kind == "embedding" and not (groups.is_first_stage or groups.is_last_stage)
            out[kind] = [rank]
            continue
        # each rank all-gathers its global rank inside the group: the members, as seen by torch
        mine = torch.tensor([rank])
        got = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(g))]
        dist.all_gather(got, mine, group=g)
        out[kind] = [int(x) for x in got]
    out["stage"] = (groups.is_first_stage, groups.is_last_stage, groups.prev_stage_rank, groups.next_stage_rank)
    return out


def test_documented_members_on_gloo_ranks():
    for layout, expected in EXPECTED.items():
        world = layout[0] * layout[1] * layout[2]
        results = run_distributed(_members, world, layout)
        t = Topology(tp=layout[0], pp=layout[1], dp=layout[2])
        for rank, got in enumerate(results):
            c = t.coord(rank)
            for kind, groups in expected.items():
                if kind == "embedding" and 0 < c.pp < layout[1] - 1:
                    assert got[kind] == [rank]
                    continue
                assert got[kind] in groups and rank in got[kind], (layout, rank, kind, got[kind])
            assert got["stage"][0] == (c.pp == 0) and got["stage"][1] == (c.pp == layout[1] - 1)
            if c.pp > 0:
                assert got["stage"][2] == t.rank(tp=c.tp, dp=c.dp, pp=c.pp - 1)
            if c.pp < layout[1] - 1:
                assert got["stage"][3] == t.rank(tp=c.tp, dp=c.dp, pp=c.pp + 1)


def test_rank_error_names_failing_rank():
    from tests.support.distributed import RankError

    with pytest.raises(RankError, match="rank 1 failed"):
        run_distributed(_fail_on_one, 2)


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom")
    return rank


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, dp=2, cp=2), dict(tp=4, pp=2, dp=1), dict(tp=1, pp=2, dp=2)])
def test_tensor_parallel_only_keeps_the_tp_group_and_drops_the_rest(layout):
    """``tensor_parallel_only`` (a whole-model copy per tp group): every rank keeps its tp rank,
    its tp group object and the same tp members, with pipeline, context, expert and data groups
    gone (None) and sizes 1 for pp and cp; at tp = world it is the groups themselves."""
    t = Topology(**layout)
    for r in range(t.world_size):
        fake = {row.name: f"{row.name}-group-of-{r}" for row in GROUP_TABLE}
        g = ProcessGroups(topology=t, rank=r, world="world", **fake)
        v = g.tensor_parallel_only()
        assert (v.rank, v.tp_rank, v.tp_size) == (r, g.tp_rank, g.tp_size)
        assert (v.pp_size, v.pp_rank, v.cp_size, v.ep_size) == (1, 0, 1, 1)
        assert v.topology.group(r, "tp") == t.group(r, "tp")
        assert v.tp == f"tp-group-of-{r}" and v.mp == v.tp and v.world == "world"
        assert all(getattr(v, row.name) is None for row in GROUP_TABLE if row.name not in ("tp", "mp"))
    whole = ProcessGroups(topology=Topology(tp=4), rank=1, tp="tp", world="world")
    assert whole.tensor_parallel_only() is whole
