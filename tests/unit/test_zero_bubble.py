"""Zero-bubble pipelining without processes: the B/W split of one chunk's backward,
the ZB-H1 and ZB-V schedules (validator, simulator, executor replay), the V layout, the
config refusals. The trained equivalence on spawned ranks is tests/layouts/test_zero_bubble_train.py.
"""

import contextlib
import math

import pytest
import torch

from megazero.pipeline.executor import comm_plan
from megazero.pipeline.partition import is_post_process, layer_ids, stage_of, virtual_stage
from megazero.pipeline.replay import simulate_executor
from megazero.pipeline.schedules import Action, ScheduleError, build_schedule, check_actions, simulate
from megazero.pipeline.weight_grad import SavedTensors, SplitBackwardError, backward_input, backward_weight
from megazero.planning.memory import inflight_per_stage
from megazero.process_groups import ProcessGroups
from tests.support.apex_stand_in import install as install_apex_stand_in

SIZES = [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]  # (pp, micro-batches)
UNIT = dict(forward_cost=1.0, backward_cost=1.0, weight_cost=1.0)  # F = B = W


def _all(kind, m, p):
    v = 2 if kind == "zb-v" else 1
    return [build_schedule(kind, m, p, r, v) for r in range(p)], v


def _sim(kind, m, p):
    scheds, v = _all(kind, m, p)
    return simulate(scheds, p, v, layout="v" if kind == "zb-v" else "interleaved", **UNIT)


@pytest.mark.parametrize("p, m", SIZES)
def test_zb_h1_has_a_third_of_1f1b_bubble_at_1f1b_memory(p, m):
    """Unit costs: 1F1B (B and W fused, cost 2) idles 3 (p-1) per stage, ZB-H1 p-1 (Qi et al.
    2024, sec. 3.1), makespan 3m + p - 1; its fraction of the makespan is therefore a bit
    above a third of 1F1B's (the makespans differ), its idle time exactly a third. A
    micro-batch's activations live from F to W: ZB-H1 holds p on every stage, 1F1B's peak."""
    one, zb = _sim("1f1b", m, p), _sim("zb-h1", m, p)
    assert sum(zb.idle) == pytest.approx(sum(one.idle) / 3)
    assert zb.makespan == 3 * m + p - 1 and one.makespan == 3 * m + 3 * (p - 1)
    assert zb.bubble_fraction <= one.bubble_fraction * 3 * m / (3 * m - 2 * (p - 1)) / 3 + 1e-12
    assert zb.peak_inflight == [p] * p and max(one.peak_inflight) == p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_v_bubble_at_m_2p_is_the_start_up_delay(p):
    """ZB-V at m = 2p: every stage busy from its first forward to the end, so the bubble is
    the unavoidable start-up delay, (p-1) chunk-forwards on the last stage: (p-1)/(6m+p-1)
    in units of a chunk's F; below 5 % at pp 2 (4 %), and below ZB-H1's and 1F1B's at every
    pp. Activations: 2p chunk-halves alive, the p micro-batches of 1F1B's first stage."""
    m = 2 * p
    v, h, one = _sim("zb-v", m, p), _sim("zb-h1", m, p), _sim("1f1b", m, p)
    assert v.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
    assert v.bubble_fraction < h.bubble_fraction < one.bubble_fraction
    if p == 2:
        assert v.bubble_fraction < 0.05
    assert v.peak_inflight == [2 * p] * p
    assert inflight_per_stage("zb-v", p, 2, m) == v.peak_inflight  # the planner counts the same
    assert inflight_per_stage("zb-h1", p, 1, m) == [p] * p


@pytest.mark.parametrize("kind", ["zb-h1", "zb-v"])
@pytest.mark.parametrize("p, m", SIZES + [(4, 3), (3, 5), (2, 1)])
def test_schedules_validate_and_run_in_the_executor_replay(kind, p, m):
    """Every (mb, chunk) has one F, B and W, W after B, W's of a chunk in micro-batch order
    (check_actions); the executor's exchanges complete when a send waits for its receive
    (zb-h1) or is posted at once (zb-v), and the replay's bubble is the simulator's."""
    scheds, v = _all(kind, m, p)
    layout = "v" if kind == "zb-v" else "interleaved"
    check_actions(scheds, v)
    for s in scheds:
        assert [a.kind for a in s].count("W") == m * v
        assert s[0].phase == "warmup" and s[-1].phase == "cooldown" and s[-1].kind == "W"
    replay = simulate_executor(scheds, p, v, lambda s, a: {"F": 1.0, "B": 1.0, "W": 1.0}[a.kind] / v, layout=layout)
    assert replay.makespan == pytest.approx(simulate(scheds, p, v, layout=layout, **UNIT).makespan)


