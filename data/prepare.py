"""Prepare the default training data in one command: corpus -> tokenizer -> preprocess.

    python -m data.prepare --data-dir DIR [--vocab-size 8192] [--workers N]

Writes (each step skipped when its outputs exist, each output written atomically):

    DIR/corpus/train.jsonl, DIR/corpus/heldout.jsonl      data.corpus (Python stdlib sources)
    DIR/tokenizer.model, DIR/tokenizer.vocab              data.tokenizer (BPE, byte fallback)
    DIR/stdlib_text_document.{bin,idx}                    data.preprocess of train.jsonl
    DIR/stdlib_heldout_text_document.{bin,idx}            data.preprocess of heldout.jsonl

and ends with three machine-readable lines (the launcher parses them; the held-out value is
empty when no file was held out):

    HELDOUT_DATA_PATH=DIR/stdlib_heldout_text_document
    DATA_PATH=DIR/stdlib_text_document
    TOKENIZER_MODEL=DIR/tokenizer.model

An existing tokenizer whose vocabulary differs from ``--vocab-size`` is an error (its
datasets would not match); use another ``--data-dir`` or delete the old one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from data.corpus import write_corpus
from data.indexed_dataset import DataError, cli_exit, exists
from data.preprocess import preprocess
from data.tokenizer import load_tokenizer, train_tokenizer


def prepare(
    data_dir: str,
    vocab_size: int = 8192,
    workers: int = 2,
    root: str | None = None,
    heldout_per_10k: int = 100,
    log=print,
) -> dict:
    """Run the missing steps; returns {"data_path", "heldout_data_path", "tokenizer_model"}.

    root: source directory of the corpus (default: this Python's stdlib; tests pass a small
    package); heldout_per_10k: held-out share (see data.corpus). "heldout_data_path" is None
    when no file is held out (a tiny root). Raises DataError when an existing tokenizer has another vocabulary size.
    """
    corpus_dir = os.path.join(data_dir, "corpus")
    train_jsonl, heldout_jsonl = (os.path.join(corpus_dir, f"{k}.jsonl") for k in ("train", "heldout"))
    model = os.path.join(data_dir, "tokenizer.model")
    out = {
        "data_path": os.path.join(data_dir, "stdlib_text_document"),
        "heldout_data_path": os.path.join(data_dir, "stdlib_heldout_text_document"),
        "tokenizer_model": model,
    }
    t0 = time.monotonic()
    if not (os.path.isfile(train_jsonl) and os.path.isfile(heldout_jsonl)):
        c = write_corpus(corpus_dir, root, heldout_per_10k)
        log(
            f"[prepare] corpus: {c['train']} train + {c['heldout']} held-out files, "
            f"{c['bytes'] / 1e6:.1f} MB ({time.monotonic() - t0:.1f} s)"
        )
    if not os.path.isfile(model):
        train_tokenizer(train_jsonl, vocab_size, os.path.join(data_dir, "tokenizer"), num_threads=workers)
        log(f"[prepare] tokenizer trained ({time.monotonic() - t0:.1f} s)")
    tok = load_tokenizer(model)
    if tok.vocab_size != vocab_size:
        raise DataError(
            f"{model}: vocabulary {tok.vocab_size} != --vocab-size {vocab_size}; use "
            f"another --data-dir or delete {data_dir} to rebuild"
        )
    for jsonl, key in ((train_jsonl, "data_path"), (heldout_jsonl, "heldout_data_path")):
        if key == "heldout_data_path" and os.path.getsize(jsonl) == 0:
            out[key] = None
        elif not exists(out[key]):
            prefix = out[key][: -len("_text_document")]
            s = preprocess(jsonl, ["text"], model, prefix, append_eod=True, workers=workers, progress=False)
            log(
                f"[prepare] {out[key]}: {s['documents']} documents, {s['tokens']} tokens "
                f"({s['tokens'] / max(s['seconds'], 1e-9):.0f} tokens/s, {time.monotonic() - t0:.1f} s)"
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--workers", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    p.add_argument("--root", default=None, help="corpus source directory (default: the stdlib)")
    p.add_argument("--heldout-per-10k", type=int, default=100, help="held-out share in 1/10000")
    args = p.parse_args(argv)
    # progress on stderr, the KEY=VALUE results on stdout (the launcher captures them)
    out = prepare(
        args.data_dir,
        args.vocab_size,
        args.workers,
        args.root,
        args.heldout_per_10k,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(f"HELDOUT_DATA_PATH={out['heldout_data_path'] or ''}")
    print(f"DATA_PATH={out['data_path']}")
    print(f"TOKENIZER_MODEL={out['tokenizer_model']}")
    return 0


if __name__ == "__main__":
    cli_exit(main)
