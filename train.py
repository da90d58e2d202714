"""megazero's trainer: config -> groups -> stage model -> DDP/ZeRO -> data -> loop.

Launched by ``scripts/pretrain_gpt.sh`` through torchrun (one process per rank; reads
WORLD_SIZE / RANK / LOCAL_RANK), or directly as ``python train.py ...`` for one process.
Each step of the orchestration is a named function below; the parallel machinery lives in
``megazero/``, the GPT in ``model/``, the data pipeline in ``data/``.
"""
from __future__ import annotations

import gc
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megazero import checkpoint, collectives
from megazero.checkpoint.manager import CheckpointManager, RunState
from megazero.planning import memory
from megazero.runtime import resilience
from megazero.runtime.extras import MissingExtra
from megazero.planning.plan import plan_memory, zero3_live_warning
from megazero.runtime import flight_recorder
from megazero.runtime.launch import (DeviceError, Launch, bind_device, check_device, launch_exports,
                                     max_connections_warning, read_launch_env, uses_cuda, watch_parent)
from megazero.config import (Config, bucket_sizes, config_from_argv, describe, layout_topology, overlap_param_gather,
                             resolve_run_dir, to_dict)
from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.zero3_gather import Zero3Options
from megazero.planning.flops import spec_flops_per_iteration
from megazero.runtime.monitor import Monitor, Timer, memory_stats, peak_flops, throughput, unigram_entropy
from megazero.ops.backend import describe_backends
from megazero.optim.lr_schedule import LRSchedule
from megazero.offload.param_swap import ParamSwapOptions
from megazero.optim.nvme import NvmeOffloadOptimizer
from megazero.optim.offload import HostOffloadOptimizer
from megazero.offload.swap import SwapError
from megazero.optim.zero import DistributedOptimizer
from megazero.moe.router import AuxLossBackward
from megazero.pipeline.executor import make_forward_step, run_schedule
from megazero.pipeline.p2p import handshake
from megazero.pipeline.partition import chunk_layout
from megazero.pipeline.schedules import build_schedule, forward_only_schedule
from megazero.precision import DynamicLossScaler, LossScaleError, StaticLossScaler, model_dtype
from megazero.context_parallel.sequence import Packing, counted_targets, shard_micro_batch
from megazero.process_groups import ProcessGroups
from megazero.runtime.profiling import StepProfiler, step_profiler
from megazero.tensor_parallel.random import resume_seed
from data.indexed_dataset import DataError
from data.run_data import RunData
from model.generation import pipeline_generate_greedy
from model.build import (build_gpt_config, build_model_chunks, check_from_hf, initial_values, model_signature,
                         zero3_units)
from model.evaluation import HarnessError
from model.gpt import VOCAB_TENSORS, generate_greedy, moe_step_end
from model.moe_state import expert_bias_state, load_expert_bias
from model.hf import config_record


def setup_groups(cfg: Config, launch: Launch, device: torch.device) -> ProcessGroups:
    """NCCL on ``device`` (bound by ``bind_device``) when it is a GPU, else gloo; every group of
    the layout. On CUDA first the flight recorder's variables (megazero/runtime/flight_recorder.py,
    read when NCCL's process group is created) and the CUDA_DEVICE_MAX_CONNECTIONS check."""
    use_cuda = device.type == "cuda"
    if use_cuda:
        flight_recorder.enable(cfg.log.run_dir, os.environ)
        warning = max_connections_warning(cfg, os.environ)
        if warning and launch.rank == 0:
            print(f"megazero: warning: {warning}", file=sys.stderr, flush=True)
    if launch.world_size > 1:
        timeout = timedelta(seconds=cfg.parallel.distributed_timeout_s)
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout, store=restart_store(timeout), device_id=device if use_cuda else None)
    return ProcessGroups.build(layout_topology(cfg), timeout_s=cfg.parallel.distributed_timeout_s)


