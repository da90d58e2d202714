"""--optimizer muon against torch.optim.Muon + torch.optim.AdamW on the one-process reference
model, and every layout against the one-process run (megazero/optim/muon.py)."""

import math
from unittest import mock

import pytest
import torch

from megazero.optim.muon import join_partitions, lr_scale, newton_schulz
from megazero.optim.zero import DistributedOptimizer
from megazero.tags import is_hidden_matrix, partition_tensor
from tests.support.distributed import run_distributed
from tests.support.layouts import BASE, oracle_losses
from tests.support.moe import ARGS as MOE_ARGS

STEPS = 10
MUON = BASE + ["--optimizer", "muon", "--lr", "1e-3", "--muon-momentum", "0.9"]


def ns_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz (torch/optim/_muon.py) with fp32 matmuls instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.float().T if grad.size(0) > grad.size(1) else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if grad.size(0) > grad.size(1) else x


def clip_qk_reference(model, outputs, tau, alpha):
    """Kimi K2's QK-Clip (arXiv 2507.20534 sec. 2.1) on a multi-head ReferenceGPT, written
    plainly: each block's QKV output ``outputs[i]`` ``[B, T, 3 A]`` of the step gives each head's
    largest causal q.k / sqrt(d); a head above ``tau`` has its q rows (weight and bias) scaled by
    gamma^alpha and its k rows by gamma^(1 - alpha), gamma = tau / max. Returns the count of
    clipped heads."""
    clipped = 0
    for block, out in zip(model.blocks, outputs):
        B, T, rows = out.shape
        heads, d = block.heads, rows // 3 // block.heads
        q, k = out[..., : heads * d], out[..., heads * d : 2 * heads * d]
        q, k = (t.reshape(B, T, heads, d).transpose(1, 2) for t in (q, k))  # (B, heads, T, d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, heads, T, T)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        top = scores.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3))  # (heads,)
        with torch.no_grad():
            for h in range(heads):
                if top[h] > tau:
                    gamma = tau / top[h].item()
                    clipped += 1
                    for p in (q for q in (block.qkv.weight, block.qkv.bias) if q is not None):
                        p[h * d : (h + 1) * d] *= gamma**alpha
                        p[(heads + h) * d : (heads + h + 1) * d] *= gamma ** (1 - alpha)
    return clipped


def _oracle_step(model, opts, params, batch, lr, clip_grad, ns, norms, losses):
    for opt in opts:
        for group in opt.param_groups:
            group["lr"] = lr
    tokens, labels = batch
    model.zero_grad(set_to_none=True)
    model.loss(tokens, labels).backward()
    norms.append(torch.nn.utils.clip_grad_norm_(params, clip_grad).item())
    with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz", ns):
        opts[0].step()
    opts[1].step()
    losses.append(model.cross_entropy.item())


