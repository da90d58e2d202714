"""Multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024, sec. 2.1 "Multi-Head Latent
Attention"), laid out as DeepSeek-V3 and transformers' ``DeepseekV3Attention``, with Megatron-LM's
flags (``--multi-latent-attention``, ``--q-lora-rank``, ``--kv-lora-rank``, ``--qk-head-dim``,
``--qk-pos-emb-head-dim``, ``--v-head-dim``).

With ``n`` = qk_head_dim (no RoPE), ``r`` = qk_pos_emb_head_dim (RoPE), ``v`` = v_head_dim:

- queries: ``q_b(RMSNorm(q_a(x)))`` (``q_a``: H -> q_lora_rank), or one projection ``q`` when
  ``q_lora_rank`` is None; each head's ``n + r`` rows are ``[nope; rope]``;
- keys and values: ``kv_a(x)`` gives ``[latent (kv_lora_rank); k_pe (r)]``; the latent is
  RMS-normalised and ``kv_b`` expands it to each head's ``[k_nope (n); value (v)]``; ``k_pe`` is
  one key RoPE head shared by every query head (sec. 2.1.3, decoupled rotary position embedding);
- scores ``q . k`` over the ``n + r`` dimensions, times ``(n + r)^-0.5``, times ``mscale^2`` under
  YaRN with ``yarn_mscale_all_dim`` set (``yarn_mscale(factor, mscale_all_dim)``, transformers'
  ``yarn_apply_mscale``); cos and sin carry YaRN's attention factor as for every rotary layer
  (model/rope.py); output ``proj`` (heads * v -> H).

RoPE layout: megazero rotates the pairs ``(j, j + r/2)`` ("rotate half", model/rope.py), as
Megatron-LM's MLA without ``--rotary-interleaved``. DeepSeek's released weights (transformers'
``rope_interleave=True``) pair ``(2j, 2j + 1)`` instead; transformers' interleaved rotation returns
the evens' then the odds' results, which is the rotate-half rotation of the rope rows reordered to
``[0, 2, 4, ..., 1, 3, 5, ...]``. So a checkpoint imports exactly by that fixed permutation of the
rope rows of ``q_b`` (or ``q``) in each head and of ``kv_a``'s ``k_pe`` rows
(``rope_rows_from_interleaved``); megazero's canonical tensors hold the rotate-half order.

Tensor parallelism: ``q_b`` (or ``q``) and ``kv_b`` are column-parallel by whole heads, ``proj``
row-parallel; ``q_a``, ``kv_a`` and the two latent norms are replicated, computed on every rank
from the gathered input. Each rank's gradient of those is its own heads' part, so they are summed
over tp (as the QK-norm weights, ``MLA_REPLICATED``), and the input's gradient is summed by the
gather (an all-reduce, or a reduce-scatter under sequence parallelism).

KV cache (the decoders, model/sampling.py and model/rollout.py, through ``decode``): each layer
caches the compressed latent ``c_kv`` (after ``kv_a_norm``, ``[B, 1, S, kv_lora_rank]``) and the
rotated shared key ``k_pe`` (``[B, 1, S, r]``), ``kv_lora_rank + r`` values a token (on every tp
rank: the latent is replicated), instead of ``heads * (n + r + v)`` for the expanded keys and
values. A step attends in the latent space, DeepSeek-V2 sec. 2.1.2's absorbed form: ``W_UK`` (the
``k_nope`` rows of ``kv_b``) is folded into the query, ``q_nope W_UK . c_kv = q_nope . W_UK
c_kv``, the scores add ``q_pe . k_pe``, the softmax weights sum latents, and ``W_UV`` (the value
rows) maps the result to each head's values: the same numbers as the expanded form up to the
order of the sums.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from megazero import collectives as C
from megazero.context_parallel.attention import context_parallel_attention
from megazero.context_parallel.sequence import SequenceInfo
from megazero.ops.norm import RMSNorm
from megazero.tensor_parallel.layers import RowParallelLinear
from megazero.tensor_parallel.mappings import copy_to_tp_region, gather_from_sequence_parallel_region
from megazero.tensor_parallel.random import RNGTracker
from megazero.tensor_parallel.recompute import recompute
from model.config import GPTConfig
from model.rope import RotaryTable, apply_rotary, yarn_mscale

MLA_REPLICATED = ("attn.q_a.weight", "attn.q_a_norm.weight", "attn.kv_a.weight", "attn.kv_a_norm.weight")
"""Replicated over tp, each rank's gradient its heads' part: summed over tp (``GPTStage`` tags them)."""


def mla_softmax_scale(cfg: GPTConfig) -> float:
    """The score scale ``(n + r)^-0.5``, times ``yarn_mscale(factor, mscale_all_dim)^2`` under YaRN
    with ``yarn_mscale_all_dim`` set (DeepSeek-V3; transformers' ``yarn_apply_mscale``)."""
    scale = (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) ** -0.5
    if cfg.yarn_rotary_scaling_factor is not None and cfg.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.yarn_rotary_scaling_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale


def rope_rows_from_interleaved(weight: torch.Tensor, blocks: int, rope: int) -> torch.Tensor:
    """Reorder the last ``rope`` rows of each of ``blocks`` equal row blocks of ``weight [rows, cols]``
    from DeepSeek's interleaved pairs to megazero's rotate-half order ``[0, 2, ..., 1, 3, ...]``
    (module docstring): ``q_b`` / ``q`` with ``blocks`` = heads, ``kv_a`` with 1. A new tensor of the
    same shape; raises ValueError when the rows do not split into ``blocks`` blocks of >= ``rope``."""
    rows = weight.shape[0]
    if rows % blocks or rows // blocks < rope or rope % 2:
        raise ValueError(f"{rows} rows do not split into {blocks} blocks ending in {rope} (even) rope rows")
    w = weight.reshape(blocks, rows // blocks, *weight.shape[1:]).clone()  # (blocks, rows/blocks, cols)
    evens, odds = (torch.arange(start, rope, 2, device=weight.device) for start in (0, 1))
    order = torch.cat([evens, odds])  # (rope,)
    w[:, -rope:] = w[:, -rope:][:, order]
    return w.reshape(weight.shape)


def latent_cache_bytes(cfg: GPTConfig, dtype: torch.dtype) -> int:
    """Bytes the decoders' latent cache holds per token and layer (module docstring):
    ``(kv_lora_rank + qk_pos_emb_head_dim) * bytes per element of dtype`` (DeepSeek-V2 sec. 2.1.2,
    Table 1's ``(d_c + d_h^R) l`` elements a token over ``l`` layers)."""
    return (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) * dtype.itemsize


class Projection(nn.Module):
    """``x @ weight^T`` without bias or communication: ``[..., in] -> [..., out]``, ``weight [out, in]``
    (this rank's partition; its tags come from model/spec.py)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MultiLatentAttention(nn.Module):
    """Causal MLA over this rank's ``heads/tp`` heads (module docstring): ``[B, T(/tp), H] ->
    [B, T(/tp), H]``.

    Offers ``model.gpt.Attention``'s interface to the block (``project``, ``masked_core``,
    ``sink_logits``, ``rotary``, ``rope``, ``window``, ``q_per_group``, ``proj``,
    ``softmax_scale``): ``project`` returns per head q and k ``[rope; nope]`` (``r + n`` dims, RoPE
    part first, so ``apply_rotary`` rotates it) and v (``v`` dims). The KV-cache decoders call
    ``decode`` instead, which keeps the compressed latent (module docstring).
    Needs rotary positions; no sinks, no window (the config refuses them: megazero/config/shape.py
    ``check_mla``).

    Context parallelism (``cp``: (cp group, its global ranks in cp order) or None): a micro-batch
    then comes with a ``SequenceInfo`` and this rank holds ``T/cp`` tokens (two zigzag chunks); the
    decoupled RoPE key ``k_pe`` and the queries' rope part are rotated at ``seq.position_ids``, the
    tokens' global positions, before anything travels, and attention runs on the ring or the
    all-to-all (``--cp-comm-type``) with keys of ``r + n`` and values of ``v`` dimensions as they
    are (megazero/context_parallel/ring.py sends ``[k | v]`` as one message).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        group,
        sp: bool,
        tracker: RNGTracker,
        device=None,
        rope: Optional[RotaryTable] = None,
        cp=None,
    ):
        super().__init__()
        H, tp, heads = cfg.hidden_size, C.group_size(group), cfg.num_attention_heads
        self.group, self.sp, self.tracker = group, sp, tracker
        self.heads_local = heads // tp
        self.nope, self.rot, self.v_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.rotary = (cfg.rotary_dim, cfg.rotary_base)
        self.rope = rope if rope is not None else RotaryTable.for_model(cfg, device)
        self.window, self.q_per_group, self.cp = None, 1, cp
        self.cp_comm_type, self.cp_ring_kernel = cfg.cp_comm_type, cfg.cp_ring_kernel
        self.softmax_scale = mla_softmax_scale(cfg)
        self.dropout_p = cfg.attention_dropout
        self.recompute_core = cfg.recompute_granularity == "selective"
        dt, qk = cfg.params_dtype, self.nope + self.rot

        def norm(width: int) -> RMSNorm:
            return RMSNorm(width, eps=cfg.layernorm_epsilon, backend=cfg.norm_backend, dtype=dt, device=device)

        self.low_rank_q = cfg.q_lora_rank is not None
        if self.low_rank_q:
            self.q_a = Projection(cfg.q_lora_rank, H, dt, device)
            self.q_a_norm = norm(cfg.q_lora_rank)
            self.q_b = Projection(self.heads_local * qk, cfg.q_lora_rank, dt, device)
        else:
            self.q = Projection(self.heads_local * qk, H, dt, device)
        self.kv_a = Projection(self.kv_lora + self.rot, H, dt, device)
        self.kv_a_norm = norm(self.kv_lora)
        self.kv_b = Projection(self.heads_local * (self.nope + self.v_dim), self.kv_lora, dt, device)
        self.proj = RowParallelLinear(
            heads * self.v_dim,
            H,
            group,
            input_is_parallel=True,
            bias=False,
            sequence_parallel=sp,
            dtype=dt,
            device=device,
        )

    def sink_logits(self) -> None:
        """No attention sinks (``--softmax-type vanilla`` only)."""
        return None

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T(/tp), H]`` gathered to ``[B, T, H]`` (sequence parallelism) or marked for the
        tp region (backward: the heads' partial input gradients reduced)."""
        if self.sp:
            return gather_from_sequence_parallel_region(x, self.group)  # (B, T, H)
        return copy_to_tp_region(x, self.group)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, heads/tp, T, r + n)``, ``[rope; nope]`` per head, not yet rotated, of ``x [B, T, H]``."""
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.low_rank_q else self.q(x)  # (B, T, heads/tp*(n+r))
        q = rearrange(q, "b t (h d) -> b h t d", h=self.heads_local)  # (B, heads/tp, T, n + r)
        return torch.cat([q[..., self.nope :], q[..., : self.nope]], dim=-1)  # [rope; nope]

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, mask: torch.Tensor):
        """One KV-cache decoder call on new tokens ``x [B, t, H]`` (no sequence parallelism) at the
        positions of ``cos``, ``sin`` (``[t, r]`` or ``[B, 1, t, r]``), after ``cache``: None or the
        earlier tokens' ``(c_kv [B, 1, S - t, kv_lora], k_pe [B, 1, S - t, r])`` (``k_pe`` rotated),
        with a bool ``mask`` broadcastable to ``[B, heads/tp, t, S]`` (True = attend). Attends in the
        latent space (the absorbed form, module docstring). Returns the output ``[B, t, H]`` (reduced
        over tp) and the cache ``(c_kv [B, 1, S, kv_lora], k_pe [B, 1, S, r])``."""
        x = self._input(x)  # (B, t, H)
        q = apply_rotary(self._queries(x), cos, sin)  # (B, heads/tp, t, r + n)
        latent, k_pe = self.kv_a(x).split([self.kv_lora, self.rot], dim=-1)  # (B, t, kv_lora), (B, t, r)
        c_kv = self.kv_a_norm(latent).unsqueeze(1)  # (B, 1, t, kv_lora): one latent head
        k_pe = apply_rotary(k_pe.unsqueeze(1), cos, sin)  # (B, 1, t, r): the shared RoPE key
        if cache is not None:
            c_kv, k_pe = torch.cat([cache[0], c_kv], dim=2), torch.cat([cache[1], k_pe], dim=2)  # (B, 1, S, .)
        y = self.latent_attention(q, c_kv, k_pe, mask)  # (B, heads/tp, t, v)
        return self.proj(rearrange(y, "b h t d -> b t (h d)")), (c_kv, k_pe)

    def latent_attention(self, q: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, mask) -> torch.Tensor:
        """Attention of rotated queries ``q [B, heads/tp, t, r + n]`` (``[rope; nope]``) over cached
        latents ``c_kv [B, 1, S, kv_lora]`` and rotated keys ``k_pe [B, 1, S, r]``, with a bool
        ``mask`` broadcastable to ``[B, heads/tp, t, S]`` (True = attend): ``[B, heads/tp, t, v]``.
        DeepSeek-V2 sec. 2.1.2's absorbed form: ``W_UK`` folded into the queries, ``W_UV`` applied
        after the softmax-weighted sum of latents (module docstring)."""
        h = self.heads_local
        w = self.kv_b.weight.view(h, self.nope + self.v_dim, self.kv_lora)  # (heads/tp, n + v, kv_lora)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)  # (heads/tp, n, kv_lora), (heads/tp, v, kv_lora)
        q_pe, q_nope = q.split([self.rot, self.nope], dim=-1)  # (B, heads/tp, t, r), (B, heads/tp, t, n)
        q_latent = torch.einsum("bhtn,hnl->bhtl", q_nope, w_uk)  # (B, heads/tp, t, kv_lora)
        query = torch.cat([q_latent, q_pe], dim=-1)  # (B, heads/tp, t, kv_lora + r)
        key = torch.cat([c_kv, k_pe], dim=-1).expand(-1, h, -1, -1)  # (B, heads/tp, S, kv_lora + r)
        o = F.scaled_dot_product_attention(
            query, key, c_kv.expand(-1, h, -1, -1), attn_mask=mask, scale=self.softmax_scale
        )  # (B, heads/tp, t, kv_lora)
        return torch.einsum("bhtl,hvl->bhtv", o, w_uv)  # (B, heads/tp, t, v)

    def project(self, x: torch.Tensor):
        """q and k ``(B, heads/tp, T, r + n)`` (``[rope; nope]`` per head, not yet rotated; k's rope
        part the shared ``k_pe``) and v ``(B, heads/tp, T, v)`` of ``x [B, T(/tp), H]``."""
        x = self._input(x)  # (B, T, H)
        q = self._queries(x)  # (B, heads/tp, T, r + n)
        latent, k_pe = self.kv_a(x).split([self.kv_lora, self.rot], dim=-1)  # (B, T, kv_lora), (B, T, r)
        kv = rearrange(self.kv_b(self.kv_a_norm(latent)), "b t (h d) -> b h t d", h=self.heads_local)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, heads/tp, T, n), (B, heads/tp, T, v)
        k_pe = k_pe.unsqueeze(1).expand(-1, self.heads_local, -1, -1)  # (B, heads/tp, T, r): one shared head
        return q, torch.cat([k_pe, k_nope], dim=-1), v

    def forward(self, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
        q, k, v = self.project(x)  # (B, heads/tp, T, r + n), v (B, heads/tp, T, v)
        if seq is None:
            cos, sin = self.rope.first(q.shape[2], q.dtype)  # (T, r)
        else:  # this rank's positions: zigzag chunks under cp, or restarting per document
            cos, sin = self.rope.at(seq.position_ids, q.dtype)  # (B, 1, T/cp, r)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        core = self._core if seq is None else functools.partial(self._document_core, seq=seq)
        y = recompute(core, self.tracker, q, k, v) if self.recompute_core else core(q, k, v)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))  # (B, T, heads/tp * v) in

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * softmax_scale + causal mask), dropout, times v: ``(B, heads/tp, T, v)``."""
        p = self.dropout_p if self.training else 0.0
        if p > 0:
            with self.tracker.fork("tp"):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)

    def _document_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq: SequenceInfo) -> torch.Tensor:
        """Causal attention of this rank's ``T/cp`` queries over the whole sequence, inside the
        documents of ``seq`` when ``seq.segment_ids`` is set: q and k ``(B, heads/tp, T/cp, r + n)``,
        v ``(B, heads/tp, T/cp, v)`` -> ``(B, heads/tp, T/cp, v)``; the ring or the all-to-all under
        cp, plain (document-masked) attention at cp 1. No attention dropout (the config refuses it
        with cp > 1 and with packed documents)."""
        docs = dict(token_index=seq.token_index, segment_ids=seq.segment_ids, mask_cache=seq.cache)
        docs["scale"] = self.softmax_scale
        return context_parallel_attention(
            q, k, v, cp=self.cp, comm_type=self.cp_comm_type, block_kernel=self.cp_ring_kernel, **docs
        )

    def masked_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The KV-cache decoders' attention: q ``[B, heads/tp, t, r + n]`` over k ``[B, heads/tp, S, r +
        n]`` and v ``[B, heads/tp, S, v]`` with a bool ``mask`` broadcastable to ``[B, heads/tp, t, S]``
        (True = attend) -> ``[B, heads/tp, t, v]``."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
