"""Ring attention (``--cp-comm-type p2p``) as an autograd function over the zigzag layout.

Liu et al. 2023, "Ring Attention with Blockwise Parallel Transformers" (sec. 3, Algorithm 1):
the C ranks of a context-parallel group form a ring; each holds T/C tokens (zigzag order,
``zigzag.py``) of q, k, v. In C steps the keys and values travel once around the ring, each
rank computing its queries against the block it holds while the next block is in flight.

Forward, step s = 0 .. C-1 (rank r holds the K/V of rank ``src = (r - s) mod C``):
  1. post the send of the K/V (and their document ids) to rank r+1 and the receive from r-1
     (skipped at the last step), before any compute, so the transfer overlaps step s;
  2. compute the blocks ``zigzag.block_pairs`` lists for step s (``blockwise.block_attention``,
     or a fused kernel: ``fused_blocks``, the ``path`` argument) and merge them into the
     running (out, lse) of each query chunk (``merge_partials``);
  3. wait for the next K/V.
The document ids that arrived at each step are kept for the backward (B*T int64, small next to
the K/V), so the backward does not send them again. With attention sinks (``sinks [h]``, one
logit per head, ``attention.py``) a last partial with no keys, ``out = 0`` and ``lse = sink``, is
merged into every query's result after step C-1.

Backward, step s = 0 .. C-1, with the final lse saved (FlashAttention-2, Dao 2023, sec. 3.1):
  1. post the K/V transfer for step s+1, as in the forward (not at the last step);
  2. compute dQ (kept here) and this rank's contribution to the dK/dV of rank src's K/V (the
     einsums take ``D = rowsum(dO * O)``, the fused kernels the final output O itself);
  3. wait for the dK/dV accumulator of rank src from rank r-1 (none at step 0), add the
     contribution, post its send to rank r+1; then wait for the next K/V.
After step C-1 the accumulator that arrives is this rank's own: C sends of dK/dV, C-1 of K/V.
The sinks' gradient is the sink column's ``dS = P_sink (dP_sink - D) = -exp(sink - lse) D`` (its
value is 0, so ``dP_sink = 0``) summed over this rank's queries; the cp ranks' parts are summed
with the other replicated gradients (over dp x cp).
Accumulators are in ``blockwise.compute_dtype`` (float32 for 16- and 32-bit inputs).

Keys and values may have different head sizes, ``d`` and ``d_v`` (DeepSeek's multi-head latent
attention: ``qk_head_dim + qk_pos_emb_head_dim`` against ``v_head_dim``, which the context
parallelism of TransformerEngine and Megatron-LM long refused). They travel
as one message ``[k | v]`` of ``d + d_v`` columns, and so do their gradients; the output, dO and
the merge run over ``d_v``, the scores, dQ and dK over ``d``.

Every send is counted with ``collectives.count_send`` and every receive recorded in
``collectives.recent``. Messages carry one tag per kind (gloo matches by tag; NCCL by posting
order, which is the same on every rank).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megazero import collectives
from megazero.context_parallel.blockwise import (
    block_attention,
    block_attention_backward,
    block_mask,
    compute_dtype,
    merge_partials,
)
from megazero.context_parallel.fused_blocks import fused_block_attention, fused_block_attention_backward
from megazero.context_parallel.zigzag import (
    DIAGONAL,
    INSIDE,
    OUTSIDE,
    block_pairs,
    local_token_index,
    ring_source,
    window_overlap,
    zigzag_chunks,
)

_TAG_FWD_KV, _TAG_FWD_SEG, _TAG_BWD_KV, _TAG_BWD_DKV = 0, 1, 2, 3


class _Transfer:
    """Sends and receives in flight; ``wait()`` returns the received tensors."""

    def __init__(self, works, received: list[torch.Tensor]):
        self.works, self.received = works, received

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


class RingLink:
    """This rank's two neighbours in the cp ring: it sends to ``next`` and receives from ``prev``
    (global ranks, taken from ``cp_ranks``, the group's global ranks in cp-rank order)."""

    def __init__(self, group, cp_ranks: Sequence[int], cp_rank: int):
        C = len(cp_ranks)
        self.group, self.size, self.cp_rank = group, C, cp_rank
        self.next, self.prev = cp_ranks[(cp_rank + 1) % C], cp_ranks[(cp_rank - 1) % C]

    def start(self, tensors: Sequence[torch.Tensor], tag: int) -> _Transfer:
        """Post the send of each tensor to ``next`` and a receive of the same shape from ``prev``
        (tags ``tag``, ``tag + 1``, ...); returns at once."""
        ops, received = [], []
        for i, t in enumerate(tensors):
            t = t.contiguous()
            collectives.count_send(t, self.next)
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group, tag + i))
            buf = torch.empty_like(t)
            collectives.record("recv", (self.prev,), buf)
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.group, tag + i))
            received.append(buf)
        return _Transfer(dist.batch_isend_irecv(ops), received)


