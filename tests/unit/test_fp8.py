"""megazero/ops/fp8.py against a fake-quantised reference written here: every recipe's forward,
data-gradient and weight-gradient GEMMs equal bit for bit the product of operands quantised block
by block (``(t * scale).to(fp8)``, then ``/ scale``; scale = fp8_max / amax, or MX's power of two
from ``torch.frexp``), taken in fp64 and rounded once to fp32 (the emulation's exact
accumulation); torch's CPU ``_scaled_mm`` (fp32 accumulation) is within fp32 rounding of it; the
emulated GEMM does not depend on where the contraction is cut (tp's partial sums); the
quantisation error stays within each format's rounding bound; the master weight is read, never
written; a shape that splits a block is refused naming the flag."""

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
    return torch.tensor(fmax, dtype=torch.float32) / amax  # current scaling


def fake_quant(t: torch.Tensor, dtype, recipe: str, block: int, weight: bool) -> torch.Tensor:
    """``t [rows, K]`` quantised to ``dtype`` per block of its contraction view and dequantised, fp64."""
    rows, cols = t.shape
    br, bc = {
        "tensorwise": (rows, cols),
        "rowwise": (1, cols),
        "blockwise": (block if weight else 1, block),
        "mxfp8": (1, 32),
    }[recipe]
    fmax = torch.finfo(dtype).max
    out = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            blk = t[i : i + br, j : j + bc].float()
            s = _scale(blk.abs().max(), dtype, recipe == "mxfp8")
            out[i : i + br, j : j + bc] = (blk * s).clamp(-fmax, fmax).to(dtype).double() / s.double()
    return out


