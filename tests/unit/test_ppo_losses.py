"""``megazero.post_training.ppo``: shaped rewards, GAE, whitening, the clipped value loss, the KL
controllers and explained variance against hand-computed values and a naive GAE written here from
the sum form of Schulman et al. 2016, eq. 16."""

from __future__ import annotations

import math

import pytest
import torch

from megazero.post_training.ppo import (
    AdaptiveKLController,
    FixedKLController,
    explained_variance,
    gae,
    masked_moments,
    shaped_rewards,
    value_loss,
    whiten,
)

GARBAGE = 1e6


def naive_gae(rewards, values, mask, gamma, lam):
    """Per row: the masked tokens in order, delta_t = r_t + gamma V_{t+1} - V_t (V = 0 past the
    end), A_t = sum_l (gamma lam)^l delta_{t+l} (eq. 16 as a sum, not the recursion)."""
    adv = torch.zeros(rewards.shape, dtype=torch.float64)
    for n in range(rewards.shape[0]):
        cols = [t for t in range(rewards.shape[1]) if mask[n, t]]
        r = [float(rewards[n, t]) for t in cols]
        v = [float(values[n, t]) for t in cols] + [0.0]
        delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(r))]
        for k, t in enumerate(cols):
            adv[n, t] = sum((gamma * lam) ** j * delta[k + j] for j in range(len(r) - k))
    return adv


