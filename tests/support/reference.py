"""A plain single-process GPT: the test oracle for every layout-equivalence test (docs/design.md, "Conventions" 13).

Written independently of ``model/`` and ``megazero/`` (it imports only torch and math; an MoE
layer routes with ``megazero.moe.router``'s functions, the one routing rule of the project, and
a gated MLP calls ``megazero.ops.activation.glu``, held against transformers' gpt-oss by
tests/unit/test_glu.py), in
the style of nanoGPT (Karpathy) and GPT-2 (Radford et al. 2019): learned position
embeddings, pre-LayerNorm blocks, causal self-attention computed with an explicit mask and
softmax, an exact (erf) GELU MLP, a final LayerNorm and an output layer that is tied to the
word embedding by default. The LLaMA-style options (Touvron et al. 2023) are written out
as plainly: RoPE as a complex rotation, RMSNorm, SwiGLU, grouped-query attention by
indexing each query head's key/value head, linear layers without bias (or with a bias on the
QKV projection alone, Qwen2's), RoPE scaling (Llama 3.1's frequency rule and linear position
interpolation, applied to the angles pair by pair), a head size of its own (``head_dim``, not
hidden / heads) and Qwen3's QK-norm (an RMSNorm of each q and k head before RoPE). There is no
dropout: the oracle is only compared with runs that have dropout off.

It loads the canonical full tensors of docs/design.md ("Interfaces" > Model); only the first
``vocab_size`` rows of the (padded) word embedding and output weight are used, and the loss
is ``F.cross_entropy`` over the real vocabulary, averaged over every token of the batch.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F


class _LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class _RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` (Zhang & Sennrich 2019, eq. 4)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = None
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


def _scaled_frequency(theta: float, scaling: dict) -> float:
    """One pair's frequency under ``scaling``'s ``llama3`` = (factor, low, high, original
    context): Llama 3.1's rule, written for a single wavelength."""
    if "llama3" not in scaling:
        return theta
    factor, low, high, original = scaling["llama3"]
    wavelength = 2 * math.pi / theta
    if wavelength < original / high:  # fast pairs keep their frequency
        return theta
    if wavelength > original / low:  # slow pairs turn factor times slower
        return theta / factor
    weight = (original / wavelength - low) / (high - low)
    return weight * theta + (1 - weight) * theta / factor


