"""FP8 linear layers with current scaling: quantise, dequantise, and ``y = x W^T`` in FP8.

Formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; Megatron-LM's
``--fp8-format``): ``e4m3`` quantises every GEMM operand to ``float8_e4m3fn`` (max 448, 3
mantissa bits); ``hybrid`` keeps e4m3 for the forward operands and uses ``float8_e5m2`` (max
57344, 2 mantissa bits) for the output gradient in both backward GEMMs.

Recipes (Megatron-LM's ``--fp8-recipe``). Every GEMM operand is viewed as ``[rows, K]`` with
``K`` its contraction dimension (the forward ``x [M, K]``, ``W [N, K]``; the data gradient
``dY [M, N]``, ``W^T [K, N]``; the weight gradient ``dY^T [N, M]``, ``X^T [K, M]``, M = tokens),
and its amax is taken per block of that view:

- ``tensorwise``: one block, the whole tensor;
- ``rowwise``: one block per row, i.e. along the contraction (torchao's rowwise recipe);
- ``blockwise``: DeepSeek-V3 (arXiv 2412.19437, sec. 3.3.2): ``1 x b`` tiles for activations
  and gradients, ``b x b`` blocks for weights (b = ``block``, 128 in the paper);
- ``mxfp8``: OCP Microscaling v1.0: ``1 x 32`` blocks along the contraction with a shared
  power-of-two scale stored as ``float8_e8m0fnu``, ``2^(floor(log2 amax) - emax)`` (emax = 8
  for e4m3, 15 for e5m2), the scaled values saturated to the format's max.

The other recipes scale by ``fp8_max / amax`` in fp32 (current scaling, TransformerEngine's
default; an all-zero block gets scale 1). A power-of-two scale changes no rounding of a normal
value, only which values fall below the format's normal range, so the exact ratio is used: it
makes a wrong scale visible. The GEMMs are emulated exactly (:func:`gemm`: FP8 products summed
in fp64 block by block, then scaled, then rounded once), equal bit for bit to a fake-quantised
reference (tests/unit/test_fp8.py). ``scaled_mm`` runs per-tensor and per-row scales through
``torch._scaled_mm``'s FP8 kernel (fp32 accumulation: within fp32 rounding of the emulation);
the layers do not call it yet.

Parallel layouts. A scale is a function of the *logical* (unsharded) tensor, so that every layout
quantises as one process does (the bugs of torchtitan #3109, amax of the local shard, and
Megatron-LM PR #442, amax over the wrong group). Under tensor parallelism an operand's
dimension is sharded (``sharded``: ``"N"`` for a column-parallel layer, ``"K"`` for a row-parallel
one); a tensorwise amax of an operand with a sharded dimension, and a rowwise amax along a
sharded contraction, is MAX all-reduced over the tp group (:func:`reduce_amax`). Block recipes
never communicate: the blocks are laid on the logical tensor and every shard must hold whole
blocks (``check_divisible``). Activations are quantised after the sequence-parallel all-gather,
so the logical activation is the micro-batch's; its tensorwise scale therefore depends on the
micro-batch, which layouts must keep (dp and pp do). Delayed scaling (amax history) is left out.
Exact sums: because :func:`gemm`'s result does not depend on where K is cut, a row-parallel
layer's partial sums are returned in ``ACCUMULATE`` and reduced in it (and a column-parallel
layer's input-gradient partial sums likewise, tensor_parallel/layers.py), so the value rounded
into the model dtype is one process's, and so is every later quantisation (docs/precision.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megazero import collectives as C
from megazero.collectives import Group

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
MX_BLOCK = 32
"""Elements per MX scale block (OCP Microscaling v1.0)."""
_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}


@dataclass(frozen=True)
class Fp8Settings:
    """What an FP8 linear layer quantises with (Megatron-LM's ``--fp8-format`` / ``--fp8-recipe``).

    ``format``: ``e4m3`` or ``hybrid`` (e5m2 gradients); ``recipe``: one of ``RECIPES``;
    ``block``: the blockwise recipe's tile width b in elements (activations ``1 x b``, weights
    ``b x b``). ``forward_dtype`` / ``grad_dtype``: the FP8 dtypes of the forward operands and of
    the output gradient.
    """

    format: str = "e4m3"
    recipe: str = "tensorwise"
    block: int = 128

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    @property
    def tile(self) -> Optional[int]:
        """Block width along the contraction, elements (None: the whole row / tensor)."""
        if self.recipe == "blockwise":
            return self.block
        return MX_BLOCK if self.recipe == "mxfp8" else None


def reduce_amax(amax: torch.Tensor, group: Group) -> torch.Tensor:
    """MAX all-reduce of ``amax`` over ``group`` (the tp group of a sharded operand); in place."""
    return C.all_reduce_max(amax, group)


def _blocks(rows: int, cols: int, s: Fp8Settings, weight: bool) -> tuple[int, int]:
    """(block rows, block cols) of a ``[rows, cols]`` operand (cols = its contraction)."""
    if s.recipe == "tensorwise":
        return rows, cols
    if s.recipe == "rowwise":
        return 1, cols
    b = s.tile
    return (b if weight and s.recipe == "blockwise" else 1), b


def check_divisible(name: str, shape: tuple, s: Fp8Settings, weight: bool) -> None:
    """Raise ValueError unless the (local) ``[rows, K]`` operand ``shape`` holds whole blocks."""
    br, bc = _blocks(shape[0], shape[1], s, weight)
    if shape[0] % br or shape[1] % bc:
        raise ValueError(
            f"--fp8-recipe {s.recipe}: {name} of local shape {tuple(shape)} does not divide into "
            f"{br} x {bc} blocks; fix: make the sizes per tensor-parallel rank (and the tokens per "
            f"micro-batch) multiples of the block (--fp8-block for blockwise, {MX_BLOCK} for mxfp8) "
            "or use --fp8-recipe tensorwise"
        )


def check_weight_blocks(name: str, shape: tuple, s: Fp8Settings) -> None:
    """Raise ValueError unless a weight shard ``[N_local, K_local]`` holds whole blocks both as the
    forward operand and, transposed, as the data gradient's."""
    check_divisible(name, shape, s, True)
    check_divisible(name + " (transposed)", tuple(shape[::-1]), s, True)


