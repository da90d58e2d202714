"""``megazero.post_training.grpo``: advantages, the clipped surrogate, the KL estimators and the
loss aggregations against their papers' formulas written out here."""

from __future__ import annotations

import math

import pytest
import torch

from megazero.post_training.grpo import (
    aggregate,
    clipped_surrogate,
    group_advantages,
    kl_penalty,
    token_weights,
    zero_variance_groups,
)

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, 0.0, 1.0, 3.0])  # 3 prompts x 4 samples


def test_advantages_follow_grpo_dr_grpo_and_rloo():
    """Group 0: mean 0.5, Bessel std sqrt(1/3); group 1 all equal: exactly 0 by every kind;
    RLOO = r minus the mean of the other three."""
    g = group_advantages(R, 4)
    want0 = [(x - 0.5) / (math.sqrt(1 / 3) + 1e-6) for x in (1, 0, 0, 1)]
    assert torch.allclose(g[:4], torch.tensor(want0, dtype=torch.float64), rtol=1e-12, atol=0)
    for kind in ("grpo", "dr_grpo", "rloo"):
        assert torch.equal(group_advantages(R, 4, kind)[4:8], torch.zeros(4, dtype=torch.float64)), kind
    assert torch.equal(group_advantages(R, 4, "dr_grpo")[8:], torch.tensor([0.5, -1.5, -0.5, 1.5], dtype=torch.float64))
    rloo = group_advantages(R, 4, "rloo")
    for i in range(12):
        others = [R[j].item() for j in range(4 * (i // 4), 4 * (i // 4) + 4) if j != i]
        assert math.isclose(rloo[i].item(), R[i].item() - sum(others) / 3, abs_tol=1e-12)
    assert zero_variance_groups(R, 4).tolist() == [False] * 4 + [True] * 4 + [False] * 4
    for bad, match in ((dict(group_size=1), "at least 2"), (dict(group_size=5), "divides"), (dict(kind="x"), "grpo")):
        with pytest.raises(ValueError, match=match):
            group_advantages(R, **{"group_size": 4, **bad})


def test_the_clipped_surrogate_clips_each_side_by_its_own_bound():
    """rho = exp(logp - old): with A > 0 the gain stops at 1 + eps_high, with A < 0 at
    1 - eps_low; inside the bounds the loss is -rho A and its gradient -rho A."""
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 0.9, 1.1, 1.5]])).requires_grad_()
    up = clipped_surrogate(logp, old, torch.tensor([1.0]), 0.2, 0.28)
    assert torch.allclose(up, -torch.tensor([[0.5, 0.9, 1.1, 1.28]]))
    down = clipped_surrogate(logp, old, torch.tensor([-1.0]), 0.2, 0.28)
    assert torch.allclose(down, torch.tensor([[0.8, 0.9, 1.1, 1.5]]))
    up.sum().backward()
    assert torch.allclose(logp.grad, -torch.tensor([[0.5, 0.9, 1.1, 0.0]]))
    with pytest.raises(ValueError, match="--grpo-clamp-eps-lower"):
        clipped_surrogate(logp, old, torch.tensor([1.0]), -0.1, 0.2)


def test_kl_estimators_match_their_formulas_and_k1_k3_are_unbiased():
    """Per token k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1 (d = logp - ref); over 200,000 draws
    from p, k1 and k3 average to KL(p || q) within 1%, and k3 is never negative."""
    d = torch.tensor([[-1.0, 0.0, 0.5]])
    assert torch.equal(kl_penalty(d, torch.zeros_like(d), "k1"), d)
    assert torch.allclose(kl_penalty(d, torch.zeros_like(d), "k2"), d * d / 2)
    assert torch.allclose(kl_penalty(d, torch.zeros_like(d), "k3"), torch.exp(-d) + d - 1)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    kl = float((p * (p / q).log()).sum())
    draws = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, lq = p.log()[draws], q.log()[draws]
    for kind in ("k1", "k3"):
        assert math.isclose(float(kl_penalty(lp, lq, kind).mean()), kl, rel_tol=0.01), kind
    assert float(kl_penalty(lp, lq, "k3").min()) >= 0
    with pytest.raises(ValueError, match="--grpo-kl-estimator"):
        kl_penalty(lp, lq, "k4")


def test_aggregations_and_their_global_counts():
    """Two sequences of 1 and 3 response tokens: token-mean weighs tokens, seq-mean-token-mean
    sequences, Dr. GRPO divides the token sum by N x constant; a rank's share with the global
    counts sums over ranks to the whole batch's value."""
    loss = torch.tensor([[4.0, 9.0, 9.0], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    assert aggregate(loss, mask).item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((4 + 2) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", constant=8).item() == pytest.approx(10 / 16)
    for kind in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = aggregate(loss, mask, kind, constant=8)
        parts = sum(
            aggregate(loss[i : i + 1], mask[i : i + 1], kind, tokens=4.0, sequences=2.0, constant=8) for i in (0, 1)
        )
        assert parts.item() == pytest.approx(whole.item(), rel=1e-12), kind
    with pytest.raises(ValueError, match="constant"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")


def test_token_weights_are_each_aggregations_closed_form():
    """Three rows of 3, 1 and 0 response tokens (T = 4), row 1 filtered out in the second case:
    token-mean weighs each kept token 1/K; seq-mean-token-mean 1/(|y_n| S); the Dr. GRPO norm
    1/(S C); and the weighted sum equals ``aggregate`` of the same rows."""
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4) - 4.5
    third, half = 1 / 3, 1 / 2
    want = {
        "token-mean": [[0.25, 0.25, 0.25, 0], [0, 0.25, 0, 0], [0] * 4],
        "seq-mean-token-mean": [[third * half] * 3 + [0], [0, 1 * half, 0, 0], [0] * 4],
        "seq-mean-token-sum-norm": [[1 / (2 * 8)] * 3 + [0], [0, 1 / (2 * 8), 0, 0], [0] * 4],
    }
    for kind, w in want.items():
        got = token_weights(mask, kind, constant=8.0)
        assert torch.allclose(got, torch.tensor(w, dtype=torch.float64), rtol=1e-15, atol=0), kind
        agg = aggregate(x, mask, kind, sequences=2.0, constant=8.0)
        assert math.isclose(float((got * x).sum()), float(agg), rel_tol=1e-13), kind
    keep = torch.tensor([True, False, True])
    assert torch.allclose(
        token_weights(mask, "token-mean", keep=keep)[0, :3], torch.full((3,), third, dtype=torch.float64)
    )
    assert float(token_weights(mask, "seq-mean-token-mean", keep=keep)[1].abs().sum()) == 0.0
    assert torch.allclose(
        token_weights(mask, "seq-mean-token-mean", keep=keep)[0, :3], torch.full((3,), third, dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="positive constant"):
        token_weights(mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="--grpo-loss-agg"):
        token_weights(mask, "mean")
