"""Global gradient norm: every element of the full model counted exactly once at tp 1, 2, 4,
with pipeline-tied embeddings, and through the ZeRO optimizer (shards summed over DP)."""

import math

import pytest
import torch

from megazero.data_parallel.ddp import DataParallel
from megazero.optim.clip import clip_coefficient, grad_norm_of_params
from megazero.optim.zero import DistributedOptimizer
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from model.gpt import GPTStage, init_full_weights
from tests.support.distributed import run_distributed
from tests.support.reference import ReferenceGPT
from tests.support.zero import SEED, make_batches, tiny_cfg


def _stage(cfg, groups, pp_rank, pp):
    layers = range(cfg.num_layers * pp_rank // pp, cfg.num_layers * (pp_rank + 1) // pp)
    return GPTStage(cfg, groups, layers, pp_rank == 0, pp_rank == pp - 1, SEED)


def _norm_run(rank, world, tokens, labels):
    cfg = tiny_cfg(vocab_size=64, num_attention_heads=4)  # padded vocab 64 at tp 1, 2, 4
    out = {}
    for tp, pp in ((1, 1), (2, 1), (4, 1), (2, 2), (1, 2)):
        groups = ProcessGroups.build(Topology(tp=tp, pp=pp, dp=world // (tp * pp)))
        model = _stage(cfg, groups, groups.pp_rank, pp)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        ones = grad_norm_of_params(model.parameters(), groups)
        real = None
        if pp == 1:
            for p in model.parameters():
                p.grad = None
            (model(tokens, labels).sum() / labels.numel()).backward()
            real = grad_norm_of_params(model.parameters(), groups)
        out[tp, pp] = (ones, real)
    # through ZeRO-2 at tp 2 x dp 2: shards summed over DP, replicated params once
    groups = ProcessGroups.build(Topology(tp=2, pp=1, dp=2))
    model = _stage(cfg, groups, 0, 1)
    ddp = DataParallel([model], groups, zero_stage=2, bucket_size=101, overlap_comm=True)
    opt = DistributedOptimizer(ddp, groups, lr=0.0, clip_grad=1e-3)
    opt.zero_grad()
    ddp.before_backward(0, True)
    rows = tokens.shape[0] // 2
    r = groups.dp_rank
    (
        model(tokens[r * rows : (r + 1) * rows], labels[r * rows : (r + 1) * rows]).sum() / (labels.numel() // 2)
    ).backward()  # / this DP rank's tokens; DP sums, divides by 2
    out["zero2"] = opt.step().grad_norm
    return out


def test_norm_counts_every_element_once_at_tp_1_2_4():
    cfg = tiny_cfg(vocab_size=64, num_attention_heads=4)
    tokens, labels = make_batches(cfg, 1)[0]
    results = run_distributed(_norm_run, 4, tokens, labels)
    full = init_full_weights(cfg, SEED)
    unique = sum(t.numel() for t in full.values())
    ref = ReferenceGPT.from_full_weights(full, cfg.vocab_size, cfg.num_attention_heads)
    ref.loss(tokens, labels).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
    for out in results:
        layouts = [k for k in out if k != "zero2"]
        for tp, pp in layouts:
            ones, real = out[tp, pp]
            assert ones**2 == pytest.approx(unique, rel=1e-6), (tp, pp)
            if real is not None:
                assert real == pytest.approx(ref_norm, rel=1e-5), tp
        assert out["zero2"] == pytest.approx(ref_norm, rel=1e-5)
        assert out["zero2"] == results[0]["zero2"]  # identical on every rank


def test_clip_coefficient_matches_torch():
    g = torch.tensor([3.0, 4.0])
    for max_norm in (1.0, 5.0, 10.0):
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([p], max_norm)
        assert (g * clip_coefficient(5.0, max_norm)).tolist() == pytest.approx(p.grad.tolist())
    assert clip_coefficient(5.0, 0.0) == 1.0
    assert math.isnan(clip_coefficient(float("inf"), 1.0))


def _norm_against_fp64(hidden: int, num_layers: int, stage: int = 0):
    """(reported norm, fp64 norm of the same gradients, parameter count) of one fp32 step of
    a GPT with ``num_layers`` layers of width ``hidden`` in one process, no clipping."""
    from megazero import tags
    from tests.support.zero import build

    torch.manual_seed(0)
    cfg = tiny_cfg(vocab_size=1000, num_layers=num_layers, hidden_size=hidden, num_attention_heads=8, seq_length=16)
    tokens, labels = make_batches(cfg, 1, batch=2)[0]
    groups = ProcessGroups.single()
    plain = _stage(cfg, groups, 0, 1)  # the same weights and batch without DP: grads in .grad
    (plain(tokens, labels).sum() / labels.numel()).backward()
    exact = math.sqrt(
        sum(p.grad.double().square().sum().item() for p in plain.parameters() if tags.counts_in_norm(p, 0))
    )
    psi = sum(p.numel() for p in plain.parameters())
    del plain
    model, ddp, opt = build(cfg, groups, stage, overlap=False, bucket=1 << 24)
    opt.zero_grad()
    ddp.before_backward(0, True)
    (model(tokens, labels).sum() / labels.numel()).backward()
    return opt.step().grad_norm, exact, psi


def test_norm_of_25m_parameters_equals_fp64():
    """A 25M-parameter model's reported norm is the fp64 norm of its gradients to 1e-6 (an fp32
    sum of squares was 4e-3 off at this size)."""
    got, exact, psi = _norm_against_fp64(hidden=512, num_layers=8)
    assert psi > 25e6
    assert got == pytest.approx(exact, rel=1e-6)


@pytest.mark.slow
def test_norm_of_100m_parameters_equals_fp64():
    got, exact, psi = _norm_against_fp64(hidden=1024, num_layers=8)
    assert psi > 100e6
    assert got == pytest.approx(exact, rel=1e-6)


def test_cpu_squared_sum_rows_equal_fp64():
    """The CPU path (rows of 64 fp32 squares, fp64 partial sums) against an fp64 sum: pieces
    below and above the whole-upcast threshold, with and without a tail, 4e6 elements."""
    from megazero.optim.clip import ROW, SMALL, squared_sum

    gen = torch.Generator().manual_seed(3)
    sizes = [1, ROW - 1, SMALL, SMALL + 1, SMALL + ROW, 3 * SMALL + 17, 2**21 + 5, 2**20 * 1 + 63]
    pieces = [torch.randn(n, generator=gen) * 10 ** (i % 5 - 2) for i, n in enumerate(sizes)]
    exact = sum(p.double().square().sum() for p in pieces).item()
    got = squared_sum(pieces)
    assert got.dtype == torch.float64 and got.shape == (1,)
    assert got.item() == pytest.approx(exact, rel=1e-8)  # each row's norm is rounded to fp32
    # a fp32 accumulation over the same values is far off: the test can tell the paths apart
    fp32 = sum(torch.linalg.vector_norm(p).square().item() for p in pieces)
    assert abs(fp32 - exact) / exact > 1e-8
    assert squared_sum([torch.empty(0)]).item() == 0.0
    assert math.isinf(squared_sum([torch.tensor([1.0, float("inf")] * 40000)]).item())