def reference(x, w, g, recipe, fmt, block):
    """(y, dx, dw) of the fake-quantised GEMMs in fp64, rounded to fp32; each operand quantised along
    its contraction."""
    gd = E5M2 if fmt == "hybrid" else E4M3
    y = fake_quant(x, E4M3, recipe, block, False) @ fake_quant(w, E4M3, recipe, block, True).t()
    dx = fake_quant(g, gd, recipe, block, False) @ fake_quant(w.t(), E4M3, recipe, block, True).t()
    dw = fake_quant(g.t(), gd, recipe, block, False) @ fake_quant(x.t(), E4M3, recipe, block, False).t()
    return y.float(), dx.float(), dw.float()


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


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_tokens_not_a_multiple_of_the_tile_are_padded_with_zeros(recipe):
    torch.manual_seed(4)
    x, w, g = torch.randn(40, K, requires_grad=True), torch.randn(N, K, requires_grad=True), torch.randn(40, N)
    fp8.fp8_linear(x, w, None, fp8.Fp8Settings("hybrid", recipe, block=16)).backward(g)
    assert torch.equal(w.grad, reference(x.detach(), w.detach(), g, recipe, "hybrid", 16)[2])  # last tile: 8 tokens


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
    q, scale = fp8.quantize(t, dtype, s, weight=True)
    assert q.dtype == dtype
    if recipe == "mxfp8":  # e8m0 scales: powers of two
        assert bool((torch.log2(scale) == torch.round(torch.log2(scale))).all())
    deq = fp8.dequantize(q, scale)
    full = scale.repeat_interleave(M // scale.shape[0], 0).repeat_interleave(K // scale.shape[1], 1)
    factor = 1 / full
    scaled, err = t.abs() * full, (deq - t).abs()  # as quantize scales it
    fmax, rb, slack = torch.finfo(dtype).max, fp8.relative_bound(dtype), 1 + 2.0**-20  # slack: fp32 scaling
    normal = (scaled >= fp8.min_normal(dtype)) & (scaled <= fmax)
    assert bool((err[normal] <= rb * slack * t.abs()[normal]).all())  # e4m3 2^-4, e5m2 2^-3 relative
    sub = scaled < fp8.min_normal(dtype)
    assert bool(normal.any()) and bool((err[sub] <= fp8.min_normal(dtype) * rb * slack * factor[sub]).all())
    over = scaled > fmax  # saturated: MX's power-of-two scale of amax, or amax * (fp8_max / amax) rounded up
    assert recipe == "mxfp8" or bool((scaled[over] <= fmax * (1 + 2.0**-22)).all())
    assert torch.equal(deq[over].abs(), torch.full_like(full[over], fmax) / full[over])
    if recipe != "mxfp8":  # current scaling: each block's largest magnitude lands on the format's max
        assert torch.finfo(dtype).max == q.float().abs().max()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_is_within_fp32_accumulation_of_the_emulated_gemm(rowwise, dtype):
    torch.manual_seed(5)
    qa = (torch.randn(M, K) * 50).clamp(-400, 400).to(dtype)
    qb = (torch.randn(N, K) * 50).clamp(-400, 400).to(E4M3)
    exps = (torch.randint(-12, 4, (M, 1) if rowwise else (1, 1)), torch.randint(-12, 4, (N, 1) if rowwise else (1, 1)))
    for sa, sb in (
        (torch.exp2(exps[0].float()), torch.exp2(exps[1].float())),
        (torch.rand(M if rowwise else 1, 1) + 0.5, torch.rand(N if rowwise else 1, 1) + 0.5),
    ):
        got, want = fp8.scaled_mm((qa, sa), (qb, sb)), fp8.gemm((qa, sa), (qb, sb))
        assert got.dtype == torch.float32 and want.dtype == fp8.ACCUMULATE
        bound = K * 2.0**-23 * (qa.double().abs() @ qb.double().abs().t()) / (sa.double() * sb.double().t())
        assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_the_emulated_gemm_does_not_depend_on_where_the_contraction_is_cut(recipe):
    """Two halves of K, each an FP8 GEMM in fp64, added: the whole GEMM's fp32 value (tp's row-parallel sum)."""
    torch.manual_seed(6)
    s = fp8.Fp8Settings("hybrid", recipe, block=16)
    a = fp8.quantize(torch.randn(M, K) * torch.logspace(-3, 1, K), E5M2, s)
    b = fp8.quantize(torch.randn(N, K), E4M3, s, weight=True)
    whole = fp8.gemm(a, b)
    h, nb = K // 2, a[1].shape[1] // 2 if a[1].shape[1] > 1 else None
    if nb is None:  # one block along K: the halves keep the whole tensor's (or row's) scale
        halves = [fp8.gemm((a[0][:, i : i + h], a[1]), (b[0][:, i : i + h], b[1])) for i in (0, h)]
    else:
        halves = [
            fp8.gemm(
                (a[0][:, i * h : (i + 1) * h], a[1][:, i * nb : (i + 1) * nb]),
                (b[0][:, i * h : (i + 1) * h], b[1][:, i * nb : (i + 1) * nb]),
            )
            for i in (0, 1)
        ]
    assert torch.equal((halves[0] + halves[1]).float(), whole.float())
    f32 = [fp8.dequantize(*a)[:, i : i + h].mm(fp8.dequantize(*b)[:, i : i + h].t()) for i in (0, h)]
    assert not torch.equal(f32[0] + f32[1], fp8.dequantize(*a).mm(fp8.dequantize(*b).t()))  # fp32 sums: order shows


def test_shapes_that_split_a_block_are_refused():
    with pytest.raises(ValueError, match=r"--fp8-recipe blockwise: operand of local shape \(64, 24\).*--fp8-block"):
        fp8.quantize(torch.randn(M, 24), E4M3, fp8.Fp8Settings("e4m3", "blockwise", block=16))
    with pytest.raises(ValueError, match="--fp8-recipe mxfp8"):
        fp8.quantize(torch.randn(M, 48), E4M3, fp8.Fp8Settings("e4m3", "mxfp8"))


def test_experts_run_their_gemms_in_fp8():
    from model.config import GPTConfig
    from model.moe import ExpertMLP

    cfg = GPTConfig(vocab_size=64, num_layers=1, hidden_size=K, num_attention_heads=4, fp8_format="hybrid")
    expert = ExpertMLP(cfg, N, 1)
    torch.manual_seed(6)
    for p in expert.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(40, K)  # a ragged token count
    h = fp8.fp8_linear(x, expert.fc1.weight, expert.fc1.bias, cfg.fp8)
    want = fp8.fp8_linear(expert.activation(h), expert.fc2.weight, None, cfg.fp8)
    assert torch.equal(expert(x), want)
    plain = expert.activation(torch.nn.functional.linear(x, expert.fc1.weight, expert.fc1.bias))
    assert not torch.equal(expert(x), torch.nn.functional.linear(plain, expert.fc2.weight))
    assert ExpertMLP.grouped_forward([expert, expert], x, [20, 20]) is None  # FP8 experts loop


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--cp", "2"], "--fp8-format e4m3 with --cp 2 is not supported; fix: use --cp 1"),
        (["--pp", "2", "--pipeline-schedule", "zb-h1"], "--fp8-format with --pipeline-schedule zb-h1"),
        (
            ["--num-experts", "2", "--tp", "2", "--expert-tensor-parallel-size", "1"],
            "with experts under --tp 2 (--expert-tensor-parallel-size 1) is not supported; fix: use --tp 1",
        ),
        (
            ["--fp8-recipe", "blockwise", "--fp8-block", "32", "--tp", "2"],
            "--hidden-size 32 / --tp 2 is not a multiple of the 32-element",
        ),
        (
            ["--fp8-recipe", "mxfp8", "--tp", "2"],
            "32-element FP8 block; fix: choose sizes that are multiples of 64 or --fp8-recipe blockwise",
        ),
    ],
)
def test_fp8_settings_without_a_logical_scale_are_refused(extra, message, capsys):
    from tests.support.config import fails
    from tests.support.layouts import BASE

    err = fails(BASE + ["--fp8-format", "e4m3"] + extra, 2 if "2" in extra else 1, capsys)
    assert message in err, err


