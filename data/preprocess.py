"""Tokenize a corpus (JSONL, JSONL.gz/.zst, parquet, a ``datasets`` folder) into ``.bin``/``.idx``
datasets, in parallel worker processes.

    python -m data.preprocess --input X.jsonl [Y.jsonl.gz 'shards/*.parquet' HF_DIR ...] \\
        --json-keys text --tokenizer-model M \\
        [--tokenizer-type {SentencePieceTokenizer,HuggingFaceTokenizer}] \\
        --output-prefix P --append-eod --workers N [--skip-bad-lines] [--chunk-rows 1024]
    python -m data.preprocess --merge P1 P2 ... --output-prefix P

``--input`` takes files, globs (expanded sorted) and Hugging Face ``save_to_disk`` folders,
read in the order given as one stream of documents (data.sources: the formats, and for
parquet and ``datasets`` the ``--json-keys`` columns). For each JSON key K the output is
``P_K_document.bin/.idx`` (Megatron's naming), one sequence per document: its tokens, plus
the tokenizer's EOD id with ``--append-eod``. Documents are tokenized by a
``multiprocessing.Pool`` (``imap``, ordered, in chunks) and written in input order, so the
output depends neither on ``--workers`` nor on the input format. About two ``--chunk-rows``
of documents are in memory at once (one read, one being tokenized), whatever the corpus
size. Blank lines are
ignored; documents whose text is empty are skipped and counted; a line that is not JSON or
lacks a key, or a row whose value is null, is an error naming file and line or row (or, with
``--skip-bad-lines``, skipped and counted). Every input is checked (it opens, its columns
exist) before any output is written. A progress bar (bytes of the input files) goes to
stderr; the summary (documents/s, tokens/s) to stdout. Outputs appear only when complete
(temporary names, then rename); on any error nothing is left behind.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

import numpy as np

from data.indexed_dataset import (
    DataError,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    check_same_tokenizer,
    cli_exit,
    exists,
    read_tokenizer_record,
    tokenizer_record_path,
    write_tokenizer_record,
)
from data.sources import resolve_inputs
from data.tokenizer import TOKENIZER_TYPES, load_tokenizer

_worker: dict = {}


def _init_worker(
    model_path: str, keys: list[str], append_eod: bool, tokenizer_type: str = "SentencePieceTokenizer"
) -> None:
    # The parent owns clean-up: a worker that the pool terminates (SIGTERM) dies quietly, and
    # Ctrl-C reaches only the parent, which then terminates the pool.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tok = load_tokenizer(model_path, tokenizer_type)
    _worker.update(tok=tok, keys=keys, eod=tok.eod if append_eod else None, dtype=best_dtype(tok.vocab_size))


def _encode(item):
    """(position, payload, nbytes) -> (position, {key: token array} | None (blank line) | error, nbytes).

    The payload is a JSON line (str) or the row's values in key order (tuple, from a column source)."""
    position, payload, nbytes = item
    keys = _worker["keys"]
    if isinstance(payload, str):
        if not payload.strip():
            return position, None, nbytes
        try:
            obj = json.loads(payload)
            texts = [obj[k] for k in keys]
        except json.JSONDecodeError as e:
            return position, f"not valid JSON ({e.msg})", nbytes
        except (KeyError, TypeError):
            return position, f"needs string field(s) {keys}", nbytes
    else:
        texts = payload
    if not all(isinstance(t, str) for t in texts):
        return position, f"needs string field(s) {keys}", nbytes
    out = {}
    for k, text in zip(keys, texts):
        ids = _worker["tok"].encode(text) if text else []
        if ids and _worker["eod"] is not None:
            ids.append(_worker["eod"])
        out[k] = np.asarray(ids, dtype=_worker["dtype"])
    return position, out, nbytes


class _Window:
    """Keeps at most ``size`` documents between the reader and the writer: the pool's feeder
    thread drains its input as fast as the workers take it, and results wait for the writer,
    so without it both would hold as much of the corpus as they get ahead by. A reader error
    is kept and raised by the writer after the documents before it (input order)."""

    def __init__(self, size: int):
        self._slots = threading.Semaphore(size)
        self.stopped = False
        self.error: BaseException | None = None

    def feed(self, items):
        try:
            for item in items:
                while not self._slots.acquire(timeout=0.1):
                    if self.stopped:
                        return
                if self.stopped:
                    return
                yield item
        except Exception as e:  # raised in the pool's feeder thread: hand it to the writer
            self.error = e

    def release(self) -> None:
        self._slots.release()


def _items(sources, keys, chunk_rows):
    """((source index, position), payload, nbytes) for every document of every source, in order."""
    for i, src in enumerate(sources):
        for position, payload, nbytes in src.items(keys, chunk_rows):
            yield (i, position), payload, nbytes


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
        sys.stderr.write(
            f"\r[{bar}] {100 * frac:5.1f}% {docs} docs {tokens} tokens "
            f"{docs / dt:.0f} docs/s {tokens / dt:.0f} tok/s" + ("\n" if final else "")
        )
        sys.stderr.flush()