def restart_store(timeout: timedelta):
    """After torchrun restarted the group: its agent's store under a key prefix of this attempt.

    torchrun's static rendezvous keeps one store for every attempt, so without a prefix the
    restarted ranks read the dead attempt's gloo addresses and time out ("Connection refused").
    None (torch's own env:// store) on the first attempt or when the agent hosts no store.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"megazero/attempt_{attempt}", store)


# -- optimizer ------------------------------------------------------------------------------
def build_optimizer(chunks, cfg: Config, groups: ProcessGroups) -> tuple[DataParallel, DistributedOptimizer]:
    """Gradient buffers (ZeRO stage 0-3) and the sharded Adam that owns the fp32 main params."""
    z, pr, o = cfg.zero, cfg.precision, cfg.optim
    grad_dtype = torch.float32 if pr.accumulate_allreduce_grads_in_fp32 else model_dtype(pr.fp16, pr.bf16)
    reduce_bucket, allgather_bucket = bucket_sizes(cfg)
    reshard = z.zero3_reshard_after_forward
    zero3 = Zero3Options(prefetch_bucket_size=z.zero3_prefetch_bucket_size,
                         max_live_parameters=z.zero3_max_live_parameters,
                         param_persistence_threshold=z.zero3_param_persistence_threshold,
                         max_reuse_distance=z.zero3_max_reuse_distance,
                         offload_param=z.offload_param == "cpu",
                         param_swap=None if z.offload_param != "nvme" else ParamSwapOptions(
                             z.offload_nvme_path, buffer_count=z.offload_param_buffer_count,
                             buffer_size=z.offload_param_buffer_size, max_in_cpu=z.offload_param_max_in_cpu))
    ddp = DataParallel(chunks, groups, zero_stage=z.stage, bucket_size=reduce_bucket,
                       overlap_comm=z.overlap_comm, grad_dtype=grad_dtype,
                       reshard_after_forward=cfg.parallel.pp == 1 if reshard == "auto" else reshard == "on",
                       units=[zero3_units(c) for c in chunks], zero3=zero3,
                       initial_values=initial_values(chunks))   # ZeRO-3: built into the shards
    scaler = None
    if pr.fp16:
        scaler = (StaticLossScaler(pr.loss_scale) if pr.loss_scale > 0 else
                  DynamicLossScaler(initial_scale_power=pr.initial_scale_power,
                                    loss_scale_window=pr.loss_scale_window, hysteresis=pr.hysteresis,
                                    min_loss_scale=pr.min_loss_scale,
                                    max_consecutive_skips=pr.max_consecutive_skips))
    kw = dict(beta1=o.adam_beta1, beta2=o.adam_beta2, eps=o.adam_eps, weight_decay=o.weight_decay,
              clip_grad=o.clip_grad, loss_scaler=scaler, allgather_bucket_size=allgather_bucket,
              adam_backend=o.kernels, max_consecutive_skips=pr.max_consecutive_skips,
              overlap_param_gather=overlap_param_gather(cfg))
    if z.offload_optimizer == "nvme":   # ZeRO-Infinity: fp32 state in swap files, Adam on the host
        return ddp, NvmeOffloadOptimizer(ddp, groups, pin_memory=z.offload_optimizer_pin_memory,
                                         nvme_path=z.offload_nvme_path, buffer_count=z.offload_nvme_buffer_count,
                                         sub_group_size=z.sub_group_size, io_threads=z.offload_nvme_io_threads,
                                         **kw)
    if z.offload_optimizer == "cpu":   # ZeRO-Offload: fp32 state and Adam on the host
        return ddp, HostOffloadOptimizer(ddp, groups, pin_memory=z.offload_optimizer_pin_memory, **kw)
    return ddp, DistributedOptimizer(ddp, groups, **kw)


# -- data -----------------------------------------------------------------------------------
def build_data(cfg: Config, resume: Optional[dict] = None) -> RunData:
    """The tokenizer (None with mock data), the train / valid / test datasets and the vocabulary
    size of this run, as a ``RunData`` (its ``resume`` is the ``resume`` given).

    Every rank builds the same indices (identical everywhere, cached atomically on disk with
    --data-cache-dir); each data-parallel rank later reads only its slice of every global
    batch. ``resume`` (a checkpoint's meta) sizes the train split from the samples already
    consumed, which differ from iterations x global batch after a change of batch size.
    Raises DataError for an unusable corpus, tokenizer or split.
    """
    from data.gpt_dataset import (MockGPTDataset, build_train_valid_test_datasets, parse_data_path,
                                  parse_split, require_files)

    t = cfg.train
    gbs = t.global_batch_size
    evals = (t.train_iters // max(cfg.train.eval_interval, 1) + 1) * cfg.train.eval_iters
    train_samples = t.train_iters * gbs
    if resume is not None:
        done = resume["extra"]["consumed_samples"]
        train_samples = max(train_samples, done + max(t.train_iters - resume["iteration"], 0) * gbs)
    num_samples = (train_samples, max(evals, 1) * gbs, cfg.train.eval_iters * gbs)
    seq = cfg.model.seq_length
    parse_split(cfg.data.split)   # a bad --split is refused also where mock data reads none
    if cfg.train.mock_data:
        vocab = cfg.data.vocab_size
        sets = tuple(MockGPTDataset(vocab, seq, n, t.seed + i) for i, n in enumerate(num_samples))
        return RunData(None, *sets, vocab_size=vocab, resume=resume)
    from data.indexed_dataset import check_same_tokenizer
    from data.tokenizer import load_tokenizer

    blend = parse_data_path(cfg.data.data_path)
    require_files(blend)
    tok = load_tokenizer(cfg.data.tokenizer_model, cfg.data.tokenizer_type)
    if cfg.data.vocab_size is not None and cfg.data.vocab_size != tok.vocab_size:
        raise DataError(f"--vocab-size {cfg.data.vocab_size} differs from the {tok.vocab_size} tokens of "
                        f"--tokenizer-model {cfg.data.tokenizer_model}; fix: drop --vocab-size (the "
                        "tokenizer sets it) or use the matching tokenizer")
    check_same_tokenizer([prefix for _, prefix in blend], tok.sha256,
                         f"--tokenizer-model {cfg.data.tokenizer_model}")
    sft = (cfg.data.sft_packing, tok.eod) if cfg.data.sft else None   # (packing, pad id)
    own_vocab, fim = tok.vocab_size, fim_settings(cfg, tok)   # FIM sentinels may grow tok.vocab_size
    sets = build_train_valid_test_datasets(cfg.data.data_path, cfg.data.split, seq, t.seed,
                                           num_samples, cfg.data.data_cache_dir,
                                           vocab_size=own_vocab, sft=sft, fim=fim)
    if sets[0] is None:
        raise DataError(f"--split {cfg.data.split} leaves no documents for training; fix: give the "
                        "train part a positive share, e.g. --split 969,30,1")
    return RunData(tok, *sets, vocab_size=tok.vocab_size, resume=resume)


def fim_settings(cfg: Config, tok):
    """``data.fim.FIMSettings`` of --fim-rate > 0 (adding the tokenizer's sentinels), else None.
    Raises DataError naming --fim-tokens / --fim-split-sample."""
    from data.fim import build_fim
    from data.tokenizer import add_fim_sentinels

    d = cfg.data
    if d.fim_rate <= 0:
        return None
    return build_fim(tok, add_fim_sentinels(tok, d.fim_tokens), rate=d.fim_rate, spm_rate=d.fim_spm_rate,
                     split_sample=d.fim_split_sample, fragment_rate=d.fim_fragment_rate, no_prefix=d.fim_no_prefix)


def dp_micro_batches(dataset, consumed: int, cfg: Config, groups: ProcessGroups, device):
    """This dp rank's micro-batches of the global batch after ``consumed`` samples, as
    ``(tokens, labels)`` ``[micro, T]`` int64 on ``device``; with ``--sft`` ``(tokens, labels,
    loss_mask)``, the mask float32 and 1 on response labels (data/sft.py). The cp ranks of one
    dp rank read the same ones. On CUDA each tensor is copied from pinned host memory without
    blocking the host (the copies queue on the current stream, ahead of the forward that reads them)."""
    from data.samplers import get_micro_batches

    read = get_micro_batches
    if cfg.data.sft:  # (tokens, labels, loss_mask): the loss on response tokens only
        from data.sft import sft_micro_batches as read
    mbs = read(dataset, consumed, cfg.train.global_batch_size, cfg.train.micro_batch_size,
               groups.dp_rank, groups.dp_size)
    if torch.device(device).type != "cuda":
        return [tuple(x.to(device) for x in mb) for mb in mbs]
    return [tuple(x.pin_memory().to(device, non_blocking=True) for x in mb) for mb in mbs]


def check_resume(cfg: Config, resume: Optional[dict], vocab_size: int) -> None:
    """Raise CheckpointError naming the first model size that differs from the checkpoint's."""
    if resume is None:
        return
    saved, mine = resume["extra"].get("model", {}), model_signature(build_gpt_config(cfg, vocab_size))
    for key, value in mine.items():
        if key in saved and saved[key] != value:
            raise checkpoint.CheckpointError(
                f"--load {cfg.train.load}: the checkpoint has {key} = {saved[key]}, this model {value}; "
                f"fix: use the model settings the checkpoint was saved with, or another --load")
    was, now = (resume["extra"].get("data") or {}).get("tokenizer"), tokenizer_digest(cfg.data.tokenizer_model)
    if was and now and was != now:  # same vocabulary size, other token meanings: the weights would not fit
        raise checkpoint.CheckpointError(
            f"--load {cfg.train.load} was trained with another tokenizer (sha256 {was[:12]}) than "
            f"--tokenizer-model {cfg.data.tokenizer_model} (sha256 {now[:12]}); fix: the tokenizer it was trained with")
    was, now = (resume["extra"].get("tokenizer") or {}).get("fim"), (tokenizer_record(cfg) or {}).get("fim")
    if was and now and was != now:  # the sentinels' rows of the embedding would mean other tokens
        raise checkpoint.CheckpointError(
            f"--load {cfg.train.load} was trained with the FIM sentinels {was}, this run has {now}; fix: the "
            "--fim-tokens and tokenizer it was trained with")


def data_signature(cfg: Config) -> dict:
    """The settings that fix the sample stream (stored in checkpoints, compared on resume)."""
    d = cfg.data
    paths = [os.path.realpath(x) if os.path.exists(x + ".idx") else x for x in d.data_path or []]
    return dict(seed=cfg.train.seed, data_path=paths, split=d.split, mock_data=cfg.train.mock_data,
                seq_length=cfg.model.seq_length, tokenizer=tokenizer_digest(d.tokenizer_model),
                sft=d.sft_packing if d.sft else None,
                fim=[d.fim_rate, d.fim_spm_rate, d.fim_split_sample, d.fim_fragment_rate, d.fim_no_prefix])


def tokenizer_record(cfg: Config) -> Optional[dict]:
    """Where the run's tokenizer is (for scripts/convert_checkpoint.py and generate.py)."""
    d = cfg.data
    if d.tokenizer_model is None or cfg.train.mock_data:
        return None
    from data.tokenizer import fim_record

    return dict(model=os.path.abspath(d.tokenizer_model), type=d.tokenizer_type,
                sha256=tokenizer_digest(d.tokenizer_model),
                fim=fim_record(d.tokenizer_model, d.tokenizer_type, tuple(d.fim_tokens or ()) or None)
                if d.fim_rate > 0 else None)


def tokenizer_digest(path: Optional[str]) -> Optional[str]:
    """sha256 of the tokenizer model file (None without one), as in PREFIX.tokenizer.json."""
    from data.tokenizer import model_sha256

    return model_sha256(path) if path and os.path.exists(path) else None


def resume_warnings(cfg: Config, resume: Optional[dict]) -> list[str]:
    """What a resume from ``resume`` (a checkpoint's meta) will not do as the user may expect."""
    if resume is None:
        return []
    out = []
    if resume["iteration"] >= cfg.train.train_iters:
        out.append(f"--load {cfg.train.load} is at iteration {resume['iteration']}, not below --train-iters "
                   f"{cfg.train.train_iters}: nothing to train; fix: raise --train-iters to continue")
    saved, mine = resume["extra"].get("data"), data_signature(cfg)
    for key in (k for k in mine if saved is not None and k in saved and saved[k] != mine[k] and k != "tokenizer"):
        out.append(f"--load {cfg.train.load} was trained with {key} = {saved[key]}, this run has {mine[key]}: "
                   f"the samples after the resume differ from those of an uninterrupted run")
    return out


# -- one iteration --------------------------------------------------------------------------
@dataclass
class StepOutcome:
    """What one ``Trainer.train_step`` produced.

    ``values``: the logged values (iteration, consumed_samples, lr, loss [nats/token, the
    global batch's token mean], grad_norm, loss_scale, skipped_iterations; an MoE model adds
    moe_aux_loss and moe_z_loss, ``model.gpt.moe_step_end``); ``stop_reason``:
    a stop every rank agreed on in the step's loss all-reduce (``resilience.agree``), else None;
    ``bad_step``: a non-finite loss or gradient outside fp16's loss scaling (the optimizer
    skipped the update).
    """

    values: dict
    stop_reason: Optional[str] = None
    bad_step: bool = False


class Trainer:
    """Everything one rank holds for training; ``train_step`` / ``eval_loss`` run one iteration.

    Args: ``cfg``, ``groups``, ``device``, ``vocab_size`` (the real vocabulary), and the run's
    collaborators: ``stop_flags`` (a callable giving this rank's stop requests,
    ``resilience.local_flags``; default: none), ``fault`` (the test hook's parsed fault or
    None), ``trail`` (the communication phases entered, for a failure report) and ``monitor``
    (where checkpoint records are logged; None logs none), ``eod`` (the tokenizer's
    end-of-document id, which the packed-document flags need). The run's counters are ``state``
    (a ``RunState``), its checkpoints ``checkpoints`` (a ``CheckpointManager``).

    ``train_step`` and ``eval_loss`` take whole sequences; with context parallelism each rank
    keeps its zigzag share (``local_batches``). The data-parallel machinery (gradient
    reduction, ZeRO, optimizer, checkpoint shards, the loss mean) runs over ``replicas``: the
    dp x cp ranks that hold the same parameters.
    """

    def __init__(self, cfg: Config, groups: ProcessGroups, device: torch.device, vocab_size: int, *,
                 stop_flags: Optional[Callable[[], list]] = None, fault: Optional[tuple] = None,
                 trail: Optional[resilience.Trail] = None, monitor: Optional[Monitor] = None,
                 eod: Optional[int] = None):
        self.cfg, self.groups, self.device = cfg, groups, device
        self.replicas = groups.replicas()
        d = cfg.data
        self.packing = Packing(eod, d.reset_attention_mask, d.reset_position_ids, d.eod_mask_loss)
        self.gpt_config = build_gpt_config(cfg, vocab_size)
        self.chunks = build_model_chunks(self.gpt_config, cfg, groups, device)
        self.ddp, self.optimizer = build_optimizer(self.chunks, cfg, self.replicas)
        o = cfg.optim
        self.lr_schedule = LRSchedule(o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters or cfg.train.train_iters,
                                      o.lr_decay_style, o.lr_wsd_decay_iters, o.lr_wsd_decay_style)
        self.num_microbatches = cfg.train.gradient_accumulation_steps
        p = cfg.parallel
        self.actions = build_schedule(p.pipeline_schedule, self.num_microbatches, p.pp, groups.pp_rank,
                                      p.virtual_pipeline_size)
        self.eval_actions = forward_only_schedule(self.num_microbatches, p.virtual_pipeline_size)
        seq = cfg.model.seq_length // p.cp // (p.tp if p.sequence_parallel else 1)
        self.tensor_shape = (cfg.train.micro_batch_size, seq, cfg.model.hidden_size)
        self.dtype = model_dtype(cfg.precision.fp16, cfg.precision.bf16)
        # the loss divisor of one replica rank: its share of the global batch's targets
        self.tokens_per_dp_rank = self.num_microbatches * cfg.train.micro_batch_size * cfg.model.seq_length // p.cp
        g = self.gpt_config
        self.flops_per_iteration = spec_flops_per_iteration(
            g.parameter_spec(p.tp), seq_length=g.seq_length, attention_width=g.hidden_size,
            global_batch_size=cfg.train.global_batch_size)
        if p.pp > 1:
            handshake(groups, self.tensor_shape, self.dtype, self.num_microbatches, device=device)
        self.state = RunState()
        self.stop_flags = stop_flags or (lambda: resilience.local_flags(None, None))
        self.forward_watch = resilience.ForwardWatch(self.chunks, groups, fault=fault)
        self.trail = trail or resilience.Trail()
        self.monitor = monitor
        self.checkpoints = CheckpointManager(self.replicas, keep=cfg.train.keep_latest_checkpoints,
                                             async_save=cfg.train.async_save,
                                             log=None if monitor is None else monitor.log_record)

    def save_checkpoint(self, root: str, wait: bool = False) -> str:
        """Write a layout-independent checkpoint of this iteration (collective); returns its
        directory. With --async-save the files are written in the background (finished by the
        next save, ``finish_save`` or ``wait``); the time the loop was blocked is logged."""
        self.checkpoints.finish()
        self.optimizer.wait_param_gather()
        self.trail.enter(self.state.iteration, "checkpoint save (gathers over dp and tp)")
        g = self.gpt_config
        return self.checkpoints.save(
            root, self.state, self.optimizer, self.chunks, rng_states=self.chunks[0].rng_tracker.get_state(),
            extra=dict(model=model_signature(g), data=data_signature(self.cfg), gpt_config=config_record(g),
                       tokenizer=tokenizer_record(self.cfg),
                       moe_expert_bias=expert_bias_state(self.chunks, self.groups, g)),
            after_write=self._save_fault(), wait=wait)

    def finish_save(self) -> None:
        """Wait for the background checkpoint, if any, and move ``latest`` to it (collective)."""
        self.checkpoints.finish()

    def close(self) -> None:
        """End of the run (collective): the background save finished, the parameter
        all-gathers and ZeRO-3 prefetches waited for, the gradient hooks removed, so that
        nothing asynchronous is in flight and the model and its process groups can be freed
        before ``destroy_process_group`` (issue 26, F1: gloo worker threads that outlived the
        interpreter aborted a finished run)."""
        self.checkpoints.finish()
        self.optimizer.wait_param_gather()
        self.ddp.close()
        if hasattr(self.optimizer, "close"):   # NVMe offload: its swap files go
            self.optimizer.close()

    def _save_fault(self):
        """The test hook's ``savekill`` fault for this save: SIGKILL this rank's process from
        inside the background write (None when it does not apply)."""
        f, pid = self.forward_watch.fault, os.getpid()
        if f is not None and f[0] == "savekill" and f[1:3] == (self.state.iteration, self.groups.rank):
            return lambda: os.kill(pid, signal.SIGKILL)
        return None

    def load_checkpoint(self, root: str) -> Optional[int]:
        """Resume from the latest checkpoint under ``root`` (saved under any layout).

        Returns the iteration resumed from, or None when ``root`` holds no checkpoint yet.
        """
        g = self.gpt_config

        def real_rows(name):  # a vocabulary tensor's padding rows are zeroed, not read
            return g.vocab_size if name in VOCAB_TENSORS else None
        resumed = self.checkpoints.resume(root, self.optimizer, self.chunks, real_rows=real_rows)
        if resumed is None:
            return None
        self.state, meta = resumed
        load_expert_bias(self.chunks, meta["extra"].get("moe_expert_bias", {}))
        tracker = self.chunks[0].rng_tracker
        if meta["rng_state"] is not None:
            tracker.set_state(meta["rng_state"])
            return self.state.iteration
        tracker.reseed(resume_seed(tracker.seed, self.state.iteration))  # every rank, one rule
        if self.groups.rank == 0:
            print(f"[megazero] {meta['directory']} was saved under another layout {meta['layout']}: weights, "
                  f"optimizer and data position restored; every rank's dropout streams re-seeded from --seed "
                  f"and iteration {self.state.iteration} (megazero.tensor_parallel.random.resume_seed)", flush=True)
        return self.state.iteration

    def local_batches(self, batches) -> tuple[list, Union[int, torch.Tensor]]:
        """Whole-sequence micro-batches ``(tokens, labels)``, or ``(tokens, labels, loss_mask)``
        of SFT data (data/sft.py) -> this rank's share (its zigzag ``T/cp`` with a
        ``SequenceInfo``, megazero/context_parallel/sequence.py) and the loss divisor: the
        targets this step counts over all dp ranks, divided by dp x cp (with --eod-mask-loss or
        a loss mask a 0-d fp64 tensor summed over the dp group, no host sync; at least 1, so a
        batch without a response token has loss 0)."""
        g, packing = self.groups, self.packing
        masks = [b[2] if len(b) > 2 else None for b in batches]
        local = [shard_micro_batch(b[0], b[1], cp=g.cp_size, cp_rank=g.cp_rank, packing=packing, loss_mask=m)
                 for b, m in zip(batches, masks)]
        if not packing.eod_mask_loss and all(m is None for m in masks):
            return local, self.tokens_per_dp_rank
        counted = sum(counted_targets(b[1], packing, m) for b, m in zip(batches, masks))
        counted = counted.reshape(()).to(self.device)
        collectives.all_reduce_sum(counted, g.dp)
        return local, counted.clamp_min(1.0) / (g.dp_size * g.cp_size)

    def _run(self, batches, actions, forward_only: bool) -> torch.Tensor:
        watch = None if forward_only else self.forward_watch.watch
        batches, divisor = self.local_batches(batches)
        if not forward_only:
            self.forward_watch.begin(self.state.iteration + 1, batches)
        if not forward_only and self.gpt_config.num_experts is not None:
            # MoE auxiliary losses weigh as Megatron-LM's: coeff x loss per micro-batch, averaged
            # over the micro-batches (and, by the gradient mean, over dp), times the fp16 loss scale
            AuxLossBackward.set_scale(self.optimizer.scale_loss(torch.ones((), device=self.device)) / len(batches))
        return run_schedule(actions, self.chunks, make_forward_step(divisor, watch), batches,
                            self.groups, tensor_shape=self.tensor_shape, dtype=self.dtype,
                            num_microbatches=len(batches), vp_size=self.cfg.parallel.virtual_pipeline_size,
                            before_backward=None if forward_only else self.ddp.before_backward,
                            scale_loss=None if forward_only else self.optimizer.scale_loss,
                            forward_only=forward_only,
                            layout=chunk_layout(self.cfg.parallel.pipeline_schedule),
                            schedule_of=None if forward_only else self._schedule_of)

    def _schedule_of(self, pp_rank: int):
        """The training schedule of stage ``pp_rank`` (the executor reads its neighbours')."""
        p = self.cfg.parallel
        return build_schedule(p.pipeline_schedule, self.num_microbatches, p.pp, pp_rank, p.virtual_pipeline_size)

    def train_step(self, batches) -> StepOutcome:
        """One iteration on this DP rank's micro-batches (a list of (tokens, labels), each
        ``(micro_batch_size, seq_length)`` int64); advances ``state`` and returns the outcome."""
        for c in self.chunks:
            c.train()
        it, trail = self.state.iteration + 1, self.trail
        lr = self.lr_schedule(it)  # warm-up starts above 0 on the first step
        self.ddp.zero_grad()
        trail.enter(it, "the pipeline schedule (forward/backward with p2p, bucketed gradient reduction)")
        loss = self._run(batches, self.actions, forward_only=False)
        trail.enter(it, "the optimizer step (gradient reduction, overflow all-reduce, norm, parameter all-gather)")
        result = self.optimizer.step(lr)
        trail.enter(it, "the loss / stop all-reduce")
        # this DP rank's share -> global mean; the same all-reduce agrees on a stop request
        loss, stop_reason = resilience.agree(loss, self.stop_flags(), self.replicas)
        s = self.state
        s.advance(self.cfg.train.global_batch_size, result.skipped)
        bad = not self.cfg.precision.fp16 and (result.skipped or not math.isfinite(loss))
        values = dict(iteration=s.iteration, consumed_samples=s.consumed_samples, lr=lr, loss=loss,
                      grad_norm=result.grad_norm, loss_scale=result.loss_scale,
                      skipped_iterations=s.skipped_iterations)
        if self.gpt_config.num_experts is not None:
            trail.enter(it, "the MoE statistics and expert-bias all-reduce over dp and pp")
            values.update(moe_step_end(self.chunks, self.groups, self.replicas.dp, self.num_microbatches))
        return StepOutcome(values, stop_reason, bool(bad))

    def locate_bad_step(self) -> str:
        """The one line naming where the last step's non-finite value appeared (collective)."""
        mine = resilience.encode_place(self.forward_watch.first_place())
        gathered = [mine]
        if self.groups.world is not None:
            gathered = [None] * self.groups.world_size
            dist.all_gather_object(gathered, mine, group=self.groups.world)
        place = resilience.locate_non_finite(gathered)
        t = self.cfg.train
        samples = None if place is None else resilience.sample_range(
            self.state.consumed_samples - t.global_batch_size, t.global_batch_size, place.dp_rank,
            self.groups.dp_size, place.microbatch, t.micro_batch_size)
        return resilience.describe_non_finite(self.state.iteration, place, samples,
                                              self.cfg.parallel.virtual_pipeline_size)

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        """Mean token loss of this global batch (forward only), known on every rank."""
        self.optimizer.wait_param_gather()
        for c in self.chunks:
            c.eval()
        loss = self._run(batches, self.eval_actions, forward_only=True)
        collectives.all_reduce_mean(loss, self.replicas.dp)
        return float(loss)


# -- evaluation, logging, summary -----------------------------------------------------------
def evaluate(trainer: Trainer, valid, cfg: Config, eval_round: int) -> tuple[float, np.ndarray]:
    """Mean validation loss over ``--eval-iters`` global batches and their label token counts
    (int64 ``[vocab_size]``, summed over data-parallel ranks: the unigram baseline is of exactly
    these tokens). The counts stay on the trainer's device until the one copy at the end: the
    dp all-reduce runs on the group's backend device (NCCL has no CPU tensors)."""
    gbs, vocab = cfg.train.global_batch_size, trainer.gpt_config.vocab_size
    losses, counts = [], torch.zeros(vocab, dtype=torch.int64, device=trainer.device)
    for i in range(cfg.train.eval_iters):
        consumed = ((eval_round * cfg.train.eval_iters + i) * gbs) % max(len(valid) - gbs + 1, 1)
        batches = dp_micro_batches(valid, consumed, cfg, trainer.groups, trainer.device)
        losses.append(trainer.eval_loss(batches))
        for batch in batches:  # with SFT data, the labels in the loss only
            labels = batch[1] if len(batch) < 3 else batch[1][batch[2] > 0]
            counts += torch.bincount(labels.flatten(), minlength=vocab)[:vocab]
    # each DP rank counted its slice of the global batches: the baseline needs them all
    collectives.all_reduce_sum(counts, trainer.groups.dp)
    return float(np.mean(losses)), counts.cpu().numpy()


def check_harness(cfg: Config) -> None:
    """``--eval-harness-tasks``: every name a task of data/tasks, lm_eval installed, a whole-model
    stage (--pp 1) and a tokenizer. Raises HarnessError or MissingExtra (one line)."""
    from model.evaluation import check_tasks, split_names

    flag = "--eval-harness-tasks"
    if cfg.parallel.pp > 1:
        raise HarnessError(f"{flag} needs --pp 1 (the harness scores with the whole model in one stage; this run: "
                           f"--pp {cfg.parallel.pp}); fix: score a saved checkpoint with scripts/evaluate.py")
    if cfg.train.mock_data:
        raise HarnessError(f"{flag} needs a tokenizer, which --mock-data has none of; fix: --data-path with "
                           "--tokenizer-model")
    check_tasks(split_names(cfg.train.eval_harness_tasks), what=flag, flag=flag)


def harness_due(cfg: Config, it: int) -> bool:
    """Whether iteration ``it`` scores the ``--eval-harness-tasks`` (each interval, and the last)."""
    t = cfg.train
    return bool(t.eval_harness_tasks) and (it == t.train_iters or bool(t.eval_harness_interval
                                                                      and it % t.eval_harness_interval == 0))


def harness_scores(trainer: Trainer, tokenizer, cfg: Config) -> dict:
    """``{task: {metric: value}}`` of the live model on ``--eval-harness-tasks`` (model/evaluation.py;
    pp 1, collective over the model's tp group: every rank scores the same requests)."""
    from model.evaluation import make_lm, run_tasks, split_names

    flag = "--eval-harness-tasks"
    trainer.optimizer.wait_param_gather()
    lm = make_lm(trainer.chunks[0], tokenizer, what=flag)
    return run_tasks(lm, split_names(cfg.train.eval_harness_tasks), limit=cfg.train.eval_harness_limit,
                     what=flag, flag=flag, quiet=True)


def perf_values(trainer: Trainer, cfg: Config, seconds_per_iter: float) -> dict:
    """Throughput, TFLOP/s, MFU (megazero.planning.flops) and memory for one logged iteration."""
    values = throughput(flops_per_iteration=trainer.flops_per_iteration,
                        tokens_per_iteration=cfg.train.global_batch_size * cfg.model.seq_length,
                        iteration_time_s=seconds_per_iter, world_size=trainer.groups.world_size,
                        peak_flops_per_device=(cfg.log.peak_tflops * 1e12 if cfg.log.peak_tflops
                                               else peak_flops(trainer.device, trainer.dtype)))
    return dict(values, iteration_time_s=seconds_per_iter,
                model_state_bytes=trainer.optimizer.model_state_bytes()["total"],
                peak_memory_bytes=memory_stats(trainer.device).get("peak_bytes"))


def report_model_state(trainer: Trainer, monitor: Monitor) -> None:
    """Every rank's model-state bytes beside the ZeRO formula's prediction (and the bound on its
    bucket temporaries), gathered into one table that the logging rank prints (collective)."""
    opt = trainer.optimizer
    got, bound, predicted = opt.model_state_bytes(), opt.bucket_bound_bytes(), opt.formula()
    psi = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    p_bytes = trainer.dtype.itemsize
    g_bytes = trainer.ddp.grad_dtype.itemsize
    formula, m_bytes, offload = predicted["total"], predicted["main_bytes"], predicted["note"]
    row = dict(rank=trainer.groups.rank, psi=psi, formula=formula,
               bytes={(k.replace("host_", "host ") if k.startswith("host") else "host " + k) if k in opt.HOST_PARTS
                      else k: v for k, v in got.items() if k != "total"})
    if got.keys() & set(opt.HOST_PARTS):   # host memory in use: how much of it is page-locked
        row["pinned"] = opt.pinned_bytes()
    rows = [row]
    if trainer.groups.world_size > 1:
        rows = [None] * trainer.groups.world_size
        dist.all_gather_object(rows, row, group=trainer.groups.world)
    experts = f" (expert parameters: N={trainer.replicas.edp_size})" if trainer.replicas.ep_size > 1 else ""
    hybrid = (f" (hybrid sharding: replicated over {trainer.replicas.dp_size // trainer.replicas.zero_shard_size})"
              if trainer.replicas.topology.hybrid else "")
    monitor.log_model_state_table(rows, note=(
        f"ZeRO-{trainer.cfg.zero.stage} formula on the padded Psi with N={trainer.replicas.zero_shard_size}{hybrid}"
        f"{experts}, "
        f"{p_bytes}-byte params, {g_bytes}-byte grads, {m_bytes + 8} bytes/param fp32 optimizer state, "
        f"+ at most {bound} bytes of buckets{offload}"))


def is_logging_rank(groups: ProcessGroups) -> bool:
    """The last pipeline stage holds the loss; its first TP/DP rank writes the logs."""
    return groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0


def generate_ids(trainer: Trainer, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation under any layout (collective over the model-parallel ranks):
    a whole-model stage decodes directly, a pipeline runs one forward-only pass per token. The
    context-parallel ranks decode the whole context each, the same tokens (no cp attention)."""
    if trainer.cfg.parallel.pp == 1:
        ids = torch.tensor([prompt_ids], device=trainer.device)
        return generate_greedy(trainer.chunks[0], ids, max_new_tokens)[0].tolist()
    B, _, H = trainer.tensor_shape
    p = trainer.cfg.parallel
    shape = (B, trainer.cfg.model.seq_length // (p.tp if p.sequence_parallel else 1), H)
    return pipeline_generate_greedy(trainer.chunks, trainer.groups, prompt_ids, max_new_tokens,
                                    seq_length=trainer.cfg.model.seq_length, tensor_shape=shape,
                                    dtype=trainer.dtype, vocab_size=trainer.gpt_config.vocab_size,
                                    layout=chunk_layout(p.pipeline_schedule))


def final_sample(trainer: Trainer, tokenizer, cfg: Config) -> str:
    """A short greedy continuation of ``--prompt`` (needs a tokenizer, i.e. real data)."""
    prompt = tokenizer.encode(cfg.log.prompt) if tokenizer is not None else []
    if not prompt:
        return "(sample generation needs a tokenizer and a non-empty --prompt)"
    return tokenizer.decode(generate_ids(trainer, prompt, cfg.log.generate_tokens))


def wandb_settings(cfg: Config) -> Optional[dict]:
    """Arguments of the Monitor's W&B logger, or None without ``--wandb-project``."""
    lg = cfg.log
    if lg.wandb_project is None:
        return None
    return dict(project=lg.wandb_project, name=lg.wandb_exp_name or os.path.basename(os.path.normpath(lg.run_dir)),
                save_dir=lg.wandb_save_dir or os.path.join(lg.run_dir, "wandb"), config=to_dict(cfg))


def make_profiler(cfg: Config, rank: int) -> StepProfiler:
    """--profile: this rank's torch.profiler window (a no-op on the other ranks)."""
    g = cfg.log
    return step_profiler(g.run_dir, rank, g.profile, g.profile_step_start, g.profile_step_end, g.profile_ranks)


@dataclass
class RunControl:
    """How a run may end early (megazero/runtime/resilience.py): the signals caught, the wall-clock limit,
    whether this rank writes ``stop.json`` (one per node), the restart count and a test fault."""

    signals: Optional[resilience.StopSignals] = None
    clock: Optional[resilience.StopClock] = None
    writes_record: bool = True
    restart: int = 0
    fault: Optional[tuple] = None
    trail: resilience.Trail = field(default_factory=resilience.Trail)

    def flags(self) -> list[float]:
        return resilience.local_flags(self.signals, self.clock)


def inject_fault(control: RunControl, trainer: Trainer) -> None:
    """The test hook's ``kill`` / ``term`` / ``swaptrunc`` / ``paramtrunc`` fault, at the start of
    its iteration (first attempt)."""
    f = control.fault
    if f is not None and f[0] in ("swaptrunc", "paramtrunc") and f[1:3] == (trainer.state.iteration + 1,
                                                                          trainer.groups.rank):
        path = trainer.optimizer.swap_path if f[0] == "swaptrunc" else trainer.ddp.param_swap.swap_path
        os.truncate(path, os.path.getsize(path) - 12)
    if f is not None and f[0] in ("kill", "term") and f[1:3] == (trainer.state.iteration + 1, trainer.groups.rank) \
            and control.restart == 0:
        os.kill(os.getpid(), signal.SIGKILL if f[0] == "kill" else signal.SIGTERM)


def report_restart(cfg: Config, control: RunControl, resumed: Optional[int], monitor: Monitor) -> None:
    """After torchrun restarted the group: restarts so far and the iterations lost, from the
    last iteration the metrics file logged before the failure (exact with --log-interval 1)."""
    if control.restart == 0 or not monitor.is_logging_rank:
        return
    path = os.path.join(cfg.log.run_dir, cfg.log.metrics_file or "")
    logged = [json.loads(x) for x in open(path)] if cfg.log.metrics_file and os.path.exists(path) else []
    last = max([r["iteration"] for r in logged if r.get("kind") == "train"] + [resumed or 0])
    lost = last - (resumed or 0)
    print(f"[megazero] restart {control.restart} of --max-restarts {cfg.train.max_restarts}: resumed at "
          f"iteration {resumed or 0}; {lost} trained iteration(s) lost (the last logged was {last})", flush=True)
    monitor.log_record("restart", dict(restart=control.restart, resumed_iteration=resumed or 0,
                                       last_logged_iteration=last, iterations_lost=lost))


def handle_bad_step(trainer: Trainer, monitor: Monitor) -> Optional[str]:
    """A step with a non-finite loss or gradient (already skipped by the optimizer): count it
    against --skip-bad-batches, or return the error line that ends the run."""
    line, budget, state = trainer.locate_bad_step(), trainer.cfg.train.skip_bad_batches, trainer.state
    if state.bad_batches < budget:
        state.bad_batches += 1
        if trainer.groups.rank == 0:
            print(f"[megazero] skipped iteration {state.iteration}: {line} ({state.bad_batches} of "
                  f"--skip-bad-batches {budget} used)", flush=True)
        monitor.log_record("bad_batch", dict(iteration=state.iteration, message=line,
                                             bad_batches=state.bad_batches))
        return None
    line += "; fix: inspect those samples, lower --lr, or --skip-bad-batches N to skip such steps"
    if trainer.groups.rank == 0:
        print(f"megazero: training error: {line}", file=sys.stderr, flush=True)
    return line


def finish_stop(trainer: Trainer, control: RunControl, reason: str, saved: Optional[str],
                message: str = "") -> dict:
    """End the run early at this step boundary: save (with --save, unless just saved), write
    stop.json, say so. Returns train()'s result with ``stop`` and ``status``."""
    s, it = trainer.cfg.train, trainer.state.iteration
    if reason != "non-finite" and s.save and saved is None:
        saved = trainer.save_checkpoint(s.save)
    trainer.finish_save()  # the checkpoint is complete before the run ends
    trainer.optimizer.wait_param_gather()
    path = saved if reason != "non-finite" else None
    if control.writes_record:
        resilience.write_stop_record(trainer.cfg.log.run_dir, reason=reason, iteration=it,
                                     checkpoint=path, message=message)
    if trainer.groups.rank == 0 and reason != "non-finite":
        where = f"checkpoint saved in {path}" if path else "nothing saved (no --save)"
        print(f"[megazero] stopping after iteration {it} ({reason}): {where}", flush=True)
    return dict(iteration=it, stop=reason, status=resilience.stop_status(reason))


def start_run(cfg: Config, groups: ProcessGroups, device: torch.device, data: RunData,
              control: RunControl) -> tuple[Trainer, Monitor]:
    """The run's Monitor and Trainer (its collaborators passed in), resumed from ``--load``."""
    monitor = Monitor(cfg.log.run_dir, tensorboard_dir=cfg.log.tensorboard_dir,
                      metrics_file=cfg.log.metrics_file, rank=groups.rank,
                      is_logging_rank=is_logging_rank(groups), config_text=describe(cfg),
                      train_iters=cfg.train.train_iters, wandb=wandb_settings(cfg))
    trainer = Trainer(cfg, groups, device, data.vocab_size, stop_flags=control.flags, fault=control.fault,
                      trail=control.trail, monitor=monitor,
                      eod=None if data.tokenizer is None else data.tokenizer.eod)
    resumed = trainer.load_checkpoint(cfg.train.load) if cfg.train.load else None
    if cfg.train.load and groups.rank == 0:
        print(f"[megazero] resumed from {cfg.train.load} at iteration {resumed}" if resumed is not None
              else f"[megazero] no checkpoint under --load {cfg.train.load}: starting from scratch", flush=True)
    report_restart(cfg, control, resumed, monitor)
    if groups.rank == 0:
        print(f"[megazero] {describe_backends(device, cfg.optim.kernels)}; padded vocab "
              f"{trainer.gpt_config.padded_vocab(cfg.parallel.tp)} (real {data.vocab_size})", flush=True)
    return trainer, monitor


def train(cfg: Config, groups: ProcessGroups, device: torch.device, data: RunData,
          control: Optional[RunControl] = None) -> dict:
    """The whole run: model, loop, periodic evaluation, final summary; ``data`` from build_data.
    ``control`` (signals, time limit, test fault) may end it early at a step boundary."""
    control = control or RunControl()
    trainer, monitor = start_run(cfg, groups, device, data, control)
    result = run_loop(trainer, monitor, data, control)
    trainer.close()   # nothing in flight, every hook removed: the model can be freed
    return result


def run_loop(trainer: Trainer, monitor: Monitor, data: RunData, control: RunControl) -> dict:
    """Train until ``--train-iters`` or an agreed stop; evaluate, log and save on the way.
    Returns train()'s result (with ``stop`` and ``status`` after an early stop)."""
    cfg, groups, device = trainer.cfg, trainer.groups, trainer.device
    state, s, exit_interval = trainer.state, cfg.train, cfg.train.exit_interval
    last_valid, counts = None, None
    timer, last_logged = Timer(device), state.iteration
    first_iteration = state.iteration + 1
    profiler = make_profiler(cfg, groups.rank)
    while state.iteration < s.train_iters:
        inject_fault(control, trainer)
        profiler.before_step(state.iteration + 1)
        with timer:  # the step's time includes reading its micro-batches
            batches = dp_micro_batches(data.train, state.consumed_samples, cfg, groups, device)
            outcome = trainer.train_step(batches)
        it = state.iteration
        profiler.after_step(it)
        if it == first_iteration:  # buckets and step temporaries have now been allocated once
            report_model_state(trainer, monitor)
        if it % cfg.log.log_interval == 0 or it == 1 or it == s.train_iters:
            outcome.values.update(perf_values(trainer, cfg, timer.reset() / (it - last_logged)))
            last_logged = it
            monitor.log_iteration(it, outcome.values)
        if outcome.bad_step and (line := handle_bad_step(trainer, monitor)) is not None:
            monitor.close()
            return finish_stop(trainer, control, "non-finite", None, message=line)
        if data.valid is not None and s.eval_iters > 0 and (it % s.eval_interval == 0 or it == s.train_iters):
            last_valid, counts = evaluate(trainer, data.valid, cfg, state.eval_round)
            state.eval_round += 1
            monitor.log_validation(it, last_valid)
        if harness_due(cfg, it):
            monitor.log_harness(it, harness_scores(trainer, data.tokenizer, cfg))
        saved = None
        if s.save and ((s.save_interval and it % s.save_interval == 0) or it == s.train_iters):
            saved = trainer.save_checkpoint(s.save)
        reason = outcome.stop_reason or ("interval" if exit_interval and it % exit_interval == 0 else None)
        if reason is not None and it < s.train_iters:
            profiler.close()
            monitor.close()
            return finish_stop(trainer, control, reason, saved)
    profiler.close()
    trainer.finish_save()
    trainer.optimizer.wait_param_gather()
    sample = final_sample(trainer, data.tokenizer, cfg)
    baseline = unigram_entropy(counts) if counts is not None else float("nan")
    monitor.summary(last_valid, baseline, sample)
    monitor.close()
    return dict(valid_loss=last_valid, unigram_entropy=baseline, iteration=state.iteration)


def prepare_run(cfg: Config, verify: bool = False) -> RunData:
    """Everything that can fail before any process group exists: the checkpoint to resume and
    the data. Returns the RunData, ``resume`` set to the checkpoint's meta (None without
    ``--load`` or a checkpoint); raises DataError or CheckpointError (contract 3).
    ``verify`` re-reads the checkpoint's tensor files against their saved CRC-32 sums."""
    resume = checkpoint.peek(cfg.train.load, verify=verify) if cfg.train.load else None
    data = build_data(cfg, resume)
    check_resume(cfg, resume, data.vocab_size)
    if cfg.train.from_hf:
        check_from_hf(cfg, data.vocab_size)
    if cfg.train.eval_harness_tasks:
        check_harness(cfg)
    return data


def check_memory(cfg: Config, vocab_size: int, verbose: bool) -> None:
    """Print the memory plan (``verbose``) and raise MemoryPlanError when the model states
    cannot fit; a likely activation overflow is a warning, and so is a ZeRO-3 live bound the
    model's gather units make moot (added to ``cfg.warnings``)."""
    device = "cuda" if uses_cuda(cfg) else "cpu"
    gpt = build_gpt_config(cfg, vocab_size)
    plan = plan_memory(cfg, gpt, on_cuda=device == "cuda")
    available = memory.available_bytes_per_rank(device, memory.ranks_per_node())
    warning = memory.check_fits(plan, available)
    moot = zero3_live_warning(cfg, gpt)
    cfg.warnings += [moot] if moot else []
    if verbose:
        print(f"[megazero] {memory.describe(plan, available)}", flush=True)
        if warning:
            print(f"megazero: warning: {warning}", file=sys.stderr, flush=True)
        if moot:
            print(f"megazero: config warning: {moot}", file=sys.stderr, flush=True)


START_ERRORS = (DataError, checkpoint.CheckpointError, memory.MemoryPlanError, DeviceError, MissingExtra, HarnessError)


def report_start_error(e: Exception) -> int:
    """One line on stderr for a problem found before start; returns exit code 2."""
    kind = {DataError: "data", memory.MemoryPlanError: "memory", DeviceError: "device",
            MissingExtra: "config", HarnessError: "config"}.get(type(e), "checkpoint")
    print(f"megazero: {kind} error: {e}", file=sys.stderr)
    return 2


def preflight(argv: list[str], world_size: int, exports_file: Optional[str] = None) -> int:
    """Check the settings, the data and the checkpoint as ``main`` would, starting nothing.

    The launcher runs it once before torchrun, so a bad configuration ends with its one-line
    message and exit code 2 instead of torchrun's per-rank failure report. Returns 0 or 2.
    ``exports_file``: where to write the launcher's ``export NAME=VALUE`` lines for this run
    (``launch_exports``: CUDA_DEVICE_MAX_CONNECTIONS where the overlap needs it), each after a
    comment with its reason; the launcher sources it before torchrun.
    """
    cfg = config_from_argv(argv, world_size)
    try:
        check_device(cfg, memory.ranks_per_node())
        data = prepare_run(cfg, verify=True)
        check_memory(cfg, data.vocab_size, verbose=True)
    except START_ERRORS as e:
        return report_start_error(e)
    for w in resume_warnings(cfg, data.resume):
        print(f"megazero: warning: {w}", file=sys.stderr, flush=True)
    if exports_file is not None:
        import shlex

        with open(exports_file, "w") as f:
            f.writelines(f"# {why}\nexport {name}={shlex.quote(value)}\n"
                         for name, value, why in launch_exports(cfg, os.environ))
    return 0


def run_control(cfg: Config, launch: Launch, signals: resilience.StopSignals, start: float) -> RunControl:
    """The RunControl of this rank: its signals and clock, one stop.json writer per node
    (local rank 0), torchrun's restart count and the test hook ``MEGAZERO_TEST_FAULT``."""
    return RunControl(signals=signals, clock=resilience.StopClock(cfg.train.exit_duration_in_mins, start),
                      writes_record=launch.local_rank == 0,
                      restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                      fault=resilience.parse_fault(os.environ.get("MEGAZERO_TEST_FAULT", "")))


def main(argv=None) -> int:
    """Train; returns the exit status: 0, 1 (training error), 2 (bad setting, data or checkpoint),
    or after an early stop its documented status (resilience.stop_status) -- 0 under torchrun,
    whose launcher reads that status from stop.json, so torchrun neither restarts nor reports."""
    start = time.monotonic()
    signals = resilience.StopSignals().install()  # from now on a signal asks for a stop, see train()
    launch = read_launch_env()
    argv = sys.argv[1:] if argv is None else argv
    # Everything that can be wrong with the settings, the data or the checkpoint is found
    # here, on every rank, before any process group exists (docs/design.md, contract 3). The
    # launcher already printed the config warnings in its preflight.
    quiet = launch.rank != 0 or os.environ.get("MEGAZERO_PREFLIGHT_DONE") == "1"
    cfg = config_from_argv(argv, launch.world_size, print_warnings=not quiet)
    # Same directory on every rank: the launcher passes --run-dir; torchrun's run id otherwise.
    resolve_run_dir(cfg, os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        watch_parent()
    try:
        check_device(cfg, memory.ranks_per_node())
        device = bind_device(cfg, launch)  # before anything opens a CUDA context (the memory check does)
        # the checksums are read once: by the launcher's preflight, else by rank 0
        verify = launch.rank == 0 and os.environ.get("MEGAZERO_PREFLIGHT_DONE") != "1"
        data = prepare_run(cfg, verify=verify)
        check_memory(cfg, data.vocab_size, verbose=not quiet)
    except START_ERRORS as e:
        return report_start_error(e)
    for w in resume_warnings(cfg, data.resume) if not quiet else []:
        print(f"megazero: warning: {w}", file=sys.stderr, flush=True)
    groups = setup_groups(cfg, launch, device)
    control = run_control(cfg, launch, signals, start)
    try:
        result = train(cfg, groups, device, data, control)
        if dist.is_initialized():
            dist.barrier()  # nobody tears down connections a peer is still reading from
        if "stop" in result:
            return 0 if "TORCHELASTIC_RUN_ID" in os.environ else result["status"]
    except SwapError as e:  # an NVMe swap file failed its check: every rank stops in the same step
        if e.local:   # the rank whose file it is names it
            print(f"megazero: training error: {e}", file=sys.stderr, flush=True)
        return 1
    except LossScaleError as e:  # every rank skips the same steps, so all of them stop here
        if launch.rank == 0:
            print(f"megazero: training error: {e}", file=sys.stderr, flush=True)
        return 1
    except checkpoint.CheckpointError as e:  # a tensor file that fails to read: DCP tells every rank
        if launch.rank == 0:
            report_start_error(e)
        return 2
    except RuntimeError as e:  # a collective failed: a peer died, was stopped or hung
        if launch.world_size == 1 or not is_collective_failure(e):
            raise
        print(resilience.write_failure(cfg.log.run_dir, launch.rank, control.trail, e), file=sys.stderr, flush=True)
        os._exit(1)  # no teardown: it would wait on the peer that failed
    finally:
        groups = None   # train() has closed and dropped the Trainer: these are the last references
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()    # the model's reference cycles go, and with them every process group, whose
        # destructor joins its worker threads now, not during interpreter shutdown (issue 26, F1)
    return 0


def is_collective_failure(e: BaseException) -> bool:
    """True for gloo/NCCL errors of a peer that disappeared or a collective that timed out
    (gloo's asynchronous ``Work.wait`` says "Application timeout caused pair closure")."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        k in text for k in ("Connection reset", "Connection closed", "timed out", "Timed out", "timeout",
                             "pair closure", "gloo", "NCCL"))


if __name__ == "__main__":
    sys.exit(main())
