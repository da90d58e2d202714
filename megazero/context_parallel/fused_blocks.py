"""One ring block through PyTorch's fused attention kernels, with ``blockwise``'s contract.

``blockwise.block_attention`` materialises fp32 score tiles; on a GPU a fused kernel is far
faster and keeps O(T) statistics. Each block runs instead through an aten operator that also
returns the log-sum-exp the ring merges with (``blockwise.merge_partials``):

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (float64, float32, bfloat16, float16);
  lse ``[B, h, Tq]`` in float32 (float64 for float64 inputs).
- CUDA: ``_scaled_dot_product_efficient_attention`` (float32, bfloat16, float16; the head dim
  and storage offsets as ``sdpa_kernels.efficient_refusal`` requires); lse ``[B, h, ceil32(Tq)]``
  in float32, sliced to Tq. (Flash and cuDNN return no usable lse through SDPA's ops with a
  mask, and flash refuses float32.)

The backward of a block runs the operators' backward with the *final* ``out`` and ``lse`` of
the queries (over every key block), as FlashAttention-2 ring implementations do (Dao 2023,
sec. 3.1): the kernel recomputes ``P = exp(S - lse)`` and ``D = rowsum(dO * out)`` itself, so
the block's dq, dk, dv are exactly its terms of the full gradient.

Conventions shared with ``blockwise``: q ``[B, G, R, Tq, d]``, k ``[B, G, Tk, d]``, v
``[B, G, Tk, d_v]`` (``d_v`` may differ from ``d``: DeepSeek's MLA), mask bool ``[B or 1, Tq, Tk]``
(True = attend) or None. The kernels take no grouped-query layout through these operators, so K/V
are expanded over R (``[B, G*R, Tk, d]``, a copy) and dk, dv summed over R afterwards. The CPU
operator takes one head size for q, k and v, so when ``d_v != d`` the three are zero-padded to
``max(d, d_v)`` in that same copy: zero columns of q and k add nothing to a score (the scale is
explicit), zero columns of v give zero output columns, which are cut off, and the padded
columns' gradients are dropped. The mask becomes an additive bias of q's dtype (0 / -inf, one
``[B|1, 1, Tq, Tk]`` tensor per block, rows padded to 16 elements on CUDA); ``causal=True``
says the mask is exactly the top-left causal one (a diagonal block without documents) and
passes ``is_causal`` with no bias. A row with no visible key gets ``out = 0`` and
``lse = -inf`` here whatever the kernel wrote, and zero gradient in the backward (the final
lse of such a row is -inf; the kernel is given 0 there, so ``exp(-inf - 0) = 0``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megazero.context_parallel.blockwise import compute_dtype
from megazero.context_parallel.sdpa_kernels import CudaPlatform, ring_block_kernel

PATHS = ("einsum", "flash_cpu", "efficient")
"""Block paths: ``blockwise``'s einsums (the oracle), the CPU flash operator, CUDA's efficient one."""
CHOICES = ("auto", "einsum")
"""What a caller may ask for: the fused path where it exists (``auto``), or the einsums."""
_CPU_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)  # what the CPU kernel takes
_CPU_AUTO = (torch.float64, torch.float32)  # where "auto" takes it: 16-bit ran 3.7x slower (long-sequences.md)
_BIAS_ALIGN = 16  # elements: SDPA pads an efficient-attention bias row to this


def _op(name: str):
    return getattr(torch.ops.aten, name, None)


def block_path(q: torch.Tensor, choice: str = "auto", v_dim: Optional[int] = None) -> str:
    """The path the ring's blocks take for queries like ``q`` (``[..., d]``) and values of ``v_dim``
    dimensions (None: ``d``): one of ``PATHS``; a CUDA kernel is chosen for the padded width
    ``max(d, v_dim)`` (module docstring).

    ``choice`` ``"einsum"`` always gives ``"einsum"``; ``"auto"`` gives ``"flash_cpu"`` on CPU
    for float64 and float32 (16-bit blocks ran 3.7x slower there than the einsums), on CUDA
    ``sdpa_kernels.ring_block_kernel`` for this GPU (``"efficient"`` for float32, bfloat16 and
    float16 at a head dim the kernel takes), else ``"einsum"``. Raises ValueError for a choice not in ``CHOICES``.
    """
    if choice not in CHOICES:
        raise ValueError(f"ring block kernel {choice!r} is not one of {CHOICES}")
    if choice == "einsum":
        return "einsum"
    if q.device.type == "cpu" and q.dtype in _CPU_AUTO and _op("_scaled_dot_product_flash_attention_for_cpu"):
        return "flash_cpu"
    if q.device.type == "cuda" and _op("_scaled_dot_product_efficient_attention"):
        width = max(q.shape[-1], v_dim or 0)
        return ring_block_kernel(q.dtype, width, CudaPlatform.current(q.device))
    return "einsum"


def _width(t: torch.Tensor, w: int) -> torch.Tensor:
    """``t [..., d]`` zero-padded to ``[..., w]`` (itself when ``d == w``)."""
    return t if t.shape[-1] == w else F.pad(t, (0, w - t.shape[-1]))


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q ``[B, G, R, Tq, d]`` as ``[B, G*R, Tq, w]``; k and v (``[B, G, Tk, d]``, ``[B, G, Tk, d_v]``)
    expanded over R to ``[B, G*R, Tk, w]``, with ``w = max(d, d_v)`` (zero-padded, module docstring)."""
    B, G, R, Tq, _ = q.shape
    Tk, w = k.shape[2], max(q.shape[-1], v.shape[-1])
    qh = _width(q.reshape(B, G * R, Tq, -1), w).contiguous()
    kh, vh = (_width(t, w)[:, :, None].expand(B, G, R, Tk, w).reshape(B, G * R, Tk, w) for t in (k, v))  # copies
    return qh, kh, vh


