"""NCCL's completion order on gloo ranks (tests/support/deferred.py): asynchronous collectives that
land only at ``wait()`` give bit-identical losses, gradient norms and parameters to the normal runs
on every path that overlaps communication (docs/reliability.md lists the runs)."""

import contextlib

import torch

from tests.support.deferred import deferred_collectives
from tests.support.distributed import run_distributed
from tests.support.layouts import BASE, LLAMA
from tests.support.moe import MOE

STEPS = 3


def _semantics(rank, world):
    """What the mode promises, on plain tensors (2 ranks): see the test below."""
    import torch.distributed as dist

    from megazero import collectives as C

    real = dist.all_reduce
    group, peer, got = dist.group.WORLD, 1 - rank, {}
    with deferred_collectives() as counts:
        t = torch.full((3,), float(rank + 1))
        w = C.all_reduce_sum(t, group, async_op=True)
        got["all_reduce before"], got["completed before"] = t.clone(), w.is_completed()
        w.wait()
        got["all_reduce after"], got["completed after"] = t.clone(), w.is_completed()
        full = torch.zeros(4)
        full[2 * rank : 2 * rank + 2] = float(rank + 1)  # this rank's shard in place (ZeRO's all-gather)
        w = C.all_gather_into(full, full[2 * rank : 2 * rank + 2], group, async_op=True)
        got["all_gather before"] = full.clone()
        full[2 * rank] = 10.0 * (rank + 1)  # a write to the input before the wait is what is sent
        w.wait()
        got["all_gather after"] = full.clone()
        shard = torch.zeros(2)
        w = C.reduce_scatter_sum(shard, torch.arange(4.0), group, async_op=True)
        got["reduce_scatter before"] = shard.clone()
        w.wait()
        got["reduce_scatter after"] = shard.clone()
        b = torch.full((2,), float(rank))
        w = dist.broadcast(b, src=0, async_op=True)
        got["broadcast before"] = b.clone()
        w.wait()
        got["broadcast after"] = b.clone()
        synced = torch.ones(1)
        C.all_reduce_sum(synced, group)  # synchronous: complete at the call
        got["sync"] = synced.clone()
        sent, received = torch.full((2,), float(rank + 5)), torch.zeros(2)
        ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, received, peer)]
        works = dist.batch_isend_irecv(ops)
        got["recv before"] = received.clone()
        for w in works:
            w.wait()
        got["recv after"] = received.clone()
        ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, received, peer)]
        works = dist.batch_isend_irecv(ops)
        sent.add_(1.0)  # written between the post and the wait: refused
        try:
            works[0].wait()
        except RuntimeError as e:
            got["written send"] = str(e)
        got["counts"] = dict(counts)
    got["restored"] = dist.all_reduce is real
    return got


def test_async_collectives_land_at_wait_and_read_before_wait_is_poisoned():
    nan = float("nan")
    for rank, got in enumerate(run_distributed(_semantics, 2)):
        assert torch.equal(got["all_reduce before"], torch.full((3,), float(rank + 1)))  # not reduced yet
        assert torch.equal(got["all_reduce after"], torch.full((3,), 3.0))
        assert (got["completed before"], got["completed after"]) == (False, True)
        mine = torch.full((2,), float(rank + 1))
        before = torch.full((4,), nan)
        before[2 * rank : 2 * rank + 2] = mine  # the input kept, the rest NaN
        assert torch.equal(got["all_gather before"].nan_to_num(-1), before.nan_to_num(-1))
        assert torch.equal(got["all_gather after"], torch.tensor([10.0, 1.0, 20.0, 2.0]))
        assert got["reduce_scatter before"].isnan().all()
        assert torch.equal(got["reduce_scatter after"], torch.arange(2.0 * rank, 2.0 * rank + 2) * 2)
        assert got["broadcast before"].isnan().all() == (rank == 1)
        assert torch.equal(got["broadcast after"], torch.zeros(2))
        assert torch.equal(got["sync"], torch.full((1,), 2.0))
        assert got["recv before"].isnan().all()
        assert torch.equal(got["recv after"], torch.full((2,), float(6 - rank)))
        assert "written after its isend was posted and before its wait" in got["written send"]
        assert got["counts"]["all_reduce"] == 1 and got["counts"]["broadcast"] == 1
        assert got["counts"]["p2p"] == 2 and got["counts"]["wait"] == 6
        assert got["restored"]


def _train(argv, world, steps):
    from megazero.training import build_trainer

    trainer = build_trainer(argv, world)
    values = []
    for _ in range(steps):
        v = trainer.train_step(trainer.next_batches()).values
        values.append((v["loss"], v["grad_norm"]))
    wait = getattr(trainer.optimizer, "wait_param_gather", None)
    if wait is not None:
        wait()  # what train() does before a save / at the end
    params = {f"{i}.{n}": t.clone() for i, c in enumerate(trainer.chunks) for n, t in c.state_dict().items()}
    return values, params


def _runs(rank, world, cases, steps):
    """``(values, params, deferred counts or None)`` of each ``(argv, deferred)`` case."""
    out = []
    for argv, deferred in cases:
        with deferred_collectives() if deferred else contextlib.nullcontext() as counts:
            if counts is not None:
                counts.clear()
            values, params = _train(argv, world, steps)
        out.append((values, params, None if counts is None else dict(counts)))
    return out


