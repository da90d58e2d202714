"""Zero-bubble schedules through the whole trainer on spawned gloo ranks, fp32, dropout off:
ZB-H1 and ZB-V at (pp, micro-batches) = (2, 4) give 1F1B's losses, gradient norms and
updated parameters bit for bit over 10 steps (4 in the 4- and 8-rank sweeps: SHORT) and the
evaluation loss and greedy generation after them, and tests/support/reference.py's losses within 1e-5.

ZB-V places layers differently (stage r holds virtual stages r and 2p-1-r, the output layer
on stage 0), so its gradient norm, a sum of per-rank squares, is added in another order:
equal to 1F1B's within 1e-12 relative, not bit for bit; its losses and every parameter (by
name) are bit-identical (at ZeRO-3, whose shards follow the placement, losses and norms
only). With tied embeddings both copies sit on stage 0 (chunks 0 and 1) and their
gradients are summed there; untied, ZB-V is compared with an untied 1F1B run. MoE layouts
are checked against the MoE reference. One spawn runs every layout of its world size.

Block features run under every pp-2 schedule (1F1B, interleaved, ZB-H1, ZB-V) against 1F1B:
RoPE (tied, so ZB-V sums both embedding copies on stage 0) and the LLaMA block on 2 ranks;
LLaMA with MoE at expert parallel 2 (dp 2) and LLaMA with packed documents at cp 2 on 4 ranks.
A first stage with RoPE has no position table, so its word embedding is where its activations
begin (pipeline/weight_grad.py). Interleaved, like ZB-V, places layers in chunks of its own: gradient
norms within 1e-12, losses and parameters bit for bit. With apex-style fused norms (custom autograd
Functions, tests/support/apex_stand_in.py) ZB-H1 and ZB-V equal 1F1B with the same norms.
"""

import pytest
import torch

from tests.support.apex_stand_in import install as install_apex_stand_in
from tests.support.distributed import run_distributed
from tests.support.layouts import BASE, LLAMA, STEPS, oracle_losses, reference_losses
from tests.support.moe import moe_reference as _moe_reference
from tests.support.packed import EOD, PACKING, packed_batches, packed_trainer, rank_micro_batches

GBS = ["--global-batch-size", "8"]  # micro-batch 2: 4 micro-batches at dp 1
UNTIE = ["--untie-embeddings-and-output-weights"]
MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
]
MICRO1 = ["--micro-batch-size", "1"]  # dp 2: still 4 micro-batches per pipeline
ROPE = ["--position-embedding-type", "rope"]
# packed documents: the flags mock data refuses on the command line; _run strips them and
# gives the trainer EOD and the flags (tests/support/packed.py) and batches with EOD tokens
PACKED = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
EP2 = ["--dp", "2", "--expert-model-parallel-size", "2"] + MICRO1
BLOCKS = {"untied": UNTIE, "moe": MOE, "rope": ROPE, "llama": LLAMA, "packed": PACKED}


def _has(argv, flags) -> bool:
    return any(argv[i : i + len(flags)] == flags for i in range(len(argv) - len(flags) + 1))


def _without(argv, flags) -> list:
    i = next(i for i in range(len(argv)) if argv[i : i + len(flags)] == flags)
    return argv[:i] + argv[i + len(flags) :]


def _packed_global_batches(cfg, steps):
    """The global batches every packed-document run and its oracle train on (``cfg``: a Config)."""
    return packed_batches(cfg.data.vocab_size, cfg.model.seq_length, cfg.train.global_batch_size, steps)


