"""DataParallel + DistributedOptimizer (ZeRO stages 0/1/2) against the single-process oracle.

fp32, dropout off. Each spawned run loops over many configurations (stage, overlap,
gradient accumulation) so that ranks are started once per DP size. The oracle is
``tests/support/reference.py``'s ``train_reference`` (torch.optim.AdamW on the full batch).
"""

import math

import numpy as np
import pytest
import torch

from megazero import collectives as C
from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.grad_buffer import GradBuffer, Range
from megazero.optim import clip
from megazero.optim.zero import DistributedOptimizer, zero_formula_bytes
from megazero.pipeline.partition import is_post_process, is_pre_process, layer_ids
from megazero.precision import DynamicLossScaler, LossScaleError
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from model.gpt import GPTStage, init_full_weights
from tests.support.distributed import run_distributed
from tests.support.reference import ReferenceGPT
from tests.support.zero import (
    ADAM,
    BUCKET,
    CLIP,
    SEED,
    STEPS,
    build,
    make_batches,
    pipeline_steps,
    reference,
    tiny_cfg,
    train,
)

EQUIV_STEPS = 5  # steps of the layout-equivalence runs (the loss-scale scripts need all STEPS)


def _equivalence_run(rank, world, tp, batches, accum=4):
    """Stages 0-2, overlap on and off, with 1 and ``accum`` micro-batches per step."""
    torch.manual_seed(0)
    groups = ProcessGroups.build(Topology(tp=tp, pp=1, dp=world // tp))
    cfg = tiny_cfg(sequence_parallel=tp > 1)
    out = {}
    for stage in (0, 1, 2):
        for num_micro in (1, accum):
            for overlap in (False, True):
                C.counter.clear()
                model, ddp, opt = build(cfg, groups, stage, overlap)
                losses, _, state_bytes = train(model, ddp, opt, groups, batches, num_micro, len(batches))
                rs_bytes = C.counter["reduce_scatter"]
                check_state_bytes(ddp, opt, state_bytes, param_bytes=4, grad_bytes=4)
                out[stage, num_micro, overlap] = dict(
                    losses=losses,
                    main=opt.main_param.numpy().copy(),
                    rs_bytes=rs_bytes,
                    padded=sum(b.layout.padded_numel for b in ddp.buffers),
                    params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(),
                )
    return out


def check_state_bytes(ddp, opt, state_bytes, param_bytes, grad_bytes):
    """Model-state bytes equal the ZeRO formula (sec. 5, Fig. 1) for these dtypes over the
    buffers padded to a multiple of N (an fp32 model keeps no second copy of its params);
    temporaries stay under the printed bound; no growth after step 2."""
    psi = sum(p.numel() for p in ddp.params)
    padded = sum(b.layout.padded_numel for b in ddp.buffers)
    n, stage = ddp.dp_size, ddp.stage
    main = 0 if param_bytes == 4 else 4
    grads = grad_bytes * psi / (n if stage == 2 else 1)
    formula = param_bytes * psi + grads + (main + 8) * psi / (1 if stage == 0 else n)
    assert formula == zero_formula_bytes(psi, n, stage, param_bytes, grad_bytes)
    got = state_bytes[-1]
    assert got == state_bytes[1], "model state grew between step 2 and the last step"
    assert got["total"] - got["buckets"] == zero_formula_bytes(padded, n, stage, param_bytes, grad_bytes)
    assert got["params"] == param_bytes * padded and padded - psi < n * len(ddp.buffers)
    assert got["main_params"] == (0 if param_bytes == 4 else got["exp_avg"])
    bucket = max(b.layout.bucket_size for b in ddp.buffers)
    staged = (ddp.buckets_in_flight + 2) * bucket * grad_bytes if stage == 2 else 0
    step_tmp = max(4 * bucket, (1001 + 1001 // n) * param_bytes)
    assert got["buckets"] <= opt.bucket_bound_bytes() <= max(staged, step_tmp)
    if stage == 2:
        assert got["buckets"] > 0


def _check_equivalence(results, ref, check_bytes=True, tp=1):
    for out in results:
        for (stage, num_micro, overlap), r in out.items():
            assert r["losses"] == pytest.approx(ref, rel=1e-5), (stage, num_micro, overlap)
            if overlap:  # overlap on and off: bit-identical
                off = out[stage, num_micro, False]
                assert r["losses"] == off["losses"]
                assert np.array_equal(r["main"], off["main"])
                assert np.array_equal(r["params"], off["params"])
            # every gradient element (the tied embedding too) is reduced exactly once per
            # step (stage 1) or once per micro-batch (stage 2)
            per_step = {0: 0, 1: 1, 2: num_micro}[stage]
            assert not check_bytes or r["rs_bytes"] == 4 * r["padded"] * per_step * len(ref)
        accum = max(n for _, n, _ in out)
        for stage in (0, 1, 2):  # micro-batch 1 x 4 accumulation == micro-batch 4 x 1 (or 2 x 2)
            assert out[stage, accum, True]["losses"] == pytest.approx(out[stage, 1, True]["losses"], rel=1e-5)
    for a, b in zip(results, results[tp:]):  # DP peers hold identical model params
        for key in a:
            assert np.array_equal(a[key]["params"], b[key]["params"])


def test_zero_matches_reference_dp2():
    cfg = tiny_cfg()
    batches = make_batches(cfg, EQUIV_STEPS)
    results = run_distributed(_equivalence_run, 2, 1, batches)
    _check_equivalence(results, reference(cfg, batches, EQUIV_STEPS))


@pytest.mark.slow
def test_zero_matches_reference_dp4_and_tp2_dp2():
    """dp 4 and tp 2 x dp 2 (sequence parallel), 3 steps, 1 and 2 micro-batches per step (dp 2
    covers 4): a step's CPU time on gloo ranks is its collectives' latency, stage 2 reducing
    once per micro-batch; 3 steps still compare the state bytes of step 2 and the last."""
    cfg = tiny_cfg()
    batches = make_batches(cfg, 3)
    ref = reference(cfg, batches, 3)
    _check_equivalence(run_distributed(_equivalence_run, 4, 1, batches, 2), ref)
    _check_equivalence(
        run_distributed(_equivalence_run, 4, 2, batches, 2), ref, check_bytes=False, tp=2
    )  # TP's sequence-parallel reduce-scatters count too


def _mixed_precision_run(rank, world, batches, inject):
    groups = ProcessGroups.build(Topology(tp=1, pp=1, dp=world))
    out = {"bf16": {}}
    for stage in (0, 1, 2):  # bf16 params and grads: the paper's 2-byte formulas
        model, ddp, opt = build(tiny_cfg(params_dtype=torch.bfloat16), groups, stage, True, grad_dtype=torch.bfloat16)
        *_, state_bytes = train(model, ddp, opt, groups, batches, 2)
        check_state_bytes(ddp, opt, state_bytes, param_bytes=2, grad_bytes=2)
        out["bf16"][stage] = state_bytes[-1]
    # fp32 model with a dynamic fp16 loss scaler: inf injected into rank 1's gradient
    scaler = DynamicLossScaler(initial_scale_power=16, loss_scale_window=3, hysteresis=2)
    model, ddp, opt = build(tiny_cfg(), groups, 2, True, scaler=scaler)
    out["scripted"] = _overflow_run(rank, model, ddp, opt, groups, batches, inject, STEPS)
    # a real fp16 model with fp16 gradient buckets; hysteresis 1: one overflow halves
    scaler = DynamicLossScaler(initial_scale_power=16, hysteresis=1)
    model, ddp, opt = build(
        tiny_cfg(params_dtype=torch.float16), groups, 2, True, scaler=scaler, grad_dtype=torch.float16
    )
    out["fp16"] = _overflow_run(rank, model, ddp, opt, groups, batches, {1}, 4)
    model, ddp, opt = build(tiny_cfg(), groups, 1, True, clip_grad=CLIP)  # clipping active
    out["clip"], results, _ = train(model, ddp, opt, groups, batches, 2)
    out["norms"] = [r.grad_norm for r in results]
    return out


def _overflow_run(rank, model, ddp, opt, groups, batches, inject, steps):
    """Train with inf put into one element of rank 1's fc1 gradient at steps ``inject``."""
    poison = {"on": False}
    model.layers["1"].mlp.fc1.weight.register_hook(
        lambda g: g.index_fill(0, torch.tensor([1]), float("inf")) if poison["on"] else g
    )
    hysteresis = []  # before each step's last backward

    def on_backward(step, micro):
        poison["on"] = rank == 1 and step in inject and micro == 0
        if micro == 1:
            hysteresis.append(opt.loss_scaler.hysteresis_left)

    losses, results, _ = train(model, ddp, opt, groups, batches, 2, steps, on_backward)
    return dict(
        losses=losses,
        skipped=[r.skipped for r in results],
        scales=[r.loss_scale for r in results],
        hysteresis=hysteresis,
        skipped_steps=opt.loss_scaler.skipped_steps,
        final_scale=opt.loss_scaler.scale,
    )


def test_memory_formulas_loss_scale_schedule_and_clipping():
    cfg = tiny_cfg()
    batches = make_batches(cfg, STEPS)
    inject = {2, 3, 7}
    results = run_distributed(_mixed_precision_run, 2, batches, inject)
    groups = ProcessGroups.single()  # dp 1, in this process
    for stage in (0, 1, 2):
        model, ddp, opt = build(tiny_cfg(params_dtype=torch.bfloat16), groups, stage, False, grad_dtype=torch.bfloat16)
        *_, state_bytes = train(model, ddp, opt, groups, batches, 1, steps=3)
        check_state_bytes(ddp, opt, state_bytes, param_bytes=2, grad_bytes=2)
    psi = sum(p.numel() for p in ddp.params)
    b = results[0]["bf16"]  # exact paper numbers at N = 2 (Psi is even: no padding)
    assert psi % 2 == 0
    assert b[0]["total"] - b[0]["buckets"] == 16 * psi
    assert b[1]["total"] - b[1]["buckets"] == 4 * psi + 12 * psi // 2
    assert b[2]["total"] - b[2]["buckets"] == 2 * psi + 14 * psi // 2
    # loss-scale rules of precision.DynamicLossScaler (window 3, hysteresis 2), by hand:
    # step 2 overflow -> hysteresis 2->1, scale kept; step 3 overflow -> scale halved;
    # steps 4-6 clean -> doubled after 3; step 7 overflow -> hysteresis 1, kept.
    big, half = 2.0**16, 2.0**15
    expected_scales = [big, big, big, big, half, half, half, big, big, big]
    expected_skipped = [s in inject for s in range(STEPS)]
    expected_hysteresis = [2, 2, 2, 1, 1, 1, 1, 2, 1, 1]  # before each step's backward
    for r in results:
        f = r["scripted"]
        assert f["scales"] == expected_scales
        assert f["skipped"] == expected_skipped
        assert f["hysteresis"] == expected_hysteresis
        assert f["skipped_steps"] == 3 and f["final_scale"] == big
    # global-norm clipping (ZeRO-1) matches torch.nn.utils.clip_grad_norm_ in the oracle
    assert results[0]["clip"] == pytest.approx(reference(cfg, batches, clip_grad=CLIP), rel=1e-5)
    assert min(results[0]["norms"]) > CLIP  # every step was clipped
    # the updates that did happen used correctly unscaled gradients: the fp32 oracle
    # with the skipped steps left out gives the same losses
    expected = _reference_skipping(cfg, batches, inject, STEPS)
    assert results[0]["scripted"]["losses"] == pytest.approx(expected, rel=1e-5)
    assert results[1]["scripted"]["losses"] == results[0]["scripted"]["losses"]
    for r in results:  # fp16 model: 2^16, overflow at step 1 (skipped), then 2^15
        assert r["fp16"]["scales"] == [big, big, half, half]
        assert r["fp16"]["skipped"] == [False, True, False, False]
        assert r["fp16"]["losses"] == pytest.approx(_reference_skipping(cfg, batches, {1}, 4), rel=1e-4)


def _reference_skipping(cfg, batches, skip, steps):
    model = ReferenceGPT.from_full_weights(init_full_weights(cfg, SEED), cfg.vocab_size, cfg.num_attention_heads)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        **ADAM,
    )
    losses = []
    for step in range(steps):
        tokens, labels = batches[step]
        opt.zero_grad()
        loss = model.loss(tokens, labels)
        losses.append(loss.item())
        if step not in skip:
            loss.backward()
            opt.step()
    return losses


def test_stuck_overflow_raises_clear_error():
    groups = ProcessGroups.single()
    cfg = tiny_cfg(num_layers=1)
    model, ddp, opt = build(
        cfg, groups, 1, False, scaler=DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_loss_scale=1.0)
    )
    opt.max_consecutive_skips = 3
    tokens, labels = make_batches(cfg, 1)[0]
    results = []
    with pytest.raises(
        LossScaleError,
        match=r"at the minimum loss scale 1 \(--max-consecutive-skips 3\)"
        r".*--bf16 instead of --fp16",
    ):
        for _ in range(10):
            opt.zero_grad()
            ddp.before_backward(0, True)
            (opt.scale_loss(model(tokens, labels).sum()) * float("inf")).backward()
            results.append(opt.step())
    # scale 4 -> 2 -> 1, then three skips at the minimum scale: the third raises
    assert [r.loss_scale for r in results] == [4.0, 2.0, 1.0, 1.0]
    assert all(r.skipped for r in results)
    # fp32 (no scaler): the advice names neither loss scales nor --fp16
    model, ddp, opt = build(cfg, groups, 1, False)
    opt.max_consecutive_skips = 2
    with pytest.raises(LossScaleError, match="2 consecutive steps without loss scaling") as err:
        for _ in range(3):
            opt.zero_grad()
            ddp.before_backward(0, True)
            (model(tokens, labels).sum() * float("inf")).backward()
            opt.step()
    assert "--fp16" not in str(err.value)


def test_state_dict_resumes_under_another_bucketing():
    cfg, groups = tiny_cfg(num_layers=1), ProcessGroups.single()
    batches = make_batches(cfg, 6)
    model, ddp, opt = build(cfg, groups, 0, False)
    straight, *_ = train(model, ddp, opt, groups, batches, 1, steps=6)
    model, ddp, opt = build(cfg, groups, 0, False)
    first, *_ = train(model, ddp, opt, groups, batches[:3], 1, steps=3)
    state = opt.state_dict()
    model, ddp, opt = build(cfg, groups, 2, True, bucket=53)  # fresh weights, new layout
    opt.load_state_dict(state)
    assert opt.step_count == 3
    rest, *_ = train(model, ddp, opt, groups, batches[3:], 1, steps=3)
    assert first + rest == pytest.approx(straight, rel=1e-6)
    state["shards"] = state["shards"][1:]
    with pytest.raises(ValueError, match="pass every rank's shards"):
        opt.load_state_dict(state)


def test_grad_buffer_layout_tiny_buckets():
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (5, 3, 4))  # registration order
    layout = GradBuffer([a, b, c], bucket_size=3, dp_size=2, dp_rank=1)
    assert layout.params == [c, b, a]  # reverse registration order
    assert [layout.param_range[id(p)] for p in (c, b, a)] == [Range(0, 4), Range(4, 7), Range(7, 12)]
    assert layout.bucket_size == 4 and layout.padded_numel == 12
    assert [bk.range for bk in layout.buckets] == [Range(0, 4), Range(4, 8), Range(8, 12)]
    assert layout.param_buckets[id(a)] == (1, 2)  # a straddles two buckets
    assert [bk.shard_world for bk in layout.buckets] == [Range(2, 4), Range(6, 8), Range(10, 12)]
    assert [bk.shard_local for bk in layout.buckets] == [Range(0, 2), Range(2, 4), Range(4, 6)]
    # rank 0's local [1, 5) is world [1, 2), [4, 6), [8, 9)
    assert [w for w, _ in layout.local_to_world(Range(1, 5), 0)] == [Range(1, 2), Range(4, 6), Range(8, 9)]
    odd = GradBuffer([a, b], bucket_size=100, dp_size=4, dp_rank=3)  # 8 elements + padding
    assert odd.padded_numel == 8 and odd.buckets[0].shard_world == Range(6, 8)
    with pytest.raises(ValueError, match="bucket_size"):
        GradBuffer([a], bucket_size=0, dp_size=2, dp_rank=0)


def _pipeline_run(rank, world, batches, num_layers):
    """pp 2 x dp 2 through the pipeline executor: tied embeddings on stages 0 and 1."""
    groups = ProcessGroups.build(Topology(tp=1, pp=2, dp=2))
    cfg, num_micro, out = tiny_cfg(num_layers=num_layers), 4, {}
    for kind, vp in (("1f1b", 1), ("interleaved", 2)):
        for stage in (1, 2):
            for overlap in (False, True):
                chunks = [
                    GPTStage(
                        cfg,
                        groups,
                        layer_ids(num_layers, 2, groups.pp_rank, vp, v),
                        is_pre_process(groups.pp_rank, v),
                        is_post_process(groups.pp_rank, 2, v, vp),
                        SEED,
                    )
                    for v in range(vp)
                ]
                ddp = DataParallel(chunks, groups, zero_stage=stage, bucket_size=BUCKET, overlap_comm=overlap)
                opt = DistributedOptimizer(
                    ddp,
                    groups,
                    lr=ADAM["lr"],
                    beta1=ADAM["betas"][0],
                    beta2=ADAM["betas"][1],
                    eps=ADAM["eps"],
                    weight_decay=ADAM["weight_decay"],
                    allgather_bucket_size=1001,
                )
                out[kind, stage, overlap] = pipeline_steps(groups, chunks, ddp, opt, batches, kind, vp, num_micro, cfg)
    return out


@pytest.mark.slow
def test_zero_under_pipeline_parallelism_with_tied_embeddings():
    """pp 2 x dp 2, 1F1B and interleaved, ZeRO-1/2, overlap on and off: 3 steps of 4
    micro-batches equal the oracle."""
    cfg = tiny_cfg(num_layers=4)
    batches = make_batches(cfg, 3)
    ref = reference(cfg, batches, 3)
    results = run_distributed(_pipeline_run, 4, batches, 4)
    for out in results:
        for key, r in out.items():
            assert r["losses"] == pytest.approx(ref, rel=1e-5), key
            if key[2]:
                assert r["losses"] == out[key[0], key[1], False]["losses"]
    # the two copies of the tied word embedding stay bit-identical (stage 0 rank 0, stage 1
    # rank 2: same dp coordinate)
    for key in results[0]:
        assert np.array_equal(results[0][key]["shared"][0], results[2][key]["shared"][0])


@pytest.mark.cuda
def test_single_gpu_matches_cpu():
    cfg, groups = tiny_cfg(), ProcessGroups.single()
    batches = make_batches(cfg, 3)
    losses = {}
    for device in ("cpu", "cuda"):
        model = GPTStage(cfg, groups, range(cfg.num_layers), True, True, SEED, device=device)
        ddp = DataParallel([model], groups, zero_stage=1, bucket_size=BUCKET, overlap_comm=True)
        opt = DistributedOptimizer(ddp, groups, lr=ADAM["lr"], clip_grad=1.0)
        losses[device] = []
        for tokens, labels in batches:
            opt.zero_grad()
            ddp.before_backward(0, True)
            loss = model(tokens.to(device), labels.to(device)).sum() / labels.numel()
            loss.backward()
            opt.step()
            losses[device].append(loss.item())
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-4)


