"""The Trainer: everything one rank holds for training, and one iteration of it
(``Trainer.train_step``: pipeline schedule -> gradient reduction -> optimizer step -> the loss
all-reduce), evaluation losses and checkpoints."""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from data.run_data import RunData
from megazero import collectives
from megazero.checkpoint.manager import CheckpointManager, RunState
from megazero.config import Config
from megazero.context_parallel.sequence import (
    Packing,
    counted_targets,
    local_mtp_targets,
    mtp_targets,
    shard_micro_batch,
)
from megazero.moe.router import AuxLossBackward
from megazero.optim.lr_schedule import LRSchedule
from megazero.pipeline.executor import make_forward_step, run_schedule
from megazero.pipeline.p2p import handshake
from megazero.pipeline.partition import chunk_layout
from megazero.pipeline.schedules import build_schedule, forward_only_schedule
from megazero.planning.flops import spec_flops_per_iteration
from megazero.post_training import PostTraining
from megazero.post_training.reward import last_token_mask
from megazero.precision import model_dtype
from megazero.process_groups import ProcessGroups
from megazero.runtime import resilience
from megazero.runtime.monitor import Monitor
from megazero.tensor_parallel.random import resume_seed
from megazero.training.inputs import data_signature, dp_micro_batches, tokenizer_record
from megazero.training.optimizer import build_optimizer
from megazero.training.reference import build_reference
from model.build import build_gpt_config, build_model_chunks, model_signature
from model.gpt import VOCAB_TENSORS, moe_step_end
from model.hf import config_record
from model.moe_state import expert_bias_state, load_expert_bias

CRITIC = "critic"  # --post-train ppo: the critic's checkpoints, under the run's


@dataclass
class StepOutcome:
    """What one ``Trainer.train_step`` produced.

    ``values``: the logged values (iteration, consumed_samples, lr, loss [nats/token, the
    global batch's token mean; None for a batch without a loss token], grad_norm, loss_scale,
    skipped_iterations; an MoE model adds moe_aux_loss and moe_z_loss, ``model.gpt.moe_step_end``; multi-token
    prediction adds mtp_loss, ``Trainer.mtp_step_end``, which ``loss`` leaves out); ``stop_reason``:
    a stop every rank agreed on in the step's loss all-reduce (``resilience.agree``), else None;
    ``bad_step``: a non-finite loss or gradient outside fp16's loss scaling (the optimizer
    skipped the update); ``empty``: the global batch had no loss token, so the optimizer step
    was skipped (counted in ``skipped_iterations``; not a bad step).
    """

    values: dict
    stop_reason: Optional[str] = None
    bad_step: bool = False
    empty: bool = False


