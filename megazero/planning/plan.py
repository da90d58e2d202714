"""A run's memory plan from its Config: what ``memory.estimate`` needs, read off the settings.

The model's sizes come in as a ``memory.ModelSizes`` (``model.config.GPTConfig``, which
megazero does not import); ``on_cuda`` says whether the run's devices are GPUs, where an
offloaded optimizer's fp32 state lives in host memory and leaves the device's count. The
trainer's preflight, ``python -m scripts.plan`` and the tests plan through here.

The model's sizes also judge one setting the config alone cannot: ``zero3_live_warning`` (a
``--zero3-max-live-parameters`` below the smallest ZeRO-3 gather unit can never hold), and
the plan counts what is gathered at once even when that bound is lower.
"""

from __future__ import annotations

from typing import Optional

from megazero.config import Config, bucket_sizes, show_flag
from megazero.context_parallel.sdpa_kernels import SM90, CudaPlatform
from megazero.data_parallel.policy import BUCKETS_IN_FLIGHT, sharding_policy
from megazero.pipeline.partition import chunk_layout
from megazero.planning import memory
from megazero.planning.activations import ActivationSettings, attention_kernel, head_size, math_core_bytes
from megazero.precision import model_dtype


def activation_settings(cfg: Config, platform: Optional[CudaPlatform] = None) -> ActivationSettings:
    """What the planner needs to count this run's activations (``megazero.planning.activations``);
    ``platform`` the GPU whose attention kernels run (None: CPU ranks)."""
    m, p, pr = cfg.model, cfg.parallel, cfg.precision
    return ActivationSettings(
        micro_batch_size=cfg.train.micro_batch_size,
        tp=p.tp,
        sequence_parallel=p.sequence_parallel and p.tp > 1,
        activation_bytes=model_dtype(pr.fp16, pr.bf16).itemsize,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        cp=p.cp,
        cp_comm_type=p.cp_comm_type,
        cp_ring_kernel=p.cp_ring_kernel,
        documents=cfg.data.reset_attention_mask,
        platform=platform,
        sinks=m.softmax_type != "vanilla",
        logits_bytes=4 if pr.fp8_format is None else 8,
    )


def layout_settings(cfg: Config, on_cuda: bool) -> dict:
    """The layout, schedule, ZeRO stage and byte widths (bytes per element) of ``cfg``, as the
    keyword arguments ``memory.estimate`` and ``memory.stage_estimates`` share. Their ``dp`` is
    the number of ranks ZeRO shards over: the replicas, dp x cp (``ProcessGroups.replicas``), or
    the shard size S of hybrid sharding (``--zero-shard-size``: the state is replicated over the
    dp x cp / S groups, so the formulas hold with N = S); ``ep`` the expert-parallel size of an
    MoE model (1 for a dense one; its expert state shards over ``dp / ep``: dp x cp / EP, or
    S / EP under hybrid sharding); ``states_on_host`` / ``params_on_host``: the optimizer state /
    ZeRO-3's parameter shards offloaded off the GPU (``--offload-optimizer`` / ``--offload-param``
    cpu or nvme; on a CPU run the host is the planned memory, so nothing leaves it);
    ``reference``: DPO's frozen reference model in the planned memory (not SimPO's, which has
    none; not with ``--ref-offload`` on a GPU); ``muon``: ``--optimizer muon`` (one moment on the
    hidden matrices)."""
    p, pr = cfg.parallel, cfg.precision
    dtype = model_dtype(pr.fp16, pr.bf16)
    return dict(
        tp=p.tp,
        pp=p.pp,
        dp=cfg.zero.zero_shard_size or p.dp * p.cp,
        vp_size=p.virtual_pipeline_size,
        layer_split=p.pipeline_layer_split,
        schedule=p.pipeline_schedule,
        num_microbatches=cfg.train.gradient_accumulation_steps,
        zero_stage=cfg.zero.stage,
        param_bytes=dtype.itemsize,
        grad_bytes=4 if pr.accumulate_allreduce_grads_in_fp32 else dtype.itemsize,
        states_on_host=cfg.zero.offload_optimizer != "none" and on_cuda,
        params_on_host=cfg.zero.offload_param != "none" and sharding_policy(cfg.zero.stage).shards_params and on_cuda,
        ep=p.expert_model_parallel_size if cfg.model.num_experts is not None else 1,
        etp=p.expert_tensor_parallel_size if cfg.model.num_experts is not None else None,
        reference=cfg.post.mode == "dpo" and cfg.post.dpo_loss != "simpo" and not (cfg.post.ref_offload and on_cuda),
        muon=cfg.optim.optimizer == "muon",
    )


def zero3_units(cfg: Config, model: memory.ModelSizes) -> list[list[dict[str, int]]]:
    """The ZeRO-3 gather units of each pipeline stage (index = pp rank), per model chunk: unit
    name -> elements on one rank of that stage (``memory.zero3_units``)."""
    p = cfg.parallel
    return [
        memory.zero3_units(
            model,
            p.tp,
            p.pp,
            r,
            p.virtual_pipeline_size,
            p.pipeline_layer_split,
            cfg.zero.zero3_param_persistence_threshold,
            chunk_layout(p.pipeline_schedule),
        )
        for r in range(p.pp)
    ]


