"""The training loop: the run's Monitor and Trainer, then train until ``--train-iters`` or an
agreed stop, with logging, periodic evaluation, checkpoints and the final summary."""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from data.run_data import RunData
from megazero.config import Config, describe, to_dict
from megazero.ops.backend import describe_backends
from megazero.process_groups import ProcessGroups
from megazero.runtime.monitor import Monitor, Timer, memory_stats, peak_flops, throughput, unigram_entropy
from megazero.runtime.profiling import StepProfiler, step_profiler
from megazero.training.control import (
    RunControl,
    finish_stop,
    handle_bad_step,
    inject_fault,
    no_loss_tokens_line,
    report_empty_step,
    report_restart,
)
from megazero.training.evaluation import evaluate, final_sample, harness_due, harness_scores
from megazero.training.factory import build_trainer
from megazero.training.trainer import Trainer


def perf_values(trainer: Trainer, cfg: Config, seconds_per_iter: float) -> dict:
    """Throughput, TFLOP/s, MFU (megazero.planning.flops) and memory for one logged iteration."""
    values = throughput(
        flops_per_iteration=trainer.flops_per_iteration,
        tokens_per_iteration=cfg.train.global_batch_size * cfg.model.seq_length,
        iteration_time_s=seconds_per_iter,
        world_size=trainer.groups.world_size,
        peak_flops_per_device=(
            cfg.log.peak_tflops * 1e12
            if cfg.log.peak_tflops
            else peak_flops(trainer.device, trainer.dtype, tf32=cfg.precision.tf32)
        ),
    )
    return dict(
        values,
        iteration_time_s=seconds_per_iter,
        model_state_bytes=trainer.optimizer.model_state_bytes()["total"],
        peak_memory_bytes=memory_stats(trainer.device).get("peak_bytes"),
    )


def report_model_state(trainer: Trainer, monitor: Monitor) -> None:
    """Every rank's model-state bytes beside the ZeRO formula's prediction (and the bound on its
    bucket temporaries), gathered into one table that the logging rank prints (collective)."""
    opt = trainer.optimizer
    got, bound, predicted = opt.model_state_bytes(), opt.bucket_bound_bytes(), opt.formula()
    psi = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    p_bytes = trainer.dtype.itemsize
    g_bytes = trainer.ddp.grad_dtype.itemsize
    formula, m_bytes, offload = predicted["total"], predicted["main_bytes"], predicted["note"]
    row = dict(
        rank=trainer.groups.rank,
        psi=psi,
        formula=formula,
        bytes={
            (k.replace("host_", "host ") if k.startswith("host") else "host " + k) if k in opt.HOST_PARTS else k: v
            for k, v in got.items()
            if k != "total"
        },
    )
    if got.keys() & set(opt.HOST_PARTS):  # host memory in use: how much of it is page-locked
        row["pinned"] = opt.pinned_bytes()
    rows = [row]
    if trainer.groups.world_size > 1:
        rows = [None] * trainer.groups.world_size
        dist.all_gather_object(rows, row, group=trainer.groups.world)
    experts = f" (expert parameters: N={trainer.replicas.edp_size})" if trainer.replicas.experts_apart else ""
    hybrid = (
        f" (hybrid sharding: replicated over {trainer.replicas.dp_size // trainer.replicas.zero_shard_size})"
        if trainer.replicas.topology.hybrid
        else ""
    )
    monitor.log_model_state_table(
        rows,
        note=(
            f"ZeRO-{trainer.cfg.zero.stage} formula on the padded Psi with N={trainer.replicas.zero_shard_size}{hybrid}"
            f"{experts}, "
            f"{p_bytes}-byte params, {g_bytes}-byte grads, {m_bytes + 8} bytes/param fp32 optimizer state, "
            f"+ at most {bound} bytes of buckets{offload}"
        ),
    )


def is_logging_rank(groups: ProcessGroups) -> bool:
    """The last pipeline stage holds the loss; its first TP/DP rank writes the logs."""
    return groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0


