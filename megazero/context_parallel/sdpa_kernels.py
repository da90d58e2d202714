"""Which kernel ``F.scaled_dot_product_attention`` runs on CUDA for a call, and the call megazero makes.

A pure oracle of PyTorch's runtime dispatch (``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, with the shared checks of
``aten/src/ATen/native/transformers/sdp_utils_cpp.h``), written from the rules there for a
dense, non-nested call on an NVIDIA sm80 (A100) or sm90 (H100/H200) GPU, torch 2.13:

1. Order. ``priority_order`` puts cuDNN first when ``check_prefer_cudnn_attention`` holds
   (runtime cuDNN newer than 9.15.0, compute capability 9.x or 10.x, with CUDA 12 wheels
   minor 0 or 3, and ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` unset): cudnn, flash, efficient,
   math. Otherwise the context's default order, flash, efficient, math, cudnn: cuDNN is then
   never reached, as math accepts everything.
2. Flash (``can_use_flash_attention``): no ``attn_mask`` tensor (``check_for_attn_mask``);
   q, k, v the same head dim, at most 256 (``check_head_dim_size_flash``); fp16 or bf16
   (``check_dtypes_flash_attention``); ``is_causal`` only with as many queries as keys;
   fewer key/value heads than query heads only with ``enable_gqa`` and q heads a multiple
   of them (``check_batch_size_and_num_heads_dense<supports_gqa=true>``); dropout allowed.
3. Efficient (``can_use_mem_efficient_attention``): fp16, bf16 or fp32; head dims of q and
   k equal and q's and v's a multiple of ``minimum_gemm_alignment`` (8 for 16-bit, 4 for
   fp32 on sm80+), the same alignment in bytes for the storage offsets of q, k and v
   (``check_data_ptr_alignment_mem_efficient``); any mask (a boolean one is turned into an
   additive one of q's dtype, and a last dim not a multiple of 16 is padded, per call); dropout
   allowed; key/value heads different from query heads refused in torch 2.13 whatever
   ``enable_gqa`` says (``supports_gqa = false``; the 2.13 wheel's meta kernel of the efficient
   backward still returns K/V gradients with the query's heads). Upstream has since added
   GQA to this kernel: ``CudaPlatform.efficient_gqa`` models a torch that has it.
4. cuDNN (``can_use_cudnn_attention``): fp16 or bf16 only; an ``attn_mask`` of shape
   ``[Tq|1, Tk|1]`` or ``[B|1, h|1, Tq|1, Tk|1]`` (``check_attn_mask_shape``); dropout a
   multiple of 1/16 and not with cuDNN 9.11-9.13; refused under deterministic algorithms;
   key/value heads a divisor of query heads with or without ``enable_gqa``; head dims a
   multiple of 8 and at most 128 (256 on sm90/sm10x with cuDNN newer than 9.22 and a cuDNN
   frontend of at least 1.24; ``check_cudnn_tensor_shapes``); with gradients at the 256
   limit, head dims at most 128, or 192/128, or 256/256 (``check_cudnn_d256_bprop_head_dim``);
   more than one key.
5. Math: everything else; it materialises the ``[B, h, Tq, Tk]`` scores (fp32 for 16-bit
   inputs) and keeps the probabilities for the backward.

``megazero_call`` then gives the call megazero makes (``attention.local_attention`` and
``model/gpt.py``'s core): ``enable_gqa`` where a fused kernel takes it, else K/V expanded
(``repeat_interleave`` over the group) before SDPA when that lets a fused kernel run; packed
documents as one additive mask ``[B, 1, T, T]`` of q's dtype, built once per micro-batch and
shared by its layers. ``attention_table`` lists every configuration the config accepts with its
kernel (docs/long-sequences.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch

HALF = (torch.float16, torch.bfloat16)
KERNELS = ("cudnn", "flash", "efficient", "math")


@dataclass(frozen=True)
class CudaPlatform:
    """The GPU and libraries the dispatch reads (``sdp_utils.cpp``)."""

    sm: tuple[int, int] = (9, 0)
    """Compute capability (major, minor)."""
    cudnn_version: int = 91501
    """Runtime cuDNN as ``torch.backends.cudnn.version()`` (9.15.1 = 91501)."""
    cuda_major: int = 12
    """Major CUDA version torch was built with."""
    cudnn_frontend_d256: bool = False
    """Whether torch was built with a cuDNN frontend of at least 1.24 (head dims up to 256)."""
    efficient_gqa: bool = False
    """Whether the memory-efficient kernel takes ``enable_gqa`` (not in torch 2.13)."""
    deterministic: bool = False
    """``torch.use_deterministic_algorithms(True)`` (without warn-only): cuDNN refused."""

    def prefers_cudnn(self) -> bool:
        """``check_prefer_cudnn_attention``: cuDNN first in the order (rule 1)."""
        major, minor = self.sm
        arch = major in (9, 10) and (self.cuda_major >= 13 or minor in (0, 3))
        return self.cudnn_version > 91500 and arch

    def cudnn_head_dim_limit(self, d_qk: int, d_v: int) -> int:
        """cuDNN's largest head dim (``check_cudnn_tensor_shapes``): 256 on sm90/sm10x with cuDNN
        newer than 9.22 and the d256 frontend, 192 there for (192, 128) from cuDNN 9.11, else 128."""
        sm90_or_10x = self.sm == (9, 0) or self.sm[0] == 10
        if sm90_or_10x and self.cudnn_version > 92200 and self.cudnn_frontend_d256:
            return 256
        if sm90_or_10x and self.cudnn_version >= 91100 and (d_qk, d_v) == (192, 128):
            return 192
        return 128

    @staticmethod
    def current(device: torch.device) -> "CudaPlatform":
        """The platform of CUDA ``device`` (capability, runtime cuDNN, CUDA build)."""
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 0
        return CudaPlatform(
            sm=torch.cuda.get_device_capability(device),
            cudnn_version=cudnn or 0,
            cuda_major=int((torch.version.cuda or "12").split(".")[0]),
            deterministic=torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled(),
        )


SM80 = CudaPlatform(sm=(8, 0))
SM90 = CudaPlatform(sm=(9, 0))


@dataclass(frozen=True)
class SdpaCall:
    """One ``F.scaled_dot_product_attention`` call as the dispatch sees it.

    ``mask``: ``"causal"`` (``is_causal=True``, no ``attn_mask``), ``"none"``, ``"bool"`` or
    ``"additive"`` (an ``attn_mask`` tensor of shape ``mask_dims``, e.g. ``(1|B, 1, T, T)`` as
    ``(1, 1)`` for its two leading sizes against ``(B, h)``: ``mask_broadcast_ok``).
    ``offsets``: storage offsets of q, k, v in elements (views of a fused QKV output have
    nonzero ones). ``head_dim`` is q's, k's and v's last size.
    """

    dtype: torch.dtype
    q_heads: int
    kv_heads: int
    head_dim: int
    enable_gqa: bool = False
    mask: str = "causal"
    mask_broadcast_ok: bool = True
    dropout: float = 0.0
    offsets: tuple[int, int, int] = (0, 0, 0)
    last_dim_contiguous: bool = True
    requires_grad: bool = True
    seq_q: int = 2048
    seq_k: int = 2048


def _gemm_alignment(dtype: torch.dtype, plat: CudaPlatform) -> int:
    """``minimum_gemm_alignment``: elements, 4 on sm80+, 8 for 16-bit with tensor cores."""
    half = dtype in HALF
    tc = plat.sm[0] >= 8 or (plat.sm[0] >= 7 and half)
    align = 4 if plat.sm[0] >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if tc else align


def _heads_ok(c: SdpaCall, supports_gqa: bool, needs_flag: bool = True) -> Optional[str]:
    if c.q_heads == c.kv_heads:
        return None
    if supports_gqa and (c.enable_gqa or not needs_flag) and c.q_heads % c.kv_heads == 0:
        return None
    return "fewer key/value heads than query heads" + ("" if supports_gqa else " (no GQA)")


def flash_refusal(c: SdpaCall, plat: CudaPlatform) -> Optional[str]:
    """Why flash refuses ``c`` (rule 2), or None when it takes it."""
    if c.mask in ("bool", "additive"):
        return "attn_mask tensor"
    if c.head_dim > 256:
        return "head dim > 256"
    if not (8, 0) <= plat.sm <= (12, 1):
        return "architecture"
    if c.mask == "causal" and c.seq_q != c.seq_k:
        return "causal with Tq != Tk"
    if c.dtype not in HALF:
        return f"dtype {str(c.dtype).removeprefix('torch.')}"
    if not c.last_dim_contiguous:
        return "last dim stride"
    return _heads_ok(c, supports_gqa=True)


def efficient_refusal(c: SdpaCall, plat: CudaPlatform) -> Optional[str]:
    """Why the memory-efficient kernel refuses ``c`` (rule 3), or None."""
    if not (5, 0) <= plat.sm <= (12, 1):
        return "architecture"
    align = _gemm_alignment(c.dtype, plat)
    if c.head_dim % align:
        return f"head dim not a multiple of {align}"
    if plat.sm[0] >= 8 and any(off % align for off in c.offsets):
        return f"storage offset not {align * c.dtype.itemsize}-byte aligned"
    if not c.last_dim_contiguous:
        return "last dim stride"
    refused = _heads_ok(c, supports_gqa=plat.efficient_gqa)
    if refused:
        return refused
    if c.dtype not in HALF + (torch.float32,):
        return f"dtype {c.dtype}"
    return None


def cudnn_refusal(c: SdpaCall, plat: CudaPlatform) -> Optional[str]:
    """Why cuDNN refuses ``c`` (rule 4), or None."""
    if c.dropout > 0 and 91100 < plat.cudnn_version < 91400:
        return "dropout with cuDNN 9.11-9.13"
    if plat.deterministic:
        return "deterministic algorithms"
    if c.dtype not in HALF:
        return f"dtype {str(c.dtype).removeprefix('torch.')}"
    if c.mask in ("bool", "additive") and not c.mask_broadcast_ok:
        return "attn_mask shape"
    if not (8, 0) <= plat.sm <= (12, 1):
        return "architecture"
    if c.dropout * 16 != int(c.dropout * 16):
        return "dropout not a multiple of 1/16"
    if not c.last_dim_contiguous:
        return "last dim stride"
    refused = _heads_ok(c, supports_gqa=True, needs_flag=False)
    if refused:
        return refused
    limit = plat.cudnn_head_dim_limit(c.head_dim, c.head_dim)
    if c.head_dim > limit:
        return f"head dim > {limit}"
    if c.head_dim % 8:
        return "head dim not a multiple of 8"
    if c.seq_k == 1:
        return "one key"
    if c.requires_grad and limit == 256 and not (c.head_dim <= 128 or c.head_dim == 256):
        return "backward head dim"
    return None


def refusals(c: SdpaCall, plat: CudaPlatform) -> dict:
    """``{kernel: reason or None}`` for cudnn, flash and efficient."""
    return {"cudnn": cudnn_refusal(c, plat), "flash": flash_refusal(c, plat), "efficient": efficient_refusal(c, plat)}


def select_kernel(c: SdpaCall, plat: CudaPlatform) -> str:
    """The kernel SDPA on CUDA runs for ``c``: ``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``
    (``select_sdp_backend``: the first of the priority order whose checks pass)."""
    order = KERNELS if plat.prefers_cudnn() else ("flash", "efficient", "math")
    why = refusals(c, plat)
    return next(k for k in order if k == "math" or why[k] is None)


class MegazeroCall(NamedTuple):
    """What megazero passes to SDPA for one attention configuration, and the kernel it gets."""

    call: SdpaCall
    expand_kv: bool
    """K/V repeated over the group (``repeat_interleave``) before the call, no ``enable_gqa``."""
    kernel: str


def megazero_call(
    dtype: torch.dtype,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    documents: bool,
    dropout: float = 0.0,
    offsets: tuple[int, int, int] = (0, 0, 0),
    plat: CudaPlatform = SM90,
) -> MegazeroCall:
    """The SDPA call megazero makes on CUDA for this rank's attention core.

    ``q_heads``/``kv_heads``: this rank's heads (after tp, and cp under a2a); ``documents``:
    packed documents (an additive ``[B, 1, T, T]`` mask of ``dtype``, else ``is_causal``);
    ``offsets``: storage offsets (elements) of q, k, v as they reach SDPA. Under grouped-query
    attention ``enable_gqa`` is kept when some fused kernel takes it; otherwise K/V are
    expanded (contiguous copies, offsets 0) if that lets a fused kernel run. Returns the call,
    whether K/V are expanded, and the kernel (``select_kernel``): ``"math"`` only when no
    form of the call reaches a fused kernel.
    """
    mask = "additive" if documents else "causal"
    call = SdpaCall(dtype, q_heads, kv_heads, head_dim, kv_heads != q_heads, mask, dropout=dropout, offsets=offsets)
    kernel = select_kernel(call, plat)
    if kernel != "math" or kv_heads == q_heads:
        return MegazeroCall(call, False, kernel)
    expanded = replace(call, kv_heads=q_heads, enable_gqa=False, offsets=(offsets[0], 0, 0))
    kernel_expanded = select_kernel(expanded, plat)
    if kernel_expanded == "math":
        return MegazeroCall(call, False, kernel)
    return MegazeroCall(expanded, True, kernel_expanded)


def expand_kv_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, documents: bool, dropout: float = 0.0) -> bool:
    """Whether megazero expands K/V before SDPA for q ``[B, h, T, d]``, k and v ``[B, G, T, d]``:
    on CUDA per ``megazero_call`` (the device's platform); on CPU never (PyTorch's CPU kernels
    take ``enable_gqa`` themselves, masked or not, so the CPU call is the one it always was)."""
    if q.device.type != "cuda" or k.shape[1] == q.shape[1]:
        return False
    offsets = (q.storage_offset(), k.storage_offset(), v.storage_offset())
    plat = CudaPlatform.current(q.device)
    return megazero_call(
        q.dtype, q.shape[1], k.shape[1], q.shape[-1], documents=documents, dropout=dropout, offsets=offsets, plat=plat
    ).expand_kv


TABLE_HEAD_DIMS = (64, 128, 256, 320, 36)
"""Head dims of the table's columns: the usual two, flash's limit, beyond it, not a multiple of 8."""
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADS = {False: (8, 8), True: (8, 2)}  # this rank's (query, key/value) heads without and with GQA


class AttentionConfig(NamedTuple):
    """One attention configuration the config accepts (dropout only at cp 1 without documents)."""

    cp: str
    """``"none"`` (cp 1), ``"p2p"`` (ring) or ``"a2a"`` (all-to-all)."""
    dtype: torch.dtype
    gqa: bool
    documents: bool
    dropout: float


def accepted_configs() -> list[AttentionConfig]:
    """Every (cp type, dtype, GQA, packed documents, dropout) the config accepts: attention dropout
    is refused with cp > 1 and with packed documents (``config/checks.py``)."""
    out = []
    for cp in ("none", "p2p", "a2a"):
        for dtype in TABLE_DTYPES:
            for gqa in (False, True):
                for documents in (False, True):
                    drops = (0.0, 0.1) if cp == "none" and not documents else (0.0,)
                    out += [AttentionConfig(cp, dtype, gqa, documents, p) for p in drops]
    return out


def split_offsets(gqa: bool, q_heads: int, kv_heads: int, head_dim: int, rope: bool = False) -> tuple[int, int, int]:
    """Storage offsets (elements) of q, k, v as ``model/gpt.py``'s ``_split_heads`` gives them:
    views of the QKV output ``[q; k; v]`` (MHA) or per group ``[q of R heads; k; v]`` (GQA, q a
    copy); RoPE makes q and k new tensors."""
    if gqa:
        R = q_heads // kv_heads
        offsets = (0, R * head_dim, (R + 1) * head_dim)
    else:
        offsets = (0, q_heads * head_dim, 2 * q_heads * head_dim)
    return (0, 0, offsets[2]) if rope else offsets


def ring_block_kernel(dtype: torch.dtype, head_dim: int, plat: CudaPlatform) -> str:
    """The kernel of one ring block (``--cp-comm-type p2p``) on CUDA: ``"efficient"``
    (``_scaled_dot_product_efficient_attention`` called directly, ``fused_blocks``) when it takes
    ``dtype`` and ``head_dim`` on ``plat`` (rule 3, with K/V expanded to the query heads and an
    additive mask), else ``"einsum"`` (``blockwise``: fp32 einsums in row tiles of at most 16 MiB
    of scores). Flash is not used (its op takes no mask tensor and refuses float32), nor cuDNN
    (16-bit only; not tried here)."""
    call = SdpaCall(dtype, 1, 1, head_dim, mask="additive")
    return "efficient" if efficient_refusal(call, plat) is None else "einsum"


def config_kernel(c: AttentionConfig, head_dim: int, plat: CudaPlatform) -> tuple[str, bool]:
    """``(kernel, K/V expanded)`` of configuration ``c`` at ``head_dim`` on ``plat``. The ring calls
    its blocks' kernel itself (``ring_block_kernel``; K/V expanded over the group under GQA),
    shown as ``"efficient"`` or ``"einsum"``. The all-to-all's tensors are new (offsets 0)."""
    if c.cp == "p2p":
        kernel = ring_block_kernel(c.dtype, head_dim, plat)
        return kernel, kernel == "efficient" and c.gqa
    h, g = _HEADS[c.gqa]
    offsets = split_offsets(c.gqa, h, g, head_dim) if c.cp == "none" else (0, 0, 0)
    got = megazero_call(c.dtype, h, g, head_dim, documents=c.documents, dropout=c.dropout, offsets=offsets, plat=plat)
    return got.kernel, got.expand_kv


