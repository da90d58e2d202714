"""GPT-2-style or LLaMA-style decoder built from megazero's tensor-parallel layers.

The model (Radford et al. 2019; nanoGPT's layout) is: word + learned position embedding,
``num_layers`` pre-LayerNorm blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``, a final
LayerNorm and an output layer tied to the word embedding (or its own ``output.weight``).
The LLaMA-style options (Touvron et al. 2023) swap parts of the same structure: rotary
positions inside attention instead of the table (model/rope.py), RMSNorm, a SwiGLU MLP,
grouped-query attention, linears without bias; ``model/spec.py`` lists the parameters
each choice has, and the stage takes its partition tags from that list. With
``multi_latent_attention`` a block's attention is DeepSeek's MLA instead (model/mla.py).
Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019, sec. 3): the fused QKV and
``fc1`` are column-parallel (each rank holds whole heads / ``F/tp`` hidden units), ``proj``
and ``fc2`` are row-parallel, the word embedding and logits are split by vocabulary rows and
the loss is computed without gathering the logits. With sequence parallelism (Korthikanti
et al. 2022) the LayerNorm / dropout / residual activations are ``[B, T/tp, H]``.

Dropout draws from an ``RNGTracker``: the embedding and residual dropouts act on a
replicated region (same mask on every TP rank, the ``"replicated"`` stream), or, with
sequence parallelism, on different token chunks (the ``"tp"`` stream); attention dropout acts
on this rank's heads (``"tp"`` stream). ``scaled_dot_product_attention`` draws its dropout
from the global generator, so it runs inside ``tracker.fork("tp")``, which swaps the tp
stream in for the call.

Initialisation is layout independent (docs/design.md, contract 1): every full tensor comes
from (seed, canonical name) alone (``model.spec.InitialWeights``) and a stage keeps its
partitions, made one full tensor at a time (model/materialize.py).

Context parallelism and packed documents (megazero/context_parallel): a micro-batch may come
with a ``SequenceInfo`` (``seq``): the rank then holds ``T/cp`` tokens of each sequence (two
zigzag chunks), positions come from ``seq.position_ids``, and attention runs across the cp
ranks (ring or all-to-all) and inside documents (``seq.segment_ids``). Without ``seq`` the
model is exactly the single-sequence one (positions 0..T-1, causal SDPA).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from megazero import collectives as C
from megazero import tags
from megazero.context_parallel.attention import (
    context_parallel_attention,
    document_mask,
    local_attention,
    sink_attention,
)
from megazero.context_parallel.sdpa_kernels import expand_kv_for
from megazero.context_parallel.sequence import MTPTargets, SequenceInfo
from megazero.ops.activation import glu
from megazero.ops.fp8 import ACCUMULATE
from megazero.ops.norm import LayerNorm, RMSNorm
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_logits,
)
from megazero.tensor_parallel.mappings import gather_from_tp_region
from megazero.tensor_parallel.random import RNGTracker, dropout
from megazero.tensor_parallel.recompute import recompute
from model.config import GPTConfig
from model.materialize import VOCAB_TENSORS, local_partition, resize_vocab, use_placeholders  # noqa: F401
from model.mla import MLA_REPLICATED, MultiLatentAttention
from model.moe import ExpertMLP, MoEMLP, grouped_mm_available, moe_step_end  # noqa: F401 (re-export)
from model.mtp import MTPLossBackward, MTPModule, mtp_loss
from model.qk_clip import head_max_logits
from model.rope import RotaryTable, apply_rotary
from model.spec import InitialWeights, canonical_shapes, init_full_weights, spec_by_name  # noqa: F401 (re-export)
from model.value_head import ValueHead, per_token_values

# SDPA expands the key/value heads itself (``enable_gqa``, torch >= 2.5): no repeated K/V tensors
SDPA_GQA = torch.__version__ >= (2, 5)


PER_HEAD_NORMS = ("attn.q_norm.weight", "attn.k_norm.weight")
"""Replicated over tp, but applied to each rank's own heads: without sequence parallelism too,
a tp rank's gradient is its heads' part, summed over tp by the ``sequence_parallel`` tag's rule."""


