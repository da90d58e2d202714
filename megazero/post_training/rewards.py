"""Rewards of RL post-training: a verifier's score of each response, placed on a token.

A reward function takes ``(prompt, response, answer)`` (the prompt's text, the response's text
up to its EOD, the record's reference answer from ``data.prompts``) and returns a finite number.
``--reward`` names one:

- ``exact``: 1.0 when the response, stripped of surrounding white space, equals the answer
  stripped likewise, else 0.0 (a verifiable task's binary reward, as GRPO's math and code
  tasks use: DeepSeek-R1, Guo et al. 2025, sec. 2.2.2 "accuracy rewards");
- ``python:MODULE:FN``: ``FN`` of the importable ``MODULE``, called with the same three
  arguments (a user's own verifier: a unit-test runner, a format check);
- ``rm:DIR``: a reward model, the latest ``--post-train rm`` checkpoint under ``DIR``, scoring
  the prompt's and the response's tokens (``reward_model_inputs``: the tokens as the reward
  model was trained to score them; ``reward_model_scores``), learned from human preferences as
  in InstructGPT's RL stage (Ouyang et al. 2022, sec. 3.5).

``token_rewards`` puts each sequence's score on its last response token: the EOD when the row
generated one, else the last token generated (a row cut by ``--max-new-tokens``), never a pad
after the EOD (the misplacement verl and OpenRLHF users met when the reward went to the last
position of the padded row).
"""

from __future__ import annotations

import importlib
import math
from typing import Callable, Optional

import torch

from megazero.post_training.reward import last_token_mask

RewardFunction = Callable[[str, str, str], float]


class RewardError(ValueError):
    """A ``--reward`` that names no usable reward function (found before any rank starts)."""


def exact_match(prompt: str, response: str, answer: str) -> float:
    """1.0 when ``response.strip() == answer.strip()``, else 0.0 (module docstring)."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def reward_model_dir(spec: str) -> Optional[str]:
    """``DIR`` of a ``--reward rm:DIR``, None for another kind. Raises RewardError for ``rm:``
    without a directory."""
    kind, _, rest = spec.partition(":")
    if kind != "rm":
        return None
    if not rest:
        raise RewardError(
            f"--reward {spec}: no directory; fix: --reward rm:DIR, DIR the --save of a --post-train rm run"
        )
    return rest


def parse_reward(spec: str) -> RewardFunction:
    """The reward function ``spec`` names (module docstring; not ``rm:DIR``, a model that
    ``megazero.training.rl`` runs). Raises RewardError (a ValueError), one line naming
    ``--reward`` and the fix: an unknown kind, a module that does not import, a missing or
    non-callable function."""
    if spec == "exact":
        return exact_match
    kind, _, rest = spec.partition(":")
    module, _, name = rest.rpartition(":")
    if kind != "python" or not module or not name:
        raise RewardError(
            f"--reward {spec}: not a reward; fix: --reward exact, --reward python:MODULE:FUNCTION or --reward rm:DIR"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise RewardError(f"--reward {spec}: module {module!r} does not import ({e}); fix: put it on PYTHONPATH") from e
    except AttributeError as e:
        raise RewardError(f"--reward {spec}: module {module!r} has no {name!r}; fix: name a function it defines") from e
    if not callable(fn):
        raise RewardError(f"--reward {spec}: {module}.{name} is not callable; fix: name a function")
    return fn


def score(fn: RewardFunction, spec: str, prompt: str, response: str, answer: str) -> float:
    """``fn(prompt, response, answer)`` as a float. Raises ValueError naming ``--reward`` when it
    returns something that is not a finite number."""
    value = fn(prompt, response, answer)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"--reward {spec} returned {value!r} for a response; fix: return a finite number (an int or a float)"
        )
    return float(value)


def token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` float32: ``scores[n]`` (``[N]``) at the last position where ``response_mask``
    ``[N, T]`` is non-zero (row n's last response token: its EOD, or the last token generated
    before the length limit), 0 elsewhere. Raises ValueError for a row without a response
    token (its score would land nowhere)."""
    on = response_mask > 0
    if not bool(on.any(dim=1).all()):
        rows = torch.nonzero(~on.any(dim=1)).flatten().tolist()
        raise ValueError(f"rows {rows} have no response token to put their reward on")
    return last_token_mask(response_mask) * scores.to(torch.float32).unsqueeze(1)


def reward_model_inputs(
    prompts: list[list[int]], group_size: int, tokens: torch.Tensor, mask: torch.Tensor, eod: Optional[int]
) -> tuple[list[list[int]], list[int]]:
    """(sequences, response lengths) for ``reward_model_scores`` of N = P G rollout rows:
    ``prompts`` P lists of ids, row n answering prompt ``n // group_size``; ``tokens`` / ``mask``
    ``[N, max_new_tokens]`` the responses (``megazero.post_training.rollout.Rollout``).

    A reward model scores the hidden state of the token whose next token is the response's
    closing EOD: ``data.preference`` writes a pair's sequence as prompt + response + EOD and
    ``--post-train rm`` reads the score at the last position whose label is a response token,
    the EOD's (``last_token_mask``). So row n's sequence is its prompt and its response up to,
    not including, the EOD (all of it when ``--max-new-tokens`` cut it first, or ``eod`` is None);
    an empty response (an EOD alone) leaves the prompt, scored at its last token as training
    scores such a pair. The response length counts the tokens kept (1 for an empty response:
    the scored position is the sequence's last token either way)."""
    sequences, lengths = [], []
    for n in range(tokens.shape[0]):
        ids = tokens[n][mask[n]].tolist()
        if ids and eod is not None and ids[-1] == eod:
            ids = ids[:-1]
        sequences.append(list(prompts[n // group_size]) + ids)
        lengths.append(max(len(ids), 1))
    return sequences, lengths


@torch.no_grad()
def reward_model_scores(stage, sequences: list[list[int]], response_lengths: list[int], pad: int) -> torch.Tensor:
    """A reward model's score ``[N]`` fp32 of each sequence (prompt + response ids, ragged) whose
    last ``response_lengths[n]`` tokens are the response: the value head on the final-norm hidden
    state of the last response token (``last_token_mask``), as ``--post-train rm`` trains it,
    the rows right-padded with ``pad`` in one batch. ``stage`` is a whole-model reward-model
    stage (``model.gpt.GPTStage`` with its value head; any tp, no pipeline), in eval mode; every
    tp rank returns the same scores. Raises ValueError for a stage without a value head, or a
    response length outside [1, len(sequence)]."""
    from megazero.context_parallel.sequence import Packing, shard_micro_batch

    if not getattr(stage.cfg, "value_head", False):
        raise ValueError("the model has no value head: a reward model is a --post-train rm checkpoint")
    bad = [n for n, (s, r) in enumerate(zip(sequences, response_lengths, strict=True)) if not 1 <= r <= len(s)]
    if bad:
        raise ValueError(f"sequences {bad} have a response length outside [1, sequence length]")
    device = next(stage.parameters()).device
    T = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), T), pad, dtype=torch.long, device=device)
    mask = torch.zeros(len(sequences), T, dtype=torch.float32, device=device)
    for n, (s, r) in enumerate(zip(sequences, response_lengths)):
        tokens[n, : len(s)] = torch.as_tensor(s, dtype=torch.long, device=device)
        mask[n, len(s) - r : len(s)] = 1.0
    tokens, _, seq = shard_micro_batch(
        tokens, tokens, cp=1, cp_rank=0, packing=Packing(), loss_mask=last_token_mask(mask)
    )
    return stage(tokens, seq=seq).float()
