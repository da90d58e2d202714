"""Sampling with a key/value cache from a whole-model GPT stage (pp == 1, any tp), GPT-2 or
LLaMA-style block.

The prompt runs once through the model (prefill), each layer keeping its keys and values
``[B, kv_heads/tp, t, head_dim]`` (kv_heads = n_head, or the G groups of grouped-query
attention, whose heads are repeated for their queries only inside attention; with RoPE the
cached keys are already rotated at their absolute positions); every new token then runs alone,
attending to the cache, so a step costs one token's forward instead of the whole context's
(the standard decoder KV cache, e.g. Pope et al. 2022, "Efficiently Scaling Transformer
Inference", sec. 2). Each layer's ``LayerCache`` counts the tokens it has seen (``seen``, the
absolute position of the next one), apart from how many keys it holds, so RoPE angles, learned
positions and masks stay right once a cache is trimmed. A layer with a sliding window W
(Mistral 7B, Jiang et al. 2023, sec. 2) keeps only the last W - 1 keys and values after each
call, the ones the next query can still see: its cache holds at most W - 1 + t entries during a
call of t new tokens, while a full layer's grows with the sequence. A prefill longer than W
attends inside the prompt with the window's mask, then trims. Attention sinks need no key: the
sink logit of each head joins every softmax over the trimmed keys. The forward reuses the
stage's own tensor-parallel modules (QKV and fc1 column-parallel, projections row-parallel,
vocabulary-parallel embedding and logits), so under tp each rank
holds its heads' cache and the logits are gathered over TP before sampling: every TP rank
sees the same full logits and, with the same seed, draws the same token. A multi-head latent
attention layer (model/mla.py) caches its compressed latent and shared RoPE key instead,
``kv_lora_rank + qk_pos_emb_head_dim`` values a token, and attends in the latent space
(``MultiLatentAttention.decode``).

Sampling (as Hugging Face's ``generate`` and Megatron's text generation define it): with
``temperature == 0`` the argmax (greedy); otherwise the logits are divided by the
temperature, restricted to the ``top_k`` largest (0 = all), then to the smallest set of
tokens whose probabilities sum to at least ``top_p`` (1.0 = all; the most likely token
always stays; nucleus sampling, Holtzman et al. 2020, sec. 3.1), and one token is drawn
with a ``torch.Generator`` seeded by ``seed``. Padded vocabulary columns are never drawn.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from einops import rearrange

from megazero.tensor_parallel.layers import parallel_lm_logits
from megazero.tensor_parallel.mappings import gather_from_tp_region
from model.gpt import SDPA_GQA
from model.mla import MultiLatentAttention
from model.rope import apply_rotary


class LayerCache(NamedTuple):
    """One layer's KV cache: ``k``, ``v`` ``[B, kv_heads/tp, held, d]`` (RoPE keys already
    rotated), the keys of the absolute positions ``seen - held .. seen - 1``; ``seen``: the
    tokens this layer has processed (the position of the next one). A multi-head latent attention
    layer holds its latent ``c_kv [B, 1, held, kv_lora_rank]`` in ``k`` and its rotated shared key
    ``k_pe [B, 1, held, qk_pos_emb_head_dim]`` in ``v`` (model/mla.py)."""

    k: torch.Tensor
    v: torch.Tensor
    seen: int


def _attend(attn, x: torch.Tensor, cache: Optional[LayerCache]) -> tuple[torch.Tensor, LayerCache]:
    """``model.gpt.Attention`` on new tokens ``x [B, t, H]`` after ``cache`` (None: the first call);
    returns the output ``[B, t, H]`` and the cache, trimmed to W - 1 entries on a windowed layer."""
    if isinstance(attn, MultiLatentAttention):
        return _attend_latent(attn, x, cache)
    q, k, v = attn.project(x)  # q (B, n_head/tp, t, d); k, v (B, kv_heads/tp, t, d)
    t = q.shape[2]
    past, held = (0, 0) if cache is None else (cache.seen, cache.k.shape[2])
    if attn.rotary is not None:  # absolute positions past .. past + t - 1: the stage's table
        cos, sin = attn.rope.first(past + t, q.dtype)  # (past+t, rot)
        q, k = apply_rotary(q, cos[past:], sin[past:]), apply_rotary(k, cos[past:], sin[past:])
    if cache is not None:
        k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)  # (B, kv/tp, held+t, d)
    new_cache = LayerCache(k, v, past + t)
    if attn.window is not None and held + t > attn.window - 1:  # keep what the next query sees
        keep = attn.window - 1
        new_cache = LayerCache(k[:, :, held + t - keep :].clone(), v[:, :, held + t - keep :].clone(), past + t)
    gqa = {}
    if attn.q_per_group > 1 and SDPA_GQA:  # SDPA reads each key/value head for its group's queries
        gqa = {"enable_gqa": True}
    elif attn.q_per_group > 1:
        k, v = (z.repeat_interleave(attn.q_per_group, dim=1) for z in (k, v))  # (B, n/tp, held+t, d)
    # key j holds position past - held + j: new token i (position past + i) sees j <= held + i,
    # and with a window W only j > held + i - W
    mask = torch.ones(t, held + t, dtype=torch.bool, device=x.device).tril(diagonal=held)
    if attn.window is not None:
        mask = mask & ~torch.ones(t, held + t, dtype=torch.bool, device=x.device).tril(diagonal=held - attn.window)
    if attn.sink_logits() is not None:  # the sink is a logit per head, no key: nothing to keep for it
        y = attn.masked_core(q, k, v, mask)  # (B, n/tp, t, d)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.softmax_scale, **gqa)  # (B, n/tp, t, d)
    y = rearrange(y, "b h t d -> b t (h d)")  # (B, t, n_head/tp * d)
    return attn.proj(y), new_cache


def _attend_latent(attn: MultiLatentAttention, x: torch.Tensor, cache: Optional[LayerCache]):
    """``_attend`` for multi-head latent attention: the latent cache (``LayerCache``), no window."""
    t = x.shape[1]
    past, held = (0, 0) if cache is None else (cache.seen, cache.k.shape[2])
    cos, sin = attn.rope.first(past + t, x.dtype)  # (past+t, r)
    mask = torch.ones(t, held + t, dtype=torch.bool, device=x.device).tril(diagonal=held)  # (t, held+t)
    y, (c_kv, k_pe) = attn.decode(x, cos[past:], sin[past:], None if cache is None else cache[:2], mask)
    return y, LayerCache(c_kv, k_pe, past + t)


@torch.no_grad()
def forward_cached(stage, ids: torch.Tensor, caches: list) -> torch.Tensor:
    """Logits ``[B, V]`` (real vocabulary, gathered over TP) of the last of the new tokens
    ``ids [B, t]``; ``caches`` (one ``LayerCache`` per layer, None at first) is replaced in
    place by the caches after these tokens (a windowed layer's trimmed to W - 1 entries).

    Raises ValueError when the positions run past ``max_position_embeddings`` or the stage
    is not the whole model without sequence parallelism.
    """
    if not (stage.pre_process and stage.post_process) or stage.sp:
        raise ValueError("KV-cache decoding needs the whole model in one stage (pp 1), without --sequence-parallel")
    past = 0 if caches[0] is None else caches[0].seen  # absolute position of ids[:, 0]
    if past + ids.shape[1] > stage.cfg.max_position_embeddings:
        raise ValueError(
            f"prompt + new tokens ({past + ids.shape[1]}) exceed the model's "
            f"{stage.cfg.max_position_embeddings} positions; lower --max-new-tokens"
        )
    emb = stage.embedding
    x = emb.word_embeddings(ids)  # (B, t, H)
    if emb.with_positions:  # learned positions; RoPE enters in attention
        x = x + emb.position_embeddings(torch.arange(past, past + ids.shape[1], device=ids.device))
    for i, block in enumerate(stage.layers.values()):
        y, caches[i] = _attend(block.attn, block.ln1(x), caches[i])
        x = x + y
        x = x + block.mlp(block.ln2(x))
    x = stage.final_ln(x[:, -1:])  # (B, 1, H)
    if stage.cfg.tie_embeddings:
        logits = parallel_lm_logits(x, emb.word_embeddings.weight, stage.tp, sequence_parallel=False)
    else:
        logits = stage.output(x)  # (B, 1, V_pad/tp)
    return gather_from_tp_region(logits[:, 0], stage.tp)[:, : stage.cfg.vocab_size]  # (B, V)


def choose(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: Optional[torch.Generator]
) -> torch.Tensor:
    """Next token ids ``[B]`` from logits ``[B, V]`` (see the module docstring).

    Raises ValueError for a negative temperature or top_k, or top_p outside (0, 1].
    """
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"need --temperature >= 0 (got {temperature}), --top-k >= 0 (got {top_k}) and "
            f"0 < --top-p <= 1 (got {top_p})"
        )
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)  # (B, V) each
        before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(1, order, before >= top_p)  # vocab order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(logits.device)


def check_prompt(prompt_ids: list[int], max_positions: int) -> None:
    """Raise ValueError (naming --prompt and the fix) unless the prompt has 1 to
    ``max_positions`` tokens (the model's ``max_position_embeddings``)."""
    if not prompt_ids:
        raise ValueError("--prompt encodes to no tokens; give a non-empty prompt")
    if len(prompt_ids) > max_positions:
        raise ValueError(
            f"--prompt encodes to {len(prompt_ids)} tokens, more than the model's {max_positions} "
            "positions; fix: a shorter prompt"
        )


@torch.no_grad()
def sample(
    stage,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eod: Optional[int] = None,
) -> list[int]:
    """``prompt_ids`` continued by up to ``max_new_tokens`` tokens (stops after ``eod``, and when
    the sequence fills the model's ``max_position_embeddings`` positions).

    Collective over the stage's TP group (every TP rank calls it with the same arguments and
    gets the same ids). Reproducible: the same seed gives the same tokens. Raises ValueError
    for an empty prompt, bad sampling settings, or a length past the model's positions.
    """
    check_prompt(prompt_ids, stage.cfg.max_position_embeddings)
    was_training = stage.training
    stage.eval()
    device = next(stage.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    caches: list = [None] * len(stage.layers)
    ids = list(prompt_ids)
    new = torch.tensor([ids], device=device)  # (1, T0): the prefill
    try:
        room = stage.cfg.max_position_embeddings - len(ids)  # every token of the result has a position
        for _ in range(min(max_new_tokens, room)):
            token = int(choose(forward_cached(stage, new, caches), temperature, top_k, top_p, generator)[0])
            ids.append(token)
            if token == eod:
                break
            new = torch.tensor([[token]], device=device)  # (1, 1)
    finally:
        stage.train(was_training)
    return ids
