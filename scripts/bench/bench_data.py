"""Data pipeline benchmark: preprocessing throughput and GPT index-building time.

    python -m scripts.bench.bench_data [--workers 1 2] [--max-docs N] [--tokens 100000000]
    python -m scripts.bench.bench_data --memory [--chunk-rows 256] [--doc-bytes 4096] [--workers 1] [--scales 1 20]

1. Writes the stdlib corpus (data.corpus), trains a tokenizer on it (or uses
   --tokenizer-model), and tokenizes it with each --workers count: documents/s, tokens/s and
   tokens/s per worker. --max-docs takes only the first N documents (a quick run).
2. With --memory: peak memory of preprocessing a corpus as large as one --chunk-rows chunk (1x)
   and ones 20 times larger (20x) or more (--scales), in each input format (JSONL.gz, JSONL.zst, parquet in two
   shards, a datasets folder; pyarrow, zstandard and datasets needed). Each run is a fresh
   process that prints its own peak RSS (VmHWM; with --workers > 1 the parent's, which holds
   the reader, the in-flight documents and the writer), so the two sizes compare side by side. Documents are
   --doc-bytes of stdlib source each. Then the index benchmark below is skipped unless
   --tokens is given.
3. Writes a synthetic --tokens dataset (document lengths log-normal, mean ~1000 tokens;
   the .bin is a sparse file, so it costs no disk) and times building the document / sample /
   shuffle indices (--seq-length, default 2048; 1 and 3 epochs), the cache write and the cache load, and
   random sample reads.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from data.corpus import list_files, stdlib_root, write_corpus
from data.gpt_dataset import GPTDataset
from data.indexed_dataset import IndexedDataset, write_index
from data.preprocess import preprocess
from data.tokenizer import train_tokenizer


def bench_preprocess(tmp: str, workers: list[int], max_docs: int | None, model: str | None) -> None:
    write_corpus(tmp)
    src = os.path.join(tmp, "train.jsonl")
    if max_docs:
        with open(src, encoding="utf-8") as f:
            lines = [line for _, line in zip(range(max_docs), f)]
        src = os.path.join(tmp, "subset.jsonl")
        with open(src, "w", encoding="utf-8") as f:
            f.writelines(lines)
    mb = os.path.getsize(src) / 1e6
    if model is None:
        t = time.monotonic()
        model = train_tokenizer(src, 8192, os.path.join(tmp, "tok"))
        print(f"tokenizer training (vocab 8192, {mb:.1f} MB input): {time.monotonic() - t:.1f} s")
    for w in workers:
        s = preprocess(src, ["text"], model, os.path.join(tmp, f"w{w}"), True, w, progress=False)
        sec = s["seconds"]
        print(
            f"preprocess {mb:.1f} MB, {s['documents']} docs, {s['tokens']} tokens, workers={w}: "
            f"{sec:.2f} s, {s['documents'] / sec:.0f} docs/s, {s['tokens'] / sec:.0f} tokens/s, "
            f"{s['tokens'] / sec / w:.0f} tokens/s per worker"
        )


def _memory_corpus(n_docs: int, doc_bytes: int) -> list[str]:
    """``n_docs`` texts of ``doc_bytes`` characters cut from the stdlib sources, cycling."""
    root, docs, buf = stdlib_root(), [], ""
    files = list_files(root)
    while len(docs) < n_docs:
        for rel in files:
            try:
                buf += open(os.path.join(root, rel), encoding="utf-8").read()
            except UnicodeDecodeError:
                continue
            while len(buf) >= doc_bytes and len(docs) < n_docs:
                docs.append(buf[:doc_bytes])
                buf = buf[doc_bytes:]
            if len(docs) == n_docs:
                break
    return docs


def _write_format(fmt: str, docs: list[str], base: str) -> list[str]:
    """Write ``docs`` in ``fmt`` under ``base``; returns the --input arguments."""
    lines = "".join(json.dumps({"text": t}) + "\n" for t in docs).encode("utf-8")
    if fmt == "jsonl.gz":
        with open(base + ".jsonl.gz", "wb") as f:
            f.write(gzip.compress(lines, 6))
        return [base + ".jsonl.gz"]
    if fmt == "jsonl.zst":
        import zstandard

        with open(base + ".jsonl.zst", "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(lines))
        return [base + ".jsonl.zst"]
    import pyarrow as pa

    table = pa.table({"text": docs})
    if fmt == "parquet":
        import pyarrow.parquet as pq

        half = len(docs) // 2
        pq.write_table(table.slice(0, half), base + "-0.parquet")
        pq.write_table(table.slice(half), base + "-1.parquet")
        return [base + "-*.parquet"]
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset(table).save_to_disk(base + "_hf", num_shards=2)
    return [base + "_hf"]


def bench_memory(tmp: str, model: str | None, chunk_rows: int, doc_bytes: int, workers: int, scales: list[int]) -> None:
    docs = _memory_corpus(max(scales) * chunk_rows, doc_bytes)
    if model is None:
        with open(os.path.join(tmp, "tok.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in docs[:chunk_rows])
        model = train_tokenizer(os.path.join(tmp, "tok.jsonl"), 1024, os.path.join(tmp, "memtok"))
    for fmt in ("jsonl.gz", "jsonl.zst", "parquet", "datasets"):
        parts = []
        for k in scales:
            n = k * chunk_rows
            inputs = _write_format(fmt, docs[:n], os.path.join(tmp, f"mem{fmt}{n}"))
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    __spec__.name,
                    "--_measure",
                    model,
                    os.path.join(tmp, f"memout{n}"),
                    str(chunk_rows),
                    str(workers),
                    *inputs,
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            parts.append((k, n, r["rss_mb"], r["tokens"]))
        print(
            f"peak RSS preprocessing {fmt} (--chunk-rows {chunk_rows}, {doc_bytes}-byte docs, workers={workers}): "
            + "; ".join(
                f"{k}x ({n} docs, {n * doc_bytes / 1e6:.1f} MB text, {t} tokens) {rss:.1f} MB" for k, n, rss, t in parts
            )
            + f"; {parts[-1][0]}x - {parts[0][0]}x = {parts[-1][2] - parts[0][2]:+.1f} MB"
        )


def _peak_rss_mb() -> float:
    """This process's peak resident set size, MB: VmHWM (Linux; ru_maxrss would include the
    parent's pages from before exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)


