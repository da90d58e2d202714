"""Async TP all-reduce (--no-async-tensor-model-parallel-allreduce turns it off): overlapping the
column-parallel input-gradient reduction with the weight-gradient matmul gives bit-identical
losses and gradients, with and without sequence parallelism, tied and untied output layers;
and the communication volume is unchanged (same collectives, same bytes)."""

import torch

from tests.support.distributed import run_distributed


def _grads(rank, world, steps=2):
    from megazero import collectives as C
    from megazero.data_parallel.finalize import finalize_param_grads
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from model.config import GPTConfig
    from model.gpt import GPTStage

    groups = ProcessGroups.build(Topology(tp=world, pp=1, dp=1))
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (4, 9), generator=gen)
    out = {}
    for sp in (False, True):
        for tie in (True, False):
            for overlap in (False, True):
                cfg = GPTConfig(
                    vocab_size=50,
                    num_layers=2,
                    hidden_size=16,
                    num_attention_heads=2,
                    seq_length=8,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    make_vocab_size_divisible_by=8,
                    sequence_parallel=sp,
                    tie_embeddings=tie,
                    tp_overlap_grad_reduce=overlap,
                )
                model = GPTStage(cfg, groups, range(2), True, True, 11)
                C.counter.clear()
                losses = []
                for _ in range(steps):
                    model.zero_grad(set_to_none=True)
                    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
                    loss.backward()
                    finalize_param_grads(model.parameters(), groups.tp)
                    losses.append(loss.item())
                out[(sp, tie, overlap)] = (losses, [p.grad.clone() for p in model.parameters()], dict(C.counter))
    layer = next(iter(model.layers.values())).attn.qkv
    x = torch.randn(4, 8 // world, 16, requires_grad=True)  # sequence-parallel input
    out["grad_fn"] = type(layer(x).grad_fn).__name__
    return out


def test_overlapped_backward_is_bit_identical():
    for result in run_distributed(_grads, 2):
        assert result.pop("grad_fn") == "_ColumnLinearOverlapBackward"  # the overlapped path ran
        for sp in (False, True):
            for tie in (True, False):
                plain, fast = result[(sp, tie, False)], result[(sp, tie, True)]
                assert plain[0] == fast[0], (sp, tie)
                assert all(torch.equal(a, b) for a, b in zip(plain[1], fast[1])), (sp, tie)
                assert plain[2] == fast[2] and plain[2], (sp, tie)  # same bytes per kind
