"""Zigzag causal load balancing: which tokens a context-parallel rank holds, which blocks it computes.

Under a causal mask the last tokens of a sequence attend to many more keys than the first, so
a contiguous split over C ranks gives the last rank about 2C-1 times the work of the first.
Megatron-LM's context parallelism (also ring-flash-attention's "zigzag" layout; Brandon et al.
2023, "Striped Attention", discuss the imbalance) cuts the T tokens into 2C chunks of
``n = T/(2C)`` tokens and gives cp rank ``r`` chunks ``r`` and ``2C-1-r``, concatenated in that
order: an early chunk and its mirror image at the end.

In the ring (``attention.ring_attention``) rank ``r`` holds, at ring step ``s``, the keys and
values of rank ``src = (r - s) mod C``: its chunks ``src`` and ``2C-1-src``. Chunk ``i`` of the
queries attends chunk ``j`` of the keys fully when ``j < i``, through the causal triangle when
``j == i`` ("diagonal") and not at all when ``j > i``. So step 0 has two diagonal blocks and one
full block, and each later step exactly two full blocks: ``(r, src)`` and ``(2C-1-r, src)`` when
``src < r``, ``(2C-1-r, src)`` and ``(2C-1-r, 2C-1-src)`` when ``src > r``. Every rank computes
2 diagonal and 2C-1 full blocks, whatever ``r`` is: the work is balanced.

Everything here is pure (no torch.distributed); tensors only where a position is returned.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

DIAGONAL, FULL = "diagonal", "full"


def zigzag_chunks(rank: int, C: int) -> tuple[int, int]:
    """The two chunk indices (of 2C) that cp rank ``rank`` holds, in its local order.

    Raises ValueError unless ``0 <= rank < C``.
    """
    if not 0 <= rank < C:
        raise ValueError(f"cp rank {rank} is not in [0, {C}) (context-parallel size {C})")
    return rank, 2 * C - 1 - rank


def chunk_size(T: int, C: int) -> int:
    """``T/(2C)`` tokens per chunk; raises ValueError naming --seq-length unless 2C divides T."""
    if T % (2 * C) != 0:
        raise ValueError(
            f"--seq-length {T} is not divisible by 2*C = {2 * C} (zigzag context "
            f"parallelism cuts the sequence into 2 chunks per cp rank, C = {C})"
        )
    return T // (2 * C)


def local_token_index(T: int, rank: int, C: int, device=None) -> torch.Tensor:
    """Global positions of the ``T/C`` tokens cp rank ``rank`` holds, in its local order.

    Returns a LongTensor ``[T/C]``: ``[r*n, ..., r*n+n-1, (2C-1-r)*n, ..., (2C-r)*n-1]`` with
    ``n = T/(2C)``. Raises ValueError when 2C does not divide T.
    """
    n = chunk_size(T, C)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in zigzag_chunks(rank, C)])


def split_for_rank(x: torch.Tensor, dim: int, rank: int, C: int) -> torch.Tensor:
    """This cp rank's part of a full-sequence tensor: ``[.., T, ..] -> [.., T/C, ..]`` along ``dim``.

    Chunks ``rank`` and ``2C-1-rank`` of ``x.shape[dim] / (2C)`` tokens, concatenated (a copy).
    Raises ValueError naming --seq-length and 2*C when 2C does not divide ``x.shape[dim]``.
    """
    chunk_size(x.shape[dim], C)
    chunks = x.chunk(2 * C, dim=dim)
    return torch.cat([chunks[c] for c in zigzag_chunks(rank, C)], dim=dim)


def merge_from_ranks(parts: Sequence[torch.Tensor], dim: int, C: int) -> torch.Tensor:
    """Inverse of ``split_for_rank``: the full sequence in natural order from the C local parts.

    ``parts[r]`` is cp rank r's ``[.., T/C, ..]``; returns ``[.., T, ..]``. Raises ValueError when
    there are not C parts or a part's length along ``dim`` is odd.
    """
    if len(parts) != C:
        raise ValueError(f"merge_from_ranks: {len(parts)} parts for context-parallel size {C}")
    chunks: list = [None] * (2 * C)
    for r, part in enumerate(parts):
        if part.shape[dim] % 2 != 0:
            raise ValueError(
                f"merge_from_ranks: part {r} has {part.shape[dim]} tokens along dim {dim}, not two equal chunks"
            )
        first, second = part.chunk(2, dim=dim)
        a, b = zigzag_chunks(r, C)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def ring_source(rank: int, step: int, C: int) -> int:
    """The cp rank whose keys and values rank ``rank`` holds at ring step ``step``."""
    return (rank - step) % C


def block_pairs(rank: int, C: int) -> list[tuple[int, int, int, str]]:
    """The attention blocks cp rank ``rank`` computes, as ``(ring_step, q_chunk, kv_chunk, kind)``.

    Chunks are indices in ``[0, 2C)`` of the natural order; ``kind`` is ``"diagonal"`` (q chunk
    == kv chunk: the causal triangle) or ``"full"`` (kv chunk before q chunk: no causal mask).
    Blocks above the causal diagonal (kv chunk after q chunk) are omitted. Ordered by step, then
    by the local order of the q chunk, then of the kv chunk. ``ring_attention`` computes exactly
    these blocks.
    """
    pairs = []
    for step in range(C):
        src = ring_source(rank, step, C)
        for q_chunk in zigzag_chunks(rank, C):
            for kv_chunk in zigzag_chunks(src, C):
                if kv_chunk < q_chunk:
                    pairs.append((step, q_chunk, kv_chunk, FULL))
                elif kv_chunk == q_chunk:
                    pairs.append((step, q_chunk, kv_chunk, DIAGONAL))
    return pairs


def block_work(rank: int, C: int) -> float:
    """Work of ``block_pairs(rank, C)`` in full-block units: a full block (n x n scores) counts 1,
    a diagonal block 1/2 (its n(n+1)/2 unmasked scores, rounded to half a block).
    Equal on every rank: 2C-1 full and 2 diagonal blocks, so ``2C``."""
    return sum(1.0 if kind == FULL else 0.5 for *_, kind in block_pairs(rank, C))


OUTSIDE, PARTIAL, INSIDE = "outside", "partial", "inside"


def window_overlap(q_chunk: int, kv_chunk: int, n: int, window: Optional[int]) -> str:
    """How a sliding window W (query p sees keys p-W+1 .. p) meets the block of query chunk
    ``q_chunk`` and key chunk ``kv_chunk`` (chunk c holds positions ``c*n .. c*n+n-1``), causal
    order aside: ``OUTSIDE`` when no query is within W of any key (the block can be skipped:
    ``c_q*n - (c_k*n + n-1) >= W``), ``INSIDE`` when every pair is (``c_q*n + n-1 - c_k*n < W``,
    or no window), else ``PARTIAL`` (the block needs the window in its mask)."""
    if window is None:
        return INSIDE
    if q_chunk * n - (kv_chunk * n + n - 1) >= window:
        return OUTSIDE
    if q_chunk * n + n - 1 - kv_chunk * n < window:
        return INSIDE
    return PARTIAL
