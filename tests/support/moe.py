"""The MoE layouts' shared pieces: ARGS of the MoE GPT, MOE_STEPS, and the dense-oracle reference of
the routed model (moe_reference), computed once per pytest process."""

import functools

import torch

from tests.support.layouts import BASE, LLAMA

MOE = [
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-shared-expert-intermediate-size",
    "32",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
]


ARGS = BASE + LLAMA + MOE


# steps of BASE's 10-iteration schedule: warm-up (1-3, the peak at 3) and decay (4), Adam from its
# moments; every layout of tests/layouts/test_moe.py and tests/layouts/test_moe_ep.py, and their references
MOE_STEPS = 4


def moe_reference(argv, steps):
    """tests/support/reference.py's MoE run for ``argv``: (losses, stats), computed once per pytest
    process (tests/layouts/test_moe_ep.py and tests/layouts/test_zero_bubble_train.py share it); read only."""
    return _reference_once(tuple(argv), steps)


@functools.lru_cache(maxsize=None)
def _reference_once(argv: tuple, steps: int):
    argv = list(argv)
    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.optim.lr_schedule import LRSchedule
    from model.build import build_gpt_config
    from model.gpt import init_full_weights
    from tests.support.reference import block_options, train_reference

    cfg = config_from_argv(argv, 1)
    run = training.build_data(cfg)
    gcfg = build_gpt_config(cfg, run.vocab_size)
    gbs = cfg.train.global_batch_size
    batches = [get_micro_batches(run.train, s * gbs, gbs, gbs, 0, 1)[0] for s in range(steps)]
    o = cfg.optim
    sched = LRSchedule(o.lr, o.min_lr, o.lr_warmup_iters, cfg.train.train_iters, o.lr_decay_style)
    block = block_options(gcfg)
    block["moe"]["group_rows"] = cfg.train.micro_batch_size  # route per micro-batch, as the trainer
    stats, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: two threads made the oracle 20x slower on 2 busy cores
    try:
        losses = train_reference(
            init_full_weights(gcfg, cfg.train.seed),
            batches,
            vocab_size=run.vocab_size,
            num_heads=gcfg.num_attention_heads,
            lr=lambda s: sched(s + 1),
            steps=steps,
            betas=(o.adam_beta1, o.adam_beta2),
            weight_decay=o.weight_decay,
            eps=o.adam_eps,
            clip_grad=o.clip_grad,
            block=block,
            stats=stats,
        )
    finally:
        torch.set_num_threads(threads)
    return losses, stats
