"""The scalar value head of a reward model (``--post-train rm``; docs/post-training.md).

A reward model is the GPT with its output layer replaced by ``Linear(H -> 1, bias=False)``
applied to the final-norm hidden state of one token per sequence (Ouyang et al. 2022, sec.
3.5; Stiennon et al. 2020, sec. 3.4). The token scored is the last position whose loss mask is
1: its label is the EOD closing the response, so its hidden state has read the whole prompt
and response. This is the token Hugging Face's ``*ForSequenceClassification`` scores with
``pad_token_id`` = EOD (the last token that is not padding), which makes the export exact.

The head lives on the last pipeline stage as canonical parameter ``value_head.weight``
``[1, H]``, fp32, replicated over tp (``model/spec.py``). The trainer hands each sequence's
choice as a one-hot mask over its tokens (``megazero.post_training.reward.last_token_mask``,
sharded like a loss mask), so no rank searches for a pad id.

Layouts: every tp rank holds the whole final-norm hidden state unless sequence parallelism
splits it ``[B, T/tp, H]``; context parallelism splits it ``[B, T/cp, H]`` (zigzag). A rank
scores the selected token only where it holds it (zero elsewhere), and the partial scores are
summed: over tp with sequence parallelism (Megatron's ``g``: the backward is the identity, as
tp ranks hold the true gradient of their own tokens, and the replicated head's gradient is
summed over tp by the sequence-parallel rule), then over cp (``sum_over_cp``: the backward
multiplies by cp, which the replica mean over dp x cp divides out). Every rank of the stage
then holds every row's score.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Optional

import torch
from torch import nn

from megazero import collectives as C
from megazero.context_parallel.sequence import SequenceInfo
from megazero.post_training.preference import sum_over_cp
from megazero.tensor_parallel.mappings import reduce_from_tp_region

HEAD = "value_head.weight"


class ValueHead(nn.Module):
    """``Linear(H -> 1, bias=False)`` in fp32 on one selected token per sequence.

    ``forward(hidden, seq)``: ``hidden`` the final-norm output ``[B, T_local, H]`` (``T_local``
    = ``T/cp``, or ``T/(cp tp)`` with sequence parallelism); ``seq.loss_mask`` ``[B, T/cp]``
    the one-hot of each sequence's scored token (all zeros: score 0). Returns the scores
    ``[B]`` fp32, the same on every rank of the stage. Raises ValueError without ``seq`` or
    its mask (a reward model needs to know which token to score).
    """

    def __init__(self, hidden_size: int, groups, sequence_parallel: bool, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=torch.float32, device=device))
        self.groups, self.sp = groups, sequence_parallel

    def forward(self, hidden: torch.Tensor, seq: Optional[SequenceInfo]) -> torch.Tensor:
        if seq is None or seq.loss_mask is None:
            raise ValueError(
                "the value head scores the token a loss mask selects; give the micro-batch its mask "
                "(megazero.post_training.reward.last_token_mask)"
            )
        select = seq.loss_mask  # (B, T/cp)
        if self.sp:  # this rank's T/(cp tp) positions of the local sequence
            n = hidden.shape[1]
            r = C.group_rank(self.groups.tp)
            select = select[:, r * n : (r + 1) * n]  # (B, T/(cp tp))
        picked = (hidden.float() * select.to(torch.float32).unsqueeze(-1)).sum(dim=1)  # (B, H)
        score = (picked @ self.weight.t()).squeeze(-1)  # (B,)
        if self.sp:
            score = reduce_from_tp_region(score, self.groups.tp)
        return sum_over_cp(score, self.groups)


def per_token_values(head: ValueHead, hidden: torch.Tensor) -> torch.Tensor:
    """A critic's value of every local position (``--post-train ppo``): ``[B, T/cp]`` fp32 from
    the final-norm ``hidden`` ``[B, T/cp, H]`` and the head's ``[1, H]`` weight, the same on
    every tp rank (each holds the whole hidden state). Raises ValueError under sequence
    parallelism (the positions would be split over tp; not built)."""
    if head.sp:
        raise ValueError("per-token values under --sequence-parallel are not built; drop --sequence-parallel")
    return (hidden.float() @ head.weight.t()).squeeze(-1)


class WithSeededHead(Mapping):
    """A language model's canonical full tensors (``lm``, e.g. a ``--from-hf`` folder's
    ``model.hf.CanonicalView``) plus a reward model's ``value_head.weight`` drawn from (seed,
    name) as the seeded initialisation draws it (``heads[HEAD]``, ``model.spec.InitialWeights``):
    how a reward model starts from a language model that has no head."""

    def __init__(self, lm: Mapping, heads: Mapping):
        self.lm, self.heads = lm, heads

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.heads[HEAD] if name == HEAD else self.lm[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.lm
        yield HEAD

    def __len__(self) -> int:
        return len(self.lm) + 1