def muon_oracle(argv, steps, fp32=False, qk_clip=None, stats=None):
    """Losses and pre-clip gradient norms of ReferenceGPT trained with torch.optim.Muon on the
    2-D hidden matrices (``layers.*``) and torch.optim.AdamW on the rest, both at the
    schedule's learning rate, after torch's clip_grad_norm_. ``fp32``: Newton-Schulz in fp32
    (``ns_fp32``); ``qk_clip`` (tau, alpha): ``clip_qk_reference`` after each step; ``stats``: a
    dict to receive the final canonical parameters (``params``) and the clipped heads' count."""
    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.optim.lr_schedule import LRSchedule
    from model.build import build_gpt_config
    from model.gpt import init_full_weights
    from tests.support.reference import ReferenceGPT, block_options

    cfg = config_from_argv(list(argv), 1)
    run = training.build_data(cfg)
    gcfg = build_gpt_config(cfg, run.vocab_size)
    gbs, o = cfg.train.global_batch_size, cfg.optim
    batches = [get_micro_batches(run.train, s * gbs, gbs, gbs, 0, 1)[0] for s in range(steps)]
    sched = LRSchedule(o.lr, o.min_lr, o.lr_warmup_iters, cfg.train.train_iters, o.lr_decay_style)
    block = block_options(gcfg)
    if "moe" in block:  # route and average the aux losses per micro-batch, as the trainer
        block["moe"]["group_rows"] = cfg.train.micro_batch_size
    model = ReferenceGPT.from_full_weights(
        init_full_weights(gcfg, cfg.train.seed), run.vocab_size, gcfg.num_attention_heads, **block
    )
    named = model.canonical_parameters()
    hidden = [p for n, p in named.items() if n.startswith("layers.") and p.dim() == 2]
    ids = {id(p) for p in hidden}
    rest = [p for p in named.values() if id(p) not in ids]
    # qkv, proj, fc1, fc2 per layer; an MoE layer: router, each expert's and the shared expert's fc1, fc2
    assert len(hidden) == 4 * cfg.model.num_layers + ("moe" in block) * (1 + 2 * 8) * cfg.model.num_layers
    muon = torch.optim.Muon(hidden, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum)
    adam = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
    )
    params, opts = list(named.values()), (muon, adam)
    losses, norms, outputs, clipped = [], [], [], 0
    for block in model.blocks:
        block.qkv.register_forward_hook(lambda mod, args, out: outputs.append(out.detach()))
    ns = ns_fp32 if fp32 else torch.optim._muon._zeropower_via_newtonschulz
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only wait on the busy cores
    try:
        for step in range(steps):
            _oracle_step(model, opts, params, batches[step], sched(step + 1), o.clip_grad, ns, norms, losses)
            if qk_clip is not None:
                clipped += clip_qk_reference(model, outputs, *qk_clip)
            outputs.clear()
    finally:
        torch.set_num_threads(threads)
    if stats is not None:
        stats.update(params={n: p.detach().clone() for n, p in named.items()}, clipped=clipped)
    return losses, norms


def test_newton_schulz_and_lr_scale_match_torch():
    g = torch.Generator().manual_seed(0)
    for shape in ((12, 20), (20, 12)):
        x = torch.randn(*shape, generator=g)
        want = torch.optim._muon._zeropower_via_newtonschulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(newton_schulz(x), want)
    assert lr_scale((96, 32), "original") == math.sqrt(3) and lr_scale((32, 96), "original") == 1.0
    assert lr_scale((32, 96), "match_rms_adamw") == pytest.approx(0.2 * math.sqrt(96))
    with pytest.raises(ValueError, match="adjust_lr"):
        lr_scale((2, 2), "spectral")
    full = torch.arange(24.0).view(12, 2)  # a fused QKV of 3 blocks, 2 TP partitions
    parts = [partition_tensor(full, 0, r, 2, stride=3) for r in range(2)]
    assert torch.equal(join_partitions(parts, 0, 3), full)


def test_one_process_equals_torch_muon():
    """megazero's one-process --optimizer muon equals torch.optim.Muon + AdamW within 1e-6."""
    want_losses, want_norms = muon_oracle(MUON, STEPS)
    [(losses, norms, memory, *_)] = run_distributed(layout_jobs, 1, [(MUON, STEPS, None, None)])[0]
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        assert math.isclose(got, want, rel_tol=1e-6), (step, got, want)
    got, formula, two_moments, owned, hidden = memory  # one fp32 moment on the hidden matrices
    assert got["total"] - got["buckets"] == formula["total"] == two_moments - 4 * hidden
    assert owned == hidden == 4 * 4 * 32 * 32 * 3  # qkv 96x32, proj 32x32, fc1 128x32, fc2 32x128
    # the first norm (same weights) to summation order; later ones 1e-4: Newton-Schulz runs in
    # bf16 (as torch's), where a 1e-7 difference of the input flips a few 8-bit roundings
    assert math.isclose(norms[0], want_norms[0], rel_tol=1e-6)
    for got, want in zip(norms, want_norms):
        assert math.isclose(got, want, rel_tol=1e-4), (got, want)
    adam = oracle_losses(MUON, STEPS)  # the same run with AdamW everywhere: Muon really acts
    assert max(abs(a - b) for a, b in zip(adam, losses)) > 1e-3


