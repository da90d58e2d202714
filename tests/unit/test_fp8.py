"""megazero/ops/fp8.py against a fake-quantised fp32 reference written here: every recipe's forward,
data-gradient and weight-gradient GEMMs equal bit for bit the fp32 product of operands quantised
block by block (``(t * scale).to(fp8)``, then ``/ scale``) with the scales computed here through
``torch.frexp``; the quantisation error stays within each format's rounding bound; the master
weight is read, never written; a shape that splits a block is refused naming the flag."""

import pytest
import torch

from megazero.ops import fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M, K, N = 64, 64, 32  # tokens, in, out: whole 1x32 MX blocks and 16x16 blocks


def _scale(amax: torch.Tensor, dtype, mx: bool) -> torch.Tensor:
    """Quantisation multiplier of a block of max magnitude ``amax`` (fp32 scalar)."""
    fmax = torch.finfo(dtype).max
    if amax == 0:
        return torch.tensor(1.0)
    if mx:  # OCP MX: X = 2^(floor(log2 amax) - emax); multiplier 1/X
        _, e = torch.frexp(amax)
        return torch.exp2(-(e - 1 - {E4M3: 8, E5M2: 15}[dtype]).float())
    _, e = torch.frexp(torch.tensor(fmax, dtype=torch.float32) / amax)  # v = m 2^e, m in [0.5, 1)
    return torch.exp2((e - 1).float())  # 2^floor(log2(fmax / amax))


def fake_quant(t: torch.Tensor, dtype, recipe: str, block: int, weight: bool) -> torch.Tensor:
    """``t [rows, K]`` quantised to ``dtype`` per block of its contraction view and dequantised, fp32."""
    rows, cols = t.shape
    br, bc = {
        "tensorwise": (rows, cols),
        "rowwise": (1, cols),
        "blockwise": (block if weight else 1, block),
        "mxfp8": (1, 32),
    }[recipe]
    fmax = torch.finfo(dtype).max
    out = torch.empty(rows, cols)
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            blk = t[i : i + br, j : j + bc].float()
            s = _scale(blk.abs().max(), dtype, recipe == "mxfp8")
            out[i : i + br, j : j + bc] = (blk * s).clamp(-fmax, fmax).to(dtype).float() / s
    return out


def reference(x, w, g, recipe, fmt, block):
    """(y, dx, dw) of the fake-quantised fp32 GEMMs, each operand quantised along its contraction."""
    gd = E5M2 if fmt == "hybrid" else E4M3
    y = fake_quant(x, E4M3, recipe, block, False) @ fake_quant(w, E4M3, recipe, block, True).t()
    dx = fake_quant(g, gd, recipe, block, False) @ fake_quant(w.t(), E4M3, recipe, block, True).t()
    dw = fake_quant(g.t(), gd, recipe, block, False) @ fake_quant(x.t(), E4M3, recipe, block, False).t()
    return y, dx, dw


@pytest.mark.parametrize("fmt", fp8.FORMATS)
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_gemms_equal_fake_quantised_reference_bitwise(recipe, fmt):
    torch.manual_seed(0)
    x = (torch.randn(M, K) * torch.logspace(-3, 1, K)).requires_grad_()  # columns of many magnitudes
    w = torch.randn(N, K) * 0.02
    w[3, 5] = 7.0  # an outlier: one block's scale differs from the others'
    w.requires_grad_()
    g = torch.randn(M, N) * 1e-3
    master = w.detach().clone()
    s = fp8.Fp8Settings(fmt, recipe, block=16)
    y = fp8.fp8_linear(x, w, None, s)
    y.backward(g)
    want_y, want_dx, want_dw = reference(x.detach(), w.detach(), g, recipe, fmt, 16)
    assert torch.equal(y, want_y)
    assert torch.equal(x.grad, want_dx)
    assert torch.equal(w.grad, want_dw)
    assert torch.equal(w.detach(), master)  # the master weight is untouched
    assert not torch.equal(y, x.detach() @ w.detach().t())  # it really quantises
    rel = (y - x.detach() @ w.detach().t()).norm() / y.norm()
    assert rel < 0.1


def test_hybrid_quantises_gradients_to_e5m2():
    torch.manual_seed(1)
    x, w, g = torch.randn(M, K, requires_grad=True), torch.randn(N, K), torch.randn(M, N)
    grads = []
    for fmt in fp8.FORMATS:
        w1 = w.clone().requires_grad_()
        fp8.fp8_linear(x, w1, None, fp8.Fp8Settings(fmt, "tensorwise")).backward(g)
        grads.append(w1.grad)
    assert not torch.equal(grads[0], grads[1])
    assert torch.equal(grads[1], reference(x.detach(), w, g, "tensorwise", "hybrid", 16)[2])


def test_bias_and_bf16_inputs_keep_their_dtypes():
    torch.manual_seed(2)
    x = torch.randn(4, 8, K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(N, dtype=torch.bfloat16, requires_grad=True)
    y = fp8.fp8_linear(x, w, b, fp8.Fp8Settings("hybrid", "rowwise"))
    assert y.shape == (4, 8, N) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (torch.bfloat16,) * 3
    assert torch.equal(b.grad, torch.full((N,), 32.0, dtype=torch.bfloat16))  # sum of dY over 32 tokens


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_quantisation_error_within_format_bound(recipe, dtype):
    torch.manual_seed(3)
    t = torch.randn(M, K) * torch.logspace(-6, 2, K)
    s = fp8.Fp8Settings("e4m3", recipe, block=16)
    q, inv = fp8.quantize(t, dtype, s, weight=True)
    assert q.dtype == dtype and bool((torch.log2(inv) == torch.round(torch.log2(inv))).all())  # powers of two
    deq = fp8.dequantize(q, inv)
    factor = fp8.dequantize(torch.ones_like(q, dtype=torch.float32).to(dtype), inv)  # per-element inv scale
    scaled, err = t.abs() / factor, (deq - t).abs()
    fmax, rb = torch.finfo(dtype).max, fp8.relative_bound(dtype)
    normal = (scaled >= fp8.min_normal(dtype)) & (scaled <= fmax)
    assert bool((err[normal] <= rb * t.abs()[normal]).all())  # e4m3 2^-4, e5m2 2^-3 relative
    sub = scaled < fp8.min_normal(dtype)
    assert bool((err[sub] <= fp8.min_normal(dtype) * rb * factor[sub]).all())  # half the subnormal spacing
    over = scaled > fmax  # only MX's power-of-two scale of amax can leave values above the max: saturated
    assert recipe == "mxfp8" or not bool(over.any())
    assert torch.equal(deq[over].abs(), fmax * factor[over])


def test_shapes_that_split_a_block_are_refused():
    with pytest.raises(ValueError, match=r"--fp8-recipe blockwise: operand of local shape \(64, 24\).*--fp8-block"):
        fp8.quantize(torch.randn(M, 24), E4M3, fp8.Fp8Settings("e4m3", "blockwise", block=16))
    with pytest.raises(ValueError, match="--fp8-recipe mxfp8"):
        fp8.quantize(torch.randn(M, 48), E4M3, fp8.Fp8Settings("e4m3", "mxfp8"))