def _bias(mask: Optional[torch.Tensor], dtype: torch.dtype, device_type: str) -> Optional[torch.Tensor]:
    """Additive ``[B|1, 1, Tq, Tk]`` bias of ``dtype`` (0 attend, -inf not); rows padded to 16 on CUDA."""
    if mask is None:
        return None
    n, Tq, Tk = mask.shape
    width = -(-Tk // _BIAS_ALIGN) * _BIAS_ALIGN if device_type == "cuda" else Tk
    bias = torch.zeros(n, 1, Tq, width, dtype=dtype, device=mask.device)  # (B|1, 1, Tq, Tk padded)
    bias[..., :Tk].masked_fill_(~mask[:, None], float("-inf"))
    return bias[..., :Tk]


def _dead_rows(mask: Optional[torch.Tensor], causal: bool) -> Optional[torch.Tensor]:
    """Bool ``[B|1, 1, 1, Tq]``: rows that see no key of the block, or None when there are none."""
    if mask is None or causal:
        return None
    return ~mask.any(-1)[:, None, None]


def _cuda_bias(bias: Optional[torch.Tensor], shape) -> Optional[torch.Tensor]:
    return None if bias is None else bias.expand(*shape)


def fused_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    *,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``blockwise.block_attention`` through the fused operator of q's device (``block_path``).

    q ``[B, G, R, Tq, d]``, k ``[B, G, Tk, d]`` and v ``[B, G, Tk, d_v]`` of q's dtype, mask bool
    ``[B or 1, Tq, Tk]`` or None, ``causal``: the mask is the top-left causal one (Tq == Tk; the
    mask is then not read). Returns ``out [B, G, R, Tq, d_v]`` and ``lse [B, G, R, Tq]`` in
    ``compute_dtype(q.dtype)``; a row with no visible key has out 0 and lse -inf. Raises
    RuntimeError where the device has no fused operator (``block_path`` says ``"einsum"``).
    """
    B, G, R, Tq, _ = q.shape
    dv = v.shape[-1]
    qh, kh, vh = _heads(q, k, v)  # (B, G*R, T, max(d, d_v))
    bias = None if causal else _bias(mask, q.dtype, q.device.type)
    if q.device.type == "cuda":
        op = torch.ops.aten._scaled_dot_product_efficient_attention
        bias = _cuda_bias(bias, (B, G * R, Tq, k.shape[2]))
        out, lse = op(qh, kh, vh, bias, True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., :Tq]  # the kernel pads its lse rows to a multiple of 32
    elif q.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = op(qh, kh, vh, 0.0, causal, attn_mask=bias, scale=scale)
    else:
        raise RuntimeError(f"fused ring blocks: no fused attention operator on {q.device.type}; use the einsum path")
    acc = compute_dtype(q.dtype)
    out = out[..., :dv].to(acc).reshape(B, G, R, Tq, dv)  # the padded columns are zero
    lse = lse.to(acc).reshape(B, G, R, Tq)
    dead = _dead_rows(mask, causal)
    if dead is not None:  # the kernels leave 0, NaN or a finite lse there
        out = out.masked_fill(dead[..., None], 0.0)
        lse = lse.masked_fill(dead, float("-inf"))
    return out, lse


def fused_block_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    *,
    causal: bool = False,
):
    """``blockwise.block_attention_backward`` through the fused operator's backward.

    q ``[B, G, R, Tq, d]``, do and ``out`` ``[B, G, R, Tq, d_v]`` (``out`` the *final* attention
    output of the queries, which the kernel turns into ``D = rowsum(dO * out)``), k ``[B, G, Tk,
    d]`` and v ``[B, G, Tk, d_v]``, ``lse``
    ``[B, G, R, Tq]`` the final log-sum-exp (-inf on rows that see no key at all), mask and
    ``causal`` as in ``fused_block_attention``. Returns ``(dq [B, G, R, Tq, d], dk [B, G, Tk, d],
    dv [B, G, Tk, d_v])`` in ``compute_dtype(q.dtype)``, dk and dv summed over the R heads of each
    group; zero on rows with lse -inf.
    """
    B, G, R, Tq, d = q.shape
    Tk, dt, acc, d_v = k.shape[2], q.dtype, compute_dtype(q.dtype), v.shape[-1]
    qh, kh, vh = _heads(q, k, v)  # (B, G*R, T, w), w = max(d, d_v)
    w = qh.shape[-1]
    doh = _width(do.to(dt).reshape(B, G * R, Tq, d_v), w).contiguous()  # zero columns: no gradient
    oh = _width(out.to(dt).reshape(B, G * R, Tq, d_v), w).contiguous()
    lse_ok = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # exp(-inf - 0) = 0, not NaN
    lse_k = lse_ok.to(torch.promote_types(dt, torch.float32)).reshape(B, G * R, Tq)
    bias = None if causal else _bias(mask, dt, q.device.type)
    if q.device.type == "cuda":
        bias = _cuda_bias(bias, (B, G * R, Tq, Tk))
        # out in the forward's memory layout [B, Tq, h, d]: torch's 16-bit efficient backward
        # misreads a [B, h, Tq, d]-contiguous out (dq, dk wrong by more than their size on an
        # H200, torch 2.11; float32 is unaffected)
        oh = oh.transpose(1, 2).contiguous().transpose(1, 2)
        padded = torch.zeros(B, G * R, -(-Tq // 32) * 32, dtype=torch.float32, device=q.device)
        padded[..., :Tq] = lse_k  # (B, G*R, Tq padded to 32), the layout the forward returned
        none = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: no philox state
        op = torch.ops.aten._scaled_dot_product_efficient_attention_backward
        dq, dk, dv = op(
            doh, qh, kh, vh, bias, oh, padded, none, none, 0.0, [True, True, True, False], causal, scale=scale
        )[:3]
    elif q.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq, dk, dv = op(doh, qh, kh, vh, oh, lse_k, 0.0, causal, attn_mask=bias, scale=scale)
    else:
        raise RuntimeError(f"fused ring blocks: no fused attention operator on {q.device.type}; use the einsum path")
    del qh, kh, vh, doh, oh, bias  # before the fp32 copies: fewer block-sized tensors alive at once
    dq = dq[..., :d].to(acc).reshape(B, G, R, Tq, d)
    dk, dv = (t[..., :n].reshape(B, G, R, Tk, n).sum(2, dtype=acc) for t, n in ((dk, d), (dv, d_v)))  # (B, G, Tk, .)
    dead = torch.isneginf(lse)[..., None]
    return dq.masked_fill(dead, 0.0), dk, dv