def _yarn_frequency(j: int, rot_dim: int, base: float, yarn: dict) -> float:
    """Pair ``j``'s YaRN frequency (transformers' ``yarn`` rope type, written per pair in float64):
    the pair index where a pair turns ``b`` times over the original context is
    ``rot ln(original / (2 pi b)) / (2 ln base)``; between those of ``beta_fast`` and ``beta_slow``
    (rounded outwards when ``truncate``) the frequency slides linearly in ``j`` from kept to
    divided by ``factor``."""

    def index(b):
        return rot_dim * math.log(yarn["original"] / (2 * math.pi * b)) / (2 * math.log(base))

    low, high = index(yarn["beta_fast"]), index(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    slide = min(max((j - low) / ((high + 0.001 if high == low else high) - low), 0.0), 1.0)
    theta = base ** (-2 * j / rot_dim)
    return slide * theta / yarn["factor"] + (1 - slide) * theta


def _yarn_magnitude(yarn: dict) -> float:
    """YaRN's factor on cos and sin: ``attention_factor`` if given, else ``(0.1 a ln s + 1)`` over
    ``(0.1 b ln s + 1)`` with ``a, b = mscale, mscale_all_dim`` when both are non-zero, else
    ``0.1 ln s + 1`` (1 for ``s <= 1``)."""
    s = yarn["factor"]
    if yarn.get("attention_factor") is not None:
        return yarn["attention_factor"]

    def m(a):
        return 1.0 if s <= 1 else 0.1 * a * math.log(s) + 1.0

    a, b = yarn.get("mscale"), yarn.get("mscale_all_dim")
    return m(a) / m(b) if a and b else m(1.0)


def rope_rotate(x: torch.Tensor, rot_dim: int, base: float, positions=None, scaling=None) -> torch.Tensor:
    """RoPE written with complex numbers: pair ``(x_j, x_{j+rot/2})`` of the first ``rot_dim``
    dimensions is ``x_j + i x_{j+rot/2}``, multiplied by ``exp(i t base^(-2j/rot_dim))`` at
    position ``t`` (Su et al. 2021, eq. 34). ``x [B, heads, T, d]`` -> same shape; ``positions``
    ``[B, T]`` (default 0..T-1). ``scaling``: ``{"llama3": (factor, low, high, original)}``
    rewrites each frequency (``_scaled_frequency``), ``{"linear": f}`` uses position ``t / f``,
    ``{"yarn": dict(factor, original, beta_fast, beta_slow, truncate, mscale, mscale_all_dim,
    attention_factor)}`` uses ``_yarn_frequency`` and scales the rotated pairs by ``_yarn_magnitude``."""
    B, T, half = x.shape[0], x.shape[2], rot_dim // 2
    scaling = scaling or {}
    if "yarn" in scaling:
        freqs = [_yarn_frequency(j, rot_dim, base, scaling["yarn"]) for j in range(half)]
    else:
        freqs = [_scaled_frequency(base ** (-2 * j / rot_dim), scaling) for j in range(half)]
    theta = torch.tensor(freqs, dtype=torch.float64)  # (rot/2,)
    t = torch.arange(T, dtype=torch.float64).expand(B, T) if positions is None else positions.double()
    t = t / scaling.get("linear", 1.0)
    magnitude = _yarn_magnitude(scaling["yarn"]) if "yarn" in scaling else 1.0
    ones = torch.full((B, 1, T, half), magnitude, dtype=torch.float64)
    phase = torch.polar(ones, t[:, None, :, None] * theta)  # (B, 1, T, rot/2)
    z = torch.complex(x[..., :half].double(), x[..., half:rot_dim].double()) * phase
    return torch.cat([z.real.to(x.dtype), z.imag.to(x.dtype), x[..., rot_dim:]], dim=-1)


class _Expert(nn.Module):
    """``glu``: None for the GELU MLP, else the gated unit's options (``megazero.ops.activation.glu``)."""

    def __init__(self, hidden: int, ffn: int, glu: Optional[dict], bias: bool):
        super().__init__()
        self.glu = glu
        self.fc1 = nn.Linear(hidden, ffn if glu is None else 2 * ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        return self.fc2(_activation(self.fc1(x), self.glu))


def _activation(h, glu: Optional[dict]):
    """GELU, or the gated unit of ``h = [gate; up]`` (the model's one function: the unit tests hold
    it against transformers' gpt-oss)."""
    from megazero.ops.activation import glu as gated

    return F.gelu(h) if glu is None else gated(h, **glu)


def _moe_layer(freq, i: int) -> bool:
    """Megatron-LM's ``--moe-layer-freq``: an integer N (layers 0, N, 2N, ...) or one 0/1 per layer."""
    return bool(freq[i]) if isinstance(freq, list) else i % freq == 0


class _MoE(nn.Module):
    """A Mixture-of-Experts MLP written plainly: every expert runs on every token of a group and
    each token keeps the outputs of its (kept) top-k experts, weighted by the routing weights;
    plus the shared expert on all tokens. The tokens are routed in groups of ``group_rows``
    sequences (the trainer's micro-batches): routing, capacity, the load-balancing loss and
    the z-loss are each group's. The routing rules are ``megazero.moe.router``'s functions (one
    rule, the issue's requirement); ``losses`` collects each group's coefficient-weighted
    auxiliary loss, ``counts`` the pre-drop assignments per expert, ``record`` each group's
    ``(experts, keep)`` while it is a list."""

    def __init__(self, hidden: int, num_experts: int, ffn: int, shared, glu, bias: bool, opts: dict):
        super().__init__()
        self.o, self.E = opts, num_experts
        self.router = nn.Linear(hidden, num_experts, bias=opts.get("router_bias", False))  # gpt-oss's router bias
        self.experts = nn.ModuleList(_Expert(hidden, ffn, glu, bias) for _ in range(num_experts))
        self.shared = None if shared is None else _Expert(hidden, shared, glu, bias)
        self.expert_bias = torch.zeros(num_experts) if opts["expert_bias"] else None
        self.losses, self.counts, self.record = [], torch.zeros(num_experts, dtype=torch.long), None

    def forward(self, x):
        from megazero.moe import router as R

        o, (B, T, H), k = self.o, x.shape, self.o["topk"]
        outs = []
        rows = o.get("group_rows") or B
        for g in range(0, B, rows):
            flat = x[g : g + rows].reshape(-1, H)  # (N, H)
            logits = self.router(flat)  # (N, E)
            r = R.route(
                logits,
                k,
                o["score_function"],
                o["pre_softmax"],
                self.expert_bias,
                o.get("num_groups"),
                o.get("group_topk"),
                o.get("scaling_factor"),
            )
            keep = torch.ones_like(r.experts, dtype=torch.bool)
            if o["capacity_factor"] is not None:
                cap = R.expert_capacity(flat.shape[0], self.E, k, o["capacity_factor"])
                keep = R.capacity_keep(r.probs, r.experts, self.E, cap, o["drop_policy"])
            every = torch.stack([e(flat) for e in self.experts], dim=1)  # (N, E, H)
            chosen = every.gather(1, r.experts[..., None].expand(-1, -1, H))  # (N, k, H)
            out = (chosen * (r.probs * keep)[..., None]).sum(1)
            if self.shared is not None:
                out = out + self.shared(flat)
            loss = torch.zeros(())
            if o["load_balancing"] == "aux_loss" and o["aux_coeff"] > 0:
                loss = loss + R.aux_loss(r.scores, r.experts, k, o["aux_coeff"])
            elif o["load_balancing"] == "seq_aux_loss" and o["aux_coeff"] > 0:
                loss = loss + R.seq_aux_loss(r.scores, r.experts, k, T, o["aux_coeff"])
            if o["z_coeff"]:
                loss = loss + R.z_loss(logits, o["z_coeff"])
            self.losses.append(loss)
            self.counts += R.assignment_counts(r.experts, self.E)
            if self.record is not None:
                self.record.append((r.experts.clone(), keep.clone()))
            outs.append(out.view(-1, T, H))
        return torch.cat(outs)


class _Block(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn: int,
        eps: float,
        *,
        kv_groups=None,
        rope=None,
        rmsnorm: bool = False,
        swiglu: bool = False,
        glu: Optional[dict] = None,
        bias: bool = True,
        qkv_bias: Optional[bool] = None,
        rope_scaling=None,
        head_dim: Optional[int] = None,
        qk_norm: bool = False,
        softmax_type: str = "vanilla",
        moe=None,
        window: Optional[int] = None,
        mla: Optional[dict] = None,
    ):
        super().__init__()
        self.heads, self.kv_groups, self.rope = heads, kv_groups, rope
        self.glu = (glu or {}) if swiglu else None  # the gated unit's options; None = GELU
        self.window = window  # sliding window W: key j hidden from query i when i - j >= W
        self.rope_scaling = rope_scaling
        d = self.d = hidden // heads if head_dim is None else head_dim
        norm = _RMSNorm if rmsnorm else _LayerNorm
        self.ln1 = norm(hidden, eps)
        qkv_rows = 3 * heads * d if kv_groups is None else (heads + 2 * kv_groups) * d
        self.mla = mla
        if mla is None:
            self.qkv = nn.Linear(hidden, qkv_rows, bias=bias if qkv_bias is None else qkv_bias)
            self.proj = nn.Linear(heads * d, hidden, bias=bias)
        else:
            self._mla_modules(hidden, heads, eps, **mla)
        # QK-norm (Qwen3): every head of q and of k divided by its RMS over d, times a [d] weight
        self.q_norm, self.k_norm = (_RMSNorm(d, eps), _RMSNorm(d, eps)) if qk_norm else (None, None)
        # attention sinks: one logit per head in each softmax's denominator (learned, or 0 off-by-one)
        self.softmax_type = softmax_type
        self.sinks = nn.Parameter(torch.zeros(heads)) if softmax_type == "learnable" else None
        self.ln2 = norm(hidden, eps)
        self.moe = (
            None if moe is None else _MoE(hidden, moe["num_experts"], moe["ffn"], moe["shared"], self.glu, bias, moe)
        )
        if moe is None:
            self.fc1 = nn.Linear(hidden, 2 * ffn if swiglu else ffn, bias=bias)
            self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def _mla_modules(self, hidden: int, heads: int, eps: float, *, q_lora, kv_lora, nope, rope, v) -> None:
        """DeepSeek's latent attention (model/mla.py): per head q = [nope; rope], k/v latent expanded."""
        qk = nope + rope
        if q_lora is None:
            self.q = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a, self.q_a_norm = nn.Linear(hidden, q_lora, bias=False), _RMSNorm(q_lora, eps)
            self.q_b = nn.Linear(q_lora, heads * qk, bias=False)
        self.kv_a, self.kv_a_norm = nn.Linear(hidden, kv_lora + rope, bias=False), _RMSNorm(kv_lora, eps)
        self.kv_b = nn.Linear(kv_lora, heads * (nope + v), bias=False)
        self.proj = nn.Linear(heads * v, hidden, bias=False)

    def _mla_attention(self, x, positions, hidden):
        """Scores of [q_nope; q_pe] against [k_nope; k_pe] (one k_pe for all heads), scaled by
        (nope + rope)^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2."""
        B, T, H = x.shape
        o, heads = self.mla, self.heads
        nope, rope = o["nope"], o["rope"]
        q = self.q(x) if o["q_lora"] is None else self.q_b(self.q_a_norm(self.q_a(x)))
        q = q.view(B, T, heads, nope + rope).transpose(1, 2)  # (B, heads, T, nope + rope)
        latent, k_pe = self.kv_a(x).split([o["kv_lora"], rope], dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent)).view(B, T, heads, nope + o["v"]).transpose(1, 2)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        q_pe = rope_rotate(q[..., nope:], rope, self.rope[1], positions, self.rope_scaling)
        k_pe = rope_rotate(k_pe.view(B, 1, T, rope), rope, self.rope[1], positions, self.rope_scaling)
        scale = (nope + rope) ** -0.5
        yarn = (self.rope_scaling or {}).get("yarn")
        if yarn and yarn.get("mscale_all_dim") and yarn["factor"] > 1:
            scale *= (0.1 * yarn["mscale_all_dim"] * math.log(yarn["factor"]) + 1.0) ** 2
        scores = (q[..., :nope] @ k_nope.transpose(-2, -1) + q_pe @ k_pe.transpose(-2, -1)) * scale
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        if hidden is not None:
            future = future | hidden[:, None]  # (B, 1, T, T)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.proj((probs @ v).transpose(1, 2).reshape(B, T, heads * o["v"]))

    def _heads(self, x):
        """q ``(B, heads, T, d)``; k, v ``(B, heads, T, d)`` (a group's k/v copied to its queries)."""
        B, T, H = x.shape
        d, out = self.d, self.qkv(x)
        if self.kv_groups is None:  # [q; k; v]
            q, k, v = out.split(self.heads * d, dim=-1)  # each (B, T, heads * d)
            return (t.view(B, T, self.heads, d).transpose(1, 2) for t in (q, k, v))
        G = self.kv_groups
        n = self.heads // G  # query heads per group
        per_group = out.view(B, T, G, (n + 2) * d)  # [q (n*d); k (d); v (d)] per group
        q = per_group[..., : n * d].reshape(B, T, self.heads, d).transpose(1, 2)
        k = per_group[..., n * d : (n + 1) * d].transpose(1, 2)  # (B, G, T, d)
        v = per_group[..., (n + 1) * d :].transpose(1, 2)
        pick = torch.arange(self.heads) // n  # query head h uses group h // n
        return q, k[:, pick], v[:, pick]

    def attention(self, x, positions=None, hidden=None):
        """``hidden [B, T, T]`` bool: key j is hidden from query i (besides the future)."""
        if self.mla is not None:
            return self._mla_attention(x, positions, hidden)
        B, T, H = x.shape
        q, k, v = self._heads(x)
        if self.q_norm is not None:  # before the rotation, as Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = (rope_rotate(t, *self.rope, positions, self.rope_scaling) for t in (q, k))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d)  # (B, heads, T, T)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        if self.window is not None:  # keys W or more positions back: below the diagonal i - j = W
            future = future | torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-self.window)
        if hidden is not None:
            future = future | hidden[:, None]  # (B, 1, T, T)
        scores = scores.masked_fill(future, float("-inf"))
        if self.softmax_type == "vanilla":
            probs = scores.softmax(dim=-1)
        else:  # the sink column joins the softmax and is dropped after it
            sink = self.sinks if self.sinks is not None else torch.zeros(self.heads, device=x.device)
            column = sink.view(1, -1, 1, 1).expand(B, self.heads, T, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :T]
        y = (probs @ v).transpose(1, 2).reshape(B, T, self.heads * self.d)  # (B, heads, T, d) -> (B, T, heads d)
        return self.proj(y)

    def mlp(self, x):
        if self.moe is not None:
            return self.moe(x)
        return self.fc2(_activation(self.fc1(x), self.glu))

    def forward(self, x, positions=None, hidden=None):
        x = x + self.attention(self.ln1(x), positions, hidden)
        return x + self.mlp(self.ln2(x))


