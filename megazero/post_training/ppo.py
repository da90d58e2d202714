"""The algebra of PPO with a critic (InstructGPT's RLHF step, DeepSpeed-Chat's step 3), as pure
functions of per-token tensors; the ``--post-train ppo`` mode calls them
(``megazero.training.rl.ppo_advantages``). The policy's clipped surrogate is
``grpo.clipped_surrogate`` with per-token advantages, and a per-token loss becomes the step's
scalar with ``grpo.aggregate``.

Shapes follow ``grpo``: ``N`` rows, prompt-major, per-token tensors ``[N, T]`` over the response
positions with ``mask`` ``[N, T]`` non-zero on a row's response tokens (its EOD included) and 0 on
the padding after it. A row's episode is its masked tokens in order; a masked-out position is
skipped as if absent, whatever the tensors hold there.

- Rewards per token (``shaped_rewards``; Ouyang et al. 2022, eq. 2; Stiennon et al. 2020,
  eq. 1): ``-kl_coef * KL estimate`` at every response token (``grpo.kl_penalty``) plus the
  sequence's score on its last response token (``reward.last_token_mask``), the score optionally
  clipped to ``[-c, c]`` first (DeepSpeed-Chat's ``clip_reward_value``).
- Generalised advantage estimation (``gae``; Schulman et al. 2016, eq. 11-16):
  ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, with
  ``V = A = 0`` after the row's last token (the episode ends at its EOD or length limit);
  returns ``R_t = A_t + V_t`` are the critic's targets.
- Whitening (``whiten``): ``(x - mean) / sqrt(var + eps)`` over the masked tokens, with the
  population variance (DeepSpeed-Chat and OpenRLHF normalise the advantages so).
- The critic's loss (``value_loss``; PPO2's value clipping, as DeepSpeed-Chat's critic loss):
  ``0.5 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)``.
- The KL coefficient (``AdaptiveKLController``; Ziegler et al. 2019, sec. 2.2): a proportional
  controller toward a target KL, or ``FixedKLController``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megazero.post_training.grpo import KL_ESTIMATORS, kl_penalty
from megazero.post_training.reward import last_token_mask


def _same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"PPO tensors must be [N, T] of one shape; got {shapes}")


def _unit_interval(flag: str, x: float) -> None:
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{flag} {x}: must be in [0, 1]")


def shaped_rewards(
    scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
    clip_reward: Optional[float] = None,
) -> torch.Tensor:
    """Per-token rewards ``[N, T]`` float64 (module docstring): ``-kl_coef * kl_penalty(logp,
    ref_logp, kind)`` on every response token, plus ``scores[n]`` (``[N]``, clipped to
    ``[-clip_reward, clip_reward]`` when given) on row n's last response token; 0 where ``mask``
    is 0. ``logp`` / ``ref_logp`` ``[N, T]``: the rollout policy's and the reference's log-probs
    (nats) of the sampled tokens. Raises ValueError for a shape mismatch, a row without a
    response token, ``kl_coef < 0`` (``--init-kl-coef``), ``clip_reward <= 0``
    (``--clip-reward-value``) or another estimator (``--kl-estimator``)."""
    _same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    if scores.shape != (mask.shape[0],):
        raise ValueError(f"scores must be [N] = [{mask.shape[0]}]; got {tuple(scores.shape)}")
    if kl_coef < 0:
        raise ValueError(f"--init-kl-coef {kl_coef}: must be >= 0")
    if clip_reward is not None and clip_reward <= 0:
        raise ValueError(f"--clip-reward-value {clip_reward}: must be > 0 (or unset for no clipping)")
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"--kl-estimator {kind}: not one of {', '.join(KL_ESTIMATORS)}")
    on = mask > 0
    if not bool(on.any(dim=1).all()):
        rows = torch.nonzero(~on.any(dim=1)).flatten().tolist()
        raise ValueError(f"rows {rows} have no response token to put their score on")
    s = scores.double()
    if clip_reward is not None:
        s = s.clamp(-clip_reward, clip_reward)
    kl = kl_penalty(logp.double(), ref_logp.double(), kind)
    penalty = torch.where(on, -kl_coef * kl, torch.zeros_like(kl))  # a masked garbage log-prob stays out
    return penalty + last_token_mask(mask).double() * s.unsqueeze(1)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, each ``[N, T]`` float64, by generalised advantage estimation
    (module docstring) backwards over each row's masked tokens, rows of any lengths in one batch:
    after a row's last masked token ``V = 0`` and ``A = 0``; masked-out positions give 0 and their
    ``rewards`` / ``values`` are never read into a result. ``rewards`` ``[N, T]`` (e.g.
    ``shaped_rewards``), ``values`` ``[N, T]`` the critic's estimates at the same tokens.
    Raises ValueError for a shape mismatch or ``gamma`` / ``lam`` outside [0, 1] (``--gamma``,
    ``--lam``)."""
    _same_shape(rewards=rewards, values=values, mask=mask)
    _unit_interval("--gamma", gamma)
    _unit_interval("--lam", lam)
    r, v, on = rewards.double(), values.double(), mask > 0
    N, T = r.shape
    advantages = torch.zeros(N, T, dtype=torch.float64, device=r.device)
    next_value = torch.zeros(N, dtype=torch.float64, device=r.device)  # V of the next real token
    next_adv = torch.zeros_like(next_value)  # A of the next real token
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]  # (N,)
        a = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(on[:, t], a, 0.0)
        next_value = torch.where(on[:, t], v[:, t], next_value)
        next_adv = torch.where(on[:, t], a, next_adv)
    returns = torch.where(on, advantages + v, 0.0)
    return advantages, returns


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[3]`` float64: the count, sum and sum of squares of ``x`` ``[N, T]`` over the masked
    tokens. Summed over data-parallel ranks (one all-reduce), they give the global batch's
    ``mean = s1 / n`` and ``var = s2 / n - mean^2`` for ``whiten``."""
    on = mask > 0
    xs = torch.where(on, x.double(), 0.0)
    return torch.stack([on.double().sum(), xs.sum(), (xs * xs).sum()])


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    *,
    mean: Optional[float | torch.Tensor] = None,
    var: Optional[float | torch.Tensor] = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """``[N, T]`` float64: ``(x - mean) / sqrt(var + eps)`` on the masked tokens of ``x``
    ``[N, T]`` and 0 elsewhere; with ``shift_mean=False`` the mean is added back (only the scale
    changes). ``mean`` / ``var``: the statistics to use (both or neither; e.g. the global
    batch's, from ``masked_moments``); by default this batch's masked mean and population
    variance. Raises ValueError for a shape mismatch, only one of ``mean`` and ``var``, or no
    masked token to take statistics over."""
    _same_shape(x=x, mask=mask)
    if (mean is None) != (var is None):
        raise ValueError("whiten: give both mean and var (global statistics) or neither")
    on = mask > 0
    xd = x.double()
    if mean is None:
        n = on.sum()
        if int(n) == 0:
            raise ValueError("whiten: no masked token to take the mean and variance over")
        mean = torch.where(on, xd, 0.0).sum() / n
        var = torch.where(on, (xd - mean) ** 2, 0.0).sum() / n
    mean_t = torch.as_tensor(mean, dtype=torch.float64, device=x.device)
    var_t = torch.as_tensor(var, dtype=torch.float64, device=x.device)
    out = (xd - mean_t) * torch.rsqrt(var_t + eps)
    if not shift_mean:
        out = out + mean_t
    return torch.where(on, out, 0.0)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_range: Optional[float]
) -> torch.Tensor:
    """Per-token critic loss ``[N, T]`` in ``values``' dtype (module docstring):
    ``0.5 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)`` with ``eps = clip_range``,
    or ``0.5 (V - R)^2`` when ``clip_range`` is None. ``values`` (with gradient) are the critic's
    current estimates, ``old_values`` those of the rollout, ``returns`` the targets (``gae``);
    reduce with ``grpo.aggregate`` over the mask. Raises ValueError for a shape mismatch or
    ``clip_range <= 0`` (``--cliprange-value``)."""
    _same_shape(values=values, old_values=old_values, returns=returns)
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"--cliprange-value {clip_range}: must be > 0 (or unset for no clipping)")
    R = returns.to(values.dtype)
    unclipped = (values - R) ** 2
    if clip_range is None:
        return 0.5 * unclipped
    old = old_values.to(values.dtype)
    clipped = (torch.clamp(values, old - clip_range, old + clip_range) - R) ** 2
    return 0.5 * torch.maximum(unclipped, clipped)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` over the masked tokens (population variances): 1 for a
    perfect critic, 0 for one that predicts the mean return, negative for a worse one; NaN when
    the returns do not vary. Raises ValueError for a shape mismatch."""
    _same_shape(values=values, returns=returns, mask=mask)
    on = mask > 0
    n = on.sum().double()
    R = torch.where(on, returns.double(), 0.0)
    E = torch.where(on, returns.double() - values.double(), 0.0)

    def variance(y: torch.Tensor) -> float:
        mu = y.sum() / n
        return float(torch.where(on, (y - mu) ** 2, 0.0).sum() / n)

    var_r = variance(R) if int(n) else 0.0
    return 1.0 - variance(E) / var_r if var_r > 0 else math.nan


