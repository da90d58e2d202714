"""The algebra of GRPO-family policy losses, as pure functions of per-token tensors (the
``--post-train grpo`` mode is to call them; every layout then only has to deliver the same
per-token log-probabilities and the same global counts).

Shapes: a rollout of P prompts with G samples each is ``N = P G`` rows, prompt-major (prompt i's
samples are rows ``i G .. i G + G - 1``, as ``rollout.rollout`` returns them); per-token tensors
are ``[N, T]`` over the response positions with ``mask`` ``[N, T]`` 1 on response tokens.

- Advantages per sequence from the group's rewards ``[N]`` (``group_advantages``):
  ``grpo`` (Shao et al. 2024, DeepSeekMath, sec. 4.1.2): ``(r - mean) / (std + eps)`` with the
  group's standard deviation (Bessel-corrected, as TRL and verl compute it); ``dr_grpo`` (Liu et
  al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1): ``r - mean`` without the division,
  which biases toward groups of low variance; ``rloo`` (Ahmadian et al. 2024, sec. 3.2):
  ``r - mean of the other G - 1`` = ``G / (G - 1) (r - mean)``. A group whose rewards are all
  equal gets advantage exactly 0 (it teaches nothing); ``zero_variance_groups`` marks them so a
  caller can leave them out of the loss's denominator (DAPO's dynamic sampling keeps only
  informative groups, Yu et al. 2025, sec. 3.2).
- The clipped surrogate per token (``clipped_surrogate``; Schulman et al. 2017, eq. 7):
  ``-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``, ``rho = exp(logp - old_logp)``, with
  asymmetric bounds (DAPO's clip-higher, Yu et al. 2025, sec. 3.1).
- KL to the reference per token (``kl_penalty``; Schulman 2020, "Approximating KL Divergence"):
  ``k1 = logp - ref``, ``k2 = (logp - ref)^2 / 2``, ``k3 = exp(ref - logp) - (ref - logp) - 1``
  (unbiased and non-negative; DeepSeekMath's choice), for samples drawn from the policy.
- Aggregation of a per-token loss to the step's scalar (``aggregate``), the choice the
  loss-normalisation bugs of verl, NeMo-RL and TRL were about: ``token-mean`` (every response
  token of the global batch weighs the same: sum / global token count; DAPO, sec. 3.3),
  ``seq-mean-token-mean`` (each sequence's token mean, then the mean over sequences: the original
  GRPO), ``seq-mean-token-sum-norm`` (Dr. GRPO: the token sum over sequences times a constant,
  the generation budget, so the normaliser depends on neither length nor batch).
"""

from __future__ import annotations

from typing import Optional

import torch

ADVANTAGES = ("grpo", "dr_grpo", "rloo")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(
            f"--grpo-group-size {group_size}: needs at least 2 samples per prompt and divides the "
            f"{rewards.numel()} rewards"
        )
    return rewards.double().reshape(-1, group_size)  # (P, G)


