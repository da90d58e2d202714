"""Reward-model training (``--post-train rm``): the Bradley-Terry loss on the scores of a pair's
chosen and rejected sequences, with Llama 2's margin and a reward-centring term.

The model's last stage returns one score per sequence (``model/value_head.py``: a scalar head
on the final-norm hidden state of the token ``last_token_mask`` selects), already summed over
tp (sequence parallel) and cp, so every rank of the stage holds every row's score and computes
the same pair losses. For P pairs with scores ``s_w`` (chosen, rows 2j) and ``s_l`` (rejected,
rows 2j + 1), each pair's loss is

    -log sigmoid(s_w - s_l - m) + c (s_w + s_l)^2

(Ouyang et al. 2022, eq. 1, the Bradley-Terry model; ``m`` the pair's margin with
``--rm-use-margin``, Touvron et al. 2023, sec. 3.2.2; ``c`` = ``--rm-center-coef``, Eisenstein et
al. 2023's auxiliary term that keeps the rewards centred on zero). The step minimises the mean
over the global batch's pairs, with DPO's divisor rule (``preference.py``): a micro-batch's share
is its summed pair losses over ``P / dp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megazero.post_training.preference import global_totals
from megazero.runtime.monitor import REWARD_MODEL_KEYS

METRICS = REWARD_MODEL_KEYS  # the names the monitor logs


@dataclass(frozen=True)
class RewardLoss:
    """The settings of ``--post-train rm`` (``megazero.config.schema.PostTrainConfig``)."""

    use_margin: bool = False
    center_coef: float = 0.0

    @property
    def uses_reference(self) -> bool:
        """A reward model compares two responses, not a policy with a reference."""
        return False


def reward_losses(s: RewardLoss, scores: torch.Tensor, margins: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-pair losses ``[P]`` (module docstring's formula) from the scores ``[2P]`` (rows 2j
    chosen, 2j + 1 rejected) and the pairs' margins ``[P]`` (read only with ``use_margin``).
    Computed in the dtype of ``scores``. Raises ValueError when ``use_margin`` has no margins or
    their count is not the pairs'."""
    sw, sl = scores[0::2], scores[1::2]
    x = sw - sl
    if s.use_margin:
        if margins is None or margins.numel() != sw.numel():
            got = "none" if margins is None else margins.numel()
            raise ValueError(f"--rm-use-margin needs one margin per pair: {sw.numel()} pairs, {got} margins")
        x = x - margins.to(scores.dtype)
    loss = -F.logsigmoid(x)
    if s.center_coef > 0:
        loss = loss + s.center_coef * (sw + sl) ** 2
    return loss


def last_token_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float32, 1 at the last position of each row whose ``loss_mask`` ``[B, T]`` is
    non-zero (the response's last token, whose label is the closing EOD) and 0 elsewhere; a row
    without a masked position is all zeros. Found from the mask alone: an EOD inside the prompt
    or right padding does not move it."""
    on = loss_mask > 0  # (B, T)
    T = loss_mask.shape[1]
    index = torch.arange(T, device=loss_mask.device).expand_as(on)
    last = torch.where(on, index, torch.full_like(index, -1)).amax(dim=1)  # (B,), -1: none
    return ((index == last.unsqueeze(1)) & on).to(torch.float32)


class RewardStep:
    """One step's reward-model losses on the last stage, with ``PreferenceStep``'s interface
    (the trainer's ``post.preference``): ``prepare`` (nothing to take: no reference model),
    ``loss(batch, scores)`` a micro-batch's share of the loss (fp64 scalar; ``batch[3]`` the
    pairs' margins ``[B/2]``), ``metrics`` the step's ``rm_accuracy`` (share of pairs with
    ``s_w > s_l``), ``rm_chosen_score`` and ``rm_rejected_score`` (mean scores).

    ``settings``: a ``RewardLoss``; ``groups``: the layout's ``ProcessGroups``;
    ``pairs_per_dp_rank``: P / dp, the divisor of a micro-batch's summed pair losses."""

    def __init__(self, settings: RewardLoss, groups, pairs_per_dp_rank: float):
        self.settings, self.groups, self.divisor = settings, groups, pairs_per_dp_rank
        self.totals: Optional[torch.Tensor] = None  # chosen, rejected, correct, pairs

    def prepare(self, batches: list, reference: Optional[list]) -> None:
        """Nothing to key: the scores and margins come with each micro-batch."""

    def loss(self, batch, scores: torch.Tensor) -> torch.Tensor:
        s = scores.double()
        margins = batch[3] if len(batch) > 3 else None
        losses = reward_losses(self.settings, s, margins)
        sw, sl = s[0::2].detach(), s[1::2].detach()
        row = torch.stack([sw.sum(), sl.sum(), (sw > sl).double().sum(), sw.new_tensor(len(sw))])
        self.totals = row if self.totals is None else self.totals + row
        return losses.sum() / self.divisor

    def metrics(self, device) -> dict:
        """The step's accuracy and mean scores over every pair of the global batch (collective
        over the world: one small all-reduce and one host read); resets."""
        chosen, rejected, correct, n = global_totals(self.totals, 4, self.groups, device)
        self.totals = None
        n = max(n, 1.0)
        return dict(zip(METRICS, (correct / n, chosen / n, rejected / n)))
