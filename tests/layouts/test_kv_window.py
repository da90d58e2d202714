"""Trimmed KV caches of sliding-window layers: a windowed layer keeps only the keys its window sees.

A tiny LLaMA-style model (RoPE, grouped-query attention) with a window of W = 4 positions on
layers 1 and 3 and full attention on 2 and 4 (``--window-size 3,0 --window-attn-skip-freq 2``),
with and without attention sinks (``--softmax-type learnable``). model/sampling.py: a 7-token
prompt (longer than the window, so the prefill trims) decoded 46 tokens greedily, 42 past the
window, gives the full-forward greedy tokens (each one the argmax of a no-cache forward over its
prefix),
each step's logits equal the full forward's within 5e-5 (logits up to 6;
the untrimmed cache's rounding is 2e-5 too), a windowed layer's cache holds
min(seen, W - 1) keys after each call while a full layer's holds every one, and the window
changes the logits. model/rollout.py: ragged left-padded rows decoded 44 steps give the
log-probs of a trainer-style forward over prompt + response (5e-5), the windowed layers' caches hold
W - 1 slots (the longest prompt has 9 tokens) while the full layers' hold every slot, and
right padding (whose gap the common trim keeps) gives the left-padded logits. Two gloo ranks,
pp 2: each stage trims its own windowed layer's cache and the rollout equals one process's.
"""

from __future__ import annotations

import pytest
import torch

from megazero.post_training.rollout import RolloutSettings, rollout
from megazero.process_groups import ProcessGroups
from model.config import GPTConfig
from model.gpt import GPTStage
from model.rollout import StageDecoder
from model.sampling import forward_cached, sample
from tests.support.distributed import run_distributed

W, N_NEW = 4, 46
PROMPT = [5, 6, 7, 8, 9, 10, 11]
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [40, 41, 42, 43, 44]]


def _stage(softmax_type: str, window: bool = True) -> GPTStage:
    cfg = GPTConfig(
        vocab_size=61,
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        seq_length=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,  # large enough that the tokens do not settle into one repeated id
        make_vocab_size_divisible_by=8,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        tie_embeddings=False,
        softmax_type=softmax_type,
        **(dict(window_size=[W - 1, 0], window_attn_skip_freq=[2]) if window else {}),
    )
    return GPTStage(cfg, ProcessGroups.single(), range(cfg.num_layers), True, True, 5).eval()


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_trimmed_cache_decodes_the_full_forward_tokens_and_logits(softmax_type):
    stage = _stage(softmax_type)
    assert [block.attn.window for block in stage.layers.values()] == [W, None, W, None]
    ids = sample(stage, PROMPT, N_NEW)
    assert len(ids) == len(PROMPT) + N_NEW and len(set(ids[len(PROMPT) :])) > 3  # not one token repeated
    seq = torch.tensor([ids], device="cpu")  # (1, 53)
    with torch.no_grad():
        full = stage(seq)[0, :, : stage.cfg.vocab_size]  # (53, V): every key, the window masked
        unwindowed = _stage(softmax_type, window=False)(seq)[0, :, : stage.cfg.vocab_size]
    # each token is the full forward's argmax after its prefix: the no-cache greedy decoding's tokens
    assert full[len(PROMPT) - 1 : -1].argmax(dim=-1).tolist() == ids[len(PROMPT) :]
    assert (full[len(PROMPT) :] - unwindowed[len(PROMPT) :]).abs().max() > 1e-2  # the window matters
    caches: list = [None] * len(stage.layers)
    for end in range(len(PROMPT), len(ids) + 1):
        new = seq[:, :end] if end == len(PROMPT) else seq[:, end - 1 : end]  # the prefill, then one token
        torch.testing.assert_close(forward_cached(stage, new, caches)[0], full[end - 1], rtol=0, atol=5e-5)
        held = [c.k.shape[2] for c in caches]
        assert held == [min(end, W - 1), end, min(end, W - 1), end], end
        assert [c.seen for c in caches] == [end] * 4
    if softmax_type == "learnable":
        assert all(bool(block.attn.sinks.abs().max() > 0) for block in stage.layers.values())


