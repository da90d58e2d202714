"""Post-training modes of the one trainer (``--post-train``; docs/post-training.md).

``sft`` is supervised fine-tuning (``--sft``: data/sft.py's loss masks, the token-mean loss).
``rm`` trains a reward model (``reward.py``: a value head's scores, the Bradley-Terry loss).
``dpo`` is preference optimisation (``preference.py``, ``losses.py``) against a frozen
reference model built here in the training layout (``PostTraining.reference_chunks``).
``grpo`` and ``ppo`` learn from the policy's own rollouts (``megazero.training.rl``; the policy
loss ``rl_step.py`` on ``grpo.py``'s algebra, PPO's critic loss and KL controller ``ppo.py``).

The reference is, in this order: ``--ref-load DIR``'s latest checkpoint; the reference a
resumed checkpoint records; the policy's starting point: ``--load``'s checkpoint (with
``--finetune``, or a checkpoint of another mode), ``--from-hf``'s weights, or the seeded
initialisation. Checkpoints record it (``record``), so a resumed run compares with the same
model and not with the policy it saved. With ``--ref-offload`` its weights stay in host memory
between steps and come to the device for its forward pass only (``megazero.offload.host_resident``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch

from megazero.offload.host_resident import HostResident
from megazero.post_training.losses import PreferenceLoss
from megazero.post_training.ppo import AdaptiveKLController, FixedKLController
from megazero.post_training.preference import PreferenceStep, reference_forward_step
from megazero.post_training.reward import RewardLoss, RewardStep
from megazero.post_training.rl_step import PolicyLoss, PolicyStep, ValueStep

__all__ = ["PostTraining", "PreferenceLoss", "RewardLoss"]


class PostTraining:
    """What a post-training mode adds to a ``Trainer``: its preference step (DPO's
    ``PreferenceStep`` or the reward model's ``RewardStep``, the same interface), its reference model
    (built at first use, after any checkpoint was read) and the record kept in checkpoints.

    ``cfg``: the run's ``Config``; ``groups``: ``ProcessGroups``; ``build_reference(source) ->
    chunks``: builds the reference model in this rank's layout from a ``reference_source()``
    (``megazero.training.reference.build_reference``: the library packages do not import
    ``model``)."""

    def __init__(self, cfg, groups, build_reference: Callable[[dict], list]):
        self.cfg, self.groups, self.build_reference = cfg, groups, build_reference
        self.mode = cfg.post.mode
        self.preference: Optional[PreferenceStep | RewardStep] = None
        self.chunks: Optional[list] = None
        self.resident = None  # --ref-offload: the reference's host copy (HostResident)
        self.recorded: Optional[dict] = None
        if self.mode == "dpo":
            p = cfg.post
            settings = PreferenceLoss(p.dpo_loss, p.dpo_beta, p.dpo_label_smoothing, p.dpo_sft_weight, p.simpo_gamma)
            pairs = cfg.train.global_batch_size // 2
            self.preference = PreferenceStep(settings, groups, pairs / groups.dp_size)
        elif self.mode == "rm":
            settings = RewardLoss(cfg.post.rm_use_margin, cfg.post.rm_center_coef)
            self.preference = RewardStep(settings, groups, cfg.train.global_batch_size // 2 / groups.dp_size)
        self.policy: Optional[PolicyStep] = None  # grpo, ppo: the policy loss of each update
        self.value: Optional[ValueStep] = None  # ppo: the critic's loss
        self.kl = None  # ppo: the KL coefficient of the rewards (a FixedKLController or adaptive)
        p, replicas = cfg.post, groups.replicas().dp_size
        if self.mode == "grpo":  # the KL in the loss, or (--grpo-kl-in-reward) in the rewards
            beta = 0.0 if p.grpo_kl_in_reward else p.grpo_kl_beta
            loss = PolicyLoss(p.grpo_clamp_eps_lower, p.grpo_clamp_eps_upper, beta, p.grpo_kl_estimator)
            self.policy = PolicyStep(loss, groups, replicas)
        elif self.mode == "ppo":  # the KL enters the rewards, not the policy loss
            self.policy = PolicyStep(PolicyLoss(p.grpo_clamp_eps_lower, p.grpo_clamp_eps_upper), groups, replicas)
            self.value = ValueStep(p.cliprange_value, groups, replicas)
            self.kl = (
                FixedKLController(p.init_kl_coef)
                if p.kl_target is None
                else AdaptiveKLController(p.init_kl_coef, p.kl_target, p.kl_horizon)
            )

    @property
    def uses_reference(self) -> bool:
        if self.kl is not None:  # ppo: a KL penalty in the rewards
            return self.cfg.post.init_kl_coef > 0 or self.cfg.post.kl_target is not None
        if self.mode == "grpo":  # in the loss or in the rewards
            return self.cfg.post.grpo_kl_beta > 0
        step = self.preference if self.preference is not None else self.policy
        return step is not None and step.settings.uses_reference

    def resumed(self, meta: dict, root: str, weights_only: bool) -> None:
        """After a checkpoint under ``root`` was read: a resumed run (not ``--finetune``) keeps
        the reference its checkpoint records."""
        rec = (meta.get("extra") or {}).get("post_train") or {}
        if not weights_only and rec.get("reference") is not None:
            self.recorded = rec["reference"]
        if not weights_only and self.kl is not None and rec.get("kl") is not None:
            self.kl.load(rec["kl"])

    def reference_source(self) -> dict:
        """Where the reference comes from: ``{"load": DIR}``, ``{"hf": DIR}`` or ``{"init": seed}``
        (module docstring's order)."""
        from megazero.checkpoint import latest_iteration

        t = self.cfg.train
        if self.cfg.post.ref_load:
            return {"load": self.cfg.post.ref_load}
        if self.recorded is not None:
            return dict(self.recorded)
        if t.load and latest_iteration(t.load) is not None:
            return {"load": t.load}
        if t.from_hf:
            return {"hf": t.from_hf}
        return {"init": t.seed}

    def record(self) -> dict:
        """What a checkpoint keeps: the mode and, with a reference, its source."""
        rec = dict(mode=self.mode, reference=self.reference_source() if self.uses_reference else None)
        if self.kl is not None:
            rec["kl"] = self.kl.state()
        return rec

    def reference_chunks(self) -> list:
        """This rank's chunks of the frozen reference model (eval mode, no gradients), built at
        the first call by ``build_reference(source)`` from ``reference_source()`` (the
        trainer's ``megazero.training.reference.build_reference``). Raises CheckpointError for an
        unusable ``--ref-load``."""
        if self.chunks is None:
            self.chunks = self.build_reference(self.reference_source())
            if self.cfg.post.ref_offload:
                params = [p for c in self.chunks for p in c.parameters()]
                self.resident = HostResident(params, params[0].device)
        return self.chunks

    @torch.no_grad()
    def reference_sums(self, batches: list, run) -> list:
        """The reference's sequence log-probabilities ``[B]`` of each of ``batches`` (this rank's
        sharded micro-batches; None off the last stage). ``run(chunks, forward_step, batches)``
        runs the forward-only schedule (the trainer's)."""
        out: list = [None] * len(batches)
        index = {id(b): i for i, b in enumerate(batches)}

        def store(batch, sums):
            out[index[id(batch)]] = sums

        chunks = self.reference_chunks()
        with self.resident.on_device() if self.resident is not None else nullcontext():
            run(chunks, reference_forward_step(self.groups, store), batches)
        return out