def _halves(x: Optional[torch.Tensor], dim: int):
    """The two zigzag chunks of a local ``[.., T/C, ..]`` tensor (or ``(None, None)``)."""
    return (None, None) if x is None else x.chunk(2, dim=dim)


class _Blocks:
    """What one step needs to find its blocks: positions, chunk ids and document ids; with a
    sliding ``window`` the plan leaves out the blocks wholly outside it (``zigzag.window_overlap``),
    in the forward and the backward alike."""

    def __init__(self, rank: int, C: int, Tl: int, token_index: torch.Tensor, q_seg, window: Optional[int] = None):
        self.rank, self.C, self.T, self.window, n = rank, C, Tl * C, window, Tl // 2
        self.plan = [
            [p for p in block_pairs(rank, C) if p[0] == s and window_overlap(p[1], p[2], n, window) != OUTSIDE]
            for s in range(C)
        ]
        self.q_pos, self.q_seg = _halves(token_index, 0), _halves(q_seg, 1)

    def each(self, step: int, k_seg):
        """Yield ``(i, j, mask, causal)`` for the blocks of ``step``: query half i, key half j;
        ``causal`` when the mask is exactly the top-left causal one (a diagonal block, one document)."""
        src = ring_source(self.rank, step, self.C)
        k_pos = _halves(local_token_index(self.T, src, self.C, device=self.q_pos[0].device), 0)
        k_seg = _halves(k_seg, 1)
        n = self.T // (2 * self.C)
        for _, q_chunk, kv_chunk, kind in self.plan[step]:
            i, j = zigzag_chunks(self.rank, self.C).index(q_chunk), zigzag_chunks(src, self.C).index(kv_chunk)
            whole = window_overlap(q_chunk, kv_chunk, n, self.window) == INSIDE  # no key cut by the window
            window = None if whole else self.window
            mask = block_mask(self.q_pos[i], k_pos[j], self.q_seg[i], k_seg[j], causal=kind == DIAGONAL, window=window)
            yield i, j, mask, kind == DIAGONAL and k_seg[j] is None and whole


def _forward_block(path: str, q, k, v, mask, scale: float, causal: bool):
    """One block's ``(out, lse)`` on ``path`` (``fused_blocks.block_path``)."""
    if path == "einsum":
        return block_attention(q, k, v, mask, scale)
    return fused_block_attention(q, k, v, mask, scale, causal=causal)


def _backward_block(path: str, q, k, v, do, out, delta, lse, mask, scale: float, causal: bool):
    """One block's ``(dq, dk, dv)`` on ``path``: the einsums take ``delta = rowsum(dO * O)``, the
    fused kernels the final ``out``."""
    if path == "einsum":
        return block_attention_backward(q, k, v, do, delta, lse, mask, scale)
    return fused_block_attention_backward(q, k, v, do, out, lse, mask, scale, causal=causal)


