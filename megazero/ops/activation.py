"""The gated linear unit of the MLP: ``fc1`` gives ``[gate; up]`` and the MLP's inner activation is
``act(gate) * up`` (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5-6), in the variants
Megatron-LM names by flag:

- ``--swiglu``: ``act = silu`` (``x * sigmoid(x)``, SwiGLU);
- ``--quick-geglu``: ``act = quick_gelu``, ``x * sigmoid(1.702 x)`` (the sigmoid approximation of
  GELU, Hendrycks & Gimpel 2016, section 2; Megatron-LM's ``quick_gelu`` with the constant 1.702);
- ``--glu-linear-offset F``: ``act(gate) * (up + F)`` (Megatron-LM's ``glu_linear_offset``);
- ``--activation-func-clamp-value L``: before the activation, ``gate`` clamped to at most ``L`` and
  ``up`` to ``[-L, L]`` (Megatron-LM's ``activation_func_clamp_value``, its unfused GLU path).

OpenAI's gpt-oss MLP is ``--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0``:
transformers' ``GptOssExperts._apply_gate`` computes ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``
with ``g = clamp(gate, max=7)`` on gate and up interleaved in ``gate_up_proj``'s columns
(``[..., ::2]`` and ``[..., 1::2]``); megazero holds the halves apart (``[gate; up]``), and on the
same halves the two agree to the last bit in fp32 (tests/unit/test_glu.py).

The model's dense MLP (model/gpt.py), its experts (model/moe.py, the loop and the grouped GEMMs)
and the test oracle (tests/support/reference.py) all call :func:`glu`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

QUICK_GELU_ALPHA = 1.702
"""The slope of quick GELU's sigmoid (Hendrycks & Gimpel 2016; Megatron-LM's and gpt-oss's 1.702)."""


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)``, elementwise, any shape and floating dtype (Megatron-LM's
    ``megatron.core.fusions``/``activations`` ``quick_gelu``)."""
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


def glu(
    h: torch.Tensor, quick_geglu: bool = False, linear_offset: float = 0.0, clamp_value: Optional[float] = None
) -> torch.Tensor:
    """The gated unit of ``h [..., 2F]`` (its first half the gate, its second the up projection)
    -> ``[..., F]``: ``act(gate') * (up' + linear_offset)`` with ``act`` silu, or quick GELU with
    ``quick_geglu``, and ``gate' = min(gate, L)``, ``up' = clamp(up, -L, L)`` when ``clamp_value``
    ``L`` is given (else the halves as they are). With every option off this is exactly
    ``F.silu(gate) * up``, the op sequence of SwiGLU (no ``+ 0.0``, no clamp).

    Raises ValueError for a ``clamp_value`` that is not > 0 or an odd last dimension."""
    if h.shape[-1] % 2:
        raise ValueError(f"the gated unit wants [gate; up], an even last dimension, not {h.shape[-1]}")
    if clamp_value is not None and not clamp_value > 0:
        raise ValueError(f"--activation-func-clamp-value {clamp_value} must be > 0")
    gate, up = h.chunk(2, dim=-1)  # (..., F) each
    if clamp_value is not None:
        gate = gate.clamp(max=clamp_value)
        up = up.clamp(min=-clamp_value, max=clamp_value)
    act = quick_gelu(gate) if quick_geglu else F.silu(gate)
    if linear_offset:
        up = up + linear_offset
    return act * up