def test_a_pre_quantised_tensorwise_weight_gives_the_same_gemms_and_other_recipes_refuse_it():
    """``weight_fp8`` (ZeRO-3's FP8 all-gather hands the GEMMs the weight quantised with the whole
    weight's scale): forward and both backward GEMMs bitwise those that quantise the weight
    themselves; the weight's own values are not read (here: zeros)."""
    torch.manual_seed(7)
    x, w, g = torch.randn(M, K, requires_grad=True), torch.randn(N, K) * 0.02, torch.randn(M, N) * 1e-3
    s = fp8.Fp8Settings("hybrid", "tensorwise")
    w1 = w.clone().requires_grad_()
    y1 = fp8.fp8_linear(x, w1, None, s)
    y1.backward(g)
    dx1, x.grad = x.grad, None
    q, scale = fp8.quantize(w, s.forward_dtype, s, weight=True)
    assert scale.shape == (1, 1) and torch.equal(scale, fp8.current_scale(w.abs().max().reshape(1, 1), E4M3))
    w2 = torch.zeros(N, K, requires_grad=True)  # a ZeRO-3 placeholder: only its shape and dtype matter
    y2 = fp8.fp8_linear(x, w2, None, s, weight_fp8=(q, scale))
    y2.backward(g)
    assert torch.equal(y2, y1) and torch.equal(x.grad, dx1) and torch.equal(w2.grad, w1.grad)
    with pytest.raises(ValueError, match="needs --fp8-recipe tensorwise, got rowwise"):
        fp8.fp8_linear(x, w2, None, fp8.Fp8Settings("hybrid", "rowwise"), weight_fp8=(q, scale))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dp", "2", "--zero-stage", "3"], "--fp8-param-gather needs FP8 GEMMs; fix: add --fp8-format e4m3|hybrid"),
        (
            ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--dp", "2", "--zero-stage", "3"],
            "--fp8-param-gather with --fp8-recipe rowwise is not supported (tensorwise scales only); fix: use "
            "--fp8-recipe tensorwise",
        ),
        (
            ["--fp8-format", "e4m3", "--dp", "2", "--zero-stage", "2"],
            "--fp8-param-gather needs ZeRO-3 parameter shards (got --zero-stage 2); fix: add --zero-stage 3",
        ),
        (
            ["--fp8-format", "e4m3", "--dp", "2", "--zero-stage", "3", "--offload-param", "cpu"],
            "--fp8-param-gather with --offload-param cpu is not supported; fix: drop one of them",
        ),
    ],
)
def test_fp8_param_gather_without_fp8_tensorwise_or_zero3_or_with_param_offload_is_refused(extra, message, capsys):
    from tests.support.config import fails
    from tests.support.layouts import BASE

    err = fails(BASE + ["--fp8-param-gather"] + extra, 2, capsys)
    assert message in err, err


