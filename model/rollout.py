"""The model half of rollouts: ragged-batch KV-cache decoding of a whole-model GPT stage
(pp == 1, any tp, no sequence parallelism), GPT-2 or LLaMA-style block, for the sampling loop
of ``megazero.post_training.rollout`` (which cannot import ``model``).

Each row of the batch has its own prompt length. The cache is a list of *slots* per row;
a slot holds a token or padding, so prompts may be left- or right-padded. Every slot
carries an explicit position (the number of real tokens before it in its row) and a
validity bit; a query attends to the valid slots at or before its own slot (and to itself,
so a padding query's softmax is never empty). A row's keys, values, positions and logits
therefore depend on its own tokens only: a row decoded in a batch equals the row decoded
alone, up to the rounding of batched matrix products. Each decoding step appends one slot
per row (Pope et al. 2022, "Efficiently Scaling Transformer Inference", sec. 2, for the
cache itself; model/sampling.py is the one-row version).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from megazero.tensor_parallel.layers import parallel_lm_logits
from megazero.tensor_parallel.mappings import gather_from_tp_region
from model.rope import apply_rotary


class StageDecoder:
    """Batched, ragged KV-cache decoding of ``stage`` (a ``model.gpt.GPTStage`` holding every
    layer, embedding and head). Collective over the stage's TP group: every TP rank calls
    ``prefill``/``step`` with the same ids and gets the same full logits.

    Use: ``prefill(ids, valid)`` once, then ``step(next_ids)`` per new token; both return the
    next-token logits ``[B, V]`` (real vocabulary, gathered over TP, the stage's dtype).

    Raises ValueError when the stage is not the whole model, uses sequence parallelism, or is
    a reward model (value head).
    """

    def __init__(self, stage):
        if not (stage.pre_process and stage.post_process) or stage.sp or stage.cfg.value_head:
            raise ValueError(
                "rollouts need the whole language model in one stage (pp 1), without --sequence-parallel "
                "and without a value head"
            )
        self.stage = stage
        self.caches: list = [None] * len(stage.layers)
        self.valid = None  # (B, S) bool: which cache slots hold a real token
        self.next_pos = None  # (B,) int64: position of each row's next token

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Run the prompts ``ids [B, L]`` (``valid [B, L]`` bool marks real tokens; each row has
        at least one) and return the logits ``[B, V]`` after each row's last real token.

        Raises ValueError for an empty row, a row longer than ``max_position_embeddings``, or
        ZeRO-3 parameters left sharded (``rollout(..., zero3=...)`` gathers them)."""
        released = [n for n, p in self.stage.named_parameters() if p.numel() > 1 and not any(p.stride())]
        if released:  # ZeRO-3 placeholders (zero-stride): the decoder would read zeros
            raise ValueError(
                f"the policy's ZeRO-3 parameters (e.g. {released[0]}) are not gathered; "
                "pass zero3=DataParallel.zero3 to megazero.post_training.rollout.rollout"
            )
        counts = valid.sum(dim=1)  # (B,)
        if bool((counts == 0).any()):
            raise ValueError("a rollout prompt has no tokens; drop empty prompts")
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L): real tokens before
        self.caches = [None] * len(self.stage.layers)
        self.valid, self.next_pos = valid.clone(), counts.clone()
        x = self._blocks(ids, positions)  # (B, L, H)
        slots = torch.arange(ids.shape[1], device=ids.device)
        last = (valid * (slots + 1)).argmax(dim=1)  # (B,): the last real slot of each row
        return self._logits(x[torch.arange(ids.shape[0], device=ids.device), last][:, None])

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``ids [B]``) and return the next logits ``[B, V]``."""
        positions = self.next_pos[:, None]  # (B, 1)
        self.valid = torch.cat([self.valid, torch.ones_like(self.valid[:, :1])], dim=1)  # (B, S+1)
        self.next_pos = self.next_pos + 1
        return self._logits(self._blocks(ids[:, None], positions))

    def _blocks(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embedding and every block on the new slots ``ids [B, t]`` at ``positions [B, t]``."""
        stage = self.stage
        top = int(positions.max()) + 1
        if top > stage.cfg.max_position_embeddings:
            raise ValueError(
                f"prompt + new tokens ({top}) exceed the model's {stage.cfg.max_position_embeddings} "
                "positions; lower max_new_tokens or shorten the prompts"
            )
        emb = stage.embedding
        x = emb.word_embeddings(ids)  # (B, t, H)
        if emb.with_positions:  # learned positions; RoPE enters in attention
            x = x + emb.position_embeddings(positions)
        t, S = ids.shape[1], self.valid.shape[1]
        slot = torch.arange(S, device=ids.device)
        mine = slot[None, :] == (S - t + torch.arange(t, device=ids.device))[:, None]  # (t, S): own slot
        causal = slot[None, :] <= (S - t + torch.arange(t, device=ids.device))[:, None]  # (t, S)
        mask = (self.valid[:, None, :] & causal[None]) | mine[None]  # (B, t, S)
        for i, block in enumerate(stage.layers.values()):
            y, self.caches[i] = _attend(block.attn, block.ln1(x), self.caches[i], positions, mask[:, None])
            x = x + y
            x = x + block.mlp(block.ln2(x))
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, 1, H]`` -> full real-vocabulary logits ``[B, V]``."""
        stage = self.stage
        x = stage.final_ln(x)
        if stage.cfg.tie_embeddings:
            logits = parallel_lm_logits(x, stage.embedding.word_embeddings.weight, stage.tp, sequence_parallel=False)
        else:
            logits = stage.output(x)  # (B, 1, V_pad/tp)
        return gather_from_tp_region(logits[:, 0], stage.tp)[:, : stage.cfg.vocab_size]  # (B, V)


def _attend(attn, x: torch.Tensor, cache, positions: torch.Tensor, mask: torch.Tensor):
    """``model.gpt.Attention`` on new slots ``x [B, t, H]`` at ``positions [B, t]`` over the
    cached slots and themselves, ``mask [B, 1, t, S]`` (True: attend)."""
    q, k, v = attn._split_heads(attn.qkv(x))  # q (B, n_head/tp, t, d); k, v (B, kv_heads/tp, t, d)
    if attn.rotary is not None:
        cos, sin = attn.rope.at(positions, q.dtype)  # (B, 1, t, rot)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)  # (B, kv/tp, S, d)
    cache = (k, v)
    if attn.q_per_group > 1:  # each key/value head serves its group's query heads
        k, v = (z.repeat_interleave(attn.q_per_group, dim=1) for z in (k, v))  # (B, n/tp, S, d)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, n/tp, t, d)
    y = rearrange(y, "b h t d -> b t (h d)")  # (B, t, n_head/tp * d = H/tp)
    return attn.proj(y), cache
