"""--compile: torch.compile of each transformer layer gives the eager run's fp32 losses within
1e-5 (tensor parallel with sequence parallelism and its collectives inside the layers, a
pipeline with ZeRO-2, and ZeRO-3, whose per-layer gather hooks run around the compiled
layers). Slow: inductor compiles the layer on every rank (minutes on CPU).

The sweep's model has 2 layers, not BASE's 4: the second layer runs the first one's compiled
graphs (the same code, guards and shapes), as layers 3 and 4 would, and each layer's call walks
its graph breaks (the collectives' counters) through dynamo once per step, so every layer costs
seconds per rank. The pipeline still has a layer per stage and ZeRO-3 a gather unit per layer."""

import pytest

from tests.support.distributed import run_distributed
from tests.support.layouts import BASE

STEPS = 3
_LAYERS = BASE.index("--num-layers") + 1
MODEL = BASE[:_LAYERS] + ["2"] + BASE[_LAYERS + 1 :]  # BASE with 2 layers
LAYOUTS = {
    "tp2 SP": ["--tp", "2", "--sequence-parallel"],
    "pp2 1F1B ZeRO-2": ["--pp", "2", "--zero-stage", "2"],
    "dp2 ZeRO-3": ["--dp", "2", "--zero-stage", "3", "--zero3-param-persistence-threshold", "0"],
}


def _losses(rank, world, argv, steps):
    """The losses of ``steps`` training steps, nothing after them: a sample would compile the layers
    again for each new context length (tests/support/layouts.py's train_layout samples)."""
    from megazero.training import build_trainer

    trainer = build_trainer(argv, world)
    losses = [trainer.train_step(trainer.next_batches()).values["loss"] for _ in range(steps)]
    trainer.close()
    return losses


def _eager_and_compiled(rank, world, steps):
    import torch._dynamo

    # a layer that keeps failing its guards (e.g. on a Python counter its collectives bump)
    # recompiles up to recompile_limit times and then runs uncompiled, silently: fail instead
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    out = {}
    for name, extra in LAYOUTS.items():
        eager = _losses(rank, world, MODEL + extra, steps)
        compiled = _losses(rank, world, MODEL + extra + ["--compile"], steps)
        out[name] = eager, compiled
    return out


@pytest.mark.slow
def test_compiled_layers_match_eager_losses():
    result = run_distributed(_eager_and_compiled, 2, STEPS, timeout_s=1500, collective_timeout_s=900)[0]
    for name, (eager, compiled) in result.items():
        assert len(compiled) == STEPS
        for e, c in zip(eager, compiled):
            assert abs(e - c) <= 1e-5, (name, eager, compiled)


def test_compile_wraps_only_the_layers():
    """Parameter names (checkpoints, tags) are unchanged; embedding and head stay eager."""
    import torch

    from megazero.config import config_from_argv
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from model.build import build_gpt_config, build_model_chunks

    cfg = config_from_argv(BASE + ["--compile"], 1)
    gcfg = build_gpt_config(cfg, 1001)
    groups = ProcessGroups.build(Topology(tp=1, pp=1, dp=1))
    plain = build_model_chunks(gcfg, config_from_argv(BASE, 1), groups, torch.device("cpu"))[0]
    chunk = build_model_chunks(gcfg, cfg, groups, torch.device("cpu"))[0]
    assert [n for n, _ in chunk.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(layer._compiled_call_impl is not None for layer in chunk.layers.values())
    assert getattr(chunk.embedding, "_compiled_call_impl", None) is None
