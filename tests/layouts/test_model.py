"""GPTStage against the single-process oracle tests/support/reference.py, on 1, 2 and 4 TP ranks.

fp32, dropout off unless a test says otherwise. Distributed checks run on forked gloo
ranks (tests/support/distributed.py); each spawn batches several checks.
"""

import pytest
import torch

from megazero import collectives as C
from megazero import tags
from megazero.data_parallel.finalize import finalize_param_grads
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from model.config import GPTConfig, padded_vocab_size
from model.gpt import VOCAB_TENSORS, GPTStage, generate_greedy, init_full_weights
from tests.support.distributed import run_distributed
from tests.support.model import ADAM, assert_rel_close, padded_rows_grad_is_zero, train_stage
from tests.support.reference import ReferenceGPT, random_batches, train_reference

SEED = 1234


def tiny_cfg(**kw) -> GPTConfig:
    base = dict(
        vocab_size=101,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(kw)
    return GPTConfig(**base)


def make_batches(cfg: GPTConfig, n: int, batch: int, seed: int = 7):
    return random_batches(cfg.vocab_size, cfg.seq_length, n, batch, seed)


def reference_losses(cfg: GPTConfig, batches, steps: int):
    return train_reference(
        init_full_weights(cfg, SEED),
        batches,
        vocab_size=cfg.vocab_size,
        num_heads=cfg.num_attention_heads,
        steps=steps,
        **ADAM,
    )


def gather_full(stage: GPTStage) -> dict:
    """Every full tensor reassembled from the TP partitions (inverse of partition_tensor).

    Values are numpy arrays: a tensor returned from a forked rank travels as a shared-memory
    file descriptor that dies with the rank.
    """
    out = {}
    for name, p in stage.named_parameters():
        t = p.detach()
        if tags.is_partitioned(p):
            parts, dim, s = C.all_gather_list(t, stage.tp), p.partition_dim, p.partition_stride
            t = torch.cat([torch.cat([q.chunk(s, dim=dim)[j] for q in parts], dim=dim) for j in range(s)], dim=dim)
        out[name] = t.numpy().copy()
    return out


# -- pure ---------------------------------------------------------------------------------


def test_padded_vocab_size_and_validation():
    assert padded_vocab_size(1001, 128, 1) == 1024
    assert padded_vocab_size(1001, 8, 4) == 1024 and padded_vocab_size(1001, 8, 2) == 1008
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(1024, 128, 2) == 1024
    assert tiny_cfg(vocab_size=1001, make_vocab_size_divisible_by=8).padded_vocab(4) == 1024
    with pytest.raises(ValueError, match="--num-attention-heads 4 is not divisible by --tp 8"):
        tiny_cfg().validate(8)
    with pytest.raises(ValueError, match="--sequence-parallel needs --seq-length 16"):
        tiny_cfg(sequence_parallel=True, num_attention_heads=32).validate(32)
    with pytest.raises(ValueError, match="--hidden-size 30 is not divisible"):
        tiny_cfg(hidden_size=30).validate(1)


def test_construction_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    GPTStage(tiny_cfg(), ProcessGroups.single(), range(2), True, True, SEED)
    assert torch.equal(state, torch.random.get_rng_state())


def test_init_is_deterministic_and_gpt2_scaled():
    cfg = tiny_cfg(num_layers=8, hidden_size=64, vocab_size=1001)
    a, b = init_full_weights(cfg, SEED), init_full_weights(cfg, SEED)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.mlp.fc1.weight"], a["layers.1.mlp.fc1.weight"])
    assert not torch.equal(a["layers.0.mlp.fc1.weight"], init_full_weights(cfg, SEED + 1)["layers.0.mlp.fc1.weight"])
    assert a["embedding.word_embeddings.weight"].shape == (1024, 64)
    assert (a["embedding.word_embeddings.weight"][1001:] == 0).all()
    assert abs(a["layers.0.mlp.fc1.weight"].std().item() - 0.02) < 0.002
    assert abs(a["layers.0.mlp.fc2.weight"].std().item() - 0.02 / 4) < 0.0005  # sqrt(2*8)
    assert (a["layers.3.ln2.weight"] == 1).all() and (a["layers.3.attn.qkv.bias"] == 0).all()


# -- one process --------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_single_process_matches_reference(tie):
    cfg = tiny_cfg(tie_embeddings=tie)
    batches = make_batches(cfg, 5, batch=4)
    stage = GPTStage(cfg, ProcessGroups.single(), range(cfg.num_layers), True, True, SEED)
    ref = ReferenceGPT.from_full_weights(init_full_weights(cfg, SEED), cfg.vocab_size, 4)
    tokens, labels = batches[0]
    logits = stage(tokens)
    assert logits.shape == (4, 16, 128)
    torch.testing.assert_close(logits[..., : cfg.vocab_size], ref(tokens), rtol=0, atol=1e-6)
    # full-model gradients on the first batch, under canonical names
    (stage(tokens, labels).sum() / labels.numel()).backward()
    ref.loss(tokens, labels).backward()
    grads = dict(stage.named_parameters())
    for name, p in ref.canonical_parameters().items():
        g = grads[name].grad
        g = g[: cfg.vocab_size] if name in VOCAB_TENSORS else g
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert padded_rows_grad_is_zero(stage)
    stage.zero_grad(set_to_none=True)
    assert_rel_close(train_stage(stage, batches, 5), reference_losses(cfg, batches, 5), 1e-6)


def test_gradient_accumulation_matches_one_big_micro_batch():
    cfg = tiny_cfg()
    ((tokens, labels),) = make_batches(cfg, 1, batch=8)
    big = GPTStage(cfg, ProcessGroups.single(), range(2), True, True, SEED)
    small = GPTStage(cfg, ProcessGroups.single(), range(2), True, True, SEED)
    big_loss = big(tokens, labels).sum() / labels.numel()
    big_loss.backward()
    total = 0.0
    for i in range(4):  # 4 micro-batches of 2 samples, each divided by the global token count
        mb = slice(2 * i, 2 * i + 2)
        loss = small(tokens[mb], labels[mb]).sum() / labels.numel()
        loss.backward()
        total += loss.item()
    assert abs(total - big_loss.item()) <= 1e-6 * big_loss.item()
    for (name, p), q in zip(big.named_parameters(), small.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-8, msg=name)


def test_pipeline_stages_chain_and_tie_the_embedding():
    cfg = tiny_cfg(num_layers=3)
    topo = Topology(pp=2)
    first = GPTStage(cfg, ProcessGroups(topo, rank=0), [0, 1], True, False, SEED)
    last = GPTStage(cfg, ProcessGroups(topo, rank=1), [2], False, True, SEED)
    assert [n for n, _ in last.named_parameters()][:2] == ["embedding.word_embeddings.weight", "layers.2.ln1.weight"]
    w0, w1 = first.embedding.word_embeddings.weight, last.embedding.word_embeddings.weight
    assert torch.equal(w0, w1)
    assert w0.shared_embedding and w0.shared_counted_here
    assert w1.shared_embedding and not w1.shared_counted_here
    assert not tags.counts_in_norm(w1, 0) and tags.counts_in_norm(w0, 0)

    ref = ReferenceGPT.from_full_weights(init_full_weights(cfg, SEED), cfg.vocab_size, 4)
    ((tokens, labels),) = make_batches(cfg, 1, batch=2)
    hidden = first(tokens)
    assert hidden.shape == (2, 16, 32)
    (last(hidden, labels).mean()).backward()
    ref.loss(tokens, labels).backward()
    torch.testing.assert_close((w0.grad + w1.grad)[: cfg.vocab_size], ref.wte.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        first.layers["0"].attn.qkv.weight.grad, ref.blocks[0].qkv.weight.grad, rtol=1e-5, atol=1e-7
    )


def test_generate_greedy_matches_reference():
    cfg = tiny_cfg(seq_length=8)
    stage = GPTStage(cfg, ProcessGroups.single(), range(2), True, True, SEED)
    ref = ReferenceGPT.from_full_weights(init_full_weights(cfg, SEED), cfg.vocab_size, 4)
    prompt = make_batches(cfg, 1, batch=2)[0][0][:, :3]
    ids = prompt
    for _ in range(7):  # the reference, windowed to max positions
        ids = torch.cat([ids, ref(ids[:, -8:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generate_greedy(stage, prompt, 7), ids)


# -- tensor parallel ----------------------------------------------------------------------


def _tp_training(rank, world, cfg, batches, steps, untied_cfg):
    results = {}
    for topo in (Topology(tp=2, dp=2), Topology(tp=4)):
        groups = ProcessGroups.build(topo)
        stage = GPTStage(cfg, groups, range(cfg.num_layers), True, True, SEED)
        results[topo.tp] = train_stage(stage, batches, steps, check_padded=True)
        untied = GPTStage(untied_cfg, groups, range(cfg.num_layers), True, True, SEED)
        full = gather_full(untied)  # collective: every TP rank takes part
        results[f"full{topo.tp}"] = full if groups.tp_rank == 0 else None
    return results


def test_tensor_parallel_training_and_init_layout_independence():
    cfg = tiny_cfg(vocab_size=1001)
    batches = make_batches(cfg, 10, batch=4)
    untied = tiny_cfg(vocab_size=1001, tie_embeddings=False, make_vocab_size_divisible_by=8)
    out = run_distributed(_tp_training, 4, cfg, batches, 10, untied)
    expected = reference_losses(cfg, batches, 10)
    for r in range(4):
        for tp in (2, 4):
            losses, padded_ok = out[r][tp]
            assert padded_ok, f"padded vocabulary rows got a gradient at tp {tp}"
            assert_rel_close(losses, expected, 1e-5)
    full = init_full_weights(untied, SEED)  # padded to 1008 rows; tp 4 pads to 1024
    for tp, rank in ((2, 0), (2, 2), (4, 0)):
        got = {k: torch.from_numpy(v) for k, v in out[rank][f"full{tp}"].items()}
        assert got.keys() == full.keys()
        for name, t in full.items():
            if name in VOCAB_TENSORS:
                assert got[name].shape[0] == untied.padded_vocab(tp)
                assert (got[name][1001:] == 0).all()
                got[name], t = got[name][:1001], t[:1001]
            assert torch.equal(got[name], t), (tp, name)


def _dropout_run(rank, world, cfg, batches):
    groups = ProcessGroups.build(Topology(tp=2))
    runs = []
    for _ in range(2):
        stage = GPTStage(cfg, groups, range(cfg.num_layers), True, True, SEED)
        global_rng, tp_rng = torch.default_generator.get_state(), stage.rng_tracker.generator("tp").get_state()
        losses = train_stage(stage, batches, 10)
        # masks come from the tracker's streams only, never from the global generator
        assert torch.equal(global_rng, torch.default_generator.get_state())
        assert not torch.equal(tp_rng, stage.rng_tracker.generator("tp").get_state())
        runs.append(
            (losses, {n: p.detach().numpy().copy() for n, p in stage.named_parameters() if not tags.is_partitioned(p)})
        )
    stage.eval()
    tokens, labels = batches[0]
    eval_loss = stage(tokens, labels).mean().item()
    stage.train()
    train_loss = stage(tokens, labels).mean().item()
    return runs, eval_loss, train_loss


def test_dropout_keeps_replicas_identical_and_is_reproducible():
    cfg = tiny_cfg(hidden_dropout=0.1, attention_dropout=0.1)
    out = run_distributed(_dropout_run, 2, cfg, make_batches(cfg, 10, batch=4))
    for runs, eval_loss, train_loss in out:
        (l1, p1), (l2, p2) = runs
        assert l1 == l2 and all((p1[n] == p2[n]).all() for n in p1)
        assert eval_loss != train_loss  # dropout is active in training mode
    replicated = out[0][0][0][1]
    assert any(".ln1." in n for n in replicated) and "final_ln.weight" in replicated
    for name, t in replicated.items():
        assert (t == out[1][0][0][1][name]).all(), name


def _sequence_parallel(rank, world, cfg, batches):
    groups = ProcessGroups.build(Topology(tp=2))
    losses = {}
    for sp in (False, True):
        c = tiny_cfg(vocab_size=cfg.vocab_size, sequence_parallel=sp)
        stage = GPTStage(c, groups, range(c.num_layers), True, True, SEED)
        tokens, labels = batches[0]
        (stage(tokens, labels).sum() / labels.numel()).backward()
        finalize_param_grads(stage.parameters(), stage.tp)
        grads = {n: p.grad.numpy().copy() for n, p in stage.named_parameters() if not tags.is_partitioned(p)}
        sp_tagged = sorted(n for n, p in stage.named_parameters() if tags.is_sequence_parallel(p))
        stage.zero_grad(set_to_none=True)
        generated = generate_greedy(stage, batches[0][0][:, :3], 6)  # 3..8 tokens, padded to even
        losses[sp] = train_stage(stage, batches, 10)
    return losses, grads, sp_tagged, generated


def test_sequence_parallel_matches_tensor_parallel():
    cfg = tiny_cfg(vocab_size=1001)
    batches = make_batches(cfg, 10, batch=4)
    out = run_distributed(_sequence_parallel, 2, cfg, batches)
    single = GPTStage(cfg, ProcessGroups.single(), range(2), True, True, SEED)
    tokens, labels = batches[0]
    (single(tokens, labels).sum() / labels.numel()).backward()
    want = dict(single.named_parameters())
    generated = generate_greedy(single, tokens[:, :3], 6)
    for losses, grads, sp_tagged, sp_generated in out:
        assert torch.equal(sp_generated, generated)
        assert_rel_close(losses[True], losses[False], 1e-5)
        assert "layers.0.ln1.weight" in sp_tagged and "layers.1.mlp.fc2.bias" in sp_tagged
        for name, g in grads.items():
            assert (g == out[0][1][name]).all(), name  # identical on both TP ranks
            torch.testing.assert_close(
                torch.from_numpy(g), want[name].grad, rtol=1e-5, atol=1e-7, msg=name
            )  # the full sum, not 1/tp of it
