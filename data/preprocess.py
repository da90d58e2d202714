"""Tokenize a JSONL corpus into ``.bin``/``.idx`` datasets, in parallel worker processes.

    python -m data.preprocess --input X.jsonl --json-keys text --tokenizer-model M \\
        [--tokenizer-type {SentencePieceTokenizer,HuggingFaceTokenizer}] \\
        --output-prefix P --append-eod --workers N [--skip-bad-lines]
    python -m data.preprocess --merge P1 P2 ... --output-prefix P

For each JSON key K the output is ``P_K_document.bin/.idx`` (Megatron's naming), one sequence
per document: its tokens, plus the tokenizer's EOD id with ``--append-eod``. Lines are
tokenized by a ``multiprocessing.Pool`` (``imap``, ordered, in chunks) and written in input
order, so the output does not depend on ``--workers``. Blank lines are ignored; documents
whose text is empty are skipped and counted; a line that is not JSON or lacks a key is an
error naming file and line (or, with ``--skip-bad-lines``, skipped and counted). A progress
bar goes to stderr; the summary (documents/s, tokens/s) to stdout. Outputs appear only
when complete (temporary names, then rename); on any error nothing is left behind.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np

from data.indexed_dataset import (DataError, IndexedDataset, IndexedDatasetBuilder, best_dtype,
                                  check_same_tokenizer, cli_exit, exists, read_tokenizer_record,
                                  tokenizer_record_path, write_tokenizer_record)
from data.tokenizer import TOKENIZER_TYPES, load_tokenizer

_worker: dict = {}


def _init_worker(model_path: str, keys: list[str], append_eod: bool,
                 tokenizer_type: str = "SentencePieceTokenizer") -> None:
    # The parent owns clean-up: a worker that the pool terminates (SIGTERM) dies quietly, and
    # Ctrl-C reaches only the parent, which then terminates the pool.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tok = load_tokenizer(model_path, tokenizer_type)
    _worker.update(tok=tok, keys=keys, eod=tok.eod if append_eod else None,
                   dtype=best_dtype(tok.vocab_size))


def _encode_line(item: tuple[int, str]):
    """(lineno, line) -> (lineno, {key: token array} or None for a blank line, or an error string)."""
    lineno, line = item
    nbytes = len(line.encode("utf-8"))  # progress is measured in bytes of the file
    if not line.strip():
        return lineno, None, nbytes
    try:
        obj = json.loads(line)
        texts = [obj[k] for k in _worker["keys"]]
        if not all(isinstance(t, str) for t in texts):
            raise TypeError
    except json.JSONDecodeError as e:
        return lineno, f"not valid JSON ({e.msg})", nbytes
    except (KeyError, TypeError):
        return lineno, f"needs string field(s) {_worker['keys']}", nbytes
    out = {}
    for k, text in zip(_worker["keys"], texts):
        ids = _worker["tok"].encode(text) if text else []
        if ids and _worker["eod"] is not None:
            ids.append(_worker["eod"])
        out[k] = np.asarray(ids, dtype=_worker["dtype"])
    return lineno, out, nbytes


def _lines(path: str):
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of "
                                f"the line); re-encode the file as UTF-8") from None


class Progress:
    """A one-line progress bar on stderr (redrawn at most 4 times a second)."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.total, self.enabled = max(total_bytes, 1), enabled
        self.start = self.last = time.monotonic()
        self.drawn = False

    def close(self) -> None:
        """End the bar's line (so an error message starts on a line of its own)."""
        if self.drawn:
            sys.stderr.write("\n")
            self.drawn = False

    def update(self, done_bytes: int, docs: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.25 and not final):
            return
        self.last, self.drawn = now, not final
        frac = min(done_bytes / self.total, 1.0)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        dt = max(now - self.start, 1e-9)
        sys.stderr.write(f"\r[{bar}] {100 * frac:5.1f}% {docs} docs {tokens} tokens "
                         f"{docs / dt:.0f} docs/s {tokens / dt:.0f} tok/s" + ("\n" if final else ""))
        sys.stderr.flush()


