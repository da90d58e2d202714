"""Bytes each rank hands to each kind of collective in one training step, beside the theory.

Every case trains a small GPT-2-style model (learned positions, tied embeddings, biases,
LayerNorm, no recomputation) through ``training.Trainer`` on gloo ranks; the second step's
bytes are read from ``megazero.collectives.counter`` (the payload of this rank's input
tensor per call, ``numel x element_size``; pipeline sends are counted by ``pipeline.p2p``)
and compared with one closed-form function per case below, derived from the algorithm:

- ``theory_dp_zero0``: DP all-reduce of the whole gradient buffer once per step;
- ``theory_zero1``: reduce-scatter of the buffer once per step, all-gather of the shard;
- ``theory_zero2``: reduce-scatter in every micro-batch, all-gather of the shard;
- ``theory_tp``: Megatron (Shoeybi et al. 2019, sec. 3): per layer two all-reduces forward
  (the two row-parallel outputs) and two backward (the two column-parallel inputs), plus the
  embedding's forward all-reduce, the LM head's input-gradient all-reduce and the
  vocabulary-parallel cross-entropy's max and sums;
- ``theory_tp_sp``: sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): each of
  those all-reduces becomes a reduce-scatter (payload ``[B, T, H]``) and its conjugate an
  all-gather (payload ``[B, T/tp, H]``); the sequence-parallel parameters' gradients are
  summed over TP once per step;
- ``theory_pipeline``: one activation ``[B, T, H]`` sent forward per micro-batch at every
  chunk that is not the model's last, one gradient sent back at every chunk that is not the
  first; the tied word embedding's gradient summed over first and last stage; the loss
  broadcast from the last stage;
- ``theory_cp``: context parallelism (megazero/context_parallel/attention.py): per layer and
  micro-batch the ring's K/V (and dK/dV) sends (``--cp-comm-type p2p``, counted as "send"
  beside the pipeline's) or the all-to-alls of q, k, v, out and their gradients (``a2a``), in
  the closed forms ``ring_bytes_per_layer`` / ``a2a_bytes_per_layer`` on this rank's
  ``T/cp`` tokens and ``G/tp`` key/value heads; the gradient buffer all-reduced over the
  ``dp x cp`` ranks that hold the same parameters (padded to a multiple of dp x cp); with tp
  the sequence-parallel traffic of ``theory_tp_sp`` on ``[B, T/cp, H]``;
- ``theory_hybrid``: hybrid sharding (``--zero-shard-size S``, MiCS / HSDP): ZeRO-1/2's
  reduce-scatter and all-gather inside the S-rank shard group on a buffer padded to a multiple
  of S, plus one SUM all-reduce of the rank's shard over the dp / S replica group; its row
  ``crossing`` is every byte on a group that spans shard groups (that all-reduce and the world
  scalars), taken from ``collectives.by_group``.

Every step also has two scalars: the squared gradient norm (fp64, SUM over tp x pp, or over
the world when ZeRO shards it), which is also the step's inf/NaN check (the fp32 flag's MAX
all-reduce over the world runs only when that sum is not finite: ``DistributedOptimizer.step``),
and the logged loss together with the four stop flags (five fp64 values, SUM over the world:
``megazero.runtime.resilience.agree``); each is counted only where its group has > 1 rank.

    python -m scripts.bench.bench_comm           # prints one table, exits 1 on any mismatch
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from megazero.data_parallel.policy import sharding_policy

F32, F64 = 4, 8
LAYERS, HIDDEN, HEADS, VOCAB, SEQ, POSITIONS, MICRO = 2, 32, 4, 1001, 16, 16, 2
BASE = [
    "--mock-data",
    "--vocab-size",
    str(VOCAB),
    "--num-layers",
    str(LAYERS),
    "--hidden-size",
    str(HIDDEN),
    "--num-attention-heads",
    str(HEADS),
    "--seq-length",
    str(SEQ),
    "--max-position-embeddings",
    str(POSITIONS),
    "--micro-batch-size",
    str(MICRO),
    "--train-iters",
    "2",
    "--lr",
    "1e-3",
    "--clip-grad",
    "1.0",
    "--seed",
    "7",
    "--make-vocab-size-divisible-by",
    "8",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
    "--reduce-bucket-size",
    "500",
    "--allgather-bucket-size",
    "700",
]


@dataclass(frozen=True)
class Shape:
    """One case's sizes: layers L, hidden H, padded vocabulary V, positions P, micro-batch B,
    sequence T (whole; a rank holds ``T/cp``), micro-batches per step m, and the layout (cp
    with its ``cp_comm`` type)."""

    L: int
    H: int
    V: int
    P: int
    B: int
    T: int
    m: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vp: int = 1
    cp: int = 1
    cp_comm: str = "p2p"
    shard: int = 0

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which gradients are reduced: dp x cp."""
        return self.dp * self.cp

    @property
    def Tl(self) -> int:
        """Tokens of each sequence on one rank: T/cp."""
        return self.T // self.cp

    @property
    def S(self) -> int:
        """Ranks ZeRO shards over: the replicas, or hybrid sharding's ``--zero-shard-size``."""
        return self.shard or self.replicas