def wandb_settings(cfg: Config) -> Optional[dict]:
    """Arguments of the Monitor's W&B logger, or None without ``--wandb-project``."""
    lg = cfg.log
    if lg.wandb_project is None:
        return None
    return dict(
        project=lg.wandb_project,
        name=lg.wandb_exp_name or os.path.basename(os.path.normpath(lg.run_dir)),
        save_dir=lg.wandb_save_dir or os.path.join(lg.run_dir, "wandb"),
        config=to_dict(cfg),
    )


def make_profiler(cfg: Config, rank: int) -> StepProfiler:
    """--profile: this rank's torch.profiler window (a no-op on the other ranks)."""
    g = cfg.log
    return step_profiler(g.run_dir, rank, g.profile, g.profile_step_start, g.profile_step_end, g.profile_ranks)


def start_run(
    cfg: Config, groups: ProcessGroups, device: torch.device, data: RunData, control: RunControl
) -> tuple[Trainer, Monitor]:
    """The run's Monitor and Trainer (its collaborators passed in), resumed from ``--load``."""
    monitor = Monitor(
        cfg.log.run_dir,
        tensorboard_dir=cfg.log.tensorboard_dir,
        metrics_file=cfg.log.metrics_file,
        rank=groups.rank,
        is_logging_rank=is_logging_rank(groups),
        config_text=describe(cfg),
        train_iters=cfg.train.train_iters,
        wandb=wandb_settings(cfg),
    )
    trainer = build_trainer(
        cfg,
        data=data,
        groups=groups,
        device=device,
        stop_flags=control.flags,
        fault=control.fault,
        trail=control.trail,
        monitor=monitor,
    )
    finetune = cfg.train.finetune
    resumed = trainer.load_checkpoint(cfg.train.load, weights_only=finetune) if cfg.train.load else None
    if cfg.train.load and groups.rank == 0:
        print(
            f"[megazero] --finetune: the weights of {cfg.train.load}; iteration, optimizer and data start afresh"
            if resumed is not None and finetune
            else f"[megazero] resumed from {cfg.train.load} at iteration {resumed}"
            if resumed is not None
            else f"[megazero] no checkpoint under --load {cfg.train.load}: starting from scratch",
            flush=True,
        )
    report_restart(cfg, control, resumed, monitor)
    if groups.rank == 0:
        print(
            f"[megazero] {describe_backends(device, cfg.optim.kernels)}; padded vocab "
            f"{trainer.gpt_config.padded_vocab(cfg.parallel.tp)} (real {data.vocab_size})",
            flush=True,
        )
    return trainer, monitor


def train(
    cfg: Config, groups: ProcessGroups, device: torch.device, data: RunData, control: Optional[RunControl] = None
) -> dict:
    """The whole run: model, loop, periodic evaluation, final summary; ``data`` from build_data.
    ``control`` (signals, time limit, test fault) may end it early at a step boundary."""
    control = control or RunControl()
    trainer, monitor = start_run(cfg, groups, device, data, control)
    result = run_loop(trainer, monitor, data, control)
    trainer.close()  # nothing in flight, every hook removed: the model can be freed
    return result


def validate_rollouts(trainer: Trainer, monitor: Monitor, data: RunData, it: int) -> dict:
    """--post-train grpo / ppo's held-out rollouts at iteration ``it`` (``megazero.training.rl.evaluate``),
    logged as one ``validation at iteration`` line and a ``"valid"`` record (collective); returns
    their values."""
    from megazero.training import rl

    values = rl.evaluate(trainer, data.valid, it, rl.held_out_prompts(trainer.cfg))
    monitor.log_rollout_validation(it, values)
    return values


