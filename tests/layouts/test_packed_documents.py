"""Packed documents: ``--reset-attention-mask``, ``--reset-position-ids`` and
``--eod-mask-loss``, alone and under context and tensor parallelism.

A packed sequence here is document A (ending with the EOD token) followed by document B.
With both reset flags, every logit of B must not depend on A at all (bit-identical when A's
tokens change) and must equal B's logits when B is run alone as a sequence of its own. The
training runs match ``tests/support/reference.py``'s packed-document loss (its masks written out
token by token).
"""

import math

import pytest
import torch

from megazero.context_parallel.sequence import (
    Packing,
    counted_targets,
    document_ids,
    document_positions,
    shard_micro_batch,
)
from tests.support.distributed import run_distributed
from tests.support.packed import EOD, PACKING, packed_batches, packed_trainer, rank_micro_batches

V, T = 101, 16
LEN_A = 6  # A = tokens 0..5, the last of them EOD; B = tokens 6..15


def _cfg(block: str):
    from model.config import GPTConfig

    kw = dict(
        vocab_size=V,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=T,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        make_vocab_size_divisible_by=8,
    )
    if block == "llama":
        kw.update(
            position_embedding_type="rope",
            normalization="RMSNorm",
            swiglu=True,
            num_query_groups=2,
            add_bias_linear=False,
            tie_embeddings=False,
            ffn_hidden_size=64,
        )
    return GPTConfig(**kw)


def _packed(seed: int) -> torch.Tensor:
    """``[2, T]``: rows of A (random, EOD-terminated) then the same B in every call."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(4, V, (2, LEN_A), generator=g)
    a[:, -1] = EOD
    b = torch.randint(4, V, (2, T - LEN_A), generator=torch.Generator().manual_seed(99))
    return torch.cat([a, b], dim=1)


def test_document_ids_and_positions_restart_after_each_eod():
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9]])
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert document_positions(document_ids(tokens, EOD)).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    labels = torch.tensor([[6, EOD, 7, EOD, EOD, 8, 9, EOD]])
    assert int(counted_targets(labels, Packing(EOD, eod_mask_loss=True))) == 4
    assert int(counted_targets(labels, Packing(EOD))) == 8
    with pytest.raises(ValueError, match="EOD"):
        Packing(None, reset_attention_mask=True)


def _logits_of(rank, world, tp, cp, block, token_rows):
    """Full-vocabulary logits ``[2, T, V]`` of each packed input, and of B alone (cp 1)."""
    import torch.distributed as dist

    from megazero.context_parallel.zigzag import merge_from_ranks
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from model.gpt import GPTStage

    cfg = _cfg(block)
    groups = ProcessGroups.build(Topology(tp=tp, cp=cp))
    stage = GPTStage(cfg, groups, range(cfg.num_layers), True, True, seed=5).eval()
    packing = Packing(EOD, reset_attention_mask=True, reset_position_ids=True)

    def full(local):  # (B, T/cp, V_pad/tp) on every rank -> (B, T, V)
        parts = [torch.empty_like(local) for _ in range(world)] if world > 1 else [local]
        if world > 1:
            dist.all_gather(parts, local.contiguous())
        by_cp = [torch.cat([parts[c * tp + t] for t in range(tp)], dim=-1) for c in range(cp)]
        return merge_from_ranks(by_cp, 1, cp)[..., :V]

    out = []
    with torch.no_grad():
        for tokens in token_rows:
            x, _, seq = shard_micro_batch(tokens, tokens, cp=cp, cp_rank=groups.cp_rank, packing=packing)
            out.append(full(stage(x, seq=seq)))
        if cp == 1:  # B as a sequence of its own: default positions, plain causal attention
            alone = stage(token_rows[0][:, LEN_A:])  # (B, T - LEN_A, V_pad/tp)
            out.append((_gather_vocab(alone, tp) if tp > 1 else alone)[..., :V])
    return out


def _gather_vocab(local, tp):
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)


@pytest.fixture(scope="module")
def logits():
    """(block, layout) -> rank 0's logits; one spawn per world size."""
    rows = [_packed(1), _packed(2)]
    out = {}
    for block in ("gpt2", "llama"):
        out[(block, "single")] = run_distributed(_logits_of, 1, 1, 1, block, rows)[0]
    for tp, cp in ((1, 2), (2, 1), (2, 2)):
        world = tp * cp
        for block in ("gpt2", "llama"):
            out[(block, f"tp{tp}-cp{cp}")] = run_distributed(_logits_of, world, tp, cp, block, rows)[0]
    return out