def two_rows():
    """Row 0: 3 response tokens, row 1: 1; the tail holds GARBAGE."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    rewards = torch.tensor([[0.1, -0.2, 1.0, GARBAGE], [2.0, GARBAGE, GARBAGE, GARBAGE]])
    values = torch.tensor([[0.5, 0.3, 0.6, GARBAGE], [1.5, GARBAGE, GARBAGE, GARBAGE]])
    return rewards, values, mask


def test_gae_on_two_ragged_rows_by_hand():
    """gamma 0.9, lam 0.8 (gamma lam = 0.72). Row 0: delta_2 = 1.0 - 0.6 = 0.4,
    delta_1 = -0.2 + 0.9 * 0.6 - 0.3 = 0.04, delta_0 = 0.1 + 0.9 * 0.3 - 0.5 = -0.13;
    A_2 = 0.4, A_1 = 0.04 + 0.72 * 0.4 = 0.328, A_0 = -0.13 + 0.72 * 0.328 = 0.10616;
    returns A + V = 0.60616, 0.628, 1.0. Row 1: A = 2.0 - 1.5 = 0.5, return 2.0. The garbage in the
    masked tail reads into nothing: advantages and returns there are 0."""
    rewards, values, mask = two_rows()
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    want_adv = torch.tensor([[0.10616, 0.328, 0.4, 0.0], [0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    want_ret = torch.tensor([[0.60616, 0.628, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert adv.dtype == ret.dtype == torch.float64
    assert torch.allclose(adv, want_adv, rtol=0, atol=1e-7)
    assert torch.allclose(ret, want_ret, rtol=0, atol=1e-7)
    assert torch.allclose(adv, naive_gae(rewards, values, mask, 0.9, 0.8), rtol=0, atol=1e-12)
    clean_r, clean_v = rewards * mask, values * mask
    adv0, ret0 = gae(clean_r, clean_v, mask, 0.9, 0.8)
    assert torch.equal(adv0, adv) and torch.equal(ret0, ret)


def test_gae_matches_the_naive_sum_on_random_ragged_rows_and_skips_left_padding():
    """Seven rows of lengths 1..7 in T = 7 with garbage after each row's end; a row shifted right
    behind masked-out positions (left padding) gets the same advantages, shifted."""
    g = torch.Generator().manual_seed(0)
    N, T = 7, 7
    lengths = torch.arange(1, N + 1)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rewards = torch.where(mask > 0, torch.randn(N, T, generator=g), GARBAGE)
    values = torch.where(mask > 0, torch.randn(N, T, generator=g), -GARBAGE)
    adv, ret = gae(rewards, values, mask, 0.95, 0.9)
    assert torch.allclose(adv, naive_gae(rewards, values, mask, 0.95, 0.9), rtol=0, atol=1e-12)
    assert torch.allclose(ret, torch.where(mask > 0, adv + values.double(), 0.0), rtol=0, atol=0)
    left = torch.roll(mask[2:3], 2, dims=1)  # row of 3 tokens at positions 2..4
    a_left, _ = gae(torch.roll(rewards[2:3], 2, dims=1), torch.roll(values[2:3], 2, dims=1), left, 0.95, 0.9)
    assert torch.equal(a_left[0, 2:5], adv[2, :3])
    assert torch.equal(a_left[0, [0, 1, 5, 6]], torch.zeros(4, dtype=torch.float64))


def test_gae_limits_monte_carlo_and_one_step_td():
    """gamma = lam = 1: A_t = sum of rewards from t on - V_t (Monte Carlo); lam = 0:
    A_t = r_t + gamma V_{t+1} - V_t with V = 0 after the last token (one-step TD)."""
    rewards, values, mask = two_rows()
    adv, _ = gae(rewards, values, mask, 1.0, 1.0)
    mc = torch.tensor([[0.9 - 0.5, 0.8 - 0.3, 1.0 - 0.6, 0.0], [2.0 - 1.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(adv, mc, rtol=0, atol=1e-7)
    adv, _ = gae(rewards, values, mask, 0.9, 0.0)
    td = torch.tensor([[-0.13, 0.04, 0.4, 0.0], [0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(adv, td, rtol=0, atol=1e-7)


def test_shaped_reward_lands_on_the_last_real_token_beside_the_kl_penalty():
    """k1 KL per token = logp - ref; reward = -0.1 KL on each response token, + the score (row 1's
    -5 clipped to -3) on the last response token, 0 on the EOD-like tail whose log-probs are garbage."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    logp = torch.tensor([[-1.0, -0.5, -2.0, GARBAGE], [-0.3, GARBAGE, GARBAGE, GARBAGE]])
    ref = torch.tensor([[-1.5, -0.5, -1.0, 0.0], [-0.1, 0.0, 0.0, 0.0]])
    out = shaped_rewards(torch.tensor([2.0, -5.0]), logp, ref, mask, 0.1, clip_reward=3.0)
    want = torch.tensor([[-0.05, 0.0, 0.1 + 2.0, 0.0], [0.02 - 3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(out, want, rtol=0, atol=1e-7)
    unclipped = shaped_rewards(torch.tensor([2.0, -5.0]), logp, ref, mask, 0.1)
    assert unclipped[1, 0].item() == pytest.approx(0.02 - 5.0, abs=1e-7)
    k3 = shaped_rewards(torch.tensor([0.0, 0.0]), logp, ref, mask, 1.0, "k3")
    assert k3[0, 0].item() == pytest.approx(-(math.exp(-0.5) + 0.5 - 1), abs=1e-7)
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        shaped_rewards(torch.tensor([1.0, 1.0]), logp, ref, torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]), 0.1)


def test_whiten_gives_zero_mean_unit_variance_and_global_statistics_split_over_ranks():
    """Over the masked tokens the result has mean 0 and population variance 1 (to eps); without
    shift_mean the mean stays; two halves whitened with the summed masked_moments equal the whole."""
    g = torch.Generator().manual_seed(1)
    x = 3.0 + 2.0 * torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).long()
    mask[:, 0] = 1
    on = mask > 0
    w = whiten(torch.where(on, x, GARBAGE), mask)
    assert w[on].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert w[on].var(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(w[~on], torch.zeros(int((~on).sum()), dtype=torch.float64))
    kept = whiten(x, mask, shift_mean=False)
    assert kept[on].mean().item() == pytest.approx(x[on].double().mean().item(), abs=1e-12)
    n, s1, s2 = (masked_moments(x[:3], mask[:3]) + masked_moments(x[3:], mask[3:])).tolist()
    mean, var = s1 / n, s2 / n - (s1 / n) ** 2
    parts = torch.cat([whiten(x[:3], mask[:3], mean=mean, var=var), whiten(x[3:], mask[3:], mean=mean, var=var)])
    assert torch.allclose(parts, whiten(x, mask), rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="both mean and var"):
        whiten(x, mask, mean=0.0)


def test_value_loss_takes_the_larger_branch_on_both_sides():
    """Old value 0, eps 0.2. V = 1, R = 0.5: unclipped 0.25 > clipped (0.2 - 0.5)^2 = 0.09 -> 0.125;
    V = 1, R = 2: clipped (0.2 - 2)^2 = 3.24 > 1 -> 1.62; mirrored below: V = -1, R = -2 -> 1.62,
    V = -1, R = -0.5 -> 0.125; V = 0.1 inside the range, R = 1 -> 0.405. The clipped branch passes
    no gradient (d/dV = 0), the unclipped one V - R."""
    v = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.1]], requires_grad=True)
    old = torch.zeros(1, 5)
    R = torch.tensor([[0.5, 2.0, -2.0, -0.5, 1.0]])
    loss = value_loss(v, old, R, 0.2)
    assert torch.allclose(loss, torch.tensor([[0.125, 1.62, 1.62, 0.125, 0.405]]), rtol=0, atol=1e-6)
    loss.sum().backward()
    assert torch.allclose(v.grad, torch.tensor([[0.5, 0.0, 0.0, -0.5, -0.9]]), rtol=0, atol=1e-6)
    plain = value_loss(v.detach(), old, R, None)
    assert torch.allclose(plain, torch.tensor([[0.125, 0.5, 0.5, 0.125, 0.405]]), rtol=0, atol=1e-6)