def _assert_same(a, b, where):
    (v0, p0, _), (v1, p1, _) = a, b
    assert v0 == v1, f"{where}: losses/grad norms {v0} != {v1}"
    assert p0.keys() == p1.keys(), where
    differ = [n for n in p0 if not torch.equal(p0[n], p1[n])]
    assert not differ, f"{where}: {len(differ)} parameters differ, e.g. {differ[:3]}"


def _compare(world, cases, steps=STEPS):
    """Each ``(argv, ops)`` normal, then deferred: bit-identical on every rank; the deferred run
    deferred at least one call of each operation in ``ops``."""
    runs = [(argv, deferred) for argv, _ in cases for deferred in (False, True)]
    for rank, results in enumerate(run_distributed(_runs, world, runs, steps, timeout_s=900)):
        for i, (argv, ops) in enumerate(cases):
            normal, deferred = results[2 * i : 2 * i + 2]
            where = f"{' '.join(argv[len(BASE) :])} rank {rank}"
            for op in ops:
                assert deferred[2].get(op, 0) > 0, f"{where}: no {op} deferred: {deferred[2]}"
            _assert_same(normal, deferred, where)


GATHER = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
SCATTER = "reduce_scatter_single" if hasattr(torch.distributed, "reduce_scatter_single") else "reduce_scatter_tensor"
DENSE = BASE + ["--num-layers", "2", "--global-batch-size", "8"]
ROPE = DENSE + LLAMA
DP2 = ["--dp", "2"]


def test_overlapped_paths_on_two_ranks_are_bit_identical_under_deferred_collectives():
    """ZeRO-1/2's overlapped parameter all-gather and bucketed reduce-scatter (tied head; untied
    output layer, RMSNorm and RoPE), ZeRO-3's prefetch, the async tensor-parallel all-reduce (tp 2)
    and reduce-scatter (with sequence parallelism), ring attention's K/V sends, and the zero-bubble
    schedules' p2p (zb-v's eager sends)."""
    _compare(
        2,
        [
            (DENSE + DP2 + ["--zero-stage", "1"], [GATHER, SCATTER]),
            (ROPE + DP2 + ["--zero-stage", "2"], [GATHER, SCATTER]),
            (DENSE + DP2 + ["--zero-stage", "3", "--zero3-prefetch-bucket-size", "20000"], [GATHER]),
            (ROPE + ["--tp", "2", "--sequence-parallel"], [SCATTER]),
            (DENSE + ["--tp", "2"], ["all_reduce"]),
            (ROPE + ["--cp", "2"], ["p2p"]),
            (DENSE + ["--pp", "2", "--pipeline-schedule", "zb-h1"], ["p2p"]),
            (DENSE + ["--pp", "2", "--pipeline-schedule", "zb-v", "--num-layers", "4"], ["p2p"]),
        ],
    )


def test_pipelines_with_data_and_expert_parallelism_are_bit_identical_under_deferred_collectives():
    """pp 2 x dp 2: the interleaved schedule at ZeRO-1 (the tied embedding's buffer waited for by
    the chunk's hook, two chunks a rank), and the MoE model under zb-v with expert parallelism 2
    (all-to-all dispatch) at ZeRO-2."""
    pp2 = ["--pp", "2", "--dp", "2"]
    _compare(
        4,
        [
            (
                DENSE
                + pp2
                + ["--num-layers", "4", "--pipeline-schedule", "interleaved", "--virtual-pipeline-size", "2"]
                + ["--zero-stage", "1"],
                [GATHER, "p2p"],
            ),
            (
                ROPE
                + MOE
                + pp2
                + ["--pipeline-schedule", "zb-v", "--num-layers", "4", "--expert-model-parallel-size", "2"]
                + ["--moe-token-dispatcher-type", "alltoall", "--zero-stage", "2"],
                [GATHER, "p2p"],
            ),
        ],
    )


MOE_DP2 = BASE + LLAMA + MOE + ["--num-layers", "2", "--dp", "2", "--global-batch-size", "8"]


def test_moe_overlap_param_gather_waits_before_the_expert_reads():
    """MoE at ZeRO-1/2 with --overlap-param-gather: the router, expert and shared-expert weights are
    read by their parent MoE layer (F.linear / grouped GEMM), so the all-gather of their bucket must
    be waited for before that layer runs; overlap on and off are bit-identical under deferred
    collectives (ZeRO-1 and ZeRO-2; with and without the shared expert; expert parallelism 2)."""
    i = MOE_DP2.index("--moe-shared-expert-intermediate-size")
    no_shared = MOE_DP2[:i] + MOE_DP2[i + 2 :]
    variants = [
        MOE_DP2 + ["--zero-stage", "1"],
        MOE_DP2 + ["--zero-stage", "2"],
        no_shared + ["--zero-stage", "1"],
        no_shared + ["--zero-stage", "2"],
        MOE_DP2 + ["--zero-stage", "1", "--expert-model-parallel-size", "2"],
        MOE_DP2 + ["--zero-stage", "2", "--expert-model-parallel-size", "2"],
    ]
    cases = [(argv + ["--overlap-param-gather", mode], True) for argv in variants for mode in ("off", "on")]
    for rank, results in enumerate(run_distributed(_runs, 2, cases, STEPS, timeout_s=900)):
        for i, argv in enumerate(variants):
            off, on = results[2 * i : 2 * i + 2]
            assert on[2].get("all_gather_into_tensor", 0) + on[2].get("all_gather_single", 0) > 0
            _assert_same(off, on, f"{' '.join(argv[len(BASE) :])} rank {rank}")
