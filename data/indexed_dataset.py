"""Memory-mapped token storage: a ``.bin``/``.idx`` pair in Megatron-LM's MMapIndexedDataset layout.

A dataset ``PREFIX`` is two files. ``PREFIX.bin`` holds the token ids of every sequence back
to back (no header), in one integer dtype. ``PREFIX.idx`` describes them, little-endian:

    offset  size          field
    0       9             magic b"MMIDIDX\\x00\\x00"
    9       8  uint64     version, always 1
    17      1  uint8      dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                          6 float64, 7 float32, 8 uint16)
    18      8  uint64     S = number of sequences
    26      8  uint64     D = number of document-index entries (documents + 1)
    34      4*S int32     sequence lengths, in tokens
    ..      8*S int64     sequence pointers, byte offset of each sequence in .bin
    ..      8*D int64     document index: document d is sequences [doc[d], doc[d+1]),
                          doc[0] = 0 and doc[-1] = S

This is the layout read and written by Megatron-LM (``megatron/core/datasets/
indexed_dataset.py``, "MMIDIDX" version 1), so files are interchangeable with it. Our
preprocessing writes one sequence per document (the document's tokens plus its EOD).

Files are written under a temporary name and renamed when complete (``.bin`` first, then the
``.idx`` that makes the pair visible), so a crash never leaves a pair that looks valid.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import sys

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class DataError(ValueError):
    """Bad input to the data pipeline: the message names the file (and line) and the fix."""


def cli_exit(main):
    """Run ``main(argv) -> int`` as a CLI: a DataError becomes one line on stderr and exit code 2.

    SIGTERM (``timeout``, a scheduler's kill) is turned into KeyboardInterrupt, so the
    writers' clean-up removes their temporary files as on Ctrl-C (exit code 143).
    """

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        code = main(sys.argv[1:])
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        code = 130
    except OSError as e:  # an output directory that cannot be created, a full disk, ...
        print(f"error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        code = 2
    sys.exit(code)


def tmp_name(path: str) -> str:
    """A temporary sibling of ``path`` unique to this process (renamed onto ``path`` when complete)."""
    return f"{path}.tmp.{os.getpid()}"


def best_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (vocab_size < 65500, Megatron's threshold), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def write_index(path: str, dtype, sizes, doc_idx) -> None:
    """Write an ``.idx`` file at ``path`` (directly; callers pass a temporary name).

    sizes: tokens per sequence [S]; doc_idx: document boundaries [D] (starts at 0, ends at S).
    """
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.astype("<i8").tobytes())


class IndexedDatasetBuilder:
    """Writes ``PREFIX.bin``/``PREFIX.idx``; nothing appears under the final names until ``finalize``.

    Use as a context manager: leaving the block by an exception removes the temporary files.
    ``add_document(tokens)`` appends one document (one sequence); ``merge(prefix)`` appends all
    documents of an existing dataset. Raises DataError when a token id does not fit ``dtype``.
    """

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise DataError(f"{prefix}: dtype {self.dtype} has no MMIDIDX code")
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._bin_tmp = tmp_name(prefix + ".bin")
        self._idx_tmp = tmp_name(prefix + ".idx")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._file = open(self._bin_tmp, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_document(self, tokens) -> None:
        """Append one document's token ids (1-D, already including its EOD if wanted)."""
        arr = np.asarray(tokens)
        if arr.size and self._info is not None and (arr.min() < self._info.min or arr.max() > self._info.max):
            bad = int(arr.max() if arr.max() > self._info.max else arr.min())
            raise DataError(
                f"{self.prefix}.bin: token id {bad} does not fit dtype {self.dtype} "
                f"(range {self._info.min}..{self._info.max}); use a wider dtype (int32)"
            )
        self._file.write(arr.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(int(arr.size))
        self._doc_idx.append(len(self._sizes))

    def merge(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at ``prefix`` (same dtype required)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"{prefix}.idx: dtype {other.dtype} differs from {self.dtype} of the "
                f"other inputs; merge only datasets tokenized with the same tokenizer"
            )
        offset = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((other.doc_idx[1:] + offset).tolist())
        with open(prefix + ".bin", "rb") as f:
            shutil.copyfileobj(f, self._file, 1 << 24)

    def finalize(self) -> None:
        """Write the index and move both files to their final names (``.bin`` first)."""
        self._file.close()
        write_index(self._idx_tmp, self.dtype, self._sizes, self._doc_idx)
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(self._idx_tmp, self.prefix + ".idx")

    def abort(self) -> None:
        """Close and delete the temporary files."""
        self._file.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False


def _read_header(idx_path: str) -> tuple[np.dtype, int, int]:
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != MAGIC:
        raise DataError(
            f"{idx_path}: not an MMIDIDX index (bad magic or truncated header); re-run data.preprocess to rebuild it"
        )
    version, code = struct.unpack_from("<QB", head, 9)
    n_seq, n_doc = struct.unpack_from("<QQ", head, 18)
    if version != VERSION or code not in DTYPE_CODES:
        raise DataError(f"{idx_path}: unsupported version {version} or dtype code {code}")
    return np.dtype(DTYPE_CODES[code]), n_seq, n_doc


class IndexedDataset:
    """Read-only view of ``PREFIX.bin``/``PREFIX.idx`` (both memory-mapped).

    ``ds[i]`` is sequence i as a 1-D array of ``ds.dtype`` (a view, no copy); ``ds.get(i, offset,
    length)`` a slice of it. ``sizes`` [S] int32, ``pointers`` [S] int64 (bytes), ``doc_idx`` [D]
    int64. Raises DataError naming both files when either is missing, truncated or they disagree.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise DataError(
                    f"{p}: file not found; a dataset prefix needs both {idx_path} and "
                    f"{bin_path} (run data.preprocess or data.prepare)"
                )
        self.dtype, n_seq, n_doc = _read_header(idx_path)
        expected = HEADER_BYTES + 12 * n_seq + 8 * n_doc
        actual = os.path.getsize(idx_path)
        if actual != expected:
            raise DataError(
                f"{idx_path}: {actual} bytes but its header ({n_seq} sequences, {n_doc} "
                f"document entries) implies {expected}; the index is truncated or corrupt, "
                f"rebuild {idx_path} and {bin_path} with data.preprocess"
            )
        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = HEADER_BYTES
        self.sizes = np.frombuffer(self._idx_map, dtype="<i4", count=n_seq, offset=off)
        self.pointers = np.frombuffer(self._idx_map, dtype="<i8", count=n_seq, offset=off + 4 * n_seq)
        self.doc_idx = np.frombuffer(self._idx_map, dtype="<i8", count=n_doc, offset=off + 12 * n_seq)
        self._check(idx_path, bin_path)
        nbytes = os.path.getsize(bin_path)
        self._bin_map = np.memmap(bin_path, mode="r", dtype=self.dtype) if nbytes else np.zeros(0, dtype=self.dtype)

    def _check(self, idx_path: str, bin_path: str) -> None:
        item = self.dtype.itemsize
        n = len(self.sizes)
        implied = int(self.pointers[-1]) + int(self.sizes[-1]) * item if n else 0
        actual = os.path.getsize(bin_path)
        if actual != implied:
            raise DataError(
                f"{bin_path} has {actual} bytes but {idx_path} implies {implied} "
                f"({n} sequences of {self.dtype}); the pair does not match or is truncated, "
                f"rebuild both with data.preprocess"
            )
        if n and (
            self.sizes.min() < 0
            or self.pointers[0] != 0
            or np.any(np.diff(self.pointers) != self.sizes[:-1].astype(np.int64) * item)
        ):
            raise DataError(
                f"{idx_path}: sequence pointers do not follow the lengths; rebuild {idx_path} and {bin_path}"
            )
        d = self.doc_idx
        if len(d) == 0 or d[0] != 0 or d[-1] != n or np.any(np.diff(d) < 0):
            raise DataError(f"{idx_path}: document index must rise from 0 to {n}; rebuild {idx_path} and {bin_path}")

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the .bin, sequences back to back (memory-mapped) [num_tokens]."""
        return self._bin_map

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``i`` (to its end when length is None)."""
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return self._bin_map[start : start + length]


def exists(prefix: str) -> bool:
    """True when both ``PREFIX.idx`` and ``PREFIX.bin`` exist."""
    return os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")


# -- the tokenizer record beside a dataset ---------------------------------------------------
# Megatron's .idx does not say which tokenizer made the ids, so data tokenized with one model
# and trained with another (same vocabulary size) would train silently on the wrong text.
# data.preprocess writes PREFIX.tokenizer.json beside the pair: {"sha256": of the .model file,
# "vocab_size", "eod", "model": the path it was read from}. Other tools ignore the extra file;
# a pair without one (made by Megatron, say) is accepted without this check.
def tokenizer_record_path(prefix: str) -> str:
    return prefix + ".tokenizer.json"


def write_tokenizer_record(prefix: str, record: dict) -> None:
    """Write ``record`` as ``PREFIX.tokenizer.json`` (temporary name, then rename)."""
    path = tokenizer_record_path(prefix)
    tmp = tmp_name(path)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_tokenizer_record(prefix: str) -> dict | None:
    """The record of ``prefix`` or None when it has none; DataError when it is unreadable."""
    path = tokenizer_record_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        sha, vocab = record["sha256"], record["vocab_size"]
        if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise ValueError(f"sha256 {sha!r} is not 64 hex digits")
        if not (isinstance(vocab, int) and vocab > 0):
            raise ValueError(f"vocab_size {vocab!r} is not a positive integer")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{path}: unreadable tokenizer record ({e}); delete it (the check is then "
            f"skipped) or re-run data.preprocess"
        ) from None
    return record


def check_same_tokenizer(prefixes: list[str], sha256: str | None = None, what: str = "") -> dict | None:
    """Raise DataError when two of ``prefixes`` (or one and ``sha256``, the digest of the model
    named by ``what``) were tokenized with different models; returns the first record found."""
    first = None
    for p in prefixes:
        r = read_tokenizer_record(p)
        if r is None:
            continue
        if sha256 is not None and r["sha256"] != sha256:
            raise DataError(
                f"{p} was tokenized with {r.get('model', 'another model')} (sha256 "
                f"{r['sha256'][:12]}), not {what} (sha256 {sha256[:12]}); fix: pass the "
                f"tokenizer the data was made with, or re-run data.preprocess with this one"
            )
        if first is not None and r["sha256"] != first[1]["sha256"]:
            raise DataError(
                f"{first[0]} and {p} were tokenized with different models (sha256 "
                f"{first[1]['sha256'][:12]} and {r['sha256'][:12]}); fix: re-tokenize one "
                f"of them with the other's tokenizer"
            )
        first = first or (p, r)
    return first[1] if first else None
