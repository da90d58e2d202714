"""Post-training data derived from the embedded corpus, for the SFT -> DPO walk-through of
docs/post-training.md (``bash scripts/post_train_demo.sh``).

    python -m data.post_train_demo --data-dir DIR [--sft-records 4000] [--pairs 4000]

Reads ``DIR/corpus/train.jsonl`` and ``DIR/corpus/heldout.jsonl`` (``python -m data.prepare``)
and the tokenizer ``DIR/tokenizer.model``, and writes under ``DIR/post_train/``:

- ``sft.jsonl`` -> ``sft`` (``data.sft``): prompt = 6 consecutive lines of a training file,
  response = the 4 lines after them;
- ``pairs.jsonl`` -> ``pref`` (``data.preference``): the same kind of window, chosen = the 4 real
  next lines, rejected = those 4 lines in reverse order (a corrupted copy: the same tokens, the
  wrong order); first ``--pairs`` pairs from training files, then the pairs of the held-out files
  (every window of theirs), so ``--split TRAIN,HELDOUT,0`` makes the held-out files the
  validation pairs. The last line printed is ``SPLIT=TRAIN,HELDOUT,0``.

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


def write_demo(data_dir: str, sft_records: int = 4000, pairs: int = 4000) -> dict:
    """Write and preprocess the demo's SFT records and preference pairs (module docstring);
    returns {"sft", "pref", "train_pairs", "heldout_pairs", "sft_records"}."""
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
    for name, rows in (("sft.jsonl", sft), ("pairs.jsonl", train_pairs + held)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    preprocess_sft([os.path.join(out, "sft.jsonl")], model, os.path.join(out, "sft"))
    preprocess_preference([os.path.join(out, "pairs.jsonl")], model, os.path.join(out, "pref"))
    return dict(
        sft=os.path.join(out, "sft"),
        pref=os.path.join(out, "pref"),
        sft_records=len(sft),
        train_pairs=len(train_pairs),
        heldout_pairs=len(held),
    )


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.post_train_demo", description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True, help="the folder python -m data.prepare wrote")
    p.add_argument("--sft-records", type=int, default=4000)
    p.add_argument("--pairs", type=int, default=4000, help="training pairs (the held-out files add theirs)")
    args = p.parse_args(argv)
    r = write_demo(args.data_dir, args.sft_records, args.pairs)
    print(f"[post_train_demo] {r['sft_records']} SFT records, {r['train_pairs']} + {r['heldout_pairs']} pairs")
    print(f"SFT_PATH={r['sft']}\nPREF_PATH={r['pref']}\nSPLIT={r['train_pairs']},{r['heldout_pairs']},0")
    return 0


if __name__ == "__main__":
    cli_exit(main)
