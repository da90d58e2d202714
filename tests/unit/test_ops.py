"""Kernel backends (apex / torch / reference) agree: LayerNorm, RMSNorm, AdamW, the --kernels switch.

Tolerances: fp32 1e-6 (absolute and relative). Half precision on tiny shapes: every backend
rounds its output (and the fused kernels their fp32->half weights) to the half dtype once or
twice, so the bound is a few units in the last place of values of size ~3: bf16 (8 bits of
mantissa, eps 2^-8) atol = rtol = 3e-2, fp16 (11 bits, eps 2^-11) atol = rtol = 4e-3; the
parameter gradients (sums over rows) get atol four times larger.
"""

import pytest
import torch

from megazero.ops.adam import adam_step
from megazero.ops.backend import apex_available, describe_backends, select_backend
from megazero.ops.norm import LayerNorm, RMSNorm, layer_norm_reference, rms_norm_reference

TOL = {torch.float32: 1e-6, torch.bfloat16: 3e-2, torch.float16: 4e-3}
H = 16


def _norm_pair(cls, backend, dtype, device):
    """The same randomly-initialised norm under ``backend`` and under "reference"."""
    gen = torch.Generator().manual_seed(0)
    mods = [cls(H, eps=1e-5, backend=b, dtype=dtype, device=device) for b in (backend, "reference")]
    with torch.no_grad():
        for name, p in mods[0].named_parameters():
            p.copy_(torch.randn(H, generator=gen))
            dict(mods[1].named_parameters())[name].copy_(p)
    return mods


def _forward_backward(mod, x, dy):
    x = x.clone().requires_grad_(True)
    y = mod(x)
    y.backward(dy)
    return y, x.grad, [p.grad for p in mod.parameters()]


def _check_norm(cls, backend, dtype, device):
    mod, ref = _norm_pair(cls, backend, dtype, device)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 5, H, generator=gen) * 3 + 1).to(device=device, dtype=dtype)  # [B, T, H]
    dy = torch.randn(2, 5, H, generator=gen).to(device=device, dtype=dtype)
    y, dx, dparams = _forward_backward(mod, x, dy)
    y_ref, dx_ref, dparams_ref = _forward_backward(ref, x, dy)
    tol = TOL[dtype]
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(dx, dx_ref, atol=tol, rtol=tol)
    for g, g_ref in zip(dparams, dparams_ref):
        # parameter gradients are sums over the B*T = 10 rows: values ~10, one more rounding
        torch.testing.assert_close(g.float(), g_ref.float(), atol=4 * tol, rtol=tol)


def test_reference_norms_match_their_formulas():
    """The oracle itself against the paper formulas evaluated in float64."""
    x = torch.randn(3, 4, H) * 2 + 0.5
    w, b = torch.randn(H), torch.randn(H)
    xd, eps = x.double(), 1e-5
    mean = xd.mean(-1, keepdim=True)
    var = ((xd - mean) ** 2).mean(-1, keepdim=True)
    expected_ln = (xd - mean) / torch.sqrt(var + eps) * w.double() + b.double()
    expected_rms = xd / torch.sqrt((xd**2).mean(-1, keepdim=True) + eps) * w.double()
    torch.testing.assert_close(layer_norm_reference(x, w, b, eps).double(), expected_ln, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rms_norm_reference(x, w, eps).double(), expected_rms, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_equals_reference_cpu(backend, cls, dtype):
    _check_norm(cls, backend, dtype, torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "apex"])
@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_equals_reference_cuda(backend, cls, dtype):
    if backend == "apex" and not apex_available():
        pytest.skip("apex with CUDA extensions is not installed")
    _check_norm(cls, backend, dtype, torch.device("cuda"))


