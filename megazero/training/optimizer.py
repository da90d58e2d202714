"""The gradient buffers and the optimizer of a run: ZeRO stage 0-3 over flat buffers, the
fp16 loss scaler, and Adam on the device, the host (ZeRO-Offload) or NVMe (ZeRO-Infinity)."""

from __future__ import annotations

import torch

from megazero.config import Config, bucket_sizes, overlap_param_gather
from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.zero3_gather import Zero3Options
from megazero.offload.param_swap import ParamSwapOptions
from megazero.optim.muon import MuonOptimizer
from megazero.optim.nvme import NvmeOffloadOptimizer
from megazero.optim.offload import HostOffloadOptimizer
from megazero.optim.zero import DistributedOptimizer
from megazero.precision import DynamicLossScaler, StaticLossScaler, model_dtype
from megazero.process_groups import ProcessGroups
from model.build import initial_values, zero3_units
from model.qk_clip import QKClip


def build_optimizer(chunks, cfg: Config, groups: ProcessGroups) -> tuple[DataParallel, DistributedOptimizer]:
    """Gradient buffers (ZeRO stage 0-3) and the sharded Adam that owns the fp32 main params."""
    z, pr, o = cfg.zero, cfg.precision, cfg.optim
    grad_dtype = torch.float32 if pr.accumulate_allreduce_grads_in_fp32 else model_dtype(pr.fp16, pr.bf16)
    reduce_bucket, allgather_bucket = bucket_sizes(cfg)
    reshard = z.zero3_reshard_after_forward
    zero3 = Zero3Options(
        prefetch_bucket_size=z.zero3_prefetch_bucket_size,
        max_live_parameters=z.zero3_max_live_parameters,
        param_persistence_threshold=z.zero3_param_persistence_threshold,
        max_reuse_distance=z.zero3_max_reuse_distance,
        offload_param=z.offload_param == "cpu",
        param_swap=None
        if z.offload_param != "nvme"
        else ParamSwapOptions(
            z.offload_nvme_path,
            buffer_count=z.offload_param_buffer_count,
            buffer_size=z.offload_param_buffer_size,
            max_in_cpu=z.offload_param_max_in_cpu,
        ),
        fp8_param_gather=pr.fp8_param_gather,
    )
    ddp = DataParallel(
        chunks,
        groups,
        zero_stage=z.stage,
        bucket_size=reduce_bucket,
        overlap_comm=z.overlap_comm,
        grad_dtype=grad_dtype,
        reshard_after_forward=cfg.parallel.pp == 1 if reshard == "auto" else reshard == "on",
        units=[zero3_units(c) for c in chunks],
        zero3=zero3,
        initial_values=initial_values(chunks),
    )  # ZeRO-3: built into the shards
    scaler = None
    if pr.fp16:
        scaler = (
            StaticLossScaler(pr.loss_scale)
            if pr.loss_scale > 0
            else DynamicLossScaler(
                initial_scale_power=pr.initial_scale_power,
                loss_scale_window=pr.loss_scale_window,
                hysteresis=pr.hysteresis,
                min_loss_scale=pr.min_loss_scale,
                max_consecutive_skips=pr.max_consecutive_skips,
            )
        )
    kw = dict(
        beta1=o.adam_beta1,
        beta2=o.adam_beta2,
        eps=o.adam_eps,
        weight_decay=o.weight_decay,
        clip_grad=o.clip_grad,
        loss_scaler=scaler,
        allgather_bucket_size=allgather_bucket,
        adam_backend=o.kernels,
        max_consecutive_skips=pr.max_consecutive_skips,
        overlap_param_gather=overlap_param_gather(cfg),
        exact_norm=pr.fp8_format is not None,  # FP8: a clip coefficient independent of the layout's pieces
    )
    if z.offload_optimizer == "nvme":  # ZeRO-Infinity: fp32 state in swap files, Adam on the host
        return ddp, NvmeOffloadOptimizer(
            ddp,
            groups,
            pin_memory=z.offload_optimizer_pin_memory,
            nvme_path=z.offload_nvme_path,
            buffer_count=z.offload_nvme_buffer_count,
            sub_group_size=z.sub_group_size,
            io_threads=z.offload_nvme_io_threads,
            **kw,
        )
    if z.offload_optimizer == "cpu":  # ZeRO-Offload: fp32 state and Adam on the host
        return ddp, HostOffloadOptimizer(ddp, groups, pin_memory=z.offload_optimizer_pin_memory, **kw)
    if o.optimizer == "muon":  # Muon on the hidden matrices, AdamW on the rest
        muon = dict(momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps)
        muon["ns_dtype"] = torch.float32 if o.muon_ns_dtype == "fp32" else torch.bfloat16
        if o.qk_clip:  # Kimi K2's MuonClip: per-head rescaling of q and k after the update
            muon["qk_clip"] = QKClip(chunks, groups, o.qk_clip_threshold, o.qk_clip_alpha)
        return ddp, MuonOptimizer(ddp, groups, adjust_lr=o.muon_adjust_lr, **muon, **kw)
    return ddp, DistributedOptimizer(ddp, groups, **kw)