def test_validator_rejects_bad_weight_passes():
    ok = [Action("F", 0), Action("B", 0), Action("W", 0), Action("F", 1), Action("B", 1), Action("W", 1)]
    check_actions([ok], 1)
    with pytest.raises(ScheduleError, match=r"W\(mb=0.*before its backward"):
        check_actions([[Action("F", 0), Action("W", 0), Action("B", 0)]], 1)
    with pytest.raises(ScheduleError, match="weight gradients out of order"):
        check_actions([ok[:2] + ok[3:5] + [Action("W", 1), Action("W", 0)]], 1)
    with pytest.raises(ScheduleError, match=r"backwards without W: \[\(1, 0\)\]"):
        check_actions([ok[:5]], 1)
    with pytest.raises(ScheduleError, match="appears twice"):
        check_actions([ok + [Action("W", 1)]], 1)


def test_v_layout_and_its_messages():
    """Stage r holds virtual stages r and 2p-1-r; the turn at stage p-1 and the last virtual
    stage on stage 0 (which holds the loss)."""
    p = 4
    assert [virtual_stage(r, p, c, "v") for r in range(p) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(stage_of(virtual_stage(r, p, c, "v"), p, "v") == (r, c) for r in range(p) for c in (0, 1))
    assert layer_ids(16, p, 1, 2, 1, layout="v") == [12, 13]
    assert is_post_process(0, p, 1, 2, "v") and not is_post_process(p - 1, p, 1, 2, "v")
    f = Action("F", 5, 1)
    assert comm_plan(f, p - 1, p, 2, "v")[0][0] == "self"  # the turn stays on the rank
    recv, send = comm_plan(f, 1, p, 2, "v")  # chunk 1 runs back up
    assert (recv[:2], send[:2]) == (("next", 2), ("prev", 0))
    assert comm_plan(Action("W", 0, 1), 1, p, 2, "v") == (None, None)


def test_build_schedule_refuses_zero_bubble_without_pipeline():
    with pytest.raises(ValueError, match="--pipeline-schedule zb-h1 needs --pp >= 2"):
        build_schedule("zb-h1", 4, 1, 0)
    with pytest.raises(ValueError, match="zb-v runs 2 model chunk"):
        build_schedule("zb-v", 4, 2, 0, 1)


# -- the B/W split of one chunk -----------------------------------------------------------------
RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform"),
    # MoE (4 experts, top 2, shared expert, load-balancing and z losses): the
    # routing's custom Functions and AuxLossBackward run in B, the experts' linears in W
    "moe": dict(
        num_experts=4,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
        moe_shared_expert_intermediate_size=32,
    ),
    # rotary positions: the first stage's word embedding feeds the first norm and the residual
    # (no position table added to it), so B sums its output gradient and W runs it once
    "rope": dict(position_embedding_type="rope"),
    "llama": dict(
        position_embedding_type="rope",
        rotary_percent=0.5,
        normalization="RMSNorm",
        swiglu=True,
        num_query_groups=1,
        add_bias_linear=False,
        ffn_hidden_size=32,
    ),
}


def _stage(pre, post, recompute="none"):
    from model.config import GPTConfig
    from model.gpt import GPTStage

    cfg = GPTConfig(
        vocab_size=50,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        make_vocab_size_divisible_by=16,
        tie_embeddings=False,
        **RECOMPUTE[recompute],
    )
    return GPTStage(cfg, ProcessGroups.single(), [0, 1], pre, post, seed=3)