class Embedding(nn.Module):
    """Vocabulary-parallel word embedding plus learned positions (replicated over TP).

    tokens ``[B, T]`` -> ``[B, T, H]`` (``[B, T/tp, H]`` with sequence parallelism: the word
    lookup is reduce-scattered along the sequence and this chunk's positions are added, so
    the position-embedding gradient is partial per rank and tagged ``sequence_parallel``).
    With ``with_positions=False`` it holds only the word embedding (the last stage's copy
    of a tied weight, or a first stage with rotary positions).
    """

    def __init__(self, cfg: GPTConfig, group, sp: bool, with_positions: bool, device=None):
        super().__init__()
        self.group, self.sp = group, sp
        self.word_embeddings = VocabParallelEmbedding(
            cfg.padded_vocab(C.group_size(group)),
            cfg.hidden_size,
            group,
            dtype=cfg.params_dtype,
            device=device,
            sequence_parallel=sp,
        )
        if with_positions:
            # _weight: start from zeros (load_full_weights fills it) without drawing from
            # torch's global generator, which nn.Embedding's own init would advance
            zeros = torch.zeros(cfg.max_position_embeddings, cfg.hidden_size, dtype=cfg.params_dtype, device=device)
            self.position_embeddings = nn.Embedding(*zeros.shape, _weight=zeros)
        self.with_positions = with_positions

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``position_ids [B, T]`` of the tokens (default ``0..T-1``); with sequence
        parallelism this rank adds those of its ``T/tp`` chunk."""
        x = self.word_embeddings(tokens)  # (B, T or T/tp, H)
        if not self.with_positions:  # RoPE: positions enter in attention
            return x
        start = C.group_rank(self.group) * x.shape[1] if self.sp else 0
        if position_ids is None:
            positions = torch.arange(start, start + x.shape[1], device=tokens.device)
        else:
            positions = position_ids[:, start : start + x.shape[1]]  # (B, T or T/tp)
        return x + self.position_embeddings(positions)


class Attention(nn.Module):
    """Causal self-attention over this rank's ``n_head/tp`` heads.

    ``[B, T(/tp), H] -> [B, T(/tp), H]``. Multi-head: the QKV weight is column-parallel with
    stride 3 over the canonical ``[q; k; v]`` rows, so each rank holds q, k and v of whole
    heads. Grouped-query (``num_query_groups`` G, Ainslie et al. 2023): the rows are G blocks
    ``[q of heads/G heads; k; v]`` and each rank holds ``G/tp`` whole groups (model/spec.py);
    each key/value head serves the ``heads/G`` query heads of its group. With
    ``position_embedding_type == "rope"`` q and k are rotated by the stage's ``rope`` table
    (model/rope.py; made here when not given). The head size ``d`` is ``kv_channels`` when set
    (``proj`` then maps ``A = n_head * d`` back to H), and with ``qk_layernorm`` q and k are
    RMS-normalised per head before the rotation (``project``). With a ``softmax_type`` other than
    ``"vanilla"`` each head's softmax has a sink logit (``sink_logits``; every path:
    megazero/context_parallel/attention.py ``sink_attention``, the ring, the all-to-all, and the
    KV-cache decoders through ``masked_core``).

    Sliding-window attention (Mistral 7B, Jiang et al. 2023, sec. 2; Megatron-LM's
    ``--window-size``): with ``window`` W (``GPTConfig.attention_window`` of this layer) the query
    at position p sees keys ``p - W + 1 .. p`` only; None = full causal attention. The plain path
    takes the additive mask from ``mask_cache`` (a dict the stage owns and clears each forward,
    so the layers of a micro-batch share one ``[1, 1, T, T]`` mask per window).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        group,
        sp: bool,
        tracker: RNGTracker,
        device=None,
        cp=None,
        rope: Optional[RotaryTable] = None,
        window: Optional[int] = None,
        mask_cache: Optional[dict] = None,
    ):
        super().__init__()
        self.window, self.mask_cache = window, mask_cache
        H, tp = cfg.hidden_size, C.group_size(group)
        self.cp = cp  # (cp group, its global ranks in cp order) or None
        self.cp_comm_type, self.cp_ring_kernel = cfg.cp_comm_type, cfg.cp_ring_kernel
        self.heads_local, self.head_dim = cfg.num_attention_heads // tp, cfg.head_dim
        self.grouped = cfg.num_query_groups is not None
        self.groups_local = cfg.kv_heads // tp
        self.q_per_group = cfg.num_attention_heads // cfg.kv_heads
        self.rotary = (cfg.rotary_dim, cfg.rotary_base) if cfg.position_embedding_type == "rope" else None
        if self.rotary is not None and rope is None:
            rope = RotaryTable.for_model(cfg, device)
        self.rope = rope
        self.dropout_p, self.tracker = cfg.attention_dropout, tracker
        self.softmax_scale = None  # SDPA's 1/sqrt(d) (model/mla.py sets its own)
        self.recompute_core = cfg.recompute_granularity == "selective"
        A = cfg.attention_width  # heads * d (H unless --kv-channels)
        rows = (cfg.num_attention_heads + 2 * cfg.kv_heads) * cfg.head_dim if self.grouped else 3 * A
        self.qkv = ColumnParallelLinear(
            H,
            rows,
            group,
            sequence_parallel=sp,
            stride=1 if self.grouped else 3,
            bias=cfg.qkv_bias,
            dtype=cfg.params_dtype,
            device=device,
            fp8=cfg.fp8,
            overlap_grad_reduce=cfg.tp_overlap_grad_reduce,
        )
        self.proj = RowParallelLinear(
            A,
            H,
            group,
            input_is_parallel=True,
            bias=cfg.add_bias_linear,
            sequence_parallel=sp,
            dtype=cfg.params_dtype,
            device=device,
            fp8=cfg.fp8,
        )
        if cfg.qk_layernorm:  # per head, so each rank's heads need no communication
            self.q_norm, self.k_norm = (
                RMSNorm(
                    cfg.head_dim,
                    eps=cfg.layernorm_epsilon,
                    backend=cfg.norm_backend,
                    dtype=cfg.params_dtype,
                    device=device,
                )
                for _ in range(2)
            )
        self.qk_layernorm = cfg.qk_layernorm
        # attention sinks (gpt-oss; Megatron-LM's --softmax-type): one logit per head, this rank's heads
        self.softmax_type = cfg.softmax_type
        if cfg.softmax_type == "learnable":
            self.sinks = nn.Parameter(torch.empty(self.heads_local, dtype=cfg.params_dtype, device=device))
        self.max_logits: Optional[torch.Tensor] = None  # QK-Clip's per-head maxima (record_max_logits)

    def record_max_logits(self) -> None:
        """From now on each training forward raises ``max_logits`` ``[n_head/tp]`` fp32 to the
        largest pre-softmax logit of each of this rank's heads (model/qk_clip.py; ``QKClip.reset``
        clears it after each step)."""
        self.max_logits = torch.full((self.heads_local,), float("-inf"), device=self.proj.weight.device)

    def sink_logits(self) -> Optional[torch.Tensor]:
        """The sink logit of each of this rank's ``n_head/tp`` heads (``[n_head/tp]``), or None
        with ``softmax_type`` ``"vanilla"`` (no sink): the learned ``sinks`` (``"learnable"``),
        zeros (``"off-by-one"``, a softmax whose denominator has one more ``exp(0)``)."""
        if self.softmax_type == "learnable":
            return self.sinks
        if self.softmax_type == "off-by-one":
            return torch.zeros(self.heads_local, device=self.proj.weight.device)
        return None

    def _split_heads(self, qkv: torch.Tensor):
        """``(B, T, rows/tp)`` -> q ``(B, n_head/tp, T, d)``, k and v ``(B, kv_heads/tp, T, d)``."""
        if not self.grouped:  # rows [q; k; v], each of h = n_head/tp whole heads
            q, k, v = rearrange(qkv, "b t (qkv h d) -> qkv b h t d", qkv=3, d=self.head_dim)
            return q, k, v
        # rows: g = G/tp blocks [q of heads/G heads; k; v], so r = heads/G + 2 heads a block
        qkv = rearrange(qkv, "b t (g r d) -> b g r t d", g=self.groups_local, d=self.head_dim)
        q = rearrange(qkv[:, :, : self.q_per_group], "b g r t d -> b (g r) t d")  # group-major heads
        return q, qkv[:, :, -2], qkv[:, :, -1]  # k, v: (B, G/tp, T, d)

    def project(self, x: torch.Tensor):
        """q ``(B, n_head/tp, T, d)``, k and v ``(B, kv_heads/tp, T, d)`` of ``x [B, T(/tp), H]``
        (the sequence gathered under SP), q and k RMS-normalised per head with ``qk_layernorm``
        (Qwen3's ``q_norm`` / ``k_norm``, Megatron-LM's ``--qk-layernorm``); not yet rotated."""
        q, k, v = self._split_heads(self.qkv(x))  # (B, heads/tp or G/tp, T, d)
        if self.qk_layernorm:  # RMSNorm over d of every (token, head)
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
        q, k, v = self.project(x)  # (B, heads/tp or G/tp, T, d)
        T = q.shape[2]
        if self.rotary is not None:
            if seq is None:
                cos, sin = self.rope.first(T, q.dtype)  # (T, rot)
            else:  # this rank's positions: zigzag chunks, or restarting per document
                cos, sin = self.rope.at(seq.position_ids, q.dtype)  # (B, 1, T, rot)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.max_logits is not None and self.training:  # QK-Clip: cp 1 only (config/checks.py)
            scale = self.softmax_scale or self.head_dim**-0.5
            segments = None if seq is None else seq.segment_ids
            torch.maximum(self.max_logits, head_max_logits(q, k, scale, self.window, segments), out=self.max_logits)
        if seq is not None:  # K/V stay query groups: the ring sends G/tp heads, not heads/tp
            core = functools.partial(self._context_core, seq=seq)
            y = recompute(core, self.tracker, q, k, v) if self.recompute_core else core(q, k, v)
            return self.proj(rearrange(y, "b h t d -> b t (h d)"))
        if self.q_per_group > 1 and not SDPA_GQA:  # each key/value head serves its group's query heads
            k, v = (t.repeat_interleave(self.q_per_group, dim=1) for t in (k, v))  # (B, heads/tp, T, d)
        if self.recompute_core:  # selective recomputation: keep q, k, v only
            y = recompute(self._core, self.tracker, q, k, v)
        else:
            y = self._core(q, k, v)
        y = rearrange(y, "b h t d -> b t (h d)")  # (B, T, n_head/tp * d = A/tp)
        return self.proj(y)

    def masked_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The KV-cache decoders' attention (model/sampling.py, model/rollout.py): q ``[B, n_head/tp,
        t, d]`` over k and v ``[B, kv_heads/tp or n_head/tp, S, d]`` with a bool ``mask``
        broadcastable to ``[B, n_head/tp, t, S]`` (True = attend) -> ``[B, n_head/tp, t, d]``: SDPA,
        or ``sink_attention`` with this layer's sinks."""
        sinks = self.sink_logits()
        if sinks is not None:
            return sink_attention(q, k, v, sinks, mask)
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)

    def _context_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq: SequenceInfo) -> torch.Tensor:
        """Causal attention of this rank's ``T/cp`` queries over the whole sequence, inside
        documents when ``seq.segment_ids`` is set: q ``(B, heads/tp, T/cp, d)``, k and v
        ``(B, G/tp, T/cp, d)`` -> ``(B, heads/tp, T/cp, d)``. No attention dropout (the
        config refuses it with cp > 1; with packed documents alone it is applied nowhere either,
        so it is refused there too)."""
        docs = dict(token_index=seq.token_index, segment_ids=seq.segment_ids, mask_cache=seq.cache, window=self.window)
        docs["sinks"] = self.sink_logits()
        return context_parallel_attention(
            q, k, v, cp=self.cp, comm_type=self.cp_comm_type, block_kernel=self.cp_ring_kernel, **docs
        )

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal mask), dropout, times v: (B, n_head/tp, T, head_dim);
        the causal mask is the sliding window's (``_window_mask``) on a windowed layer.

        k and v have ``G/tp`` heads under grouped-query attention when SDPA expands them itself
        (``SDPA_GQA``): query head h reads key/value head ``h // (heads/G)``, as
        ``repeat_interleave`` would give, with the same forward values (its K/V gradients sum
        the group's heads in another order: equal to rounding, tests/layouts/test_model_build.py).
        On CUDA, where no fused kernel would take ``enable_gqa`` for this call (fp32 in torch
        2.13, ``context_parallel/sdpa_kernels.py``), K/V are expanded here instead, inside the
        recomputed region under selective recomputation."""
        sinks = self.sink_logits()
        if sinks is not None:  # no SDPA kernel takes a sink: explicit scores (dropout refused: config/checks.py)
            return local_attention(q, k, v, sinks=sinks, window=self.window, mask_cache=self.mask_cache)
        p = self.dropout_p if self.training else 0.0
        extra = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        windowed = self.window is not None
        if extra and expand_kv_for(q, k, v, documents=windowed, dropout=p):  # CUDA: no fused kernel takes it
            k, v = (t.repeat_interleave(self.q_per_group, dim=1) for t in (k, v))  # (B, heads/tp, T, d)
            extra = {}
        if windowed:  # the sliding window's [1, 1, T, T] mask, shared by the stage's layers
            extra["attn_mask"] = self._window_mask(q)
        if p > 0:
            with self.tracker.fork("tp"):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=not windowed, **extra)
        return F.scaled_dot_product_attention(q, k, v, is_causal=not windowed, **extra)

    def _window_mask(self, q: torch.Tensor) -> torch.Tensor:
        """Additive ``[1, 1, T, T]`` mask of q's dtype for ``self.window`` (0 where ``0 <= i - j <
        W``), built once per (T, W, dtype, device) in ``mask_cache`` (every call without one)."""
        T = q.shape[2]
        key = ("window", T, self.window, q.dtype, q.device)
        if self.mask_cache is not None and key in self.mask_cache:
            return self.mask_cache[key]
        mask = document_mask(torch.arange(T, device=q.device), None, q.dtype, self.window)  # (1, 1, T, T)
        if self.mask_cache is not None:
            self.mask_cache[key] = mask
        return mask


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with exact (erf) GELU (tanh-approximated with ``openai_gelu``), or with ``swiglu``
    ``fc2(silu(gate) * up)`` where ``fc1`` gives ``[gate; up]`` (Shazeer 2020, "GLU Variants
    Improve Transformer", eq. 6; stride 2, so each rank holds F/tp of each); with ``quick_geglu``
    the gate's activation is quick GELU, with the offset and clamp of gpt-oss where set
    (``megazero.ops.activation.glu``); fc1 column-, fc2 row-parallel."""

    def __init__(self, cfg: GPTConfig, group, sp: bool, device=None):
        super().__init__()
        H, F_ = cfg.hidden_size, cfg.ffn_hidden_size
        self.gated, self.glu_options = cfg.gated_linear_unit, cfg.glu_options
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"  # torch's two GELUs
        self.fc1 = ColumnParallelLinear(
            H,
            2 * F_ if self.gated else F_,
            group,
            sequence_parallel=sp,
            stride=2 if self.gated else 1,
            bias=cfg.add_bias_linear,
            dtype=cfg.params_dtype,
            device=device,
            fp8=cfg.fp8,
            overlap_grad_reduce=cfg.tp_overlap_grad_reduce,
        )
        self.fc2 = RowParallelLinear(
            F_,
            H,
            group,
            input_is_parallel=True,
            bias=cfg.add_bias_linear,
            sequence_parallel=sp,
            dtype=cfg.params_dtype,
            device=device,
            fp8=cfg.fp8,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (B, T, F/tp), or (B, T, 2F/tp)
        if self.gated:  # [gate; up], (B, T, F/tp) each
            return self.fc2(glu(h, **self.glu_options))  # (B, T, F/tp) in
        return self.fc2(F.gelu(h, approximate=self.gelu_approximate))


class Block(nn.Module):
    """Pre-norm transformer block with residual dropout (``hidden_dropout``); its MLP is an
    ``MoEMLP`` when ``moe`` (``state_device``: where the MoE's counters and expert bias live;
    ``ep``: its (expert-parallel group, ep rank), None without expert parallelism; ``etp``: the
    tp ranks each routed expert is sliced over, None = all); ``window`` and
    ``mask_cache``: its attention's sliding window and mask cache (``Attention``). Its attention is
    ``model.mla.MultiLatentAttention`` under ``cfg.multi_latent_attention``."""

    def __init__(
        self,
        cfg: GPTConfig,
        group,
        sp: bool,
        tracker: RNGTracker,
        device=None,
        cp=None,
        rope: Optional[RotaryTable] = None,
        moe: bool = False,
        state_device=None,
        ep=None,
        window: Optional[int] = None,
        mask_cache: Optional[dict] = None,
        etp: Optional[int] = None,
    ):
        super().__init__()
        self.ln1 = _norm(cfg, device)
        if cfg.multi_latent_attention:  # DeepSeek's MLA (model/mla.py); the config refuses windows, sinks
            self.attn = MultiLatentAttention(cfg, group, sp, tracker, device, rope, cp)
        else:
            self.attn = Attention(cfg, group, sp, tracker, device, cp, rope, window, mask_cache)
        self.ln2 = _norm(cfg, device)
        cp_group = None if cp is None else cp[0]
        if moe:
            self.mlp = MoEMLP(cfg, group, device, state_device, ep, sp, cp_group, etp)
        else:
            self.mlp = MLP(cfg, group, sp, device)
        self.tracker, self.p = tracker, cfg.hidden_dropout
        self.region = "tp" if sp else "replicated"

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.tracker.generator(self.region), self.training)

    def forward(self, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln1(x), seq))
        h = self.ln2(x)  # an MoE routes a cp rank's share over the whole sequences, decoding's alone
        return x + self._drop(self.mlp(h, seq is not None) if isinstance(self.mlp, MoEMLP) else self.mlp(h))


