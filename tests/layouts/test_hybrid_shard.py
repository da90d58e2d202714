"""Hybrid sharding (HSDP / MiCS): ``--zero-shard-size S`` shards the ZeRO state over S
consecutive data-parallel ranks and replicates it over the dp x cp / S groups of them.

One 4-rank spawn trains tests/layouts/test_train.py's GPT for 4 steps under dp 4 = 2 x 2 at ZeRO stages
1, 2 and 3 beside the flat (S = 4) runs, ZeRO-2 with the optimizer offloaded, tp 2 x dp 2 with
S = 1, pp 2 x dp 2 with S = 1 and cp 2 x dp 2 with S = 2 (a shard group is one cp pair): every
loss and gradient norm equals the flat run's within 1e-6 and ``tests/support/reference.py``'s within 1e-5;
each rank's model-state bytes equal the ZeRO formula with N = S (and the planner's); a checkpoint
saved at S = 2 after 2 steps resumes at S = 4 (and at ZeRO-1) with the S = 2 run's next 2 losses;
``scripts/bench/bench_comm.py``'s hybrid cases count exactly the theory's bytes, kind by kind, and the
bytes crossing shard groups (the replica all-reduce and the world scalars). The rank arithmetic
and the refused settings are tested without processes. An 8-rank spawn (slow) adds tp 2 x dp 4
with S = 2 and tp 2 x pp 2 x dp 2 with S = 1.
"""

import math

import pytest

from tests.support.distributed import run_distributed
from tests.support.layouts import BASE, STEPS, reference_losses

# Steps of every run: the learning rate's warm-up (1-3) and decay (4), Adam from its moments from step 2;
# the losses are compared with the first 4 of the 10-step reference every layout module shares.
HYBRID_STEPS = 4

Z3 = ["--zero-stage", "3", "--zero3-param-persistence-threshold", "0"]
LAYOUTS = {  # name -> (flags, the flat layout it must equal)
    "dp4-zero1-flat": (["--dp", "4", "--zero-stage", "1"], None),
    "dp4-zero1-s2": (["--dp", "4", "--zero-stage", "1", "--zero-shard-size", "2"], "dp4-zero1-flat"),
    "dp4-zero2-flat": (["--dp", "4", "--zero-stage", "2", "--reduce-bucket-size", "2000"], None),
    "dp4-zero2-s2": (
        ["--dp", "4", "--zero-stage", "2", "--reduce-bucket-size", "2000", "--zero-shard-size", "2"],
        "dp4-zero2-flat",
    ),
    "dp4-zero3-flat": (["--dp", "4"] + Z3, None),
    "dp4-zero3-s2": (["--dp", "4", "--zero-shard-size", "2"] + Z3, "dp4-zero3-flat"),
    "tp2-dp2-zero2-s1": (["--tp", "2", "--dp", "2", "--zero-stage", "2", "--zero-shard-size", "1"], None),
    "pp2-dp2-zero1-s1": (["--pp", "2", "--dp", "2", "--zero-stage", "1", "--zero-shard-size", "1"], None),
    "cp2-dp2-zero2-s2": (["--cp", "2", "--dp", "2", "--zero-stage", "2", "--zero-shard-size", "2"], None),
    "dp4-zero2-s2-offload": (
        [
            "--dp",
            "4",
            "--zero-stage",
            "2",
            "--reduce-bucket-size",
            "2000",
            "--zero-shard-size",
            "2",
            "--offload-optimizer",
            "cpu",
        ],
        "dp4-zero2-flat",
    ),
}
SAVE_AT = 2  # the checkpoint holds Adam's moments of 2 steps; the resumed runs train steps 3 and 4
RESUME = {  # resumed from dp4-zero2-s2's checkpoint at step SAVE_AT
    "resume-flat-zero2": ["--dp", "4", "--zero-stage", "2", "--reduce-bucket-size", "2000"],
    "resume-flat-zero1": ["--dp", "4", "--zero-stage", "1"],
}
COMM = ("dp4 S2 ZeRO-1", "dp4 S2 ZeRO-2")