def _three_microbatches(stage, split):
    """Gradients after 3 micro-batches' backward (split: B of all three, then W in order)."""
    g = torch.Generator().manual_seed(0)
    works, input_grads = [], []
    for _ in range(3):
        tokens, labels = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
        x = tokens if stage.pre_process else torch.randn(2, 8, 16, generator=g).requires_grad_()
        boxes = SavedTensors() if split else None
        with boxes.hooks() if split else contextlib.nullcontext():
            out = stage(x, labels=labels if stage.post_process else None)
            out = out.sum() if stage.post_process else out
        dy = None if stage.post_process else torch.randn(2, 8, 16, generator=g)
        if split:
            dx, work = backward_input(out, dy, None if stage.pre_process else x, boxes)
            assert all(p.grad is None for p in stage.parameters())  # B leaves the weights alone
            works.append(work)
        else:
            torch.autograd.backward(out, dy)
            dx = None if stage.pre_process else x.grad
        input_grads.append(dx)
    for w in works:
        backward_weight(w)
    return [p.grad for p in stage.parameters()], input_grads


@pytest.mark.parametrize(
    "recompute, pre, post",
    [
        (r, pre, post)
        for r in ("none", "selective", "full")
        for pre, post in [(True, False), (False, False), (False, True), (True, True)]
    ]
    + [("moe", True, True)]  # one stage with embedding, MoE layers and head
    + [(block, True, post) for block in ("rope", "llama") for post in (False, True)],
)
def test_split_backward_is_bit_identical(pre, post, recompute):
    """B then W (all B's first, W's in micro-batch order) gives the fused backward's input
    gradients and accumulated weight gradients bit for bit, on the first, middle and last
    stage, with and without recomputation (full: the replayed region's backward is split
    too), with MoE and with rotary positions (alone and in the LLaMA block: the first
    stage's word embedding is where its activations begin); no weight gradient exists before W."""
    fused, fused_dx = _three_microbatches(_stage(pre, post, recompute), split=False)
    split, split_dx = _three_microbatches(_stage(pre, post, recompute), split=True)
    assert len(fused) == len(split) and all(torch.equal(a, b) for a, b in zip(fused, split))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(fused_dx, split_dx))


def test_split_refuses_a_fused_custom_function():
    """A custom autograd.Function computing dX and dW in one backward cannot be split."""

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.t(), x.t() @ g

    x, w = torch.randn(3, 4, requires_grad=True), torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(SplitBackwardError, match="cannot be split into B and W"):
        backward_input(Fused.apply(x, w).sum(), None, x)


@pytest.fixture
def apex_stand_in(monkeypatch):
    """``--kernels auto`` on a CUDA machine with apex: the norms run apex-style custom
    Functions (tests/support/apex_stand_in.py)."""
    install_apex_stand_in(monkeypatch)


@pytest.mark.parametrize(
    "block, pre, post",
    [("none", True, False), ("none", False, True), ("llama", True, True), ("full", False, False)],
)
def test_split_backward_with_apex_style_fused_norms(apex_stand_in, block, pre, post):
    """apex's fused norms are custom autograd Functions with an activation child and 1-D
    weights: vector boundaries, so B runs each norm's backward once (input and weight
    gradients together) and W accumulates what B kept. ZB-H1 and ZB-V (B's of a chunk before
    its W's, W's in micro-batch order) then give 1F1B's input and weight gradients bit for
    bit with the same kernels; LayerNorm and RMSNorm (LLaMA), first / last / middle stage,
    and inside a fully recomputed region."""
    stage = _stage(pre, post, block)
    norms = [m for m in stage.modules() if type(m).__name__ in ("LayerNorm", "RMSNorm")]
    names = set()
    for n in norms:  # the stand-in runs: every norm's output comes from its custom Function
        y = n(torch.randn(2, 8, 16, requires_grad=True))
        names.add(type(y.grad_fn).__name__)
    assert names == {"RMSNormFunctionBackward" if block == "llama" else "LayerNormFunctionBackward"}
    fused, fused_dx = _three_microbatches(_stage(pre, post, block), split=False)
    split, split_dx = _three_microbatches(_stage(pre, post, block), split=True)
    assert len(fused) == len(split) and all(torch.equal(a, b) for a, b in zip(fused, split))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(fused_dx, split_dx))


