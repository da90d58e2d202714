"""The model half of rollouts: ragged-batch KV-cache decoding of a GPT under any training
layout (tp, sequence parallelism, cp, pp with virtual stages or the V layout, ZeRO-3), GPT-2,
LLaMA-style or MoE block, for the sampling loop of ``megazero.post_training.rollout`` (which
cannot import ``model``). ``make_decoder(trainer.chunks, trainer.groups)`` is the entry.

Each row of the batch has its own prompt length. The cache is a list of *slots* per row;
a slot holds a token or padding, so prompts may be left- or right-padded. Every slot
carries an explicit position (the number of real tokens before it in its row) and a
validity bit; a query attends to the valid slots at or before its own slot (and to itself,
so a padding query's softmax is never empty); a layer with a sliding window W keeps of those
only the slots whose positions are within W of the query's. After each call the caches of the
windowed layers drop their leading slots that no row's next query can see any more
(``RaggedSlots.trim``): rows are ragged, so one common number of slots is dropped, the slots
before the first one any row still needs. With left-padded prompts (the rollout loop's) every
row ends on the same slot, which leaves at most W - 1 slots; a right-padded row keeps its
padding gap until it slides out. A row's keys, values, positions and logits
therefore depend on its own tokens only: a row decoded in a batch equals the row decoded
alone, up to the rounding of batched matrix products. Each decoding step appends one slot
per row (Pope et al. 2022, "Efficiently Scaling Transformer Inference", sec. 2, for the
cache itself; model/sampling.py is the one-row version). ``RaggedSlots`` keeps that
bookkeeping once for every chunk.

Pipeline parallelism: the chunks run in their global (virtual stage) order, found from their
first layer ids; each chunk keeps the caches of its own layers (stage-local caches). The
owner of a chunk runs it on the new slots and sends the hidden states ``[B, t, H]`` (t = 1
per decoding step) to the owner of the next chunk over the pipeline group; every rank walks
the same list, so each send meets its receive in order and no two ranks wait on each other.
The last chunk's rank computes the full logits ``[B, V]`` (gathered over tp) and broadcasts
them over the pipeline group, so every rank returns them.

Sequence parallelism splits ``[B, T, H]`` along T between the tp ranks, which a step of one
token cannot be; the decoder runs the tensor-parallel layers without it
(``sequence_parallel_off``): column-parallel linears take the whole (replicated) input, the
row-parallel ones and the vocabulary-parallel embedding all-reduce over tp, as the layers do
without sequence parallelism, which gives the same values. Context parallelism needs nothing:
every cp rank holds the whole weights and the decoder's own attention (``attend``) runs whole
rows, never the ring or all-to-all. A multi-head latent attention layer caches its compressed
latent and rotated shared RoPE key, ``(c_kv [B, 1, S, kv_lora_rank], k_pe [B, 1, S, r])``, and
attends in the latent space (``model.mla.MultiLatentAttention.decode``).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from einops import rearrange

from megazero import collectives as C
from megazero.pipeline.p2p import stage_rank
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_logits,
)
from megazero.tensor_parallel.mappings import gather_from_tp_region
from model.gpt import GPTStage
from model.mla import MultiLatentAttention
from model.moe import MoEMLP
from model.rope import apply_rotary


class RaggedSlots:
    """The cache's slots of a batch of B rows: ``valid [B, S]`` bool (which slots hold a real
    token), ``positions [B, S]`` int64 and ``next_pos [B]`` int64 (the position of each row's
    next token). Shared by all chunks of a decoder. ``start``: for each sliding window W, the
    first of the S slots its layers' caches still hold (``trim``; a full layer holds all S).
    ``max_positions``: the model's ``max_position_embeddings``."""

    def __init__(self, valid: torch.Tensor, max_positions: int):
        counts = valid.sum(dim=1)  # (B,)
        if bool((counts == 0).any()):
            raise ValueError("a rollout prompt has no tokens; drop empty prompts")
        self.max_positions = max_positions
        self.valid, self.next_pos = valid.clone(), counts.clone()
        self.positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L): real tokens before
        self.start: dict[int, int] = {}
        self._check(counts)

    def _check(self, top: torch.Tensor) -> None:
        """``top [B]``: tokens each row will hold; raise ValueError past the model's positions."""
        most = int(top.max())
        if most > self.max_positions:
            raise ValueError(
                f"prompt + new tokens ({most}) exceed the model's {self.max_positions} positions; "
                "lower max_new_tokens or shorten the prompts"
            )

    def last_slots(self) -> torch.Tensor:
        """``[B]`` int64: the last real slot of each row (after ``__init__``)."""
        slots = torch.arange(self.valid.shape[1], device=self.valid.device)
        return (self.valid * (slots + 1)).argmax(dim=1)

    def append(self) -> torch.Tensor:
        """One new valid slot per row; returns its positions ``[B, 1]``."""
        positions = self.next_pos[:, None]  # (B, 1)
        self.valid = torch.cat([self.valid, torch.ones_like(self.valid[:, :1])], dim=1)  # (B, S+1)
        self.positions = torch.cat([self.positions, positions], dim=1)  # (B, S+1)
        self.next_pos = self.next_pos + 1
        self._check(self.next_pos)
        return positions

    def trim(self, window: int) -> int:
        """Advance ``start[window]`` to the first slot that some row's next query (at
        ``next_pos``) can see through a window of ``window`` W: a valid slot at a position above
        ``next_pos - W``; all S when no row needs any. Returns how many more leading slots the
        caches of that window's layers may drop."""
        S = self.valid.shape[1]
        needed = self.valid & (self.positions > self.next_pos[:, None] - window)  # (B, S)
        first = torch.where(needed.any(dim=1), needed.int().argmax(dim=1), S)  # (B,): argmax takes the first
        before, after = self.start.get(window, 0), int(first.min())
        self.start[window] = max(before, after)
        return self.start[window] - before

    def mask(self, t: int, window: Optional[int] = None) -> torch.Tensor:
        """``[B, 1, t, S - start]`` bool (True: attend) of the ``t`` newest slots' queries over the
        slots a layer of this ``window`` holds (all S for a full layer, None); with a sliding
        ``window`` W a query at position p keeps only slots at positions above ``p - W``
        (positions, not slots: padding between them does not count), over the slots from
        ``start[W]`` on."""
        S, device = self.valid.shape[1], self.valid.device
        slot = torch.arange(S, device=device)
        query = S - t + torch.arange(t, device=device)  # (t,): the new slots
        mine = slot[None, :] == query[:, None]  # (t, S): each query's own slot
        keep = self.valid[:, None, :] & (slot[None, :] <= query[:, None])[None]  # (B, t, S) causal
        if window is not None:
            near = self.positions[:, query, None] - self.positions[:, None, :] < window  # (B, t, S)
            keep = keep & near
        start = 0 if window is None else self.start.get(window, 0)
        return (keep | mine[None])[:, None, :, start:]  # (B, 1, t, S - start)


