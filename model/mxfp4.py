"""MXFP4 dequantization of a gpt-oss folder's expert weights (OCP Microscaling Formats (MX)
Specification v1.0, section 5, its concrete formats: MXFP4 is blocks of k = 32 FP4 E2M1 elements
sharing one E8M0 scale).

A gpt-oss checkpoint stores each expert projection as two tensors:

- ``*_blocks`` ``[..., R, G, 16]`` uint8: row r's ``G * 32`` values in ``G`` blocks of 32, two
  FP4 E2M1 codes per byte, the low nibble first (element ``2j`` is ``byte_j & 0xF``, element
  ``2j + 1`` is ``byte_j >> 4``);
- ``*_scales`` ``[..., R, G]`` uint8: each block's E8M0 exponent, bias 127, so the block's
  scale is ``2 ** (scale - 127)``.

An E2M1 code is ``s e1 e0 m``: sign, a 2-bit exponent (bias 1) and one mantissa bit, the values
``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives (``E2M1_VALUES``; code 8 is -0). Every
dequantized value ``value(code) * 2 ** (scale - 127)`` is exact in fp32 (a 2-bit significand
times a power of two between 2**-127 and 2**127, subnormals included); scale 255 is the spec's
NaN.

:func:`dequantize_mxfp4` returns ``[..., R, G * 32]``: the rows as stored, which for
``gate_up_proj`` is the ``[2F, H]`` (``[out, in]``) weight of ``F.linear`` with gate and up rows
interleaved, for ``down_proj`` ``[H, F]``. transformers' ``convert_moe_packed_tensors``
(``transformers/integrations/mxfp4.py``) returns the transpose of the last two dimensions
(``[E, in, out]``, gpt-oss's ``x @ W`` layout): ``transpose=True`` gives that tensor, equal to
its fp32 result element for element (tests/unit/test_glu.py). This module imports no
transformers.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The FP4 E2M1 value of each 4-bit code 0..15 (the MX v1.0 spec's FP4 element; bit 3 the sign)."""

SCALE_BIAS = 127
"""The E8M0 scale's exponent bias (MX v1.0 spec)."""

SCALE_NAN = 255
"""The E8M0 code that means NaN (MX v1.0 spec)."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """The fp32 values of MXFP4 ``blocks [..., R, G, B]`` (uint8, 2 E2M1 codes a byte, low nibble
    first; gpt-oss: B = 16, 32 values a block) scaled by ``scales [..., R, G]`` (uint8 E8M0,
    ``2 ** (scale - 127)``): ``[..., R, G * 2B]`` fp32 on ``blocks``' device, or with ``transpose``
    ``[..., G * 2B, R]`` (contiguous; transformers' ``convert_moe_packed_tensors`` layout). A block
    whose scale is 255 is NaN (the spec's; transformers multiplies by 2**128 = inf instead).

    Raises ValueError when either tensor is not uint8, when ``scales`` is not ``blocks``' shape
    without its last dimension, or when ``transpose`` is asked of a tensor under 2 row dimensions.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 scales {tuple(scales.shape)} must be the blocks' shape {tuple(blocks.shape)} without its last dim"
        )
    if transpose and blocks.dim() < 3:
        raise ValueError(f"transpose needs blocks [..., R, G, B], not {tuple(blocks.shape)}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]  # (..., R, G, B) each
    values = torch.stack((low, high), dim=-1).flatten(-2)  # (..., R, G, 2B): low nibble first
    exponent = scales.to(torch.int32).unsqueeze(-1) - SCALE_BIAS  # (..., R, G, 1)
    values = torch.ldexp(values, exponent)  # value * 2**exponent, exact in fp32
    values = values.masked_fill(scales.unsqueeze(-1) == SCALE_NAN, float("nan"))
    out = values.flatten(-2)  # (..., R, G * 2B)
    return out.transpose(-2, -1).contiguous() if transpose else out