QK_CLIP = ["--muon-ns-dtype", "fp32", "--qk-clip", "--qk-clip-threshold", "0.05"]  # ~half the heads' max logits


def assert_qkv_close(got: dict, want: dict) -> None:
    """QKV weights within 1e-6; biases within 2e-6: AdamW's first steps on their tiny gradients
    are near sign steps that amplify rounding (1e-6 apart without QK-Clip too)."""
    assert set(got) == {n for n in want if ".attn.qkv." in n}
    for name, value in got.items():
        atol = 1e-6 if name.endswith("weight") else 2e-6
        torch.testing.assert_close(value, want[name], rtol=0, atol=atol, msg=name)


def test_qk_clip_one_process_equals_reference():
    """--qk-clip (tau 0.05, alpha 0.5) with fp32 Newton-Schulz: the one-process run equals
    torch.optim.Muon (fp32 Newton-Schulz) + AdamW followed by the plain QK-Clip of
    ``clip_qk_reference``: losses and gradient norms within 1e-6 over 10 steps, QKV weights as
    ``assert_qkv_close``; the clip fired (36 of 160 head-steps), which moves the QKV weights ~1e-2
    from a run without it (so a missing clip fails the weights' check)."""
    argv, clip = MUON + QK_CLIP, {}
    want_losses, want_norms = muon_oracle(argv, STEPS, fp32=True, qk_clip=(0.05, 0.5), stats=clip)
    [(losses, norms, _, _, qkv)] = run_distributed(layout_jobs, 1, [(argv, STEPS, None, None)])[0]
    for step, (got, want, got_n, want_n) in enumerate(zip(losses, want_losses, norms, want_norms)):
        assert math.isclose(got, want, rel_tol=1e-6) and math.isclose(got_n, want_n, rel_tol=1e-6), step
    assert_qkv_close(qkv, clip["params"])
    assert 0 < clip["clipped"] < STEPS * 4 * 4  # some heads clipped, not all (4 layers x 4 heads)


@pytest.mark.parametrize("block", [256, 5])
def test_head_max_logits_equals_the_masked_scores(monkeypatch, block):
    """``head_max_logits`` (grouped keys, 2 query heads each) equals the max of the full score
    matrix q k^T / sqrt(d) under the causal mask, with a sliding window of 3 and with documents,
    in one query block and in blocks of 5 (T = 37: a ragged last block)."""
    import model.qk_clip as qk_clip

    monkeypatch.setattr(qk_clip, "QUERY_BLOCK", block)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 37, 8, generator=g), torch.randn(2, 2, 37, 8, generator=g)
    docs = torch.randint(0, 3, (2, 37), generator=g).sort(dim=1).values  # 3 documents a row
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(8)  # (2, 4, 37, 37)
    i = torch.arange(37)
    for window, segments in ((None, None), (3, None), (None, docs), (3, docs)):
        seen = (i[None, :] <= i[:, None]).expand(2, 1, 37, 37)
        if window is not None:
            seen = seen & (i[:, None] - i[None, :] < window)
        if segments is not None:
            seen = seen & (segments[:, None, :, None] == segments[:, None, None, :])
        want = scores.masked_fill(~seen, float("-inf")).amax(dim=(0, 2, 3))
        got = qk_clip.head_max_logits(q, k, 8**-0.5, window, segments)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert not torch.equal(qk_clip.head_max_logits(q, k, 8**-0.5, 3), qk_clip.head_max_logits(q, k, 8**-0.5))


