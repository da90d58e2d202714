"""Preference losses on sequence log-probabilities: DPO, IPO, SimPO, hinge (SLiC), with label
smoothing (conservative DPO) and an SFT term (RPO). Pure functions of per-sequence sums, so a
layout only has to deliver the same sums (``megazero.post_training.preference``).

Inputs, for P pairs: ``policy`` and ``reference`` ``[2P]`` float64, the summed log-probability
log pi(y | x) of each sequence's response tokens (rows 2j chosen, 2j + 1 rejected, as
``data.preference`` lays pairs out); ``lengths`` ``[2P]`` the response tokens counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid", "ipo", "simpo", "hinge")


@dataclass(frozen=True)
class PreferenceLoss:
    """The settings of ``--post-train dpo`` (``megazero.config.schema.PostTrainConfig``)."""

    kind: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def uses_reference(self) -> bool:
        """SimPO is reference-free; the others compare with a frozen reference."""
        return self.kind != "simpo"


def preference_losses(
    s: PreferenceLoss, policy: torch.Tensor, reference: Optional[torch.Tensor], lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses ``[P]`` and the implicit rewards of the chosen and the rejected response
    ``[P]`` each (detached), from per-sequence sums ``[2P]`` (module docstring).

    With ``h_w = log pi(y_w) - log pi_ref(y_w)``, ``h_l`` likewise for the rejected response and
    ``z = h_w - h_l``:

    - ``sigmoid`` (DPO, Rafailov et al. 2023, eq. 7): ``-(1 - e) log sig(beta z) - e log sig(-beta z)``
      with ``e`` = ``label_smoothing`` (conservative DPO: the preference flipped with probability e);
      rewards ``beta h_w``, ``beta h_l``.
    - ``ipo`` (Azar et al. 2023, eq. 17): ``(z' - 1 / (2 beta))^2`` where ``z'`` uses the
      log-ratios averaged over each response's tokens (as TRL computes IPO).
    - ``hinge`` (SLiC-HF, Zhao et al. 2023): ``max(0, 1 - beta z)``.
    - ``simpo`` (Meng et al. 2024, eq. 6), no reference: rewards ``beta log pi(y) / |y|``,
      loss as ``sigmoid`` on ``r_w - r_l - gamma``.

    ``sft_weight`` > 0 adds ``sft_weight x (-log pi(y_w) / |y_w|)`` (RPO, Pang et al. 2024).
    Raises ValueError for another ``kind`` or a missing reference where one is needed.
    """
    if s.kind not in LOSSES:
        raise ValueError(f"--dpo-loss {s.kind}: not one of {', '.join(LOSSES)}")
    if s.uses_reference and reference is None:
        raise ValueError(f"--dpo-loss {s.kind} needs the reference model's log-probabilities")
    lengths = lengths.to(policy.dtype).clamp_min(1.0)
    pw, pl = policy[0::2], policy[1::2]
    e, beta = s.label_smoothing, s.beta
    if s.kind == "simpo":
        rw, rl = beta * pw / lengths[0::2], beta * pl / lengths[1::2]
        x = rw - rl - s.simpo_gamma
        loss = -(1 - e) * F.logsigmoid(x) - e * F.logsigmoid(-x)
    else:
        hw, hl = pw - reference[0::2], pl - reference[1::2]
        rw, rl = beta * hw, beta * hl
        if s.kind == "ipo":
            z = hw / lengths[0::2] - hl / lengths[1::2]
            loss = (z - 1 / (2 * beta)) ** 2
        elif s.kind == "hinge":
            loss = torch.relu(1 - beta * (hw - hl))
        else:
            x = beta * (hw - hl)
            loss = -(1 - e) * F.logsigmoid(x) - e * F.logsigmoid(-x)
    if s.sft_weight > 0:
        loss = loss + s.sft_weight * (-pw / lengths[0::2])
    return loss, rw.detach(), rl.detach()
