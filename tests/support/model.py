"""Model-level comparisons with the reference: assert_rel_close, train_stage, adamw and the padded-
rows check."""

import torch

from megazero.data_parallel.finalize import finalize_param_grads
from model.gpt import GPTStage

ADAM = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def adamw(params):
    params = list(params)
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        **ADAM,
    )


def padded_rows_grad_is_zero(stage: GPTStage) -> bool:
    """True when every word-embedding row with a global id >= vocab_size has zero gradient."""
    w = stage.embedding.word_embeddings
    first_padded = max(stage.cfg.vocab_size - w.vocab_start_index, 0)
    return bool((w.weight.grad[first_padded:] == 0).all())


def train_stage(stage: GPTStage, batches, steps: int, check_padded: bool = False):
    """AdamW on this rank's partitions; loss = mean over the batch's tokens. Returns losses."""
    opt, losses, padded_ok = adamw(stage.parameters()), [], True
    for step in range(steps):
        tokens, labels = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = stage(tokens, labels).sum() / labels.numel()
        loss.backward()
        finalize_param_grads(stage.parameters(), stage.tp)
        if check_padded:
            padded_ok &= padded_rows_grad_is_zero(stage)
        opt.step()
        losses.append(loss.item())
    return (losses, padded_ok) if check_padded else losses


def assert_rel_close(actual, expected, rtol):
    a, e = torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    assert ((a - e).abs() <= rtol * e.abs()).all(), f"{actual} vs {expected}"
