"""A verifiable task for the RL demo: one-line Python programs and what they print.

    python -m data.print_tasks --output PROMPTS.jsonl --count N [--seed S] \\
        [--sft-output SFT.jsonl --sft-count M --noise P]

Each program applies one operation to a random literal: reverse a word (``'abc'[::-1]``), sort
its letters (``''.join(sorted('cab'))``), upper-case it (``'abc'.upper()``), or sum a few small
integers (``sum([3, 4, 5])``). A record of ``--output`` is ``{"prompt": "print(...)\\n# prints:
", "answer": TEXT}`` (``data.prompts``'s form; ``exact`` reward): the answer is computed by the
same operation on the literal in this process, never by running the program. ``--sft-output``
writes ``data.sft`` records ``{"prompt": ..., "response": " TEXT"}`` for other programs of the
same kinds, a share ``--noise`` of them with a wrong answer (a neighbouring word's, or the sum
off by one), so a model fine-tuned on them answers below what RL can reach. The same ``--seed``
gives the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Optional

from data.indexed_dataset import DataError, cli_exit

LETTERS = "abcdefgh"
KINDS = ("reverse", "sort", "upper", "sum")


def program(kind: str, rng: random.Random) -> tuple[str, str]:
    """(the one-line program, what it prints) of ``kind`` (one of KINDS) on a random literal.
    Raises ValueError for another kind."""
    if kind == "sum":
        xs = [rng.randint(0, 9) for _ in range(rng.randint(2, 3))]
        return f"print(sum({xs}))", str(sum(xs))
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
    if kind == "reverse":
        return f"print('{word}'[::-1])", word[::-1]
    if kind == "sort":
        return f"print(''.join(sorted('{word}')))", "".join(sorted(word))
    if kind == "upper":
        return f"print('{word}'.upper())", word.upper()
    raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


def prompt_of(code: str) -> str:
    """The prompt text of a program: the line, then ``# prints:`` for the model to complete."""
    return f"{code}\n# prints:"


def wrong(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: a number off by one, or the text with two letters swapped (or
    reversed when they are equal)."""
    if answer.isdigit():
        return str(int(answer) + rng.choice((-1, 1)) if answer != "0" else 1)
    i = rng.randrange(len(answer) - 1)
    out = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
    return out if out != answer else answer[::-1] + answer[0]


def records(count: int, seed: int) -> list[dict]:
    """``count`` prompt records (module docstring), kinds in turn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        code, answer = program(KINDS[i % len(KINDS)], rng)
        out.append({"prompt": prompt_of(code), "answer": answer})
    return out


def sft_records(count: int, seed: int, noise: float) -> list[dict]:
    """``count`` SFT records of other programs (another random stream), a share ``noise`` of
    them with ``wrong`` answers."""
    rng = random.Random(seed + 1_000_003)
    out = []
    for i in range(count):
        code, answer = program(KINDS[i % len(KINDS)], rng)
        if rng.random() < noise:
            answer = wrong(answer, rng)
        out.append({"prompt": prompt_of(code), "response": f" {answer}"})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.print_tasks", description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="the prompts (data.prompts records), JSONL")
    p.add_argument("--count", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-output", default=None, help="also SFT records (data.sft), JSONL")
    p.add_argument("--sft-count", type=int, default=2048)
    p.add_argument("--noise", type=float, default=0.3, help="share of SFT records with a wrong answer")
    args = p.parse_args(argv)
    if args.count < 1 or args.sft_count < 1:
        raise DataError("--count and --sft-count must be at least 1")
    if not 0.0 <= args.noise <= 1.0:
        raise DataError(f"--noise {args.noise}: a share, in [0, 1]")
    files = [(args.output, records(args.count, args.seed))]
    if args.sft_output:
        files.append((args.sft_output, sft_records(args.sft_count, args.seed, args.noise)))
    for path, recs in files:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        os.replace(tmp, path)
        print(f"{len(recs)} records -> {path}")
    return 0


if __name__ == "__main__":
    cli_exit(main)