@contextlib.contextmanager
def sequence_parallel_off(chunks: Sequence[GPTStage]):
    """Run the chunks' tensor-parallel layers (and MoE MLPs) without sequence parallelism for
    the block: activations ``[B, t, H]`` whole on every tp rank, the row-parallel outputs and
    the word embedding all-reduced over tp instead of reduce-scattered along t, the
    column-parallel (and MLA's latent) inputs used as they are instead of all-gathered. Restores the settings on
    exit. No-op for chunks without sequence parallelism."""
    changed = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                if module.sequence_parallel:
                    changed.append((module, "sequence_parallel"))
            elif isinstance(module, (MoEMLP, MultiLatentAttention)) and module.sp:
                changed.append((module, "sp"))
    for module, name in changed:
        setattr(module, name, False)
    try:
        yield
    finally:
        for module, name in changed:
            setattr(module, name, True)


def attend(attn, x: torch.Tensor, cache, positions: torch.Tensor, mask: torch.Tensor):
    """``model.gpt.Attention`` on new slots ``x [B, t, H]`` at ``positions [B, t]`` over the
    cached slots and themselves, ``mask [B, 1, t, S]`` (True: attend; S: the slots this layer
    holds). ``cache``: None or the ``(k, v)`` of the earlier slots, each
    ``[B, kv_heads/tp, S - t, d]``. Returns the output ``[B, t, H]`` (reduced over tp) and the
    new cache ``[B, kv_heads/tp, S, d]`` each (``trim_caches`` shortens a windowed layer's); a
    ``MultiLatentAttention``'s cache is its latent one (``decode``)."""
    if isinstance(attn, MultiLatentAttention):
        cos, sin = attn.rope.at(positions, x.dtype)  # (B, 1, t, r)
        return attn.decode(x, cos, sin, cache, mask)
    q, k, v = attn.project(x)  # q (B, n_head/tp, t, d); k, v (B, kv_heads/tp, t, d)
    if attn.rotary is not None:
        cos, sin = attn.rope.at(positions, q.dtype)  # (B, 1, t, rot)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)  # (B, kv/tp, S, d)
    cache = (k, v)
    if attn.q_per_group > 1:  # each key/value head serves its group's query heads
        k, v = (z.repeat_interleave(attn.q_per_group, dim=1) for z in (k, v))  # (B, n/tp, S, d)
    y = attn.masked_core(q, k, v, mask)  # (B, n/tp, t, d)
    y = rearrange(y, "b h t d -> b t (h d)")  # (B, t, n_head/tp * d = A/tp)
    return attn.proj(y), cache


