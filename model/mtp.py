"""Multi-token prediction (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 2.2).

Besides the next token, D sequential modules on the last stage predict the tokens 2 .. D+1
ahead. Depth k (1-based) at position i combines the previous depth's hidden state ``h^{k-1}_i``
(depth 0: the main model's output after its final norm, as Megatron-LM passes it) with the
embedding of token ``t_{i+k}``:

    h'^k_i = M_k [enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]       (M_k = ``eh_proj``, [H, 2H])
    h^k    = final_ln_k(TRM_k(h'^k))                            (one block, causal as the model's)
    P^k_i  = softmax(OutHead(h^k_i))                             -> target t_{i+k+1}

The paper's eq. 21 writes the hidden state first in the concatenation; DeepSeek's released
weights and Megatron-LM put the embedding first, which is followed here so that their
``eh_proj`` loads unchanged. The embedding ``Emb`` and the output head are the main model's
(shared: on a pipeline the last stage keeps a copy of the word embedding, tagged and
all-reduced with the first stage's as a tied weight is). ``TRM_k`` is a block of the model's
kind with a dense MLP, full causal attention (no sliding window) and the model's positions
and documents (``SequenceInfo``); the norms are the model's normalization.

The loss (eq. 25): ``L_MTP = lambda / D * sum_k CE_k``, each ``CE_k`` the mean over depth k's
counted targets of the global batch (``megazero.context_parallel.sequence.MTPTargets``: shifted
on whole sequences before the context-parallel split, masked past the sequence's end and
across documents). It is added to the training loss through ``MTPLossBackward`` (the main loss
stays the reported ``loss``; the MTP loss is logged apart as ``mtp_loss``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megazero.context_parallel.sequence import MTPTargets, SequenceInfo


class MTPLossBackward(torch.autograd.Function):
    """``y = MTPLossBackward.apply(x, loss, scale)`` returns ``x`` unchanged; the backward gives
    ``loss`` the gradient ``scale`` (a 0-d tensor: the fp16 loss scale, else 1), as if
    ``loss`` had been added to the micro-batch's share of the training loss (Megatron-LM's
    ``MTPLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss, scale)
        return x

    @staticmethod
    def backward(ctx, grad):
        loss, scale = ctx.saved_tensors
        return grad, torch.ones_like(loss) * scale.to(loss.dtype), None


class MTPModule(nn.Module):
    """Depth k's module: ``[B, T(/tp), H]`` hidden of depth k-1 and the embeddings of the tokens
    k ahead (``[B, T(/tp), H]``, sequence-parallel like the hidden) -> depth k's hidden after its
    final norm ``[B, T(/tp), H]``. ``make_norm()`` builds the model's norm over H; ``block`` is
    a ``model.gpt.Block`` (dense MLP, no window). ``eh_proj`` is replicated over tp: its input
    ``2H`` is whole on every rank (under sequence parallelism each rank's ``T/tp`` tokens)."""

    def __init__(self, hidden_size: int, make_norm: Callable[[], nn.Module], block: nn.Module, dtype, device=None):
        super().__init__()
        self.enorm, self.hnorm = make_norm(), make_norm()
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype, device=device)
        self.block = block
        self.final_ln = make_norm()

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, seq: Optional[SequenceInfo]) -> torch.Tensor:
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)  # (B, T(/tp), 2H)
        x = self.eh_proj(x)  # (B, T(/tp), H)
        x = self.block(x) if seq is None else self.block(x, seq)
        return self.final_ln(x)


def mtp_loss(
    modules: nn.ModuleList,
    hidden: torch.Tensor,
    targets: MTPTargets,
    seq: Optional[SequenceInfo],
    embed: Callable[[torch.Tensor], torch.Tensor],
    token_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scaling_factor: float,
) -> torch.Tensor:
    """This micro-batch's share of ``L_MTP`` (0-d fp64): ``lambda / D * sum_k sum_i mask_k[i] *
    CE_k[i] / divisor_k`` over this rank's tokens, with ``hidden`` the main model's output after
    its final norm ``[B, T(/tp), H]``, ``embed(tokens [B, T]) -> [B, T(/tp), H]`` the shared word
    embedding and ``token_losses(h, labels [B, T]) -> [B, T]`` fp32 the shared head's
    cross-entropy. ``targets``' tensors are ``[B, T, D]`` (this cp rank's ``T``)."""
    D = len(modules)
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    h = hidden
    for k, module in enumerate(modules):
        h = module(h, embed(targets.tokens[..., k].contiguous()), seq)  # (B, T(/tp), H)
        ce = token_losses(h, targets.labels[..., k].contiguous())  # (B, T) fp32
        total = total + (ce * targets.mask[..., k]).sum(dtype=torch.float64) / targets.divisor[k]
    return total * (scaling_factor / D)
