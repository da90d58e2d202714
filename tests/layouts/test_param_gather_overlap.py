"""--overlap-param-gather: the ZeRO-1/2 all-gather of the updated parameters left in flight after
the optimizer step and waited for by forward pre-hooks gives bit-identical losses, gradient norms
and parameters (torch.equal) to the synchronous all-gather, at dp 2 ZeRO-1 / ZeRO-2 and pp 2 x
dp 2 (interleaved, tied embeddings: the tied buffer and two chunks per rank), in fp32, bf16 and
with the optimizer offloaded to the host; the hooks did the waiting; the bytes on the wire are the same; and stage 0
/ 3 are refused."""

import pytest
import torch

from scripts.bench.bench_comm import BASE
from tests.support.distributed import run_distributed

STEPS = 3


def _train(rank, world, argvs):
    from megazero import collectives, training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    out = []
    for argv in argvs:
        cfg = config_from_argv(argv, world)
        trainer = build_trainer(cfg, data=training.prepare_run(cfg))
        cfg = trainer.cfg
        values, counted = [], {}
        for _ in range(STEPS):
            batches = trainer.next_batches()
            collectives.counter.clear()
            v = trainer.train_step(batches).values
            counted = dict(collectives.counter)
            values.append((v["loss"], v["grad_norm"]))
        gather = trainer.optimizer.param_gather
        pending = 0 if gather is None else gather.pending()
        trainer.optimizer.wait_param_gather()  # what train() does before a save / at the end
        params = {f"{i}.{n}": t.clone() for i, c in enumerate(trainer.chunks) for n, t in c.state_dict().items()}
        stats = None if gather is None else (gather.waits, gather.waits_all, gather.starts, len(gather.order), pending)
        out.append((values, params, counted, stats))
    return out


def _compare(world, cases):
    argvs = [
        BASE + flags + ["--train-iters", str(STEPS), "--overlap-param-gather", mode]
        for flags in cases
        for mode in ("off", "on")
    ]
    for rank, results in enumerate(run_distributed(_train, world, argvs, timeout_s=900)):
        for i, flags in enumerate(cases):
            (v0, p0, c0, s0), (v1, p1, c1, s1) = results[2 * i : 2 * i + 2]
            where = f"{' '.join(flags)} rank {rank}"
            assert s0 is None
            waits, waits_all, starts, buckets, pending = s1
            assert starts == STEPS and pending == buckets > 1, where  # last step's gathers in flight
            assert waits == (STEPS - 1) * buckets and waits_all == buckets, where  # hooks waited
            assert v0 == v1, f"{where}: losses/grad norms {v0} != {v1}"
            assert p0.keys() == p1.keys()
            for name in p0:
                assert torch.equal(p0[name], p1[name]), f"{where}: {name} differs"
            assert c0 == c1 and c0["all_gather"] > 0, f"{where}: bytes {c0} != {c1}"


def test_dp2_zero1_and_zero2_bit_identical():
    """fp32 (the parameters are the main params), bf16 (the shard is cast from the fp32 main
    params before the all-gather) and the host-offloaded optimizer."""
    dp2 = ["--dp", "2", "--global-batch-size", "8"]
    _compare(
        2,
        [
            dp2 + ["--zero-stage", "1"],
            dp2 + ["--zero-stage", "2"],
            dp2 + ["--zero-stage", "2", "--bf16", "--offload-optimizer", "cpu"],
        ],
    )


def test_pp2_dp2_interleaved_bit_identical():
    _compare(
        4,
        [
            [
                "--pp",
                "2",
                "--dp",
                "2",
                "--zero-stage",
                "1",
                "--pipeline-schedule",
                "interleaved",
                "--virtual-pipeline-size",
                "2",
                "--num-layers",
                "4",
                "--global-batch-size",
                "8",
            ]
        ],
    )


def test_auto_and_refusal(capsys):
    from megazero.config import config_from_argv, overlap_param_gather

    for stage, on in (("0", False), ("1", True), ("2", True), ("3", False)):
        cfg = config_from_argv(BASE + ["--dp", "2", "--zero-stage", stage], 2)
        assert overlap_param_gather(cfg) is on
    for stage in ("0", "3"):
        with pytest.raises(SystemExit) as e:
            config_from_argv(BASE + ["--dp", "2", "--zero-stage", stage, "--overlap-param-gather", "on"], 2)
        assert e.value.code == 2
        assert f"--overlap-param-gather on needs --zero-stage 1 or 2 (got {stage}" in capsys.readouterr().err
