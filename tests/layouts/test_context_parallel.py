"""Context parallelism through the whole trainer: every (tp, cp, pp, dp) layout
trains the same GPT as ``tests/support/reference.py`` on the same global batches, step by step
(fp32, dropout off), for the GPT-2-style and the LLaMA-style block.

Each sequence is cut into 2 cp chunks, cp rank r holds chunks r and 2cp-1-r; attention runs
as a ring of K/V blocks (``--cp-comm-type p2p``) or all-to-all over heads (``a2a``); gradients
are reduced and ZeRO shards over the dp x cp ranks. The layouts of one world size share one
set of spawned gloo ranks.
"""

import math

import pytest

from tests.support.distributed import run_distributed
from tests.support.layouts import (
    BASE,
    LLAMA,
    MB4,
    SWEEP_STEPS,
    check_layout,
    reference_losses,
    single_layout_run,
    train_layouts,
)

CP_LAYOUTS = {  # name -> (world size, flags)
    "cp2-p2p": (2, ["--cp", "2"]),
    "cp2-a2a": (2, ["--cp", "2", "--cp-comm-type", "a2a"]),
    "cp2-zero2-offload": (2, ["--cp", "2", "--zero-stage", "2", "--offload-optimizer", "cpu"]),
    "tp2-cp2-sp": (4, ["--tp", "2", "--cp", "2", "--sequence-parallel"]),
    "cp2-pp2-interleaved": (4, ["--cp", "2", "--pp", "2", "--virtual-pipeline-size", "2"]),
    "cp2-dp2-zero3": (4, ["--cp", "2", "--dp", "2", "--zero-stage", "3", "--zero3-param-persistence-threshold", "0"]),
    "cp4-recompute-full": (4, ["--cp", "4", "--recompute-granularity", "full", "--recompute-method", "uniform"]),
    "cp2-a2a-recompute-selective": (
        4,
        ["--cp", "2", "--dp", "2", "--cp-comm-type", "a2a", "--recompute-granularity", "selective"],
    ),
}
BLOCKS = {"gpt2": [], "llama": LLAMA}
# The LLaMA block (RoPE positions of the zigzag chunks, GQA heads under a2a and tp) runs the layouts
# where the block meets the cp split; the data-parallel, pipeline and recompute plumbing of the
# others does not depend on the block, and each costs a 2-4 rank run of ring attention.
LLAMA_LAYOUTS = ("cp2-p2p", "cp2-a2a", "tp2-cp2-sp", "cp4-recompute-full")
CASES = [(b, n) for n in CP_LAYOUTS for b in BLOCKS if b == "gpt2" or n in LLAMA_LAYOUTS]


@pytest.fixture(scope="module")
def runs():
    """(block, layout) -> per-rank results; one spawn per world size runs both blocks' layouts,
    and one single-process run per block gives the gradient norms to match."""
    out = {}
    for world in sorted({w for w, _ in CP_LAYOUTS.values()}):
        keys = [(b, n) for b, n in CASES if CP_LAYOUTS[n][0] == world]
        argvs = [BASE + BLOCKS[b] + MB4 + CP_LAYOUTS[n][1] for b, n in keys]  # 4 micro-batches at dp 1
        per_rank = run_distributed(train_layouts, world, argvs, SWEEP_STEPS, timeout_s=900)
        out.update({k: [r[i] for r in per_rank] for i, k in enumerate(keys)})
    for b in BLOCKS:  # shared with tests/layouts/test_train.py (one run per pytest process)
        out[(b, "single")] = [single_layout_run(BASE + BLOCKS[b], SWEEP_STEPS)]
    return out


@pytest.fixture(scope="module")
def references():
    return {b: reference_losses(BASE + flags, SWEEP_STEPS) for b, flags in BLOCKS.items()}


@pytest.mark.parametrize("block,name", CASES)
def test_context_parallel_layout_equals_reference(name, block, runs, references):
    """4 steps (``SWEEP_STEPS``): losses equal the reference within 1e-5 relative, gradient
    norms the single process's within 1e-6, every rank the same values, the same greedy sample."""
    check_layout(
        name, runs[(block, name)], references[block], runs[(block, "single")][0], clip=0.5 if block == "llama" else 1.0
    )


@pytest.mark.parametrize("block", list(BLOCKS))
def test_p2p_and_a2a_give_the_same_losses(block, runs):
    ring, a2a = runs[(block, "cp2-p2p")][0][0], runs[(block, "cp2-a2a")][0][0]
    for x, y in zip(ring, a2a):
        assert math.isclose(x, y, rel_tol=1e-6), (x, y)


def test_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(tmp_path):
    """cp is not part of the saved state: saved at cp 2 (ZeRO-1, optimizer shards over the dp x cp
    ranks) after 3 steps, resumed at cp 1 and at cp 4, the next 3 steps equal the
    uninterrupted cp 2 run within 1e-5 relative."""
    from tests.support.checkpoint_shards import ARGS, checkpoint_session, close_trainer

    root = str(tmp_path / "ckpt")
    saved = run_distributed(
        checkpoint_session,
        2,
        ARGS + ["--cp", "2", "--zero-stage", "1"],
        save=root,
        save_after=3,
        measure=False,
        timeout_s=600,
    )  # the allocation peaks: test_checkpoint_shards.py
    whole = saved[0]["losses"][1]
    for world, layout in ((1, []), (4, ["--cp", "4"])):
        loaded = run_distributed(
            checkpoint_session,
            world,
            ARGS + layout + ["--zero-stage", "1", "--load", root],
            loads=[root],
            measure=False,
            timeout_s=600,
        )
        close_trainer(loaded[0]["losses"][0], whole)


def _short_runs(rank, world, argvs, steps):
    from tests.support.layouts import train_layout

    return [train_layout(rank, world, argv, steps)[0] for argv in argvs]


@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16"]])
def test_mixed_precision_cp2_follows_cp1(precision):
    """bf16, and fp16 with dynamic loss scaling: 4 steps at cp 2 (ring and all-to-all; K/V sent
    in the model dtype, dK/dV accumulated and sent in fp32) stay within the half-precision
    rounding of the cp 1 run (2e-2 relative; the layouts round differently)."""
    argv = BASE + precision + ["--clip-grad", "0"]
    single = run_distributed(_short_runs, 1, [argv], 4)[0][0]
    ring, a2a = run_distributed(
        _short_runs, 2, [argv + ["--cp", "2"], argv + ["--cp", "2", "--cp-comm-type", "a2a"]], 4, timeout_s=600
    )[0]
    for got in (ring, a2a):
        assert all(math.isfinite(x) for x in got)
        for x, y in zip(got, single):
            assert math.isclose(x, y, rel_tol=2e-2), (precision, got, single)