def quantize(
    t: torch.Tensor, dtype: torch.dtype, s: Fp8Settings, *, weight: bool = False, group: Group = None, sharded=()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise the 2-D operand ``t [rows, K]`` (K = contraction) to ``dtype`` per ``s.recipe``.

    Returns ``(q, scale)``: ``q = (t * scale).clamp(+-max).to(dtype)`` ``[rows, K]`` and the fp32
    scale per block ``[rows/br, K/bc]``: ``fp8_max / amax`` (current scaling; 1 for an all-zero
    block), or for mxfp8 ``1 / X`` with the block's e8m0 exponent ``X`` (a power of two), so that
    ``dequantize(q, scale) = q / scale`` is the operand as the GEMM sees it. ``sharded``: which
    of ``("rows", "K")`` are split over ``group``; their amax is reduced over it where the
    recipe's blocks span the split.
    Raises ValueError when the shape does not divide into the recipe's blocks.
    """
    rows, cols = t.shape
    check_divisible("operand", t.shape, s, weight)
    br, bc = _blocks(rows, cols, s, weight)
    x = t.detach().float()
    amax = x.abs().reshape(rows // br, br, cols // bc, bc).amax(dim=(1, 3))  # (rows/br, K/bc)
    if (s.recipe == "tensorwise" and len(sharded) > 0) or (s.recipe == "rowwise" and "K" in sharded):
        reduce_amax(amax, group)
    fmax = torch.finfo(dtype).max
    if s.recipe == "mxfp8":
        _, e = torch.frexp(amax)  # amax = m 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
        shared = torch.exp2((e - 1 - _EMAX[dtype]).float()).to(torch.float8_e8m0fnu)  # X, exact
        scale = torch.where(amax > 0, 1.0 / shared.float(), torch.ones_like(amax))
    else:
        scale = current_scale(amax, dtype)
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)  # (rows, K)
    q = (x * full).clamp(-fmax, fmax).to(dtype)
    return q, scale


def current_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Current scaling's fp32 multiplier per block: ``fp8_max(dtype) / amax``, 1 where ``amax`` is 0
    (an all-zero block); ``amax`` fp32, any shape. A true division, the exact ratio (module docstring)."""
    return torch.where(amax > 0, torch.full_like(amax, torch.finfo(dtype).max) / amax, torch.ones_like(amax))


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, K]`` of ``quantize``'s output: each block divided by its scale."""
    rows, cols = q.shape
    br, bc = rows // scale.shape[0], cols // scale.shape[1]
    return q.float() / scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)


ACCUMULATE = torch.float64
"""dtype of the emulated GEMMs' sums and of the tp partial sums of FP8 layers (see :func:`gemm`)."""


