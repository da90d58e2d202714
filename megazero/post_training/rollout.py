"""Rollouts: batched sampling of responses to prompts with per-token log-probabilities, the
generation half of RL post-training (GRPO and PPO are to build on it).

The loop here is model-free: it drives a *decoder* with two methods, ``prefill(ids [B, L],
valid [B, L]) -> logits [B, V]`` and ``step(ids [B]) -> logits [B, V]`` (full real-vocabulary
logits of each row's next token, identical on every rank of the decoder's tp and pp groups;
``model.rollout.make_decoder`` makes the GPT's from the trainer's chunks, under any layout).

Per new token of each row:

1. ``log p`` of the drawn token under ``softmax(logits / temperature)`` over the whole real
   vocabulary, before any top-k / top-p filtering: the definition of the trainer's
   ``vocab_parallel_log_probs`` at the same temperature, so a forward over prompt + response
   reproduces them (the first PPO ratio is 1).
2. The draw: the scaled logits are restricted to the ``top_k`` largest (0 = all) and to the
   smallest set whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020,
   sec. 3.1); then the Gumbel-max trick (argmax of logits plus Gumbel noise is a draw from
   their softmax; Gumbel 1954, as used by Kool et al. 2019, sec. 2) with noise from the row's
   own ``torch.Generator``. The generator is seeded by ``sample_seed(seed, step, prompt
   index, sample index)`` -- never by a rank -- so a row's tokens are the same in any batch,
   at any tp and on any data-parallel replica. ``greedy`` takes the argmax instead.
3. A row stops after EOD or ``max_new_tokens`` tokens; the loop ends when every row stopped.

``rollout`` splits the rows (prompt-major: prompt i's samples are rows ``i * S .. i * S + S -
1``) over the data-parallel replicas and all-gathers the results, so every rank returns the
global rollout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megazero import collectives as C

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class RolloutSettings:
    """How responses are sampled.

    ``max_new_tokens``: bound on generated tokens per row (>= 1);
    ``temperature``: logits are divided by it before the softmax (> 0 when sampling; with
    ``greedy`` it only sets the temperature of the returned log-probs, 0 meaning 1);
    ``top_k``: keep the k most likely tokens (0 = all);
    ``top_p``: keep the smallest set of tokens whose probability reaches it, in (0, 1];
    ``greedy``: argmax instead of a draw;
    ``eod``: the end-of-document token id that stops a row (None: only the length stops it);
    ``seed``: the run's sampling seed, the first key of every row's generator.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    eod: Optional[int] = None
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError (one line naming the setting and the fix) on a bad setting."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling (got {self.temperature}); use greedy for argmax")
        if self.greedy and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = all tokens), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = all tokens), got {self.top_p}")

    @property
    def log_prob_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Rollout:
    """Responses of B rows (prompt-major, ``samples`` per prompt).

    ``tokens``: ``[B, max_new_tokens]`` int64, the generated ids, then padding (EOD, or 0
    without one); ``mask``: ``[B, max_new_tokens]`` bool, True on generated tokens (the EOD
    that stopped a row included); ``log_probs``: ``[B, max_new_tokens]`` fp32 (float64 for a
    float64 model), nats of ``softmax(logits / temperature)`` at each generated token, 0 on
    padding.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    log_probs: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` int64: generated tokens per row."""
        return self.mask.sum(dim=1)