def test_overflow_check_from_the_norm_and_one_rank_buffers():
    """One rank, nothing to reduce (``ShardedBuffer.solo``): the buffer is not zeroed between
    steps and the step's overflow check is the norm's sum of squares.

    - finite gradients whose squares overflow the CPU norm's fp32 rows (about 1e20) are no
      overflow: the step runs with an inf norm, as when a separate inf/NaN pass decided;
    - a NaN in one gradient element skips the step;
    - a parameter without a gradient in a step reads zeros, not the previous step's gradient.
    """
    groups = ProcessGroups.single()
    cfg = tiny_cfg(num_layers=1, vocab_size=4200)  # a buffer above clip.SMALL: fp32 rows
    model, ddp, opt = build(cfg, groups, 0, False)
    assert ddp.buffers and all(b.solo for b in ddp.buffers)
    assert sum(b.grads.numel() for b in ddp.buffers) > clip.SMALL
    tokens, labels = make_batches(cfg, 1)[0]

    def backward(loss_of):
        opt.zero_grad()
        ddp.before_backward(0, True)
        loss_of().backward()

    backward(lambda: model(tokens, labels).sum())
    for b in ddp.buffers:
        b.grads.fill_(1e20)  # finite in fp32; its square is not
    r = opt.step()
    assert not r.skipped and math.isinf(r.grad_norm) and opt.skipped_steps == 0

    model, ddp, opt = build(cfg, groups, 0, False)
    backward(lambda: model(tokens, labels).sum())
    ddp.buffers[0].grads[3] = float("nan")
    r = opt.step()
    assert r.skipped and math.isnan(r.grad_norm) and opt.skipped_steps == 1

    backward(lambda: model(tokens, labels).sum())  # every range written, the NaN overwritten
    assert bool(torch.isfinite(torch.cat([b.grads for b in ddp.buffers])).all())
    assert not opt.step().skipped
    # only the word embedding gets a gradient: every other range must read zero
    backward(lambda: model.embedding.word_embeddings(tokens).sum())
    ddp.finish_grad_sync()
    word = model.embedding.word_embeddings.weight
    for buf in ddp.buffers:
        for p in buf.layout.params:
            pr = buf.layout.param_range[id(p)]
            g = buf.grads[pr.start : pr.end]
            if p is word:
                assert torch.equal(
                    g, torch.bincount(tokens.flatten(), minlength=p.shape[0]).repeat_interleave(p.shape[1]).to(g.dtype)
                )
            else:
                assert not bool(g.any()), tuple(p.shape)
