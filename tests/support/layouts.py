"""The layout sweep's shared pieces: BASE (a 4-layer GPT on mock data) and LLAMA flags, one layout's
training run on gloo ranks (train_layout, train_layouts), the oracle's losses computed once per
pytest process (reference_losses, single_layout_run) and the per-layout assertions (check_layout)."""

import functools
import math
import os

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.paths import REPO

STEPS = 10


# Steps of the layout sweeps (tests/layouts/test_train.py, test_context_parallel.py): the learning
# rate's warm-up (1-3, the peak at 3) and decay (4), Adam from its moments from step 2 and, with a
# global norm above --clip-grad 1.0 in the first steps, the clipping.
SWEEP_STEPS = 4

FEATURE_STEPS = 6
"""Steps of the sweeps of the open checkpoints' block features (RoPE scaling, q/k/v bias,
--kv-channels, QK-norm): their layouts are compared with the oracle over 6 steps, 2 past the
decay's start, where a wrong gradient of a small parameter (the QK-norm weights') shows."""


BASE = [
    "--mock-data",
    "--vocab-size",
    "1001",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--train-iters",
    str(STEPS),
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-warmup-iters",
    "3",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--seed",
    "7",
    "--make-vocab-size-divisible-by",
    "8",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
]


def train_layout(rank, world, argv, steps):
    from megazero import training
    from megazero.training import build_trainer

    trainer = build_trainer(argv, world)
    cfg, groups = trainer.cfg, trainer.groups
    p = cfg.parallel
    losses, norms = [], []
    for _ in range(steps):
        batches = trainer.next_batches()
        out = trainer.train_step(batches).values
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
    from megazero.pipeline.partition import chunk_layout
    from megazero.planning import memory

    psi = (
        sum(q.numel() for c in trainer.chunks for q in c.parameters()),  # built vs counted
        memory.params_per_rank(
            trainer.gpt_config,
            p.tp,
            p.pp,
            groups.pp_rank,
            p.virtual_pipeline_size,
            p.pipeline_layer_split,
            layout=chunk_layout(p.pipeline_schedule),  # ZB-V: the last chunk (final norm, head) on stage 0
        ),
    )
    ids = (  # 18 ids each: the window slides
        training.generate_ids(trainer, SAMPLE_PROMPT, SAMPLE_NEW),  # greedy
        training.generate_ids(trainer, SAMPLE_PROMPT, SAMPLE_NEW, temperature=1.0, top_k=20, seed=3),  # drawn
    )
    return losses, norms, ids, psi


PROMPT = [5, 17, 3]
"""The end-of-run sample's prompt (tests/layouts/test_train.py)."""
SAMPLE_PROMPT = [5, 17, 3, 11, 2, 8, 13, 7, 1, 19, 4, 9, 6, 12]
SAMPLE_NEW = 4
"""``train_layout``'s samples: 4 tokens after a 14-token prompt, 18 ids, so the contexts are 14,
15 (odd: sequence parallelism pads it), 16 and the slid window of 16 (the sequence length), one
forward pass each. A prompt of 3 and 15 new tokens ran the same paths in 15 passes per sample, the
most of a ZeRO-3 layout's time (every pass gathers every parameter)."""


def reference_losses(argv, steps) -> list:
    """tests/support/reference.py's losses for ``argv`` over ``steps`` steps: computed once per pytest
    process (every module that compares with the same oracle shares it), on one thread (tiny
    matmuls: many times faster than on two busy cores)."""
    return list(reference_once(tuple(argv), steps))


@functools.lru_cache(maxsize=None)
def reference_once(argv: tuple, steps: int) -> tuple:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tuple(oracle_losses(list(argv), steps))
    finally:
        torch.set_num_threads(threads)


def single_layout_run(argv, steps):
    """``train_layout``'s result for ``argv`` on one spawned rank, run once per pytest process:
    the single-process run every layout's gradient norms and greedy sample are compared with
    (tests/layouts/test_context_parallel.py uses the same ones)."""
    return single_once(tuple(argv), steps)


@functools.lru_cache(maxsize=None)
def single_once(argv: tuple, steps: int):
    return run_distributed(train_layout, 1, list(argv), steps)[0]


def oracle_losses(argv, steps, batches=None, packing=None):
    """tests/support/reference.py's losses for ``argv`` over ``steps`` steps, on ``argv``'s data or on
    ``batches`` (global batches of (tokens, labels)); ``packing``: the reference's document options."""
    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.optim.lr_schedule import LRSchedule
    from model.build import build_gpt_config
    from model.gpt import init_full_weights
    from tests.support.reference import block_options, train_reference

    cfg = config_from_argv(argv, 1)
    run = training.build_data(cfg)
    train_ds, vocab = run.train, run.vocab_size
    gcfg = build_gpt_config(cfg, vocab)
    gbs = cfg.train.global_batch_size
    if batches is None:
        batches = [get_micro_batches(train_ds, s * gbs, gbs, gbs, 0, 1)[0] for s in range(steps)]
    o = cfg.optim
    sched = LRSchedule(o.lr, o.min_lr, o.lr_warmup_iters, cfg.train.train_iters, o.lr_decay_style)
    return train_reference(
        init_full_weights(gcfg, cfg.train.seed),
        batches,
        vocab_size=vocab,
        num_heads=gcfg.num_attention_heads,
        lr=lambda s: sched(s + 1),
        steps=steps,
        betas=(o.adam_beta1, o.adam_beta2),
        weight_decay=o.weight_decay,
        eps=o.adam_eps,
        clip_grad=o.clip_grad,
        block=block_options(gcfg),
        packing=packing,
    )


