"""Attention of one (query block, key block) pair, the merge of partial results, its backward.

Blockwise attention (Liu et al. 2023, "Ring Attention with Blockwise Parallel Transformers",
sec. 3; Milakov & Gimelshein 2018's online softmax) computes softmax(q k^T * scale) v over
key blocks one at a time: each block gives a partial output normalised over its own keys and
the log-sum-exp ``lse`` of its scaled scores; two partials merge exactly as

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.

The backward is FlashAttention-2's (Dao 2023, sec. 3.1, eq. before Algorithm 2): with the final
``lse`` saved, each block's probabilities are recomputed as ``P = exp(S - lse)``, and with
``D = rowsum(dO * O)``: ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - D)``,
``dQ = scale * dS K``, ``dK = scale * dS^T Q``. No block needs the others' scores.

Layouts: queries ``[B, G, R, Tq, d]`` (G query groups = key/value heads, R query heads per
group), keys and values ``[B, G, Tk, d]``, shared by the R heads of their group through einsum
broadcasting (never expanded). Masks are bool ``[B or 1, Tq, Tk]``, True = attend. A row with
no key to attend has ``lse = -inf`` and output 0; nothing here produces NaN for it.

Arithmetic is in ``compute_dtype``: float32 for half, bfloat16 and float32 inputs, float64
for float64 inputs. Pure math: no communication.
"""

from __future__ import annotations

from typing import Optional

import torch

SCORE_TILE_BYTES = 16 * 2**20
"""Bytes of one tile of scores ``[B, G, R, rows, Tk]`` in the accumulation dtype: a block's
queries are processed in row tiles of at most this size, so the ring's temporaries (one in the
forward, two in the backward) stay bounded whatever the block's side ``T/(2 cp)`` is."""