class FixedKLController:
    """A constant KL coefficient ``value`` (InstructGPT's and DeepSpeed-Chat's default).
    Raises ValueError for a negative coefficient (``--init-kl-coef``)."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"--init-kl-coef {kl_coef}: must be >= 0")
        self.value = float(kl_coef)

    def update(self, kl: float, n_steps: int) -> None:
        """Nothing changes."""

    def state(self) -> dict:
        """What a checkpoint keeps."""
        return {"value": self.value}

    def load(self, state: dict) -> None:
        """Continue from ``state()``."""
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", sec. 2.2: after
    a step whose samples' mean KL(policy || reference) was ``kl`` (nats per sequence, as the
    rewards sum it), over ``n_steps`` samples, ``e = clip(kl / target - 1, -0.2, 0.2)`` and
    ``value *= 1 + e * n_steps / horizon``: the coefficient grows while the KL is above the
    target and shrinks below it, by at most 20% per ``horizon`` samples. Raises ValueError for
    ``init_kl_coef < 0``, ``target <= 0`` or ``horizon <= 0`` (``--init-kl-coef``,
    ``--kl-target``, ``--kl-horizon``)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        super().__init__(init_kl_coef)
        if target <= 0:
            raise ValueError(f"--kl-target {target}: must be > 0")
        if horizon <= 0:
            raise ValueError(f"--kl-horizon {horizon}: must be > 0")
        self.target, self.horizon = float(target), float(horizon)

    def update(self, kl: float, n_steps: int) -> None:
        """One step's update (class docstring). Raises ValueError for a KL that is not a finite
        number or a negative ``n_steps``."""
        if not math.isfinite(kl):
            raise ValueError(f"adaptive KL controller: the measured KL is {kl}; the coefficient would be lost")
        if n_steps < 0:
            raise ValueError(f"adaptive KL controller: n_steps {n_steps} must be >= 0")
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
