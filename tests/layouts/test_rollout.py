"""Rollouts (megazero/post_training/rollout.py with model/rollout.py's ragged KV-cache decoder).

One process: a row sampled in a ragged batch gives the tokens and log-probs it gets alone;
right- and left-padded prompts give the same logits; the log-probs equal a trainer-style
forward over prompt + response (no cache, ``vocab_parallel_log_probs``; QK-norm too) at temperature 1 and
0.7 (also with a sliding window on one layer, which left padding must not shift); top-k / top-p
draws stay inside their sets; greedy decoding equals model/sampling.py's;
EOD stops a row and ``max_new_tokens`` bounds it; bad settings raise a one-line ValueError
naming them; an MoE block's log-probs equal the trainer's, and an expert capacity is refused.
Two gloo ranks: tp 2, dp 2 and dp 2 at ZeRO-3 give the one-process rollout (tokens equal,
log-probs within 1e-6), and the ZeRO-3 rollout's all-gather bytes are one gather of every unit
whatever the number of decoded tokens. The trainer's chunks through ``make_decoder``, on four
ranks: pp2 x dp2, tp2 x pp2, pp2 with a virtual pipeline, ZB-V, tp2 with sequence parallelism
and cp2 x dp2 (no cp communication), GPT-2 and LLaMA-style blocks, give one process's rollout;
under pp2 a row alone equals the row in the batch and a step sends one [B, 1, H] activation;
MoE with expert parallelism is refused by name. On eight: tp2 x pp2 x dp2 at ZeRO-3, each
unit gathered once.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megazero.post_training.rollout import RolloutSettings, generate, rollout
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel.cross_entropy import vocab_parallel_log_probs
from model.config import GPTConfig
from model.gpt import GPTStage
from model.rollout import StageDecoder
from tests.support.distributed import run_distributed
from tests.support.layouts import BASE, WIDER
from tests.support.layouts import LLAMA as LLAMA_FLAGS

SEED, N_NEW = 3, 8
LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    num_query_groups=2,
    add_bias_linear=False,
    tie_embeddings=False,
)
MLA = dict(  # DeepSeek's MLA (no GQA): the rollout decodes from the compressed latent cache
    multi_latent_attention=True,
    q_lora_rank=12,
    kv_lora_rank=10,
    qk_head_dim=6,
    qk_pos_emb_head_dim=4,
    v_head_dim=5,
    num_query_groups=None,
)
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [40, 41, 42, 43, 44], [17, 3]]
SETTINGS = RolloutSettings(max_new_tokens=N_NEW, temperature=0.7, top_k=20, top_p=0.9, seed=11)


def _cfg(arch: str) -> GPTConfig:
    return GPTConfig(
        vocab_size=61,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.1,
        make_vocab_size_divisible_by=8,
        **(LLAMA if arch.startswith("llama") else {}) | (MLA if arch == "llama-mla" else {}),
        **(dict(qk_layernorm=True) if arch == "llama-qk-norm" else {}),
        # a window of 4 positions on layer 1, layer 2 full: rows of 10 to 17 tokens reach past it
        **(dict(window_size=[3, 0], window_attn_skip_freq=[2]) if arch.startswith("llama-window") else {}),
        # gpt-oss's attention sinks: the rollout's explicit sink column against the trainer's blockwise path
        **(dict(softmax_type="learnable") if arch == "llama-window-sinks" else {}),
    )


def _stage(arch: str, groups=None) -> GPTStage:
    groups = groups or ProcessGroups.single()
    cfg = _cfg(arch)
    return GPTStage(cfg, groups, range(cfg.num_layers), True, True, SEED).eval()


def _trainer_log_probs(stage, prompt: list, response: list, temperature: float) -> torch.Tensor:
    """``[len(response)]`` log-probs of the response from one forward over prompt + response."""
    ids = torch.tensor([prompt + response])  # (1, T)
    with torch.no_grad():
        logits = stage(ids)  # (1, T, V_pad/tp)
    lp = vocab_parallel_log_probs(
        logits[:, :-1],
        ids[:, 1:],
        stage.tp,
        vocab_size=stage.cfg.vocab_size,
        padded_vocab_size=stage.padded_vocab,
        temperature=temperature,
    )
    return lp[0, len(prompt) - 1 :]


def _rows(r) -> list[list[int]]:
    return [r.tokens[b, : int(n)].tolist() for b, n in enumerate(r.lengths)]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama-mla"])
def test_row_in_a_ragged_batch_equals_the_row_alone(arch):
    stage = _stage(arch)
    batch = rollout(StageDecoder(stage), PROMPTS, SETTINGS, step=4, samples_per_prompt=2)
    assert batch.tokens.shape == (len(PROMPTS) * 2, N_NEW)
    assert len({tuple(r) for r in _rows(batch)}) == len(PROMPTS) * 2  # keys give distinct draws
    for b in range(len(PROMPTS) * 2):
        i, s = divmod(b, 2)
        alone = generate(StageDecoder(stage), [PROMPTS[i]], [(i, s)], SETTINGS, step=4)
        assert torch.equal(alone.tokens[0], batch.tokens[b]), b
        torch.testing.assert_close(alone.log_probs[0], batch.log_probs[b], rtol=0, atol=1e-6)
    other_step = rollout(StageDecoder(stage), PROMPTS, SETTINGS, step=5, samples_per_prompt=2)
    assert not torch.equal(other_step.tokens, batch.tokens)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama-window", "llama-mla"])  # window: in positions, not slots
def test_right_and_left_padding_give_the_same_logits(arch):
    stage = _stage(arch)
    L = max(len(p) for p in PROMPTS)
    out = {}
    for side in ("left", "right"):
        ids = torch.zeros(len(PROMPTS), L, dtype=torch.long)
        valid = torch.zeros(len(PROMPTS), L, dtype=torch.bool)
        for b, p in enumerate(PROMPTS):
            cols = slice(L - len(p), L) if side == "left" else slice(0, len(p))
            ids[b, cols], valid[b, cols] = torch.tensor(p), True
        dec = StageDecoder(stage)
        logits = [dec.prefill(ids, valid)]
        for t in range(3):
            logits.append(dec.step(torch.full((len(PROMPTS),), 10 + t)))
        out[side] = torch.stack(logits)  # (4, B, V)
    torch.testing.assert_close(out["right"], out["left"], rtol=0, atol=1e-5)
    alone = StageDecoder(stage).prefill(torch.tensor([PROMPTS[1]]), torch.ones(1, len(PROMPTS[1]), dtype=torch.bool))
    torch.testing.assert_close(out["left"][0, 1:2], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama-qk-norm", "llama-window", "llama-window-sinks", "llama-mla"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_a_trainer_forward_over_prompt_and_response(arch, temperature):
    stage = _stage(arch)
    settings = RolloutSettings(max_new_tokens=N_NEW, temperature=temperature, top_k=20, top_p=0.9, seed=2)
    r = rollout(StageDecoder(stage), PROMPTS, settings)
    assert bool(r.mask.all())  # no EOD: every row runs to max_new_tokens
    for b, response in enumerate(_rows(r)):
        want = _trainer_log_probs(stage, PROMPTS[b], response, temperature)
        torch.testing.assert_close(r.log_probs[b], want, rtol=0, atol=1e-6)
    other = 0.5 if temperature == 1.0 else 1.0  # scored at another temperature: not equal
    assert (_trainer_log_probs(stage, PROMPTS[0], _rows(r)[0], other) - r.log_probs[0]).abs().max() > 1e-3


def test_top_k_and_top_p_draws_stay_in_their_sets():
    stage = _stage("gpt2")
    for settings in (
        RolloutSettings(max_new_tokens=N_NEW, temperature=1.0, top_k=3, seed=1),
        RolloutSettings(max_new_tokens=N_NEW, temperature=1.0, top_p=0.2, seed=1),
    ):
        r = rollout(StageDecoder(stage), PROMPTS, settings, samples_per_prompt=3)
        for b, response in enumerate(_rows(r)):
            ids = torch.tensor([PROMPTS[b // 3] + response])
            with torch.no_grad():
                probs = stage(ids)[0, len(PROMPTS[b // 3]) - 1 : -1, : stage.cfg.vocab_size].softmax(-1)  # (N, V)
            chosen = probs.gather(1, torch.tensor(response)[:, None])  # (N, 1)
            if settings.top_k:
                assert bool(((probs > chosen).sum(dim=1) < settings.top_k).all())
            else:  # the mass of strictly more likely tokens is below top_p
                assert bool((probs.where(probs > chosen, 0).sum(dim=1) < settings.top_p).all())


def test_greedy_rollout_equals_kv_cache_greedy_decoding():
    from model.sampling import sample

    stage = _stage("llama")
    r = rollout(StageDecoder(stage), PROMPTS, RolloutSettings(max_new_tokens=N_NEW, greedy=True, temperature=0))
    for b, p in enumerate(PROMPTS):
        assert r.tokens[b].tolist() == sample(stage, p, N_NEW)[len(p) :]
        torch.testing.assert_close(r.log_probs[b], _trainer_log_probs(stage, p, _rows(r)[b], 1.0), rtol=0, atol=1e-6)


def test_eod_stops_a_row_and_max_new_tokens_bounds_it():
    stage = _stage("gpt2")
    free = rollout(StageDecoder(stage), PROMPTS, SETTINGS)
    assert free.tokens.shape == (len(PROMPTS), N_NEW) and free.lengths.tolist() == [N_NEW] * len(PROMPTS)
    eod = int(free.tokens[0, 2])  # row 0 draws it at step 2 (maybe earlier too)
    stopped = rollout(StageDecoder(stage), PROMPTS, replace(SETTINGS, eod=eod))
    for b in range(len(PROMPTS)):
        row = free.tokens[b].tolist()
        n = row.index(eod) + 1 if eod in row else N_NEW
        assert stopped.lengths[b] == n
        assert stopped.tokens[b, :n].tolist() == row[:n]  # same draws up to and including EOD
        assert stopped.tokens[b, n:].tolist() == [eod] * (N_NEW - n)  # pad = EOD
        assert stopped.mask[b].tolist() == [True] * n + [False] * (N_NEW - n)
        assert bool((stopped.log_probs[b, n:] == 0).all())
        torch.testing.assert_close(stopped.log_probs[b, :n], free.log_probs[b, :n], rtol=0, atol=1e-6)
    assert stopped.lengths[0] <= 3
    short = rollout(StageDecoder(stage), PROMPTS, replace(SETTINGS, max_new_tokens=3))
    assert short.tokens.shape == (len(PROMPTS), 3) and torch.equal(short.tokens, free.tokens[:, :3])


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=30), "max_new_tokens"),  # 9-token prompt + 30 > 32 positions
    ],
)
def test_bad_settings_raise_one_line_naming_them(change, name):
    stage = _stage("gpt2")
    with pytest.raises(ValueError, match=name) as err:
        rollout(StageDecoder(stage), PROMPTS, replace(SETTINGS, **change))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no tokens"):
        rollout(StageDecoder(stage), [[1], []], SETTINGS)


MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)


def test_moe_rollout_log_probs_equal_a_trainer_forward_and_rows_alone():
    cfg = replace(_cfg("gpt2"), **MOE)
    stage = GPTStage(cfg, ProcessGroups.single(), range(cfg.num_layers), True, True, SEED).eval()
    r = rollout(StageDecoder(stage), PROMPTS, SETTINGS, step=4, samples_per_prompt=2)
    for b, response in enumerate(_rows(r)):
        want = _trainer_log_probs(stage, PROMPTS[b // 2], response, SETTINGS.temperature)
        torch.testing.assert_close(r.log_probs[b], want, rtol=0, atol=1e-6)
    dense = rollout(StageDecoder(_stage("gpt2")), PROMPTS, SETTINGS, step=4, samples_per_prompt=2)
    assert not torch.equal(r.tokens, dense.tokens)  # the experts are in the path
    alone = generate(StageDecoder(stage), [PROMPTS[1]], [(1, 1)], SETTINGS, step=4)
    assert torch.equal(alone.tokens[0], r.tokens[3])


def test_moe_with_an_expert_capacity_is_refused_by_name():
    cfg = replace(_cfg("gpt2"), moe_expert_capacity_factor=1.0, **MOE)
    stage = GPTStage(cfg, ProcessGroups.single(), range(cfg.num_layers), True, True, SEED).eval()
    with pytest.raises(ValueError, match="--moe-expert-capacity-factor"):
        StageDecoder(stage)


def _layouts(rank, world):
    """tp 2 and dp 2 rollouts of both blocks; a dp 2 ZeRO-3 rollout of 2 and 8 new tokens with
    the all-gather bytes each counted, and the bytes of one gather of every unit."""
    from megazero import collectives as C
    from megazero.data_parallel.ddp import DataParallel
    from megazero.topology import Topology
    from model.build import zero3_units

    out = {}
    tp = ProcessGroups.build(Topology(tp=world, pp=1, dp=1))
    dp = ProcessGroups.build(Topology(tp=1, pp=1, dp=world))
    for arch in ("gpt2", "llama"):
        out[arch, "tp"] = rollout(StageDecoder(_stage(arch, tp)), PROMPTS, SETTINGS, samples_per_prompt=2)
        out[arch, "dp"] = rollout(
            StageDecoder(_stage(arch, dp)), PROMPTS, SETTINGS, samples_per_prompt=2, dp_group=dp.dp
        )
    stage = GPTStage(_cfg("gpt2"), dp, range(2), True, True, SEED).eval()
    ddp = DataParallel([stage], dp, zero_stage=3, bucket_size=301, overlap_comm=True, units=[zero3_units(stage)])
    buffers = [b for u in ddp.zero3.units for b in u.buffers]
    out["unit_bytes"] = sum(b.layout.shard_numel * b.params_shard.element_size() for b in buffers)
    try:
        rollout(StageDecoder(stage), PROMPTS, SETTINGS, dp_group=dp.dp)
    except ValueError as e:  # sharded parameters are refused, not read as zeros
        out["refused"] = str(e)
    for n in (2, N_NEW):
        before = C.counter["all_gather"]
        settings = replace(SETTINGS, max_new_tokens=n)
        r = rollout(StageDecoder(stage), PROMPTS, settings, samples_per_prompt=2, dp_group=dp.dp, zero3=ddp.zero3)
        out["zero3", n] = (r, C.counter["all_gather"] - before, ddp.zero3.live)
    return out


def test_rollouts_are_identical_at_tp2_dp2_and_zero3():
    got = run_distributed(_layouts, 2, timeout_s=300)
    for arch in ("gpt2", "llama"):
        stage = _stage(arch)
        want = rollout(StageDecoder(stage), PROMPTS, SETTINGS, samples_per_prompt=2)
        for rank in got:
            for layout in ("tp", "dp"):
                r = rank[arch, layout]
                assert torch.equal(r.tokens, want.tokens) and torch.equal(r.mask, want.mask), (arch, layout)
                torch.testing.assert_close(r.log_probs, want.log_probs, rtol=0, atol=1e-6)
            # the trainer at tp 1 scores the tp 2 rollout's tokens as the rollout did
            for b, response in enumerate(_rows(rank[arch, "tp"])):
                lp = _trainer_log_probs(stage, PROMPTS[b // 2], response, SETTINGS.temperature)
                torch.testing.assert_close(rank[arch, "tp"].log_probs[b], lp, rtol=0, atol=1e-6)
    want = rollout(StageDecoder(_stage("gpt2")), PROMPTS, SETTINGS, samples_per_prompt=2)
    for rank in got:
        assert rank["unit_bytes"] > 0 and "zero3=" in rank["refused"]
        for n in (2, N_NEW):
            r, gathered, live = rank["zero3", n]
            assert torch.equal(r.tokens, want.tokens[:, :n])
            torch.testing.assert_close(r.log_probs, want.log_probs[:, :n], rtol=0, atol=1e-6)
            results = len(r.tokens) // 2 * n * (8 + 1 + 4)  # this replica's tokens, mask, log-probs
            assert gathered == rank["unit_bytes"] + results, (n, gathered)  # one gather of each unit, any n
            assert live == 0  # every unit released after the rollout


# ---- every training layout: the trainer's chunks through model.rollout.make_decoder ----

TRAIN_ARGV = BASE + WIDER + ["--seq-length", "32"]
"""The layout sweep's 4-layer GPT (tests/support/layouts.py) with weights of std 0.1 (logits far
from uniform, so the top-k set and the draws follow the model) and room for prompt (<= 9) +
N_NEW tokens."""

LAYOUTS_4 = {
    "pp2-dp2": ["--pp", "2", "--dp", "2"],
    "tp2-pp2": ["--tp", "2", "--pp", "2"],
    "pp2-vp2-dp2": ["--pp", "2", "--dp", "2", "--virtual-pipeline-size", "2"],
    "pp2-zbv-dp2": ["--pp", "2", "--dp", "2", "--pipeline-schedule", "zb-v"],
    "tp2-sp-dp2": ["--tp", "2", "--dp", "2", "--sequence-parallel"],
    "cp2-dp2": ["--cp", "2", "--dp", "2"],
}
LLAMA_4 = ("tp2-pp2", "pp2-vp2-dp2", "pp2-zbv-dp2", "tp2-sp-dp2", "cp2-dp2")
"""The layouts the LLaMA-style block also runs under: where its parts meet a split (query groups
and SwiGLU halves over tp, RoPE positions over chunks and over cp, the untied head on the last
stage); pp2 x dp2 only moves rows, which the GPT-2 block shows."""


def _oracle(gcfg, seed: int) -> GPTStage:
    """One process's whole model of the trainer's GPTConfig and seed (the same weights)."""
    single = replace(gcfg, sequence_parallel=False, tp_overlap_grad_reduce=False)
    return GPTStage(single, ProcessGroups.single(), range(single.num_layers), True, True, seed).eval()


def _trainer_rollout(world, argv):
    """(the global rollout on this rank, the trainer's GPTConfig and seed, the bytes of the
    rollout's collectives over the cp group and, without a pipeline, of its sends: the ring's),
    trainer, decoder."""
    from megazero import collectives as C
    from megazero.training import build_trainer
    from model.rollout import make_decoder

    trainer = build_trainer(argv, world)
    for chunk in trainer.chunks:
        chunk.eval()
    decoder = make_decoder(trainer.chunks, trainer.groups)
    g, zero3 = trainer.groups, trainer.ddp.zero3
    cp = tuple(sorted(C.group_ranks(g.cp))) if g.cp_size > 1 else None
    before = sum(n for (_, ranks), n in C.by_group.items() if ranks == cp), C.counter["send"]
    r = rollout(decoder, PROMPTS, SETTINGS, step=4, samples_per_prompt=2, dp_group=g.dp, zero3=zero3)
    after = sum(n for (_, ranks), n in C.by_group.items() if ranks == cp), C.counter["send"]
    cp_bytes = after[0] - before[0] + (after[1] - before[1] if g.pp_size == 1 else 0)  # ring: sends
    return (r, trainer.gpt_config, trainer.cfg.train.seed, cp_bytes), trainer, decoder


def _rows_alone_and_sends(trainer, decoder):
    """pp 2: rows 0, 3 and 9 generated alone, and the bytes this rank sends in one decoding step
    of the 10-row batch (a one-token activation [10, 1, H] from stage 0, none from stage 1)."""
    from megazero import collectives as C

    alone = {}
    for b in (0, 3, 9):
        i, s = divmod(b, 2)
        alone[b] = generate(decoder, [PROMPTS[i]], [(i, s)], SETTINGS, step=4)
    ids, valid = torch.ones(10, 3, dtype=torch.long), torch.ones(10, 3, dtype=torch.bool)
    decoder.prefill(ids, valid)
    before = C.counter["send"]
    decoder.step(torch.ones(10, dtype=torch.long))
    return alone, C.counter["send"] - before, trainer.groups.pp_rank


def _sweep(rank, world, layouts, refused_argv):
    """Each layout's ``_trainer_rollout`` (and under pp2 x dp2 ``_rows_alone_and_sends``); the
    message ``make_decoder`` refuses ``refused_argv``'s model with."""
    from megazero.training import build_trainer
    from model.rollout import make_decoder

    trainer = build_trainer(refused_argv, world)
    with pytest.raises(ValueError) as refused:
        make_decoder(trainer.chunks, trainer.groups)
    out = {"refused": str(refused.value)}
    for name, argv in layouts.items():
        out[name], trainer, decoder = _trainer_rollout(world, argv)
        if name == "pp2-dp2":
            out["alone"] = _rows_alone_and_sends(trainer, decoder)
    return out


