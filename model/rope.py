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
"""

from __future__ import annotations

import torch


def rotary_cos_sin(
    seq_len: int, rot_dim: int, base: float, device=None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of every (position, rotated dimension): two ``[T, rot]`` tensors.

    Angles are computed in fp32 (``rot`` even, ``>= 2``) and cast to ``dtype``.
    """
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (T, rot)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_cos_sin_at(
    positions: torch.Tensor, rot_dim: int, base: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` at given positions ``[B, T]`` (int): two ``[B, 1, T, rot]`` tensors that
    broadcast over heads in ``apply_rotary``; the angles are those of ``rotary_cos_sin``."""
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float32, device=positions.device) / rot_dim)
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

    def __init__(self, length: int, rot_dim: int, base: float, device=None):
        self.cos, self.sin = rotary_cos_sin(length, rot_dim, base, device=device)
        self._cast = {torch.float32: (self.cos, self.sin)}

    @classmethod
    def for_model(cls, cfg, device=None) -> "RotaryTable":
        """The table of a ``model.config.GPTConfig`` with rotary positions."""
        return cls(max(cfg.max_position_embeddings, cfg.seq_length), cfg.rotary_dim, cfg.rotary_base, device=device)

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