def test_rollout_trims_windowed_caches_and_keeps_the_log_probs():
    stage = _stage("learnable")
    L = max(len(p) for p in PROMPTS)
    n_steps = 44
    out = {}
    for side in ("left", "right"):
        ids = torch.zeros(len(PROMPTS), L, dtype=torch.long, device="cpu")
        valid = torch.zeros(len(PROMPTS), L, dtype=torch.bool, device="cpu")
        for b, p in enumerate(PROMPTS):
            cols = slice(L - len(p), L) if side == "left" else slice(0, len(p))
            ids[b, cols], valid[b, cols] = torch.tensor(p, device="cpu"), True
        dec = StageDecoder(stage)
        logits = [dec.prefill(ids, valid)]
        held = [[c[0].shape[2] for c in dec.caches[0]]]
        for t in range(n_steps):
            logits.append(dec.step(torch.full((len(PROMPTS),), 10 + t % 7, device="cpu")))
            held.append([c[0].shape[2] for c in dec.caches[0]])
        out[side] = torch.stack(logits)  # (45, B, V)
        if side == "left":  # every row's last token at the last slot: the last W - 1 slots serve all
            assert held == [[W - 1, L + t] * 2 for t in range(n_steps + 1)]
        else:  # row 2's single token sits at slot 0: the gap stays until its window passes it
            assert held[0] == [L, L] * 2 and held[-1] == [W - 1, L + n_steps] * 2
    torch.testing.assert_close(out["right"], out["left"], rtol=0, atol=1e-5)

    settings = RolloutSettings(max_new_tokens=n_steps, temperature=1.0, seed=4)
    r = rollout(StageDecoder(stage), PROMPTS, settings)
    for b, p in enumerate(PROMPTS):
        response = r.tokens[b, : int(r.lengths[b])].tolist()
        seq = torch.tensor([p + response], device="cpu")
        with torch.no_grad():
            lp = stage(seq)[0, :-1, : stage.cfg.vocab_size].float().log_softmax(-1)  # (T-1, V)
        want = lp.gather(1, seq[0, 1:, None])[len(p) - 1 :, 0]
        torch.testing.assert_close(r.log_probs[b, : len(response)], want, rtol=0, atol=5e-5)


def _pipeline_rollout(rank, world, argv):
    """The rollout of the pp 2 trainer's chunks, the windows and cache lengths of this rank's
    layers after it, and the trainer's GPTConfig and seed."""
    from megazero.training import build_trainer
    from model.rollout import make_decoder

    trainer = build_trainer(argv, world)
    for chunk in trainer.chunks:
        chunk.eval()
    decoder = make_decoder(trainer.chunks, trainer.groups)
    r = rollout(decoder, PROMPTS, RolloutSettings(max_new_tokens=12, temperature=0.7, seed=9))
    layers = [
        (block.attn.window, cache[0].shape[2])
        for chunk, caches in zip(decoder.chunks, decoder.caches)
        for block, cache in zip(chunk.layers.values(), caches)
    ]
    return r, layers, trainer.gpt_config, trainer.cfg.train.seed


def test_pipeline_stages_trim_their_own_windowed_caches():
    """pp 2 (each stage one windowed and one full layer, stage-local caches): the rollout equals
    one process's, and after 12 new tokens (11 steps) each rank's windowed layer holds W - 1
    slots, its full layer 9 + 11."""
    from tests.support.layouts import BASE, LLAMA, WIDER

    argv = BASE + WIDER + LLAMA + ["--seq-length", "32", "--pp", "2", "--window-size", f"{W - 1},0"]
    got = run_distributed(_pipeline_rollout, 2, argv + ["--window-attn-skip-freq", "2"])
    _, _, gcfg, seed = got[0]
    one = GPTStage(gcfg, ProcessGroups.single(), range(gcfg.num_layers), True, True, seed).eval()
    want = rollout(StageDecoder(one), PROMPTS, RolloutSettings(max_new_tokens=12, temperature=0.7, seed=9))
    for r, layers, _, _ in got:
        assert torch.equal(r.tokens, want.tokens)
        torch.testing.assert_close(r.log_probs, want.log_probs, rtol=1e-6, atol=1e-6)
        assert layers == [(W, W - 1), (None, 9 + 11)]  # the 12th token is drawn, never fed back
