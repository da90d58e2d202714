"""The policy update of ``--post-train grpo`` under every layout: the clipped surrogate and the KL
penalty of ``grpo.py`` on the last stage's per-token log-probabilities, each token weighted by
its closed-form share of the step's loss (``grpo.token_weights``).

A micro-batch arrives as ``(tokens, labels, seq, extra)``: this rank's ``T / cp`` tokens of each
row (``megazero.context_parallel.sequence.shard_micro_batch``) and ``extra`` ``[B, T / cp, 6]``
float64, cut from the whole rows the same way (columns ``OLD``: the rollout's log-probability of
each label, ``REF``: the reference model's, filled on the last stage just before the update,
``ADVANTAGE``: the token's advantage, ``WEIGHT``: the token's weight, 0 off the response; PPO's
critic: ``VALUE``, its value before the update, and ``RETURN``, the GAE return). The
chunk's per-token loss is ``-log p(label)`` at the rollout's temperature
(``GPTStage.logit_temperature``).

How a layout gives the single process's gradient: the weights are computed over the whole
step's rows before any split, so the loss is a plain sum over tokens; a rank's share is its
tokens' weighted sum times R = dp x cp, the replica ranks whose gradients are averaged (the
mean of R shares is the sum of the tokens); tp ranks hold complete per-token losses, pp runs the
loss on the last stage only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megazero import collectives
from megazero.post_training.grpo import clipped_surrogate, kl_penalty
from megazero.post_training.ppo import value_loss

OLD, REF, ADVANTAGE, WEIGHT, VALUE, RETURN = range(6)
COLUMNS = 6
METRICS = ("rl_clip_fraction", "rl_ratio_deviation", "rl_kl")


@dataclass(frozen=True)
class PolicyLoss:
    """The settings of the policy loss (``megazero.config.schema.PostTrainConfig``): clip bounds
    ``eps_low`` / ``eps_high`` (``--grpo-clamp-eps-lower/upper``), KL weight ``kl_beta``
    (``--grpo-kl-beta``, 0 = no reference model) and estimator ``kl_estimator``."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_beta: float = 0.0
    kl_estimator: str = "k3"

    @property
    def uses_reference(self) -> bool:
        return self.kl_beta > 0


def per_token_objective(s: PolicyLoss, logp: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """The per-token loss ``[B, T]`` float64 (clipped surrogate plus ``kl_beta`` x KL estimate)
    from the policy's log-probabilities ``logp`` ``[B, T]`` and ``extra`` ``[B, T, 4]``."""
    logp = logp.double()
    loss = clipped_surrogate(logp, extra[..., OLD], extra[..., ADVANTAGE], s.eps_low, s.eps_high)
    if s.uses_reference:
        loss = loss + s.kl_beta * kl_penalty(logp, extra[..., REF], s.kl_estimator)
    return loss


class PolicyStep:
    """One optimizer step's policy loss on the last stage, with ``PreferenceStep``'s interface
    (``loss(batch, per_token_loss)``, a micro-batch's share, fp64 scalar; ``metrics``).

    ``settings``: a ``PolicyLoss``; ``groups``: the layout's ``ProcessGroups``; ``replicas``: the
    replica-rank count R = dp x cp (module docstring)."""

    def __init__(self, settings: PolicyLoss, groups, replicas: int):
        self.settings, self.groups, self.replicas = settings, groups, replicas
        self.totals: Optional[torch.Tensor] = None  # tokens, clipped, kl
        self.deviation: Optional[torch.Tensor] = None  # max |ratio - 1|

    def loss(self, batch, per_token_loss: torch.Tensor) -> torch.Tensor:
        extra = batch[3]
        logp = -per_token_loss
        per_token = per_token_objective(self.settings, logp, extra)
        w = extra[..., WEIGHT]
        self._count(logp.detach().double(), extra, w > 0)
        return (per_token * w).sum() * self.replicas

    def _count(self, logp: torch.Tensor, extra: torch.Tensor, on: torch.Tensor) -> None:
        s = self.settings
        ratio = torch.exp(logp - extra[..., OLD])
        a = extra[..., ADVANTAGE]
        clipped = (-a * ratio.clamp(1 - s.eps_low, 1 + s.eps_high)) > (-a * ratio)
        kl = kl_penalty(logp, extra[..., REF], s.kl_estimator) if s.uses_reference else torch.zeros_like(logp)
        on_f = on.double()
        row = torch.stack([on_f.sum(), (clipped & on).double().sum(), (kl * on_f).sum()])
        self.totals = row if self.totals is None else self.totals + row
        dev = ((ratio - 1).abs() * on_f).amax() if on.any() else ratio.new_zeros(())
        self.deviation = dev if self.deviation is None else torch.maximum(self.deviation, dev)

    def metrics(self, device) -> dict:
        """Over every weighted token of the step (collective over the world: one small
        all-reduce and one host read; resets): ``rl_clip_fraction`` (share of tokens whose
        clipped branch is taken, PPO's clipfrac), ``rl_ratio_deviation`` (the largest |ratio - 1|;
        rounding only on the first update of a rollout, where the policy is the sampler) and
        ``rl_kl`` (mean KL estimate to the reference; 0 without one). Two small all-reduces."""
        v = torch.zeros(3, dtype=torch.float64, device=device)
        m = torch.zeros(1, dtype=torch.float64, device=device)
        if self.totals is not None and self.groups.tp_rank == 0:
            v.copy_(self.totals)
            m.copy_(self.deviation.reshape(1))
        collectives.all_reduce_sum(v, self.groups.world)
        collectives.all_reduce_max(m, self.groups.world)
        self.totals = self.deviation = None
        n, clipped, kl = v.tolist()
        n = max(n, 1.0)
        return dict(zip(METRICS, (clipped / n, float(m[0]), kl / n)))


class ValueStep:
    """One optimizer step's critic loss (``--post-train ppo``) on the last stage, with
    ``PolicyStep``'s interface: ``loss(batch, values)`` from the critic's per-token values
    ``[B, T/cp]`` is the tokens' ``WEIGHT``-weighted clipped value loss (``ppo.value_loss``
    against ``RETURN`` around ``VALUE``, ``clip_range`` = ``--cliprange-value``) times R = dp x cp;
    ``metrics``: ``critic_loss`` (the weighted value loss of the step)."""

    def __init__(self, clip_range, groups, replicas: int):
        self.clip_range, self.groups, self.replicas = clip_range, groups, replicas
        self.total: Optional[torch.Tensor] = None

    def loss(self, batch, values: torch.Tensor) -> torch.Tensor:
        extra = batch[3]
        each = value_loss(values.double(), extra[..., VALUE], extra[..., RETURN], self.clip_range)
        mine = (each * extra[..., WEIGHT]).sum()
        self.total = mine.detach() if self.total is None else self.total + mine.detach()
        return mine * self.replicas

    def metrics(self, device) -> dict:
        """The step's weighted value loss over every token (collective over the world; resets)."""
        v = torch.zeros(1, dtype=torch.float64, device=device)
        if self.total is not None and self.groups.tp_rank == 0:
            v.copy_(self.total.reshape(1))
        collectives.all_reduce_sum(v, self.groups.world)
        self.total = None
        return dict(critic_loss=float(v[0]))