def _mix64(z: int) -> int:
    """SplitMix64's finaliser (Steele et al. 2014): a bijection of 64-bit integers that
    spreads every input bit over the output."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The generator seed of one row, a 63-bit integer depending on the four keys only (not on
    the rank, the batch or the layout). Distinct keys give distinct seeds up to hash
    collisions (2^-63 per pair)."""
    h = 0
    for key in (seed, step, prompt_index, sample_index):
        h = _mix64((h ^ (key & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64)
    return h >> 1


def filtered(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``scaled [B, V]`` with the tokens outside the top-k and the top-p nucleus set to -inf
    (the most likely token always stays)."""
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1:
        probs, order = scaled.softmax(dim=-1).sort(dim=-1, descending=True)  # (B, V) each
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(1, order, before >= top_p)  # vocab order
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def choose_with_log_probs(
    logits: torch.Tensor, settings: RolloutSettings, generators: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens ``[B]`` int64 and their log-probs ``[B]`` (steps 1-2 of the module
    docstring) from full logits ``[B, V]``; ``generators[b]`` draws row b's Gumbel noise (one
    ``V``-vector per call, on the CPU)."""
    x = logits.float() if logits.dtype != torch.float64 else logits
    scaled = x / settings.log_prob_temperature
    if settings.greedy:
        tokens = x.argmax(dim=-1)
    else:
        V = x.shape[-1]
        noise = torch.stack([torch.rand(V, generator=g, dtype=x.dtype, device="cpu") for g in generators])  # (B, V)
        gumbel = -torch.log(-torch.log(noise))
        tokens = (filtered(scaled, settings.top_k, settings.top_p) + gumbel.to(x.device)).argmax(dim=-1)
    log_probs = scaled.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, log_probs


def _pad_left(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> left-padded ids ``[B, L]`` (pad 0) and their validity ``[B, L]``."""
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
    valid = torch.zeros(len(prompts), L, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :] = torch.tensor(list(p), dtype=torch.long, device=device)
        valid[b, L - len(p) :] = True
    return ids, valid


@torch.no_grad()
def generate(
    decoder,
    prompts: Sequence[Sequence[int]],
    keys: Sequence[tuple[int, int]],
    settings: RolloutSettings,
    *,
    step: int = 0,
    device=None,
) -> Rollout:
    """Responses to ``prompts`` (lists of token ids, any lengths >= 1) on this rank, row b
    keyed by ``keys[b] = (prompt index, sample index)`` (global numbers). See the module
    docstring; collective over the decoder's tp and pp groups. Raises ValueError for bad settings,
    an empty prompt, or prompt + new tokens past the model's positions."""
    settings.check()
    if len(keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys; give one (prompt, sample) key per row")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a rollout prompt has no tokens; drop empty prompts")
    B, N = len(prompts), settings.max_new_tokens
    generators = [torch.Generator().manual_seed(sample_seed(settings.seed, step, i, s)) for i, s in keys]
    ids, valid = _pad_left(prompts, device)
    pad = 0 if settings.eod is None else settings.eod
    tokens = torch.full((B, N), pad, dtype=torch.long, device=device)
    mask = torch.zeros(B, N, dtype=torch.bool, device=device)
    log_probs = None
    done = torch.zeros(B, dtype=torch.bool, device=device)
    logits = decoder.prefill(ids, valid)
    for t in range(N):
        new, lp = choose_with_log_probs(logits, settings, generators)
        if log_probs is None:
            log_probs = torch.zeros(B, N, dtype=lp.dtype, device=device)
        live = ~done
        tokens[:, t] = torch.where(live, new, tokens[:, t])
        log_probs[:, t] = torch.where(live, lp, log_probs[:, t])
        mask[:, t] = live
        if settings.eod is not None:
            done = done | (new == settings.eod)
        if bool(done.all()) or t == N - 1:
            break
        logits = decoder.step(tokens[:, t])
    return Rollout(tokens, mask, log_probs)


def rollout(
    decoder,
    prompts: Sequence[Sequence[int]],
    settings: RolloutSettings,
    *,
    step: int = 0,
    samples_per_prompt: int = 1,
    prompt_keys: Optional[Sequence[int]] = None,
    dp_group=None,
    zero3=None,
    device=None,
) -> Rollout:
    """The global rollout of ``samples_per_prompt`` responses to each of the global
    ``prompts``: rows ``[len(prompts) * samples_per_prompt, max_new_tokens]``, prompt-major.

    The rows are split into equal contiguous blocks over ``dp_group`` (the last replicas pad
    theirs with copies of row 0, dropped after the gather); each replica generates its block
    and the blocks are all-gathered, so every rank returns the same rollout, equal to one
    process's. Collective over the decoder's tp and pp groups and ``dp_group``; every rank passes the
    same arguments. ``zero3``: the policy's ZeRO-3 gather schedule (``DataParallel.zero3``;
    None when its parameters are whole): every unit is gathered once for the whole rollout
    (``Zero3Gather.holding``) and released after, so the all-gather bytes do not grow with the
    number of decoded tokens. ``prompt_keys``: each prompt's global number, the second key of
    its rows' generators (default its position in ``prompts``). Raises ValueError as
    :func:`generate`, and for ``samples_per_prompt < 1`` or a ``prompt_keys`` of another length.
    """
    settings.check()  # before any collective
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if prompt_keys is not None and len(prompt_keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(prompt_keys)} prompt keys; give one per prompt")
    keys = list(range(len(prompts))) if prompt_keys is None else list(prompt_keys)
    rows = [(i, s) for i in range(len(prompts)) for s in range(samples_per_prompt)]
    dp, rank = C.group_size(dp_group), C.group_rank(dp_group)
    per = -(-len(rows) // dp)  # ceil
    mine = rows[rank * per : (rank + 1) * per]
    mine += [rows[0]] * (per - len(mine))  # padding rows: same shapes on every replica
    with contextlib.nullcontext() if zero3 is None else zero3.holding():
        local = generate(
            decoder, [prompts[i] for i, _ in mine], [(keys[i], s) for i, s in mine], settings, step=step, device=device
        )
    if dp == 1:
        return local
    parts = [C.all_gather_list(t, dp_group) for t in (local.tokens, local.mask.to(torch.uint8), local.log_probs)]
    tokens, mask, log_probs = (torch.cat(p)[: len(rows)] for p in parts)
    return Rollout(tokens, mask.bool(), log_probs)