class RingAttention(torch.autograd.Function):
    """``apply(q, k, v, segment_ids, link, token_index, scale, path, window, sinks) -> out``: q ``[B, h,
    T/C, d]`` (group-major heads), k ``[B, G, T/C, d]``, v ``[B, G, T/C, d_v]``, segment_ids ``[B, T/C]`` or None,
    token_index ``[T/C]`` (this rank's zigzag positions), ``path`` the blocks' kernel path
    (``fused_blocks.block_path``), ``window`` a sliding window W or None (blocks wholly outside
    it are not computed; the K/V still go round the ring), ``sinks [h]`` or None. Returns ``[B, h,
    T/C, d_v]`` in q's dtype. Use ``attention.ring_attention``, which checks the arguments."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        segment_ids,
        link: RingLink,
        token_index,
        scale: float,
        path: str = "einsum",
        window=None,
        sinks=None,
    ):
        B, h, Tl, d = q.shape
        G, C, n, d_v = k.shape[1], link.size, Tl // 2, v.shape[-1]
        qs = _halves(q.reshape(B, G, h // G, Tl, d), 3)  # 2 x (B, G, R, T/(2C), d)
        blocks = _Blocks(link.cp_rank, C, Tl, token_index, segment_ids, window)
        kv, seg, kv_segs = torch.cat([k, v], dim=-1), segment_ids, []  # kv (B, G, T/C, d + d_v)
        out, lse = [None, None], [None, None]
        for step in range(C):
            pending = None
            if step < C - 1:
                pending = link.start([kv] if seg is None else [kv, seg], _TAG_FWD_KV)
            kv_segs.append(seg)
            for i, j, mask, causal in blocks.each(step, seg):
                kj, vj = kv[:, :, j * n : (j + 1) * n].split([d, d_v], dim=-1)  # (B, G, T/(2C), d | d_v)
                o, l = _forward_block(path, qs[i], kj, vj, mask, scale, causal)
                out[i], lse[i] = (o, l) if out[i] is None else merge_partials(out[i], lse[i], o, l)
            if pending is not None:
                kv, *rest = pending.wait()
                seg = rest[0] if rest else None
        if sinks is not None:  # the sink: a partial with no keys, out 0 and lse = sink
            sink = sinks.to(out[0].dtype).view(1, G, h // G, 1).expand(B, G, h // G, n)
            for i in range(2):
                out[i], lse[i] = merge_partials(out[i], lse[i], torch.zeros_like(out[i]), sink)
        y = torch.cat(out, dim=3).reshape(B, h, Tl, d_v).to(q.dtype)  # (B, h, T/C, d_v)
        ctx.save_for_backward(q, k, v, y, torch.cat(lse, dim=3), sinks)  # lse (B, G, R, T/C)
        ctx.link, ctx.blocks, ctx.kv_segs, ctx.scale, ctx.path = link, blocks, kv_segs, scale, path
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        q, k, v, y, lse, sinks = ctx.saved_tensors
        link, blocks, scale = ctx.link, ctx.blocks, ctx.scale
        B, h, Tl, d = q.shape
        G, C, n, acc, d_v = k.shape[1], link.size, Tl // 2, compute_dtype(q.dtype), v.shape[-1]
        grouped, grouped_v = (B, G, h // G, Tl, d), (B, G, h // G, Tl, d_v)
        do = dy.reshape(grouped_v).to(acc)  # (B, G, R, T/C, d_v)
        delta = None  # D = rowsum(dO * O), (B, G, R, T/C)
        if ctx.path == "einsum" or sinks is not None:
            delta = (do * y.reshape(grouped_v).to(acc)).sum(-1)
        dsinks = None
        if sinks is not None:  # dS of the sink column: -exp(sink - lse) D, summed over rows
            p_sink = torch.exp(sinks.to(acc).view(1, G, h // G, 1) - lse)
            dsinks = -(p_sink * delta).sum(dim=(0, 3)).reshape(h).to(sinks.dtype)
        qs, dos, ys = _halves(q.reshape(grouped), 3), _halves(do, 3), _halves(y.reshape(grouped_v), 3)
        deltas, lses = _halves(delta, 3), _halves(lse, 3)
        dq = torch.zeros(grouped, dtype=acc, device=q.device)
        kv, pending_dkv = torch.cat([k, v], dim=-1), None  # (B, G, T/C, d + d_v)
        for step in range(C):
            pending_kv = link.start([kv], _TAG_BWD_KV) if step < C - 1 else None
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # (B, G, T/C, d + d_v)
            for i, j, mask, causal in blocks.each(step, ctx.kv_segs[step]):
                kj, vj = kv[:, :, j * n : (j + 1) * n].split([d, d_v], dim=-1)
                dq_b, dk_b, dv_b = _backward_block(
                    ctx.path, qs[i], kj, vj, dos[i], ys[i], deltas[i], lses[i], mask, scale, causal
                )
                dq[:, :, :, i * n : (i + 1) * n] += dq_b
                dkv[:, :, j * n : (j + 1) * n, :d] += dk_b
                dkv[:, :, j * n : (j + 1) * n, d:] += dv_b
            if pending_dkv is not None:
                dkv += pending_dkv.wait()[0]  # rank src's accumulator, from rank r-1
            if C > 1:
                pending_dkv = link.start([dkv], _TAG_BWD_DKV)
            if pending_kv is not None:
                kv = pending_kv.wait()[0]
        if pending_dkv is not None:
            dkv = pending_dkv.wait()[0]  # this rank's own, back after C sends
        dq = dq.reshape(B, h, Tl, d).to(q.dtype)
        return dq, dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype), None, None, None, None, None, None, dsinks
