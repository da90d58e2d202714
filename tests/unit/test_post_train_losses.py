"""``megazero.post_training.losses``: each preference loss against its paper's formula written
out per pair with Python floats, and the errors for a missing reference or an unknown loss."""

import math
import random

import pytest
import torch

from megazero.post_training.losses import PreferenceLoss, preference_losses


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _pairs(n=6, seed=0):
    rng = random.Random(seed)
    policy = [rng.uniform(-40, -5) for _ in range(2 * n)]
    reference = [p + rng.uniform(-3, 3) for p in policy]
    lengths = [float(rng.randint(1, 9)) for _ in range(2 * n)]
    return policy, reference, lengths


def _by_hand(s: PreferenceLoss, policy, reference, lengths):
    """Per pair (loss, chosen reward, rejected reward) from the papers' equations."""
    out = []
    for j in range(len(policy) // 2):
        pw, pl, lw, ll = policy[2 * j], policy[2 * j + 1], lengths[2 * j], lengths[2 * j + 1]
        e, b = s.label_smoothing, s.beta
        if s.kind == "simpo":  # Meng et al. 2024, eq. 6
            rw, rl = b * pw / lw, b * pl / ll
            x = rw - rl - s.simpo_gamma
            loss = -(1 - e) * _log_sigmoid(x) - e * _log_sigmoid(-x)
        else:
            hw, hl = pw - reference[2 * j], pl - reference[2 * j + 1]
            rw, rl = b * hw, b * hl
            if s.kind == "sigmoid":  # Rafailov et al. 2023, eq. 7; cDPO's flip probability e
                loss = -(1 - e) * _log_sigmoid(b * (hw - hl)) - e * _log_sigmoid(-b * (hw - hl))
            elif s.kind == "ipo":  # Azar et al. 2023, eq. 17, on length-averaged log-ratios
                loss = (hw / lw - hl / ll - 1 / (2 * b)) ** 2
            else:  # hinge (SLiC-HF)
                loss = max(0.0, 1 - b * (hw - hl))
        if s.sft_weight:  # RPO: the chosen response's mean token NLL
            loss += s.sft_weight * (-pw / lw)
        out.append((loss, rw, rl))
    return out


CASES = [
    PreferenceLoss("sigmoid", beta=0.1),
    PreferenceLoss("sigmoid", beta=0.3, label_smoothing=0.2, sft_weight=0.7),
    PreferenceLoss("ipo", beta=0.5),
    PreferenceLoss("hinge", beta=0.2),
    PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.4, label_smoothing=0.1),
]


@pytest.mark.parametrize("s", CASES, ids=lambda s: f"{s.kind}-ls{s.label_smoothing}-sft{s.sft_weight}")
def test_each_loss_is_its_papers_formula(s):
    policy, reference, lengths = _pairs()
    loss, rw, rl = preference_losses(
        s,
        torch.tensor(policy, dtype=torch.float64),
        torch.tensor(reference, dtype=torch.float64),
        torch.tensor(lengths),
    )
    for j, (want, want_w, want_l) in enumerate(_by_hand(s, policy, reference, lengths)):
        assert math.isclose(float(loss[j]), want, rel_tol=1e-12, abs_tol=1e-12), (j, float(loss[j]), want)
        assert math.isclose(float(rw[j]), want_w, rel_tol=1e-12) and math.isclose(float(rl[j]), want_l, rel_tol=1e-12)


def test_the_gradient_of_dpo_is_its_closed_form():
    """d/d pi_w of -log sig(beta z) is -beta sig(-beta z) (Rafailov et al. 2023, sec. 4)."""
    policy, reference, lengths = _pairs(3)
    p = torch.tensor(policy, dtype=torch.float64, requires_grad=True)
    loss, _, _ = preference_losses(
        PreferenceLoss(beta=0.25), p, torch.tensor(reference, dtype=torch.float64), torch.tensor(lengths)
    )
    loss.sum().backward()
    for j in range(3):
        z = (policy[2 * j] - reference[2 * j]) - (policy[2 * j + 1] - reference[2 * j + 1])
        want = -0.25 / (1 + math.exp(0.25 * z))
        assert math.isclose(float(p.grad[2 * j]), want, rel_tol=1e-12)
        assert math.isclose(float(p.grad[2 * j + 1]), -want, rel_tol=1e-12)


def test_a_missing_reference_and_an_unknown_loss_are_refused():
    p, lengths = torch.zeros(4, dtype=torch.float64), torch.ones(4)
    with pytest.raises(ValueError, match="--dpo-loss sigmoid needs the reference"):
        preference_losses(PreferenceLoss("sigmoid"), p, None, lengths)
    with pytest.raises(ValueError, match="--dpo-loss kto: not one of"):
        preference_losses(PreferenceLoss("kto"), p, p, lengths)
    loss, _, _ = preference_losses(PreferenceLoss("simpo", simpo_gamma=0.0), p, None, lengths)  # reference-free
    assert torch.allclose(loss, torch.full((2,), math.log(2), dtype=torch.float64))
