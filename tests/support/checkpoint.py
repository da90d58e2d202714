"""Checkpoint round trips through build_trainer: ARGS and run_checkpointed (train, save, load under a
layout)."""

from tests.support.layouts import BASE

ARGS = [a if a != "10" else "6" for a in BASE]  # --train-iters 6: the LR schedule spans the whole run


def run_checkpointed(rank, world, argv, steps, save=None, load=None):
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    cfg = config_from_argv(argv + (["--load", load] if load else []), world)
    trainer = build_trainer(cfg, data=training.prepare_run(cfg))  # sized for the resumed samples
    cfg = trainer.cfg
    start = trainer.load_checkpoint(load) if load else None
    losses = []
    for _ in range(steps):
        batches = trainer.next_batches()
        losses.append(trainer.train_step(batches).values["loss"])
    if save:
        trainer.save_checkpoint(save)
    return losses, start, trainer.state.consumed_samples
