"""What each ZeRO stage shards and holds, answered without processes, tensors or torch.

Rajbhandari et al., SC'20, sec. 5: stage 1 shards the optimizer states (P_os), stage 2 the
gradients too (P_os+g), stage 3 the parameters too (P_os+g+p); stage 0 is plain data
parallelism. One :class:`ShardingPolicy` subclass per stage answers the questions the config
checks, the planner and the optimizer's accounting ask (what is sharded, how many reduce buckets
the backward stages, what is gathered after the step, the paper's byte formula); the
strategies of :mod:`megazero.data_parallel.sharding` and :mod:`megazero.data_parallel.zero3`
inherit these answers and add the mechanics. The integer a user sets (``--zero-stage``,
DeepSpeed's ``zero_optimization.stage``) reaches a policy through :func:`sharding_policy`; code
asks the policy, never compares stage numbers. This module imports nothing (the config package,
which must not import torch, asks it too).
"""

from __future__ import annotations

from typing import Optional

BUCKETS_IN_FLIGHT = 2
"""Started reduce-scatters a stage-2/3 backward lets wait at once (``DataParallel``'s default)."""


class ShardingPolicy:
    """The answers of one ZeRO stage (class attributes and class methods: no instance needed).

    ``stage``: the user's setting this policy answers to; ``shards_optimizer``: each data-parallel
    rank owns a disjoint 1/N of the fp32 main params and Adam moments (so norms sum over the
    world); ``shards_grads``: only the 1/N gradient shard persists; ``shards_params``: only the
    1/N parameter shard persists, whole parameters gathered around each unit's compute;
    ``gathers_after_step``: the updated parameters are all-gathered after the optimizer step
    (what ``--overlap-param-gather`` overlaps); ``remedy``: the flag that shards more, for a
    message when the model states do not fit (None: nothing shards more).
    """

    stage = -1
    shards_optimizer = True
    shards_grads = False
    shards_params = False
    gathers_after_step = True
    remedy: Optional[str] = None

    @classmethod
    def staging_slots(cls, buckets_in_flight: int) -> int:
        """Reduce buckets the backward may hold staged at once (0: it reduces in place), with
        ``buckets_in_flight`` started reductions allowed to wait (``--buckets-in-flight``)."""
        return 0

    @classmethod
    def owned_numel(cls, numel: float, n: int) -> float:
        """Elements of ``numel`` whose optimizer state one of ``n`` data-parallel ranks owns."""
        return numel / n if cls.shards_optimizer else numel

    @classmethod
    def formula_bytes(cls, psi: float, n: int, param_bytes: int, grad_bytes: int, main_bytes: int) -> float:
        """Persistent model-state bytes per rank for ``psi`` elements over ``n`` data-parallel
        ranks: parameters (``param_bytes`` each) + gradients (``grad_bytes``) + fp32 main params
        (``main_bytes``) and the two fp32 Adam moments (8), each divided by ``n`` where sharded.
        Stages 1 and 2 here; stages 0 and 3, which shard all or nothing, write it in one term."""
        grads = grad_bytes * psi / (n if cls.shards_grads else 1)
        return param_bytes * psi + grads + (main_bytes + 8) * psi / n


class Replicated(ShardingPolicy):
    """Stage 0, plain data parallelism: every rank keeps and updates everything in place."""

    stage = 0
    shards_optimizer = False
    gathers_after_step = False
    remedy = "--zero-stage 2 (shards gradients and Adam states over --dp)"

    @classmethod
    def formula_bytes(cls, psi, n, param_bytes, grad_bytes, main_bytes):
        return (param_bytes + grad_bytes + main_bytes + 8) * psi


class ShardOptimizer(ShardingPolicy):
    """Stage 1 (P_os): the optimizer states sharded, the full gradient buffer kept."""

    stage = 1
    remedy = Replicated.remedy


class ShardGradients(ShardingPolicy):
    """Stage 2 (P_os+g): gradients sharded too; each reduce bucket is staged per micro-batch,
    up to ``buckets_in_flight`` waiting for their reduce-scatter, one filling and one spare."""

    stage = 2
    shards_grads = True
    remedy = "--zero-stage 3 (shards the parameters too)"

    @classmethod
    def staging_slots(cls, buckets_in_flight: int) -> int:
        return buckets_in_flight + 2


class ShardParameters(ShardGradients):
    """Stage 3 (P_os+g+p): parameters sharded too, gathered per unit around its compute; the
    optimizer updates the shard in place, so nothing is gathered after the step."""

    stage = 3
    shards_params = True
    gathers_after_step = False
    remedy = None

    @classmethod
    def formula_bytes(cls, psi, n, param_bytes, grad_bytes, main_bytes):
        return (param_bytes + grad_bytes + main_bytes + 8) * psi / n


POLICIES: dict[int, type[ShardingPolicy]] = {
    p.stage: p for p in (Replicated, ShardOptimizer, ShardGradients, ShardParameters)
}
"""The user's ZeRO stage -> its policy (each policy's ``stage``; the strategies extend these)."""


def sharding_policy(stage: int) -> type[ShardingPolicy]:
    """The policy class of ZeRO stage ``stage``. Raises ValueError for a stage without one."""
    if stage not in POLICIES:
        raise ValueError(f"zero_stage must be one of {sorted(POLICIES)}, got {stage}")
    return POLICIES[stage]


def stages_where(question: str) -> tuple[int, ...]:
    """The stage numbers whose policy answers ``question`` (an attribute name) with True, e.g.
    ``stages_where("shards_params") == (3,)``: for settings that only apply there."""
    return tuple(s for s, p in POLICIES.items() if getattr(p, question))
