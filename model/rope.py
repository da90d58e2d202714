"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer", sec. 3.4).

The first ``rot`` dimensions of a query or key head are paired as ``(x_j, x_{j + rot/2})``
(the "rotate half" layout of GPT-NeoX, LLaMA and Megatron-LM), and pair ``j`` at position
``t`` is rotated by the angle ``t * base^(-2j / rot)``; the other ``head_dim - rot``
dimensions (``--rotary-percent`` < 1) pass unchanged. A rotated query at position ``m`` and
key at ``n`` then have a dot product that depends on ``m - n`` only (sec. 3.4.2).

Each rank rotates its own heads (the rotation is per head, so tensor parallelism changes
nothing), and inside attention the sequence is whole (sequence parallelism all-gathers it
before the QKV projection; pipeline stages pass whole samples), so positions are
``0 .. T-1``, unless the batch says otherwise: under context parallelism a rank holds two
chunks of each sequence, and with ``--reset-position-ids`` positions restart with every
document; ``rotary_cos_sin_at`` takes those positions (megazero/context_parallel/sequence.py).

Scaling (``RopeScaling``; off = the frequencies above, bit for bit): ``linear`` divides every
position by a factor (Chen et al. 2023, "Extending Context Window of Large Language Models via
Positional Interpolation"; Megatron-LM's ``--rotary-seq-len-interpolation-factor``), which is the
same angle as dividing each frequency by it, as transformers' ``linear`` rope type does; ``llama3``
rewrites the frequencies as Llama 3.1 does (transformers' documented ``llama3`` rope type,
Megatron-LM's ``--use-rope-scaling``): with wavelength ``w_j = 2 pi / f_j`` and the original
context ``L``, a pair whose ``w_j`` is longer than ``L / low_freq_factor`` turns ``factor`` times
slower, one shorter than ``L / high_freq_factor`` keeps its frequency, and one in between mixes
the two, ``(1 - s) f_j / factor + s f_j`` with ``s = (L / w_j - low) / (high - low)``.

``yarn`` (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
sec. 3.2-3.4; computed as transformers' ``yarn`` rope type, ``_compute_yarn_parameters``, and
Megatron-core's YarnRotaryEmbedding): with the ``rot`` rotated dimensions, the original context
``L`` and ``beta_fast`` / ``beta_slow`` (rotations per ``L``), the correction dimensions are
``d(b) = rot ln(L / (2 pi b)) / (2 ln base)``; ``low = d(beta_fast)``, ``high = d(beta_slow)``
(floored / ceiled when ``truncate``, Megatron's ``correction_range_round_to_int``; gpt-oss sets it
false), clamped to ``[0, rot - 1]``. Pair ``j`` mixes the interpolated frequency ``f_j / factor``
and the original ``f_j`` with the ramp ``r_j = clamp((j - low) / (high - low), 0, 1)``:
``f_j / factor * r_j + f_j * (1 - r_j)`` (fast pairs, below ``low``, keep their frequency).
YaRN also scales the attention logits: cos and sin are multiplied by the attention factor
(sec. 3.4's ``sqrt(1/t)``), ``0.1 ln(factor) + 1``, or with ``mscale`` and ``mscale_all_dim``
both set (DeepSeek's form) ``(0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1)``,
or the given ``attention_factor``; 1 when ``factor <= 1``. Since both q and k are rotated, the
logits grow by its square.

Every attention path reads one table (``RotaryTable``: training, context parallel, the KV-cache
decoding of model/sampling.py and model/rollout.py), so all see the same scaled angles and the
same attention factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (module docstring): ``llama3_factor`` None = no Llama 3.1 rewrite,
    ``yarn_factor`` None = no YaRN, ``linear_factor`` None = positions undivided. The linear
    division may follow either rewrite (as Megatron-LM's RotaryEmbedding applies its two options);
    llama3 and yarn together raise ValueError. ``original_max_positions`` is the pretraining
    context ``L`` (tokens) of the rewrite; ``beta_fast``, ``beta_slow`` (rotations), ``mscale``,
    ``mscale_all_dim``, ``attention_factor`` and ``truncate`` are YaRN's (transformers' keys)."""

    llama3_factor: Optional[float] = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    linear_factor: Optional[float] = None
    yarn_factor: Optional[float] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True

    def __post_init__(self):
        if self.llama3_factor is not None and self.yarn_factor is not None:
            raise ValueError("RopeScaling: llama3 and yarn both rewrite the frequencies; give one")

    @classmethod
    def of(cls, cfg) -> Optional["RopeScaling"]:
        """The scaling of a ``model.config.GPTConfig``; None when it has none (unscaled RoPE)."""
        yarn = cfg.yarn_rotary_scaling_factor
        if not cfg.use_rope_scaling and cfg.rotary_seq_len_interpolation_factor is None and yarn is None:
            return None
        return cls(
            llama3_factor=cfg.rope_scaling_factor if cfg.use_rope_scaling else None,
            low_freq_factor=cfg.rope_scaling_low_freq_factor,
            high_freq_factor=cfg.rope_scaling_high_freq_factor,
            original_max_positions=(
                cfg.rope_scaling_original_max_position_embeddings
                if yarn is None
                else cfg.yarn_original_max_position_embeddings
            ),
            linear_factor=cfg.rotary_seq_len_interpolation_factor,
            yarn_factor=yarn,
            beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow,
            mscale=cfg.yarn_mscale,
            mscale_all_dim=cfg.yarn_mscale_all_dim,
            attention_factor=cfg.yarn_attention_factor,
            truncate=cfg.yarn_correction_range_round_to_int,
        )

    @property
    def cos_sin_factor(self) -> float:
        """The factor multiplied onto cos and sin (transformers' ``attention_scaling``): YaRN's
        attention factor (module docstring), 1.0 without YaRN."""
        if self.yarn_factor is None:
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            s = self.yarn_factor
            return float(yarn_mscale(s, self.mscale) / yarn_mscale(s, self.mscale_all_dim))
        return yarn_mscale(self.yarn_factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 mscale ln(factor) + 1`` (Peng et al. 2023, eq. 22 with
    DeepSeek's ``mscale`` coefficient); 1.0 when ``factor <= 1`` (no extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_frequencies(rot_dim: int, base: float, scaling: Optional[RopeScaling] = None, device=None) -> torch.Tensor:
    """Frequencies ``f_j = base^(-2j / rot)`` of the ``rot/2`` pairs (radians per position, fp32
    ``[rot/2]``), rewritten by ``scaling`` (module docstring) when given."""
    if scaling is not None and scaling.yarn_factor is not None:
        inv_freq = _yarn(rot_dim, base, scaling, device)
    else:
        inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim)
    if scaling is None:
        return inv_freq
    if scaling.llama3_factor is not None:
        inv_freq = _llama3(inv_freq, scaling)
    if scaling.linear_factor is not None:
        inv_freq = inv_freq / scaling.linear_factor
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rewrite of ``inv_freq [rot/2]``: slow pairs divided by the factor, fast pairs
    kept, the band between interpolated linearly in ``L / wavelength``."""
    wavelength = 2 * math.pi / inv_freq  # (rot/2,) positions per turn
    L = s.original_max_positions
    slowed = inv_freq / s.llama3_factor
    mix = (L / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    between = (1 - mix) * slowed + mix * inv_freq
    out = torch.where(wavelength > L / s.low_freq_factor, slowed, between)
    return torch.where(wavelength < L / s.high_freq_factor, inv_freq, out)


def yarn_correction_range(rot_dim: int, base: float, s: RopeScaling) -> tuple[float, float]:
    """YaRN's ramp bounds ``(low, high)`` in pair indices (module docstring): the dimensions where a
    pair turns ``beta_fast`` and ``beta_slow`` times over the original context, rounded outwards
    when ``s.truncate``, clamped to ``[0, rot - 1]``."""

    def dim_of(rotations: float) -> float:
        return rot_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rot_dim - 1)


def _yarn(rot_dim: int, base: float, s: RopeScaling, device) -> torch.Tensor:
    """YaRN's frequencies ``[rot/2]``: fast pairs kept, slow pairs divided by the factor, a linear
    ramp over the pair index between (the order of operations of transformers' initialiser, so the
    fp32 values are its own)."""
    pos_freqs = base ** (torch.arange(0, rot_dim, 2, device=device).to(torch.float32) / rot_dim)  # (rot/2,)
    kept, interpolated = 1.0 / pos_freqs, 1.0 / (s.yarn_factor * pos_freqs)
    low, high = yarn_correction_range(rot_dim, base, s)
    if low == high:
        high += 0.001  # a one-step ramp instead of a division by zero (transformers' choice)
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # (rot/2,) share of the original frequency
    return interpolated * (1 - keep) + kept * keep


def _scaled(cos: torch.Tensor, sin: torch.Tensor, scaling: Optional[RopeScaling]):
    """``cos`` and ``sin`` times the attention factor (fp32, before any cast), untouched without YaRN."""
    factor = 1.0 if scaling is None else scaling.cos_sin_factor
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


def rotary_cos_sin(
    seq_len: int,
    rot_dim: int,
    base: float,
    device=None,
    dtype: torch.dtype = torch.float32,
    scaling: Optional[RopeScaling] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of every (position, rotated dimension): two ``[T, rot]`` tensors.

    Angles are computed in fp32 (``rot`` even, ``>= 2``) from ``inv_frequencies``; cos and sin are
    multiplied by YaRN's attention factor (``RopeScaling.cos_sin_factor``) in fp32 and cast to ``dtype``.
    """
    inv_freq = inv_frequencies(rot_dim, base, scaling, device)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (T, rot)
    cos, sin = _scaled(angles.cos(), angles.sin(), scaling)
    return cos.to(dtype), sin.to(dtype)


def rotary_cos_sin_at(
    positions: torch.Tensor,
    rot_dim: int,
    base: float,
    dtype: torch.dtype = torch.float32,
    scaling: Optional[RopeScaling] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` at given positions ``[B, T]`` (int): two ``[B, 1, T, rot]`` tensors that
    broadcast over heads in ``apply_rotary``; the angles and factor are those of ``rotary_cos_sin``."""
    inv_freq = inv_frequencies(rot_dim, base, scaling, positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (B, T, rot/2)
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # (B, 1, T, rot)
    cos, sin = _scaled(angles.cos(), angles.sin(), scaling)
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, T, head_dim]`` by ``cos``/``sin [T, rot]`` (or ``[B, 1, T, rot]``);
    same shape back."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)  # (B, n, T, rot/2) each
    rotated = torch.cat([-x2, x1], dim=-1)  # "rotate half"
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


class RotaryTable:
    """``cos`` and ``sin`` of positions ``0 .. length-1`` made once (``rotary_cos_sin``, fp32) and
    read by every layer of a stage in every forward, instead of each layer rebuilding them.

    ``length`` covers every position the model sees (``max_position_embeddings``); the rows of
    a prefix or of given positions equal ``rotary_cos_sin`` / ``rotary_cos_sin_at`` bit for bit
    in every dtype (each angle is one product ``t * inv_freq[j]`` whatever the length, and a
    dtype's table is the fp32 one cast once, as those functions cast; tests/layouts/test_model_build.py).
    Tables: two ``[length, rot]`` fp32 tensors on ``device``, plus one cast pair per other dtype.
    """

    def __init__(self, length: int, rot_dim: int, base: float, device=None, scaling: Optional[RopeScaling] = None):
        self.cos, self.sin = rotary_cos_sin(length, rot_dim, base, device=device, scaling=scaling)
        self._cast = {torch.float32: (self.cos, self.sin)}

    @classmethod
    def for_model(cls, cfg, device=None) -> "RotaryTable":
        """The table of a ``model.config.GPTConfig`` with rotary positions (and its ``RopeScaling``)."""
        length = max(cfg.max_position_embeddings, cfg.seq_length)
        return cls(length, cfg.rotary_dim, cfg.rotary_base, device=device, scaling=RopeScaling.of(cfg))

    def _tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._cast[dtype]

    def first(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``0 .. seq_len-1``: two ``[T, rot]`` views. Raises ValueError past the table."""
        if seq_len > self.cos.shape[0]:
            raise ValueError(f"{seq_len} positions exceed the rotary table's {self.cos.shape[0]}")
        cos, sin = self._tables(dtype)
        return cos[:seq_len], sin[:seq_len]

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Given positions ``[B, T]`` (int, below the table's length): two ``[B, 1, T, rot]``
        tensors that broadcast over heads (``rotary_cos_sin_at``'s values)."""
        cos, sin = self._tables(dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (B, 1, T, rot)