def _assert_equal_rollouts(got, want, name):
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.mask, want.mask), name
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=1e-6, atol=1e-6)


def test_rollouts_under_pipeline_sequence_and_context_parallel_layouts_equal_one_process():
    layouts = {name: TRAIN_ARGV + flags for name, flags in LAYOUTS_4.items()}
    layouts |= {f"{name}-llama": TRAIN_ARGV + LLAMA_FLAGS + LAYOUTS_4[name] for name in LLAMA_4}
    moe_ep2 = TRAIN_ARGV + ["--num-experts", "4", "--expert-model-parallel-size", "2", "--dp", "4"]
    got = run_distributed(_sweep, 4, layouts, moe_ep2, timeout_s=900)
    wants = {}
    for name in layouts:
        _, gcfg, seed, _ = got[0][name]
        key = "llama" if name.endswith("-llama") else "gpt2"
        if key not in wants:
            wants[key] = rollout(StageDecoder(_oracle(gcfg, seed)), PROMPTS, SETTINGS, step=4, samples_per_prompt=2)
        for rank in got:
            _assert_equal_rollouts(rank[name][0], wants[key], name)
            assert rank[name][3] == 0, name  # no cp communication: each cp rank decodes whole rows
    assert not torch.equal(wants["gpt2"].tokens, wants["llama"].tokens)  # two models, two rollouts
    H = got[0]["pp2-dp2"][1].hidden_size
    for rank in got:
        assert "--expert-model-parallel-size 1 (got 2)" in rank["refused"]
        alone, sent, pp_rank = rank["alone"]
        for b, r in alone.items():
            assert torch.equal(r.tokens[0], wants["gpt2"].tokens[b]), b
            torch.testing.assert_close(r.log_probs[0], wants["gpt2"].log_probs[b], rtol=0, atol=1e-6)
        assert sent == (10 * 1 * H * 4 if pp_rank == 0 else 0)  # fp32 [B, 1, H], stage 0 -> 1


