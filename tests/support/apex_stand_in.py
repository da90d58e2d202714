"""A stand-in for apex's fused norms, so zero-bubble schedules can be tried with them on CPU.

apex's ``fused_layer_norm_affine`` / ``fused_rms_norm_affine`` (``apex.normalization.
fused_layer_norm``) apply ``FusedLayerNormAffineFunction`` / ``FusedRMSNormAffineFunction``:
custom autograd Functions whose one backward returns the input's and the weights' gradients
together. ``install(patch)`` puts Python Functions with the same signatures and the same shape
of backward where ``megazero.ops.norm`` imports apex from, and makes its backend selection
answer ``"apex"`` (what ``--kernels auto`` gives on CUDA with apex)."""

import sys
import types

import torch


class LayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dim: ``x`` [..., H], ``weight``/``bias`` [H]; backward returns
    (dx, dweight, dbias) from one call."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        mean = x.mean(-1, keepdim=True)  # [..., 1]
        rstd = torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        xhat = (x - mean) * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        return xhat * weight + bias

    @staticmethod
    def backward(ctx, dy):
        xhat, rstd, weight = ctx.saved_tensors
        g = dy * weight
        dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        rows = dy.reshape(-1, dy.shape[-1])  # [N, H]
        dw = (rows * xhat.reshape(rows.shape)).sum(0)
        return dx, dw, rows.sum(0), None, None


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dim: ``x`` [..., H], ``weight`` [H]; backward returns (dx, dweight)
    from one call."""

    @staticmethod
    def forward(ctx, x, weight, shape, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        xhat = x * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        return xhat * weight

    @staticmethod
    def backward(ctx, dy):
        xhat, rstd, weight = ctx.saved_tensors
        g = dy * weight
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        rows = dy.reshape(-1, dy.shape[-1])  # [N, H]
        return dx, (rows * xhat.reshape(rows.shape)).sum(0), None, None


def install(patch) -> None:
    """Make ``megazero.ops.norm`` run the stand-ins as its apex backend; ``patch``: a
    ``pytest.MonkeyPatch`` (its undo restores everything)."""
    fused = types.ModuleType("apex.normalization.fused_layer_norm")
    fused.fused_layer_norm_affine = lambda x, w, b, shape, eps: LayerNormFunction.apply(x, w, b, shape, eps)
    fused.fused_rms_norm_affine = lambda x, w, shape, eps: RMSNormFunction.apply(x, w, shape, eps)
    for name in ("apex", "apex.normalization"):
        patch.setitem(sys.modules, name, types.ModuleType(name))
    patch.setitem(sys.modules, fused.__name__, fused)
    patch.setattr("megazero.ops.norm.select_backend", lambda requested, device: "apex")
