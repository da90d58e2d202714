"""Data pipeline benchmark: preprocessing throughput and GPT index-building time.

    python scripts/bench_data.py [--workers 1 2] [--max-docs N] [--tokens 100000000]

1. Writes the stdlib corpus (data.corpus), trains a tokenizer on it (or uses
   --tokenizer-model), and tokenizes it with each --workers count: documents/s, tokens/s and
   tokens/s per worker. --max-docs takes only the first N documents (a quick run).
2. Writes a synthetic --tokens dataset (document lengths log-normal, mean ~1000 tokens;
   the .bin is a sparse file, so it costs no disk) and times building the document / sample /
   shuffle indices (--seq-length, default 2048; 1 and 3 epochs), the cache write and the cache load, and
   random sample reads.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.corpus import write_corpus  # noqa: E402
from data.gpt_dataset import GPTDataset  # noqa: E402
from data.indexed_dataset import IndexedDataset, write_index  # noqa: E402
from data.preprocess import preprocess  # noqa: E402
from data.tokenizer import train_tokenizer  # noqa: E402


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
        print(f"preprocess {mb:.1f} MB, {s['documents']} docs, {s['tokens']} tokens, workers={w}: "
              f"{sec:.2f} s, {s['documents'] / sec:.0f} docs/s, {s['tokens'] / sec:.0f} tokens/s, "
              f"{s['tokens'] / sec / w:.0f} tokens/s per worker")


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
    print(f"synthetic dataset: {ds.num_documents} documents, {ds.num_tokens} tokens "
          f"(written in {time.monotonic() - t:.2f} s)")
    for epochs in (1, 3):
        n = epochs * ds.num_tokens // seq_length - 1
        cache = os.path.join(tmp, f"cache{epochs}")
        for label, cache_dir in (("no cache", None), ("build + write cache", cache), ("cache hit", cache)):
            t = time.monotonic()
            g = GPTDataset(ds, (0, ds.num_documents), seq_length, n, seed=1234, cache_dir=cache_dir)
            print(f"indices for {epochs} epoch(s), {n} samples of {seq_length + 1} tokens, {label}: "
                  f"{time.monotonic() - t:.2f} s")
        idx = np.random.default_rng(0).integers(0, n, 2000)
        t = time.monotonic()
        for i in idx:
            g[int(i)]
        print(f"random sample reads: {len(idx) / (time.monotonic() - t):.0f} samples/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-docs", type=int, default=None, help="only the first N corpus documents")
    p.add_argument("--tokenizer-model", default=None, help="skip tokenizer training, use this model")
    p.add_argument("--tokens", type=int, default=100_000_000, help="synthetic dataset size")
    p.add_argument("--seq-length", type=int, default=2048, help="sample length for the index benchmark")
    p.add_argument("--skip-preprocess", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_preprocess:
            bench_preprocess(tmp, args.workers, args.max_docs, args.tokenizer_model)
        bench_indices(tmp, args.tokens, args.seq_length)


if __name__ == "__main__":
    main()
