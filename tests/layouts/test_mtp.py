"""Multi-token prediction (DeepSeek-V3 sec. 2.2, model/mtp.py) under every parallel dimension: one spawn
of 4 gloo ranks trains, FEATURE_STEPS (6) steps each, the LLaMA-style model (untied output, so the last
stage's copy of the word embedding is the MTP modules' alone) with 2 MTP depths under tp 2 with
sequence parallelism and ZeRO-3 over dp 2 (each depth its own gather unit, the untied output layer
gathered once per depth), interleaved pp 2 (virtual pipeline 2: the modules on the last chunk, the
embedding shared with the first stage over the embedding group), cp 2 ring attention on packed
documents (tests/support/packed.py: EODs at random, --reset-attention-mask, --reset-position-ids,
--eod-mask-loss; the shifted targets cut from whole sequences before the zigzag split, masked across
documents), and the MoE model of tests/support/moe.py at EP 2 over dp 4. Every step's main loss, MTP
loss and gradient norm equal tests/support/mtp.py's single-process oracle within 1e-5 relative, and
every rank holds the parameters the planner counts for its stage."""

import math

import pytest

from tests.support.distributed import run_distributed
from tests.support.layouts import BASE, FEATURE_STEPS, LLAMA
from tests.support.moe import MOE
from tests.support.mtp import mtp_reference

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
DENSE = BASE + LLAMA + MTP
MOE_MTP = DENSE + MOE
LAYOUTS = {  # name -> (argv, packed documents); 4 layouts to keep the spawn short, each with 2 dimensions
    "tp2-sp-dp2-zero3": (
        DENSE + ["--tp", "2", "--sequence-parallel", "--zero-stage", "3", "--zero3-param-persistence-threshold", "0"],
        False,
    ),
    "pp2-interleaved-dp2": (
        DENSE + ["--pp", "2", "--virtual-pipeline-size", "2", "--pipeline-schedule", "interleaved"],
        False,
    ),
    "cp2-ring-packed-dp2": (DENSE + ["--cp", "2"], True),
    "moe-dp4-ep2": (MOE_MTP + ["--expert-model-parallel-size", "2", "--zero-stage", "1"], False),
}


def _train(rank, world, layouts, steps):
    from megazero.pipeline.partition import chunk_layout
    from megazero.planning import memory
    from megazero.training import build_trainer
    from tests.support.packed import packed_batches, packed_trainer, rank_micro_batches

    out = []
    for argv, packed in layouts:
        trainer = packed_trainer(argv, world) if packed else build_trainer(argv, world)
        cfg, p = trainer.cfg, trainer.cfg.parallel
        data = packed_batches(trainer.gpt_config.vocab_size, cfg.model.seq_length, cfg.train.global_batch_size, steps)
        rows = []
        for step in range(steps):
            batches = rank_micro_batches(trainer, data[step]) if packed else trainer.next_batches()
            v = trainer.train_step(batches).values
            rows.append((v["loss"], v["mtp_loss"], v["grad_norm"]))
        built = sum(q.numel() for c in trainer.chunks for q in c.parameters())
        counted = memory.params_per_rank(
            trainer.gpt_config,
            p.tp,
            p.pp,
            trainer.groups.pp_rank,
            p.virtual_pipeline_size,
            ep=p.expert_model_parallel_size,
            layout=chunk_layout(p.pipeline_schedule),
        )
        out.append((rows, built, counted))
        trainer.close()
    return out


@pytest.mark.slow
def test_mtp_under_every_layout_equals_the_reference():
    runs = run_distributed(_train, 4, list(LAYOUTS.values()), FEATURE_STEPS, timeout_s=600)
    for i, (name, (argv, packed)) in enumerate(LAYOUTS.items()):
        losses, stats = mtp_reference(DENSE + MOE if "moe" in name else DENSE, FEATURE_STEPS, packed)
        want = list(zip(losses, stats["mtp_losses"], stats["grad_norms"]))
        for rank, (rows, built, counted) in enumerate(r[i] for r in runs):
            assert built == counted, (name, rank, built, counted)
            assert rows == runs[0][i][0], (name, rank)  # every rank logs the same values
        for step, (got, ref) in enumerate(zip(runs[0][i][0], want)):
            for what, g, w in zip(("loss", "mtp_loss", "grad_norm"), got, ref):
                assert math.isclose(g, w, rel_tol=1e-5), (name, step, what, g, w)
        assert stats["mtp_losses"][0] > 0.25 * math.log(1001)  # lambda 0.3 x ~ln V: the MTP loss is in it