def _run(rank, world, argv, steps=STEPS):
    from megazero import training
    from megazero.training import build_trainer

    torch.set_num_threads(1)
    if _has(argv, PACKED):  # documents packed: the batches given, not the mock data's
        trainer = packed_trainer(_without(argv, PACKED), world)
        given = _packed_global_batches(trainer.cfg, steps)
    else:
        trainer, given = build_trainer(argv, world), None
    cfg, groups = trainer.cfg, trainer.groups
    values = []
    for step in range(steps):
        batches = trainer.next_batches() if given is None else rank_micro_batches(trainer, given[step])
        v = trainer.train_step(batches).values
        values.append((v["loss"], v["grad_norm"]))
    values.append((trainer.eval_loss(batches), None))  # forward only, through the same chunks
    values.append((training.generate_ids(trainer, [1, 2, 3], 3), None))  # greedy, forward only
    trainer.optimizer.wait_param_gather()
    if cfg.zero.stage == 3:  # this rank's shards (the parameters are gathered on demand)
        params = {
            (f"shard{i}", groups.pp_rank, groups.dp_rank, groups.tp_rank): b.params_shard.clone()
            if b.params_shard is not None  # small ones stay whole
            else torch.cat([q.detach().reshape(-1) for q in b.layout.params])
            for i, b in enumerate(trainer.ddp.buffers)
        }
    else:
        params = {(n, groups.tp_rank): q.detach().clone() for c in trainer.chunks for n, q in c.named_parameters()}
    trainer.close()
    return values, params


def _runs(rank, world, argvs, steps=STEPS, resume=None):
    out = [_run(rank, world, a, steps) for a in argvs]
    return out if resume is None else (out, _save_resume(rank, world, *resume))


