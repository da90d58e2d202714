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
the two, ``(1 - s) f_j / factor + s f_j`` with ``s = (L / w_j - low) / (high - low)``. Every
attention path reads one table (training, context parallel, the KV-cache decoding of
model/sampling.py), so all see the same scaled angles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (module docstring): ``llama3_factor`` None = no Llama 3.1 rewrite,
    ``linear_factor`` None = positions undivided; both may be set (the rewrite, then the division,
    as Megatron-LM's RotaryEmbedding applies its two options). ``original_max_positions`` is the
    pretraining context ``L`` (tokens) of the rewrite."""

    llama3_factor: Optional[float] = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    linear_factor: Optional[float] = None

    @classmethod
    def of(cls, cfg) -> Optional["RopeScaling"]:
        """The scaling of a ``model.config.GPTConfig``; None when it has none (unscaled RoPE)."""
        if not cfg.use_rope_scaling and cfg.rotary_seq_len_interpolation_factor is None:
            return None
        return cls(
            llama3_factor=cfg.rope_scaling_factor if cfg.use_rope_scaling else None,
            low_freq_factor=cfg.rope_scaling_low_freq_factor,
            high_freq_factor=cfg.rope_scaling_high_freq_factor,
            original_max_positions=cfg.rope_scaling_original_max_position_embeddings,
            linear_factor=cfg.rotary_seq_len_interpolation_factor,
        )


def inv_frequencies(rot_dim: int, base: float, scaling: Optional[RopeScaling] = None, device=None) -> torch.Tensor:
    """Frequencies ``f_j = base^(-2j / rot)`` of the ``rot/2`` pairs (radians per position, fp32
    ``[rot/2]``), rewritten by ``scaling`` (module docstring) when given."""
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


def rotary_cos_sin(
    seq_len: int,
    rot_dim: int,
    base: float,
    device=None,
    dtype: torch.dtype = torch.float32,
    scaling: Optional[RopeScaling] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of every (position, rotated dimension): two ``[T, rot]`` tensors.

    Angles are computed in fp32 (``rot`` even, ``>= 2``) from ``inv_frequencies`` and cast to ``dtype``.
    """
    inv_freq = inv_frequencies(rot_dim, base, scaling, device)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (T, rot)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_cos_sin_at(
    positions: torch.Tensor,
    rot_dim: int,
    base: float,
    dtype: torch.dtype = torch.float32,
    scaling: Optional[RopeScaling] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` at given positions ``[B, T]`` (int): two ``[B, 1, T, rot]`` tensors that
    broadcast over heads in ``apply_rotary``; the angles are those of ``rotary_cos_sin``."""
    inv_freq = inv_frequencies(rot_dim, base, scaling, positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (B, T, rot/2)
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # (B, 1, T, rot)
    return angles.cos().to(dtype), angles.sin().to(dtype)


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
