"""Keep the two copies of a weight tied across pipeline stages identical.

With tied embeddings (GPT-2) and pp > 1 the word embedding lives on stage 0 and the output
layer, which reuses it, on the last stage: two copies of one weight, initialised from the
same full tensor. Each copy receives only its own stage's share of the gradient; summing the
two over the embedding group (first and last stage at the same tp/dp coordinates) gives
both the full gradient, so both apply the same update and stay bit-identical (Shoeybi et al.
2019, Megatron-LM; Narayanan et al. 2021, sec. 3).
"""
from __future__ import annotations

from typing import Iterable

import torch

from megazero import collectives
from megazero.tensor_parallel.tags import is_shared_embedding


def sync_shared_embedding_grads(params: Iterable[torch.Tensor], embedding_group) -> int:
    """SUM all-reduce the gradients of ``params`` tagged ``shared_embedding``.

    Uses ``p.main_grad`` when the parameter has one (flat fp32 buffer of the data-parallel
    wrapper), else ``p.grad``; a tagged parameter without a gradient gets a zero one so the
    collective still matches its peer. A no-op for ``embedding_group`` None or of size 1
    (pp 1, or a middle stage). Call it after the data-parallel reduction and before the
    optimizer step. Returns the number of tensors reduced.
    """
    count = 0
    if collectives.group_size(embedding_group) == 1:
        return count
    for p in params:
        if not is_shared_embedding(p):
            continue
        grad = getattr(p, "main_grad", None)
        if grad is None:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
        collectives.all_reduce_sum(grad, embedding_group)
        count += 1
    return count
