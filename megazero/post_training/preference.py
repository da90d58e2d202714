"""Preference optimisation (``--post-train dpo``) under every layout: sequence log-probabilities
from the vocabulary-parallel cross-entropy, a frozen reference model in the training layout, the
pair losses of ``losses.py`` and their metrics.

How a layout delivers the single process's loss and gradients (docs/post-training.md):

- tp: the last stage's per-token loss ``-log p(label)`` is already complete on every tp rank
  (``megazero.tensor_parallel.cross_entropy``); sp gathers the sequence before the output layer.
- cp: each rank holds ``T / cp`` tokens of every sequence (zigzag); the masked sums are summed
  over the cp group (``sum_over_cp``), so every cp rank computes the same pair losses. Its
  backward multiplies the gradient by cp: the adjoint of the sum is an all-reduce of the cp
  ranks' upstream gradients, which are equal because every rank computes the same loss of
  the same sums; the replica gradient mean (over dp x cp) then gives the true gradient.
- pp: only the last stage computes losses; the reference's sums are needed only there.
- dp / ZeRO: a micro-batch's share is its pair losses summed over ``P / dp`` (P the pairs of the
  global batch), so the replica mean of the gradients is the gradient of the mean pair loss.
  The reference model is replicated over dp (not sharded): 2 or 4 bytes per parameter of the
  rank's tp x pp partition, no gradients or optimizer state.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megazero import collectives
from megazero.post_training.losses import PreferenceLoss, preference_losses
from megazero.runtime.monitor import PREFERENCE_KEYS

METRICS = PREFERENCE_KEYS  # the names the monitor logs


class _SumOverCP(torch.autograd.Function):
    """Sum over the cp group forward; gradient times cp backward (module docstring)."""

    @staticmethod
    def forward(ctx, x, group, size: int):
        ctx.size = size
        y = x.clone()
        collectives.all_reduce_sum(y, group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None, None


def sum_over_cp(x: torch.Tensor, groups) -> torch.Tensor:
    """``x`` (any shape) summed over this rank's context-parallel group; identity at cp 1.
    Differentiable as the module docstring says (valid where every cp rank computes the same
    function of the result)."""
    if groups.cp_size == 1:
        return x
    if not x.requires_grad:
        y = x.clone()
        collectives.all_reduce_sum(y, groups.cp)
        return y
    return _SumOverCP.apply(x, groups.cp, groups.cp_size)


def sequence_sums(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each sequence's masked tokens ``[B]`` float64, differentiable; the
    masked token count ``[B]`` float64) from the last stage's per-token loss ``[B, T/cp]``
    (``-log p(label)`` at temperature 1) and the loss mask of the same shape, whole sequences
    over the cp group."""
    logp = -(per_token_loss.double() * loss_mask.double()).sum(dim=1)
    return sum_over_cp(logp, groups), sum_over_cp(loss_mask.double().sum(dim=1).detach(), groups)


def global_totals(totals: Optional[torch.Tensor], size: int, groups, device) -> list[float]:
    """The sums ``totals`` (a float64 ``[size]`` vector accumulated on the last stage, or None)
    over every pair of the global batch: each last-stage tp 0 / cp 0 rank's, all-reduced over the
    world (one small all-reduce and one host read); the same list on every rank."""
    v = torch.zeros(size, dtype=torch.float64, device=device)
    if totals is not None and groups.tp_rank == 0 and groups.cp_rank == 0:
        v.copy_(totals)
    collectives.all_reduce_sum(v, groups.world)
    return v.tolist()


class PreferenceStep:
    """One step's preference losses on the last stage: ``prepare`` keys the step's micro-batches
    and takes the reference sums; ``loss(batch, per_token_loss)`` is a micro-batch's share of the
    loss (fp64 scalar) and adds its pairs to the metrics.

    ``settings``: a ``PreferenceLoss``; ``groups``: the layout's ``ProcessGroups``;
    ``pairs_per_dp_rank``: P / dp, the divisor of a micro-batch's summed pair losses."""

    def __init__(self, settings: PreferenceLoss, groups, pairs_per_dp_rank: float):
        self.settings, self.groups, self.divisor = settings, groups, pairs_per_dp_rank
        self.index: dict[int, int] = {}
        self.reference: list[Optional[torch.Tensor]] = []
        self.totals: Optional[torch.Tensor] = None  # chosen, rejected, correct, margin, pairs

    def prepare(self, batches: list, reference: Optional[list]) -> None:
        """Key ``batches`` (this rank's sharded micro-batches) by identity; ``reference``: their
        reference sums ``[B]`` per micro-batch (None entries off the last stage), or None."""
        self.index = {id(b): i for i, b in enumerate(batches)}
        self.reference = reference if reference is not None else [None] * len(batches)

    def loss(self, batch, per_token_loss: torch.Tensor) -> torch.Tensor:
        seq = batch[2]
        logp, lengths = sequence_sums(per_token_loss, seq.loss_mask, self.groups)
        ref = self.reference[self.index[id(batch)]]
        losses, rw, rl = preference_losses(self.settings, logp, ref, lengths)
        self._count(rw, rl)
        return losses.sum() / self.divisor

    def _count(self, rw: torch.Tensor, rl: torch.Tensor) -> None:
        row = torch.stack([rw.sum(), rl.sum(), (rw > rl).double().sum(), (rw - rl).sum(), rw.new_tensor(len(rw))])
        self.totals = row if self.totals is None else self.totals + row

    def metrics(self, device) -> dict:
        """The step's mean implicit rewards, reward accuracy and margin over every pair of the
        global batch (collective over the world: one small all-reduce and one host read); resets."""
        chosen, rejected, correct, margin, n = global_totals(self.totals, 5, self.groups, device)
        self.totals = None
        n = max(n, 1.0)
        return dict(zip(METRICS, (chosen / n, rejected / n, correct / n, margin / n)))


def reference_forward_step(groups, store: Callable[[object, torch.Tensor], None]):
    """Forward step (``megazero.pipeline.executor`` contract) of the reference model: the last
    stage's loss function hands ``store(batch, sums)`` each micro-batch's sequence sums ``[B]``
    and returns a zero loss."""

    def forward_step(batch, chunk, input_tensor):
        tokens, labels, *rest = batch
        seq = rest[0] if rest else None
        x = tokens if input_tensor is None else input_tensor
        out = chunk(x, labels=labels if chunk.post_process else None, seq=seq)

        def loss_fn(per_token_loss):
            store(batch, sequence_sums(per_token_loss, seq.loss_mask, groups)[0])
            return per_token_loss.new_zeros((), dtype=torch.float64)

        return out, loss_fn

    return forward_step
