"""The layouts a model can run in on N devices, for the planner's search (``python -m scripts.plan
--devices N``): every (tp, cp with its comm type, pp, dp, ZeRO stage, ZeRO shard size S,
recomputation) the settings allow (``layouts``), and the data-parallel bytes each rank sends off
its node per step under that layout (``dp_internode_bytes``). The memory of each layout is the
planner's (``megazero.planning.plan.plan_memory``); nothing here builds a model.
"""

from __future__ import annotations

from megazero.config import ConfigError, config_from_argv
from megazero.config.shape import check_context_parallel

#: recomputation settings searched, by name
RECOMPUTE = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform"],
}


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_options(base, tp: int, ranks: int) -> list[tuple[int, str]]:
    """(cp, comm type) pairs for ``ranks`` = devices / (tp x pp): cp = 1, and every divisor cp > 1
    of ``ranks`` that ``shape.check_context_parallel`` accepts (2 cp divides the sequence, with
    SP cp x tp does, a2a needs the heads divisible by tp x cp), with p2p and a2a. None at cp > 1
    when the run has attention dropout or --compile, which context parallelism refuses
    (``megazero.config.checks``)."""
    m = base.model
    options = [(1, "p2p")]
    if m.attention_dropout > 0 or base.train.compile:
        return options
    for cp in (d for d in _divisors(ranks) if d > 1):
        for comm in ("p2p", "a2a"):
            try:
                check_context_parallel(
                    seq_length=m.seq_length,
                    cp=cp,
                    tp=tp,
                    sequence_parallel=tp > 1,
                    comm_type=comm,
                    num_attention_heads=m.num_attention_heads,
                    num_query_groups=m.num_query_groups if m.group_query_attention else None,
                )
            except ConfigError:
                continue
            options.append((cp, comm))
    return options


def shard_options(zero: int, replicas: int, tp: int, gpus_per_node: int) -> list[int]:
    """ZeRO shard sizes S searched: the flat dp x cp (``replicas``), and at stages >= 1 one node's
    replicas (``gpus_per_node / tp``: consecutive replicas r' = cp_rank + cp dp_rank are tp global
    ranks apart) when that divides ``replicas`` and is smaller: hybrid sharding, whose
    all-gathers and reduce-scatters stay inside the node."""
    node = gpus_per_node // tp if gpus_per_node % tp == 0 else 0
    hybrid = zero >= 1 and 1 <= node < replicas and replicas % node == 0
    return [replicas, node] if hybrid else [replicas]


def dp_internode_bytes(
    psi: float,
    zero: int,
    replicas: int,
    shard: int,
    tp: int,
    gpus_per_node: int,
    num_microbatches: int,
    param_bytes: int,
    grad_bytes: int,
) -> float:
    """Bytes per rank and step the data-parallel collectives hand to groups that span nodes (the
    payload ``megazero.collectives.counter`` counts), ranks filling nodes of ``gpus_per_node`` in
    order. n consecutive replicas are ``tp x n`` consecutive ranks, so a group of them spans nodes
    when ``tp x n > gpus_per_node``. ZeRO-0: the all-reduce of the g Psi buffer; ZeRO-1/2: the
    shard group's reduce-scatter (g Psi, per micro-batch at stage 2) and all-gather (p Psi / S)
    when that group spans nodes, plus hybrid sharding's all-reduce of the shard (g Psi / S) over
    the replica group when that one does. Psi unpadded (each buffer pads < N elements)."""
    spans = lambda n: tp * n > gpus_per_node
    if zero == 0:
        return grad_bytes * psi if spans(replicas) else 0.0
    inside = (num_microbatches if zero == 2 else 1) * grad_bytes * psi + param_bytes * psi / shard
    across = grad_bytes * psi / shard if shard < replicas and spans(replicas) else 0.0
    return (inside if spans(shard) else 0.0) + across


def layouts(argv: list[str], devices: int, max_tp: int = 8, gpus_per_node: int = 8):
    """Every (tp, cp, cp comm type, pp, dp, ZeRO stage, ZeRO shard size S, recomputation) of
    ``devices`` ranks the model allows, as (label, argv); tp a power of two up to ``max_tp`` (one
    node), sequence parallel when tp > 1, cp as ``cp_options`` gives it (the comm type "-" at cp
    1), S the flat dp x cp or one node of ``gpus_per_node`` (``shard_options``)."""
    base = config_from_argv(argv + ["--tp", "1", "--pp", "1", "--dp", "1"], 1, print_warnings=False, needs_data=False)
    m, t = base.model, base.train
    for tp in (d for d in (1, 2, 4, 8, 16) if d <= max_tp and devices % d == 0):
        if m.num_attention_heads % tp or m.ffn_hidden_size % tp:
            continue
        for pp in (d for d in _divisors(m.num_layers) if devices % (tp * d) == 0):
            for cp, comm in cp_options(base, tp, devices // (tp * pp)):
                dp = devices // (tp * pp * cp)
                if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp):
                    continue
                extra = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp)]
                extra += ["--cp", str(cp), "--cp-comm-type", comm] if cp > 1 else []
                extra += ["--sequence-parallel"] if tp > 1 else []
                for zero in (0, 1, 2):
                    for shard in shard_options(zero, dp * cp, tp, gpus_per_node):
                        hybrid = ["--zero-shard-size", str(shard)] if shard < dp * cp else []
                        for name, flags in RECOMPUTE.items():
                            label = (tp, cp, comm if cp > 1 else "-", pp, dp, zero, shard, name)
                            yield label, argv + extra + ["--zero-stage", str(zero)] + hybrid + flags