def run_chunk(chunk: GPTStage, x: torch.Tensor, positions: torch.Tensor, masks: dict, caches: list):
    """One chunk on the new slots: ids ``x [B, t]`` (embedding chunk) or hidden ``[B, t, H]``
    -> hidden ``[B, t, H]``; ``masks``: each layer's sliding window (None = full) -> its
    ``RaggedSlots.mask``; ``caches`` (one entry per layer) updated in place."""
    if chunk.pre_process:
        emb = chunk.embedding
        x = emb.word_embeddings(x)  # (B, t) ids -> (B, t, H)
        if emb.with_positions:  # learned positions; RoPE enters in attention
            x = x + emb.position_embeddings(positions)
    for i, block in enumerate(chunk.layers.values()):
        y, caches[i] = attend(block.attn, block.ln1(x), caches[i], positions, masks[block.attn.window])
        x = x + y
        x = x + block.mlp(block.ln2(x))
    return x


def trim_caches(chunk: GPTStage, caches: list, drop: dict) -> None:
    """Drop the ``drop[W]`` leading slots of the caches (updated in place, one per layer) of the
    chunk's layers with sliding window W (``RaggedSlots.trim``); full layers keep theirs."""
    for i, block in enumerate(chunk.layers.values()):
        n = drop.get(block.attn.window, 0)
        if block.attn.window is not None and n > 0 and caches[i] is not None:
            caches[i] = tuple(z[:, :, n:].clone() for z in caches[i])  # a copy frees the dropped slots


def head_logits(chunk: GPTStage, x: torch.Tensor) -> torch.Tensor:
    """The last chunk's head: ``x [B, 1, H]`` -> full real-vocabulary logits ``[B, V]``
    (gathered over tp), in the chunk's dtype."""
    x = chunk.final_ln(x)
    if chunk.cfg.tie_embeddings:
        logits = parallel_lm_logits(x, chunk.embedding.word_embeddings.weight, chunk.tp, sequence_parallel=False)
    else:
        logits = chunk.output(x)  # (B, 1, V_pad/tp)
    return gather_from_tp_region(logits[:, 0], chunk.tp)[:, : chunk.cfg.vocab_size]  # (B, V)


def check_decodable(chunks: Sequence[GPTStage], groups: ProcessGroups) -> None:
    """Raise ValueError (one line naming the setting) for a model the decoder cannot sample
    from: a reward model (value head), or an MoE model with expert parallelism (its
    all-to-all would pair ranks that decode different numbers of steps) or with an expert
    capacity (the dropped tokens would depend on the batch, so a row's tokens on the other
    rows)."""
    cfg = chunks[0].cfg
    if cfg.value_head:
        raise ValueError("rollouts need a language model; this one is a reward model (value head)")
    if cfg.num_experts is not None and groups.ep_size > 1:
        raise ValueError(
            f"rollouts of an MoE model need --expert-model-parallel-size 1 (got {groups.ep_size}): "
            "the expert all-to-all cannot follow replicas that stop at different steps"
        )
    if cfg.num_experts is not None and cfg.moe_expert_capacity_factor is not None:
        raise ValueError(
            "rollouts of an MoE model need no --moe-expert-capacity-factor: dropped tokens would make "
            "a row's tokens depend on the other rows"
        )


