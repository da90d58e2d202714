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
gather (an all-reduce, or a reduce-scatter under sequence parallelism). The decoders' KV cache
holds the expanded, rotated k and v of every head (``project`` returns them as a multi-head
attention's), not the compressed latent.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from megazero import collectives as C
from megazero.context_parallel.attention import local_attention
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

    Offers ``model.gpt.Attention``'s interface to the block and the KV-cache decoders
    (``project``, ``masked_core``, ``sink_logits``, ``rotary``, ``rope``, ``window``,
    ``q_per_group``, ``proj``, ``softmax_scale``): ``project`` returns per head q and k ``[rope;
    nope]`` (``r + n`` dims, RoPE part first, so ``apply_rotary`` rotates it) and v (``v`` dims).
    Needs rotary positions; no sinks, no window, no context parallelism (the config refuses them:
    megazero/config/shape.py ``check_mla``).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        group,
        sp: bool,
        tracker: RNGTracker,
        device=None,
        rope: Optional[RotaryTable] = None,
    ):
        super().__init__()
        H, tp, heads = cfg.hidden_size, C.group_size(group), cfg.num_attention_heads
        self.group, self.sp, self.tracker = group, sp, tracker
        self.heads_local = heads // tp
        self.nope, self.rot, self.v_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.rotary = (cfg.rotary_dim, cfg.rotary_base)
        self.rope = rope if rope is not None else RotaryTable.for_model(cfg, device)
        self.window, self.q_per_group, self.cp = None, 1, None
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

    def project(self, x: torch.Tensor):
        """q and k ``(B, heads/tp, T, r + n)`` (``[rope; nope]`` per head, not yet rotated; k's rope
        part the shared ``k_pe``) and v ``(B, heads/tp, T, v)`` of ``x [B, T(/tp), H]``."""
        if self.sp:  # backward: the heads' partial input gradients reduce-scattered
            x = gather_from_sequence_parallel_region(x, self.group)  # (B, T, H)
        else:  # backward: the heads' partial input gradients all-reduced
            x = copy_to_tp_region(x, self.group)
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.low_rank_q else self.q(x)  # (B, T, heads/tp*(n+r))
        q = rearrange(q, "b t (h d) -> b h t d", h=self.heads_local)  # (B, heads/tp, T, n + r)
        q = torch.cat([q[..., self.nope :], q[..., : self.nope]], dim=-1)  # [rope; nope]
        latent, k_pe = self.kv_a(x).split([self.kv_lora, self.rot], dim=-1)  # (B, T, kv_lora), (B, T, r)
        kv = rearrange(self.kv_b(self.kv_a_norm(latent)), "b t (h d) -> b h t d", h=self.heads_local)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, heads/tp, T, n), (B, heads/tp, T, v)
        k_pe = k_pe.unsqueeze(1).expand(-1, self.heads_local, -1, -1)  # (B, heads/tp, T, r): one shared head
        return q, torch.cat([k_pe, k_nope], dim=-1), v

    def forward(self, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
        q, k, v = self.project(x)  # (B, heads/tp, T, r + n), v (B, heads/tp, T, v)
        if seq is None:
            cos, sin = self.rope.first(q.shape[2], q.dtype)  # (T, r)
        else:  # positions restarting per document (cp 1: check_mla refuses the ring)
            cos, sin = self.rope.at(seq.position_ids, q.dtype)  # (B, 1, T, r)
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
        """Causal attention inside the documents of ``seq`` (packed documents, cp = 1). The kernel
        takes one head size, so q, k and v are zero-padded to the larger of ``r + n`` and ``v`` (zero
        dimensions add nothing to a score or an output; the scale is explicit) and the output cut back."""
        width = max(q.shape[-1], v.shape[-1])
        q, k, v_padded = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))  # (B, heads/tp, T, width)
        docs = dict(token_index=seq.token_index, segment_ids=seq.segment_ids, mask_cache=seq.cache)
        y = local_attention(q, k, v_padded, scale=self.softmax_scale, **docs)  # (B, heads/tp, T, width)
        return y[..., : v.shape[-1]]

    def masked_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The KV-cache decoders' attention: q ``[B, heads/tp, t, r + n]`` over k ``[B, heads/tp, S, r +
        n]`` and v ``[B, heads/tp, S, v]`` with a bool ``mask`` broadcastable to ``[B, heads/tp, t, S]``
        (True = attend) -> ``[B, heads/tp, t, v]``."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