def shape_of(tp=1, pp=1, dp=1, vp=1, global_batch=8, cp=1, cp_comm="p2p", shard=0) -> Shape:
    """The model of ``BASE`` under a layout; V padded to a multiple of 8 x tp (Megatron)."""
    step = 8 * tp
    padded = -(-VOCAB // step) * step
    return Shape(
        LAYERS, HIDDEN, padded, POSITIONS, MICRO, SEQ, global_batch // (MICRO * dp), tp, pp, dp, vp, cp, cp_comm, shard
    )


def round_up(x: int, n: int) -> int:
    return -(-x // n) * n


def layer_params(s: Shape) -> int:
    """Elements of one transformer layer on one TP rank: QKV [3H/tp, H] + 3H/tp, projection
    [H, H/tp] + H, fc1 [4H/tp, H] + 4H/tp, fc2 [H, 4H/tp] + H, two LayerNorms 4H."""
    return 12 * s.H * s.H // s.tp + 7 * s.H // s.tp + 6 * s.H


def params_per_rank(s: Shape) -> int:
    """Elements one rank holds at pp = 1: layers, word embedding [V/tp, H], positions
    [P, H], final LayerNorm 2H (the output layer is the tied word embedding)."""
    return s.L * layer_params(s) + s.V // s.tp * s.H + s.P * s.H + 2 * s.H


def scalars(s: Shape, zero_stage: int) -> dict:
    """The step's two scalars: norm (fp64, tp x pp or world; it is also the inf/NaN check), loss
    share plus the SIGTERM/SIGINT/SIGUSR1/time stop flags (5 x fp64, world); the loss is also
    broadcast from the last stage over pp (fp64)."""
    world, mp = s.tp * s.cp * s.pp * s.dp, s.tp * s.pp
    norm_group = world if sharding_policy(zero_stage).shards_optimizer else mp
    out = {"all_reduce": F64 * (norm_group > 1) + 5 * F64 * (world > 1)}
    if s.pp > 1:
        out["broadcast"] = F64
    return out


def add(*parts: dict) -> dict:
    total: dict = {}
    for p in parts:
        for k, v in p.items():
            total[k] = total.get(k, 0) + v
    return {k: v for k, v in total.items() if v}


def theory_dp_zero0(s: Shape, pp_rank: int) -> dict:
    """ZeRO-0: the gradient buffer (padded to a multiple of dp) all-reduced once per step."""
    return add({"all_reduce": F32 * round_up(params_per_rank(s), s.dp)}, scalars(s, 0))


def theory_zero1(s: Shape, pp_rank: int) -> dict:
    """ZeRO-1 (P_os): the full buffer reduce-scattered once per step (input payload = the
    padded buffer), each rank's updated shard (padded / dp) all-gathered."""
    padded = round_up(params_per_rank(s), s.dp)
    return add({"reduce_scatter": F32 * padded, "all_gather": F32 * padded // s.dp}, scalars(s, 1))


def theory_zero2(s: Shape, pp_rank: int) -> dict:
    """ZeRO-2 (P_os+g): the buffer reduce-scattered in each of the m micro-batches."""
    padded = round_up(params_per_rank(s), s.dp)
    return add({"reduce_scatter": F32 * padded * s.m, "all_gather": F32 * padded // s.dp}, scalars(s, 2))


def theory_hybrid(s: Shape, pp_rank: int, stage: int) -> dict:
    """Hybrid sharding (``--zero-shard-size S``) at ZeRO-1 or 2: the buffer (padded to a multiple
    of S) reduce-scattered inside the S-rank shard group (once per step, or per micro-batch at
    stage 2), the rank's shard (padded / S) SUM all-reduced over the replicas / S replica group
    once per step, the shard all-gathered inside the shard group. ``crossing``: the bytes on
    groups that span shard groups: that all-reduce and the step's world scalars."""
    padded = round_up(params_per_rank(s), s.S)
    out = add(
        {
            "reduce_scatter": F32 * padded * (s.m if stage == 2 else 1),
            "all_gather": F32 * padded // s.S,
            "all_reduce": F32 * padded // s.S,
        },
        scalars(s, stage),
    )
    out["crossing"] = F32 * padded // s.S + scalars(s, stage)["all_reduce"]
    return out


def theory_hybrid1(s: Shape, pp_rank: int) -> dict:
    return theory_hybrid(s, pp_rank, 1)


def theory_hybrid2(s: Shape, pp_rank: int) -> dict:
    return theory_hybrid(s, pp_rank, 2)


def cross_entropy_bytes(s: Shape) -> int:
    """Vocabulary-parallel cross-entropy forward: MAX of [B, T/cp] and SUM of [3, B, T/cp], fp32."""
    return F32 * 4 * s.B * s.Tl


def theory_tp(s: Shape, pp_rank: int) -> dict:
    """Megatron TP, per micro-batch: 4 all-reduces of [B, T, H] per layer (2 forward, 2
    backward), the embedding's forward one, the LM head's backward one, cross-entropy."""
    act = F32 * s.B * s.T * s.H
    per_micro = (4 * s.L + 2) * act + cross_entropy_bytes(s)
    return add({"all_reduce": s.m * per_micro}, scalars(s, 0))


def sequence_parallel_params(s: Shape) -> int:
    """Parameters whose gradient is partial under SP: per layer two LayerNorms (4H) and the
    two row-parallel biases (2H); the final LayerNorm 2H; the positions [P, H]."""
    return s.L * 6 * s.H + 2 * s.H + s.P * s.H


def theory_tp_sp(s: Shape, pp_rank: int) -> dict:
    """TP with SP, per micro-batch: the 4L + 2 all-reduces become reduce-scatters of
    [B, T, H] and their conjugates all-gathers of [B, T/tp, H]; cross-entropy unchanged;
    once per step the SP parameters' gradients all-reduced over TP. (T is a rank's T/cp.)"""
    act = F32 * s.B * s.Tl * s.H
    per_micro = {
        "reduce_scatter": (4 * s.L + 2) * act,
        "all_gather": (4 * s.L + 2) * act // s.tp,
        "all_reduce": cross_entropy_bytes(s),
    }
    step = {k: s.m * v for k, v in per_micro.items()}
    return add(step, {"all_reduce": F32 * sequence_parallel_params(s)}, scalars(s, 0))


def theory_pipeline(s: Shape, pp_rank: int) -> dict:
    """Pipeline (pp stages, vp chunks each, virtual stage of chunk v = v pp + pp_rank): per
    micro-batch one [B, T, H] send forward from each chunk but the model's last, one send
    backward from each chunk but the first; the tied word embedding [V, H] summed between
    the first and last stage once per step."""
    stages = [v * s.pp + pp_rank for v in range(s.vp)]
    last = s.pp * s.vp - 1
    sends = sum(v < last for v in stages) + sum(v > 0 for v in stages)
    tied = F32 * s.V * s.H if pp_rank in (0, s.pp - 1) else 0
    return add({"send": F32 * s.B * s.T * s.H * s.m * sends, "all_reduce": tied}, scalars(s, 0))


def theory_tp_zero2(s: Shape, pp_rank: int) -> dict:
    """TP x DP with ZeRO-2: the TP traffic of ``theory_tp`` (each DP replica alone) plus the
    ZeRO-2 traffic of this TP rank's partition over its DP group; one set of scalars."""
    act = F32 * s.B * s.T * s.H
    padded = round_up(params_per_rank(s), s.dp)
    return add(
        {"all_reduce": s.m * ((4 * s.L + 2) * act + cross_entropy_bytes(s))},
        {"reduce_scatter": F32 * padded * s.m, "all_gather": F32 * padded // s.dp},
        scalars(s, 2),
    )


def context_parallel_attention(s: Shape) -> dict:
    """The cp attention's bytes in one step: ``m`` micro-batches x ``L`` layers of the forward
    and backward closed forms (``megazero.context_parallel.attention``), fp32, no documents."""
    from megazero.context_parallel.attention import a2a_bytes_per_layer, ring_bytes_per_layer

    heads, d = HEADS // s.tp, s.H // HEADS  # G = heads (multi-head attention)
    if s.cp_comm == "a2a":
        per = a2a_bytes_per_layer(s.B, heads, heads, s.Tl, d, F32, s.cp)
    else:
        per = ring_bytes_per_layer(s.B, heads, s.Tl, d, F32, s.cp)
    return {kind: s.m * s.L * n for kind, n in add(per.forward, per.backward).items()}


def theory_cp(s: Shape, pp_rank: int) -> dict:
    """Context parallelism at ZeRO-0: the cp attention's bytes, the gradient buffer (padded to
    a multiple of dp x cp) all-reduced once per step over the dp x cp replicas, with tp the
    sequence-parallel traffic of ``theory_tp_sp`` on the ``T/cp`` local tokens; the scalars."""
    reduce = {"all_reduce": F32 * round_up(params_per_rank(s), s.replicas)}
    rest = theory_tp_sp(s, pp_rank) if s.tp > 1 else scalars(s, 0)
    return add(context_parallel_attention(s), reduce, rest)


#: name, ranks, flags beyond BASE, shape, theory
CASES = [
    ("dp2 ZeRO-0", 2, ["--dp", "2", "--zero-stage", "0", "--global-batch-size", "8"], shape_of(dp=2), theory_dp_zero0),
    ("dp2 ZeRO-1", 2, ["--dp", "2", "--zero-stage", "1", "--global-batch-size", "8"], shape_of(dp=2), theory_zero1),
    ("dp2 ZeRO-2", 2, ["--dp", "2", "--zero-stage", "2", "--global-batch-size", "8"], shape_of(dp=2), theory_zero2),
    ("tp2", 2, ["--tp", "2", "--global-batch-size", "4"], shape_of(tp=2, global_batch=4), theory_tp),
    (
        "tp2 SP",
        2,
        ["--tp", "2", "--sequence-parallel", "--global-batch-size", "4"],
        shape_of(tp=2, global_batch=4),
        theory_tp_sp,
    ),
    (
        "pp2 GPipe",
        2,
        ["--pp", "2", "--pipeline-schedule", "gpipe", "--global-batch-size", "8"],
        shape_of(pp=2),
        theory_pipeline,
    ),
    (
        "pp2 1F1B",
        2,
        ["--pp", "2", "--pipeline-schedule", "1f1b", "--global-batch-size", "8"],
        shape_of(pp=2),
        theory_pipeline,
    ),
    (
        "pp2 interleaved vp2",
        2,
        [
            "--pp",
            "2",
            "--pipeline-schedule",
            "interleaved",
            "--virtual-pipeline-size",
            "2",
            "--num-layers",
            "4",
            "--global-batch-size",
            "8",
        ],
        Shape(**{**shape_of(pp=2).__dict__, "L": 4, "vp": 2}),
        theory_pipeline,
    ),
    (
        "pp4 1F1B",
        4,
        ["--pp", "4", "--num-layers", "4", "--global-batch-size", "8"],
        Shape(**{**shape_of(pp=4).__dict__, "L": 4}),
        theory_pipeline,
    ),
    (
        "tp2 dp2 ZeRO-2",
        4,
        ["--tp", "2", "--dp", "2", "--zero-stage", "2", "--global-batch-size", "8"],
        shape_of(tp=2, dp=2),
        theory_tp_zero2,
    ),
    (
        "dp4 S2 ZeRO-1",
        4,
        ["--dp", "4", "--zero-stage", "1", "--zero-shard-size", "2", "--global-batch-size", "8"],
        shape_of(dp=4, shard=2),
        theory_hybrid1,
    ),
    (
        "dp4 S2 ZeRO-2",
        4,
        ["--dp", "4", "--zero-stage", "2", "--zero-shard-size", "2", "--global-batch-size", "16"],
        shape_of(dp=4, shard=2, global_batch=16),
        theory_hybrid2,
    ),
    ("cp2 p2p", 2, ["--cp", "2", "--global-batch-size", "4"], shape_of(cp=2, global_batch=4), theory_cp),
    (
        "cp2 a2a",
        2,
        ["--cp", "2", "--cp-comm-type", "a2a", "--global-batch-size", "4"],
        shape_of(cp=2, cp_comm="a2a", global_batch=4),
        theory_cp,
    ),
    (
        "tp2 cp2 SP p2p",
        4,
        ["--tp", "2", "--cp", "2", "--sequence-parallel", "--global-batch-size", "4"],
        shape_of(tp=2, cp=2, global_batch=4),
        theory_cp,
    ),
]


def count_step(rank: int, world: int, argvs: list[list[str]]) -> list[tuple[int, dict]]:
    """On every rank: for each argv, build a Trainer, run one step, count the second.
    Returns ``(pp_rank, {kind: bytes})`` per argv."""

    from megazero import collectives, training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    out = []
    for argv in argvs:
        cfg = config_from_argv(argv, world)
        trainer = build_trainer(cfg, data=training.prepare_run(cfg))
        cfg, groups = trainer.cfg, trainer.groups
        for step in range(2):
            batches = trainer.next_batches()
            collectives.counter.clear()
            collectives.by_group.clear()
            trainer.train_step(batches)
        counted = dict(collectives.counter)
        if groups.topology.hybrid:  # bytes on groups that are not inside this rank's shard group
            shard = set(groups.topology.zero_group(groups.rank, "zero_shard"))
            counted["crossing"] = sum(n for (_, ranks), n in collectives.by_group.items() if not shard >= set(ranks))
        trainer.close()
        out.append((groups.pp_rank, counted))
    return out


def measure(cases=CASES) -> list[tuple[str, int, int, dict, dict]]:
    """Run every case (one spawn per world size). Returns ``(name, rank, pp_rank, counted,
    theory)`` rows."""
    from tests.support.distributed import run_distributed

    rows = []
    for world in sorted({c[1] for c in cases}):
        mine = [c for c in cases if c[1] == world]
        per_rank = run_distributed(count_step, world, [BASE + c[2] for c in mine], timeout_s=600)
        for rank, results in enumerate(per_rank):
            for (name, _, _, shape, theory), (pp_rank, counted) in zip(mine, results):
                rows.append((name, rank, pp_rank, counted, theory(shape, pp_rank)))
    return rows


#: MoE (expert parallelism) cases on tests/layouts/test_moe.py's model (4 layers, all MoE, E 8, top-2,
#: hidden 32, dropless): name, flags, (tp, dp). One 4-rank spawn runs them all.
MOE_CASES = [
    ("MoE dp4 EP2", ["--dp", "4", "--expert-model-parallel-size", "2"], (1, 4)),
    ("MoE dp4 EP4", ["--dp", "4", "--expert-model-parallel-size", "4"], (1, 4)),
    ("MoE tp2 dp2 EP2", ["--tp", "2", "--dp", "2", "--expert-model-parallel-size", "2"], (2, 2)),
]


def theory_moe_all_to_all(
    tp: int, dp: int, layers: int, micro_batches: int, experts: int, hidden: int, kept: int
) -> int:
    """Bytes of one step's all-to-alls summed over the world (fp32; megazero/moe/dispatch.py).

    Every (rank, MoE layer, micro-batch) exchanges its ``experts`` int64 token counts (8 E
    bytes); every kept assignment's token row (4 H bytes) is sent to its expert and its output
    back in the forward, and the two gradients the same way in the backward, by each of the tp
    ranks: ``tp dp L M 8 E + 16 H tp K``. Dropless routing keeps ``K = tokens x top-k x L``.
    What one rank sends depends on the routing, so only the world total has a closed form."""
    return tp * dp * layers * micro_batches * 8 * experts + 16 * hidden * tp * kept


def measure_moe(cases=MOE_CASES) -> list[tuple[str, int, int]]:
    """Run the MoE cases (one 4-rank spawn); ``(name, counted, theory)`` all-to-all bytes of the
    second step, summed over the world."""
    from tests.support.distributed import run_distributed
    from tests.support.moe import ARGS

    layers, experts, hidden, top_k, gbs, mbs, seq = 4, 8, 32, 2, 16, 2, 16
    assert all(f in ARGS for f in ("--num-experts", "8", "--moe-router-topk", "2", "--hidden-size", "32"))
    per_rank = run_distributed(count_step, 4, [ARGS + flags for _, flags, _ in cases], timeout_s=600)
    rows = []
    for i, (name, _, (tp, dp)) in enumerate(cases):
        counted = sum(results[i][1].get("all_to_all", 0) for results in per_rank)
        kept = gbs * seq * top_k * layers
        rows.append((name, counted, theory_moe_all_to_all(tp, dp, layers, gbs // (mbs * dp), experts, hidden, kept)))
    return rows


def main() -> int:
    rows = measure()
    print("| case | rank | kind | counted bytes | theory bytes | equal |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for name, rank, _, counted, theory in rows:
        for kind in sorted(set(counted) | set(theory)):
            c, t = counted.get(kind, 0), theory.get(kind, 0)
            bad += c != t
            print(f"| {name} | {rank} | {kind} | {c:,} | {t:,} | {'yes' if c == t else 'NO'} |")
    print("\n| MoE case | all-to-all bytes summed over the world | theory tp dp L M 8E + 16 H tp K | equal |")
    print("|---|---|---|---|")
    for name, c, t in measure_moe():
        bad += c != t
        print(f"| {name} | {c:,} | {t:,} | {'yes' if c == t else 'NO'} |")
    print(f"{'all equal' if not bad else f'{bad} mismatches'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