def _flag(flags, name, default):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def _state(trainer, cfg, groups):
    """(held model-state bytes, ZeRO formula with the buffers' own N, (padded Psi, N) terms, planned)."""
    from megazero.planning import memory, plan

    opt = trainer.optimizer
    got = opt.model_state_bytes()
    planned = memory.stage_estimates(
        trainer.gpt_config, **plan.layout_settings(cfg, False), a=plan.activation_settings(cfg), buckets=(2**62, 2**62)
    )
    return (
        got["total"] - got["buckets"],
        opt.formula()["total"],
        opt.formula_terms(),
        planned[groups.pp_rank].model_state_bytes,
        len(opt.ddp.buffers),
    )


def _run(rank, world, argv, steps, save=None, load=None):
    from megazero.training import build_trainer

    trainer = build_trainer(argv, world)
    cfg, groups = trainer.cfg, trainer.groups
    if load is not None:
        assert trainer.load_checkpoint(load) == SAVE_AT
    values = []
    for _ in range(steps):
        batches = trainer.next_batches()
        values.append(trainer.train_step(batches).values)
        if save is not None and trainer.state.iteration == SAVE_AT:
            trainer.save_checkpoint(save, wait=True)
    out = dict(
        losses=[v["loss"] for v in values],
        norms=[v["grad_norm"] for v in values],
        state=_state(trainer, cfg, groups),
        shard=groups.zero_shard_size,
    )
    trainer.close()
    return out


def _all(rank, world, root):
    from scripts.bench import bench_comm as B

    out = {}
    for name, (flags, _) in LAYOUTS.items():
        save = root if name == "dp4-zero2-s2" else None
        out[name] = _run(rank, world, BASE + flags, HYBRID_STEPS, save=save)
    for name, flags in RESUME.items():
        out[name] = _run(rank, world, BASE + flags, HYBRID_STEPS - SAVE_AT, load=root)
    cases = [c for c in B.CASES if c[0] in COMM]
    out["comm"] = [
        (c[0], pp_rank, counted)
        for c, (pp_rank, counted) in zip(cases, B.count_step(rank, world, [B.BASE + c[2] for c in cases]))
    ]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    per_rank = run_distributed(_all, 4, str(tmp_path_factory.mktemp("hybrid")), timeout_s=900)
    return per_rank, reference_losses(BASE, STEPS)[:HYBRID_STEPS]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_layout_equals_flat_and_reference(name, runs):
    """4 steps: every rank's losses and gradient norms equal the flat ZeRO run's within 1e-6
    (bit-identical where the sums are) and the single-process reference's losses within 1e-5;
    the model-state bytes equal the ZeRO formula with N = S."""
    from megazero.optim.offload import offload_formula_bytes
    from megazero.optim.zero import zero_formula_bytes

    per_rank, reference = runs
    flags, flat = LAYOUTS[name]
    stage = _flag(flags, "--zero-stage", 0)
    replicas = _flag(flags, "--dp", 1) * _flag(flags, "--cp", 1)
    shard = _flag(flags, "--zero-shard-size", replicas)
    for r in per_rank:
        got = r[name]
        assert got["shard"] == shard
        assert got["losses"] == pytest.approx(reference, rel=1e-5), name
        if flat is not None:
            assert got["losses"] == pytest.approx(r[flat]["losses"], rel=1e-6, abs=0), name
            assert got["norms"] == pytest.approx(r[flat]["norms"], rel=1e-6, abs=0), name
        held, formula, terms, planned, buffers = got["state"]
        assert [n for _, n in terms] == [shard]
        if "--offload-optimizer" in flags:  # offload_formula_bytes: device p + g, host 16 Psi / N
            assert held == formula == sum(sum(offload_formula_bytes(psi, n, stage, 4, 4).values()) for psi, n in terms)
            continue
        assert held == formula == sum(zero_formula_bytes(psi, n, stage, 4, 4) for psi, n in terms)
        assert 0 <= held - planned < 16 * shard * buffers, (held, planned)
    assert per_rank[0][name]["losses"][-1] < per_rank[0][name]["losses"][0]


