"""Mixture-of-Experts routing: top-k routers, load-balancing losses, the aux-loss-free expert
bias and the capacity drop rule, as plain functions of one micro-batch's router logits
(the pieces the MoE layer, its expert-parallel dispatch and ``tests/support/reference.py``
share, so the oracle and every layout route with the same code).

Shapes: ``T`` tokens (all of a micro-batch's positions, flattened), ``E`` experts, ``k`` the
router's top-k. Flag names and meanings are Megatron-LM's (``--moe-router-topk``,
``--moe-router-score-function``, ``--moe-router-pre-softmax``,
``--moe-router-load-balancing-type``, ``--moe-aux-loss-coeff``, ``--moe-z-loss-coeff``,
``--moe-router-enable-expert-bias``, ``--moe-router-bias-update-rate``,
``--moe-expert-capacity-factor``, ``--moe-token-drop-policy``).

- Routing (:func:`route`): softmax scores, top-k after the softmax over all experts
  (``pre_softmax``) or a softmax over the k chosen logits (the default: Mixtral's form, and
  gpt-oss's ``GptOssTopKRouter`` on logits with the router's bias, :func:`router_logits`);
  sigmoid scores (DeepSeek-V3, section 2.1.2), the chosen k normalised to sum 1 when k > 1,
  with the expert bias added only to choose the experts, never to weight them.
  Group-limited routing (DeepSeek-V3 section 2.1.2's node-limited routing, Megatron-LM's
  ``--moe-router-num-groups`` / ``--moe-router-group-topk``): the E experts in G groups of
  E/G consecutive experts, each group scored by the sum of its two highest choice scores, the
  k experts chosen only among the ``group_topk`` best groups. ``scaling_factor`` (Megatron-LM's
  ``--moe-router-topk-scaling-factor``, DeepSeek-V3's ``routed_scaling_factor``) multiplies
  the combine weights.
- Load balancing, computed from the top-k assignment *before* any capacity drop (a drop must
  not hide the imbalance that caused it; Megatron-LM #1513 counted after):
  :func:`aux_loss` (Switch Transformer, Fedus et al. 2021, eq. 4-6, GShard's top-k form:
  ``E * sum_i f_i P_i``, ``f_i`` the fraction of the ``T k`` assignments that went to expert i,
  ``P_i`` the mean router probability of expert i), :func:`seq_aux_loss` (DeepSeek-V3 eq.
  17-20: the same per sequence, averaged over the sequences) and :func:`z_loss` (ST-MoE,
  Zoph et al. 2022, eq. 5: the mean squared log-sum-exp of the logits).
- Aux-loss-free balancing (DeepSeek-V3 section 2.1.2, Wang et al. 2024):
  :func:`expert_bias_update`, ``b_i += rate * sign(mean load - load_i)`` from the step's
  token counts.
- Capacity (:func:`expert_capacity`, :func:`capacity_keep`): ``ceil(T k / E * F)`` slots per
  expert; the assignments over it are dropped by lowest probability (``probs``) or latest
  position (``position``), ties to the earlier token.
- :class:`AuxLossBackward`: the gradient of an auxiliary loss enters the backward of the
  layer's output (the output itself unchanged), so the losses need no second path through
  the pipeline schedule (Megatron-core's ``MoEAuxLossAutoScaler`` does the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


@dataclass
class Routing:
    """One micro-batch's routing decision.

    ``probs [T, k]`` (fp32) the weights the chosen experts' outputs are combined with;
    ``experts [T, k]`` (int64) the chosen experts, in descending order of choice score;
    ``scores [T, E]`` (fp32) every expert's probability for the load-balancing losses
    (softmax over all experts, or the sigmoid scores normalised per token).
    """

    probs: torch.Tensor
    experts: torch.Tensor
    scores: torch.Tensor


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, dtype: str = "fp32", bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The router's logits ``x [..., H] @ weight[E, H]^T (+ bias [E]) -> [..., E]``, in fp32
    (``dtype`` ``"fp32"``: inputs, weight and bias cast up, fp32 accumulation and output, the
    gradient cast back to their dtypes by autograd) or in the model dtype (``"model"``). A bf16
    GEMM rounds its output to 8 significant bits, so logits that differ by less than that become
    exact ties, which ``route`` gives to the lower-numbered expert: the fp32 GEMM keeps them apart
    (Megatron-LM's ``--moe-router-dtype fp32``). ``bias``: the router's learnable bias
    (``--moe-router-linear-bias``; gpt-oss's ``router.bias``), None = none.
    Raises ValueError for another ``dtype``."""
    if dtype == "model":
        return F.linear(x, weight, bias)
    if dtype != "fp32":
        raise ValueError(f"--moe-router-dtype {dtype!r}: one of fp32, model")
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def route(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    expert_bias: Optional[torch.Tensor] = None,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
) -> Routing:
    """Choose ``topk`` experts per token from ``logits [T, E]`` (computed in fp32).

    ``softmax``: with ``pre_softmax`` the k largest of ``softmax(logits)`` (weights not
    renormalised), else the k largest logits and a softmax over those k. ``sigmoid``:
    ``s = sigmoid(logits)``; the experts are the k largest of ``s + expert_bias`` (the bias
    steers the choice only), their weights ``s`` of the chosen, divided by their sum when
    k > 1 (transformers' DeepseekV3 divides when ``norm_topk_prob``, DeepSeek-V3's setting,
    so the two agree for k > 1; for k = 1 megazero keeps ``s`` as Megatron-LM does, where
    the division would make every weight 1). Ties go to the lower expert index
    (``torch.topk`` on CPU and CUDA alike is not promised to, so the order is made explicit
    by a stable sort).

    ``num_groups`` G with ``group_topk`` (both or neither): the choice key (the biased
    sigmoid scores, the softmax probabilities under ``pre_softmax``, else the logits) of
    each of the G groups of E/G consecutive experts is summed over its two largest (its one
    when E/G = 1), the ``group_topk`` groups with the largest sums kept (ties to the lower
    group) and the k experts chosen among theirs only (:func:`group_mask`). The weights and
    ``scores`` are those of the ungrouped rule. ``scaling_factor``: the weights ``probs``
    times it (None = unscaled; ``scores`` unscaled).

    Raises ValueError for ``topk`` outside ``[1, E]``, an unknown ``score_function``, an
    ``expert_bias`` with softmax scores (Megatron-LM's aux-loss-free bias is defined for
    sigmoid scores) or of another shape than ``[E]``, and the group errors of
    :func:`check_groups`.
    """
    T, E = logits.shape
    if not 1 <= topk <= E:
        raise ValueError(f"--moe-router-topk {topk} must be in [1, --num-experts {E}]")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"--moe-router-score-function {score_function!r}: one of {', '.join(SCORE_FUNCTIONS)}")
    if expert_bias is not None and score_function != "sigmoid":
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if expert_bias is not None and tuple(expert_bias.shape) != (E,):
        raise ValueError(f"the expert bias has shape {tuple(expert_bias.shape)}, not ({E},)")
    if num_groups is not None or group_topk is not None:
        check_groups(E, topk, num_groups, group_topk)
    logits = logits.float()
    if score_function == "softmax":
        full = torch.softmax(logits, dim=-1)
        key = full if pre_softmax else logits
        experts = _choose(key, topk, num_groups, group_topk)
        chosen = key.gather(1, experts)
        probs = chosen if pre_softmax else torch.softmax(chosen, dim=-1)
        return Routing(_scaled(probs, scaling_factor), experts, full)
    s = torch.sigmoid(logits)
    key = s if expert_bias is None else s + expert_bias.float()
    experts = _choose(key, topk, num_groups, group_topk)
    chosen = s.gather(1, experts)
    probs = chosen / (chosen.sum(-1, keepdim=True) + 1e-20) if topk > 1 else chosen
    return Routing(_scaled(probs, scaling_factor), experts, s / (s.sum(-1, keepdim=True) + 1e-20))


