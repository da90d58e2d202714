"""Multi-token prediction (model/mtp.py) in one process: the shifted inputs and targets equal explicit
indexing at context-parallel shard edges and at document boundaries; the trainer at one process equals
tests/support/mtp.py's oracle (main loss, MTP loss, gradient norm); ``--mtp-num-layers 0`` is the model
without the flag, bit for bit; the planner counts the modules' parameters and FLOPs."""

import math

import pytest
import torch

from megazero.context_parallel.sequence import Packing, local_mtp_targets, mtp_targets
from megazero.context_parallel.zigzag import local_token_index
from tests.support.mtp import explicit_mtp_targets, mtp_reference

EOD = 3
SMALL = [
    "--mock-data",
    "--vocab-size",
    "101",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "3",
    "--lr",
    "3e-3",
    "--seed",
    "7",
    "--make-vocab-size-divisible-by",
    "8",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
]


def _packed_tokens(B: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(4, 50, (B, T + 1), generator=g)
    data[torch.rand(B, T + 1, generator=g) < 0.2] = EOD
    return data[:, :-1], data[:, 1:]


def test_shifted_targets_equal_explicit_indexing_at_cp_edges_and_documents():
    """Every (depth, sequence, position) of every cp rank's share: the input token, the label and
    whether it counts equal ``explicit_mtp_targets`` at the position's place in the whole sequence.
    The checked positions include targets past the rank's own chunk (another rank's tokens), ones
    masked at the sequence's end and ones masked because an EOD lies between position and target."""
    B, T, D = 3, 16, 3
    tokens, labels = _packed_tokens(B, T, seed=5)
    wrong = crossing_chunks = masked_by_documents = masked_at_end = 0
    for packing, packed in ((Packing(EOD, True, True, True), True), (Packing(), False)):
        want = explicit_mtp_targets(tokens, labels, D, EOD, packing.eod_mask_loss, packed)
        full = mtp_targets(tokens, labels, D, packing)
        for cp in (1, 2, 4):
            n = T // (2 * cp)  # zigzag chunk size
            for rank in range(cp):
                mine = local_mtp_targets(full, cp, rank)
                for local, i in enumerate(local_token_index(T, rank, cp).tolist()):
                    for k in range(1, D + 1):
                        for b in range(B):
                            tok, lab, counted = want[k - 1][b][i]
                            got_counted = bool(mine.mask[b, local, k - 1])
                            wrong += got_counted != counted
                            if tok is not None:
                                wrong += int(mine.tokens[b, local, k - 1]) != tok
                                wrong += int(mine.labels[b, local, k - 1]) != lab
                                crossing_chunks += cp > 1 and (i + k) // n != i // n
                            masked_at_end += tok is None
                            masked_by_documents += packed and tok is not None and not counted and lab != EOD
    assert wrong == 0
    assert crossing_chunks > 100 and masked_at_end > 0 and masked_by_documents > 50


def test_shifted_targets_of_a_written_out_sequence():
    """One sequence by hand: ``a b EOD c d e`` with labels the next tokens, D = 2, documents packed."""
    tokens = torch.tensor([[10, 11, EOD, 12, 13, 14]])
    labels = torch.tensor([[11, EOD, 12, 13, 14, 15]])
    t = mtp_targets(tokens, labels, 2, Packing(EOD, reset_attention_mask=True))
    # depth 1: position i takes token i+1 and label i+1 (= token i+2); counted unless EOD in tokens[i..i+1]
    assert t.tokens[0, :, 0].tolist() == [11, EOD, 12, 13, 14, 0]
    assert t.labels[0, :, 0].tolist() == [EOD, 12, 13, 14, 15, 0]
    assert t.mask[0, :, 0].tolist() == [1, 0, 0, 1, 1, 0]
    # depth 2: token i+2, label token i+3; counted unless EOD in tokens[i..i+2]
    assert t.tokens[0, :, 1].tolist() == [EOD, 12, 13, 14, 0, 0]
    assert t.mask[0, :, 1].tolist() == [0, 0, 0, 1, 0, 0]


def _train(argv, steps):
    from megazero.training import build_trainer

    trainer = build_trainer(argv, 1)
    out = []
    for _ in range(steps):
        v = trainer.train_step(trainer.next_batches()).values
        out.append((v["loss"], v.get("mtp_loss"), v["grad_norm"]))
    trainer.close()
    return out, trainer


MLA_MTP = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
MLA_MTP += ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8"]
MLA_MTP += ["--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--disable-bias-linear"]


@pytest.mark.parametrize("block", ["gpt2", "mla"])
def test_one_process_equals_the_reference(block):
    """3 steps of 2 MTP depths at one process equal the oracle's (main loss, MTP loss, gradient
    norm) within 1e-5 relative; ``mla``: a RoPE/RMSNorm/SwiGLU model with DeepSeek's latent
    attention, whose MTP blocks are MLA blocks too."""
    argv = SMALL + ["--mtp-num-layers", "2"] + (MLA_MTP if block == "mla" else [])
    losses, stats = mtp_reference(argv, 3)
    got, _ = _train(argv, 3)
    want = zip(losses, stats["mtp_losses"], stats["grad_norms"])
    for step, (g, w) in enumerate(zip(got, want)):
        for what, a, b in zip(("loss", "mtp_loss", "grad_norm"), g, w):
            assert math.isclose(a, b, rel_tol=1e-5), (step, what, a, b)
    assert stats["mtp_losses"][0] > 0.09 * math.log(101)  # lambda 0.1 x about ln V


def test_mtp_num_layers_0_is_bit_identical_to_no_flag():
    without, trainer = _train(SMALL, 2)
    with_zero, _ = _train(SMALL + ["--mtp-num-layers", "0"], 2)
    assert without == with_zero
    assert all(m is None for _, m, _ in without)  # nothing logged
    assert not any(n.startswith("mtp.") for n, _ in trainer.chunks[0].named_parameters())


def test_planner_counts_the_modules_parameters_and_flops():
    """At one stage the planner's parameters equal the built stage's; the FLOPs grow per depth by the
    module's matmuls, its attention and a second pass through the output layer (3 x forward)."""
    from megazero.planning import memory
    from megazero.planning.flops import spec_flops_per_iteration
    from megazero.process_groups import ProcessGroups
    from model.config import GPTConfig
    from model.gpt import GPTStage

    g = GPTConfig(vocab_size=101, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, mtp_num_layers=2)
    stage = GPTStage(g, ProcessGroups.single(), range(2), True, True, seed=7)
    assert sum(p.numel() for p in stage.parameters()) == memory.params_per_rank(g, 1, 1, 0)
    # per depth: enorm, hnorm (weight, bias), eh_proj, the GPT-2 block's 12 tensors, final_ln (weight, bias)
    assert len([n for n, _ in stage.named_parameters() if n.startswith("mtp.")]) == 2 * (4 + 1 + 12 + 2)
    H, V, s, B, F = 32, g.padded_vocab(1), 16, 4, g.ffn_hidden_size
    plain = spec_flops_per_iteration(
        g.parameter_spec(1)[: -2 * len([n for n in g.parameter_spec(1) if n.name.startswith("mtp.0.")])],
        seq_length=s,
        attention_width=H,
        global_batch_size=B,
    )
    with_mtp = spec_flops_per_iteration(
        g.parameter_spec(1), seq_length=s, attention_width=H, global_batch_size=B, mtp_num_layers=2
    )
    per_depth = 2 * H * H + 4 * H * H + 2 * H * F  # eh_proj, qkv + proj, fc1 + fc2 (GPT-2 block)
    assert with_mtp - plain == B * s * 2 * 3 * (2 * per_depth + 2 * 2 * s * H + 2 * V * H)