def _row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``1 / scale`` per row and contraction block, ``[rows, K/bc]`` in ``ACCUMULATE``."""
    return (1.0 / scale.to(ACCUMULATE)).repeat_interleave(rows // scale.shape[0], 0)


def gemm(a: tuple, b: tuple) -> torch.Tensor:
    """``A B^T [M, N]`` in ``ACCUMULATE`` (fp64) of quantised ``a = (q [M, K], scale)`` and
    ``b = (q [N, K], scale)``, block by block of the contraction: the FP8 products of a block
    summed (exact in fp64: an e4m3 x e4m3 product has 8 significant bits and lies between 2^-18
    and 2^17.6, so up to 2^17 of them add without rounding), then multiplied by the block's
    ``1 / scale`` of each operand, the blocks added. So the result is the exact product of the
    dequantised operands to fp64 rounding, and does not depend on how K is cut: the tp partial
    sums of a row-parallel layer (and of a column-parallel layer's data gradient) reduced in fp64
    round to the same fp32/bf16 value as one process's GEMM (``ColumnParallelLinear`` /
    ``RowParallelLinear``), which an fp32 accumulation does not promise (its last bit follows the
    summation order, and a last-bit change moves an FP8 quantisation across a rounding boundary
    now and then). Hardware FP8 GEMMs accumulate in fp32 or less; this emulation is the exact
    reference they approximate. Raises ValueError when the operands' K blocks differ."""
    (qa, sa), (qb, sb) = a, b
    rows, k = qa.shape
    if sa.shape[1] != sb.shape[1] or k != qb.shape[1]:
        raise ValueError(f"fp8 gemm: contraction blocks differ: {tuple(qa.shape)} / {sa.shape[1]} vs {tuple(qb.shape)}")
    nb = sa.shape[1]
    bc = k // nb
    ia, ib = _row_scales(sa, rows), _row_scales(sb, qb.shape[0])  # (M, nb), (N, nb)
    xa, xb = qa.to(ACCUMULATE), qb.to(ACCUMULATE)
    out = None
    for j in range(nb):  # contraction blocks: exact sums, then the scales
        part = xa[:, j * bc : (j + 1) * bc].mm(xb[:, j * bc : (j + 1) * bc].t())  # (M, N)
        part = part * ia[:, j : j + 1] * ib[:, j].unsqueeze(0)
        out = part if out is None else out + part
    return out


def scaled_mm(a: tuple, b: tuple) -> torch.Tensor:
    """``gemm`` by ``torch._scaled_mm`` (FP8 operands, fp32 accumulation and output) for one scale
    per tensor or per row of each operand (tensorwise, rowwise): ``A [M, K]``, ``B [N, K]`` ->
    ``[M, N]`` fp32, within fp32 accumulation rounding of ``gemm`` (tests/unit/test_fp8.py). Not
    used by the layers: the kernel a CUDA FP8 path would call."""
    (qa, sa), (qb, sb) = a, b
    ia = (1.0 / sa).reshape(()) if sa.numel() == 1 else (1.0 / sa).reshape(-1, 1)
    ib = (1.0 / sb).reshape(()) if sb.numel() == 1 else (1.0 / sb).reshape(1, -1)
    return torch._scaled_mm(qa, qb.t(), scale_a=ia, scale_b=ib, out_dtype=torch.float32)