def _experts(recipe: str, n: int = 3) -> dict:
    """``n`` FP8 SwiGLU experts (hidden K, ffn 16) by global index, weights from a fixed seed."""
    from model.config import GPTConfig
    from model.moe import ExpertMLP

    cfg = GPTConfig(
        vocab_size=64,
        num_layers=1,
        hidden_size=K,
        num_attention_heads=4,
        swiglu=True,
        add_bias_linear=False,
        fp8_format="hybrid",
        fp8_recipe=recipe,
        fp8_block=8,
    )
    gen = torch.Generator(device="cpu").manual_seed(3)
    experts = {e: ExpertMLP(cfg, 16, 1) for e in range(n)}
    for ex in experts.values():
        for p in ex.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen, device="cpu") * 0.1)
    return experts


def test_an_fp8_expert_on_no_rows_gives_an_empty_output_and_zero_gradients():
    expert = _experts("tensorwise", 1)[0]
    y = expert(torch.zeros(0, K, requires_grad=True))  # FP8 quantisation of no rows would divide by zero
    y.sum().backward()
    assert y.shape == (0, K)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in expert.parameters())


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_experts_run_once_per_source_micro_batch_as_at_one_rank(recipe):
    """The all-gather dispatcher's local step on two source micro-batches' rows (``sources=2``)
    equals the experts run on each micro-batch alone, gradients accumulated micro-batch by
    micro-batch (the one-rank run): outputs, input and weight gradients bit for bit. One call
    over both micro-batches' rows (the planted bug: one scale over the whole received tokens,
    ``sources=1``) changes the weight gradients (quantised along the tokens) and, tensorwise, the
    outputs. Expert 2 gets no row of micro-batch 0 (a skipped empty chunk)."""
    from megazero.moe.dispatch import local_experts

    gen = torch.Generator(device="cpu").manual_seed(5)
    N, k = 24, 2
    x = torch.randn(2, N, K, generator=gen, device="cpu") * torch.tensor([1.0, 30.0], device="cpu")[:, None, None]
    w = torch.rand(2, N, k, generator=gen, device="cpu")
    a = torch.stack([torch.randint(0, n, (N, k), generator=gen, device="cpu") for n in (2, 3)])  # (2, N, k)
    dy = torch.randn(2, N, K, generator=gen, device="cpu")

    def run(sources: int):
        experts = _experts(recipe)
        xs = x.clone().requires_grad_()
        if sources == 0:  # the one-rank oracle: micro-batch 0, then micro-batch 1, gradients accumulated
            ys = [local_experts(xs[i], w[i], a[i], experts) for i in range(2)]
            for y, g in zip(ys, dy):
                y.backward(g)
            y = torch.stack(ys)
        else:
            y = local_experts(xs.view(2 * N, K), w.view(2 * N, k), a.view(2 * N, k), experts, sources=sources)
            y.backward(dy.view(2 * N, K))
        return [y.detach().view(2, N, K), xs.grad] + [p.grad for e in experts.values() for p in e.parameters()]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: on busy cores a second thread made them 10x slower
    try:
        want, got, planted = run(0), run(2), run(1)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(g, v) for g, v in zip(got, want))
    assert not all(torch.equal(g, v) for g, v in zip(planted[2:], want[2:]))  # weight gradients: along tokens
    assert torch.equal(planted[0], want[0]) == (recipe == "blockwise")  # blockwise forward tiles lie in a token


def test_fp8_experts_under_expert_parallelism_are_accepted():
    from megazero.config import config_from_argv
    from tests.support.layouts import BASE

    argv = BASE + ["--fp8-format", "hybrid", "--num-experts", "4", "--dp", "2", "--expert-model-parallel-size", "2"]
    cfg = config_from_argv(argv, 2)
    assert (cfg.precision.fp8_format, cfg.parallel.expert_model_parallel_size) == ("hybrid", 2)