def run_loop(trainer: Trainer, monitor: Monitor, data: RunData, control: RunControl) -> dict:
    """Train until ``--train-iters`` or an agreed stop; evaluate, log and save on the way.
    Returns train()'s result (with ``stop`` and ``status`` after an early stop)."""
    cfg, groups, device = trainer.cfg, trainer.groups, trainer.device
    state, s, exit_interval = trainer.state, cfg.train, cfg.train.exit_interval
    last_valid, counts, last_rollouts = None, None, None
    timer, last_logged = Timer(device), state.iteration
    first_iteration, empty_steps = state.iteration + 1, 0
    profiler = make_profiler(cfg, groups.rank)
    if cfg.post.mode in ("grpo", "ppo") and state.iteration == 0 and data.valid is not None and s.eval_iters > 0:
        last_rollouts = validate_rollouts(trainer, monitor, data, 0)  # the curve's start: the policy before any update
    while state.iteration < s.train_iters:
        inject_fault(control, trainer)
        profiler.before_step(state.iteration + 1)
        with timer:  # the step's time includes reading its micro-batches
            outcome = trainer.train_step(trainer.next_batches(data.train))
        it = state.iteration
        profiler.after_step(it)
        if it == first_iteration:  # buckets and step temporaries have now been allocated once
            report_model_state(trainer, monitor)
        if it % cfg.log.log_interval == 0 or it == 1 or it == s.train_iters:
            outcome.values.update(perf_values(trainer, cfg, timer.reset() / (it - last_logged)))
            last_logged = it
            monitor.log_iteration(it, outcome.values)
        if outcome.empty:
            empty_steps += 1
            report_empty_step(trainer, monitor, empty_steps)
        if outcome.bad_step and (line := handle_bad_step(trainer, monitor)) is not None:
            profiler.close()
            monitor.close()
            return finish_stop(trainer, control, "non-finite", None, message=line)
        due = data.valid is not None and s.eval_iters > 0 and (it % s.eval_interval == 0 or it == s.train_iters)
        if due and cfg.post.mode in ("grpo", "ppo"):  # held-out rollouts: sampled and greedy rewards
            last_rollouts = validate_rollouts(trainer, monitor, data, it)
        elif due:
            last_valid, counts = evaluate(trainer, data.valid, cfg, state.eval_round)
            state.eval_round += 1
            pref = trainer.post.preference  # --post-train dpo: the held-out pairs' reward statistics
            monitor.log_validation(it, last_valid, None if pref is None else pref.metrics(device))
        if harness_due(cfg, it):
            monitor.log_harness(it, harness_scores(trainer, data.tokenizer, cfg))
        saved = None
        learned = empty_steps < it - first_iteration + 1  # a run with no loss token yet saves nothing
        if s.save and learned and ((s.save_interval and it % s.save_interval == 0) or it == s.train_iters):
            saved = trainer.save_checkpoint(s.save)
        reason = outcome.stop_reason or ("interval" if exit_interval and it % exit_interval == 0 else None)
        if reason is not None and it < s.train_iters:
            profiler.close()
            monitor.close()
            return finish_stop(trainer, control, reason, saved)
    profiler.close()
    if empty_steps and empty_steps == state.iteration - first_iteration + 1:  # every step: the data is wrong
        line = no_loss_tokens_line(cfg, empty_steps)
        if groups.rank == 0:
            print(f"megazero: data error: {line}", file=sys.stderr, flush=True)
        monitor.close()
        return finish_stop(trainer, control, "no-loss-tokens", None, message=line)
    trainer.finish_save()
    trainer.optimizer.wait_param_gather()
    sample = final_sample(trainer, data.tokenizer, cfg)
    baseline = unigram_entropy(counts) if counts is not None and counts.sum() > 0 else None
    rl_mode = cfg.post.mode in ("grpo", "ppo")
    monitor.summary(
        last_valid, baseline, sample, pair_loss=cfg.post.mode in ("dpo", "rm"), rollouts=last_rollouts, rl=rl_mode
    )
    monitor.close()
    return dict(valid_loss=last_valid, unigram_entropy=baseline, iteration=state.iteration)