@pytest.mark.slow
def test_hybrid_state_is_smaller_than_replicated_and_larger_than_flat(runs):
    """N = S in the bytes: at dp 4 the S = 2 state lies strictly between the flat state (N = 4)
    and ZeRO-0's (no sharding), at every stage."""
    per_rank, _ = runs
    for stage in (1, 2, 3):
        flat, hybrid = (per_rank[0][f"dp4-zero{stage}-{s}"]["state"][0] for s in ("flat", "s2"))
        assert flat < hybrid, stage


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUME))
def test_checkpoint_saved_at_s2_resumes_flat(name, runs):
    """Saved by dp4-zero2-s2 after 2 steps (each state element written by its first replica),
    loaded at S = 4 (ZeRO-2 and ZeRO-1): the next 2 losses equal the S = 2 run's within 1e-6."""
    per_rank, _ = runs
    for r in per_rank:
        want = r["dp4-zero2-s2"]["losses"][SAVE_AT:]
        assert r[name]["losses"] == pytest.approx(want, rel=1e-6, abs=0), name


@pytest.mark.slow
def test_bench_comm_hybrid_bytes_equal_theory(runs):
    """scripts/bench/bench_comm.py's hybrid cases (dp 4, S 2, ZeRO-1 and 2): every kind's bytes equal the
    closed form, and the bytes on groups that cross shard groups are exactly the replica
    all-reduce of the rank's shard (padded / S x 4 bytes) plus the step's world scalars."""
    from scripts.bench import bench_comm as B

    per_rank, _ = runs
    cases = {c[0]: c for c in B.CASES}
    for rank, r in enumerate(per_rank):
        assert [name for name, _, _ in r["comm"]] == list(COMM)
        for name, pp_rank, counted in r["comm"]:
            _, _, _, shape, theory = cases[name]
            want = theory(shape, pp_rank)
            assert counted == want, (name, rank, counted, want)
            padded = B.round_up(B.params_per_rank(shape), 2)
            assert counted["crossing"] == 4 * padded // 2 + B.scalars(shape, 1)["all_reduce"]


def test_hybrid_groups_by_hand():
    """r' = cp_rank + cp x dp_rank; shard group = same r' // S, replica group = same r' % S: tp 2 x
    dp 4 with S 2 (the tp pairs stay inside), cp 2 x dp 2 with S 2 (a shard group is one cp ring),
    and S = dp x cp is flat (the dp_cp groups, no hybrid)."""
    from megazero.topology import Topology

    t = Topology(tp=2, dp=4, zero_shard=2)
    assert t.hybrid and t.named_groups("zero_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.named_groups("zero_replica") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [t.zero_replica_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.replica_topology() == Topology(tp=2, dp=4, zero_shard=2, order="tp-dp-pp")
    c = Topology(dp=2, cp=2, pp=2, zero_shard=2)
    assert c.named_groups("zero_shard") == c.named_groups("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert c.named_groups("zero_replica") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    flat = Topology(tp=2, dp=4)
    assert not flat.hybrid and flat.zero_shard == 4 and flat.named_groups("zero_shard") == flat.named_groups("dp")
    assert Topology(tp=2, dp=4, zero_shard=4) == flat
    with pytest.raises(ValueError, match="--zero-shard-size 3 must be >= 1 and divide dp x cp = 4"):
        Topology(dp=4, zero_shard=3)
    with pytest.raises(ValueError, match="--zero-shard-size 2 must be a multiple of --expert-model-parallel-size 4"):
        Topology(dp=8, ep=4, zero_shard=2)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--dp", "4", "--zero-stage", "1", "--zero-shard-size", "3"],
            "--zero-shard-size 3 does not divide the data x context parallel size 4 x 1 = 4",
        ),
        (["--dp", "4", "--zero-stage", "1", "--zero-shard-size", "0"], "--zero-shard-size"),
        (["--dp", "4", "--zero-shard-size", "2"], "--zero-shard-size 2 needs a ZeRO stage of 1 or more"),
        (
            [
                "--dp",
                "4",
                "--zero-stage",
                "2",
                "--zero-shard-size",
                "1",
                "--num-experts",
                "4",
                "--expert-model-parallel-size",
                "2",
            ],
            "--zero-shard-size 1 is not a multiple of --expert-model-parallel-size 2 (expert state shards over "
            "the S / EP expert-data-parallel ranks of each shard group); fix: choose one of 2, 4",
        ),
    ],
)
def test_bad_shard_size_is_one_line_naming_the_flag(extra, message, capsys):
    """S not dividing dp x cp, S < 1, S at ZeRO-0, S no multiple of the expert-parallel size:
    exit 2 before launch with one line naming --zero-shard-size and the sizes that fit."""
    from megazero.config import config_from_argv

    with pytest.raises(SystemExit) as e:
        config_from_argv(BASE + extra, 4, print_warnings=False)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_deepspeed_mics_shard_size_fills_the_flag(tmp_path):
    """DeepSpeed's MiCS ``mics_shard_size`` is --zero-shard-size (-1: off); ZeRO++'s
    ``zero_hpz_partition_size`` is accepted silently at 1 or equal to mics_shard_size and named
    in a warning otherwise."""
    import json

    from megazero.config import config_from_argv
    from megazero.config.deepspeed import load_deepspeed_config
    from megazero.config.schema import Config

    def load(zero):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 2, **zero}}))
        cfg = Config()
        return cfg, load_deepspeed_config(str(path), cfg)

    cfg, warnings = load({"mics_shard_size": 2, "zero_hpz_partition_size": 2})
    assert cfg.zero.zero_shard_size == 2 and warnings == []
    cfg, warnings = load({"mics_shard_size": -1, "zero_hpz_partition_size": 1})
    assert cfg.zero.zero_shard_size is None and warnings == []
    cfg, warnings = load({"zero_hpz_partition_size": 4})
    assert cfg.zero.zero_shard_size is None and len(warnings) == 1 and "zero_hpz_partition_size" in warnings[0]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "mics_shard_size": 2}}))
    cfg = config_from_argv(BASE + ["--dp", "4", "--deepspeed-config", str(path)], 4, print_warnings=False)
    assert cfg.zero.zero_shard_size == 2 and cfg.zero.stage == 1


