"""QK-Clip (Kimi K2, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, sec. 2.1: MuonClip).

Muon lets the attention logits of a few heads grow without bound; QK-Clip caps them by
rescaling the weights after the optimizer step. For head h, with the step's largest
pre-softmax logit over every (query, key) pair the causal mask allows,

    S_h = max_{b, i, j <= i} q_{b,i}^h . k_{b,j}^h / sqrt(d)      (over the whole global batch)
    gamma_h = min(1, tau / S_h)
    W_q^h <- gamma_h^alpha W_q^h,   W_k^h <- gamma_h^(1 - alpha) W_k^h

so that the same inputs would give logits scaled by gamma_h (at most tau); heads below tau are
untouched. A key head that several query heads share (grouped-query attention) is not scaled,
and each query head takes its whole gamma_h, as the paper treats MLA's shared rotary key (its
q^R takes gamma, k^R none). The bias rows of q and k scale with their weight rows, so q and k
themselves scale exactly (RoPE is linear in them).

Pieces: ``head_max_logits`` is each attention layer's per-head maximum of one micro-batch (the layer
keeps a running max over the step's micro-batches); ``row_factors`` turns a layer's maxima into
one factor per row of its TP-local QKV weight (model/gpt.py's row order); ``QKClip`` reduces the
maxima of every layer of this rank with one MAX all-reduce over the data-parallel group (dp x
cp: the ranks that split the global batch; tp ranks hold other heads, stages other layers) and
hands ``megazero.optim.muon.MuonOptimizer`` the ``(parameter, row factors)`` pairs, which it
applies to the owned elements of the fp32 main parameters before they reach the model.
"""

from __future__ import annotations

from typing import Optional

import torch

from megazero import collectives as C
from megazero.process_groups import ProcessGroups

QUERY_BLOCK = 256  # queries per block of head_max_logits: [B, h, 256, T] fp32 logits at a time


@torch.no_grad()
def head_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
    segment_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Each query head's largest causal pre-softmax logit ``scale * q . k``: q ``[B, h, T, d]``,
    k ``[B, g, T, d]`` (g divides h; query head i reads key head ``i // (h / g)``) -> ``[h]``
    fp32. Only pairs the attention uses count: key position j <= i, ``i - j < window`` when
    given, and the same document when ``segment_ids [B, T]`` is given. Computed in fp32, over
    blocks of ``QUERY_BLOCK`` queries (a temporary of ``B h QUERY_BLOCK T`` floats, not ``B h T^2``)."""
    B, h, T, _ = q.shape
    k = k.float().repeat_interleave(h // k.shape[1], dim=1)  # (B, h, T, d)
    j = torch.arange(T, device=q.device)
    best = torch.full((h,), float("-inf"), device=q.device)
    for start in range(0, T, QUERY_BLOCK):
        i = j[start : start + QUERY_BLOCK]  # (c,) query positions
        logits = torch.einsum("bhid,bhjd->bhij", q[:, :, i].float(), k) * scale  # (B, h, c, T)
        allowed = j[None, :] <= i[:, None]  # (c, T): key j <= query i
        if window is not None:
            allowed = allowed & (i[:, None] - j[None, :] < window)
        allowed = allowed.expand(B, 1, i.numel(), T)
        if segment_ids is not None:
            allowed = allowed & (segment_ids[:, None, i, None] == segment_ids[:, None, None, :])
        top = logits.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))  # (h,)
        best = torch.maximum(best, top)
    return best


def row_factors(
    maxima: torch.Tensor, tau: float, alpha: float, q_per_group: int, head_dim: int, grouped: bool
) -> torch.Tensor:
    """One scale per row of a TP-local QKV weight from its heads' maxima ``[h]`` (h = n_head/tp):
    ``[rows/tp]`` fp32, in model/gpt.py's row order: ``[q of h heads; k of h; v of h]`` (multi-head,
    stride 3) or, ``grouped``, ``h / q_per_group`` blocks ``[q of q_per_group heads; k; v]``, each
    head ``head_dim`` rows. gamma = min(1, tau / max) (1 where a head saw no logit, max -inf);
    multi-head (``q_per_group`` 1): q rows gamma^alpha, k rows gamma^(1 - alpha); shared keys
    (``q_per_group`` > 1): q rows gamma, k rows 1; v rows 1 always."""
    gamma = torch.where(maxima > tau, tau / maxima, torch.ones_like(maxima)).float()  # (h,)
    if q_per_group == 1:
        q, k = gamma.pow(alpha), gamma.pow(1 - alpha)  # (h,)
    else:
        q, k = gamma, torch.ones(gamma.numel() // q_per_group, device=gamma.device)  # (h,), (h/q_per_group,)
    v = torch.ones_like(k)
    if grouped:  # per group: its q heads, then its key head, then its value head
        heads = torch.cat([q.view(k.numel(), q_per_group), k[:, None], v[:, None]], dim=1)  # (g, q_per_group + 2)
    else:
        heads = torch.cat([q, k, v])  # (3h,)
    return heads.reshape(-1).repeat_interleave(head_dim)  # (rows/tp,)


class QKClip:
    """The step's QK-Clip over the attention layers of ``chunks`` (this rank's model chunks):
    turns recording on in every layer that offers it (``record_max_logits``) and gives
    ``MuonOptimizer`` its ``(parameter, row factors [rows/tp])`` pairs (the QKV weight, and its
    bias when there is one) through ``factors``; ``reset`` clears the maxima after each step
    (also a skipped one). ``tau`` the threshold (> 0), ``alpha`` the query's share in (0, 1).
    Raises ValueError for a ``tau`` or ``alpha`` out of range."""

    def __init__(self, chunks, groups: ProcessGroups, tau: float, alpha: float):
        if tau <= 0 or not 0 < alpha < 1:
            raise ValueError(f"QK-Clip needs tau > 0 and 0 < alpha < 1, got tau {tau}, alpha {alpha}")
        self.tau, self.alpha, self.group = tau, alpha, groups.dp_cp
        self.layers = [m for c in chunks for m in c.modules() if hasattr(m, "record_max_logits")]
        for layer in self.layers:
            layer.record_max_logits()

    @torch.no_grad()
    def factors(self) -> list:
        """The MAX over the data-parallel group of every layer's maxima (one all-reduce), then
        each layer's QKV parameters with their row factors (``row_factors``)."""
        if not self.layers:
            return []
        maxima = torch.cat([layer.max_logits for layer in self.layers])  # (sum of h,)
        C.all_reduce_max(maxima, self.group)
        out, start = [], 0
        for layer in self.layers:
            h = layer.max_logits.numel()
            rows = row_factors(
                maxima[start : start + h], self.tau, self.alpha, layer.q_per_group, layer.head_dim, layer.grouped
            )
            start += h
            out += [(p, rows) for p in (layer.qkv.weight, layer.qkv.bias) if p is not None]
        return out

    def reset(self) -> None:
        for layer in self.layers:
            layer.max_logits.fill_(float("-inf"))
