"""Rank arithmetic (pure) and the process groups built from it (spawned gloo ranks)."""
import pytest

from megazero.topology import Topology
from tests.distributed import run_distributed


def test_order_is_tp_dp_pp():
    t = Topology(tp=2, pp=2, dp=2)
    # rank = tp + 2 * (dp + 2 * pp)
    assert [(c.tp, c.dp, c.pp) for c in map(t.coord, range(8))] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    for r in range(8):
        c = t.coord(r)
        assert t.rank(c.tp, c.dp, c.pp) == r


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 2, 1), (3, 2, 5)])
def test_groups_partition_the_world(tp, pp, dp):
    t = Topology(tp=tp, pp=pp, dp=dp)
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("mp", tp * pp)):
        groups = getattr(t, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(range(t.world_size))
        assert all(len(g) == size for g in groups)


EXPECTED = {
    (2, 2, 2): dict(tp=[[0, 1], [2, 3], [4, 5], [6, 7]], dp=[[0, 2], [1, 3], [4, 6], [5, 7]],
                    pp=[[0, 4], [1, 5], [2, 6], [3, 7]], mp=[[0, 1, 4, 5], [2, 3, 6, 7]],
                    embedding=[[0, 4], [1, 5], [2, 6], [3, 7]]),
    (1, 4, 2): dict(tp=[[r] for r in range(8)], dp=[[0, 1], [2, 3], [4, 5], [6, 7]],
                    pp=[[0, 2, 4, 6], [1, 3, 5, 7]], mp=[[0, 2, 4, 6], [1, 3, 5, 7]],
                    embedding=[[0, 6], [1, 7]]),
    (4, 1, 2): dict(tp=[[0, 1, 2, 3], [4, 5, 6, 7]], dp=[[0, 4], [1, 5], [2, 6], [3, 7]],
                    pp=[[r] for r in range(8)], mp=[[0, 1, 2, 3], [4, 5, 6, 7]],
                    embedding=[[r] for r in range(8)]),
    (2, 2, 1): dict(tp=[[0, 1], [2, 3]], dp=[[0], [1], [2], [3]], pp=[[0, 2], [1, 3]],
                    mp=[[0, 1, 2, 3]], embedding=[[0, 2], [1, 3]]),
}


@pytest.mark.parametrize("layout", list(EXPECTED))
def test_documented_members_pure(layout):
    tp, pp, dp = layout
    t = Topology(tp=tp, pp=pp, dp=dp)
    for kind, groups in EXPECTED[layout].items():
        assert getattr(t, f"{kind}_groups")() == groups, kind


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
    out["stage"] = (groups.is_first_stage, groups.is_last_stage, groups.prev_stage_rank,
                    groups.next_stage_rank)
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
                assert got["stage"][2] == t.rank(c.tp, c.dp, c.pp - 1)
            if c.pp < layout[1] - 1:
                assert got["stage"][3] == t.rank(c.tp, c.dp, c.pp + 1)


def test_rank_error_names_failing_rank():
    from tests.distributed import RankError

    with pytest.raises(RankError, match="rank 1 failed"):
        run_distributed(_fail_on_one, 2)


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom")
    return rank