def test_norm_parameters_and_bad_input():
    ln = LayerNorm(H, dtype=torch.bfloat16)
    assert torch.equal(ln.weight, torch.ones(H, dtype=torch.bfloat16))
    assert torch.equal(ln.bias, torch.zeros(H, dtype=torch.bfloat16))
    assert [n for n, _ in RMSNorm(H).named_parameters()] == ["weight"]
    with pytest.raises(ValueError, match="hidden_size 16"):
        ln(torch.randn(2, H + 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="--kernels"):
        LayerNorm(H, backend="triton")
    with pytest.raises(ValueError, match="--kernels apex"):
        RMSNorm(H, backend="apex")(torch.randn(2, H))


def _adamw_reference_run(flat_param, grads, decay_mask, hyper):
    """torch.optim.AdamW (single-tensor path) on two Parameters: decayed and non-decayed halves."""
    k = int(decay_mask.sum())
    p_decay = torch.nn.Parameter(flat_param[:k].clone())
    p_plain = torch.nn.Parameter(flat_param[k:].clone())
    opt = torch.optim.AdamW(
        [dict(params=[p_decay], weight_decay=hyper["weight_decay"]), dict(params=[p_plain], weight_decay=0.0)],
        lr=hyper["lr"],
        betas=(hyper["beta1"], hyper["beta2"]),
        eps=hyper["eps"],
        foreach=False,
    )
    for g in grads:
        p_decay.grad, p_plain.grad = g[:k].clone(), g[k:].clone()
        opt.step()
    return torch.cat([p_decay.detach(), p_plain.detach()])


def _run_adam(backend, device, n_steps, weight_decay_as_tensor):
    gen = torch.Generator().manual_seed(2)
    n, k = 37, 20  # flat shard of 37 elements; the first 20 are decayed
    param0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(n_steps)]
    mask = torch.zeros(n)
    mask[:k] = 1.0
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    expected = _adamw_reference_run(param0, grads, mask, hyper)

    param = param0.clone().to(device)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    wd = (mask * hyper["weight_decay"]).to(device)
    for step, g in enumerate(grads, start=1):
        if weight_decay_as_tensor:
            adam_step(
                param, g.to(device), exp_avg, exp_avg_sq, step=step, backend=backend, **dict(hyper, weight_decay=wd)
            )
        else:  # scalar decay on the decayed part, none on the rest: two calls on views
            for sl, w in ((slice(0, k), hyper["weight_decay"]), (slice(k, n), 0.0)):
                adam_step(
                    param[sl],
                    g[sl].to(device),
                    exp_avg[sl],
                    exp_avg_sq[sl],
                    step=step,
                    backend=backend,
                    **dict(hyper, weight_decay=w),
                )
    torch.testing.assert_close(param.cpu(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
@pytest.mark.parametrize("n_steps", [1, 5])
@pytest.mark.parametrize("wd_tensor", [False, True])
def test_adam_equals_torch_adamw_cpu(backend, n_steps, wd_tensor):
    _run_adam(backend, torch.device("cpu"), n_steps, wd_tensor)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "apex", "reference"])
@pytest.mark.parametrize("wd_tensor", [False, True])
def test_adam_equals_torch_adamw_cuda(backend, wd_tensor):
    if backend == "apex" and not apex_available():
        pytest.skip("apex with CUDA extensions is not installed")
    _run_adam(backend, torch.device("cuda"), 5, wd_tensor)


def test_adam_rejects_bad_arguments():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="shapes differ"):
        adam_step(
            p,
            torch.zeros(5),
            torch.zeros(4),
            torch.zeros(4),
            step=1,
            lr=1.0,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=0.0,
        )
    with pytest.raises(ValueError, match="step must be >= 1"):
        adam_step(p, p.clone(), p.clone(), p.clone(), step=0, lr=1.0, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="--kernels apex"):
        adam_step(
            p,
            p.clone(),
            p.clone(),
            p.clone(),
            step=1,
            lr=1.0,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=0.0,
            backend="apex",
        )


def test_select_backend():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu) == "torch"
    assert select_backend("torch", cpu) == "torch"
    assert select_backend("reference", cpu) == "reference"
    with pytest.raises(ValueError, match="--kernels apex needs a CUDA device.*--kernels torch"):
        select_backend("apex", cpu)
    with pytest.raises(ValueError, match="--kernels 'fused'.*auto, apex, torch, reference"):
        select_backend("fused", cpu)
    line = describe_backends(cpu)
    assert "torch.nn.functional.layer_norm" in line and "torch._fused_adamw_" in line
    assert "reference" in describe_backends(cpu, "reference")


@pytest.mark.cuda
def test_select_backend_cuda():
    cuda = torch.device("cuda")
    assert select_backend("auto", cuda) == ("apex" if apex_available() else "torch")
    if not apex_available():
        with pytest.raises(ValueError, match="--kernels apex.*not importable"):
            select_backend("apex", cuda)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_adam_over_a_list_equals_one_call_per_tensor_bit_for_bit(backend):
    """One multi-tensor call over views of a flat shard (what the optimizer issues per buffer
    and weight decay) gives exactly the values of one call per view (what it issued per
    bucket piece and decay run before the change)."""
    from megazero.ops.adam import adam_step_lists

    gen = torch.Generator().manual_seed(3)
    cuts = [0, 5, 37, 38, 300, 301, 1000]  # odd sizes: vectorised bodies and scalar tails
    state = [torch.randn(1000, generator=gen) for _ in range(2)] + [torch.rand(1000, generator=gen)]
    grads = [torch.randn(1000, generator=gen) for _ in range(3)]
    runs = [(a, b) for a, b in zip(cuts, cuts[1:])]
    one, lists = [t.clone() for t in state], [t.clone() for t in state]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, backend=backend)
    for step, g in enumerate(grads, start=1):
        for a, b in runs:
            adam_step(one[0][a:b], g[a:b], one[1][a:b], one[2][a:b], step=step, **hyper)
        adam_step_lists(*([t[a:b] for a, b in runs] for t in (lists[0], g, lists[1], lists[2])), step=step, **hyper)
    for x, y in zip(one, lists):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="list lengths differ"):
        adam_step_lists([state[0]], [], [], [], step=1, **hyper)