def zero3_live_warning(cfg: Config, model: memory.ModelSizes) -> Optional[str]:
    """At ZeRO-3, a ``--zero3-max-live-parameters`` below the smallest gather unit of a stage
    can never hold: ``zero3_gather`` gathers a unit on demand anyway (releasing idle ones
    first) and never prefetches, so the bound limits nothing. Returns that warning, else None."""
    if not sharding_policy(cfg.zero.stage).shards_params:
        return None
    bound = cfg.zero.zero3_max_live_parameters
    stages = zero3_units(cfg, model)
    for r, chunks in enumerate(stages):
        units = sorted((n, name) for c in chunks for name, n in c.items())
        if units and bound < units[0][0]:
            n, name = units[0]
            where = (f"pipeline stage {r}: " if cfg.parallel.pp > 1 else "") + (
                "the chunk's own parameters" if name == "chunk" else name
            )
            need = max(memory.zero3_gathered_at_once(c) for c in stages)
            return (
                f"{show_flag(cfg, 'zero.zero3_max_live_parameters')} {bound:,} is below the smallest "
                f"ZeRO-3 gather unit ({where}, {n:,} elements per rank), so the bound can never "
                "hold: every unit is gathered anyway when it computes (idle ones released first) and "
                f"nothing is prefetched; fix: give at least {need:,} (what is gathered at once: the "
                "chunk's own parameters and the two largest units) or leave the default"
            )
    return None


def _buckets(cfg: Config, model: memory.ModelSizes) -> tuple:
    """(reduce, all-gather bucket, buckets in flight, gathered ZeRO-3 elements): the live bound,
    or what is gathered at once when that is more (``zero3_gather`` exceeds a lower bound)."""
    live = cfg.zero.zero3_max_live_parameters
    if sharding_policy(cfg.zero.stage).shards_params:
        live = max([live] + [memory.zero3_gathered_at_once(c) for c in zero3_units(cfg, model)])
    return bucket_sizes(cfg) + (BUCKETS_IN_FLIGHT, live)


def cuda_platform(on_cuda: bool, platform: Optional[CudaPlatform]) -> Optional[CudaPlatform]:
    """The GPU the attention kernels are planned for: ``platform``, else on CUDA an sm90
    (H100/H200) with a recent cuDNN (``sdpa_kernels.SM90``), else None (CPU ranks)."""
    return (platform or SM90) if on_cuda else None


def attention_math_warning(cfg: Config, model: memory.ModelSizes, platform: Optional[CudaPlatform]) -> Optional[str]:
    """A warning naming the attention configuration that CUDA SDPA runs on its math kernel
    (``activations.attention_kernel``), with the fp32 scores it keeps per layer, else None
    (also on CPU ranks, ``platform`` None)."""
    a = activation_settings(cfg, platform)
    if platform is None or attention_kernel(model, a) != "math":
        return None
    d = head_size(model)
    dtype = "fp32" if a.activation_bytes == 4 else "bf16/fp16"
    docs = " with --reset-attention-mask" if a.documents else ""
    return (
        f"attention in {dtype} with head size {d} (--kv-channels, else --hidden-size {model.hidden_size} / "
        f"--num-attention-heads {model.num_attention_heads}){docs} has no fused SDPA kernel on this GPU "
        f"and runs PyTorch's math kernel: {math_core_bytes(model, a) / 2**20:,.1f} MiB of fp32 scores "
        "per layer and micro-batch, counted in the plan; fix: a head size that is a multiple of 8"
    )


def plan_memory(
    cfg: Config, model: memory.ModelSizes, *, on_cuda: bool = False, platform: Optional[CudaPlatform] = None
) -> memory.MemoryEstimate:
    """Bytes per rank of the most loaded pipeline stage before anything is allocated; on CUDA
    the attention kernels of ``platform`` (``cuda_platform``)."""
    p = cfg.parallel
    return memory.estimate(
        model,
        **layout_settings(cfg, on_cuda),
        micro_batch_size=cfg.train.micro_batch_size,
        sequence_parallel=p.sequence_parallel and p.tp > 1,
        cp=p.cp,
        activations=activation_settings(cfg, cuda_platform(on_cuda, platform)),
        buckets=_buckets(cfg, model),
    )


def plan_stages(
    cfg: Config, model: memory.ModelSizes, *, on_cuda: bool = False, platform: Optional[CudaPlatform] = None
) -> list[memory.MemoryEstimate]:
    """The memory plan of every pipeline stage (index = pp rank), as ``plan_memory`` counts it."""
    a = activation_settings(cfg, cuda_platform(on_cuda, platform))
    return memory.stage_estimates(model, **layout_settings(cfg, on_cuda), a=a, buckets=_buckets(cfg, model))


def nvme_swap_bytes(cfg: Config, plan: memory.MemoryEstimate) -> int:
    """Bytes one rank's NVMe swap files take (an upper bound: the most loaded stage's ``plan``):
    ``--offload-optimizer nvme`` 12 bytes (fp32 main param and two moments) per owned element,
    ``--offload-param nvme`` at ZeRO-3 ``p`` bytes per owned element past
    ``--offload-param-max-in-cpu``, each file plus its 4 KiB header
    (``megazero/offload/swap.py``); 0 without NVMe offload."""
    z, pr = cfg.zero, cfg.precision
    owned = -(-plan.params // max(1, plan.dp))
    total = 0
    if z.offload_optimizer == "nvme":
        total += 4096 + 12 * owned
    if z.offload_param == "nvme" and sharding_policy(z.stage).shards_params:
        total += 4096 + model_dtype(pr.fp16, pr.bf16).itemsize * max(0, owned - z.offload_param_max_in_cpu)
    return total