def reference_block(hidden: int, heads: int, ffn: int, eps: float, **block) -> nn.Module:
    """One of the oracle's blocks, ``x [B, T, H] -> [B, T, H]`` called as ``block(x, positions [B, T],
    hidden [B, T, T] bool: True = key hidden)``; ``block``: ``ReferenceGPT``'s block options (one
    ``window``, not ``windows``)."""
    return _Block(hidden, heads, ffn, eps, **block)


def reference_norm(size: int, eps: float, rmsnorm: bool) -> nn.Module:
    """The oracle's LayerNorm (weight and bias) or RMSNorm (weight) over the last ``size`` dimensions."""
    return _RMSNorm(size, eps) if rmsnorm else _LayerNorm(size, eps)


_GLU_OPTIONS = {  # megazero.ops.activation.glu's keyword -> the config attribute
    "quick_geglu": "quick_geglu",
    "linear_offset": "glu_linear_offset",
    "clamp_value": "activation_func_clamp_value",
}


def block_options(cfg) -> dict:
    """The reference's block options read off a config object's attributes (a
    ``model.config.GPTConfig``; read by name, so this file imports nothing of ``model``)."""
    rope = None
    if cfg.position_embedding_type == "rope":
        d = cfg.hidden_size // cfg.num_attention_heads
        d = getattr(cfg, "kv_channels", None) or d
        rope = (int(d * cfg.rotary_percent), cfg.rotary_base)
    gated = cfg.swiglu or getattr(cfg, "quick_geglu", False)
    out = dict(kv_groups=cfg.num_query_groups, rope=rope, rmsnorm=cfg.normalization == "RMSNorm", swiglu=gated)
    glu = {name: getattr(cfg, key) for name, key in _GLU_OPTIONS.items() if getattr(cfg, key, None)}
    if glu:
        out["glu"] = glu
    if getattr(cfg, "kv_channels", None) is not None:
        out["head_dim"] = cfg.kv_channels
    if getattr(cfg, "multi_latent_attention", False):
        out["rope"] = (cfg.qk_pos_emb_head_dim, cfg.rotary_base)
        out["mla"] = dict(
            q_lora=cfg.q_lora_rank,
            kv_lora=cfg.kv_lora_rank,
            nope=cfg.qk_head_dim,
            rope=cfg.qk_pos_emb_head_dim,
            v=cfg.v_head_dim,
        )
    if getattr(cfg, "qk_layernorm", False):
        out["qk_norm"] = True
    if getattr(cfg, "softmax_type", "vanilla") != "vanilla":
        out["softmax_type"] = cfg.softmax_type
    if getattr(cfg, "window_size", None) is not None:  # per-layer sliding windows
        out["windows"] = [cfg.attention_window(i) for i in range(cfg.num_layers)]
    scaling = {}
    if getattr(cfg, "use_rope_scaling", False):
        scaling["llama3"] = (
            cfg.rope_scaling_factor,
            cfg.rope_scaling_low_freq_factor,
            cfg.rope_scaling_high_freq_factor,
            cfg.rope_scaling_original_max_position_embeddings,
        )
    if getattr(cfg, "rotary_seq_len_interpolation_factor", None) is not None:
        scaling["linear"] = cfg.rotary_seq_len_interpolation_factor
    if getattr(cfg, "yarn_rotary_scaling_factor", None) is not None:
        scaling["yarn"] = dict(
            factor=cfg.yarn_rotary_scaling_factor,
            original=cfg.yarn_original_max_position_embeddings,
            beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow,
            truncate=cfg.yarn_correction_range_round_to_int,
            mscale=cfg.yarn_mscale,
            mscale_all_dim=cfg.yarn_mscale_all_dim,
            attention_factor=cfg.yarn_attention_factor,
        )
    if scaling:
        out["rope_scaling"] = scaling
    if getattr(cfg, "num_experts", None) is not None:
        out["moe"] = dict(
            topk=cfg.moe_router_topk,
            layer_freq=cfg.moe_layer_freq,
            score_function=cfg.moe_router_score_function,
            pre_softmax=cfg.moe_router_pre_softmax,
            load_balancing=cfg.moe_router_load_balancing_type,
            aux_coeff=cfg.moe_aux_loss_coeff,
            z_coeff=cfg.moe_z_loss_coeff,
            capacity_factor=cfg.moe_expert_capacity_factor,
            drop_policy=cfg.moe_token_drop_policy,
            expert_bias=cfg.moe_router_enable_expert_bias,
            router_bias=getattr(cfg, "moe_router_linear_bias", False),
            bias_rate=cfg.moe_router_bias_update_rate,
            num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk,
            scaling_factor=cfg.moe_router_topk_scaling_factor,
        )
    return out