def check_groups(num_experts: int, topk: int, num_groups: Optional[int], group_topk: Optional[int]) -> None:
    """Raise ValueError unless group-limited routing of ``topk`` of ``num_experts`` experts is
    well formed: ``num_groups`` and ``group_topk`` both given, ``num_groups`` dividing
    ``num_experts``, ``1 <= group_topk <= num_groups``, and the kept groups holding at least
    ``topk`` experts (``topk <= group_topk * num_experts / num_groups``)."""
    if num_groups is None or group_topk is None:
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together; fix: give both or neither")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"--moe-router-num-groups {num_groups} does not divide --num-experts {num_experts}; fix: choose a divisor"
        )
    if not 1 <= group_topk <= num_groups:
        raise ValueError(
            f"--moe-router-group-topk {group_topk} must be in [1, --moe-router-num-groups {num_groups}]; "
            "fix: choose one in that range"
        )
    per_group = num_experts // num_groups
    if topk > group_topk * per_group:
        raise ValueError(
            f"--moe-router-topk {topk} exceeds the {group_topk} x {per_group} experts of the kept groups; "
            "fix: raise --moe-router-group-topk"
        )


def group_mask(key: torch.Tensor, num_groups: int, group_topk: int) -> torch.Tensor:
    """Which experts lie in each token's ``group_topk`` best groups: bool ``[T, E]`` from the
    choice key ``key [T, E]``. A group's score is the sum of its two largest keys (DeepSeek-V3's
    and transformers' ``DeepseekV3TopkRouter``; Megatron-LM sums the top ``k / group_topk``,
    the same for DeepSeek-V3's 8 / 4; one key when a group has one expert); ties to the lower
    group. No checks (:func:`check_groups`)."""
    T, E = key.shape
    per_group = E // num_groups
    grouped = key.reshape(T, num_groups, per_group)  # (T, G, E/G)
    group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # (T, G)
    kept = _topk_indices(group_score, group_topk)  # (T, group_topk)
    mask = torch.zeros(T, num_groups, dtype=torch.bool, device=key.device).scatter_(1, kept, True)
    return mask.repeat_interleave(per_group, dim=1)  # (T, E)


