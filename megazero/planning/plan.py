"""A run's memory plan from its Config: what ``memory.estimate`` needs, read off the settings.

The model's sizes come in as a ``memory.ModelSizes`` (``model.config.GPTConfig``, which
megazero does not import); ``on_cuda`` says whether the run's devices are GPUs, where an
offloaded optimizer's fp32 state lives in host memory and leaves the device's count. train.py's preflight, ``scripts/plan.py`` and the tests plan through here.
"""
from __future__ import annotations

from megazero.config import Config, bucket_sizes
from megazero.planning import memory
from megazero.planning.activations import ActivationSettings
from megazero.precision import model_dtype


def activation_settings(cfg: Config) -> ActivationSettings:
    """What the planner needs to count this run's activations (``megazero.planning.activations``)."""
    m, p, pr = cfg.model, cfg.parallel, cfg.precision
    return ActivationSettings(
        micro_batch_size=cfg.train.micro_batch_size, tp=p.tp, sequence_parallel=p.sequence_parallel and p.tp > 1,
        activation_bytes=model_dtype(pr.fp16, pr.bf16).itemsize, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers)


def layout_settings(cfg: Config, on_cuda: bool) -> dict:
    """The layout, schedule, ZeRO stage and byte widths (bytes per element) of ``cfg``, as the
    keyword arguments ``memory.estimate`` and ``memory.stage_estimates`` share."""
    p, pr = cfg.parallel, cfg.precision
    dtype = model_dtype(pr.fp16, pr.bf16)
    return dict(tp=p.tp, pp=p.pp, dp=p.dp, vp_size=p.virtual_pipeline_size, layer_split=p.pipeline_layer_split,
                schedule=p.pipeline_schedule, num_microbatches=cfg.train.gradient_accumulation_steps,
                zero_stage=cfg.zero.stage, param_bytes=dtype.itemsize,
                grad_bytes=4 if pr.accumulate_allreduce_grads_in_fp32 else dtype.itemsize,
                states_on_host=cfg.zero.offload_optimizer == "cpu" and on_cuda)


def _buckets(cfg: Config) -> tuple:
    return bucket_sizes(cfg) + (2, cfg.zero.zero3_max_live_parameters)


def plan_memory(cfg: Config, model: memory.ModelSizes, *, on_cuda: bool = False) -> memory.MemoryEstimate:
    """Bytes per rank of the most loaded pipeline stage before anything is allocated."""
    p = cfg.parallel
    return memory.estimate(model, **layout_settings(cfg, on_cuda), micro_batch_size=cfg.train.micro_batch_size,
                           sequence_parallel=p.sequence_parallel and p.tp > 1,
                           activations=activation_settings(cfg), buckets=_buckets(cfg))


def plan_stages(cfg: Config, model: memory.ModelSizes, *, on_cuda: bool = False) -> list[memory.MemoryEstimate]:
    """The memory plan of every pipeline stage (index = pp rank), as ``plan_memory`` counts it."""
    return memory.stage_estimates(model, **layout_settings(cfg, on_cuda), a=activation_settings(cfg),
                                  buckets=_buckets(cfg))