def test_split_refuses_a_fused_custom_function_with_a_vector_and_a_matrix():
    """A custom Function with a matrix weight stays refused though it also takes a bias."""

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(x, w)
            return x @ w + b

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.t(), x.t() @ g, g.sum(0)

    x, w, b = (
        torch.randn(3, 4, requires_grad=True),
        torch.nn.Parameter(torch.randn(4, 4)),
        torch.nn.Parameter(torch.randn(4)),
    )
    with pytest.raises(SplitBackwardError, match="cannot be split into B and W"):
        backward_input(Fused.apply(x, w, b).sum(), None, x)


# -- bad input: exit 2 before launch ---------------------------------------------------------------
BAD = {
    "zb-h1 at pp 1": (["--pipeline-schedule", "zb-h1"], 1, "--pipeline-schedule zb-h1 needs --pp >= 2"),
    "zb-v at pp 1": (["--pipeline-schedule", "zb-v"], 1, "--pipeline-schedule zb-v needs --pp >= 2"),
    "zb-v layers": (
        ["--pp", "2", "--pipeline-schedule", "zb-v", "--num-layers", "6", "--untie-embeddings-and-output-weights"],
        2,
        "--num-layers (6) divisible by 2 x --pp = 4",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_zero_bubble_settings_exit_2(case, capsys):
    from megazero.config import config_from_argv

    argv, world, expected = BAD[case]
    with pytest.raises(SystemExit) as exc:
        config_from_argv(["--mock-data"] + argv, world)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("megazero: config error: ") and err.count("\n") == 1, err
    assert expected in err, err


def test_zb_v_selects_two_chunks():
    from megazero.config import config_from_argv

    cfg = config_from_argv(
        [
            "--mock-data",
            "--pp",
            "2",
            "--pipeline-schedule",
            "zb-v",
            "--num-layers",
            "4",
            "--untie-embeddings-and-output-weights",
        ],
        2,
    )
    assert cfg.parallel.virtual_pipeline_size == 2


def test_planner_counts_what_b_leaves_for_w():
    """A micro-batch holds all its activations from F to B and, under a split backward, its
    linear layers' inputs and output gradients from B to W (``weight_grad_bytes``); the
    planner takes the largest of the (kept, awaiting W) moments of each stage's schedule.
    ZB-H1's stage r: (p - r, r) in the steady phase, (0, p) at the end of the last stage."""
    from megazero.config import config_from_argv
    from megazero.pipeline.schedules import inflight_pairs_of
    from megazero.planning import activations as A
    from megazero.planning.plan import plan_stages
    from model.build import build_gpt_config

    assert [inflight_pairs_of(build_schedule("zb-h1", 8, 4, r)) for r in range(4)] == [
        ((3, 1), (4, 0)),
        ((2, 2), (3, 1)),
        ((1, 3), (2, 2)),
        ((0, 4), (1, 3)),
    ]
    assert inflight_pairs_of(build_schedule("1f1b", 8, 4, 0)) == ((4, 0),)
    base = [
        "--mock-data",
        "--vocab-size",
        "1001",
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "128",
        "--micro-batch-size",
        "2",
        "--pp",
        "2",
        "--global-batch-size",
        "8",
    ]
    stages = {}
    for kind in ("1f1b", "zb-h1"):
        cfg = config_from_argv(base + ["--pipeline-schedule", kind], 2, print_warnings=False)
        gcfg = build_gpt_config(cfg, 1001)
        stages[kind] = plan_stages(cfg, gcfg, on_cuda=False)
    a = A.ActivationSettings(micro_batch_size=2, tp=1, sequence_parallel=False, activation_bytes=4)
    q, vocab = 4 * 2 * 128 * 64, gcfg.padded_vocab(1)
    # per layer: inputs 2 q + q + 4 q, output gradients 3 q + 4 q + 2 q; the embedding's q
    assert A.weight_grad_bytes(gcfg, a, 2, True, False, vocab) == q * (2 * 16 + 1)
    assert A.weight_grad_bytes(gcfg, a, 2, False, True, vocab) == q * 2 * 16 + 4 * vocab * 64  # + the head's dW
    for r, (first, last) in enumerate(((True, False), (False, True))):
        want = max(
            A.stage_activation_bytes(gcfg, a, [2], kept, first, last, 2, vocab, waiting)
            for kept, waiting in inflight_pairs_of(build_schedule("zb-h1", 4, 2, r))
        )
        assert stages["zb-h1"][r].activation_bytes == pytest.approx(want)
        assert stages["1f1b"][r].activation_bytes == pytest.approx(
            A.stage_activation_bytes(gcfg, a, [2], 2 - r, first, last, 2, vocab)
        )


@pytest.mark.parametrize(
    "pre, post, block", [(False, False, "none"), (True, False, "none"), (False, True, "none"), (True, False, "rope")]
)
def test_b_frees_what_w_does_not_read(pre, post, block):
    """After B a micro-batch keeps, of its saved tensors, only its linear layers' inputs (and
    views of the weights, the embeddings' ids), plus the captured output gradients and, on
    the last stage, the output layer's weight gradient that B computed: together
    the planner's ``weight_grad_bytes`` exactly (with rotary positions too, where the first
    stage keeps the word embedding's output gradient and its ids, no position ids); W
    reading an emptied box raises instead of computing."""
    from megazero.planning import activations as A
    from model.config import GPTConfig

    stage = _stage(pre, post, block)
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
    x = tokens if pre else torch.randn(2, 8, 16, generator=g).requires_grad_()
    boxes = SavedTensors()
    with boxes.hooks():
        out = stage(x, labels=labels if post else None)
        out = out.sum() if post else out
    before = boxes.held_bytes()
    _, work = backward_input(out, None if post else torch.randn(2, 8, 16, generator=g), None if pre else x, boxes)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    kept = {
        b.tensor.untyped_storage().data_ptr(): b.tensor
        for b in boxes.boxes
        if b.tensor.untyped_storage().data_ptr() not in params
    }
    indices = sum(t.untyped_storage().nbytes() for t in kept.values() if not t.is_floating_point())
    positions = 8 * 8 if block == "none" else 0  # rotary: no position table, no position ids
    assert indices == (2 * 8 * 8 + positions if pre else 0)  # the embeddings' token and position ids
    kept = sum(t.untyped_storage().nbytes() for t in kept.values()) - indices
    grads = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for it in work.items
        for t in it.grads
        if t is not None
    }
    grads.update(
        {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # the head's, B computed
            for it in work.items
            if it.done
            for t in it.done
            if t is not None and t.dim() > 1
        }
    )
    cfg = GPTConfig(
        vocab_size=50,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        make_vocab_size_divisible_by=16,
    )
    a = A.ActivationSettings(micro_batch_size=2, tp=1, sequence_parallel=False, activation_bytes=4)
    assert kept + sum(grads.values()) == A.weight_grad_bytes(cfg, a, 2, pre, post, 64)
    assert boxes.held_bytes() < before
    for b in boxes.boxes:  # as if B had not marked what W reads
        b.tensor = None
    with pytest.raises(SplitBackwardError, match="read a saved tensor that its B released"):
        backward_weight(work)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_v_attains_the_start_up_lower_bound(p):
    """With a synchronous step, stage p-1 idles while micro-batch 0 passes the p-1 chunk
    forwards before it, and every stage has 6m unit actions: bubble >= (p-1)/(6m+p-1)
    (zero_bubble.py). ZB-V attains it for every m from p to 4p; at pp 4 the bound is 5.9 %
    at m = 2p = 8, so "< 5 %" needs m >= 10 (19 (p-1)/6 < m), where ZB-V is below 5 %."""
    for m in range(p, 4 * p + 1):
        bound = (p - 1) / (6 * m + p - 1)
        assert _sim("zb-v", m, p).bubble_fraction == pytest.approx(bound, rel=1e-12, abs=0)
    first_below = min(m for m in range(1, 100) if (p - 1) / (6 * m + p - 1) < 0.05)
    assert first_below == math.floor(19 * (p - 1) / 6) + 1
    if p == 4:
        assert first_below == 10 and (p - 1) / (6 * 2 * p + p - 1) > 0.058
        assert all(_sim("zb-v", m, p).bubble_fraction < 0.05 for m in range(10, 4 * p + 1))