@pytest.mark.parametrize("block", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", ["single", "tp1-cp2", "tp2-cp1", "tp2-cp2"])
def test_document_b_ignores_document_a(block, layout, logits):
    """Changing A leaves every logit of B bit-unchanged; B's logits equal B run alone (and
    the single process's) to fp32 rounding."""
    got = logits[(block, layout)]
    first, second = got[0], got[1]
    assert not torch.equal(first[:, :LEN_A], second[:, :LEN_A])  # A did change what A sees
    assert torch.equal(first[:, LEN_A:], second[:, LEN_A:])
    single = logits[(block, "single")]
    alone = single[2]
    torch.testing.assert_close(first[:, LEN_A:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first, single[0], rtol=1e-5, atol=1e-5)
    if layout.endswith("cp1"):
        torch.testing.assert_close(got[2], alone, rtol=1e-5, atol=1e-5)


# -- training with packed documents equals the reference's packed loss ---------------------
STEPS = 5
BASE = [
    "--mock-data",
    "--vocab-size",
    str(V),
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    str(T),
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    str(STEPS),
    "--lr",
    "3e-3",
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
]
FLAGS = PACKING


def _batches():
    """STEPS global batches of 8 packed sequences: EOD tokens at random places (about 1 in 5)."""
    return packed_batches(V, T, 8, STEPS)


def _train_packed(rank, world, argvs):
    results = []
    for argv in argvs:  # mock data has no tokenizer: the trainer is given the EOD id and flags
        trainer = packed_trainer(argv, world)
        losses = [trainer.train_step(rank_micro_batches(trainer, b)).values["loss"] for b in _batches()]
        trainer.close()
        results.append(losses)
    return results


@pytest.fixture(scope="module")
def packed_reference():
    from megazero.config import config_from_argv
    from model.build import build_gpt_config
    from model.gpt import init_full_weights
    from tests.support.reference import train_reference

    cfg = config_from_argv(BASE, 1)
    gcfg = build_gpt_config(cfg, V)
    o = cfg.optim
    from megazero.optim.lr_schedule import LRSchedule

    sched = LRSchedule(o.lr, o.min_lr, o.lr_warmup_iters, cfg.train.train_iters, o.lr_decay_style)
    return train_reference(
        init_full_weights(gcfg, cfg.train.seed),
        _batches(),
        vocab_size=V,
        num_heads=4,
        lr=lambda s: sched(s + 1),
        steps=STEPS,
        betas=(o.adam_beta1, o.adam_beta2),
        weight_decay=o.weight_decay,
        eps=o.adam_eps,
        clip_grad=o.clip_grad,
        packing=dict(eod=EOD, **FLAGS),
    )


PACKED_LAYOUTS = {
    1: [[]],
    2: [["--cp", "2"], ["--tp", "2", "--sequence-parallel"], ["--dp", "2"]],
    4: [["--tp", "2", "--cp", "2"], ["--cp", "2", "--pp", "2"]],
}


@pytest.fixture(scope="module")
def packed_runs():
    return {
        world: run_distributed(_train_packed, world, [BASE + a for a in argvs], timeout_s=600)[0]
        for world, argvs in PACKED_LAYOUTS.items()
    }


@pytest.mark.parametrize("world,index", [(w, i) for w, a in PACKED_LAYOUTS.items() for i in range(len(a))])
def test_packed_training_equals_the_reference(world, index, packed_runs, packed_reference):
    """All three flags: 5 steps equal the reference (documents masked, positions restarted,
    EOD targets left out of the mean) within 1e-5 relative, under cp, tp, dp and pp."""
    for step, (got, want) in enumerate(zip(packed_runs[world][index], packed_reference)):
        assert math.isclose(got, want, rel_tol=1e-5), (PACKED_LAYOUTS[world][index], step, got, want)


def test_eod_mask_loss_is_the_mean_over_non_eod_targets():
    """The reference's masked loss is the per-target loss summed over the targets that are not
    EOD, divided by their count; it differs from the plain mean (the batch has EOD targets)."""
    import torch.nn.functional as F

    from megazero.config import config_from_argv
    from model.build import build_gpt_config
    from model.gpt import init_full_weights
    from tests.support.reference import ReferenceGPT

    full = init_full_weights(build_gpt_config(config_from_argv(BASE, 1), V), 7)
    model = ReferenceGPT.from_full_weights(full, V, 4)
    tokens, labels = _batches()[0]
    with torch.no_grad():
        each = F.cross_entropy(model(tokens).reshape(-1, V), labels.reshape(-1), reduction="none")
        keep = labels.reshape(-1) != EOD
        assert 0 < int(counted_targets(labels, Packing(EOD, eod_mask_loss=True))) == int(keep.sum()) < labels.numel()
        masked = model.loss(tokens, labels, eod=EOD, eod_mask_loss=True)
        assert math.isclose(float(masked), float(each[keep].sum() / keep.sum()), rel_tol=1e-6)
        assert not math.isclose(float(masked), float(each.mean()), rel_tol=1e-4)
