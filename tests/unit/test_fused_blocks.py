"""The ring's blocks through PyTorch's fused CPU attention kernel (``fused_blocks``) equal the
einsum blocks (``blockwise``, the oracle): forward out and lse, backward dq, dk, dv given the
final out and lse of the queries, in float64 to 1e-12 and float32 to 1e-5, with no mask, the
causal diagonal, packed documents with rows that see no key, and grouped-query heads; and with
values narrower or wider than the keys (``d_v != d``, DeepSeek's MLA: the fused path zero-pads to
one head size, the results are cut back). The distributed ring runs the fused path by default:
tests/layouts/test_context_parallel_attention.py."""

import pytest
import torch

from megazero.context_parallel.blockwise import block_attention, block_attention_backward, merge_partials
from megazero.context_parallel.fused_blocks import block_path, fused_block_attention, fused_block_attention_backward

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
SCALE = 0.35


def _inputs(dtype, G, R, Tq, Tk, seed=0, B=2, d=8, dv=None):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(B, G, R, Tq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, G, Tk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, G, Tk, dv, generator=g, dtype=torch.float64).to(dtype)
    do = torch.randn(B, G, R, Tq, dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, do


def _mask(kind, B, Tq, Tk, seed=0):
    """None, the top-left causal mask ``[1, T, T]``, or document masks ``[B, Tq, Tk]`` in which
    query row 2 sees no key of the block and batch 1's row 0 none either."""
    if kind == "none":
        return None
    if kind == "causal":
        return torch.ones(Tq, Tk, dtype=torch.bool).tril()[None]
    seg_q = torch.tensor([[0, 0, 1, 2, 2, 2, 3, 3], [4, 1, 5, 1, 2, 2, 3, 3]])[:, :Tq]
    seg_k = torch.tensor([[0, 0, 0, 2, 2, 3, 3, 3], [1, 1, 2, 2, 2, 3, 3, 3]])[:, :Tk]
    mask = seg_q[:, :, None] == seg_k[:, None, :]  # (B, Tq, Tk)
    assert not mask[:, 2].any() and not mask[1, 0].any()
    return mask


def _close(got, want, tol, what):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf rows differ"
    assert not got.isnan().any(), f"{what}: NaN"
    err = (got.nan_to_num(neginf=0.0) - want.nan_to_num(neginf=0.0)).abs().max().item()
    assert err <= tol, f"{what}: max abs difference {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["none", "causal", "documents"])
@pytest.mark.parametrize("G,R", [(2, 1), (1, 3), (2, 2)])
@pytest.mark.parametrize("dv", [8, 5, 12])
def test_fused_block_equals_einsum_block(dtype, kind, G, R, dv):
    """One block as the ring's first step computes it: its own out and lse are the final ones;
    values of ``dv`` dimensions against keys of 8."""
    T = 8
    q, k, v, do = _inputs(dtype, G, R, T, T, dv=dv)
    mask, causal = _mask(kind, 2, T, T), kind == "causal"
    out, lse = block_attention(q, k, v, mask, SCALE)
    f_out, f_lse = fused_block_attention(q, k, v, mask, SCALE, causal=causal)
    _close(f_out, out, TOL[dtype], "out")
    _close(f_lse, lse, TOL[dtype], "lse")
    y = out.to(dtype)  # the ring saves its output in q's dtype
    delta = (do.to(out.dtype) * y.to(out.dtype)).sum(-1)
    want = block_attention_backward(q, k, v, do, delta, lse, mask, SCALE)
    got = fused_block_attention_backward(q, k, v, do, y, lse, mask, SCALE, causal=causal)
    assert f_out.shape == (2, G, R, T, dv)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        _close(a, b, TOL[dtype], name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("dv", [8, 6])
def test_backward_with_the_merged_out_and_lse_of_two_blocks(dtype, dv):
    """Two key blocks (a document one with empty rows, then an unmasked one) merged as the ring
    merges them; each block's backward with the *final* out and lse equals the einsum's, and
    the blocks' dq, dk, dv are the gradient of attention over all keys (values of ``dv`` dims)."""
    q, k, v, do = _inputs(dtype, 2, 2, 8, 12, seed=1, dv=dv)
    mask_a = _mask("documents", 2, 8, 6)
    ka, kb, va, vb = k[:, :, :6], k[:, :, 6:], v[:, :, :6], v[:, :, 6:]
    parts = [fused_block_attention(q, ka, va, mask_a, SCALE), fused_block_attention(q, kb, vb, None, SCALE)]
    out, lse = merge_partials(*parts[0], *parts[1])
    ref_out, ref_lse = merge_partials(
        *block_attention(q, ka, va, mask_a, SCALE), *block_attention(q, kb, vb, None, SCALE)
    )
    _close(out, ref_out, TOL[dtype], "merged out")
    _close(lse, ref_lse, TOL[dtype], "merged lse")
    y = ref_out.to(dtype)
    delta = (do.to(y.dtype) * y).sum(-1).to(ref_out.dtype)
    total, dks, dvs = 0, [], []
    for kk, vv, m in ((ka, va, mask_a), (kb, vb, None)):
        got = fused_block_attention_backward(q, kk, vv, do, y, ref_lse, m, SCALE)
        want = block_attention_backward(q, kk, vv, do, delta, ref_lse, m, SCALE)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            _close(a, b, TOL[dtype], name)
        total = total + got[0]
        dks.append(got[1])
        dvs.append(got[2])
    qa, ka_, va_ = (t.double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bgrqd,bgkd->bgrqk", qa, ka_) * SCALE  # (B, G, R, Tq, Tk)
    full_mask = torch.cat([mask_a, torch.ones(2, 8, 6, dtype=torch.bool)], dim=2)
    s = s.masked_fill(~full_mask[:, None, None], float("-inf"))
    torch.einsum("bgrqk,bgkd->bgrqd", s.softmax(-1), va_).backward(do.double())
    _close(total.double(), qa.grad, 10 * TOL[dtype], "dq summed over blocks")
    _close(torch.cat(dks, dim=2).double(), ka_.grad, 10 * TOL[dtype], "dk of the two blocks")
    _close(torch.cat(dvs, dim=2).double(), va_.grad, 10 * TOL[dtype], "dv of the two blocks")


def test_fully_masked_rows_give_zero_and_no_nan():
    """A row with no visible key: out 0 and lse -inf in the forward (the kernel alone leaves lse
    0 there), zero dq in the backward when the final lse is -inf, and no NaN anywhere."""
    q, k, v, do = _inputs(torch.float32, 2, 2, 8, 8, seed=2)
    mask = _mask("documents", 2, 8, 8)
    out, lse = fused_block_attention(q, k, v, mask, SCALE)
    assert torch.isneginf(lse[:, :, :, 2]).all() and torch.isneginf(lse[1, :, :, 0]).all()
    assert torch.isfinite(lse[0, :, :, [0, 1, 3]]).all()
    assert (out[:, :, :, 2] == 0).all() and (out[1, :, :, 0] == 0).all() and not out.isnan().any()
    dq, dk, dv = fused_block_attention_backward(q, k, v, do, out, lse, mask, SCALE)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert (dq[:, :, :, 2] == 0).all() and (dq[1, :, :, 0] == 0).all()
    everything = torch.zeros(2, 8, 8, dtype=torch.bool)  # no row sees any key
    out, lse = fused_block_attention(q, k, v, everything, SCALE)
    assert (out == 0).all() and torch.isneginf(lse).all()
    grads = fused_block_attention_backward(q, k, v, do, out, lse, everything, SCALE)
    assert all((t == 0).all() for t in grads)


def test_block_path_choice():
    q32, q16 = torch.zeros(1, 1, 1, 2, 8), torch.zeros(1, 1, 1, 2, 8, dtype=torch.bfloat16)
    assert block_path(q32) == block_path(q32.double()) == "flash_cpu"
    assert block_path(q16) == "einsum"  # on CPU 16-bit blocks are faster as einsums
    assert block_path(q32, "einsum") == "einsum"
    assert block_path(torch.zeros(1, 8, dtype=torch.int64)) == "einsum"
    assert block_path(torch.zeros(1, 8, device="meta")) == "einsum"
    with pytest.raises(ValueError, match=r"ring block kernel 'flash' is not one of \('auto', 'einsum'\)"):
        block_path(q32, "flash")


def test_bfloat16_block_is_within_bfloat16_rounding():
    """bfloat16 inputs: the fused kernel rounds its output (and P before P V) to bfloat16, the
    einsums keep fp32; the difference stays at bfloat16's resolution (2^-8 relative)."""
    q, k, v, do = _inputs(torch.bfloat16, 2, 2, 8, 8, seed=3)
    mask = _mask("documents", 2, 8, 8)
    out, lse = block_attention(q, k, v, mask, SCALE)
    f_out, f_lse = fused_block_attention(q, k, v, mask, SCALE)
    _close(f_out, out, 2**-6, "out")
    _close(f_lse, lse, 1e-3, "lse")
