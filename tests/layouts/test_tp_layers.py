"""Tensor-parallel building blocks against dense single-process references.

One set of gloo ranks per world size (2 and 4) runs every check (the whole world is the TP
group) and sends back errors and tensors; the tests below assert on them. Every rank
builds the same full tensors from a fixed seed, computes the dense reference with plain
torch ops, and compares its partition of the parallel result (float64, dropout off).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import tags
from megazero.data_parallel.finalize import finalize_param_grads
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_log_probs
from megazero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_logits,
)
from megazero.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from megazero.tensor_parallel.random import RNGTracker, dropout
from tests.support.distributed import run_distributed

B, T, IN, OUT, V, H = 2, 8, 8, 12, 16, 6
D = torch.float64


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _err(got, want):
    if got is None or tuple(got.shape) != tuple(want.shape):
        return math.inf
    return (got.detach() - want.detach()).abs().max().item()


def _seq(t, rank, tp):
    """This rank's sequence chunk of a full ``[B, T, ..]`` tensor."""
    return t.chunk(tp, dim=1)[rank]


def _column(rank, tp, g, gather, sp, stride):
    torch.manual_seed(1)
    out = OUT * stride if stride > 1 else OUT
    x, w, b, gy = (
        torch.randn(B, T, IN, dtype=D),
        torch.randn(out, IN, dtype=D),
        torch.randn(out, dtype=D),
        torch.randn(B, T, out, dtype=D),
    )
    xr, wr, br = _leaf(x), _leaf(w), _leaf(b)
    (F.linear(xr, wr, br) * gy).sum().backward()
    yr = F.linear(x, w, b)

    layer = ColumnParallelLinear(
        IN, out, g, gather_output=gather, sequence_parallel=sp, full_weight=w, full_bias=b, stride=stride, dtype=D
    )
    xin = _leaf(_seq(x, rank, tp) if sp else x)
    y = layer(xin)
    part = lambda t: tags.partition_tensor(t, t.dim() - 1, rank, tp, stride)
    (y * (gy if gather else part(gy))).sum().backward()
    assert tags.is_partitioned(layer.weight) and layer.weight.partition_dim == 0
    assert layer.bias.partition_dim == 0 and layer.weight.partition_stride == stride
    return max(
        _err(y, yr if gather else part(yr)),
        _err(xin.grad, _seq(xr.grad, rank, tp) if sp else xr.grad),
        _err(layer.weight.grad, tags.partition_tensor(wr.grad, 0, rank, tp, stride)),
        _err(layer.bias.grad, tags.partition_tensor(br.grad, 0, rank, tp, stride)),
    )


def _row(rank, tp, g, input_is_parallel, sp):
    torch.manual_seed(2)
    x, w, b, gy = (
        torch.randn(B, T, IN, dtype=D),
        torch.randn(OUT, IN, dtype=D),
        torch.randn(OUT, dtype=D),
        torch.randn(B, T, OUT, dtype=D),
    )
    xr, wr, br = _leaf(x), _leaf(w), _leaf(b)
    (F.linear(xr, wr, br) * gy).sum().backward()
    yr = F.linear(x, w, b)

    layer = RowParallelLinear(
        IN, OUT, g, input_is_parallel=input_is_parallel, sequence_parallel=sp, full_weight=w, full_bias=b, dtype=D
    )
    xin = _leaf(tags.partition_tensor(x, 2, rank, tp) if input_is_parallel else x)
    y = layer(xin)
    (y * (_seq(gy, rank, tp) if sp else gy)).sum().backward()
    assert tags.is_partitioned(layer.weight) and layer.weight.partition_dim == 1
    assert not tags.is_partitioned(layer.bias) and tags.is_sequence_parallel(layer.bias) == sp
    n_synced, _ = finalize_param_grads(list(layer.parameters()), g)
    assert n_synced == (1 if sp else 0)
    want_xgrad = tags.partition_tensor(xr.grad, 2, rank, tp) if input_is_parallel else xr.grad
    return max(
        _err(y, _seq(yr, rank, tp) if sp else yr),
        _err(xin.grad, want_xgrad),
        _err(layer.weight.grad, tags.partition_tensor(wr.grad, 1, rank, tp)),
        _err(layer.bias.grad, br.grad),
    )