def group_advantages(rewards: torch.Tensor, group_size: int, kind: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Each sample's advantage ``[N]`` float64 from the rewards ``[N]`` (prompt-major groups of
    ``group_size``), by ``kind`` (module docstring). Raises ValueError for another kind, or a
    group size below 2 or not dividing N."""
    if kind not in ADVANTAGES:
        raise ValueError(f"--grpo-advantage {kind}: not one of {', '.join(ADVANTAGES)}")
    r = _groups(rewards, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if kind == "dr_grpo":
        out = centred
    elif kind == "rloo":
        out = centred * (group_size / (group_size - 1))
    else:
        out = centred / (r.std(dim=1, keepdim=True) + eps)
    return out.reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N]`` bool: the samples whose group's rewards are all equal (advantage 0 by every kind)."""
    r = _groups(rewards, group_size)
    same = (r == r[:, :1]).all(dim=1, keepdim=True)  # (P, 1)
    return same.expand_as(r).reshape(-1)


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Per-token loss ``[N, T]`` (module docstring) from the policy's log-probs ``logp`` (with
    gradient), the rollout's ``old_logp`` and the advantages (``[N]``, one per sequence, or
    ``[N, T]``). Raises ValueError for a negative bound."""
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"--grpo-clamp-eps-lower {eps_low} / --grpo-clamp-eps-upper {eps_high}: must be >= 0")
    a = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    a = a.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    return -torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) ``[N, T]`` at tokens drawn from the policy
    (module docstring). Raises ValueError for another kind."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"--grpo-kl-estimator {kind}: not one of {', '.join(KL_ESTIMATORS)}")
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    return torch.exp(-d) + d - 1


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "token-mean",
    *,
    tokens: Optional[float] = None,
    sequences: Optional[float] = None,
    constant: Optional[float] = None,
) -> torch.Tensor:
    """The step's loss (a float64 scalar) from ``per_token`` ``[N, T]`` and ``mask`` ``[N, T]``
    (module docstring). ``tokens`` / ``sequences``: the global batch's response-token and
    sequence counts (default: this batch's), so that a rank's share of a global ``token-mean`` or
    ``seq-mean-*`` is its sum over the global count, whatever the split; ``constant``: Dr. GRPO's
    normaliser (required for ``seq-mean-token-sum-norm``, e.g. ``--max-new-tokens``). A row
    without response tokens adds nothing. Raises ValueError for another kind or a missing
    constant."""
    if kind not in AGGREGATIONS:
        raise ValueError(f"--grpo-loss-agg {kind}: not one of {', '.join(AGGREGATIONS)}")
    m = mask.to(torch.float64)
    summed = (per_token.double() * m).sum(dim=1)  # (N,)
    if kind == "token-mean":
        return summed.sum() / (m.sum().clamp_min(1.0) if tokens is None else max(tokens, 1.0))
    n = float(per_token.shape[0]) if sequences is None else sequences
    if kind == "seq-mean-token-mean":
        return (summed / m.sum(dim=1).clamp_min(1)).sum() / max(n, 1.0)
    if constant is None or constant <= 0:
        raise ValueError("--grpo-loss-agg seq-mean-token-sum-norm needs a positive constant (the generation budget)")
    return summed.sum() / (max(n, 1.0) * constant)


def token_weights(
    mask: torch.Tensor,
    kind: str = "token-mean",
    *,
    keep: Optional[torch.Tensor] = None,
    constant: Optional[float] = None,
) -> torch.Tensor:
    """Each response token's weight ``[N, T]`` float64 in the step's loss under ``kind``, so that
    ``aggregate(per_token, mask, kind, ...) == (token_weights(...) * per_token).sum()`` for the
    N rows of one optimizer step (the closed forms below; ``keep`` ``[N]`` bool, default all:
    the rows that count, e.g. without zero-variance groups, whose tokens weigh 0 and which leave
    the denominators):

    - ``token-mean``: ``1 / K`` with K the kept response tokens;
    - ``seq-mean-token-mean``: ``1 / (|y_n| S)`` with ``|y_n|`` row n's tokens, S the kept rows;
    - ``seq-mean-token-sum-norm``: ``1 / (S C)`` with C = ``constant`` (Dr. GRPO's budget).

    Computed once over the whole step's rows, then cut by any layout: a rank's loss is its
    tokens' weighted sum, so splitting rows over micro-batches or ranks changes nothing.
    Raises ValueError as ``aggregate``."""
    if kind not in AGGREGATIONS:
        raise ValueError(f"--grpo-loss-agg {kind}: not one of {', '.join(AGGREGATIONS)}")
    m = mask.to(torch.float64)
    if keep is not None:
        m = m * keep.to(torch.float64).unsqueeze(1)
    rows = float((m.sum(dim=1) > 0).sum())
    if kind == "token-mean":
        return m / max(float(m.sum()), 1.0)
    if kind == "seq-mean-token-mean":
        return m / m.sum(dim=1, keepdim=True).clamp_min(1.0) / max(rows, 1.0)
    if constant is None or constant <= 0:
        raise ValueError("--grpo-loss-agg seq-mean-token-sum-norm needs a positive constant (the generation budget)")
    return m / (max(rows, 1.0) * constant)