class ReferenceGPT(nn.Module):
    """GPT-2-style decoder in one process, or the LLaMA-style variant.

    Args: real ``vocab_size`` V, ``num_layers``, ``hidden_size`` H, ``num_heads``,
    ``ffn_hidden_size`` F, ``max_positions`` (rows of the learned position table; 0 = none,
    e.g. with ``rope``); ``tie_embeddings`` shares the word embedding with the output layer;
    ``eps`` is the norm epsilon. Block options: ``kv_groups`` G (grouped-query attention
    with Megatron's per-group ``[q; k; v]`` QKV rows; None = GPT-2's ``[q; k; v]``),
    ``rope`` = ``(rotated dims, base)``, ``rope_scaling`` (``rope_rotate``), ``rmsnorm``,
    ``swiglu`` (a gated MLP, ``fc1`` = ``[gate; up]``; ``glu``: its options, the keywords of
    ``megazero.ops.activation.glu``: gpt-oss's quick GEGLU, offset and clamp), ``bias`` (linear
    biases; the MoE router's with ``moe["router_bias"]``), ``qkv_bias`` (the QKV projection's; None = ``bias``),
    ``head_dim`` (None = hidden / heads), ``qk_norm``, ``softmax_type`` (sinks), ``windows``
    (one sliding window W or None per layer: key j hidden from query i when ``i - j >= W``), ``mla``
    (DeepSeek's latent attention in place of ``qkv``: ``dict(q_lora, kv_lora, nope, rope, v)``,
    ``rope`` = ``(its rotated dims, base)``).
    """

    def __init__(
        self,
        vocab_size: int,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        ffn_hidden_size: int,
        max_positions: int,
        tie_embeddings: bool = True,
        eps: float = 1e-5,
        **block,
    ):
        super().__init__()
        self.vocab_size, self.num_layers = vocab_size, num_layers
        self.tie_embeddings = tie_embeddings
        self.wte = nn.Embedding(vocab_size, hidden_size)
        self.wpe = nn.Embedding(max_positions, hidden_size) if max_positions else None
        moe = block.pop("moe", None)  # MoE options (block_options) and sizes (from_full_weights)
        windows = block.pop("windows", None) or [None] * num_layers  # sliding window per layer
        self.blocks = nn.ModuleList(
            _Block(
                hidden_size,
                num_heads,
                ffn_hidden_size,
                eps,
                **block,
                moe=moe if moe is not None and _moe_layer(moe["layer_freq"], i) else None,
                window=windows[i],
            )
            for i in range(num_layers)
        )
        self.ln_f = (_RMSNorm if block.get("rmsnorm") else _LayerNorm)(hidden_size, eps)
        self.lm_head = None if tie_embeddings else nn.Linear(hidden_size, vocab_size, bias=False)

    def canonical_parameters(self) -> dict[str, nn.Parameter]:
        """Canonical name -> parameter (the word embedding holds the real rows only)."""
        mods, sinks = {"final_ln": self.ln_f}, {}
        for i, b in enumerate(self.blocks):
            attention = ("q", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b") if b.mla else ("qkv",)
            named = [("ln1", b.ln1)] + [(f"attn.{n}", getattr(b, n)) for n in attention if hasattr(b, n)]
            named += [("attn.proj", b.proj), ("ln2", b.ln2)]
            mods.update({f"layers.{i}.{canon}": mod for canon, mod in named})
            if b.q_norm is not None:
                mods.update({f"layers.{i}.attn.q_norm": b.q_norm, f"layers.{i}.attn.k_norm": b.k_norm})
            if b.sinks is not None:
                sinks[f"layers.{i}.attn.sinks"] = b.sinks
            if b.moe is None:
                mods.update({f"layers.{i}.mlp.fc1": b.fc1, f"layers.{i}.mlp.fc2": b.fc2})
                continue
            mods[f"layers.{i}.mlp.router"] = b.moe.router
            experts = [(f"experts.{j}", e) for j, e in enumerate(b.moe.experts)]
            for prefix, e in experts + ([("shared_experts", b.moe.shared)] if b.moe.shared is not None else []):
                mods.update({f"layers.{i}.mlp.{prefix}.fc1": e.fc1, f"layers.{i}.mlp.{prefix}.fc2": e.fc2})
        out = {"embedding.word_embeddings.weight": self.wte.weight}
        if self.wpe is not None:
            out["embedding.position_embeddings.weight"] = self.wpe.weight
        for canon, mod in mods.items():
            out[f"{canon}.weight"] = mod.weight
            if mod.bias is not None:
                out[f"{canon}.bias"] = mod.bias
        if self.lm_head is not None:
            out["output.weight"] = self.lm_head.weight
        return {**out, **sinks}

    @torch.no_grad()
    def load_full_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Copy the canonical full tensors in; vocabulary rows past ``vocab_size`` are dropped.

        Raises KeyError naming a missing canonical tensor, ValueError for a tensor this
        model does not have.
        """
        mine = self.canonical_parameters()
        extra = sorted(set(full) - set(mine))
        if extra:
            raise ValueError(f"full weights hold {extra[0]!r}, which this reference lacks")
        for name, p in mine.items():
            if name not in full:
                raise KeyError(f"full weights lack {name!r}")
            src = full[name]
            if name in ("embedding.word_embeddings.weight", "output.weight"):
                src = src[: self.vocab_size]
            p.copy_(src)

    @classmethod
    def from_full_weights(
        cls, full: dict[str, torch.Tensor], vocab_size: int, num_heads: int, eps: float = 1e-5, **block
    ) -> "ReferenceGPT":
        """Build a model whose sizes are read off the canonical tensors, then load them.

        Learned positions, linear biases and tying follow from which tensors exist; the
        other block options are ``block`` (see the class).
        """
        num_layers = len({k.split(".")[1] for k in full if k.startswith("layers.")})
        hidden = full["embedding.word_embeddings.weight"].shape[1]
        wpe = full.get("embedding.position_embeddings.weight")
        dense = [k for k in full if k.endswith(".mlp.fc2.weight")]
        ffn = full[dense[0]].shape[1] if dense else 1
        if block.get("moe") is not None:  # the sizes of the experts, read off the first MoE layer's
            block = dict(
                block,
                moe=dict(
                    block["moe"],
                    num_experts=full["layers.0.mlp.router.weight"].shape[0],
                    ffn=full["layers.0.mlp.experts.0.fc2.weight"].shape[1],
                    shared=full["layers.0.mlp.shared_experts.fc2.weight"].shape[1]
                    if "layers.0.mlp.shared_experts.fc2.weight" in full
                    else None,
                ),
            )
        model = cls(
            vocab_size,
            num_layers,
            hidden,
            num_heads,
            ffn,
            0 if wpe is None else wpe.shape[0],
            tie_embeddings="output.weight" not in full,
            eps=eps,
            bias="layers.0.attn.proj.bias" in full,
            qkv_bias="layers.0.attn.qkv.bias" in full,
            **block,
        )
        model.load_full_weights(full)
        return model

    def forward(
        self, tokens: torch.Tensor, eod=None, reset_attention_mask=False, reset_position_ids=False, return_hidden=False
    ) -> torch.Tensor:
        """tokens ``[B, T]`` int64 -> logits ``[B, T, V]`` over the real vocabulary; with
        ``return_hidden`` the final-norm hidden states ``[B, T, H]`` instead (what a reward
        model's value head reads).

        Packed documents (Megatron's flags): with ``eod`` set, a document ends at each EOD token
        (which belongs to it); ``reset_attention_mask`` hides other documents' keys,
        ``reset_position_ids`` counts positions from 0 in each document."""
        B, T = tokens.shape
        positions, hidden = torch.arange(T).repeat(B, 1), None  # (B, T)
        if eod is not None:
            doc = torch.zeros(B, T, dtype=torch.long)
            for b in range(B):
                start = 0
                for t in range(T):  # written out: token t opens a document after an EOD
                    if t > 0 and tokens[b, t - 1] == eod:
                        start = t
                        doc[b, t] = doc[b, t - 1] + 1
                    elif t > 0:
                        doc[b, t] = doc[b, t - 1]
                    if reset_position_ids:
                        positions[b, t] = t - start
            if reset_attention_mask:
                hidden = doc[:, :, None] != doc[:, None, :]  # (B, T, T)
        x = self.wte(tokens)  # (B, T, H)
        if self.wpe is not None:
            x = x + self.wpe(positions)
        for block in self.blocks:
            x = block(x, positions, hidden)
        x = self.ln_f(x)
        if return_hidden:
            return x
        return x @ (self.wte.weight if self.lm_head is None else self.lm_head.weight).t()

    def moe_layers(self) -> list:
        """The blocks' MoE MLPs (``_MoE``), in layer order; empty for a dense model."""
        return [b.moe for b in self.blocks if b.moe is not None]

    def loss(
        self, tokens: torch.Tensor, labels: torch.Tensor, eod=None, eod_mask_loss=False, **packing
    ) -> torch.Tensor:
        """Mean cross-entropy over all ``B*T`` tokens (a scalar); with ``eod_mask_loss`` over the
        targets that are not ``eod``. ``packing``: ``forward``'s document flags. With MoE layers
        the loss to minimise adds, per layer, the mean over the token groups of their
        auxiliary losses (``aux_loss``: the last call's sum of those means)."""
        for m in self.moe_layers():
            m.losses = []
        logits = self(tokens, eod, **packing)
        self.aux_loss = sum((torch.stack(m.losses).mean() for m in self.moe_layers()), torch.zeros(()))
        if not eod_mask_loss:
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        else:
            each = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
            counted = labels.reshape(-1) != eod
            ce = each[counted].sum() / counted.sum()
        self.cross_entropy = ce.detach()
        return ce + self.aux_loss if self.moe_layers() else ce


def train_reference(
    full_weights: dict[str, torch.Tensor],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    vocab_size: int,
    num_heads: int,
    lr: Union[float, Callable[[int], float]],
    steps: int,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
    eps: float = 1e-8,
    clip_grad: float = 0.0,
    layernorm_eps: float = 1e-5,
    optimizer: str = "adamw",
    return_model: bool = False,
    block=None,
    packing=None,
    stats: Optional[dict] = None,
    model_class=None,
):
    """Train the reference model; returns the loss before each of ``steps`` updates.

    Step ``s`` uses ``batches[s % len(batches)]`` = (tokens ``[B, T]``, labels ``[B, T]``)
    as the whole global batch (loss = mean over its tokens). ``lr`` is a constant or a
    function of the step index. ``optimizer`` is ``"adamw"`` (torch.optim.AdamW; weight
    decay on weights of 2 or more dimensions only, none on biases and LayerNorm, as in
    Megatron-LM) or ``"sgd"`` (plain torch.optim.SGD, no momentum). ``clip_grad > 0``
    clips the global gradient norm with ``torch.nn.utils.clip_grad_norm_``.
    ``block``: the block options of ``ReferenceGPT`` (e.g. ``block_options(gpt_config)``);
    ``packing``: ``ReferenceGPT.loss``'s document options (``eod``, ``reset_attention_mask``, ...).
    Returns ``list[float]`` (the cross-entropy, without MoE auxiliary losses), or ``(losses,
    model)`` when ``return_model``. ``stats``: a dict to fill with each step's ``grad_norms`` (the
    global norm before clipping) and ``aux_losses``, the first step's MoE ``assignments`` (per MoE
    layer, per token group ``(experts [N, k], keep [N, k])``; every step's in ``assignment_steps``)
    and ``expert_bias``: after each step,
    per MoE layer, its bias (None without one). ``model_class``: ``ReferenceGPT`` (default) or a
    subclass; one whose loss sets ``mtp_loss`` (tests/support/mtp.py) adds it per step to
    ``stats["mtp_losses"]``.
    """
    model_class = model_class or ReferenceGPT
    from megazero.moe.router import expert_bias_update

    model = model_class.from_full_weights(full_weights, vocab_size, num_heads, layernorm_eps, **(block or {}))
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    lr0 = lr(0) if callable(lr) else lr
    if optimizer == "adamw":
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr0,
            betas=betas,
            eps=eps,
        )
    elif optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr0)
    else:
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr(step) if callable(lr) else lr
        tokens, labels = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        moe = model.moe_layers()
        for m in moe:
            m.record = [] if stats is not None else None
        loss = model.loss(tokens, labels, **(packing or {}))
        loss.backward()
        if stats is not None:
            stats.setdefault("grad_norms", []).append(
                torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()
            )
            stats.setdefault("aux_losses", []).append(model.aux_loss.item())
            if hasattr(model, "mtp_loss"):
                stats.setdefault("mtp_losses", []).append(model.mtp_loss.item())
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, clip_grad)
        opt.step()
        for m in moe:  # the aux-loss-free bias: once per step, from the step's pre-drop counts
            if m.expert_bias is not None:
                m.expert_bias = expert_bias_update(m.expert_bias, m.counts, m.o["bias_rate"])
            m.counts.zero_()
        if stats is not None:
            stats.setdefault("expert_bias", []).append(
                [None if m.expert_bias is None else m.expert_bias.clone() for m in moe]
            )
            if step == 0:
                stats["assignments"] = [m.record for m in moe]
            stats.setdefault("assignment_steps", []).append([m.record for m in moe])
        losses.append(model.cross_entropy.item())
    return (losses, model) if return_model else losses


def random_batches(vocab_size: int, seq_length: int, n: int, batch: int, seed: int):
    """``n`` global batches of uniform random tokens: (tokens ``[batch, T]``, labels ``[batch, T]``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(0, vocab_size, (batch, seq_length + 1), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out
