"""Greedy decoding through a pipeline of stages (``--pp > 1``).

``model.gpt.generate_greedy`` decodes with a whole-model stage. Here the model is split
over pipeline stages (and, inside each, over TP ranks), so each new token is one
forward-only pass of the training pipeline (``schedules.forward_only_schedule`` with one
micro-batch) run by ``pipeline.executor.run_schedule``: the activations travel between
stages in the training shape ``[micro-batch, seq_length, hidden]``, and the last stage's
"loss" of that micro-batch is the chosen token id (the argmax, or a ``pick`` function's draw),
which ``run_schedule`` broadcasts over the pipeline group, so every rank appends the same token.

The context is the last ``seq_length`` tokens, right-padded to ``seq_length`` (causal
attention keeps padding invisible to the real positions) and repeated over the
micro-batch rows, so every tensor sent matches the shape the stages agreed on at start-up.
Token ids travel as fp32, exact below 2**24 (vocabularies are far smaller).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megazero.pipeline.executor import run_schedule
from megazero.pipeline.schedules import forward_only_schedule
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel.mappings import gather_from_tp_region


@torch.no_grad()
def pipeline_generate_greedy(
    chunks: Sequence[torch.nn.Module],
    groups: ProcessGroups,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    seq_length: int,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    vocab_size: int,
    layout: str = "interleaved",
    pick: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> list[int]:
    """Greedy continuation of ``prompt_ids`` by the model whose stage chunks are ``chunks``.

    Collective over the pipeline and tensor-parallel groups: every rank of a data-parallel
    replica calls it with the same arguments and gets the same ids back.

    Args:
        chunks: this rank's ``GPTStage`` chunks (``--virtual-pipeline-size`` of them).
        prompt_ids: at least one token id.
        seq_length: tokens per sample in training (the context window here).
        tensor_shape: the activation shape the stages exchange in training,
            ``(micro-batch, seq_length / (tp if sequence-parallel else 1), hidden)``.
        vocab_size: the real vocabulary; padded logit columns are never chosen.
        layout: how the chunks sit on the stages (``pipeline.partition.chunk_layout``).
        pick: ``logits [1, V] -> ids [1]`` in place of the argmax (e.g. ``model.sampling.choose``
            with a seeded generator), called on the last stage only, whose choice every rank
            receives.

    Returns ``prompt_ids + new`` (``len(prompt_ids) + max_new_tokens`` ids).
    Raises ValueError for an empty prompt.
    """
    if len(prompt_ids) == 0:
        raise ValueError("pipeline_generate_greedy needs a prompt of at least one token")
    batch_size = tensor_shape[0]
    device = next(iter(chunks[0].parameters())).device
    actions = forward_only_schedule(1, len(chunks))
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    ids = [int(i) for i in prompt_ids]
    try:
        for _ in range(max_new_tokens):
            context = ids[-seq_length:]
            t = len(context)
            tokens = torch.zeros(batch_size, seq_length, dtype=torch.long, device=device)  # (B, S)
            tokens[:, :t] = torch.tensor(context, dtype=torch.long, device=device)

            def forward_step(batch, chunk, input_tensor, t=t):
                out = chunk(batch if input_tensor is None else input_tensor)

                def next_token(logits):  # (B, S, V_pad/tp) on the last stage
                    row = gather_from_tp_region(logits[:1, t - 1], chunk.tp)[:, :vocab_size]  # (1, V)
                    chosen = row.argmax(dim=-1) if pick is None else pick(row)  # (1,)
                    return chosen.float().sum()

                return out, next_token

            token = run_schedule(
                actions,
                chunks,
                forward_step,
                [tokens],
                groups,
                tensor_shape=tensor_shape,
                dtype=dtype,
                num_microbatches=1,
                vp_size=len(chunks),
                device=device,
                forward_only=True,
                layout=layout,
            )
            ids.append(int(token.item()))
    finally:
        for c, mode in zip(chunks, was_training):
            c.train(mode)
    return ids