class Trainer:
    """Everything one rank holds for training; ``train_step`` / ``eval_loss`` run one iteration.

    Args: ``cfg``, ``groups``, ``device``, ``vocab_size`` (the real vocabulary), and the run's
    collaborators: ``stop_flags`` (a callable giving this rank's stop requests,
    ``resilience.local_flags``; default: none), ``fault`` (the test hook's parsed fault or
    None), ``trail`` (the communication phases entered, for a failure report) and ``monitor``
    (where checkpoint records are logged; None logs none), ``eod`` (the tokenizer's
    end-of-document id, which the packed-document flags need), ``data`` (the run's ``RunData``,
    read by ``next_batches``; ``build_trainer`` sets it). The run's counters are ``state``
    (a ``RunState``), its checkpoints ``checkpoints`` (a ``CheckpointManager``).

    ``train_step`` and ``eval_loss`` take whole sequences; with context parallelism each rank
    keeps its zigzag share (``local_batches``). The data-parallel machinery (gradient
    reduction, ZeRO, optimizer, checkpoint shards, the loss mean) runs over ``replicas``: the
    dp x cp ranks that hold the same parameters.
    """

    def __init__(
        self,
        cfg: Config,
        groups: ProcessGroups,
        device: torch.device,
        vocab_size: int,
        *,
        stop_flags: Optional[Callable[[], list]] = None,
        fault: Optional[tuple] = None,
        trail: Optional[resilience.Trail] = None,
        monitor: Optional[Monitor] = None,
        eod: Optional[int] = None,
        data: Optional[RunData] = None,
    ):
        self.cfg, self.groups, self.device, self.data = cfg, groups, device, data
        self.replicas = groups.replicas()
        d = cfg.data
        self.packing = Packing(eod, d.reset_attention_mask, d.reset_position_ids, d.eod_mask_loss)
        self.eod = eod
        self.gpt_config = build_gpt_config(cfg, vocab_size)
        self.chunks = build_model_chunks(self.gpt_config, cfg, groups, device)
        self.ddp, self.optimizer = build_optimizer(self.chunks, cfg, self.replicas)
        o = cfg.optim
        self.lr_schedule = LRSchedule(
            o.lr,
            o.min_lr,
            o.lr_warmup_iters,
            o.lr_decay_iters or cfg.train.train_iters,
            o.lr_decay_style,
            o.lr_wsd_decay_iters,
            o.lr_wsd_decay_style,
        )
        self.num_microbatches = cfg.train.gradient_accumulation_steps
        p = cfg.parallel
        self.actions = build_schedule(
            p.pipeline_schedule, self.num_microbatches, p.pp, groups.pp_rank, p.virtual_pipeline_size
        )
        self.eval_actions = forward_only_schedule(self.num_microbatches, p.virtual_pipeline_size)
        seq = cfg.model.seq_length // p.cp // (p.tp if p.sequence_parallel else 1)
        self.tensor_shape = (cfg.train.micro_batch_size, seq, cfg.model.hidden_size)
        self.dtype = model_dtype(cfg.precision.fp16, cfg.precision.bf16)
        # the loss divisor of one replica rank: its share of the global batch's targets
        self.tokens_per_dp_rank = self.num_microbatches * cfg.train.micro_batch_size * cfg.model.seq_length // p.cp
        g = self.gpt_config
        self.flops_per_iteration = spec_flops_per_iteration(
            g.parameter_spec(p.tp),
            seq_length=g.seq_length,
            attention_width=g.attention_flops_width,
            global_batch_size=cfg.train.global_batch_size,
            windows=[g.attention_window(i) for i in range(g.num_layers)],
            mtp_num_layers=g.mtp_num_layers,
        )
        if p.pp > 1:
            handshake(groups, self.tensor_shape, self.dtype, self.num_microbatches, device=device)
        self.state = RunState()
        self.stop_flags = stop_flags or (lambda: resilience.local_flags(None, None))
        self.forward_watch = resilience.ForwardWatch(self.chunks, groups, fault=fault)
        self._loss_tokens: Optional[torch.Tensor] = None  # the last _run's count (local_batches)
        self.trail = trail or resilience.Trail()
        self.monitor = monitor
        gcfg = self.gpt_config  # not self: a cycle through the trainer would keep it (and its swap files) alive
        self.post = PostTraining(cfg, groups, lambda source: build_reference(cfg, groups, gcfg, device, source))
        self.critic: Optional["Trainer"] = None  # --post-train ppo: the value model, a second Trainer
        if cfg.post.mode == "ppo":
            self.critic = build_critic(cfg, groups, device, vocab_size, eod)
            if cfg.post.critic_load and not cfg.train.load:  # else load_checkpoint starts it
                self.critic.load_checkpoint(cfg.post.critic_load, weights_only=True)
        self.reward_model = None  # --reward rm:DIR: the scorer, loaded by the first rollout (training.rl)
        self.checkpoints = CheckpointManager(
            self.replicas,
            keep=cfg.train.keep_latest_checkpoints,
            async_save=cfg.train.async_save,
            log=None if monitor is None else monitor.log_record,
        )

    def save_checkpoint(self, root: str, wait: bool = False) -> str:
        """Write a layout-independent checkpoint of this iteration (collective); returns its
        directory. With --async-save the files are written in the background (finished by the
        next save, ``finish_save`` or ``wait``); the time the loop was blocked is logged."""
        self.checkpoints.finish()
        self.optimizer.wait_param_gather()
        self.trail.enter(self.state.iteration, "checkpoint save (gathers over dp and tp)")
        g = self.gpt_config
        if self.critic is not None:  # ROOT/critic: the value model's own checkpoints
            self.critic.save_checkpoint(os.path.join(root, CRITIC), wait=wait)
        return self.checkpoints.save(
            root,
            self.state,
            self.optimizer,
            self.chunks,
            rng_states=self.chunks[0].rng_tracker.get_state(),
            extra=dict(
                model=model_signature(g),
                data=data_signature(self.cfg),
                gpt_config=config_record(g),
                tokenizer=tokenizer_record(self.cfg),
                moe_expert_bias=expert_bias_state(self.chunks, self.groups, g),
                post_train=self.post.record(),
            ),
            after_write=self._save_fault(),
            wait=wait,
        )

    def finish_save(self) -> None:
        """Wait for the background checkpoint, if any, and move ``latest`` to it (collective)."""
        self.checkpoints.finish()
        if self.critic is not None:
            self.critic.finish_save()

    def close(self) -> None:
        """End of the run (collective): the background save finished, the parameter
        all-gathers and ZeRO-3 prefetches waited for, the gradient hooks removed, so that
        nothing asynchronous is in flight and the model and its process groups can be freed
        before ``destroy_process_group`` (gloo worker threads that outlived the
        interpreter aborted a finished run)."""
        self.checkpoints.finish()
        self.optimizer.wait_param_gather()
        self.ddp.close()
        if hasattr(self.optimizer, "close"):  # NVMe offload: its swap files go
            self.optimizer.close()
        if self.critic is not None:
            self.critic.close()

    def _start_critic(self, root: str, resuming: bool) -> None:
        """--post-train ppo: the critic resumes from ``ROOT/critic`` when the policy resumed a
        PPO run; else it starts from ``--critic-load`` (e.g. the reward model), or from the
        policy's starting checkpoint under ``root`` with a seeded value head, or stays seeded."""
        from megazero.checkpoint import latest_iteration

        mine = os.path.join(root, CRITIC)
        if resuming and latest_iteration(mine) is not None:
            self.critic.load_checkpoint(mine)
        elif self.cfg.post.critic_load:
            self.critic.load_checkpoint(self.cfg.post.critic_load, weights_only=True)
        elif latest_iteration(root) is not None:
            self.critic.load_checkpoint(root, weights_only=True)

    def _save_fault(self):
        """The test hook's ``savekill`` fault for this save: SIGKILL this rank's process from
        inside the background write (None when it does not apply)."""
        f, pid = self.forward_watch.fault, os.getpid()
        if f is not None and f[0] == "savekill" and f[1:3] == (self.state.iteration, self.groups.rank):
            return lambda: os.kill(pid, signal.SIGKILL)
        return None

    def load_checkpoint(self, root: str, weights_only: bool = False) -> Optional[int]:
        """Resume from the latest checkpoint under ``root`` (saved under any layout).

        Returns the iteration resumed from, or None when ``root`` holds no checkpoint yet.
        ``weights_only`` (``--finetune``): only the weights (and an MoE's expert biases) are
        read; the iteration stays 0, the optimizer fresh, the dropout streams from --seed; a
        reward model's value head keeps its seeded values when the checkpoint (a language
        model's) has none.
        """
        g = self.gpt_config

        def real_rows(name):  # a vocabulary tensor's padding rows are zeroed, not read
            return g.vocab_size if name in VOCAB_TENSORS else None

        fresh = ("value_head.weight",) if g.value_head else ()  # a reward model from a language model's weights
        resumed = self.checkpoints.resume(
            root, self.optimizer, self.chunks, real_rows=real_rows, weights_only=weights_only, fresh=fresh
        )
        if self.critic is not None:
            self._start_critic(root, resumed is not None and not weights_only)
        if resumed is None:
            return None
        self.state, meta = resumed
        load_expert_bias(self.chunks, meta["extra"].get("moe_expert_bias", {}))
        self.post.resumed(meta, root, weights_only)
        if weights_only:
            return self.state.iteration
        tracker, saved = self.chunks[0].rng_tracker, meta["rng_state"]
        drawn = None if saved is None else tracker.saved_device(saved)
        if saved is None:
            why = f"under another layout {meta['layout']}"
        elif drawn != tracker.device.type:  # CPU <-> CUDA: the generator states do not fit
            why = f"with dropout streams drawn on {drawn}, this run draws on {tracker.device.type}"
        else:
            tracker.set_state(saved)
            return self.state.iteration
        tracker.reseed(resume_seed(tracker.seed, self.state.iteration))  # every rank, one rule
        if self.groups.rank == 0:
            print(
                f"[megazero] {meta['directory']} was saved {why}: weights, "
                f"optimizer and data position restored; every rank's dropout streams re-seeded from --seed "
                f"and iteration {self.state.iteration} (megazero.tensor_parallel.random.resume_seed)",
                flush=True,
            )
        return self.state.iteration

    def local_batches(self, batches) -> tuple[list, Union[int, torch.Tensor], Optional[torch.Tensor]]:
        """Whole-sequence micro-batches ``(tokens, labels)``, or ``(tokens, labels, loss_mask,
        *extra)`` of SFT or preference data (data/sft.py; ``extra``, a reward model's margins,
        is kept as it is) -> this rank's share (its zigzag ``T/cp`` with a
        ``SequenceInfo``, megazero/context_parallel/sequence.py), the loss divisor and the count
        of loss tokens. The count: the targets this step counts over all dp ranks (with
        --eod-mask-loss or a loss mask a 0-d fp64 tensor summed over the dp group, no host sync;
        the same on every rank; None without a mask, where every target counts). The divisor:
        that count divided by dp x cp, at least 1/(dp x cp), so a batch without a response token
        has loss 0."""
        g, packing = self.groups, self.packing
        masks = [b[2] if len(b) > 2 else None for b in batches]
        local = [  # items past the loss mask (a reward model's margins) ride along unsharded
            (*shard_micro_batch(b[0], b[1], cp=g.cp_size, cp_rank=g.cp_rank, packing=packing, loss_mask=m), *b[3:])
            for b, m in zip(batches, masks)
        ]
        if self.gpt_config.mtp_num_layers > 0:
            local = self._with_mtp_targets(batches, masks, local)
        if not packing.eod_mask_loss and all(m is None for m in masks):
            return local, self.tokens_per_dp_rank, None
        counted = sum(counted_targets(b[1], packing, m) for b, m in zip(batches, masks))
        counted = counted.reshape(()).to(self.device)
        collectives.all_reduce_sum(counted, g.dp)
        return local, counted.clamp_min(1.0) / (g.dp_size * g.cp_size), counted

    def _with_mtp_targets(self, batches, masks, local) -> list:
        """``local`` micro-batches as ``(tokens, labels, seq or None, MTPTargets)``: multi-token
        prediction's shifted tokens and labels, made from the whole sequences before the cp split
        (``mtp_targets``), with each depth's divisor from its counted targets summed over the dp
        group (one all-reduce of ``[D]`` fp64, no host sync) and the fp16 loss scale as gradient."""
        g, D = self.groups, self.gpt_config.mtp_num_layers
        full = [mtp_targets(b[0], b[1], D, self.packing, m) for b, m in zip(batches, masks)]
        counted = sum(t.mask.sum(dim=(0, 1), dtype=torch.float64) for t in full).to(self.device)  # (D,)
        collectives.all_reduce_sum(counted, g.dp)
        divisor = counted.clamp_min(1.0) / (g.dp_size * g.cp_size)
        scale = self.optimizer.scale_loss(torch.ones((), device=self.device))
        out = []
        for b, t in zip(local, full):
            mine = local_mtp_targets(t, g.cp_size, g.cp_rank).counted(divisor, scale)
            out.append((b[0], b[1], b[2] if len(b) > 2 else None, mine))
        return out

    def mtp_step_end(self) -> dict:
        """After a training step (collective over the replicas and pp): ``{"mtp_loss": float}``, the
        step's multi-token prediction loss (``lambda / D * sum_k CE_k``, the global batch's) that
        the training loss added, read from the last stage's ``mtp_loss_sum`` (then zeroed)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for c in self.chunks:
            if hasattr(c, "mtp_loss_sum"):
                total += c.mtp_loss_sum
                c.mtp_loss_sum.zero_()
        collectives.all_reduce_sum(total, self.replicas.dp)
        if self.groups.pp_size > 1:
            collectives.all_reduce_sum(total, self.groups.pp)
        return {"mtp_loss": float(total) / collectives.group_size(self.replicas.dp)}

    def _run(self, batches, actions, forward_only: bool) -> torch.Tensor:
        watch = None if forward_only else self.forward_watch.watch
        if self.gpt_config.value_head:  # --post-train rm: the mask selects each sequence's scored token
            batches = [(b[0], b[1], last_token_mask(b[2]), *b[3:]) for b in batches]
        batches, divisor, self._loss_tokens = self.local_batches(batches)
        sequence_loss, pref = None, self.post.preference
        if pref is not None:  # dpo: the reference's sums first, then pair losses; rm: pair losses
            ref = self.post.reference_sums(batches, self._forward_only) if self.post.uses_reference else None
            pref.prepare(batches, ref)
            sequence_loss = pref.loss
        if not forward_only:
            self.forward_watch.begin(self.state.iteration + 1, batches)
        if not forward_only and self.gpt_config.num_experts is not None:
            # MoE auxiliary losses weigh as Megatron-LM's: coeff x loss per micro-batch, averaged
            # over the micro-batches (and, by the gradient mean, over dp), times the fp16 loss scale
            AuxLossBackward.set_scale(self.optimizer.scale_loss(torch.ones((), device=self.device)) / len(batches))
        return self._schedule(
            actions, self.chunks, make_forward_step(divisor, watch, sequence_loss), batches, forward_only
        )

    def _schedule(self, actions, chunks, forward_step, batches, forward_only: bool) -> torch.Tensor:
        """``run_schedule`` of ``actions`` over this rank's sharded ``batches`` with ``chunks``
        (the model's, or another model in this layout: the post-training reference)."""
        return run_schedule(
            actions,
            chunks,
            forward_step,
            batches,
            self.groups,
            tensor_shape=self.tensor_shape,
            dtype=self.dtype,
            num_microbatches=len(batches),
            vp_size=self.cfg.parallel.virtual_pipeline_size,
            before_backward=None if forward_only else self.ddp.before_backward,
            scale_loss=None if forward_only else self.optimizer.scale_loss,
            forward_only=forward_only,
            layout=chunk_layout(self.cfg.parallel.pipeline_schedule),
            schedule_of=None if forward_only else self._schedule_of,
        )

    def _forward_only(self, chunks, forward_step, batches) -> torch.Tensor:
        """The forward-only schedule of ``chunks`` (the post-training reference)."""
        return self._schedule(self.eval_actions, chunks, forward_step, batches, forward_only=True)

    def run_forward_only(self, chunks, forward_step, batches) -> torch.Tensor:
        """The forward-only schedule of ``chunks`` (the model's or another in this layout, e.g.
        the post-training reference) over this rank's sharded ``batches`` (one global batch's
        micro-batches) with ``forward_step`` (``megazero.pipeline.executor`` contract)."""
        return self._forward_only(chunks, forward_step, batches)

    def run_training_schedule(self, forward_step, batches) -> torch.Tensor:
        """The training schedule (forward, backward, gradient reduction) of the model over this
        rank's sharded ``batches`` with ``forward_step``: this replica's loss (fp64 0-d, on the
        last stage). The caller zeroes the gradients before and steps the optimizer after
        (``megazero.training.rl.update``)."""
        return self._schedule(self.actions, self.chunks, forward_step, batches, forward_only=False)

    def _schedule_of(self, pp_rank: int):
        """The training schedule of stage ``pp_rank`` (the executor reads its neighbours')."""
        p = self.cfg.parallel
        return build_schedule(p.pipeline_schedule, self.num_microbatches, p.pp, pp_rank, p.virtual_pipeline_size)

    def next_batches(self, dataset=None) -> list:
        """This data-parallel rank's micro-batches of the next global batch (``dp_micro_batches``
        after ``state.consumed_samples``) of ``dataset``, default the run's training split
        (``data.train``; a Trainer built without ``data`` needs ``dataset``). With
        ``--post-train grpo``: the next rollout (``megazero.training.rl.sample``; collective)."""
        dataset = self.data.train if dataset is None else dataset
        if self.post.mode in ("grpo", "ppo"):
            from megazero.training import rl

            p = self.cfg.post
            first = self.state.consumed_samples
            return rl.sample(self, dataset, first, p.grpo_prompts_per_step, p.grpo_group_size, self.state.iteration + 1)
        return dp_micro_batches(dataset, self.state.consumed_samples, self.cfg, self.groups, self.device)

    def train_step(self, batches) -> StepOutcome:
        """One iteration on this DP rank's micro-batches (a list of (tokens, labels), each
        ``(micro_batch_size, seq_length)`` int64); advances ``state`` and returns the outcome."""
        if self.post.mode in ("grpo", "ppo"):
            return self._rl_step(batches)
        for c in self.chunks:
            c.train()
        it, trail = self.state.iteration + 1, self.trail
        lr = self.lr_schedule(it)  # warm-up starts above 0 on the first step
        self.ddp.zero_grad()
        trail.enter(it, "the pipeline schedule (forward/backward with p2p, bucketed gradient reduction)")
        loss = self._run(batches, self.actions, forward_only=False)
        trail.enter(it, "the optimizer step (gradient reduction, overflow all-reduce, norm, parameter all-gather)")
        result = self.optimizer.step(lr, loss_tokens=self._loss_tokens)
        trail.enter(it, "the loss / stop all-reduce")
        # this DP rank's share -> global mean; the same all-reduce agrees on a stop request
        loss, stop_reason = resilience.agree(loss, self.stop_flags(), self.replicas)
        s = self.state
        s.advance(self.cfg.train.global_batch_size, result.skipped)
        bad = not self.cfg.precision.fp16 and ((result.skipped and not result.empty) or not math.isfinite(loss))
        values = dict(
            iteration=s.iteration,
            consumed_samples=s.consumed_samples,
            lr=lr,
            loss=None if result.empty else loss,  # no loss token: n/a, not a dip to 0 in the curve
            grad_norm=result.grad_norm,
            loss_scale=result.loss_scale,
            skipped_iterations=s.skipped_iterations,
        )
        if self.post.preference is not None:
            trail.enter(it, "the preference metrics all-reduce")
            values.update(self.post.preference.metrics(self.device))
        if self.gpt_config.mtp_num_layers > 0:
            trail.enter(it, "the multi-token prediction loss all-reduce over dp and pp")
            values.update(self.mtp_step_end())
        if self.gpt_config.num_experts is not None:
            trail.enter(it, "the MoE statistics and expert-bias all-reduce over dp and pp")
            values.update(moe_step_end(self.chunks, self.groups, self.replicas.dp, self.num_microbatches))
        return StepOutcome(values, stop_reason, bool(bad), result.empty)

    def _rl_step(self, stored) -> StepOutcome:
        """``--post-train grpo``'s iteration on a rollout (``megazero.training.rl.update``)."""
        from megazero.training import rl

        it = self.state.iteration + 1
        lr = self.lr_schedule(it)
        self.trail.enter(it, "the policy updates on the rollout (schedule, gradient reduction, optimizer steps)")
        out = rl.update(self, stored, lr)
        s = self.state
        s.advance(len(stored.prompts), out["skipped"])
        v = out["values"]
        bad = not self.cfg.precision.fp16 and (out["skipped"] or not math.isfinite(v["loss"]))
        values = dict(iteration=s.iteration, consumed_samples=s.consumed_samples, lr=lr, **v)
        values["skipped_iterations"] = s.skipped_iterations
        return StepOutcome(values, out["stop"], bool(bad), out["empty"])

    def locate_bad_step(self) -> str:
        """The one line naming where the last step's non-finite value appeared (collective)."""
        mine = resilience.encode_place(self.forward_watch.first_place())
        gathered = [mine]
        if self.groups.world is not None:
            gathered = [None] * self.groups.world_size
            dist.all_gather_object(gathered, mine, group=self.groups.world)
        place = resilience.locate_non_finite(gathered)
        t = self.cfg.train
        samples = (
            None
            if place is None
            else resilience.sample_range(
                self.state.consumed_samples - t.global_batch_size,
                t.global_batch_size,
                place.dp_rank,
                self.groups.dp_size,
                place.microbatch,
                t.micro_batch_size,
            )
        )
        return resilience.describe_non_finite(
            self.state.iteration, place, samples, self.cfg.parallel.virtual_pipeline_size
        )

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        """Mean token loss of this global batch (forward only), known on every rank."""
        self.optimizer.wait_param_gather()
        for c in self.chunks:
            c.eval()
        loss = self._run(batches, self.eval_actions, forward_only=True)  # DPO: adds to the reward statistics
        collectives.all_reduce_mean(loss, self.replicas.dp)
        return float(loss)


def build_critic(cfg, groups, device, vocab_size: int, eod):
    """``--post-train ppo``'s critic: a second ``Trainer`` in the same layout (its own chunks,
    ZeRO optimizer and checkpoints) whose model ends in a value head scoring every position
    (``GPTStage.values_per_token``), at ``--critic-lr`` on the policy's schedule."""
    import copy

    c = copy.deepcopy(cfg)
    c.post.mode = "rm"  # the GPT with a value head
    if cfg.post.critic_lr is not None:
        scale = cfg.post.critic_lr / cfg.optim.lr
        c.optim.lr, c.optim.min_lr = cfg.post.critic_lr, cfg.optim.min_lr * scale
    critic = Trainer(c, groups, device, vocab_size, eod=eod)
    for chunk in critic.chunks:
        chunk.values_per_token = True
    return critic