def preprocess(input_path: str, keys: list[str], model_path: str, output_prefix: str,
               append_eod: bool = True, workers: int = 1, skip_bad_lines: bool = False,
               progress: bool = True, chunksize: int = 16,
               tokenizer_type: str = "SentencePieceTokenizer") -> dict:
    """Tokenize ``input_path`` into ``{output_prefix}_{key}_document`` for each key, with the
    sentencepiece model or Hugging Face ``tokenizer.json`` ``model_path`` (``tokenizer_type``).

    Returns stats: documents, tokens, empty (skipped empty texts), bad_lines (skipped),
    seconds, and prefixes {key: prefix}. Raises DataError (file:line and fix) on bad input;
    no output file survives an error.
    """
    if not os.path.isfile(input_path):
        raise DataError(f"{input_path}: input file not found (--input)")
    tok = load_tokenizer(model_path, tokenizer_type)
    dtype = best_dtype(tok.vocab_size)
    prefixes = {k: f"{output_prefix}_{k}_document" for k in keys}
    stats = {"documents": 0, "tokens": 0, "empty": 0, "bad_lines": 0, "prefixes": prefixes}
    bar = Progress(os.path.getsize(input_path), progress)
    start = time.monotonic()
    builders = [IndexedDatasetBuilder(p, dtype) for p in prefixes.values()]
    pool = None
    try:
        init = (model_path, keys, append_eod, tokenizer_type)
        if workers > 1:
            # Workers fork with default SIGTERM / ignored SIGINT, so no handler of the parent's
            # (cli_exit turns SIGTERM into KeyboardInterrupt) runs in a child before its initializer.
            term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
            intr = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                pool = mp.get_context("fork").Pool(workers, _init_worker, init)
            finally:
                signal.signal(signal.SIGTERM, term)
                signal.signal(signal.SIGINT, intr)
            results = pool.imap(_encode_line, _lines(input_path), chunksize)
        else:
            _init_worker(*init)
            results = map(_encode_line, _lines(input_path))
        done = 0
        for lineno, out, nbytes in results:
            done += nbytes
            _consume(input_path, lineno, out, builders, keys, stats, skip_bad_lines)
            bar.update(done, stats["documents"], stats["tokens"])
        if stats["documents"] == 0:
            raise DataError(f"{input_path}: no non-empty documents under key(s) {keys}")
        for b in builders:
            b.finalize()
        for prefix in prefixes.values():
            write_tokenizer_record(prefix, tok.record())
    except BaseException:
        bar.close()
        for b in builders:
            b.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    bar.update(done, stats["documents"], stats["tokens"], final=True)
    stats["seconds"] = time.monotonic() - start
    return stats


def _consume(path, lineno, out, builders, keys, stats, skip_bad_lines) -> None:
    if out is None:
        return
    if isinstance(out, str):
        if not skip_bad_lines:
            raise DataError(f"{path}:{lineno}: {out}; fix the line or pass --skip-bad-lines")
        stats["bad_lines"] += 1
        return
    if all(out[k].size == 0 for k in keys):
        stats["empty"] += 1
        return
    for b, k in zip(builders, keys):
        b.add_document(out[k])
        stats["tokens"] += int(out[k].size)
    stats["documents"] += 1


def merge(prefixes: list[str], output_prefix: str) -> dict:
    """Concatenate datasets (same dtype) into ``output_prefix``; returns documents and tokens.

    Raises DataError when two inputs' tokenizer records (``PREFIX.tokenizer.json``) name
    different models; the output gets the record when every input has it."""
    for p in prefixes:
        if not exists(p):
            raise DataError(f"{p}.idx / {p}.bin: dataset not found (--merge takes prefixes without "
                            f".bin/.idx)")
    record = check_same_tokenizer(prefixes)  # before any output exists
    first = IndexedDataset(prefixes[0])
    with IndexedDatasetBuilder(output_prefix, first.dtype) as b:
        for p in prefixes:
            b.merge(p)
        b.finalize()
    if record is not None and all(read_tokenizer_record(p) for p in prefixes):
        write_tokenizer_record(output_prefix, record)
    elif os.path.exists(tokenizer_record_path(output_prefix)):  # a stale record of an older output
        os.remove(tokenizer_record_path(output_prefix))
    out = IndexedDataset(output_prefix)
    return {"documents": out.num_documents, "tokens": out.num_tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.preprocess", description=__doc__.split("\n")[0])
    p.add_argument("--input", help="JSONL file, one document per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize")
    p.add_argument("--tokenizer-model", help="sentencepiece .model (see data.tokenizer), or with "
                   "--tokenizer-type HuggingFaceTokenizer a tokenizer.json or a folder holding one")
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD id")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--skip-bad-lines", action="store_true", help="skip (and count) malformed lines")
    p.add_argument("--merge", nargs="+", metavar="PREFIX", help="merge these datasets instead")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.merge:
        s = merge(args.merge, args.output_prefix)
        print(f"merged {len(args.merge)} datasets into {args.output_prefix}: "
              f"{s['documents']} documents, {s['tokens']} tokens")
        return 0
    if not args.input or not args.tokenizer_model:
        raise DataError("--input and --tokenizer-model are required unless --merge is given")
    if args.workers < 1:
        raise DataError(f"--workers {args.workers}: must be at least 1")
    s = preprocess(args.input, args.json_keys, args.tokenizer_model, args.output_prefix,
                   args.append_eod, args.workers, args.skip_bad_lines, not args.no_progress,
                   tokenizer_type=args.tokenizer_type)
    secs = max(s["seconds"], 1e-9)
    print(f"{args.input}: {s['documents']} documents, {s['tokens']} tokens in {secs:.1f} s "
          f"({s['documents'] / secs:.0f} documents/s, {s['tokens'] / secs:.0f} tokens/s, "
          f"{s['tokens'] / secs / args.workers:.0f} tokens/s per worker); skipped "
          f"{s['empty']} empty documents and {s['bad_lines']} bad lines -> "
          + ", ".join(s["prefixes"].values()))
    return 0


if __name__ == "__main__":
    cli_exit(main)