def _save_resume(rank, world, argv, save_at, ckpt, resume_argvs):
    """Train ``save_at`` steps under ``argv`` and save; then, for each of ``resume_argvs``,
    a new Trainer loads that checkpoint and trains to STEPS. Returns the losses of each part."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    torch.set_num_threads(1)
    out = []
    for i, (a, steps) in enumerate([(argv, save_at)] + [(r, STEPS - save_at) for r in resume_argvs]):
        cfg = config_from_argv(a + (["--load", ckpt] if i else []), world)
        trainer = build_trainer(cfg, data=training.prepare_run(cfg))
        cfg = trainer.cfg
        if i:
            trainer.load_checkpoint(ckpt)
        losses = []
        for _ in range(steps):
            batches = trainer.next_batches()
            losses.append(trainer.train_step(batches).values["loss"])
        if not i:
            trainer.save_checkpoint(ckpt)
        trainer.close()
        out.append(losses)
    return out


def _compare(results, base, other, same_layout):
    """``other``'s run equals ``base``'s: losses bit for bit, gradient norms bit for bit
    (same layout) or within 1e-12, every updated parameter bit for bit."""
    b_vals, o_vals = results[0][base][0], results[0][other][0]
    assert [v[0] for v in o_vals] == [v[0] for v in b_vals], (other, "loss")  # eval loss, generated ids
    b_norms, o_norms = [v[1] for v in b_vals[:-2]], [v[1] for v in o_vals[:-2]]
    if same_layout:
        assert o_norms == b_norms, (other, "grad norm")
    else:
        assert o_norms == pytest.approx(b_norms, rel=1e-12, abs=0)
    b_par, o_par = {}, {}
    for r in results:  # every rank's parameters, by name (and tp rank) or by shard
        b_par.update(r[base][1])
        o_par.update(r[other][1])
    if not same_layout and any(k[0].startswith("shard") for k in b_par):
        return  # ZeRO-3 shards of different layer placements hold different parameters
    assert b_par.keys() == o_par.keys() and len(b_par) > 0
    bad = [k for k in b_par if not torch.equal(b_par[k], o_par[k])]
    assert not bad, (other, bad[:4])


def _reference(key, model, steps=STEPS):
    """The oracle's losses over ``steps`` steps for the model of the blocks named in ``key`` (BLOCKS)."""
    flags = dict(BLOCKS, packed=[], micro1=MICRO1)
    ref_argv = BASE + GBS + list(model) + [f for k in key for f in flags[k]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: the oracle is many times faster on one thread
    try:  # MoE: the reference routes (and takes its auxiliary losses) per micro-batch
        if "moe" in key:
            return _moe_reference(ref_argv, steps)[0]
        if "packed" in key:
            from megazero.config import config_from_argv

            batches = _packed_global_batches(config_from_argv(ref_argv, 1), steps)
            return oracle_losses(ref_argv, steps, batches, packing=dict(eod=EOD, **PACKING))
        return reference_losses(ref_argv, steps)
    finally:
        torch.set_num_threads(threads)


def _placed_apart(name: str) -> bool:
    """ZB-V and interleaved place the layers in chunks of their own (their norms add in another order)."""
    return "zb-v" in name or "interleaved" in name


def _check(layouts, results, names, model=(), steps=STEPS):
    refs = {}
    for i, name in enumerate(names):
        argv, _ = layouts[name]
        key = tuple(k for k, flags in BLOCKS.items() if _has(argv, flags))
        if "moe" in key and _has(argv, MICRO1):  # the MoE oracle routes per micro-batch
            key += ("micro1",)
        if key not in refs:
            refs[key] = _reference(key, model, steps)
        for r in results:  # every rank agrees, and equals the oracle within 1e-5
            assert [v[0] for v in r[i][0]] == [v[0] for v in results[0][i][0]]
            assert [v[0] for v in r[i][0][:-2]] == pytest.approx(refs[key], rel=1e-5), name
    for i, name in enumerate(names):
        base = layouts[name][1]
        if base is not None:
            _compare(results, names.index(base), i, same_layout=not _placed_apart(name))


# name -> (flags, the 1F1B run it must equal bit for bit)
PP2 = {
    "1f1b": (["--pp", "2"], None),
    "zb-h1": (["--pp", "2", "--pipeline-schedule", "zb-h1"], "1f1b"),
    "1f1b-untied": (["--pp", "2"] + UNTIE, None),
    "zb-v": (["--pp", "2", "--pipeline-schedule", "zb-v"] + UNTIE, "1f1b-untied"),
}


FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
TIED_V = ["--pp", "2", "--pipeline-schedule", "zb-v"]
# every schedule of pp 2 (zb-v with the block's own embedding choice), for the block features
SCHEDULES = {
    "1f1b": ["--pp", "2"],
    "interleaved": ["--pp", "2", "--virtual-pipeline-size", "2"],
    "zb-h1": ["--pp", "2", "--pipeline-schedule", "zb-h1"],
    "zb-v": TIED_V,
}


def _every_schedule(tag, flags, schedules=SCHEDULES):
    """``tag``'s block or layout ``flags`` under each of ``schedules``, each against its 1F1B run."""
    return {
        f"{tag} {name}": (sched + flags, None if name == "1f1b" else f"{tag} 1f1b") for name, sched in schedules.items()
    }


def test_zero_bubble_pp2_equals_1f1b_bit_for_bit(tmp_path):
    """pp 2, 4 micro-batches, 2 ranks: ZB-H1 and ZB-V against 1F1B and the reference; ZB-H1
    with full recomputation too (the forward replayed in B, its weights' gradients in W); ZB-V
    with tied embeddings (both copies on stage 0, their gradients summed on the rank: a sum of
    two, the same bits as the embedding group's all-reduce); ZB-H1 and ZB-V with MoE (router,
    auxiliary losses and the shared expert: B runs the routing's backward, W the experts').
    In the same ranks, ZB-V with tied embeddings saved at step 4 and resumed under ZB-V gives
    the unbroken run's losses bit for bit; resumed under 1F1B (both embedding copies back on
    their own stages), the same losses, which 1F1B and ZB-V share bit for bit. RoPE alone and the
    LLaMA block under interleaved, ZB-H1 and ZB-V against 1F1B with the same block."""
    layouts = dict(
        PP2,
        **{
            "1f1b recompute": (PP2["1f1b"][0] + FULL, None),
            "zb-h1 recompute": (PP2["zb-h1"][0] + FULL, "1f1b recompute"),
            "zb-v tied": (TIED_V, "1f1b"),
            "1f1b moe": (PP2["1f1b"][0] + MOE, None),
            "zb-h1 moe": (PP2["zb-h1"][0] + MOE, "1f1b moe"),
            "zb-v tied moe": (TIED_V + MOE, "1f1b moe"),
        },
        **_every_schedule("rope", ROPE),
        **_every_schedule("llama", LLAMA),
    )
    names = list(layouts)
    resume = (BASE + GBS + TIED_V, 4, str(tmp_path), [BASE + GBS + TIED_V, BASE + GBS + PP2["1f1b"][0]])
    got = run_distributed(_runs, 2, [BASE + GBS + layouts[n][0] for n in names], resume=resume, timeout_s=900)
    _check(layouts, [g[0] for g in got], names)
    unbroken = [v[0] for v in got[0][0][names.index("zb-v tied")][0][:STEPS]]
    for first, same, other in (g[1] for g in got):
        assert first == unbroken[:4]
        assert same == unbroken[4:], "zb-v resumed under zb-v"
        assert other == unbroken[4:], "zb-v resumed under 1f1b"


def _runs_with_apex_stand_in(rank, world, argvs):
    """``_runs`` with the norms on apex-style custom autograd Functions (--kernels auto where
    apex imports: tests/support/apex_stand_in.py)."""
    with pytest.MonkeyPatch.context() as patch:
        install_apex_stand_in(patch)
        return _runs(rank, world, argvs)


def test_zero_bubble_with_apex_style_fused_norms_equals_1f1b_bit_for_bit():
    """Wherever apex imports, --kernels auto runs apex's fused LayerNorm / RMSNorm: custom
    autograd Functions returning the input's and the weights' gradients from one backward.
    Their weights are vectors, so B runs each once and W accumulates what B kept: ZB-H1 and
    ZB-V (tied embeddings) at pp 2 equal 1F1B with the same Functions bit for bit, with
    LayerNorm (GPT-2) and RMSNorm (LLaMA), and the oracle within 1e-5."""
    schedules = {k: SCHEDULES[k] for k in ("1f1b", "zb-h1", "zb-v")}
    layouts = dict(**_every_schedule("apex", [], schedules), **_every_schedule("apex llama", LLAMA, schedules))
    names = list(layouts)
    got = run_distributed(_runs_with_apex_stand_in, 2, [BASE + GBS + layouts[n][0] for n in names], timeout_s=900)
    _check(layouts, got, names)


# Steps of the 4- and 8-rank sweeps (the 2-rank ones keep STEPS = 10 and the resume at step 4).
# A schedule's order of gradient accumulation shows in the first step's gradients and parameters;
# from step 2 on Adam runs from its moments and ZeRO-1/2 wait for the parameter all-gathers the
# previous step started; steps 1-3 warm the learning rate up and step 4 decays it. No later step
# runs other code, so bit for bit over 4 steps proves what 10 did, at 2/5 of the steps' cost.
SHORT = 4


def _layouts4():
    out = {}
    for tag, flags in (
        ("tp2-sp", ["--tp", "2", "--sequence-parallel"]),
        ("dp2-zero2", ["--dp", "2", "--zero-stage", "2"] + MICRO1),
        ("dp2-zero3", ["--dp", "2", "--zero-stage", "3"] + MICRO1),
    ):
        for name, (pp_flags, base) in PP2.items():
            out[f"{tag} {name}"] = (pp_flags + flags, None if base is None else f"{tag} {base}")
    for tag, flags in (("dp2-zero1", ["--dp", "2", "--zero-stage", "1"] + MICRO1), ("cp2", ["--cp", "2"])):
        for name in ("1f1b", "zb-h1"):  # ZeRO-1's overlapped reduction and gather; context parallel
            pp_flags, base = PP2[name]
            out[f"{tag} {name}"] = (pp_flags + flags, None if base is None else f"{tag} {base}")
    out.update(_every_schedule("ep2 llama-moe", EP2 + LLAMA + MOE))  # experts split over 2 ranks
    out.update(_every_schedule("cp2 packed llama", ["--cp", "2"] + LLAMA + PACKED))
    return out


@pytest.mark.slow
def test_zero_bubble_with_tp_sp_and_zero_equals_1f1b_bit_for_bit():
    """4 ranks: tp 2 + sequence parallelism, ZeRO-2 and ZeRO-3 over dp 2, each with ZB-H1 and
    ZB-V next to 1F1B (the bucket reductions start when a bucket's last W is done; ZeRO-3
    keeps a unit gathered from its B to its last W); ZB-H1 also with ZeRO-1 (overlapped
    reduction and parameter gather) and with context parallelism cp 2; the LLaMA block with MoE
    at expert parallel 2 and with packed documents (document masks, restarted positions, EOD
    targets left out) at cp 2 under interleaved, ZB-H1 and ZB-V against 1F1B and the oracle."""
    layouts = _layouts4()
    names = list(layouts)
    out = run_distributed(_runs, 4, [BASE + GBS + layouts[n][0] for n in names], SHORT, timeout_s=1500)
    _check(layouts, out, names, steps=SHORT)


PP4 = ["--num-layers", "8", "--global-batch-size", "16"]  # zb-v: 2 x 4 chunks; 8 micro-batches


@pytest.mark.slow
def test_zero_bubble_pp4_with_8_microbatches_equals_1f1b():
    """(pp, micro-batches) = (4, 8) on 4 ranks (pp only: the tp 2 / dp 2 variants need 8), ``SHORT``
    (4) steps."""
    layouts = {n: (["--pp", "4"] + flags[2:], base) for n, (flags, base) in PP2.items()}
    names = list(layouts)
    out = run_distributed(_runs, 4, [BASE + PP4 + layouts[n][0] for n in names], SHORT, timeout_s=1500)
    _check(layouts, out, names, model=PP4, steps=SHORT)


@pytest.mark.slow
def test_zero_bubble_pp4_8_ranks_equals_1f1b():
    """8 ranks, (pp, micro-batches) = (4, 4), ``SHORT`` (4) steps: pp 4 x tp 2 + sequence parallelism and
    pp 4 x dp 2 with ZeRO-2 and ZeRO-3, each under ZB-H1 and ZB-V (tied embeddings: both
    copies on stage 0) against 1F1B: losses and every parameter bit for bit (ZB-V: gradient
    norms within 1e-12, at ZeRO-3 losses and norms only, as in _compare), and every loss
    equal to tests/support/reference.py within 1e-5. Four micro-batches (a global batch of 8)
    still give stage 0 a warm-up, a steady 1F1B pair and a cool-down and the middle stages their
    deferred W; 8 micro-batches at pp 4 run in test_zero_bubble_pp4_with_8_microbatches_equals_1f1b,
    2 per stage with tp 2 and ZeRO-1/2/3 in the 4-rank sweep above, at half this test's cost."""
    layouts = {}
    for tag, flags in (
        ("tp2-sp", ["--tp", "2", "--sequence-parallel", "--global-batch-size", "8"]),
        ("dp2-zero2", ["--dp", "2", "--zero-stage", "2", "--micro-batch-size", "1", "--global-batch-size", "8"]),
        ("dp2-zero3", ["--dp", "2", "--zero-stage", "3", "--micro-batch-size", "1", "--global-batch-size", "8"]),
    ):
        for sched in ("1f1b", "zb-h1", "zb-v"):
            layouts[f"{tag} {sched}"] = (
                ["--pp", "4", "--num-layers", "8", "--pipeline-schedule", sched] + flags,
                None if sched == "1f1b" else f"{tag} 1f1b",
            )
    names = list(layouts)
    out = run_distributed(
        _runs, 8, [BASE + layouts[n][0] for n in names], SHORT, timeout_s=2400, collective_timeout_s=600
    )
    # every layout trains the same global batch of 8: one oracle
    ref = reference_losses(BASE + ["--num-layers", "8", "--global-batch-size", "8"], SHORT)
    for i, name in enumerate(names):
        assert len(out[0][i][0]) == SHORT + 2  # the steps, the evaluation loss, the generated ids
        assert all([v[0] for v in r[i][0]] == [v[0] for v in out[0][i][0]] for r in out), name
        assert [v[0] for v in out[0][i][0]][:SHORT] == pytest.approx(ref, rel=1e-5), name
        if layouts[name][1] is not None:
            _compare(out, names.index(layouts[name][1]), i, same_layout="zb-v" not in name)
