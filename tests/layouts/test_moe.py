"""Mixture of Experts without expert parallelism: the MoE MLP through the whole
trainer equals ``tests/support/reference.py``'s plain MoE (every expert on every token, the same
``megazero.moe.router`` rules) under (tp, pp, dp) layouts and ZeRO stages, fp32, dropout off.

LLaMA-style block with grouped-query attention, top-2 of 8 experts plus one shared expert,
aux-loss coefficient 1e-2 and z-loss 1e-3: losses within 1e-5 relative for 4 steps, gradient
norms and the logged auxiliary losses likewise, the first step's token-to-expert assignment
of every token equal (integers); capacity-factor runs (drop by probability, and by position
with the sequence-wise aux loss and the pre-top-k softmax) drop exactly the reference rule's
assignments (also under context parallelism, cp 2 with all-to-all attention and full
recomputation, where the drops and the sequence-wise aux loss span every cp rank's tokens); an
expert-bias run has the reference's bias after every step. All layouts of the 4-rank world share one spawn.
"""

import math

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.moe import ARGS, MOE_STEPS, moe_reference

LAYOUTS = {  # name -> (layout flags, model flags, steps)
    "dp4-zero1": (["--dp", "4", "--zero-stage", "1"], [], MOE_STEPS),
    "dp4-zero3": (["--dp", "4", "--zero-stage", "3", "--zero3-param-persistence-threshold", "0"], [], MOE_STEPS),
    "tp2-dp2-zero2": (["--tp", "2", "--dp", "2", "--zero-stage", "2"], [], MOE_STEPS),
    "pp2-dp2-interleaved-zero1": (
        ["--pp", "2", "--dp", "2", "--virtual-pipeline-size", "2", "--zero-stage", "1"],
        [],
        MOE_STEPS,
    ),
    # capacity 1.0 of 8 experts: ceil(32 x 2 / 8) = 8 slots each, so most micro-batches drop some
    "capacity-tp2-dp2": (
        ["--tp", "2", "--dp", "2"],
        ["--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "probs"],
        MOE_STEPS,
    ),
    # the other router and drop rules: sequence-wise aux loss, top-k of the full softmax, drops by position
    "capacity-position-seqaux-dp4": (
        ["--dp", "4"],
        [
            "--moe-expert-capacity-factor",
            "1.25",
            "--moe-token-drop-policy",
            "position",
            "--moe-router-load-balancing-type",
            "seq_aux_loss",
            "--moe-router-pre-softmax",
        ],
        MOE_STEPS,
    ),
    # context parallelism (all-to-all attention): every cp rank routes the whole micro-batch, so the
    # capacity, the drops by position and each sequence's aux loss are those of cp 1; under full
    # recomputation the gather runs in both forwards, the statistics are taken in the replay
    "capacity-position-seqaux-cp2-a2a-dp2-recompute": (
        [
            "--cp",
            "2",
            "--cp-comm-type",
            "a2a",
            "--dp",
            "2",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        [
            "--moe-expert-capacity-factor",
            "1.25",
            "--moe-token-drop-policy",
            "position",
            "--moe-router-load-balancing-type",
            "seq_aux_loss",
            "--moe-router-pre-softmax",
        ],
        MOE_STEPS,
    ),
    # DeepSeek-V3's aux-loss-free bias; a large rate so that it changes the routing within MOE_STEPS (4)
    "bias-pp2-dp2": (
        ["--pp", "2", "--dp", "2"],
        [
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate",
            "0.05",
        ],
        MOE_STEPS,
    ),
}

NEW_TOKENS = 4  # greedy tokens after the steps: one forward pass each (a ZeRO-3 one gathers every parameter)


def _moe_run(rank, world, argv, steps):
    from megazero.training import build_trainer
    from model.gpt import MoEMLP

    trainer = build_trainer(argv, world)
    cfg, groups = trainer.cfg, trainer.groups
    moe = {int(i): b.mlp for c in trainer.chunks for i, b in c.layers.items() if isinstance(b.mlp, MoEMLP)}
    values, bias = [], []  # bias: after each step, per MoE layer held here
    for step in range(steps):
        for m in moe.values():
            m.record = [] if step == 0 else None
        if step == 0:
            records = {i: m.record for i, m in moe.items()}
        batches = trainer.next_batches()
        values.append(trainer.train_step(batches).values)
        bias.append({i: None if m.expert_bias is None else m.expert_bias.clone() for i, m in moe.items()})
    from megazero import training
    from megazero.planning import memory

    ids = training.generate_ids(trainer, [5, 17, 3], NEW_TOKENS)  # greedy; under cp every rank decodes whole rows
    p = cfg.parallel
    psi = (
        sum(q.numel() for c in trainer.chunks for q in c.parameters()),  # built vs the planner's count
        memory.params_per_rank(
            trainer.gpt_config, p.tp, p.pp, groups.pp_rank, p.virtual_pipeline_size, p.pipeline_layer_split
        ),
    )
    trainer.close()
    return dict(
        values=values, records=records, bias=bias, dp_rank=groups.dp_rank, tp_rank=groups.tp_rank, psi=psi, ids=ids
    )


def _moe_runs(rank, world, argvs, steps):
    return [_moe_run(rank, world, argv, n) for argv, n in zip(argvs, steps)]


@pytest.fixture(scope="module")
def runs():
    """name -> (per-rank results, reference (losses, stats)); one 4-rank spawn runs every layout."""
    names = list(LAYOUTS)
    per_rank = run_distributed(
        _moe_runs,
        4,
        [ARGS + LAYOUTS[n][1] + LAYOUTS[n][0] for n in names],
        [LAYOUTS[n][2] for n in names],
        timeout_s=900,
    )
    return {
        n: ([r[i] for r in per_rank], moe_reference(ARGS + LAYOUTS[n][1], LAYOUTS[n][2])) for i, n in enumerate(names)
    }


def _global_assignment(results, layer):
    """The first step's (experts, keep) of every token of the global batch for ``layer``: the
    micro-batches of dp rank 0, then of dp rank 1, ... (the global batch's row order)."""
    by_dp = {}
    for r in results:
        if layer in r["records"] and r["tp_rank"] == 0:
            by_dp[r["dp_rank"]] = r["records"][layer]
    return [mb for d in sorted(by_dp) for mb in by_dp[d]]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_equals_reference(name, runs):
    """Losses (cross-entropy) within 1e-5 relative of the reference at every step, the gradient
    norms (aux-loss gradients included) and the logged aux + z losses too, every rank the same
    values; the first step's expert of every token, and with a capacity factor which of its
    assignments are kept, equal the reference's exactly; the expert bias at the end as well."""
    results, (ref_losses, stats) = runs[name]
    values = results[0]["values"]
    for r in results:
        assert r["psi"][0] == r["psi"][1]  # the planner counts each rank's parameters exactly
        assert [v["loss"] for v in r["values"]] == [v["loss"] for v in values]
        assert [v["grad_norm"] for v in r["values"]] == [v["grad_norm"] for v in values]
    for step, v in enumerate(values):
        assert math.isclose(v["loss"], ref_losses[step], rel_tol=1e-5), (name, step, v["loss"], ref_losses[step])
        assert math.isclose(v["grad_norm"], stats["grad_norms"][step], rel_tol=1e-5), (name, step)
        aux = v["moe_aux_loss"] + v["moe_z_loss"]
        assert math.isclose(aux, stats["aux_losses"][step], rel_tol=1e-5), (name, step, aux)
    assert values[-1]["loss"] < values[0]["loss"]
    dropped = 0
    for layer, want in enumerate(stats["assignments"]):  # every layer is an MoE layer here
        got = _global_assignment(results, layer)
        assert len(got) == len(want) == 8  # 16 sequences / micro-batches of 2
        for (g_experts, g_keep), (w_experts, w_keep) in zip(got, want):
            assert torch.equal(g_experts, w_experts), (name, layer)
            assert torch.equal(w_keep, torch.ones_like(w_keep) if g_keep is None else g_keep), (name, layer)
            dropped += int((~w_keep).sum())
    assert (dropped > 0) == name.startswith("capacity"), dropped
    moved = False
    for step, per_layer in enumerate(stats["expert_bias"]):  # after every step
        for layer, want in enumerate(per_layer):
            for r in results:
                if layer in r["bias"][step]:
                    got = r["bias"][step][layer]
                    assert (got is None) == (want is None)
                    if want is not None:
                        assert torch.equal(got, want), (step, layer, got, want)
                        moved |= bool(want.abs().sum() > 0)
    assert moved == name.startswith("bias")


@pytest.mark.slow
def test_moe_greedy_tokens_agree_across_layouts_of_one_model(runs):
    """After the steps, 4 (NEW_TOKENS) greedy tokens from one prompt are the same on every rank and under every
    layout of the same model flags (equal losses to 1e-7 leave the argmax alone): under cp each
    rank decodes whole rows and routes them alone, as dp 4 does (the capacity and sequence-aux
    model under cp 2 x dp 2 and under dp 4)."""
    by_model: dict = {}
    for name, (results, _) in runs.items():
        by_model.setdefault(tuple(LAYOUTS[name][1]), []).extend((name, r["ids"]) for r in results)
    cp_model = tuple(LAYOUTS["capacity-position-seqaux-cp2-a2a-dp2-recompute"][1])
    names = {n for n, _ in by_model[cp_model]}
    assert names == {"capacity-position-seqaux-dp4", "capacity-position-seqaux-cp2-a2a-dp2-recompute"}
    for got in by_model.values():
        assert len(got[0][1]) == 3 + NEW_TOKENS
        assert all(ids == got[0][1] for _, ids in got), got


GROUPS, TOPK = ["--moe-router-num-groups"], "--moe-router-group-topk"


def fails(argv, capsys):
    from megazero.config import config_from_argv

    with pytest.raises(SystemExit) as exc:
        config_from_argv(argv, 2)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megazero: config error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5"),
        (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor 0"),
        (["--num-experts", "4", "--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias"),
        (["--num-experts", "8"] + GROUPS + ["3", TOPK, "1"], "--moe-router-num-groups 3 does not divide"),
        (["--num-experts", "8"] + GROUPS + ["4", TOPK, "5"], "--moe-router-group-topk 5 must be in [1,"),
        (["--num-experts", "8"] + GROUPS + ["4", TOPK, "1", "--moe-router-topk", "3"], "3 exceeds the 1 x 2 experts"),
        (["--num-experts", "8"] + GROUPS + ["4"], "--moe-router-group-topk go together"),
        (["--num-experts", "8", TOPK, "1"], "--moe-router-group-topk has no effect"),
        (["--num-experts", "8", "--moe-router-topk-scaling-factor", "0"], "--moe-router-topk-scaling-factor"),
        (GROUPS + ["2"], "--num-experts"),
        (["--moe-router-topk", "1"], "--num-experts"),
        (["--moe-aux-loss-coeff", "0.01"], "--num-experts"),
        (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], "--moe-pad-expert-input-to-capacity"),
        (["--num-experts", "4", "--dp", "2", "--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3"),
        (["--num-experts", "4", "--tp", "2", "--moe-ffn-hidden-size", "7"], "--moe-ffn-hidden-size 7"),
        (["--num-experts", "4", "--moe-ffn-hidden-size", "7", "--tp", "1", "--moe-router-topk", "1"], None),
        (["--num-experts", "4", "--moe-ffn-hidden-size", "7", "--cp", "2"], None),  # MoE under context parallelism
    ],
)
def test_bad_moe_settings_exit_2_naming_the_flag(extra, named, capsys):
    from megazero.config import config_from_argv

    argv = ["--mock-data", "--device", "cpu"] + extra
    if named is None:  # a valid setting for contrast: parses
        assert config_from_argv(argv, 2).model.moe_ffn_hidden_size == 7
        return
    assert named in fails(argv, capsys)


def test_moe_spec_names_experts_by_global_index_and_counts_active_flops():
    """The spec declares router, experts and shared expert with the dense MLP's partitions; the
    FLOP count takes the k active experts (and the shared one), not all E."""
    from megazero.param_spec import matmul_params
    from model.config import GPTConfig

    kw = dict(
        vocab_size=64,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        swiglu=True,
        add_bias_linear=False,
        ffn_hidden_size=32,
    )
    moe = GPTConfig(
        **kw,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        moe_shared_expert_intermediate_size=12,
        moe_layer_freq=2,
    )
    spec = {e.name: e for e in moe.parameter_spec(2)}
    assert (
        spec["layers.0.mlp.router.weight"].shape == (8, 16) and spec["layers.0.mlp.router.weight"].partition_dim is None
    )
    e7 = spec["layers.0.mlp.experts.7.fc1.weight"]
    assert e7.shape == (16, 16) and (e7.partition_dim, e7.partition_stride) == (0, 2)
    assert spec["layers.0.mlp.shared_experts.fc2.weight"].shape == (16, 12)
    assert "layers.1.mlp.fc1.weight" in spec and "layers.1.mlp.router.weight" not in spec  # freq 2
    layer, _, _ = matmul_params(moe.parameter_spec(1))
    attn = 2 * ((2 + 2 * 2) * 8 * 16 + 16 * 16)  # qkv + proj of both layers
    active = 8 * 16 + 2 * (3 * 16 * 8) + 3 * 16 * 12  # router + k experts + shared
    assert layer == attn + active + 3 * 16 * 32  # layer 1: the dense SwiGLU MLP


def test_moe_losses_reach_the_log_line_and_metrics(tmp_path, capsys):
    """The step's aux and z-loss values go to the console line and metrics.jsonl (a dense run's
    records keep their keys: tests/unit/test_monitor.py)."""
    import json

    from megazero.runtime.monitor import Monitor

    with Monitor(
        str(tmp_path), tensorboard_dir=None, metrics_file="m.jsonl", rank=0, is_logging_rank=True, config_text=""
    ) as mon:
        mon.log_iteration(1, {"loss": 2.0, "moe_aux_loss": 0.04, "moe_z_loss": 0.0175})
    assert "| moe aux loss: 4.000000E-02 | moe z loss: 1.750000E-02" in capsys.readouterr().out
    train = [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if r["kind"] == "train"]
    assert (train[0]["moe_aux_loss"], train[0]["moe_z_loss"]) == (0.04, 0.0175)


def test_moe_layer_statistics_reach_the_log_line_tensorboard_and_metrics(tmp_path, capsys):
    """Per-layer routing statistics (``moe_step_end``'s ``moe_layers``): the log line shows the
    worst layer's busiest-expert load over the mean and the dropped fraction over all layers;
    TensorBoard holds every layer's values under ``moe/layer{i}/``; metrics.jsonl the table."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megazero.runtime.monitor import Monitor

    layers = {
        0: {"tokens_per_expert": [4, 4, 4, 4], "dropped": 0, "assignments": 16, "aux_loss": 0.01, "z_loss": 0.002},
        2: {"tokens_per_expert": [10, 2, 4, 0], "dropped": 4, "assignments": 16, "aux_loss": 0.03, "z_loss": 0.001},
    }
    with Monitor(
        str(tmp_path), tensorboard_dir="tb", metrics_file="m.jsonl", rank=0, is_logging_rank=True, config_text=""
    ) as mon:
        mon.log_iteration(3, {"loss": 2.0, "moe_aux_loss": 0.04, "moe_z_loss": 0.003, "moe_layers": layers})
    line = capsys.readouterr().out
    # layer 2: max 10 over mean 4 = 2.5; dropped 4 of 32 assignments = 12.5 %
    assert "| moe load max/mean: 2.500 (layer 2) | moe dropped: 12.50 %" in line, line
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    scalar = lambda tag: acc.Scalars(tag)[0].value
    assert scalar("moe/layer2/tokens/expert0") == 10 and scalar("moe/layer2/tokens/expert3") == 0
    assert scalar("moe/layer2/dropped_fraction") == 0.25 and scalar("moe/layer0/load_max_over_mean") == 1.0
    assert math.isclose(scalar("moe/layer2/aux_loss"), 0.03, rel_tol=1e-6)
    assert math.isclose(scalar("moe/layer0/z_loss"), 0.002, rel_tol=1e-6)
    assert acc.Scalars("moe/layer2/aux_loss")[0].step == 3
    train = [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if r["kind"] == "train"]
    assert train[0]["moe_layers"]["2"]["tokens_per_expert"] == [10, 2, 4, 0]


@pytest.mark.parametrize("swiglu, bias", [(True, False), (False, True)])
def test_pad_expert_input_to_capacity_keeps_the_numbers(swiglu, bias):
    """``--moe-pad-expert-input-to-capacity``: every expert computes on exactly its capacity of
    rows (seen through a hook), and the layer's output and every gradient equal the unpadded
    layer's bitwise (on this CPU's matmuls: a row's sums do not depend on the other rows)."""
    from model.config import GPTConfig
    from model.gpt import MoEMLP

    results, shapes = [], []
    for pad in (False, True):
        cfg = GPTConfig(
            vocab_size=10,
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            seq_length=6,
            swiglu=swiglu,
            add_bias_linear=bias,
            num_experts=4,
            moe_ffn_hidden_size=6,
            moe_router_topk=2,
            moe_expert_capacity_factor=1.0,
            moe_pad_expert_input_to_capacity=pad,
            moe_aux_loss_coeff=1e-2,
        )
        layer = MoEMLP(cfg, None)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for ex in layer.experts.values():
            ex.register_forward_hook(lambda m, inp, out: shapes.append((pad, inp[0].shape[0])))
        x = torch.randn(2, 6, 8, generator=g, requires_grad=True)
        out = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    capacity = 6  # ceil(12 tokens x 2 / 4 experts x 1.0)
    assert {n for padded, n in shapes if padded} == {capacity}
    assert any(n < capacity for padded, n in shapes if not padded)  # some expert had fewer rows
    (o1, x1, g1), (o2, x2, g2) = results
    assert torch.equal(o1, o2) and torch.equal(x1, x2)  # the zero rows change no row's sums
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


GPT_OSS_UNIT = dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.5)


@pytest.mark.parametrize("mlp", [dict(swiglu=True), {}, GPT_OSS_UNIT], ids=["swiglu", "gelu", "gpt-oss"])
def test_grouped_expert_gemm_equals_the_loop(mlp):
    """Experts without biases run as two grouped GEMMs (``torch._grouped_mm`` on CPU fp32):
    outputs and the gradients of the rows and of every expert weight equal the loop over
    experts bitwise, an expert with no rows included (SwiGLU, GELU, and gpt-oss's clamped quick
    GEGLU with its offset); with biases the loop runs (None)."""
    from megazero.moe.dispatch import run_blocks
    from model.config import GPTConfig
    from model.gpt import ExpertMLP, grouped_mm_available

    cfg = GPTConfig(vocab_size=10, num_layers=1, hidden_size=16, num_attention_heads=2, add_bias_linear=False, **mlp)
    g = torch.Generator().manual_seed(2)
    experts = [ExpertMLP(cfg, 12, 1) for _ in range(4)]
    for e in experts:
        with torch.no_grad():
            for p in e.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
    sizes = [5, 0, 9, 3]
    rows0 = torch.randn(sum(sizes), 16, generator=g)
    assert grouped_mm_available(rows0)
    results = []
    for grouped in (False, True):
        rows = rows0.clone().requires_grad_(True)
        if grouped:
            y = ExpertMLP.grouped_forward(experts, rows, sizes)
            assert torch.equal(run_blocks(experts, rows, sizes), y)
        else:
            y = torch.cat([e(b) for e, b in zip(experts, rows.split(sizes))])
        params = [p for e in experts for p in e.parameters()]
        grads = torch.autograd.grad(y.square().sum(), [rows] + params)
        results.append((y.detach(), grads))
    (y1, g1), (y2, g2) = results
    if mlp is GPT_OSS_UNIT:  # the clamp's copy is contiguous: its sigmoid's SIMD tail depends on the row count
        assert torch.allclose(y1, y2, rtol=1e-6, atol=0)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(g1, g2))
    else:
        assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    biased = GPTConfig(vocab_size=10, num_layers=1, hidden_size=16, num_attention_heads=2)
    assert ExpertMLP.grouped_forward([ExpertMLP(biased, 12, 1)], rows0, [17]) is None


@pytest.mark.parametrize(
    "device,dtype",
    [("cpu", torch.float32), ("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda)],
)
def test_the_grouped_gemm_guard_compares_it_with_the_loop(device, dtype):
    """The guard that lets CUDA's bf16 grouped GEMM run the experts: it passes where the kernel
    matches the per-expert loop (CPU fp32 and bf16 here; on a GPU, scripts/gpu_check.sh), and it
    fails when the kernel's result is off (a stand-in kernel adding one unit of rounding too many)."""
    from unittest import mock

    from model.moe import grouped_matches_loop

    assert grouped_matches_loop(torch.device(device), dtype)
    real = torch._grouped_mm
    off = lambda *a, **k: real(*a, **k) * (1 + 4 * torch.finfo(dtype).eps)
    with mock.patch.object(torch, "_grouped_mm", off):
        assert not grouped_matches_loop(torch.device(device), dtype)