def check_gathered(chunks: Sequence[GPTStage]) -> None:
    """Raise ValueError naming a ZeRO-3 parameter left sharded (a zero-stride placeholder the
    decoder would read as zeros)."""
    for chunk in chunks:
        released = [n for n, p in chunk.named_parameters() if p.numel() > 1 and not any(p.stride())]
        if released:
            raise ValueError(
                f"the policy's ZeRO-3 parameters (e.g. {released[0]}) are not gathered; "
                "pass zero3=DataParallel.zero3 to megazero.post_training.rollout.rollout"
            )


def virtual_order(chunks: Sequence[GPTStage], groups: ProcessGroups) -> list[tuple[int, int]]:
    """``(pp rank, index in that rank's chunks)`` of every model chunk of the pipeline in
    forward (virtual stage) order: the chunks sorted by their first layer id, which holds for
    every layout (interleaved, V shape, ``--pipeline-layer-split``). Collective over the pp
    group (an all-gather of each rank's first layer ids). Raises ValueError when a chunk has
    no layer or the first / last chunk lacks the embedding / head."""
    if any(not c.layer_ids for c in chunks):
        raise ValueError("every model chunk needs at least one layer to decode")
    firsts = torch.tensor([c.layer_ids[0] for c in chunks], dtype=torch.long, device=chunks[0].device)
    per_rank = C.all_gather_list(firsts, groups.pp)  # pp x (V,)
    order = sorted((int(f), p, i) for p, fs in enumerate(per_rank) for i, f in enumerate(fs.tolist()))
    owners = [(p, i) for _, p, i in order]
    me = groups.pp_rank
    for (p, i), part, held in ((owners[0], "first", "embedding"), (owners[-1], "last", "head")):
        if p == me and not (chunks[i].pre_process if part == "first" else chunks[i].post_process):
            raise ValueError(f"the {part} chunk in layer order (layer {chunks[i].layer_ids[0]}) lacks the {held}")
    return owners