def preprocess(
    inputs,
    keys: list[str],
    model_path: str,
    output_prefix: str,
    append_eod: bool = True,
    workers: int = 1,
    skip_bad_lines: bool = False,
    progress: bool = True,
    chunksize: int = 16,
    tokenizer_type: str = "SentencePieceTokenizer",
    chunk_rows: int = 1024,
) -> dict:
    """Tokenize ``inputs`` (a path or glob, or a list of them: JSONL, JSONL.gz, JSONL.zst,
    parquet, a ``datasets`` folder; see data.sources) into ``{output_prefix}_{key}_document``
    for each key, with the sentencepiece model or Hugging Face ``tokenizer.json``
    ``model_path`` (``tokenizer_type``). Documents keep the input order; at most about
    ``chunk_rows`` documents are held at once (plus one reader batch of as many rows).

    Returns stats: documents, tokens, empty (skipped empty texts), bad_lines (skipped lines or
    rows), seconds, files (number of sources) and prefixes {key: prefix}. Raises DataError
    (file:line or file: row N, and the fix) on bad input; no output file survives an error.
    """
    if chunk_rows < 1:
        raise DataError(f"--chunk-rows {chunk_rows}: must be at least 1")
    sources = resolve_inputs(inputs, keys)  # every input checked before any output exists
    label = inputs if isinstance(inputs, (str, os.PathLike)) else " ".join(map(os.fspath, inputs))
    tok = load_tokenizer(model_path, tokenizer_type)
    dtype = best_dtype(tok.vocab_size)
    prefixes = {k: f"{output_prefix}_{k}_document" for k in keys}
    stats = {"documents": 0, "tokens": 0, "empty": 0, "bad_lines": 0, "prefixes": prefixes, "files": len(sources)}
    bar = Progress(sum(s.size for s in sources), progress)
    start = time.monotonic()
    builders = [IndexedDatasetBuilder(p, dtype) for p in prefixes.values()]
    pool, window = None, _Window(max(chunk_rows, 2 * chunksize * workers))
    try:
        init = (model_path, keys, append_eod, tokenizer_type)
        items = _items(sources, keys, chunk_rows)
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
            results = pool.imap(_encode, window.feed(items), chunksize)
        else:
            _init_worker(*init)
            results = map(_encode, items)
        done = 0
        for (i, position), out, nbytes in results:
            window.release()
            done += nbytes
            _consume(sources[i], position, out, builders, keys, stats, skip_bad_lines)
            bar.update(done, stats["documents"], stats["tokens"])
        if window.error is not None:
            raise window.error
        if stats["documents"] == 0:
            raise DataError(f"{label}: no non-empty documents under key(s) {keys}")
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
        window.stopped = True
        if pool is not None:
            pool.terminate()
            pool.join()
    bar.update(done, stats["documents"], stats["tokens"], final=True)
    stats["seconds"] = time.monotonic() - start
    return stats


def _consume(source, position, out, builders, keys, stats, skip_bad_lines) -> None:
    if out is None:
        return
    if isinstance(out, str):
        if not skip_bad_lines:
            raise DataError(f"{source.where(position)}: {out}; fix the {source.unit} or pass --skip-bad-lines")
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
            raise DataError(f"{p}.idx / {p}.bin: dataset not found (--merge takes prefixes without .bin/.idx)")
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
    p.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="JSONL (.jsonl, .jsonl.gz, .jsonl.zst: "
        "one document per line), .parquet files, globs of them, or a Hugging Face "
        "datasets folder (save_to_disk); read in this order",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="fields (JSONL) or string columns (parquet, datasets) to tokenize",
    )
    p.add_argument(
        "--tokenizer-model",
        help="sentencepiece .model (see data.tokenizer), or with "
        "--tokenizer-type HuggingFaceTokenizer a tokenizer.json or a folder holding one",
    )
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD id")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--skip-bad-lines", action="store_true", help="skip (and count) malformed lines")
    p.add_argument("--merge", nargs="+", metavar="PREFIX", help="merge these datasets instead")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--chunk-rows",
        type=int,
        default=1024,
        help="documents read and held at once (memory is bounded by about two such chunks)",
    )
    args = p.parse_args(argv)
    if args.merge:
        s = merge(args.merge, args.output_prefix)
        print(
            f"merged {len(args.merge)} datasets into {args.output_prefix}: "
            f"{s['documents']} documents, {s['tokens']} tokens"
        )
        return 0
    if not args.input or not args.tokenizer_model:
        raise DataError("--input and --tokenizer-model are required unless --merge is given")
    if args.workers < 1:
        raise DataError(f"--workers {args.workers}: must be at least 1")
    s = preprocess(
        args.input,
        args.json_keys,
        args.tokenizer_model,
        args.output_prefix,
        args.append_eod,
        args.workers,
        args.skip_bad_lines,
        not args.no_progress,
        tokenizer_type=args.tokenizer_type,
        chunk_rows=args.chunk_rows,
    )
    secs = max(s["seconds"], 1e-9)
    files = f" ({s['files']} files)" if s["files"] > 1 else ""
    print(
        f"{' '.join(args.input)}{files}: {s['documents']} documents, {s['tokens']} tokens in {secs:.1f} s "
        f"({s['documents'] / secs:.0f} documents/s, {s['tokens'] / secs:.0f} tokens/s, "
        f"{s['tokens'] / secs / args.workers:.0f} tokens/s per worker); skipped "
        f"{s['empty']} empty documents and {s['bad_lines']} bad lines/rows -> " + ", ".join(s["prefixes"].values())
    )
    return 0


if __name__ == "__main__":
    cli_exit(main)