def _choose(key: torch.Tensor, k: int, num_groups: Optional[int], group_topk: Optional[int]) -> torch.Tensor:
    """The k experts ``[T, k]`` of the largest ``key [T, E]``, among the kept groups' when grouped."""
    if num_groups is not None:
        key = key.masked_fill(~group_mask(key, num_groups, group_topk), float("-inf"))
    return _topk_indices(key, k)


def _scaled(probs: torch.Tensor, scaling_factor: Optional[float]) -> torch.Tensor:
    """``probs`` times ``scaling_factor``; the same tensor when it is None."""
    return probs if scaling_factor is None else probs * scaling_factor


def _topk_indices(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[T, k]`` of the k largest of ``key [T, E]`` per row, largest first, ties to
    the lower index (a stable descending sort)."""
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]


def assignment_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert ``[E]`` (int64) from ``experts [T, k]`` (each assignment
    counts once; before any drop; an index outside ``[0, E)``, e.g. -1 for a dropped one, is
    not counted). A ``scatter_add`` of ones, not ``torch.bincount``: on CUDA bincount reads the
    largest index on the host to size its output, a device sync per call; integer atomics make
    the sum exact in any order."""
    flat = experts.reshape(-1)
    inside = (flat >= 0) & (flat < num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=experts.device)
    counts.scatter_add_(0, torch.where(inside, flat, num_experts), torch.ones_like(flat, dtype=torch.int64))
    return counts[:num_experts]


def aux_loss(scores: torch.Tensor, experts: torch.Tensor, topk: int, coeff: float = 1.0) -> torch.Tensor:
    """Switch/GShard load-balancing loss of one group of tokens, 0-d fp32:
    ``coeff * E * sum_i f_i P_i`` with ``f_i = count_i / (T k)`` (``count`` from the top-k
    assignment ``experts [T, k]``, before any capacity drop) and ``P_i = mean_t scores[t, i]``
    (``scores [T, E]``). Its minimum, 1 x coeff, is a uniform assignment. Gradient flows into
    ``scores`` only (``f`` is a count)."""
    T, E = scores.shape
    f = assignment_counts(experts, E).to(scores.dtype) / (T * topk)
    return coeff * E * (f * scores.mean(0)).sum()


def seq_aux_loss(
    scores: torch.Tensor, experts: torch.Tensor, topk: int, seq_length: int, coeff: float = 1.0
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20): :func:`aux_loss` of each sequence
    (consecutive ``seq_length`` rows of ``scores [T, E]`` / ``experts [T, k]``; tokens in
    batch-major order) averaged over the ``T / seq_length`` sequences. Raises ValueError when
    ``T`` is not a multiple of ``seq_length``."""
    T, E = scores.shape
    if T % seq_length:
        raise ValueError(f"{T} tokens are not whole sequences of {seq_length}")
    B = T // seq_length
    one_hot = F.one_hot(experts.reshape(B, seq_length * topk), E).to(scores.dtype)  # [B, S k, E]
    f = one_hot.sum(1) / (seq_length * topk)  # [B, E]
    P = scores.reshape(B, seq_length, E).mean(1)  # [B, E]
    return coeff * E * (f * P).sum(-1).mean()


def z_loss(logits: torch.Tensor, coeff: float = 1.0) -> torch.Tensor:
    """Router z-loss (ST-MoE eq. 5), 0-d fp32: ``coeff * mean_t logsumexp(logits[t])^2`` of
    ``logits [T, E]``; keeps the router's logits small (fp16/bf16 round-off in the softmax)."""
    return coeff * torch.logsumexp(logits.float(), dim=-1).square().mean()


def expert_bias_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """The aux-loss-free bias after one step (DeepSeek-V3 section 2.1.2): ``bias + rate *
    sign(mean(counts) - counts)`` (an under-loaded expert's bias rises, an over-loaded one's
    falls, a balanced one's stays). ``counts [E]`` are the step's tokens per expert over every
    micro-batch and every rank that shares the router (summed before the call). fp32 ``[E]``."""
    c = counts.float()
    return bias + rate * torch.sign(c.mean() - c)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Slots per expert, ``ceil(T k / E * F)`` (Megatron-LM's ``get_capacity`` of the ``T k``
    assignments). Raises ValueError for ``capacity_factor <= 0``."""
    if not capacity_factor > 0:
        raise ValueError(f"--moe-expert-capacity-factor {capacity_factor} must be > 0")
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def capacity_keep(
    probs: torch.Tensor, experts: torch.Tensor, num_experts: int, capacity: int, policy: str = "probs"
) -> torch.Tensor:
    """Which assignments survive ``capacity`` slots per expert: bool ``[T, k]``.

    For each expert, of the assignments ``(t, j)`` with ``experts[t, j] == e``, keep the
    ``capacity`` with the highest ``probs[t, j]`` (``probs``) or the lowest token index ``t``
    (``position``); ties go to the lower token index. Raises ValueError for another policy.
    """
    if policy not in DROP_POLICIES:
        raise ValueError(f"--moe-token-drop-policy {policy!r}: one of {', '.join(DROP_POLICIES)}")
    T, k = experts.shape
    flat_e = experts.reshape(-1)
    token = torch.arange(T, device=experts.device).repeat_interleave(k)
    if policy == "probs":  # order: expert, then descending prob, then token
        order = torch.sort(token, stable=True).indices
        order = order[torch.sort(-probs.reshape(-1)[order].float(), stable=True).indices]
    else:
        order = torch.sort(token, stable=True).indices
    order = order[torch.sort(flat_e[order], stable=True).indices]
    sorted_e = flat_e[order]
    first = torch.searchsorted(sorted_e, torch.arange(num_experts, device=experts.device))
    rank_in_expert = torch.arange(T * k, device=experts.device) - first[sorted_e]
    keep = torch.empty(T * k, dtype=torch.bool, device=experts.device)
    keep[order] = rank_in_expert < capacity
    return keep.view(T, k)


class AuxLossBackward(torch.autograd.Function):
    """``y = AuxLossBackward.apply(x, loss)`` returns ``x`` unchanged; in the backward ``loss``
    receives the gradient ``scale`` (a 0-d tensor, or 1.0) so that ``d loss / d router`` is
    added to the router's gradient as if ``scale * loss`` had been added to the training loss.

    ``scale`` is set per micro-batch by the caller (:meth:`set_scale`): the loss scale of
    fp16 training divided by the divisor of the micro-batch's token-loss sum, so an auxiliary
    loss weighs the same in every layout."""

    _scale: torch.Tensor | float = 1.0

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        scale = AuxLossBackward._scale
        return grad, torch.ones_like(loss) * scale

    @staticmethod
    def set_scale(scale) -> None:
        """The factor the auxiliary losses' gradients get in the next backward passes."""
        AuxLossBackward._scale = scale