def _cell(c: AttentionConfig, d: int, plats) -> str:
    got = [config_kernel(c, d, p) for p in plats]
    names = [k + (" (x)" if expanded else "") for k, expanded in got]
    text = names[0] if len(set(names)) == 1 else " / ".join(names)
    return f"**{text}**" if any(k == "math" for k, _ in got) else text


def attention_table(plats: tuple = (SM90, SM80)) -> str:
    """The markdown table of every accepted configuration (``accepted_configs``) and its kernel
    per head dim (``TABLE_HEAD_DIMS``) on ``plats`` (cells "sm90 / sm80" where they differ, "(x)"
    K/V expanded, math in bold), as docs/long-sequences.md shows it."""
    dims = " | ".join(f"d={d}" for d in TABLE_HEAD_DIMS)
    rows = [f"| cp | dtype | GQA | documents | dropout | {dims} |", "|" + " --- |" * (5 + len(TABLE_HEAD_DIMS))]
    for c in accepted_configs():
        dtype = str(c.dtype).removeprefix("torch.")
        head = f"| {c.cp} | {dtype} | {'yes' if c.gqa else 'no'} | {'yes' if c.documents else 'no'} | {c.dropout:g} |"
        rows.append(head + "".join(f" {_cell(c, d, plats)} |" for d in TABLE_HEAD_DIMS))
    return "\n".join(rows) + "\n"