def _norm(cfg: GPTConfig, device) -> nn.Module:
    """``cfg.normalization`` over H (tags come from the spec in ``GPTStage``)."""
    norm = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return norm(
        cfg.hidden_size, eps=cfg.layernorm_epsilon, backend=cfg.norm_backend, dtype=cfg.params_dtype, device=device
    )


class GPTStage(nn.Module):
    """One pipeline model chunk of the GPT: optional embedding, some blocks, optional head.

    Args:
        cfg: model sizes; validated against the TP size (ValueError names the setting).
        groups: this rank's ProcessGroups; ``groups.tp`` partitions the layers.
        layer_ids: global ids of the blocks held here (``layers.{id}.*`` parameter names).
        pre_process: holds the embedding (first chunk of the first stage).
        post_process: holds the final LayerNorm and the output layer (last chunk).
        seed: initialisation seed (``init_full_weights``); the dropout tracker, unless
            given, is seeded with ``seed + 100 * pp_rank`` (Megatron's convention).
        full_weights: canonical full tensors to slice instead of ``InitialWeights(cfg, seed,
            tp)`` (a mapping; a lazy one, e.g. ``model.hf.CanonicalView``, is read one tensor
            at a time).
        rng_tracker: share one tracker between the chunks of an interleaved schedule.
        device: where the parameters live and the dropout masks are drawn (default CPU);
            build the stage on its device rather than moving it, since the tracker's
            generators stay on the device they were made for.
        materialize: give the parameters their initial values now (``materialize()``), one
            at a time. False: they stay placeholders holding no memory (NaN when read) until
            whoever owns their storage fills them from ``initial_partition`` -- ZeRO-3's
            ``DataParallel(initial_values=...)``, which writes each straight into its shard.

    With tied embeddings a last stage that is not also the first keeps its own copy of the
    word-embedding partition (same name, same initial value); when ``pp_size > 1`` both
    copies are tagged ``shared_embedding`` (counted in norms on the first stage only) and
    the trainer sums their gradients over the embedding group.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        groups: ProcessGroups,
        layer_ids: Iterable[int],
        pre_process: bool,
        post_process: bool,
        seed: int,
        *,
        full_weights: Optional[Mapping[str, torch.Tensor]] = None,
        rng_tracker: Optional[RNGTracker] = None,
        device=None,
        materialize: bool = True,
    ):
        super().__init__()
        cfg.validate(groups.tp_size)
        self.cfg, self.groups, self.tp = cfg, groups, groups.tp
        self.layer_ids = list(layer_ids)
        self.pre_process, self.post_process = pre_process, post_process
        self.padded_vocab = cfg.padded_vocab(groups.tp_size)
        self.sp = cfg.sequence_parallel and groups.tp_size > 1
        self.device = torch.device(device if device is not None else "cpu")
        self.rng_tracker = rng_tracker or RNGTracker(seed + 100 * groups.pp_rank, groups.tp_rank, self.device)
        self._build_modules(cfg, groups)
        use_placeholders(self, self.device)
        self._tag_from_spec()
        shared = cfg.tie_embeddings or cfg.mtp_num_layers > 0  # the last stage reads the word embedding
        if groups.pp_size > 1 and shared and (pre_process or post_process):
            tags.set_shared_embedding(self.embedding.word_embeddings.weight, counted_here=pre_process)
        if post_process and not pre_process:  # the head's W would hold [B, T, V/tp]
            tags.set_weight_grad_in_b(
                self.embedding.word_embeddings.weight if cfg.tie_embeddings else self.output.weight
            )
        self._initial = InitialWeights(cfg, seed, groups.tp_size) if full_weights is None else full_weights
        self._start_expert_bias(full_weights)
        self.materialized = False
        # the per-token losses are -log softmax(logits / this): a rollout sampled at temperature T
        # is scored at T (--post-train grpo sets it on the policy and the reference)
        self.logit_temperature = 1.0
        # a value head scores every position instead of the one the loss mask selects (the
        # critic of --post-train ppo sets it; model/value_head.per_token_values)
        self.values_per_token = False
        if materialize:
            self.materialize()

    def _build_modules(self, cfg: GPTConfig, groups: ProcessGroups) -> None:
        """The embedding, blocks and head on the meta device (no memory; ``use_placeholders``
        moves them to ``self.device``), sharing one rotary table made on the device."""
        meta, pre, post = "meta", self.pre_process, self.post_process
        self.attention_masks: dict = {}  # sliding-window masks, shared by the layers, cleared each forward
        if pre or (post and (cfg.tie_embeddings or cfg.mtp_num_layers > 0)):
            with_positions = pre and cfg.position_embedding_type == "learned_absolute"
            self.embedding = Embedding(cfg, self.tp, self.sp, with_positions, meta)
        cp = (groups.cp, groups.cp_ranks) if groups.cp_size > 1 else None
        rope = RotaryTable.for_model(cfg, self.device) if cfg.position_embedding_type == "rope" else None
        ep = (groups.ep, groups.ep_rank) if groups.ep_size > 1 else None
        self.layers = nn.ModuleDict(
            {
                str(i): Block(
                    cfg,
                    self.tp,
                    self.sp,
                    self.rng_tracker,
                    meta,
                    cp,
                    rope,
                    moe=cfg.is_moe_layer(i),
                    state_device=self.device,
                    ep=ep,
                    window=cfg.attention_window(i),
                    mask_cache=self.attention_masks,
                    etp=groups.etp_size,
                )
                for i in self.layer_ids
            }
        )
        if post:
            self.final_ln = _norm(cfg, meta)
            if not cfg.tie_embeddings:
                self.output = ColumnParallelLinear(
                    cfg.hidden_size,
                    self.padded_vocab,
                    self.tp,
                    bias=False,
                    sequence_parallel=self.sp,
                    dtype=cfg.params_dtype,
                    device=meta,
                    overlap_grad_reduce=cfg.tp_overlap_grad_reduce,
                    wide=None if cfg.fp8 is None else ACCUMULATE,  # exact tp sums for FP8 (megazero.ops.fp8)
                )
            if cfg.value_head:
                self.value_head = ValueHead(cfg.hidden_size, groups, self.sp, meta)
            if cfg.mtp_num_layers > 0:  # DeepSeek-V3's multi-token prediction (model/mtp.py)
                self.mtp = nn.ModuleList(
                    MTPModule(
                        cfg.hidden_size,
                        functools.partial(_norm, cfg, meta),
                        Block(cfg, self.tp, self.sp, self.rng_tracker, meta, cp, rope, mask_cache=self.attention_masks),
                        cfg.params_dtype,
                        meta,
                    )
                    for _ in range(cfg.mtp_num_layers)
                )
                # this step's MTP loss (fp64, the sum of the micro-batches' shares; mtp_step_end reads it)
                self.mtp_loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def _start_expert_bias(self, full_weights) -> None:
        """Each MoE layer's expert bias (``--moe-router-enable-expert-bias``) from ``full_weights``
        where it offers one (``expert_bias(layer)`` -> ``[E]`` or None: a Hugging Face folder's
        DeepSeek-V3 ``e_score_correction_bias``, ``model.hf.CanonicalView``); zeros otherwise."""
        read = getattr(full_weights, "expert_bias", None)
        if read is None:
            return
        for i, block in self.layers.items():
            bias = block.mlp.expert_bias if isinstance(block.mlp, MoEMLP) else None
            value = read(int(i)) if bias is not None else None
            if value is not None:
                bias.copy_(value)

    def _tag_from_spec(self) -> None:
        """Partition tags of every parameter from its spec entry (model/spec.py); a parameter
        the spec does not declare, or whose partition shape disagrees, is a ValueError."""
        spec, tp, etp = spec_by_name(self.cfg, self.padded_vocab), self.groups.tp_size, self.groups.etp_size
        for name, p in self.named_parameters():
            e = spec.get(name)
            if e is None:
                raise ValueError(f"parameter {name!r} is not declared in model/spec.py")
            local, routed = list(e.shape), ".mlp.experts." in name
            if e.partition_dim is not None:
                local[e.partition_dim] //= etp if routed else tp
                tags.set_partitioned(p, e.partition_dim, e.partition_stride)
                if routed and etp < tp:  # cut over etp ranks, replicated over tp / etp
                    tags.set_partition_size(p, etp)
            else:  # QK-norm and MLA's latent weights: each tp rank's heads give part of the gradient
                tags.set_replicated(p, sequence_parallel=self.sp or name.endswith(PER_HEAD_NORMS + MLA_REPLICATED))
            if self.groups.experts_apart and routed:
                tags.set_expert_parallel(p)
            tags.set_weight_decay(p, e.weight_decay)
            tags.set_hidden_matrix(p, len(e.shape) == 2 and e.part == "layer")
            if tuple(local) != tuple(p.shape):
                raise ValueError(
                    f"{name}: spec gives a partition of shape {tuple(local)}, the module holds {tuple(p.shape)}"
                )

    def _partition(self, name: str, full: Mapping) -> torch.Tensor:
        g = self.groups
        return local_partition(
            name, self.get_parameter(name), full, g.tp_rank, g.tp_size, self.cfg.vocab_size, self.padded_vocab
        )

    @torch.no_grad()
    def initial_partition(self, name: str) -> torch.Tensor:
        """This rank's partition of parameter ``name``'s initial value: a new tensor of the
        parameter's shape and dtype on ``self.device``, cut from its full tensor alone (made by
        ``InitialWeights`` or read from ``full_weights``), which is dropped on return. Raises
        KeyError naming a missing tensor, ValueError on a shape mismatch, RuntimeError once the
        stage has materialized (its source is dropped then)."""
        if self._initial is None:
            raise RuntimeError(f"{name}: the stage's initial values were already given to its parameters")
        p = self.get_parameter(name)
        src = self._partition(name, self._initial)
        if tags.is_partitioned(p) and src.dtype == p.dtype and src.device == self.device:
            return src  # already a new contiguous tensor (tags.partition_tensor): no third copy
        return torch.empty(p.shape, dtype=p.dtype, device=self.device).copy_(src)

    @torch.no_grad()
    def materialize(self, partitions: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Give every parameter its initial value, one at a time (``initial_partition``): at
        most one full tensor and one partition exist beyond the parameters already made.
        Drops the source of the values (``full_weights`` is not kept alive by the stage).

        ``partitions``: this rank's partitions already cut (name -> a tensor of the
        parameter's shape, e.g. ``megazero.checkpoint.read_partitions``), taken instead of
        the initial values and cast to the parameter's dtype on ``self.device`` (no copy
        when they match). Raises KeyError naming a missing partition, ValueError on a shape
        mismatch."""
        for name, p in self.named_parameters():
            if partitions is None:
                p.data = self.initial_partition(name)
                continue
            if name not in partitions:
                raise KeyError(f"partitions lack {name!r}, needed by this stage")
            src = partitions[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"{name}: partition of shape {tuple(src.shape)}, parameter is {tuple(p.shape)}")
            p.data = src.to(dtype=p.dtype, device=self.device)
        self._initial, self.materialized = None, True

    @torch.no_grad()
    def load_full_weights(self, full: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's partition of each canonical full tensor into the (materialized)
        parameters, one tensor at a time (``model.materialize.local_partition``: vocabulary
        tensors of any padding, partitions from each parameter's tags). Raises KeyError naming
        a missing tensor, ValueError on a shape mismatch."""
        for name, p in self.named_parameters():
            p.copy_(self._partition(name, full))

    def forward(
        self,
        x: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        seq: Optional[SequenceInfo] = None,
        mtp: Optional[MTPTargets] = None,
    ) -> torch.Tensor:
        """Run this chunk.

        ``x``: token ids ``[B, T]`` with ``pre_process``, else hidden ``[B, T, H]``
        (``[B, T/tp, H]`` with sequence parallelism); ``T`` is this rank's ``T/cp`` tokens
        when ``seq`` (their positions and documents) is given. Returns, with ``post_process``,
        per-token losses ``[B, T]`` fp32 when ``labels [B, T]`` is given (of ``logits /
        logit_temperature``, 1 unless a post-training mode set it), else this rank's
        vocabulary partition of the logits ``[B, T, V_pad/tp]``; a reward model
        (``cfg.value_head``) returns instead the score of each sequence ``[B]`` fp32, of the
        token ``seq.loss_mask`` selects (model/value_head.py), or with ``values_per_token`` (a PPO
        critic) each position's value ``[B, T]`` fp32; otherwise the hidden
        states for the next stage. With ``mtp`` (this rank's ``MTPTargets``, counted) and
        ``labels`` a last stage with multi-token prediction modules in training mode also computes
        the micro-batch's share of the MTP loss (model/mtp.py), adds it to ``mtp_loss_sum`` and
        attaches it to the returned per-token losses, whose values it leaves unchanged (its
        gradient joins the backward). Raises ValueError when ``T`` exceeds
        ``max_position_embeddings`` or (sequence parallel) is not divisible by tp.
        """
        self.attention_masks.clear()  # masks of the last micro-batch's shapes (held by autograd if needed)
        if self.pre_process:
            if x.shape[1] > self.cfg.max_position_embeddings:
                raise ValueError(
                    f"sequence of {x.shape[1]} tokens exceeds "
                    f"--max-position-embeddings {self.cfg.max_position_embeddings}"
                )
            x = self.embedding(x, None if seq is None else seq.position_ids)  # (B, T(/tp), H)
            region = "tp" if self.sp else "replicated"
            x = dropout(x, self.cfg.hidden_dropout, self.rng_tracker.generator(region), self.training)
        x = self._run_layers(x, seq)
        if not self.post_process:
            return x
        x = self.final_ln(x)
        if self.cfg.value_head:  # a reward model: one score per sequence, no logits
            if self.values_per_token:  # a critic: one value per position
                return per_token_values(self.value_head, x)  # (B, T/cp) fp32
            return self.value_head(x, seq)  # (B,) fp32
        logits = self._logits(x)  # (B, T, V_pad/tp)
        if labels is None:
            return logits
        if self.logit_temperature != 1.0:
            logits = logits / self.logit_temperature
        losses = self._cross_entropy(logits, labels)  # (B, T) fp32
        if mtp is None or not hasattr(self, "mtp") or not self.training:  # evaluation: the next-token loss
            return losses
        share = mtp_loss(
            self.mtp,
            x,
            mtp,
            seq,
            self.embedding.word_embeddings,
            lambda h, y: self._cross_entropy(self._logits(h), y),
            self.cfg.mtp_loss_scaling_factor,
        )
        self.mtp_loss_sum += share.detach()
        return MTPLossBackward.apply(losses, share, mtp.grad_scale)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer (the tied word embedding or ``output``): ``[B, T(/tp), H]`` -> this
        rank's vocabulary partition ``[B, T, V_pad/tp]``."""
        if self.cfg.tie_embeddings:  # FP8: logits, softmax sums and the hidden gradient in fp64 (megazero.ops.fp8)
            wide = None if self.cfg.fp8 is None else ACCUMULATE
            return parallel_lm_logits(
                x, self.embedding.word_embeddings.weight, self.tp, sequence_parallel=self.sp, wide=wide
            )
        return self.output(x)  # built with wide= under FP8

    def _cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token losses ``[B, T]`` fp32 of the vocabulary-parallel ``logits`` for ``labels [B, T]``
        (computed in fp64 for the fp64 logits of FP8 training, then rounded)."""
        loss = vocab_parallel_cross_entropy(
            logits,
            labels,
            self.tp,
            label_smoothing=self.cfg.label_smoothing,
            vocab_size=self.cfg.vocab_size,
            padded_vocab_size=self.padded_vocab,
        )
        return loss.float() if self.cfg.fp8 is not None else loss

    def _run_layers(self, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
        """The blocks of this chunk, ``[B, T(/tp), H]`` in and out, with full recomputation as
        Megatron-LM lays it out: ``uniform`` makes each group of ``recompute_num_layers``
        consecutive layers one recomputed region; ``block`` recomputes the first
        ``recompute_num_layers`` layers of the chunk one by one and runs the rest normally."""
        layers, cfg = list(self.layers.values()), self.cfg
        if cfg.recompute_granularity != "full" or not self.training:
            for layer in layers:
                x = layer(x) if seq is None else layer(x, seq)
            return x
        n = cfg.recompute_num_layers
        if cfg.recompute_method == "uniform":
            groups = [layers[i : i + n] for i in range(0, len(layers), n)]
            regions = [(group, True) for group in groups]
        else:
            regions = [([layer], i < n) for i, layer in enumerate(layers)]
        for group, recomputed in regions:
            run = functools.partial(_run_group, group, seq=seq)
            x = recompute(run, self.rng_tracker, x) if recomputed else run(x)
        return x


def _run_group(layers: list, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
    for layer in layers:
        x = layer(x) if seq is None else layer(x, seq)
    return x


@torch.no_grad()
def generate_greedy(
    stage: GPTStage,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    pick: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Greedy decoding with a whole-model stage (pp == 1): ``[B, T0] -> [B, T0 + new]``.

    Each step runs the last ``max_position_embeddings`` tokens without dropout, gathers the
    vocabulary partitions of the last position's logits over TP and takes the argmax over
    the real vocabulary (padded columns ignored), or ``pick(logits [B, V]) -> ids [B]`` (e.g.
    ``model.sampling.choose`` with a seeded generator: every TP rank sees the same logits and
    draws the same ids). Under sequence parallelism the context is right-padded to a multiple
    of tp, which causal attention keeps invisible to the real positions. Raises ValueError
    when the stage lacks the embedding or the output layer.
    """
    if not (stage.pre_process and stage.post_process):
        raise ValueError("generate_greedy needs the whole model in one stage (pp == 1)")
    cfg, tp = stage.cfg, stage.groups.tp_size
    window = cfg.max_position_embeddings
    if stage.sp:
        window -= window % tp
    was_training = stage.training
    stage.eval()
    ids = prompt_ids
    try:
        for _ in range(max_new_tokens):
            context = ids[:, -window:]  # (B, t)
            t = context.shape[1]
            if stage.sp:
                context = F.pad(context, (0, (-t) % tp))  # (B, t rounded up to tp)
            logits = stage(context)[:, t - 1]  # (B, V_pad/tp)
            logits = gather_from_tp_region(logits, stage.tp)[:, : cfg.vocab_size]  # (B, V)
            chosen = logits.argmax(dim=-1) if pick is None else pick(logits)  # (B,)
            ids = torch.cat([ids, chosen.reshape(-1, 1).to(ids.dtype)], dim=1)
    finally:
        stage.train(was_training)
    return ids