SPLIT = {
    "N": dict(x=(), w=("rows",), g=("K",), wt=("K",), gt=("rows",), xt=()),
    "K": dict(x=("K",), w=("K",), g=(), wt=("rows",), gt=(), xt=("rows",)),
    "": dict(x=(), w=(), g=(), wt=(), gt=(), xt=()),
}
"""Which dimensions of each GEMM operand's ``[rows, K]`` view tp splits: column-parallel (``"N"``:
``W [N/tp, K]``, ``dY [M, N/tp]``) and row-parallel (``"K"``: ``x [M, K/tp]``, ``W [N, K/tp]``).
Operands: x, w (forward), g = dY, wt = W^T (data gradient), gt = dY^T, xt = X^T (weight gradient)."""


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x W^T (+ b)`` with both operands in FP8; backward ``dX = dY W``, ``dW = dY^T X`` with
    ``dY`` in the format's gradient dtype and ``W``, ``X`` re-quantised along each GEMM's
    contraction. ``x [..., K]``, ``weight [N, K]`` (the master weight: read, never modified),
    ``bias [N]`` -> ``[..., N]`` in ``x``'s dtype; the gradients come back in the inputs' dtypes.
    ``sharded``: ``"N"`` (column-parallel), ``"K"`` (row-parallel) or ``""`` (no tp split).
    ``weight_fp8``: the weight already quantised, ``(q [N, K] e4m3, scale [1, 1])`` (tensorwise:
    ZeRO-3's FP8 all-gather, ``megazero.data_parallel.zero3_fp8``): both GEMMs use it, ``q^T`` for
    the data gradient (a tensorwise scale is the transpose's too), instead of quantising ``weight``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, s: Fp8Settings, group, sharded: str, out_dtype, weight_fp8=None):
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        split = SPLIT[sharded]
        if weight_fp8 is not None and s.recipe != "tensorwise":
            raise ValueError(f"a pre-quantised FP8 weight needs --fp8-recipe tensorwise, got {s.recipe}")
        y = gemm(
            quantize(x2, s.forward_dtype, s, group=group, sharded=split["x"]),
            weight_fp8 or quantize(weight, s.forward_dtype, s, weight=True, group=group, sharded=split["w"]),
        ).to(out_dtype)  # (M, N), rounded once
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(x.to(out_dtype) if x.dtype == ACCUMULATE else x, weight)  # a widened x: saved narrow
        ctx.s, ctx.group, ctx.sharded, ctx.has_bias, ctx.x_dtype = s, group, sharded, bias is not None, x.dtype
        ctx.weight_fp8 = weight_fp8  # views of a storage ZeRO-3 frees and refills before the backward
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        s, group, sh = ctx.s, ctx.group, ctx.sharded
        g2 = grad.reshape(-1, grad.shape[-1])  # (M, N)
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        split = SPLIT[sh]
        tile = s.tile
        if tile and g2.shape[0] % tile:  # tokens in whole tiles: zero rows change no amax and add nothing
            pad = tile - g2.shape[0] % tile
            gt, xt = F.pad(g2, (0, 0, 0, pad)).t(), F.pad(x2, (0, 0, 0, pad)).t()  # (N, M+pad), (K, M+pad)
        else:
            gt, xt = g2.t(), x2.t()
        # data gradient: contraction over N
        wt = None if ctx.weight_fp8 is None else (ctx.weight_fp8[0].t(), ctx.weight_fp8[1])  # (K, N), same scale
        dx = gemm(
            quantize(g2, s.grad_dtype, s, group=group, sharded=split["g"]),
            wt or quantize(weight.t(), s.forward_dtype, s, weight=True, group=group, sharded=split["wt"]),
        )  # (M, K)
        # weight gradient: contraction over the M tokens
        dw = gemm(
            quantize(gt, s.grad_dtype, s, group=group, sharded=split["gt"]),
            quantize(xt, s.forward_dtype, s, group=group, sharded=split["xt"]),
        )  # (N, K)
        db = g2.to(ACCUMULATE).sum(0).to(weight.dtype) if ctx.has_bias else None  # fp64: one value for any N split
        return dx.to(ctx.x_dtype).view(x.shape), dw.to(weight.dtype), db, None, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    s: Fp8Settings,
    group: Group = None,
    sharded: str = "",
    out_dtype: Optional[torch.dtype] = None,
    weight_fp8: Optional[tuple] = None,
) -> torch.Tensor:
    """:class:`Fp8LinearFunction` applied: ``x [..., K]``, ``weight [N, K]`` -> ``[..., N]`` in
    ``out_dtype`` (default ``x``'s; ``ACCUMULATE`` for a row-parallel partial sum, reduced in it);
    ``weight_fp8``: the weight pre-quantised, tensorwise (raises ValueError for another recipe)."""
    return Fp8LinearFunction.apply(x, weight, bias, s, group, sharded, out_dtype or x.dtype, weight_fp8)


def relative_bound(dtype: torch.dtype) -> float:
    """Largest relative rounding error of a normal value cast to ``dtype``: half a unit in the
    last place, 2^-(mantissa bits + 1) (2^-4 for e4m3, 2^-3 for e5m2)."""
    return 2.0 ** -(1 + {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype])


def min_normal(dtype: torch.dtype) -> float:
    """Smallest normal magnitude of ``dtype`` (2^-6 for e4m3, 2^-14 for e5m2): below it the
    spacing is absolute, ``min_normal * relative_bound * 2``."""
    return math.ldexp(1.0, -6 if dtype == torch.float8_e4m3fn else -14)