def tile_rows(B: int, heads: int, Tq: int, Tk: int, acc_bytes: int, budget: int = SCORE_TILE_BYTES) -> int:
    """Query rows per tile: the most rows whose scores ``B * heads * rows * Tk * acc_bytes`` fit
    ``budget`` bytes, at least 1 and at most ``Tq``."""
    per_row = max(B * heads * Tk * acc_bytes, 1)
    return max(1, min(Tq, budget // per_row))


def score_tiles(q: torch.Tensor, Tk: int):
    """Slices of q's rows (dim 3 of ``[B, G, R, Tq, d]``) of at most ``tile_rows`` each."""
    B, G, R, Tq, _ = q.shape
    rows = tile_rows(B, G * R, Tq, Tk, torch.finfo(compute_dtype(q.dtype)).bits // 8, SCORE_TILE_BYTES)
    return [slice(i, min(i + rows, Tq)) for i in range(0, Tq, rows)]


def _rows(mask: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    return None if mask is None else mask[:, rows]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs: the accumulation dtype of every block."""
    return torch.promote_types(dtype, torch.float32)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a fully masked row) replaced by 0, so ``exp(-inf - 0) = 0``, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor], scale: float):
    acc = compute_dtype(q.dtype)
    s = torch.einsum("bgrqd,bgkd->bgrqk", q.to(acc), k.to(acc)) * scale  # (B, G, R, Tq, Tk)
    if mask is not None:
        s.masked_fill_(~mask[:, None, None], float("-inf"))  # mask (B|1, 1, 1, Tq, Tk)
    return s


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over the keys of one block.

    q ``[B, G, R, Tq, d]``, k and v ``[B, G, Tk, d]``, mask bool ``[B or 1, Tq, Tk]`` or None,
    ``scale`` the factor on the scores (usually ``d**-0.5``). Returns ``out [B, G, R, Tq, d]``
    and ``lse [B, G, R, Tq]``, both in ``compute_dtype(q.dtype)``; a fully masked row has
    ``lse = -inf`` and ``out = 0``. The rows run in tiles of ``SCORE_TILE_BYTES`` of scores (each
    row's result is the same as in one pass).
    """
    outs, lses = [], []
    for rows in score_tiles(q, k.shape[2]):
        s = _scores(q[:, :, :, rows], k, _rows(mask, rows), scale)  # (B, G, R, tile, Tk)
        lse = torch.logsumexp(s, dim=-1)  # (B, G, R, tile); -inf on an empty row
        p = s.sub_(_finite(lse)[..., None]).exp_()  # in place: rows sum to 1, empty rows to 0
        outs.append(torch.einsum("bgrqk,bgkd->bgrqd", p, v.to(p.dtype)))
        lses.append(lse)
        del s, p
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions of the same queries over disjoint key sets.

    ``out_*`` ``[..., Tq, d]``, ``lse_*`` ``[..., Tq]``. Returns ``(out, lse)`` over the union of
    the keys; a side with ``lse = -inf`` contributes nothing, both sides -inf give out 0 and
    lse -inf (never NaN).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = _finite(lse)
    w_a = torch.exp(lse_a - ref)[..., None]  # exp(-inf) = 0 for an empty side
    w_b = torch.exp(lse_b - ref)[..., None]
    return w_a * out_a + w_b * out_b, lse


def block_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    delta: torch.Tensor,
    lse: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
):
    """Gradients of one block's contribution, given the *final* ``lse`` of the queries.

    q and do ``[B, G, R, Tq, d]``, k and v ``[B, G, Tk, d]``, ``delta = rowsum(dO * O)`` and
    ``lse`` ``[B, G, R, Tq]`` (over all keys, not just this block's), mask as in
    ``block_attention``. Returns ``(dq [B, G, R, Tq, d], dk [B, G, Tk, d], dv [B, G, Tk, d])``
    in ``compute_dtype(q.dtype)``; dk and dv are summed over the R heads of each group and over
    the row tiles (``SCORE_TILE_BYTES`` of scores each).
    """
    acc = compute_dtype(q.dtype)
    do, v, qa, ka = do.to(acc), v.to(acc), q.to(acc), k.to(acc)
    dqs, dk, dv = [], None, None
    for rows in score_tiles(q, k.shape[2]):
        # in place, so at most two score tiles are alive: P, then dP and dS in dP's memory
        p = _scores(qa[:, :, :, rows], ka, _rows(mask, rows), scale)
        p.sub_(_finite(lse[..., rows])[..., None]).exp_()  # (B, G, R, tile, Tk), final probabilities
        dv_t = torch.einsum("bgrqk,bgrqd->bgkd", p, do[:, :, :, rows])
        ds = torch.einsum("bgrqd,bgkd->bgrqk", do[:, :, :, rows], v)  # dP
        ds.sub_(delta[..., rows, None]).mul_(p)  # dS = P (dP - D); masked entries: P = 0
        del p
        dqs.append(torch.einsum("bgrqk,bgkd->bgrqd", ds, ka) * scale)
        dk_t = torch.einsum("bgrqk,bgrqd->bgkd", ds, qa[:, :, :, rows]) * scale
        dk, dv = (dk_t, dv_t) if dk is None else (dk + dk_t, dv + dv_t)
        del ds
    return torch.cat(dqs, dim=3), dk, dv


def block_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_seg: Optional[torch.Tensor],
    k_seg: Optional[torch.Tensor],
    causal: bool,
    window: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """Bool mask ``[B or 1, Tq, Tk]`` (True = attend), or None when every score is kept.

    ``q_pos [Tq]`` and ``k_pos [Tk]`` are global token positions; ``causal`` keeps
    ``k_pos <= q_pos``; ``window`` W (sliding-window attention, transformers' ``sliding_window``)
    keeps ``q_pos - k_pos < W``; document ids ``q_seg [B, Tq]`` and ``k_seg [B, Tk]`` (or None: one
    document) keep only keys of the query's own document.
    """
    mask = None
    if causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None]  # (1, Tq, Tk)
    if window is not None:
        near = (q_pos[:, None] - k_pos[None, :] < window)[None]  # (1, Tq, Tk)
        mask = near if mask is None else mask & near
    if q_seg is not None:
        same = q_seg[:, :, None] == k_seg[:, None, :]  # (B, Tq, Tk)
        mask = same if mask is None else mask & same
    return mask
