"""Rebuild the data of the shipped lm-evaluation-harness tasks from the embedded corpus's
held-out split (``data/corpus.py``: the standard library files with ``is_heldout(path)``).

    python -m data.tasks.megazero_stdlib.build      # (repository root) rewrites mc.jsonl and ppl.jsonl here

``mc.jsonl`` (task ``megazero_stdlib``, multiple choice): from each held-out file (sorted by
path), up to ``ITEMS_PER_FILE`` target lines drawn with a ``random.Random`` seeded by the
file's path; a target line is a line after the first four whose stripped text has 12 to 100
characters. The context is the up to ``CONTEXT_LINES`` lines before it, cut from the front to
at most ``CONTEXT_CHARS`` characters (whole lines). The choices are the true line and three
lines drawn from the candidate lines of the *other* held-out files, each given the true
line's leading whitespace (so indentation gives nothing away), in a shuffled order;
``label`` is the true line's index. Every choice ends with the file's line ending.

``ppl.jsonl`` (task ``megazero_stdlib_ppl``, rolling log-likelihood): each held-out file's
first whole lines up to ``PPL_CHARS`` characters.

The held-out split depends on the path alone; the texts on the running Python's standard
library (CPython 3.11.7 wrote the committed files: ``python`` in each row's ``source``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random

from data.corpus import is_heldout, read_documents, stdlib_root

HERE = os.path.dirname(os.path.abspath(__file__))

ITEMS_PER_FILE, CONTEXT_LINES, CONTEXT_CHARS, PPL_CHARS, DISTRACTORS = 10, 10, 480, 2000, 3


def _seed(path: str) -> int:
    return int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:8], "big")


def _candidates(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if i >= 4 and 12 <= len(line.strip()) <= 100]


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def _ending(line: str) -> str:
    return line[len(line.rstrip("\r\n")) :]


def build(root: str | None = None) -> tuple[list[dict], list[dict]]:
    """(multiple-choice rows, perplexity rows) from the held-out files under ``root`` (default:
    this Python's standard library), as the module docstring defines them."""
    docs = [(p, t) for p, t in read_documents(root or stdlib_root()) if is_heldout(p)]
    source = f"python {platform.python_version()} stdlib, held-out split"
    lines = {p: t.splitlines(keepends=True) for p, t in docs}
    pool = {p: [lines[p][i].strip() for i in _candidates(lines[p])] for p, _ in docs}
    mc, ppl = [], []
    for path, text in docs:
        rng = random.Random(_seed(path))
        file_lines = lines[path]
        cands = _candidates(file_lines)
        others = [s for q in sorted(pool) if q != path for s in pool[q]]
        for i in sorted(rng.sample(cands, min(ITEMS_PER_FILE, len(cands)))):
            context = file_lines[max(0, i - CONTEXT_LINES) : i]
            while len(context) > 1 and sum(map(len, context)) > CONTEXT_CHARS:
                context = context[1:]
            true = file_lines[i]
            end = _ending(true) or "\n"
            wrong = []
            while len(wrong) < DISTRACTORS:
                s = rng.choice(others)
                line = _indent(true) + s + end
                if s != true.strip() and line not in wrong:
                    wrong.append(line)
            choices = [true] + wrong
            rng.shuffle(choices)
            mc.append(
                {
                    "path": path,
                    "line": i + 1,
                    "context": "".join(context),
                    "choices": choices,
                    "label": choices.index(true),
                    "source": source,
                }
            )
        head, size = [], 0
        for line in file_lines:
            if size + len(line) > PPL_CHARS and head:
                break
            head.append(line)
            size += len(line)
        ppl.append({"path": path, "text": "".join(head), "source": source})
    return mc, ppl


def write(rows: list[dict], path: str) -> None:
    """``rows`` as JSON lines at ``path`` (temporary name, then rename)."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    mc_rows, ppl_rows = build()
    write(mc_rows, os.path.join(HERE, "mc.jsonl"))
    write(ppl_rows, os.path.join(HERE, "ppl.jsonl"))
    print(f"wrote {len(mc_rows)} multiple-choice items and {len(ppl_rows)} perplexity documents to {HERE}")
