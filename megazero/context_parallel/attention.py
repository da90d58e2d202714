"""Causal self-attention over a sequence split across the context-parallel (cp) group.

Three entry points, one per ``--cp-comm-type``, with the same tensors: queries ``q [B, h, T/C,
d]`` with h = G*R heads in group-major order (heads g*R .. g*R+R-1 use key/value head g, as in
model/gpt.py), keys ``[B, G, T/C, d]`` and values ``[B, G, T/C, d_v]`` (not expanded; ``d_v`` may
differ from ``d``, as in DeepSeek's multi-head latent attention, model/mla.py, where the output
is ``[B, h, T/C, d_v]``), this rank's tokens in the
zigzag order of ``zigzag.py`` (``token_index = local_token_index(T, cp_rank, C)``), and
optional document ids ``segment_ids [B, T/C]`` (int64; packed documents, ``--reset-attention-
mask``): query i attends key j iff they are in the same document and ``pos(j) <= pos(i)``.

- ``ring_attention`` (p2p): ring attention, Liu et al. 2023 (``ring.py``), zigzag balanced
  (Megatron-LM's context parallelism), FlashAttention-2 backward (Dao 2023, sec. 3.1).
- ``all_to_all_attention`` (a2a): DeepSpeed-Ulysses, Jacobs et al. 2023 (sec. 3): an
  all-to-all turns "all heads, T/C tokens" into "h/C heads, all T tokens", each rank runs
  ordinary attention, a second all-to-all turns it back.
- ``local_attention``: C = 1, plain (document-masked) causal attention.

Attention sinks (``sinks [h]``, one logit per query head; gpt-oss's learnable sinks,
Megatron-LM's ``--softmax-type learnable``, or a constant 0 for ``off-by-one``, Miller 2023,
"Attention Is Off By One"): every row's softmax gains one extra term ``exp(sink_h)`` in its
denominator, with no value behind it, so ``out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j
exp(s_ij))`` and a row can give less than all of its weight to the keys. Each entry point takes
``sinks``: the ring merges one more partial into each query's running ``(out, lse)``
(``ring.RingAttention``), and so do the local and all-to-all paths, which run that blockwise
attention on one rank; the KV-cache decoders (new queries against a longer cache) make the scores
explicitly with the extra column appended (``sink_attention``, as transformers' gpt-oss eager
attention does).

Bytes this rank puts on the wire per layer and micro-batch (``elt`` = bytes per element of
q/k/v, ``acc`` = bytes per element of ``blockwise.compute_dtype``: 4, or 8 for float64),
counted in ``megazero.collectives.counter`` and given in closed form by the functions below
(written for ``d_v = d``; with values of ``d_v`` dimensions each ``2*d`` of K and V, and of q and
the output, is ``d + d_v``):

- p2p forward: C-1 sends of K and V, ``(C-1) * 2*B*G*(T/C)*d*elt`` (``"send"``), plus
  ``(C-1) * B*(T/C)*8`` for the document ids if any. Backward: C-1 sends of K and V again plus
  C sends of the dK/dV accumulators, ``(C-1) * 2*B*G*(T/C)*d*elt + C * 2*B*G*(T/C)*d*acc``.
  None at C = 1.
- a2a forward: 4 all-to-alls (q, k, v, out), ``2*B*(h+G)*(T/C)*d*elt`` (``"all_to_all"``,
  counted as this rank's input, the 1/C it keeps included), plus an all-gather of the document
  ids, ``B*(T/C)*8`` (``"all_gather"``), if any (once per ``mask_cache``: the model gathers
  them at a micro-batch's first layer only). Backward: 4 all-to-alls (dout, dq, dk, dv),
  the same ``2*B*(h+G)*(T/C)*d*elt``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import collectives
from megazero.context_parallel.blockwise import block_attention, block_mask, compute_dtype, merge_partials  # noqa: F401
from megazero.context_parallel.fused_blocks import block_path
from megazero.context_parallel.ring import RingAttention, RingLink
from megazero.context_parallel.sdpa_kernels import expand_kv_for
from megazero.context_parallel.zigzag import chunk_size, local_token_index

# enable_gqa (torch >= 2.5) lets SDPA share a key/value head across its group without a copy.
_SDPA_GQA = torch.torch_version.TorchVersion(torch.__version__) >= "2.5"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids) -> None:
    B, h, T, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != B or k.shape[2:] != (T, d) or h % k.shape[1] != 0:
        raise ValueError(
            f"attention: q {tuple(q.shape)} [B, h, T, d] needs k [B, G, T, d] and v [B, G, T, d_v] "
            f"with G dividing h; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if segment_ids is not None and tuple(segment_ids.shape) != (B, T):
        raise ValueError(f"attention: segment_ids {tuple(segment_ids.shape)} is not [B, T] = {(B, T)}")


def _sdpa(q, k, v, mask: Optional[torch.Tensor], scale: Optional[float]) -> torch.Tensor:
    """SDPA with group-major GQA; causal when ``mask`` is None, else the additive mask only.
    K/V are expanded over their group where the kernel would otherwise be refused
    (``sdpa_kernels.expand_kv_for``: on CUDA, e.g. fp32 or a mask with fewer K/V heads)."""
    extra = {}
    if k.shape[1] != q.shape[1]:
        if _SDPA_GQA and not expand_kv_for(q, k, v, documents=mask is not None):
            extra["enable_gqa"] = True
        else:
            R = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(R, dim=1), v.repeat_interleave(R, dim=1)  # (B, h, T, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, **extra)


def document_mask(
    pos: torch.Tensor, segment_ids: Optional[torch.Tensor], dtype: torch.dtype, window: Optional[int] = None
) -> torch.Tensor:
    """Additive mask ``[B or 1, 1, T, T]`` of ``dtype``: 0 where query i may attend key j (same
    document, ``pos(j) <= pos(i)`` and, with a sliding ``window`` W, ``pos(i) - pos(j) < W``),
    -inf elsewhere; ``pos [T]`` positions, ``segment_ids [B, T]`` or None. The rows' storage is
    padded to a multiple of 16 elements, so CUDA's
    memory-efficient kernel takes it as it is (``preprocess_mask`` in PyTorch's
    ``transformers/cuda/attention.cu`` pads a mask whose strides are not multiples of 8, a copy
    per call); SDPA gives the boolean mask's results (it turns a boolean mask into this one,
    ``convert_boolean_attn_mask``)."""
    keep = block_mask(pos, pos, segment_ids, segment_ids, causal=True, window=window)[:, None]  # (B|1, 1, T, T)
    T = pos.shape[0]
    storage = torch.zeros((*keep.shape[:3], -(-T // 16) * 16), dtype=dtype, device=pos.device)
    mask = storage[..., :T]
    return mask.masked_fill_(~keep, float("-inf"))


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Softmax attention with one sink logit per query head (module docstring), differentiable in
    q, k, v and ``sinks``.

    q ``[B, h, Tq, d]``, k ``[B, G, Tk, d]`` and v ``[B, G, Tk, d_v]`` (G divides h, group-major
    heads), ``sinks [h]`` (any float dtype), ``mask`` bool broadcastable to ``[B, h, Tq, Tk]`` (True
    = attend) or None (causal, top-left aligned: needs Tq == Tk). Scores, softmax and products in
    ``blockwise.compute_dtype`` (fp32 for 16-bit inputs); returns ``[B, h, Tq, d_v]`` in q's dtype.
    A row with no key to attend gives 0 (all its weight on the sink). Scores are held whole
    (``[B, h, Tq, Tk]``), as the eager attention of transformers' ``modeling_gpt_oss``.
    """
    B, h, Tq, d = q.shape
    G, Tk = k.shape[1], k.shape[2]
    acc = compute_dtype(q.dtype)
    scale = d**-0.5 if scale is None else scale
    if mask is None:
        if Tq != Tk:
            raise ValueError(f"sink_attention: a causal mask needs as many queries as keys, got {Tq} and {Tk}")
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
    grouped = q.reshape(B, G, h // G, Tq, d).to(acc)
    s = torch.einsum("bgrqd,bgkd->bgrqk", grouped, k.to(acc)).reshape(B, h, Tq, Tk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.to(acc).view(1, h, 1, 1).expand(B, h, Tq, 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :Tk]  # (B, h, Tq, Tk), the sink's share dropped
    out = torch.einsum("bgrqk,bgkd->bgrqd", p.reshape(B, G, h // G, Tq, Tk), v.to(acc))
    return out.reshape(B, h, Tq, v.shape[-1]).to(q.dtype)


def _cached(cache: Optional[dict], key, build):
    if cache is None:
        return build()
    if key not in cache:
        cache[key] = build()
    return cache[key]


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    token_index: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    mask_cache: Optional[dict] = None,
    sinks: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of a whole sequence on one rank (cp = 1), document-masked if asked.

    q ``[B, h, T, d]``, k ``[B, G, T, d]`` and v ``[B, G, T, d_v]`` (G divides h, group-major
    heads), ``token_index [T]`` the positions (None: ``0..T-1``), ``segment_ids [B, T]`` document
    ids or None. ``scale`` defaults to ``d**-0.5``. Returns ``[B, h, T, d_v]``. Without documents and
    positions this is ``F.scaled_dot_product_attention(is_causal=True)``; otherwise SDPA with the
    additive ``document_mask`` "same document and ``pos(j) <= pos(i)``" (block-diagonal causal),
    built once per ``mask_cache`` (a dict that lives as long as the micro-batch, e.g.
    ``SequenceInfo.cache``: every layer then shares one ``[B, 1, T, T]`` mask), dtype and
    ``window``: a sliding window W (None = full) also drops keys with ``pos(i) - pos(j) >= W``.
    ``sinks [h]``: the ring's blockwise attention on this one rank (``ring.RingAttention``: its
    two zigzag chunks, fused block kernels, the sink merged as one more partial; it keeps the
    log-sum-exp, ``O(T)``, not the ``[B, h, T, T]`` scores), or for an odd T or given positions
    ``sink_attention`` with the same mask (bool, cached likewise).
    Raises ValueError on inconsistent shapes.
    """
    _check(q, k, v, segment_ids)
    if sinks is not None and token_index is None and q.shape[2] % 2 == 0:
        # the ring's blockwise path on one rank: O(T) memory (the log-sum-exp), fused block kernels
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        whole = torch.arange(q.shape[2], device=q.device)
        link, path = RingLink(None, [0], 0), block_path(q, "auto", v.shape[-1])
        return RingAttention.apply(q, k, v, segment_ids, link, whole, scale, path, window, sinks)
    if sinks is not None:  # an odd length or given positions: explicit scores
        pos = torch.arange(q.shape[2], device=q.device) if token_index is None else token_index

        def build():  # (B|1, 1, T, T)
            return block_mask(pos, pos, segment_ids, segment_ids, causal=True, window=window)[:, None]

        keep = _cached(mask_cache, ("sink mask", q.shape[2], q.device, window), build)
        return sink_attention(q, k, v, sinks, keep, scale)
    if token_index is None and segment_ids is None and window is None:
        return _sdpa(q, k, v, None, scale)
    pos = torch.arange(q.shape[2], device=q.device) if token_index is None else token_index
    mask = _cached(
        mask_cache, ("local", q.dtype, q.device, window), lambda: document_mask(pos, segment_ids, q.dtype, window)
    )
    return _sdpa(q, k, v, mask, scale)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group,
    cp_ranks: Sequence[int],
    token_index: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    mask_cache: Optional[dict] = None,
    block_kernel: str = "auto",
    sinks: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """``--cp-comm-type p2p``: ring attention over the cp group (``ring.RingAttention``).

    q ``[B, h, T/C, d]``, k ``[B, G, T/C, d]``, v ``[B, G, T/C, d_v]``, ``token_index [T/C]`` this rank's zigzag
    positions (``local_token_index(T, cp_rank, C)``; the keys' positions are derived from the
    same layout), ``segment_ids [B, T/C]`` or None; ``cp_ranks`` the global ranks of ``group`` in
    cp-rank order, C = ``len(cp_ranks)``. Returns ``[B, h, T/C, d_v]`` in q's dtype; differentiable
    in q, k and v. At C = 1 it is ``local_attention`` (no communication; ``mask_cache`` is its). ``block_kernel``:
    ``"auto"`` runs each block through a fused kernel where q's device and dtype have one
    (``fused_blocks.block_path``), ``"einsum"`` through ``blockwise``'s einsums. ``sinks [h]``: one
    sink logit per query head (module docstring), differentiable. ``window``: a
    sliding window W (None = full): a (query chunk, key chunk) block wholly outside it is skipped
    in forward and backward (its K/V still travel on to the next rank). Raises ValueError when
    the group size is not C, T/C is odd, shapes disagree, or ``block_kernel`` is unknown.
    """
    _check(q, k, v, segment_ids)
    C, Tl = len(cp_ranks), q.shape[2]
    if collectives.group_size(group) != C:
        raise ValueError(
            f"ring_attention: the cp group has {collectives.group_size(group)} ranks but cp_ranks lists {C}"
        )
    if tuple(token_index.shape) != (Tl,):
        raise ValueError(f"ring_attention: token_index {tuple(token_index.shape)} is not [T/C] = [{Tl}]")
    chunk_size(Tl * C, C)
    if C == 1:
        return local_attention(
            q, k, v, segment_ids=segment_ids, scale=scale, mask_cache=mask_cache, sinks=sinks, window=window
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    link = RingLink(group, cp_ranks, collectives.group_rank(group))
    path = block_path(q, block_kernel, v.shape[-1])
    return RingAttention.apply(q, k, v, segment_ids, link, token_index, scale, path, window, sinks)


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk i of ``x`` along ``scatter_dim`` goes to group rank i; what rank i sent lands as
    chunk i along ``gather_dim``. Counted in ``counter["all_to_all"]`` (this rank's input)."""
    C = collectives.group_size(group)
    send = torch.stack(x.chunk(C, dim=scatter_dim))  # (C, ...): row i for group rank i
    recv = torch.empty_like(send)
    collectives.counter["all_to_all"] += send.numel() * send.element_size()
    collectives.record("all_to_all", collectives.group_ranks(group), send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """``_all_to_all`` forward; its inverse (the two dims swapped) backward."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group,
    token_index: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    mask_cache: Optional[dict] = None,
    sinks: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """``--cp-comm-type a2a``: DeepSpeed-Ulysses attention over the cp group.

    Shapes as ``ring_attention`` (q ``[B, h, T/C, d]``, k ``[B, G, T/C, d]``, v ``[B, G, T/C, d_v]``, ``token_index
    [T/C]`` this rank's zigzag positions, of which the gathered order is derived, ``segment_ids
    [B, T/C]`` or None). Inside: ``[B, h/C, T, d]`` and ``[B, G/C, T, d]`` in natural order,
    ``local_attention`` on them, and back. With documents the ids are all-gathered and the
    mask built once per ``mask_cache`` (as ``local_attention``: then once per micro-batch, not
    per layer; without a cache, every call); a sliding ``window`` W masks the natural order
    (``local_attention``'s). ``sinks [h]``: each rank applies its heads' sinks
    (``[i h/C, (i+1) h/C)`` on cp rank i). Returns ``[B, h, T/C, d_v]``; differentiable. Raises
    ValueError naming --cp-comm-type a2a when h or G is not divisible by C (group-major heads:
    rank i gets query groups i*G/C .. (i+1)*G/C-1 and their heads).
    """
    _check(q, k, v, segment_ids)
    C, (_, h, Tl, _), G = collectives.group_size(group), q.shape, k.shape[1]  # q: (B, h, T/C, d)
    if h % C or G % C:
        raise ValueError(
            f"--cp-comm-type a2a needs the attention heads (h = {h}) and the "
            f"key/value heads (G = {G}) of this rank divisible by the context-"
            f"parallel size C = {C}; use --cp-comm-type p2p"
        )
    if tuple(token_index.shape) != (Tl,):
        raise ValueError(f"all_to_all_attention: token_index {tuple(token_index.shape)} is not [T/C] = [{Tl}]")
    if C == 1:
        return local_attention(
            q, k, v, segment_ids=segment_ids, scale=scale, mask_cache=mask_cache, sinks=sinks, window=window
        )
    T = Tl * C
    gathered = torch.cat([local_token_index(T, i, C, device=q.device) for i in range(C)])
    natural = torch.argsort(gathered)  # natural[p] = where position p arrived
    seq_major = [_AllToAll.apply(t, group, 1, 2).index_select(2, natural) for t in (q, k, v)]
    seg = None  # heads/C (or G/C) of all T tokens above
    if segment_ids is not None:

        def gather():  # (B, T), natural order
            return torch.cat(collectives.all_gather_list(segment_ids.contiguous(), group), dim=1).index_select(
                1, natural
            )

        seg = _cached(mask_cache, ("a2a segments", group), gather)
    cache = None if mask_cache is None else mask_cache.setdefault(("a2a", group), {})
    if sinks is not None:  # this rank's h/C heads, as the first all-to-all gave them
        r = collectives.group_rank(group)
        sinks = sinks[r * (h // C) : (r + 1) * (h // C)]
    y = local_attention(*seq_major, segment_ids=seg, scale=scale, mask_cache=cache, sinks=sinks, window=window)
    y = y.index_select(2, gathered)  # back to the arrival (rank-major) order
    return _AllToAll.apply(y, group, 2, 1)  # (B, h, T/C, d_v)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp: Optional[tuple],
    comm_type: str = "p2p",
    block_kernel: Optional[str] = None,
    **docs,
) -> torch.Tensor:
    """A block's attention core under its context-parallel setting: ``local_attention`` when
    ``cp`` is None (one rank holds the sequence), else ``all_to_all_attention`` over ``cp =
    (group, ranks)``'s group for ``comm_type`` ``"a2a"`` (``--cp-comm-type``) and
    ``ring_attention`` with ``block_kernel`` (``--cp-ring-kernel``) otherwise. ``docs``: the
    keywords those share (``token_index``, ``segment_ids``, ``mask_cache``, ``scale``, ``sinks``,
    ``window``). Shapes as ``ring_attention``: q ``[B, h, T/C, d]``, k ``[B, G, T/C, d]``, v
    ``[B, G, T/C, d_v]`` -> ``[B, h, T/C, d_v]``."""
    if cp is None:
        return local_attention(q, k, v, **docs)
    group, ranks = cp
    if comm_type == "a2a":
        return all_to_all_attention(q, k, v, group=group, **docs)
    return ring_attention(q, k, v, group=group, cp_ranks=ranks, block_kernel=block_kernel, **docs)


class LayerBytes(NamedTuple):
    """Bytes one rank sends per layer and micro-batch, by ``collectives.counter`` kind."""

    forward: dict
    backward: dict


def ring_bytes_per_layer(
    B: int, G: int, Tl: int, d: int, elt: int, C: int, *, documents: bool = False, d_v: Optional[int] = None
) -> LayerBytes:
    """``ring_attention``'s bytes (module docstring): ``Tl = T/C`` local tokens, ``elt`` bytes per
    element of k/v, keys of ``d`` and values of ``d_v`` dimensions (None: ``d``); the dK/dV
    accumulators travel in ``compute_dtype`` (``max(elt, 4)`` bytes)."""
    if C == 1:
        return LayerBytes({"send": 0}, {"send": 0})
    width = d + (d if d_v is None else d_v)  # one [k | v] message
    kv, dkv = B * G * Tl * width * elt, B * G * Tl * width * max(elt, 4)
    seg = B * Tl * 8 if documents else 0
    return LayerBytes({"send": (C - 1) * (kv + seg)}, {"send": (C - 1) * kv + C * dkv})


def a2a_bytes_per_layer(
    B: int, h: int, G: int, Tl: int, d: int, elt: int, C: int, *, documents: bool = False, d_v: Optional[int] = None
) -> LayerBytes:
    """``all_to_all_attention``'s bytes (module docstring): q ``[B, h, Tl, d]``, out ``[B, h, Tl,
    d_v]``, k ``[B, G, Tl, d]`` and v ``[B, G, Tl, d_v]`` each forward (``d_v`` None: ``d``), their
    gradients backward, ``elt`` bytes per element."""
    if C == 1:
        return LayerBytes({"all_to_all": 0}, {"all_to_all": 0})
    per_pass = B * (h + G) * Tl * (d + (d if d_v is None else d_v)) * elt
    forward = {"all_to_all": per_pass}
    if documents:
        forward["all_gather"] = B * Tl * 8
    return LayerBytes(forward, {"all_to_all": per_pass})
