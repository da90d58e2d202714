"""Where a rank's tokens sit in their sequences: packed documents and the context-parallel split.

A micro-batch arrives as whole sequences ``tokens, labels [B, T]``. ``shard_micro_batch``
turns it into this cp rank's share (``[B, T/cp]``, chunks r and 2cp-1-r of the zigzag split,
megazero/context_parallel/zigzag.py) and a ``SequenceInfo`` with what attention, the position
embedding and the loss need to know about those tokens:

- ``token_index [T/cp]``: each local token's place in the sequence (the causal order); None at
  cp 1, where it is ``0..T-1`` (attention then takes plain causal SDPA unless documents mask it);
- ``position_ids [B, T/cp]``: the position the embedding or RoPE uses; ``token_index``
  unless ``--reset-position-ids``, when positions restart at 0 after each EOD token;
- ``segment_ids [B, T/cp]`` with ``--reset-attention-mask``: the document of each token (the
  number of EOD tokens before it, so an EOD belongs to the document it ends); a query
  attends a key only inside its own document;
- ``loss_mask [B, T/cp]`` with ``--eod-mask-loss``: 0 where the target is the EOD token; with
  supervised fine-tuning data (``--sft``, data/sft.py) the dataset's mask of the labels (1 on
  response tokens), times the EOD rule when both are on.

With multi-token prediction (``--mtp-num-layers D``, model/mtp.py) ``mtp_targets`` shifts the
whole sequences before the split, so the token ``k`` ahead of a local token is the sequence's
own even where it sits on another cp rank's chunk (``MTPTargets``).

These are Megatron-LM's ``get_ltor_masks_and_position_ids`` meanings (its masks per
document), with one difference: ``--eod-mask-loss`` here leaves out EOD *targets* (the issue's
definition: the count is of non-EOD targets), where Megatron zeroes the positions whose
*input* is EOD. The documents are computed on the whole sequence before the split, so a
document that spans two cp ranks keeps its ids and positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megazero.context_parallel.zigzag import local_token_index, split_for_rank


@dataclass(frozen=True)
class SequenceInfo:
    """This rank's tokens of a micro-batch of ``B`` sequences: shapes as in the module docstring
    (``Tl = T / cp``); ``segment_ids`` and ``loss_mask`` are None when their flag is off.
    ``cache`` holds what every layer of the micro-batch shares, built by the first that needs
    it (``attention.local_attention``'s document mask, the all-to-all's gathered document ids);
    it is not copied by ``dataclasses.replace``."""

    token_index: Optional[torch.Tensor]
    position_ids: torch.Tensor
    segment_ids: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)


@dataclass(frozen=True)
class Packing:
    """The packed-document flags and the EOD id (``None`` when no flag is set)."""

    eod: Optional[int] = None
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    @property
    def active(self) -> bool:
        return self.reset_attention_mask or self.reset_position_ids or self.eod_mask_loss

    def __post_init__(self):
        if self.active and self.eod is None:
            raise ValueError(
                "--reset-attention-mask / --reset-position-ids / --eod-mask-loss need the "
                "tokenizer's EOD id; fix: give a tokenizer or drop the flags"
            )


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[B, T]`` int64: the document of each token, the number of EOD tokens before it."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=1) - is_eod


def document_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64: each token's position inside its document (0 at a document's start)."""
    T = segment_ids.shape[1]
    index = torch.arange(T, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def target_mask(
    labels: torch.Tensor, packing: Packing, loss_mask: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """``[B, T]`` float32: 1 where the loss counts the target, or None when it counts them all.
    ``loss_mask [B, T]`` is the dataset's (SFT: 1 on response labels); ``--eod-mask-loss``
    also leaves out EOD targets."""
    mask = None if loss_mask is None else loss_mask.float()
    if packing.eod_mask_loss:
        not_eod = (labels != packing.eod).float()
        mask = not_eod if mask is None else mask * not_eod
    return mask


def counted_targets(labels: torch.Tensor, packing: Packing, loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Targets the loss counts in ``labels [B, T]`` (all of them unless ``--eod-mask-loss`` or a
    dataset ``loss_mask``, as ``target_mask``): a 0-d fp64 tensor on ``labels``' device (no
    host sync)."""
    mask = target_mask(labels, packing, loss_mask)
    if mask is not None:
        return mask.sum(dtype=torch.float64)
    return torch.tensor(float(labels.numel()), dtype=torch.float64, device=labels.device)


def shard_micro_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    cp: int,
    cp_rank: int,
    packing: Packing,
    loss_mask: Optional[torch.Tensor] = None,
) -> tuple:
    """``(tokens, labels)`` of ``[B, T]`` whole sequences (and the dataset's ``loss_mask [B, T]``
    of the labels, SFT data) -> this cp rank's ``(tokens, labels, SequenceInfo)`` of
    ``[B, T/cp]``; the pair unchanged when cp == 1, no packing flag is set and there is no
    ``loss_mask`` (the model then takes its default positions 0..T-1).

    Raises ValueError (via zigzag.split_for_rank) when cp > 1 and T is not divisible by 2 cp.
    """
    if cp == 1 and not packing.active and loss_mask is None:
        return tokens, labels
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    segments = None
    if packing.reset_attention_mask or packing.reset_position_ids:
        docs = document_ids(tokens, packing.eod)
        segments = docs if packing.reset_attention_mask else None
        if packing.reset_position_ids:
            positions = document_positions(docs)
    mask = target_mask(labels, packing, loss_mask)

    def local(x):
        return x if x is None or cp == 1 else split_for_rank(x, 1, cp_rank, cp)

    info = SequenceInfo(
        token_index=local_token_index(T, cp_rank, cp, device=tokens.device) if cp > 1 else None,
        position_ids=local(positions).contiguous(),
        segment_ids=local(segments),
        loss_mask=local(mask),
    )
    return local(tokens), local(labels), info


@dataclass(frozen=True)
class MTPTargets:
    """Multi-token prediction's inputs and targets of this rank's tokens (``Tl = T / cp``):
    ``tokens [B, Tl, D]`` int64, at position i and depth k (1-based, index k-1) the token
    ``t_{i+k}`` whose embedding enters depth k; ``labels [B, Tl, D]`` its target ``t_{i+k+1}``;
    ``mask [B, Tl, D]`` float32, 1 where that target counts; ``divisor [D]`` fp64, each depth's
    counted targets of the global batch divided by the replica ranks (dp x cp), at least
    ``1 / (dp x cp)``: the main loss's divisor rule, per depth; ``grad_scale`` (0-d) the
    gradient the MTP loss gets in the backward, the fp16 loss scale (else 1). The two are filled
    in by ``counted`` once the global counts are known."""

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    divisor: Optional[torch.Tensor] = None
    grad_scale: Optional[torch.Tensor] = None

    def counted(self, divisor: torch.Tensor, grad_scale: torch.Tensor) -> "MTPTargets":
        """These targets with their ``divisor [D]`` and ``grad_scale`` (0-d)."""
        return MTPTargets(self.tokens, self.labels, self.mask, divisor, grad_scale)


def mtp_targets(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    depth: int,
    packing: Packing,
    loss_mask: Optional[torch.Tensor] = None,
) -> MTPTargets:
    """``MTPTargets`` of whole sequences ``tokens, labels [B, T]`` (``labels[:, i] = t_{i+1}``) for
    ``depth`` D modules, without a divisor: at depth k the input ``tokens[:, i+k]`` and the target
    ``labels[:, i+k]``, counted where (1) ``i + k < T`` (positions without a k-shifted target are
    masked; their token and label are 0), (2) the main loss would count ``labels[:, i+k]``
    (``target_mask``: the dataset's loss mask, ``--eod-mask-loss``'s EOD targets) and (3) with
    packed documents (any of the packing flags) no EOD among ``tokens[:, i .. i+k]``: the chain
    from position i's hidden state to the target stays inside one document. Raises ValueError
    unless ``1 <= depth < T``."""
    B, T = tokens.shape
    if not 1 <= depth < T:
        raise ValueError(f"--mtp-num-layers {depth} must be in [1, {T}) for sequences of {T} tokens")
    base = target_mask(labels, packing, loss_mask)
    base = torch.ones(B, T, device=tokens.device) if base is None else base
    eod = (tokens == packing.eod) if packing.active else torch.zeros(B, T, dtype=torch.bool, device=tokens.device)
    shifted_tokens = torch.zeros(B, T, depth, dtype=tokens.dtype, device=tokens.device)
    shifted_labels = torch.zeros(B, T, depth, dtype=labels.dtype, device=labels.device)
    mask = torch.zeros(B, T, depth, dtype=torch.float32, device=tokens.device)
    crossed = eod.clone()  # crossed[:, i]: an EOD among tokens[:, i .. i+k] (k = 0 so far)
    for k in range(1, depth + 1):
        n = T - k  # positions 0 .. n-1 have the target labels[:, i+k]
        crossed[:, :n] |= eod[:, k:]
        shifted_tokens[:, :n, k - 1] = tokens[:, k:]
        shifted_labels[:, :n, k - 1] = labels[:, k:]
        mask[:, :n, k - 1] = base[:, k:] * (~crossed[:, :n]).float()
    return MTPTargets(shifted_tokens, shifted_labels, mask)


def local_mtp_targets(targets: MTPTargets, cp: int, cp_rank: int) -> MTPTargets:
    """This cp rank's zigzag share (``[B, T/cp, D]``) of whole-sequence ``targets``."""
    if cp == 1:
        return targets
    tokens, labels, mask = (split_for_rank(x, 1, cp_rank, cp) for x in (targets.tokens, targets.labels, targets.mask))
    return MTPTargets(tokens, labels, mask, targets.divisor, targets.grad_scale)