class PipelineDecoder:
    """Batched, ragged KV-cache decoding of this rank's model ``chunks`` (``Trainer.chunks``)
    under any layout (module docstring). Collective over the chunks' tp and pp groups: every
    rank of them calls ``prefill``/``step`` with the same ids and gets the same full logits.

    Use: ``prefill(ids, valid)`` once, then ``step(next_ids)`` per new token; both return the
    next-token logits ``[B, V]`` (real vocabulary, the model's dtype). ``caches[c][i]``: the
    ``(k, v)`` of layer i of chunk c, ``[B, kv_heads/tp, S, d]`` each, S the slots it holds
    (fewer on a windowed layer: ``RaggedSlots.trim``).

    Raises ValueError as ``check_decodable`` and ``virtual_order``. The constructor is
    collective over the pp group when ``groups.pp_size > 1``.
    """

    def __init__(self, chunks: Sequence[GPTStage], groups: ProcessGroups):
        chunks = list(chunks)
        check_decodable(chunks, groups)
        self.chunks, self.groups, self.cfg = chunks, groups, chunks[0].cfg
        self.order = virtual_order(chunks, groups) if groups.pp_size > 1 else self._local_order(chunks)
        self.caches = [[None] * len(c.layers) for c in chunks]
        self.slots: Optional[RaggedSlots] = None

    @staticmethod
    def _local_order(chunks: list) -> list[tuple[int, int]]:
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].layer_ids[0] if chunks[i].layer_ids else -1)
        if not (chunks[order[0]].pre_process and chunks[order[-1]].post_process):
            raise ValueError("rollouts without a pipeline need the whole model: the embedding and the head")
        return [(0, i) for i in order]

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Run the prompts ``ids [B, L]`` (``valid [B, L]`` bool marks real tokens; each row has
        at least one) and return the logits ``[B, V]`` after each row's last real token.

        Raises ValueError for an empty row, a row longer than ``max_position_embeddings``, or
        ZeRO-3 parameters left sharded (``rollout(..., zero3=...)`` gathers them)."""
        check_gathered(self.chunks)
        self.slots = RaggedSlots(valid, self.cfg.max_position_embeddings)
        self.caches = [[None] * len(c.layers) for c in self.chunks]
        return self._forward(ids, self.slots.positions, self.slots.last_slots())

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``ids [B]``) and return the next logits ``[B, V]``.
        Raises ValueError past ``max_position_embeddings``."""
        return self._forward(ids[:, None], self.slots.append(), None)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, last: Optional[torch.Tensor]) -> torch.Tensor:
        """Every chunk in virtual-stage order on the new slots ``ids [B, t]``; ``last [B]``:
        the slot whose logits to return (None: the only one). Returns ``[B, V]`` on every rank."""
        B, t = ids.shape
        windows = {block.attn.window for chunk in self.chunks for block in chunk.layers.values()}
        masks, me = {w: self.slots.mask(t, w) for w in windows}, self.groups.pp_rank  # one per window
        x = ids
        with sequence_parallel_off(self.chunks):
            for v, (owner, i) in enumerate(self.order):
                if owner != me:
                    continue
                if v > 0 and self.order[v - 1][0] != me:  # the previous chunk ran on another stage
                    x = self._recv((B, t, self.cfg.hidden_size), self.order[v - 1][0], ids.device)
                x = run_chunk(self.chunks[i], x, positions, masks, self.caches[i])  # (B, t, H)
                if v + 1 < len(self.order) and self.order[v + 1][0] != me:
                    self._send(x, self.order[v + 1][0])
            drop = {w: self.slots.trim(w) for w in windows if w is not None}  # the next query's reach
            for chunk, caches in zip(self.chunks, self.caches):
                trim_caches(chunk, caches, drop)
            owner, i = self.order[-1]
            logits = None
            if owner == me:
                if last is not None:
                    x = x[torch.arange(B, device=ids.device), last][:, None]  # (B, 1, H)
                logits = head_logits(self.chunks[i], x)  # (B, V)
        return self._broadcast(logits, owner, B, ids.device)

    def _send(self, x: torch.Tensor, pp_rank: int) -> None:
        peer = stage_rank(self.groups, pp_rank)
        x = x.contiguous()
        C.count_send(x, peer)
        dist.send(x, dst=peer, group=self.groups.pp)

    def _recv(self, shape: tuple, pp_rank: int, device) -> torch.Tensor:
        x = torch.empty(shape, dtype=self.cfg.params_dtype, device=device)  # (B, t, H)
        dist.recv(x, src=stage_rank(self.groups, pp_rank), group=self.groups.pp)
        return x

    def _broadcast(self, logits: Optional[torch.Tensor], owner: int, B: int, device) -> torch.Tensor:
        """The last stage's logits ``[B, V]`` on every rank of the pp group."""
        if self.groups.pp_size == 1:
            return logits
        if logits is None:
            logits = torch.empty(B, self.cfg.vocab_size, dtype=self.cfg.params_dtype, device=device)
        return C.broadcast(logits.contiguous(), stage_rank(self.groups, owner), self.groups.pp)


class StageDecoder(PipelineDecoder):
    """``PipelineDecoder`` of one chunk holding every layer, the embedding and the head
    (pp 1), for any tp, with or without sequence parallelism; collective over its tp group.

    Raises ValueError when the stage is not the whole model, or as ``check_decodable``."""

    def __init__(self, stage: GPTStage):
        if not (stage.pre_process and stage.post_process):
            raise ValueError("StageDecoder needs the whole language model in one stage (pp 1); use make_decoder")
        super().__init__([stage], stage.groups)


def make_decoder(chunks: Sequence[GPTStage], groups: ProcessGroups) -> PipelineDecoder:
    """The rollout decoder of this rank's model chunks as the trainer holds them
    (``Trainer.chunks``, ``Trainer.groups``): a ``StageDecoder`` for one whole-model chunk,
    else a ``PipelineDecoder`` (collective over the pp group: call it on every rank). Put the
    chunks in eval mode first. Raises ValueError as ``PipelineDecoder``."""
    if groups.pp_size == 1 and len(chunks) == 1:
        return StageDecoder(chunks[0])
    return PipelineDecoder(chunks, groups)
