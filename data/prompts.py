"""Prompts for reinforcement-learning post-training: (prompt, answer) records -> token prompts
with the reference answer a verifier scores a response against.

    python -m data.prompts --input A.jsonl [B.parquet ...] --tokenizer-model M \\
        [--tokenizer-type HuggingFaceTokenizer] --output-prefix P [--max-prompt-length L] \\
        [--prompt-key prompt] [--answer-key answer] [--messages-key messages]

A record (one JSON line, or one parquet row, read as ``data.sft`` reads them) is one of:

- ``{"prompt": P, "answer": A}``: the prompt's tokens are ``encode(P)``, the text ``data.sft``'s
  prompt/response form puts before its response, so a model fine-tuned on such records
  continues it with a response;
- ``{"messages": [turns...], "answer": A}``: the turns rendered exactly as ``data.sft`` renders
  them (the same ``<|ROLE|>`` headers), then the header of the assistant turn to generate
  (``"\\n<|assistant|>\\n"``); the last turn must not be the assistant's.

``answer`` is the reference a reward function compares with (``megazero.post_training.rewards``):
a string, or a number stored as its decimal text. The answer is required: a verifiable task
without one would score every response 0 without saying so.

Output ``P_prompts.npz`` (record i of the inputs, in order, is prompt i): ``tokens`` int32 (every
prompt's ids end to end), ``offsets`` int64 [N + 1] (prompt i is ``tokens[offsets[i]:offsets[i +
1]]``), ``answers`` str [N], and where each came from (``input`` int32 [N] into ``inputs``,
``position`` int64 [N], the JSONL line from 1 or the parquet row from 0); and
``P.tokenizer.json``. The npz is written under a temporary name and renamed when complete; a bad
record (a missing or non-string field, a chat whose last turn is the assistant's, an empty
prompt, a prompt longer than ``--max-prompt-length`` tokens) ends the run with exit code 2 and one
line naming file, line (or row) and field, leaving nothing behind.

Training reads ``PromptSet(P)``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from data.indexed_dataset import DataError, cli_exit, tmp_name, write_tokenizer_record
from data.sft import SFTKeys, iter_records, record_pieces


def prompts_path(prefix: str) -> str:
    """The npz ``preprocess_prompts`` writes for ``prefix``."""
    return f"{prefix}_prompts.npz"


@dataclass(frozen=True)
class PromptKeys:
    """The record fields (``--prompt-key``, ``--answer-key``, ``--messages-key``)."""

    prompt: str = "prompt"
    answer: str = "answer"
    messages: str = "messages"


def prompt_text(obj, where: str, keys: PromptKeys = PromptKeys()) -> str:
    """One record -> the text whose tokens are the prompt (module doc). Raises DataError naming
    ``where`` and the field: not an object, a missing or non-string prompt, bad chat turns, a
    chat ending with the assistant's turn, an empty prompt."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a record must be a JSON object, not {type(obj).__name__}")
    if obj.get(keys.messages) is not None:
        turns = obj[keys.messages]
        if isinstance(turns, list) and turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
            raise DataError(
                f"{where}: the last turn of {keys.messages!r} is the assistant's; fix: end with the turn "
                "the model answers (the assistant's reply is what RL generates)"
            )
        # data.sft's rendering of the turns plus an assistant turn to be generated
        sft = SFTKeys(messages=keys.messages)
        pieces = record_pieces({keys.messages: turns + [{"role": "assistant", "content": ""}]}, where, sft)
        text = "".join(t for t, _ in pieces)
    else:
        if keys.prompt not in obj:
            raise DataError(
                f"{where}: missing field {keys.prompt!r} (--prompt-key); a record needs {keys.prompt!r} "
                f"or {keys.messages!r}, and {keys.answer!r}"
            )
        text = obj[keys.prompt]
        if not isinstance(text, str):
            raise DataError(f"{where}: field {keys.prompt!r} is {type(text).__name__}, not a string")
    if not text:
        raise DataError(f"{where}: field {keys.prompt!r} is empty; fix: give the prompt text")
    return text


def answer_text(obj: dict, where: str, keys: PromptKeys = PromptKeys()) -> str:
    """The record's reference answer as text (a number as its decimal text). Raises DataError
    for a missing answer or one of another type."""
    if obj.get(keys.answer) is None:
        raise DataError(
            f"{where}: missing field {keys.answer!r} (--answer-key); a verifiable prompt needs its reference answer"
        )
    a = obj[keys.answer]
    if isinstance(a, bool) or not isinstance(a, (str, int, float)):
        raise DataError(f"{where}: field {keys.answer!r} is {type(a).__name__}, not a string or a number")
    return a if isinstance(a, str) else repr(a)