def _measure(model: str, prefix: str, chunk_rows: str, workers: str, *inputs: str) -> None:
    """One preprocessing run in this process; prints its peak RSS (MB) as a JSON line."""
    s = preprocess(
        list(inputs), ["text"], model, prefix, True, int(workers), progress=False, chunk_rows=int(chunk_rows)
    )
    print(json.dumps({"rss_mb": _peak_rss_mb(), "tokens": s["tokens"]}))


def synthetic_dataset(prefix: str, tokens: int, seed: int = 0) -> IndexedDataset:
    rng = np.random.default_rng(seed)
    sizes = np.maximum(1, rng.lognormal(6.5, 1.0, int(tokens / 1000 * 1.2))).astype(np.int64)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), tokens) + 1]
    write_index(prefix + ".idx", np.uint16, sizes.astype(np.int32), np.arange(len(sizes) + 1))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(sizes.sum()) * 2)  # sparse: reads as zeros, no disk used
    return IndexedDataset(prefix)


def bench_indices(tmp: str, tokens: int, seq_length: int = 2048) -> None:
    t = time.monotonic()
    ds = synthetic_dataset(os.path.join(tmp, "synthetic"), tokens)
    print(
        f"synthetic dataset: {ds.num_documents} documents, {ds.num_tokens} tokens "
        f"(written in {time.monotonic() - t:.2f} s)"
    )
    for epochs in (1, 3):
        n = epochs * ds.num_tokens // seq_length - 1
        cache = os.path.join(tmp, f"cache{epochs}")
        for label, cache_dir in (("no cache", None), ("build + write cache", cache), ("cache hit", cache)):
            t = time.monotonic()
            g = GPTDataset(ds, (0, ds.num_documents), seq_length, n, seed=1234, cache_dir=cache_dir)
            print(
                f"indices for {epochs} epoch(s), {n} samples of {seq_length + 1} tokens, {label}: "
                f"{time.monotonic() - t:.2f} s"
            )
        idx = np.random.default_rng(0).integers(0, n, 2000)
        t = time.monotonic()
        for i in idx:
            g[int(i)]
        print(f"random sample reads: {len(idx) / (time.monotonic() - t):.0f} samples/s")


def main() -> None:
    if sys.argv[1:2] == ["--_measure"]:
        return _measure(*sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-docs", type=int, default=None, help="only the first N corpus documents")
    p.add_argument("--tokenizer-model", default=None, help="skip tokenizer training, use this model")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="synthetic dataset size (default 100M; with --memory no index benchmark unless given)",
    )
    p.add_argument("--memory", action="store_true", help="peak RSS for a 1x and a 20x chunk corpus")
    p.add_argument("--chunk-rows", type=int, default=256, help="--memory: preprocess's --chunk-rows")
    p.add_argument("--doc-bytes", type=int, default=4096, help="--memory: characters per document")
    p.add_argument("--scales", type=int, nargs="+", default=[1, 20], help="--memory: corpus sizes in chunks")
    p.add_argument("--seq-length", type=int, default=2048, help="sample length for the index benchmark")
    p.add_argument("--skip-preprocess", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.memory:
            bench_memory(
                tmp, args.tokenizer_model, args.chunk_rows, args.doc_bytes, args.workers[0], sorted(args.scales)
            )
            if args.tokens is None:
                return
        elif not args.skip_preprocess:
            bench_preprocess(tmp, args.workers, args.max_docs, args.tokenizer_model)
        bench_indices(tmp, args.tokens or 100_000_000, args.seq_length)


if __name__ == "__main__":
    main()