def test_adaptive_kl_controller_follows_the_closed_form_and_round_trips_its_state():
    """init 0.2, target 6, horizon 10,000, 256 samples a step; KLs 12, 3, 6.6 give errors
    +0.2 (clipped from 1), -0.2 (clipped from -0.5), +0.1: value = 0.2 (1 + 0.2 x 0.0256)
    (1 - 0.2 x 0.0256) (1 + 0.1 x 0.0256)."""
    c = AdaptiveKLController(0.2, 6.0, 10_000)
    for kl in (12.0, 3.0, 6.6):
        c.update(kl, 256)
    assert c.value == pytest.approx(0.2 * 1.00512 * 0.99488 * 1.00256, rel=1e-12)
    resumed = AdaptiveKLController(0.2, 6.0, 10_000)
    resumed.load(c.state())
    c.update(9.0, 64)
    resumed.update(9.0, 64)
    assert resumed.value == c.value
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05 and fixed.state() == {"value": 0.05}
    with pytest.raises(ValueError, match="not finite|nan"):
        c.update(math.nan, 1)


def test_explained_variance_by_hand():
    """R = 1, 2, 3, V = 1, 2, 2 on the masked tokens: Var[R - V] = 2/9, Var[R] = 2/3 -> 2/3; V = R
    -> 1; constant R -> NaN."""
    R = torch.tensor([[1.0, 2.0, GARBAGE], [3.0, GARBAGE, GARBAGE]])
    V = torch.tensor([[1.0, 2.0, -GARBAGE], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert explained_variance(V, R, mask) == pytest.approx(2 / 3, abs=1e-12)
    assert explained_variance(R, R, mask) == 1.0
    assert math.isnan(explained_variance(V, torch.ones(2, 3), mask))


X = torch.zeros(2, 3)
M = torch.ones(2, 3)


@pytest.mark.parametrize(
    "call, flag",
    [
        (lambda: gae(X, X, M, 1.1, 0.9), "--gamma"),
        (lambda: gae(X, X, M, 0.9, -0.1), "--lam"),
        (lambda: gae(X, torch.zeros(2, 4), M, 0.9, 0.9), r"\[N, T\]"),
        (lambda: value_loss(X, X, X, 0.0), "--cliprange-value"),
        (lambda: value_loss(X, X, torch.zeros(3, 3), 0.2), r"\[N, T\]"),
        (lambda: AdaptiveKLController(0.1, 0.0, 10_000), "--kl-target"),
        (lambda: AdaptiveKLController(0.1, 6.0, -1), "--kl-horizon"),
        (lambda: AdaptiveKLController(-0.1, 6.0, 10_000), "--init-kl-coef"),
        (lambda: shaped_rewards(torch.zeros(2), X, X, M, -0.1), "--init-kl-coef"),
        (lambda: shaped_rewards(torch.zeros(2), X, X, M, 0.1, clip_reward=0.0), "--clip-reward-value"),
        (lambda: shaped_rewards(torch.zeros(2), X, X, M, 0.1, "k4"), "--kl-estimator"),
        (lambda: shaped_rewards(torch.zeros(3), X, X, M, 0.1), r"scores must be \[N\]"),
        (lambda: whiten(X, torch.zeros(2, 3)), "no masked token"),
    ],
)
def test_bad_settings_raise_naming_the_flag(call, flag):
    with pytest.raises(ValueError, match=flag):
        call()
