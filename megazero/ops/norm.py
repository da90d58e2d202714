"""LayerNorm and RMSNorm over the last (hidden) dimension, with a choice of kernels.

LayerNorm (Ba et al. 2016, "Layer Normalization", eq. 4)::

    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias      (biased variance, last dim)

RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4)::

    y = x / sqrt(mean(x^2) + eps) * weight

Backends (see :mod:`megazero.ops.backend`), each called with the same arguments:

- ``"apex"``: ``apex.normalization.fused_layer_norm.fused_layer_norm_affine`` /
  ``fused_rms_norm_affine`` (fused CUDA kernels, fp32 statistics for half inputs).
- ``"torch"``: ``torch.nn.functional.layer_norm`` / ``torch.nn.functional.rms_norm``; torch
  accumulates the statistics of fp16/bf16 inputs in fp32 (its ``acc_type``).
- ``"reference"``: the formulas above written out, the input upcast to fp32 first.

Every backend computes in fp32 for half inputs and returns the input's dtype. The parameters
are cast to the input's dtype for the fused kernels (autograd casts their gradients back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.ops.backend import BACKENDS, select_backend


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm written out in fp32. ``x`` [..., H], ``weight``/``bias`` [H] -> [..., H] in x.dtype."""
    xf = x.float()
    mean = xf.mean(dim=-1, keepdim=True)  # [..., 1]
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)  # [..., 1], biased
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.float() + bias.float()
    return y.to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm written out in fp32. ``x`` [..., H], ``weight`` [H] -> [..., H] in x.dtype."""
    xf = x.float()
    mean_sq = xf.pow(2).mean(dim=-1, keepdim=True)  # [..., 1]
    return (xf * torch.rsqrt(mean_sq + eps) * weight.float()).to(x.dtype)


def layer_norm_backend(x, weight, bias, eps, backend):
    h = (x.shape[-1],)
    if backend == "reference":
        return layer_norm_reference(x, weight, bias, eps)
    w, b = weight.to(x.dtype), bias.to(x.dtype)
    if backend == "apex":
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine

        return fused_layer_norm_affine(x.contiguous(), w, b, h, eps)
    return F.layer_norm(x, h, w, b, eps)


def rms_norm_backend(x, weight, eps, backend):
    h = (x.shape[-1],)
    if backend == "reference":
        return rms_norm_reference(x, weight, eps)
    w = weight.to(x.dtype)
    if backend == "apex":
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine

        return fused_rms_norm_affine(x.contiguous(), w, h, eps)
    return F.rms_norm(x, h, w, eps)


class _Norm(nn.Module):
    """Shared set-up: the requested backend is resolved per input device at forward time."""

    def __init__(self, hidden_size: int, eps: float, backend: str):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"--kernels {backend!r} is not a kernel backend; choose one of {', '.join(BACKENDS)}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.backend = backend

    def _check(self, x: torch.Tensor) -> str:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"{type(self).__name__}: input last dim {x.shape[-1]} != hidden_size {self.hidden_size}")
        return select_backend(self.backend, x.device)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, backend={self.backend}"


class LayerNorm(_Norm):
    """LayerNorm over the last dimension with ``weight`` [H] (ones) and ``bias`` [H] (zeros).

    Args:
        hidden_size: H, the size of the normalised (last) dimension.
        eps: added to the variance before the square root.
        backend: ``"auto"``, ``"apex"``, ``"torch"`` or ``"reference"`` (module docstring);
            resolved with :func:`select_backend` against the input's device at each forward.
        dtype, device: of the parameters.

    Forward: ``x`` [..., H] -> [..., H], same dtype as ``x`` (fp32 statistics).

    Raises:
        ValueError: unknown ``backend``; at forward, ``"apex"`` where apex cannot run, or an
            input whose last dimension is not ``hidden_size``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        backend: str = "auto",
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__(hidden_size, eps, backend)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_backend(x, self.weight, self.bias, self.eps, self._check(x))


class RMSNorm(_Norm):
    """RMSNorm over the last dimension with ``weight`` [H] (ones) and no bias.

    Arguments, shapes and errors as :class:`LayerNorm`.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        backend: str = "auto",
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__(hidden_size, eps, backend)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_backend(x, self.weight, self.eps, self._check(x))
