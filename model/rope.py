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


def rotary_cos_sin(seq_len: int, rot_dim: int, base: float, device=None,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of every (position, rotated dimension): two ``[T, rot]`` tensors.

    Angles are computed in fp32 (``rot`` even, ``>= 2``) and cast to ``dtype``.
    """
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)                      # (T, rot)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_cos_sin_at(positions: torch.Tensor, rot_dim: int, base: float,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` at given positions ``[B, T]`` (int): two ``[B, 1, T, rot]`` tensors that
    broadcast over heads in ``apply_rotary``; the angles are those of ``rotary_cos_sin``."""
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float32, device=positions.device) / rot_dim)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq                # (B, T, rot/2)
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)                     # (B, 1, T, rot)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, T, head_dim]`` by ``cos``/``sin [T, rot]`` (or ``[B, 1, T, rot]``);
    same shape back."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)                                   # (B, n, T, rot/2) each
    rotated = torch.cat([-x2, x1], dim=-1)                            # "rotate half"
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