def test_qk_clip_row_factors_and_refusals(capsys):
    """``row_factors`` in both QKV row orders (one row a head): multi-head maxima [4, 0.5] at tau 1
    give gamma [0.25, 1], q and k rows sqrt(gamma) at alpha 0.5; grouped (2 query heads a key head)
    maxima [2, 0.5, 4, -inf] give each query row its gamma and leave the shared k and v rows alone.
    --qk-clip without Muon or with --context-parallel-size 2 exits 2 naming the flag."""
    from megazero import training
    from model.qk_clip import row_factors

    mha = row_factors(torch.tensor([4.0, 0.5]), 1.0, 0.5, 1, 1, grouped=False)
    assert mha.tolist() == [0.5, 1.0, 0.5, 1.0, 1.0, 1.0]
    gqa = row_factors(torch.tensor([2.0, 0.5, 4.0, float("-inf")]), 1.0, 0.5, 2, 1, grouped=True)
    assert gqa.tolist() == [0.5, 1.0, 1.0, 1.0, 0.25, 1.0, 1.0, 1.0]
    want = [0.25**0.25] * 2 + [0.25**0.75] * 2 + [1.0] * 2  # alpha 0.25, head_dim 2, G = heads
    assert row_factors(torch.tensor([4.0]), 1.0, 0.25, 1, 2, grouped=True).tolist() == pytest.approx(want)
    for argv, world, named in (
        (BASE + ["--qk-clip"], 1, "--qk-clip"),
        (MUON + ["--qk-clip", "--context-parallel-size", "2"], 2, "--context-parallel-size"),
    ):
        with pytest.raises(SystemExit) as exc:
            training.preflight(argv, world)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--qk-clip" in err and named in err and "fix:" in err, err


MB4 = ["--micro-batch-size", "4"]
TP_SP = ["--tp", "2", "--sequence-parallel", "--dp", "2", "--zero-stage", "1"] + MB4
# buckets of 2,000 elements: ZeRO-3 shard boundaries cut hidden matrices (checked below)
PP_Z3 = ["--pp", "2", "--dp", "2", "--zero-stage", "3", "--reduce-bucket-size", "2000"] + MB4
PP_Z3 += ["--zero3-param-persistence-threshold", "0"]  # every parameter sharded: the formula is exact
# ZeRO-0 keeps whole buffers (no sum over dp); ZeRO-2 and hybrid sharding (shards of 2 of the 4 dp
# ranks, replicated across the pairs) cut hidden matrices with 2,000-element buckets
TP_Z0 = ["--tp", "2", "--dp", "2", "--zero-stage", "0"] + MB4
PP_Z2 = ["--pp", "2", "--dp", "2", "--zero-stage", "2", "--reduce-bucket-size", "2000"] + MB4
HYBRID = ["--dp", "4", "--zero-stage", "2", "--zero-shard-size", "2", "--reduce-bucket-size", "2000"] + MB4
# the LLaMA-block MoE (8 experts, top-2, a shared expert): experts split over ep 2 and cut over tp 2
EP2 = ["--tp", "2", "--dp", "2", "--zero-stage", "2", "--expert-model-parallel-size", "2"] + MB4
# dp 4 x ep 2: each expert's state sharded over its expert-data-parallel group of 2 ranks
DP_EP2 = ["--dp", "4", "--zero-stage", "2", "--expert-model-parallel-size", "2"] + MB4