def _zero3(rank, world, layouts):
    """Per layout at ZeRO-3: the rollout refused without ``zero3`` (sharded parameters named),
    then with it: (rollout, GPTConfig, seed), the all-gather bytes it counted over the ZeRO shard
    group (dp here, which the results' gather also spans), the bytes of one
    gather of every unit of this rank's chunks, and the units still gathered after it."""
    from megazero import collectives as C
    from megazero.training import build_trainer
    from model.rollout import make_decoder

    out = {}
    for name, argv in layouts.items():
        trainer = build_trainer(argv, world)
        for chunk in trainer.chunks:
            chunk.eval()
        decoder, g, zero3 = make_decoder(trainer.chunks, trainer.groups), trainer.groups, trainer.ddp.zero3
        with pytest.raises(ValueError, match="zero3=") as refused:
            rollout(decoder, PROMPTS, SETTINGS, dp_group=g.dp)
        buffers = [b for u in zero3.units for b in u.buffers]
        unit_bytes = sum(b.layout.shard_numel * b.params_shard.element_size() for b in buffers)
        key = ("all_gather", tuple(sorted(C.group_ranks(g.zero_shard_group))))  # not the logits' tp gather
        before = C.by_group[key]
        r = rollout(decoder, PROMPTS, SETTINGS, step=4, samples_per_prompt=2, dp_group=g.dp, zero3=zero3)
        gathered = C.by_group[key] - before
        out[name] = ((r, trainer.gpt_config, trainer.cfg.train.seed), gathered, unit_bytes, zero3.live)
        assert "not gathered" in str(refused.value)
    return out


def test_rollouts_at_tp2_pp2_dp2_zero3_equal_one_process_and_gather_each_unit_once():
    flags = ["--tp", "2", "--pp", "2", "--dp", "2", "--zero-stage", "3", "--zero3-param-persistence-threshold", "0"]
    layouts = {"gpt2": TRAIN_ARGV + flags, "llama": TRAIN_ARGV + LLAMA_FLAGS + flags}
    got = run_distributed(_zero3, 8, layouts, timeout_s=900)
    for name in layouts:
        _, gcfg, seed = got[0][name][0]
        want = rollout(StageDecoder(_oracle(gcfg, seed)), PROMPTS, SETTINGS, step=4, samples_per_prompt=2)
        for rank in got:
            (r, _, _), gathered, unit_bytes, live = rank[name]
            _assert_equal_rollouts(r, want, name)
            results = len(r.tokens) // 2 * N_NEW * (8 + 1 + 4)  # this replica's tokens, mask, log-probs
            assert unit_bytes > 0 and gathered == unit_bytes + results, (name, gathered, unit_bytes)
            assert live == 0  # every unit released after the rollout