def _embedding(rank, tp, g, sp):
    torch.manual_seed(3)
    ids, w, gy = torch.randint(0, V, (B, T)), torch.randn(V, H, dtype=D), torch.randn(B, T, H, dtype=D)
    wr = _leaf(w)
    (F.embedding(ids, wr) * gy).sum().backward()
    emb = VocabParallelEmbedding(V, H, g, full_weight=w, dtype=D, sequence_parallel=sp)
    assert (emb.vocab_start_index, emb.vocab_end_index) == (rank * V // tp, (rank + 1) * V // tp)
    y = emb(ids)
    (y * (_seq(gy, rank, tp) if sp else gy)).sum().backward()
    yr = F.embedding(ids, w)
    return max(
        _err(y, _seq(yr, rank, tp) if sp else yr), _err(emb.weight.grad, tags.partition_tensor(wr.grad, 0, rank, tp))
    )


def _lm_logits(rank, tp, g, sp):
    torch.manual_seed(4)
    h, w, gy = torch.randn(B, T, H, dtype=D), torch.randn(V, H, dtype=D), torch.randn(B, T, V, dtype=D)
    hr, wr = _leaf(h), _leaf(w)
    (F.linear(hr, wr) * gy).sum().backward()
    hin, wp = _leaf(_seq(h, rank, tp) if sp else h), _leaf(tags.partition_tensor(w, 0, rank, tp))
    logits = parallel_lm_logits(hin, wp, g, sequence_parallel=sp)
    (logits * tags.partition_tensor(gy, 2, rank, tp)).sum().backward()
    return max(
        _err(logits, tags.partition_tensor(F.linear(h, w), 2, rank, tp)),
        _err(hin.grad, _seq(hr.grad, rank, tp) if sp else hr.grad),
        _err(wp.grad, tags.partition_tensor(wr.grad, 0, rank, tp)),
    )


def _sequence_mappings(rank, tp, g):
    """The sequence-parallel mappings not exercised through a layer, and their errors."""
    torch.manual_seed(5)
    x, gy = torch.randn(B, T, H, dtype=D), torch.randn(B, T, H, dtype=D)
    xs = _leaf(x)
    y = scatter_to_sequence_parallel_region(xs, g)
    (y * _seq(gy, rank, tp)).sum().backward()
    errs = [_err(y, _seq(x, rank, tp)), _err(xs.grad, gy)]
    for grad_rs, scale in ((False, 1), (True, tp)):
        xc = _leaf(_seq(x, rank, tp))
        y = gather_from_sequence_parallel_region(xc, g, grad_reduce_scatter=grad_rs)
        (y * gy).sum().backward()
        errs += [_err(y, x), _err(xc.grad, scale * _seq(gy, rank, tp))]
    messages = []
    for call in (
        lambda: scatter_to_sequence_parallel_region(torch.zeros(B, T + 1, H), g),
        lambda: scatter_to_tp_region(torch.zeros(B, T, 4 * tp + 1), g),
        lambda: ColumnParallelLinear(IN, 4 * tp + 1, g),
    ):
        try:
            call()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return max(errs), messages


def _cross_entropy(rank, tp, g):
    """Errors vs F.cross_entropy for real vocab 8, 7 and 5 in a padded vocab of 8."""
    out = {}
    pv = 8
    for vocab in (8, 7, 5):
        for eps in (0.0, 0.1):
            for scale in (1.0, 1000.0):
                torch.manual_seed(6)
                full = torch.randn(B, T, pv, dtype=D) * scale
                target, gl = torch.randint(0, vocab, (B, T)), torch.randn(B, T, dtype=D)
                real = _leaf(full[..., :vocab])
                ref = F.cross_entropy(
                    real.reshape(-1, vocab), target.reshape(-1), reduction="none", label_smoothing=eps
                ).view(B, T)
                (ref * gl).sum().backward()
                ref_grad = torch.cat([real.grad, torch.zeros(B, T, pv - vocab, dtype=D)], -1)
                part = _leaf(tags.partition_tensor(full, 2, rank, tp))
                loss = vocab_parallel_cross_entropy(
                    part, target, g, label_smoothing=eps, vocab_size=vocab, padded_vocab_size=pv
                )
                (loss * gl).sum().backward()
                cols = torch.arange(rank * pv // tp, (rank + 1) * pv // tp)
                out[(vocab, eps, scale)] = dict(
                    loss_err=_err(loss, ref),
                    grad_err=_err(part.grad, tags.partition_tensor(ref_grad, 2, rank, tp)),
                    finite=bool(torch.isfinite(loss).all() and torch.isfinite(part.grad).all()),
                    pad_grad_zero=bool((part.grad[..., cols >= vocab] == 0).all()),
                    loss=loss.detach(),
                    dtype=loss.dtype,
                )
    for vocab in (8, 5):  # the log-probability primitive at temperatures 1 and 0.7
        for temperature in (1.0, 0.7):
            torch.manual_seed(7)
            full = torch.randn(B, T, pv, dtype=D) * 3
            target, gl = torch.randint(0, vocab, (B, T)), torch.randn(B, T, dtype=D)
            real = _leaf(full[..., :vocab])
            ref = F.log_softmax(real / temperature, -1).gather(-1, target[..., None])[..., 0]
            (ref * gl).sum().backward()
            ref_grad = torch.cat([real.grad, torch.zeros(B, T, pv - vocab, dtype=D)], -1)
            part = _leaf(tags.partition_tensor(full, 2, rank, tp))
            logp = vocab_parallel_log_probs(
                part, target, g, vocab_size=vocab, padded_vocab_size=pv, temperature=temperature
            )
            (logp * gl).sum().backward()
            out[("logp", vocab, temperature)] = dict(
                loss_err=_err(logp, ref),
                grad_err=_err(part.grad, tags.partition_tensor(ref_grad, 2, rank, tp)),
                finite=bool(torch.isfinite(logp).all() and (logp <= 0).all()),
                pad_grad_zero=True,
                loss=logp.detach(),
                dtype=logp.dtype,
            )
    try:
        vocab_parallel_cross_entropy(
            torch.zeros(B, T, pv, dtype=D), torch.zeros(B, T, dtype=torch.long), g, vocab_size=7, padded_vocab_size=pv
        )
        out["replicated_error"] = None
    except ValueError as e:
        out["replicated_error"] = str(e)
    try:  # the misuse that gave loss + ln(tp): replicated logits and no sizes
        vocab_parallel_cross_entropy(torch.zeros(B, T, pv, dtype=D), torch.zeros(B, T, dtype=torch.long), g)
        out["no_sizes_error"] = None
    except TypeError as e:
        out["no_sizes_error"] = str(e)
    return out


def _rng(rank):
    x = torch.ones(4, 64)
    masks = {}
    for attempt in (0, 1):  # attempt 1: fresh tracker, same seed
        tr = RNGTracker(1234, rank, "cpu")
        masks[attempt] = {name: dropout(x, 0.5, tr.generator(name), True) for name in ("replicated", "tp")}
        state = tr.get_state()
        after = dropout(x, 0.5, tr.generator("tp"), True)
        tr.set_state(state)
        masks[attempt]["restored_equal"] = torch.equal(after, dropout(x, 0.5, tr.generator("tp"), True))
        tr.reseed(1234)
        masks[attempt]["reseed_equal"] = torch.equal(masks[attempt]["tp"], dropout(x, 0.5, tr.generator("tp"), True))
    global_before = torch.get_rng_state()
    tr = RNGTracker(1234, rank, "cpu")
    with tr.fork("tp"):
        forked = F.dropout(x, 0.5, training=True)
    with tr.fork("replicated"):
        forked_rep = F.dropout(x, 0.5, training=True)
    masks["global_untouched"] = torch.equal(global_before, torch.get_rng_state())
    masks["fork_tp"], masks["fork_rep"] = forked, forked_rep
    masks["eval_identity"] = dropout(x, 0.5, tr.generator("tp"), False) is x
    return masks


def _worker(rank, world):
    g = dist.group.WORLD
    res = {"column": {}, "row": {}, "embedding": {}, "lm_logits": {}}
    for gather, sp, stride in (
        (False, False, 1),
        (True, False, 1),
        (False, True, 1),
        (False, False, 3),
        (False, True, 3),
    ):
        res["column"][(gather, sp, stride)] = _column(rank, world, g, gather, sp, stride)
    for parallel_in, sp in ((True, False), (False, False), (True, True)):
        res["row"][(parallel_in, sp)] = _row(rank, world, g, parallel_in, sp)
    for sp in (False, True):
        res["embedding"][sp] = _embedding(rank, world, g, sp)
        res["lm_logits"][sp] = _lm_logits(rank, world, g, sp)
    res["seq_mappings"] = _sequence_mappings(rank, world, g)
    res["ce"] = _cross_entropy(rank, world, g)
    res["rng"] = _rng(rank)
    return _to_numpy(res)


def _to_numpy(obj):
    """Tensors as numpy arrays: tensors returned through the harness's queue would travel
    as shared-memory handles that die with the rank."""
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"tp{w}")
def ranks(request):
    return request.param, run_distributed(_worker, request.param)


@pytest.mark.parametrize("kind", ["column", "row", "embedding", "lm_logits"])
def test_layers_match_dense_reference(ranks, kind):
    _, per_rank = ranks
    for rank, res in enumerate(per_rank):
        for variant, err in res[kind].items():
            assert err < 1e-6, f"{kind} {variant} rank {rank}: max error {err}"


def test_sequence_mappings_and_divisibility_errors(ranks):
    tp, per_rank = ranks
    for res in per_rank:
        err, messages = res["seq_mappings"]
        assert err < 1e-12
        assert "size 9" in messages[0] and f"tensor-parallel size {tp}" in messages[0]
        assert f"size {4 * tp + 1}" in messages[1]
        assert f"size {4 * tp + 1}" in messages[2] and f"tensor-parallel size {tp}" in messages[2]


def test_vocab_parallel_cross_entropy(ranks):
    """The loss (and, keyed ``("logp", vocab, temperature)``, the post-training log-probability
    primitive ``vocab_parallel_log_probs``) and its gradient against F.cross_entropy /
    F.log_softmax of the gathered real vocabulary, on every tp rank."""
    tp, per_rank = ranks
    for case in per_rank[0]["ce"]:
        if case in ("replicated_error", "no_sizes_error"):
            continue
        for rank, res in enumerate(per_rank):
            r = res["ce"][case]
            assert r["loss_err"] < 1e-10 and r["grad_err"] < 1e-10, (case, rank, r)
            assert r["finite"] and r["pad_grad_zero"] and r["dtype"] == torch.float64
            assert np.array_equal(r["loss"], per_rank[0]["ce"][case]["loss"]), "ranks disagree"
    for res in per_rank:
        msg = res["ce"]["replicated_error"]
        assert msg is not None and f"[B, T, {8 // tp}]" in msg and "[2, 8, 8]" in msg
        msg = res["ce"]["no_sizes_error"]
        assert msg is not None and "vocab_size" in msg and "padded_vocab_size" in msg


def test_rng_tracker_masks(ranks):
    _, per_rank = ranks
    eq = np.array_equal
    rng = [res["rng"] for res in per_rank]
    for name in ("replicated", "fork_rep"):
        assert all(
            eq(
                r[0][name] if name == "replicated" else r[name],
                rng[0][0][name] if name == "replicated" else rng[0][name],
            )
            for r in rng
        )
    for a in range(len(rng)):
        for b in range(a + 1, len(rng)):
            assert not eq(rng[a][0]["tp"], rng[b][0]["tp"])
            assert not eq(rng[a]["fork_tp"], rng[b]["fork_tp"])
    for r in rng:
        assert not eq(r[0]["tp"], r[0]["replicated"])
        for name in ("replicated", "tp"):
            assert eq(r[0][name], r[1][name])  # same seed, bit-exact
            assert set(np.unique(r[0][name]).tolist()) == {0.0, 2.0}
        assert all(r[a]["restored_equal"] and r[a]["reseed_equal"] for a in (0, 1))
        assert r["global_untouched"] and r["eval_identity"]


def test_group_size_one_is_plain_math():
    torch.manual_seed(7)
    x, w, b = torch.randn(B, T, IN), torch.randn(OUT, IN), torch.randn(OUT)
    col = ColumnParallelLinear(IN, OUT, None, full_weight=w, full_bias=b, gather_output=True)
    wt = w.t().contiguous()  # (IN, OUT)
    row = RowParallelLinear(OUT, IN, None, full_weight=wt, full_bias=x[0, 0])
    assert torch.equal(col(x), F.linear(x, w, b))
    h = torch.randn(B, T, OUT)
    assert torch.equal(row(h), F.linear(h, wt, x[0, 0]))
    ids = torch.randint(0, V, (B, T))
    table = torch.randn(V, H)
    assert torch.equal(VocabParallelEmbedding(V, H, None, full_weight=table)(ids), F.embedding(ids, table))
    logits = torch.randn(B, T, 8, dtype=torch.bfloat16)
    target = torch.randint(0, 8, (B, T))
    loss = vocab_parallel_cross_entropy(logits, target, None, vocab_size=8, padded_vocab_size=8, label_smoothing=0.1)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(logits.float().view(-1, 8), target.view(-1), reduction="none", label_smoothing=0.1).view(B, T)
    assert torch.allclose(loss, ref, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[B, T, 16\]"):
        vocab_parallel_cross_entropy(logits, target, None, vocab_size=8, padded_vocab_size=16)
    real = target.clamp(max=6)  # ids of the 7 real tokens
    logp = vocab_parallel_log_probs(logits, real, None, vocab_size=7, padded_vocab_size=8, temperature=0.5)
    want = F.log_softmax(logits[..., :7].float() / 0.5, -1).gather(-1, real[..., None])[..., 0]
    assert logp.dtype == torch.float32 and torch.allclose(logp, want, atol=1e-6)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        vocab_parallel_log_probs(logits, target, None, vocab_size=8, padded_vocab_size=8, temperature=0)
    with pytest.raises(ValueError, match="stride 3"):
        ColumnParallelLinear(IN, OUT * 3, None, gather_output=True, stride=3)
    with pytest.raises(ValueError, match=r"expected \(12, 8\)"):
        ColumnParallelLinear(IN, OUT, None, full_weight=w.t())
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        dropout(x, 1.5, torch.Generator(), True)


@pytest.mark.cuda
def test_cuda_single_rank_paths():
    dev = torch.device("cuda")
    logits = torch.randn(B, T, 8, device=dev, dtype=torch.bfloat16)
    target = torch.randint(0, 7, (B, T), device=dev)
    loss = vocab_parallel_cross_entropy(logits, target, None, vocab_size=7, padded_vocab_size=8, label_smoothing=0.1)
    ref = F.cross_entropy(
        logits.float()[..., :7].reshape(-1, 7), target.view(-1), reduction="none", label_smoothing=0.1
    ).view(B, T)
    assert loss.dtype == torch.float32 and torch.allclose(loss, ref, atol=1e-5)
    x = torch.ones(4, 64, device=dev)
    masks = []
    for _ in range(2):
        tr = RNGTracker(1234, 0, dev)
        with tr.fork("tp"):
            forked = F.dropout(x, 0.5, training=True)
        masks.append((dropout(x, 0.5, tr.generator("replicated"), True), forked))
    assert torch.equal(masks[0][0], masks[1][0]) and torch.equal(masks[0][1], masks[1][1])