@pytest.fixture(scope="module")
def reference():
    return reference_losses(BASE, SWEEP_STEPS)


MB4 = ["--micro-batch-size", "4"]


@pytest.fixture(scope="module")
def single_run():
    return single_layout_run(BASE, SWEEP_STEPS)


def train_layouts(rank, world, argvs, steps):
    return [train_layout(rank, world, argv, steps) for argv in argvs]


def check_layout(name, results, reference, single_run, clip=1.0):
    for losses, norms, ids, (built, counted) in results:  # every rank: global loss, norm, sample
        assert losses == results[0][0]
        assert norms == results[0][1]
        assert ids == single_run[2]  # greedy and seeded sampling: the same tokens under every layout
        assert built == counted  # megazero.planning.memory counts each rank's parameters exactly
    losses, norms = results[0][:2]
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert math.isclose(got, want, rel_tol=1e-5), (name, step, got, want)
    assert max(single_run[1]) > clip  # the clip really acts
    assert single_run[2][0] != single_run[2][1]  # the sample is drawn, not the argmax
    for got, want in zip(norms, single_run[1]):
        assert math.isclose(got, want, rel_tol=1e-6), (name, got, want)
    assert losses[-1] < losses[0]


# The LLaMA-style block (RoPE on half of each head, RMSNorm, SwiGLU, 2 query groups for 4
# heads, no linear biases, untied output) under the layouts where the block meets the split:
# tp (query groups and SwiGLU halves per rank), sequence parallelism, every pipeline schedule
# (the untied output layer on the last stage), and tp x pp x dp with all of them. Data
# parallelism and ZeRO alone do not depend on the block (tests/layouts/test_moe.py runs this block
# under dp 4 ZeRO-1/3, tp 2 x dp 2 ZeRO-2 and pp 2 x dp 2), so the sweep's dp-only, pp x dp
# and two of its 8-rank layouts run with the GPT-2 block only. The layouts of one world size
# share one set of spawned ranks.
LLAMA = [
    "--position-embedding-type",
    "rope",
    "--rotary-percent",
    "0.5",
    "--rotary-base",
    "1000",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--clip-grad",
    "0.5",
]


SEEDS = os.path.join(str(REPO), "..", "shared", "cases", "deepspeed")


def seed_case(name: str) -> str:
    """Path of a seed DeepSpeed JSON; skips without ../shared/cases/deepspeed, except under
    CI=true, where a missing folder is a failure (the tests must run there)."""
    path = os.path.join(SEEDS, name)
    if not os.path.exists(path):
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"{path} not present under CI=true; fix: check out the shared cases beside the repository")
        pytest.skip(f"{path} not present")
    return path


def offload_runs(rank, world, argvs, steps):
    """(losses, optimizer class name, bytes_by_place) of a Trainer per argv."""
    from megazero.config import config_from_argv
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training import build_trainer

    out = []
    for argv in argvs:
        cfg = config_from_argv(argv, world)
        trainer = build_trainer(cfg, groups=ProcessGroups.build(Topology(tp=1, pp=1, dp=cfg.parallel.dp)))
        losses = [trainer.train_step(trainer.next_batches()).values["loss"] for _ in range(steps)]
        out.append((losses, type(trainer.optimizer).__name__, trainer.optimizer.bytes_by_place()))
    return out


WIDER = ["--init-method-std", "0.1"]
"""Weights of std 0.1: attention, so positions and the attention features, move the loss more."""


def check_feature_sweep(features: list, layouts: dict, world: int) -> None:
    """A block feature's sweep: ``BASE + features`` under each of ``layouts`` (name -> flags; one
    spawn of ``world`` ranks, FEATURE_STEPS steps) passes ``check_layout`` against the oracle
    (losses within 1e-5 relative, gradient norms and sample the single process's, clip 0.5), and
    the features move the oracle's last loss by 10x that tolerance from the plain LLaMA block's."""
    argv = BASE + features
    reference, single = reference_losses(argv, FEATURE_STEPS), single_layout_run(argv, FEATURE_STEPS)
    plain = reference_losses(BASE + LLAMA + WIDER, FEATURE_STEPS)
    assert not math.isclose(reference[-1], plain[-1], rel_tol=1e-4)  # the features matter
    argvs = [argv + flags for flags in layouts.values()]
    per_rank = run_distributed(train_layouts, world, argvs, FEATURE_STEPS, timeout_s=300 * len(argvs))
    for i, name in enumerate(layouts):
        check_layout(name, [r[i] for r in per_rank], reference, single, clip=0.5)