def preprocess_prompts(
    inputs: list[str],
    model_path: str,
    output_prefix: str,
    keys: PromptKeys = PromptKeys(),
    tokenizer_type: str = "SentencePieceTokenizer",
    max_prompt_length: Optional[int] = None,
) -> dict:
    """Tokenize the records of ``inputs`` into ``output_prefix`` (module doc for the files).
    Returns stats: prompts, tokens, longest, prefix. Raises DataError on bad input; no output
    file survives an error."""
    from data.tokenizer import load_tokenizer

    if max_prompt_length is not None and max_prompt_length < 1:
        raise DataError(f"--max-prompt-length {max_prompt_length}: must be at least 1")
    tok = load_tokenizer(model_path, tokenizer_type)
    ids, offsets, answers, sources, positions = [], [0], [], [], []
    for k, path in enumerate(inputs):
        for where, obj in iter_records([path]):
            text = prompt_text(obj, where, keys)
            answer = answer_text(obj, where, keys)
            t = tok.encode(text)
            if max_prompt_length is not None and len(t) > max_prompt_length:
                raise DataError(
                    f"{where}: the prompt is {len(t)} tokens, above --max-prompt-length {max_prompt_length}; "
                    "fix: a shorter prompt or a larger --max-prompt-length"
                )
            ids += t
            offsets.append(len(ids))
            answers.append(answer)
            sources.append(k)
            positions.append(int(where.replace(":", " ").split()[-1]))
    if not answers:
        raise DataError(f"{', '.join(inputs)}: no records")
    out, tmp = prompts_path(output_prefix), tmp_name(prompts_path(output_prefix))
    try:
        with open(tmp, "wb") as f:
            np.savez(
                f,
                tokens=np.asarray(ids, dtype=np.int32),
                offsets=np.asarray(offsets, dtype=np.int64),
                answers=np.asarray(answers, dtype=str),
                input=np.asarray(sources, dtype=np.int32),
                position=np.asarray(positions, dtype=np.int64),
                inputs=np.asarray([os.fspath(p) for p in inputs], dtype=str),
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    write_tokenizer_record(output_prefix, tok.record())
    lengths = np.diff(np.asarray(offsets))
    return dict(prompts=len(answers), tokens=len(ids), longest=int(lengths.max()), prefix=output_prefix)


class PromptSet:
    """The prompts ``preprocess_prompts`` wrote at ``prefix``: ``len``, ``tokens(i)`` (the ids,
    a list of int), ``answer(i)`` and ``where(i)`` (``file:line`` or ``file: row N``, for an
    error that names the record). Raises DataError when the file is missing or unreadable."""

    def __init__(self, prefix: str):
        path = prompts_path(prefix)
        if not os.path.isfile(path):
            raise DataError(f"{path}: not found; fix: write it with python -m data.prompts --output-prefix {prefix}")
        try:
            with np.load(path) as z:
                self._tokens, self._offsets = z["tokens"], z["offsets"]
                self._answers, self._input = z["answers"], z["input"]
                self._position, self._inputs = z["position"], z["inputs"]
        except (OSError, KeyError, ValueError) as e:
            raise DataError(f"{path}: unreadable ({e}); fix: write it again with python -m data.prompts") from e

    def __len__(self) -> int:
        return len(self._answers)

    def tokens(self, i: int) -> list[int]:
        return self._tokens[self._offsets[i] : self._offsets[i + 1]].tolist()

    def lengths(self) -> np.ndarray:
        """``[N]`` int64: each prompt's token count."""
        return np.diff(self._offsets)

    def answer(self, i: int) -> str:
        return str(self._answers[i])

    def where(self, i: int) -> str:
        path, pos = str(self._inputs[self._input[i]]), int(self._position[i])
        return f"{path}: row {pos}" if path.endswith(".parquet") else f"{path}:{pos}"


class PromptSplit:
    """Prompts ``ids`` (a range of ``PromptSet`` indices) of one split, read in epochs: each epoch
    visits every prompt once in an order shuffled by ``(seed, epoch)`` (numpy's PCG64), so the
    prompts of any step follow from the count already consumed, on every rank and after a
    resume. ``len``; ``index(k)``: the ``PromptSet`` index of the k-th prompt read (k >= 0);
    ``tokens``, ``answer``, ``where`` of a ``PromptSet`` index."""

    def __init__(self, prompts: PromptSet, ids: range, seed: int):
        self.prompts, self.ids, self.seed = prompts, ids, seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def index(self, k: int) -> int:
        epoch, pos = divmod(k, len(self.ids))
        if epoch not in self._orders:
            self._orders[epoch] = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(len(self.ids))
        return self.ids.start + int(self._orders[epoch][pos])

    def tokens(self, i: int) -> list[int]:
        return self.prompts.tokens(i)

    def answer(self, i: int) -> str:
        return self.prompts.answer(i)

    def where(self, i: int) -> str:
        return self.prompts.where(i)


def prompt_splits(prefix: str, split: str, seed: int) -> tuple:
    """(train, valid, test) ``PromptSplit`` of the prompts at ``prefix`` by ``--split``
    (``data.gpt_dataset.split_ranges`` over the prompts in file order; an empty valid or test
    split is None). Raises DataError for an unreadable file or an empty train split."""
    from data.gpt_dataset import parse_split, split_ranges

    prompts = PromptSet(prefix)
    out = []
    for (a, b), name in zip(split_ranges(len(prompts), parse_split(split)), ("train", "valid", "test")):
        if b > a:
            out.append(PromptSplit(prompts, range(a, b), seed))
        elif name == "train":
            raise DataError(f"--split {split} leaves no prompt of {prefix} for training; fix: e.g. --split 95,5,0")
        else:
            out.append(None)
    return tuple(out)


def main(argv: Optional[list[str]] = None) -> int:
    from data.tokenizer import TOKENIZER_TYPES

    p = argparse.ArgumentParser(prog="python -m data.prompts", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or .parquet files")
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_prompts.npz and PREFIX.tokenizer.json")
    p.add_argument("--max-prompt-length", type=int, default=None, help="refuse longer prompts (tokens)")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--answer-key", default="answer")
    p.add_argument("--messages-key", default="messages", help="the chat form's turns")
    args = p.parse_args(argv)
    keys = PromptKeys(args.prompt_key, args.answer_key, args.messages_key)
    s = preprocess_prompts(
        args.input, args.tokenizer_model, args.output_prefix, keys, args.tokenizer_type, args.max_prompt_length
    )
    print(f"{s['prompts']} prompts, {s['tokens']} tokens (longest {s['longest']}) -> {prompts_path(s['prefix'])}")
    return 0


if __name__ == "__main__":
    cli_exit(main)
