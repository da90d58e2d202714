"""Post-training data derived from the embedded corpus, for the SFT -> DPO walk-through of
docs/post-training.md (``bash scripts/post_train_demo.sh``) and the SFT -> RM -> GRPO run
(``bash scripts/rlhf_e2e.sh``).

    python -m data.post_train_demo --data-dir DIR [--sft-records 4000] [--pairs 4000] \
        [--prompts N --max-prompt-tokens 224]

Reads ``DIR/corpus/train.jsonl`` and ``DIR/corpus/heldout.jsonl`` (``python -m data.prepare``)
and the tokenizer ``DIR/tokenizer.model``, and writes under ``DIR/post_train/``:

- ``sft.jsonl`` -> ``sft`` (``data.sft``): prompt = 6 consecutive lines of a training file,
  response = the 4 lines after them;
- ``pairs.jsonl`` -> ``pref`` (``data.preference``): the same kind of window, chosen = the 4 real
  next lines, rejected = those 4 lines in reverse order (a corrupted copy: the same tokens, the
  wrong order); first ``--pairs`` pairs from training files, then the pairs of the held-out files
  (every window of theirs), so ``--split TRAIN,HELDOUT,0`` makes the held-out files the
  validation pairs;
- with ``--prompts N`` (N >= 1), ``prompts.jsonl`` (``data.prompts`` records, preprocessed by
  ``python -m data.prompts``): the prompts of the first N SFT records whose prompt encodes to
  at most ``--max-prompt-tokens`` tokens, each with its record's response (the 4 real next
  lines) as the answer; DataError when fewer than N fit.

The last lines printed are ``SFT_PATH=``, ``PREF_PATH=``, ``PROMPTS_JSONL=`` (with --prompts)
and ``SPLIT=TRAIN,HELDOUT,0``.

Windows: every 10th line of a file starts one (lines 0, 10, 20, ...), a window is kept when its
10 lines are at most 600 characters, hold some text and (for pairs) reversing the 4 lines changes
them; SFT records take the windows at even positions, pairs the odd ones, so no training window
is in both. Deterministic for a given corpus. Raises DataError (one line) when the corpus or the
tokenizer is missing.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Iterator, Optional

from data.indexed_dataset import DataError, cli_exit

PROMPT_LINES, RESPONSE_LINES, STRIDE, MAX_CHARS = 6, 4, 10, 600


def windows(text: str) -> Iterator[tuple[str, list[str]]]:
    """(prompt, response lines) of each kept window of one file (module docstring)."""
    lines = text.splitlines(keepends=True)
    for start in range(0, len(lines) - PROMPT_LINES - RESPONSE_LINES + 1, STRIDE):
        prompt = "".join(lines[start : start + PROMPT_LINES])
        response = lines[start + PROMPT_LINES : start + PROMPT_LINES + RESPONSE_LINES]
        if len(prompt) + sum(map(len, response)) <= MAX_CHARS and "".join(response).strip() and prompt.strip():
            yield prompt, response


def _pair(prompt: str, response: list[str]) -> Optional[dict]:
    chosen, rejected = "".join(response), "".join(reversed(response))
    return None if chosen == rejected else {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _texts(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def prompt_records(sft: list[dict], model: str, count: int, max_tokens: int) -> list[dict]:
    """``data.prompts`` records ``{"prompt", "answer"}`` of the first ``count`` SFT records
    ``sft`` (``{"prompt", "response"}``) whose prompt encodes (sentencepiece ``model``) to at
    most ``max_tokens`` tokens, the response as the answer. Raises DataError naming
    ``--prompts`` / ``--max-prompt-tokens`` when ``count`` < 1, ``max_tokens`` < 1 or fewer fit."""
    from data.tokenizer import load_tokenizer

    if count < 1 or max_tokens < 1:
        raise DataError(
            f"--prompts {count} --max-prompt-tokens {max_tokens}: both must be at least 1; fix: e.g. --prompts 256 "
            "--max-prompt-tokens 224"
        )
    tok = load_tokenizer(model, "SentencePieceTokenizer")
    out = []
    for r in sft:
        if len(out) == count:
            break
        if len(tok.encode(r["prompt"])) <= max_tokens:
            out.append({"prompt": r["prompt"], "answer": r["response"]})
    if len(out) < count:
        raise DataError(
            f"--prompts {count}: only {len(out)} of {len(sft)} SFT windows have a prompt of at most "
            f"--max-prompt-tokens {max_tokens} tokens; fix: fewer --prompts, more --sft-records or a larger "
            "--max-prompt-tokens"
        )
    return out


def write_demo(
    data_dir: str, sft_records: int = 4000, pairs: int = 4000, prompts: int = 0, max_prompt_tokens: int = 224
) -> dict:
    """Write and preprocess the demo's SFT records and preference pairs, and with ``prompts``
    > 0 write ``prompts.jsonl`` (``prompt_records``; module docstring); returns {"sft", "pref",
    "prompts" (the JSONL's path, or None), "train_pairs", "heldout_pairs", "sft_records"}.
    Raises DataError."""
    from data.preference import preprocess_preference
    from data.sft import preprocess_sft

    corpus, model = os.path.join(data_dir, "corpus"), os.path.join(data_dir, "tokenizer.model")
    for path in (os.path.join(corpus, "train.jsonl"), os.path.join(corpus, "heldout.jsonl"), model):
        if not os.path.isfile(path):
            raise DataError(f"{path} not found; fix: python -m data.prepare --data-dir {data_dir} first")
    out = os.path.join(data_dir, "post_train")
    os.makedirs(out, exist_ok=True)
    sft, train_pairs, held = [], [], []
    for text in _texts(os.path.join(corpus, "train.jsonl")):
        for i, (prompt, response) in enumerate(windows(text)):
            if i % 2 == 0 and len(sft) < sft_records:
                sft.append({"prompt": prompt, "response": "".join(response)})
            elif i % 2 == 1 and len(train_pairs) < pairs and (p := _pair(prompt, response)):
                train_pairs.append(p)
        if len(sft) >= sft_records and len(train_pairs) >= pairs:
            break
    for text in _texts(os.path.join(corpus, "heldout.jsonl")):
        held += [p for prompt, response in windows(text) if (p := _pair(prompt, response))]
    if not train_pairs or not held:
        found = f"{len(train_pairs)} train, {len(held)} held-out pairs"
        raise DataError(f"{corpus}: too few windows for the demo ({found}); fix: a larger corpus")
    files = [("sft.jsonl", sft), ("pairs.jsonl", train_pairs + held)]
    if prompts:
        files.append(("prompts.jsonl", prompt_records(sft, model, prompts, max_prompt_tokens)))
    for name, rows in files:
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    preprocess_sft([os.path.join(out, "sft.jsonl")], model, os.path.join(out, "sft"))
    preprocess_preference([os.path.join(out, "pairs.jsonl")], model, os.path.join(out, "pref"))
    return dict(
        sft=os.path.join(out, "sft"),
        pref=os.path.join(out, "pref"),
        prompts=os.path.join(out, "prompts.jsonl") if prompts else None,
        sft_records=len(sft),
        train_pairs=len(train_pairs),
        heldout_pairs=len(held),
    )


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.post_train_demo", description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True, help="the folder python -m data.prepare wrote")
    p.add_argument("--sft-records", type=int, default=4000)
    p.add_argument("--pairs", type=int, default=4000, help="training pairs (the held-out files add theirs)")
    p.add_argument("--prompts", type=int, default=0, help="also write prompts.jsonl with this many RL prompts")
    p.add_argument("--max-prompt-tokens", type=int, default=224, help="the longest prompt kept (tokens)")
    args = p.parse_args(argv)
    r = write_demo(args.data_dir, args.sft_records, args.pairs, args.prompts, args.max_prompt_tokens)
    print(f"[post_train_demo] {r['sft_records']} SFT records, {r['train_pairs']} + {r['heldout_pairs']} pairs")
    print(f"SFT_PATH={r['sft']}\nPREF_PATH={r['pref']}")
    if r["prompts"]:
        print(f"PROMPTS_JSONL={r['prompts']}")
    print(f"SPLIT={r['train_pairs']},{r['heldout_pairs']},0")
    return 0


if __name__ == "__main__":
    cli_exit(main)