def _eight(rank, world, argvs):
    return [_run(rank, world, argv, HYBRID_STEPS) for argv in argvs]


EIGHT = {  # name -> flags (8 ranks; one micro-batch of 2 per dp rank and step at dp 4)
    "tp2-dp4-zero2-s2": ["--tp", "2", "--dp", "4", "--zero-stage", "2", "--zero-shard-size", "2"],
    "tp2-pp2-dp2-zero1-s1": [
        "--tp",
        "2",
        "--pp",
        "2",
        "--dp",
        "2",
        "--zero-stage",
        "1",
        "--zero-shard-size",
        "1",
        "--micro-batch-size",
        "1",
    ],
}


@pytest.mark.slow
def test_eight_rank_hybrid_layouts_equal_reference():
    """tp 2 x dp 4 with S = 2 (ZeRO-2) and tp 2 x pp 2 x dp 2 with S = 1 (ZeRO-1, 1F1B): 4 steps
    equal the reference within 1e-5; the state bytes equal the formula with N = S."""
    from megazero.optim.zero import zero_formula_bytes

    reference = reference_losses(BASE, STEPS)[:HYBRID_STEPS]
    per_rank = run_distributed(_eight, 8, [BASE + f for f in EIGHT.values()], timeout_s=900)
    for r in per_rank:
        for (name, flags), got in zip(EIGHT.items(), r):
            assert got["losses"] == pytest.approx(reference, rel=1e-5), name
            held, formula, terms, _, _ = got["state"]
            assert [n for _, n in terms] == [_flag(flags, "--zero-shard-size", 0)]
            assert (
                held
                == formula
                == sum(zero_formula_bytes(psi, n, _flag(flags, "--zero-stage", 0), 4, 4) for psi, n in terms)
            )
            assert all(math.isfinite(n) for n in got["norms"])


# The two-loopback-node launch of dp 4 with --zero-shard-size 2 (one shard group per node) is
# tests/launcher/test_preemption.py's test_two_loopback_nodes_with_hybrid_shards_train_like_one_process: it
# runs there while another launch waits out its timeouts.