def layout_jobs(rank, world, jobs):
    """``jobs`` = [(argv, steps, save, load)] run one after the other on these ranks: each
    one's losses, gradient norms, model-state bytes and formula, and whether a hidden matrix
    has only part of its elements owned here (cut by a ZeRO shard boundary), and this rank's QKV
    weights and biases by name (TP partitions; not at ZeRO-3, where they are shards)."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    out = []
    for argv, steps, save, load in jobs:
        cfg = config_from_argv(argv + (["--load", load] if load else []), world)
        trainer = build_trainer(cfg, data=training.prepare_run(cfg))
        if load:
            trainer.load_checkpoint(load)
        losses, norms = [], []
        for _ in range(steps):
            values = trainer.train_step(trainer.next_batches()).values
            losses.append(values["loss"])
            norms.append(values["grad_norm"])
        if save:
            trainer.save_checkpoint(save)
        opt = trainer.optimizer
        owned = {}
        for _, runs in getattr(opt, "packs", []):
            for p, pr, *_ in runs:
                owned[id(p)] = owned.get(id(p), 0) + pr.size
        params = {id(p): p.numel() for c in trainer.chunks for p in c.parameters()}
        cut = any(0 < n < params[k] for k, n in owned.items())
        hidden = sum(p.numel() for c in trainer.chunks for p in c.parameters() if is_hidden_matrix(p))
        two_moments = DistributedOptimizer.formula(opt)["total"]
        memory = (opt.model_state_bytes(), opt.formula(), two_moments, sum(owned.values()), hidden)
        opt.wait_param_gather()  # --overlap-param-gather (ZeRO-1/2) leaves the last step's in flight
        qkv = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters() if ".attn.qkv." in n}
        out.append((losses, norms, memory, cut, qkv))
    return out


@pytest.mark.slow
def test_layouts_and_resume_equal_one_process(tmp_path):
    """The one-process runs (dense and MoE, Newton-Schulz in fp32) equal torch.optim.Muon +
    AdamW on the reference model (losses 1e-6, gradient norms 1e-6, MoE 2e-6), and every layout
    equals its one-process run within 1e-6 in losses and gradient norms over 10 steps: tp 2 + SP
    x dp 2 ZeRO-1, tp 2 x dp 2 ZeRO-0, pp 2 x dp 2 ZeRO-2 and ZeRO-3 and dp 4 ZeRO-2 sharded over
    pairs (hybrid), with hidden matrices cut by shard boundaries, and, on the MoE model, tp 2 x
    dp 2 x ep 2 and dp 4 x ep 2 ZeRO-2 (experts sharded over their expert-data-parallel group); a
    checkpoint saved at step 5 under tp 2 + SP resumes under pp 2 ZeRO-3; model-state bytes equal
    the optimizer's formula. With --qk-clip, tp 2 + SP x dp 2 ZeRO-1 equals its one-process run
    (losses, norms, the QKV weights joined over tp as ``assert_qkv_close``)."""
    ckpt = str(tmp_path)
    muon = MUON + ["--muon-ns-dtype", "fp32"]  # bf16 rounding would amplify summation order
    # the MoE oracle routes micro-batches of the layout's size: the router's aux and z losses are
    # means over a micro-batch's tokens, so another split is another loss (at micro-batch 2 the
    # first gradient norm differs by 2e-5 before any update, under AdamW as under Muon)
    moe = MOE_ARGS + MUON[len(BASE) :] + ["--muon-ns-dtype", "fp32"] + MB4
    qk = MUON + QK_CLIP
    singles = run_distributed(
        layout_jobs, 1, [(muon, STEPS, None, None), (moe, STEPS, None, None), (qk, STEPS, None, None)]
    )[0]
    (single, single_norms, *_), (moe_single, moe_norms, *_), qk_single = singles
    # the one-process runs equal torch.optim.Muon (fp32 Newton-Schulz) + AdamW on the reference;
    # the MoE norms to 2e-6 (up to 9e-7 seen): the dense-oracle experts sum in another order
    for argv, got, got_norms, norm_tol in ((muon, single, single_norms, 1e-6), (moe, moe_single, moe_norms, 2e-6)):
        want, want_norms = muon_oracle(argv, STEPS, fp32=True)
        for step in range(STEPS):
            assert math.isclose(got[step], want[step], rel_tol=1e-6), (argv[-1], step, got[step], want[step])
            assert math.isclose(got_norms[step], want_norms[step], rel_tol=norm_tol), (step, got_norms, want_norms)
    layouts = {  # name: (argv, partner rank owning the rest of each hidden matrix, "all" or None)
        "tp2-sp-dp2-zero1": (muon + TP_SP, 2),
        "pp2-dp2-zero3": (muon + PP_Z3, 1),
        "tp2-dp2-zero0": (muon + TP_Z0, "all"),
        "pp2-dp2-zero2": (muon + PP_Z2, 1),
        "dp4-zero2-shard2": (muon + HYBRID, 1),
        "dp4-ep2-zero2 moe": (moe + DP_EP2, None),
        "tp2-dp2-ep2-zero2 moe": (moe + EP2, None),
    }
    jobs = [(argv, STEPS, None, None) for argv, _ in layouts.values()]
    jobs += [(muon + TP_SP, STEPS // 2, ckpt, None), (muon + PP_Z3, STEPS - STEPS // 2, None, ckpt)]
    jobs.append((qk + TP_SP, STEPS, None, None))  # QK-Clip's maxima MAX-reduced over dp 2
    results = run_distributed(layout_jobs, 4, jobs, timeout_s=600)
    checks = [(name, job, single, single_norms) for job, name in enumerate(layouts)]
    for job in (len(layouts) - 2, len(layouts) - 1):
        checks[job] = (checks[job][0], job, moe_single, moe_norms)
    checks.append(("resume", len(layouts) + 1, single[STEPS // 2 :], single_norms[STEPS // 2 :]))
    checks.append(("tp2-sp-dp2-zero1 qk-clip", len(layouts) + 2, qk_single[0], qk_single[1]))
    for name, job, want, want_norms in checks:
        losses, norms, *_ = results[0][job]
        assert len(losses) == len(want)
        for step, (got, ref) in enumerate(zip(losses, want)):
            assert math.isclose(got, ref, rel_tol=1e-6), (name, step, got, ref)
        for step, (got, ref) in enumerate(zip(norms, want_norms)):
            assert math.isclose(got, ref, rel_tol=1e-6), (name, step, got, ref)
    assert results[0][len(layouts)][0] == results[0][0][0][: STEPS // 2]
    tp_pieces = [results[rank][len(layouts) + 2][4] for rank in (0, 1)]  # tp ranks 0, 1 of dp rank 0
    assert_qkv_close({n: join_partitions([q[n] for q in tp_pieces], 0, 3) for n in tp_pieces[0]}, qk_single[4])
    for job in (1, 3, 4):  # ZeRO-3, ZeRO-2, hybrid: some rank owns only part of a hidden matrix
        assert any(r[job][3] for r in results), checks[job][0]
    # the ZeRO formula with one moment on the hidden-matrix elements each rank owns; the partner
    # (same tp rank and stage, other dp rank of the shard group) owns the rest; ZeRO-0 owns them all
    for job, (name, (_, other)) in enumerate(layouts.items()):
        for rank, rank_results in enumerate(results):
            got, formula, two_moments, owned, hidden = rank_results[job][2]
            assert got["total"] - got["buckets"] == formula["total"] == two_moments - 4 * owned, name
            if other == "all":
                assert owned == hidden > 0, name
            elif other is not None:
                assert owned + results[rank ^ other][job][2][3] == hidden > 0, name


def test_muon_with_optimizer_offload_is_refused(capsys):
    from megazero import training

    argv = MUON + ["--zero-stage", "1", "--offload-optimizer", "cpu"]
    with pytest.raises(SystemExit) as exc:
        training.preflight(argv, 1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--optimizer muon runs on the device" in err and "fix: drop --offload-optimizer" in err


def test_memory_plan_keeps_one_moment_on_the_hidden_matrices():
    """The planner's model states under --optimizer muon: Adam's less 4 bytes per hidden-matrix
    element over the N = 2 ranks sharding them (4 layers of qkv, proj, fc1, fc2: 12 x 32^2 each,
    halved by tp 2)."""
    from megazero.config import config_from_argv
    from megazero.planning.plan import plan_memory
    from model.build import build_gpt_config

    argv = BASE + ["--tp", "2", "--dp", "2", "--zero-stage", "1"]
    adam, muon = (config_from_argv(argv + extra, 4) for extra in ([], ["--optimizer", "muon"]))
    gpt = build_gpt_config(adam, 1001)
    saved = plan_memory(adam, gpt).model_state_bytes - plan_memory(muon, gpt).model_state_bytes
    assert saved == 4 * (4 * 12 * 32 * 32 // 2) / 2
