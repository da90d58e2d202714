"""The inputs of ``data.preprocess``: files, globs and folders read as a stream of documents.

``resolve_inputs(["a.jsonl", "shards/*.parquet", "hf_dir"])`` turns each ``--input`` argument
into one or more sources, in the order given; a glob expands to its matches sorted by path
(a glob that matches nothing is an error). A source is chosen by its name:

    name                      source       a document is                     position
    *.gz                      JsonlSource  one JSON line (gzip)              line (from 1)
    *.zst, *.zstd             JsonlSource  one JSON line (Zstandard)         line (from 1)
    *.parquet                 ArrowSource  one row; ``--json-keys`` columns  row (from 0)
    a directory               ArrowSource  one row of a Hugging Face         row (from 0)
                                           ``Dataset.save_to_disk`` folder
    anything else             JsonlSource  one JSON line                     line (from 1)

Streaming: a JSONL source reads one line at a time; a parquet file is decoded ``chunk_rows``
rows at a time (``ParquetFile.iter_batches``), its column chunks read page by page through a
1 MiB buffer (not a row group at once), and a ``datasets`` folder is read one Arrow record
batch at a time (``save_to_disk`` writes batches of 1,000 rows), each cut into ``chunk_rows``
rows. So memory is bounded by a chunk plus one parquet page or Arrow batch (properties of how
the file was written), not by the corpus. A ``datasets`` folder is read with pyarrow
alone: its ``state.json`` lists the Arrow stream files in order (``datasets`` itself is needed
only to make such a folder). Row numbers count from 0 across a folder's files, as ``ds[i]``.

``check(keys)`` validates a source before any output exists (the file opens, every key is a
string column); ``items(keys, chunk_rows)`` yields ``(position, payload, nbytes)``: the payload
is the JSON line (a str) or the row's values in key order (a tuple), ``nbytes`` this document's
share of the bytes on disk (the progress bar's unit). Every problem raises DataError naming
the file, the line or row, and the fix. The packages pyarrow and zstandard are the optional
extra ``data`` (pyproject.toml); a missing one raises the one line of megazero's form
(``megazero.runtime.extras.missing_extra_message``, which data/ may not import).
"""

from __future__ import annotations

import glob
import gzip
import importlib
import io
import json
import os
import zlib

from data.indexed_dataset import DataError

GLOB_CHARS = set("*?[")
ARROW_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # the IPC stream's last 8 bytes (continuation, length 0)


def require_data_extra(module: str, what: str):
    """``import module`` (pyarrow, zstandard) for ``what``; DataError with the install line if missing."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and (e.name or top).split(".")[0] == top
        reason = "is not installed" if missing else "cannot be imported: " + " ".join(str(e).split())
        raise DataError(
            f"{what} needs the optional extra data ({module} {reason}); fix: pip install -e .[data]"
        ) from None


class JsonlSource:
    """One JSON document per line, plain, gzip (``.gz``) or Zstandard (``.zst``) compressed."""

    unit = "line"

    def __init__(self, path: str):
        self.path = path
        low = path.lower()
        self.codec = "gzip" if low.endswith(".gz") else "zstd" if low.endswith((".zst", ".zstd")) else None

    @property
    def size(self) -> int:
        return os.path.getsize(self.path)

    def where(self, position: int) -> str:
        return f"{self.path}:{position}"

    def check(self, keys) -> None:
        if not os.path.isfile(self.path):
            raise DataError(f"{self.path}: input file not found (--input)")
        if self.codec == "zstd":
            require_data_extra("zstandard", f"--input {self.path}")

    def _open(self, raw):
        if self.codec == "gzip":
            return gzip.GzipFile(fileobj=raw, mode="rb")
        if self.codec == "zstd":
            zstd = require_data_extra("zstandard", f"--input {self.path}")
            return io.BufferedReader(_ZstdFrames(zstd, raw), 1 << 16)
        return raw

    def _corrupt_errors(self) -> tuple:
        errors = (EOFError, zlib.error, gzip.BadGzipFile)
        if self.codec == "zstd":
            errors += (require_data_extra("zstandard", f"--input {self.path}").ZstdError,)
        return errors

    def items(self, keys, chunk_rows: int):
        lineno, done = 0, 0
        with open(self.path, "rb") as raw:
            stream = self._open(raw)
            lines = iter(stream)
            while True:
                try:
                    line = next(lines, None)
                except self._corrupt_errors() as e:
                    raise DataError(
                        f"{self.path}:{lineno + 1}: corrupt or truncated {self.codec} data "
                        f"({_one_line(e)}) after {lineno} complete lines; re-create or "
                        "re-download the file"
                    ) from None
                if line is None:
                    break
                lineno += 1
                pos = raw.tell() if self.codec else done + len(line)
                nbytes, done = pos - done, pos
                try:
                    yield lineno, line.decode("utf-8"), nbytes
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{self.path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} "
                        f"of the line); re-encode the file as UTF-8"
                    ) from None


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a Zstandard file of one or more frames, as a raw stream.

    zstandard's ``stream_reader`` ends quietly at a truncated frame (it returns what it has,
    often nothing); this reader raises EOFError there instead, so a cut file is never taken for
    a shorter corpus."""

    def __init__(self, zstd, raw):
        self._zstd, self._raw = zstd, raw
        self._dobj, self._in_frame = None, False
        self._pending, self._offset = b"", 0  # decompressed bytes not yet returned: _pending[_offset:]

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self._offset == len(self._pending):
            data = self._raw.read(1 << 16)
            if not data:
                if self._in_frame:
                    raise EOFError("the file ends inside a Zstandard frame")
                return 0
            out = []
            while data:
                if self._dobj is None:
                    self._dobj, self._in_frame = self._zstd.ZstdDecompressor().decompressobj(), True
                out.append(self._dobj.decompress(data))
                data = b""
                if self._dobj.eof:  # a frame ended; what follows starts the next one
                    data, self._dobj, self._in_frame = self._dobj.unused_data, None, False
            self._pending, self._offset = b"".join(out), 0
        n = min(len(buf), len(self._pending) - self._offset)
        buf[:n] = memoryview(self._pending)[self._offset : self._offset + n]
        self._offset += n
        return n


class ArrowSource:
    """Rows of a parquet file, or of a Hugging Face ``datasets`` folder (its Arrow stream files).

    ``keys`` name string columns; a row whose value is null is a bad row (``--skip-bad-lines``).
    """

    unit = "row"

    def __init__(self, path: str):
        self.path = path
        self.folder = os.path.isdir(path)

    def where(self, position: int) -> str:
        return f"{self.path}: row {position}"

    def _pa(self):
        return require_data_extra("pyarrow", f"--input {self.path}")

    def _files(self) -> list[str]:
        """The files holding the rows, in row order."""
        if not self.folder:
            return [self.path]
        if os.path.isfile(os.path.join(self.path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(self.path) if os.path.isdir(os.path.join(self.path, d)))
            raise DataError(
                f"{self.path}: a DatasetDict folder (splits {', '.join(splits)}); pass one "
                f"split's folder, e.g. --input {os.path.join(self.path, splits[0] if splits else 'train')}"
            )
        state = os.path.join(self.path, "state.json")
        if not os.path.isfile(state):
            raise DataError(
                f"{self.path}: a directory without state.json, so not a Hugging Face "
                "datasets folder (Dataset.save_to_disk); pass files or a glob, e.g. "
                f"--input '{os.path.join(self.path, '*.parquet')}'"
            )
        try:
            with open(state, encoding="utf-8") as f:
                meta = json.load(f)
            names = [d["filename"] for d in meta["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{state}: not a datasets state file ({type(e).__name__}: {e}); re-save "
                "the dataset with Dataset.save_to_disk"
            ) from None
        if meta.get("_indices_data_files"):
            raise DataError(
                f"{state}: the dataset was saved with an indices mapping; save ds.flatten_indices() instead"
            )
        files = [os.path.join(self.path, n) for n in names]
        for f in files:
            if not os.path.isfile(f):
                raise DataError(f"{f}: listed in {state} but not found; re-save the dataset")
        return files

    @property
    def size(self) -> int:
        return sum(os.path.getsize(f) for f in self._files())

    def _schema(self, file: str):
        pa = self._pa()
        try:
            if self.folder:
                with open(file, "rb") as f:  # a stream cut at a message boundary reads as shorter
                    f.seek(max(os.path.getsize(file) - 8, 0))
                    if f.read() != ARROW_EOS:
                        raise DataError(
                            f"{file}: truncated (no Arrow end-of-stream marker); re-save "
                            "the dataset with Dataset.save_to_disk"
                        )
                with pa.OSFile(file) as f:
                    return pa.ipc.open_stream(f).schema
            import pyarrow.parquet as pq

            return pq.read_schema(file)
        except (pa.ArrowException, OSError) as e:
            kind = "Arrow stream (datasets)" if self.folder else "parquet"
            raise DataError(
                f"{file}: not a readable {kind} file ({_one_line(e)}); re-create or re-download it"
            ) from None

    def check(self, keys) -> None:
        if not os.path.exists(self.path):
            raise DataError(f"{self.path}: input file not found (--input)")
        pa = self._pa()
        for file in self._files():
            schema = self._schema(file)
            for k in keys:
                if k not in schema.names:
                    raise DataError(
                        f"{file}: no column {k!r} (--json-keys {' '.join(keys)}); its columns: "
                        f"{', '.join(schema.names)}"
                    )
                t = schema.field(k).type
                if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
                    raise DataError(f"{file}: column {k!r} has type {t}, not string (--json-keys)")

    def _batches(self, file: str, keys, chunk_rows: int):
        """Record batches of at most ``chunk_rows`` rows of ``keys``, each with its bytes read."""
        pa = self._pa()
        if self.folder:
            with pa.OSFile(file) as f:
                done = 0
                for batch in pa.ipc.open_stream(f):
                    pieces = [batch.slice(i, chunk_rows) for i in range(0, batch.num_rows, chunk_rows)]
                    nbytes, done = f.tell() - done, f.tell()
                    for j, piece in enumerate(pieces):
                        yield piece.select(keys), nbytes if j == 0 else 0
            return
        import pyarrow.parquet as pq

        # buffer_size without pre_buffer: a column chunk is read through a 1 MiB buffer, page by
        # page, instead of whole (pyarrow's default reads a row group's columns at once)
        with pq.ParquetFile(file, buffer_size=1 << 20, pre_buffer=False) as pf:
            total, rows, done, seen = os.path.getsize(file), max(pf.metadata.num_rows, 1), 0, 0
            for batch in pf.iter_batches(batch_size=chunk_rows, columns=list(keys)):
                seen += batch.num_rows
                pos = total * seen // rows
                nbytes, done = pos - done, pos
                yield batch, nbytes

    def items(self, keys, chunk_rows: int):
        pa = self._pa()
        row = 0
        for file in self._files():
            batches = self._batches(file, keys, chunk_rows)
            while True:
                try:
                    got = next(batches, None)
                    if got is None:
                        break
                    batch, nbytes = got
                    columns = [batch.column(k).to_pylist() for k in keys]
                except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
                    raise DataError(
                        f"{file}: rows from {row} unreadable ({_one_line(e)}); re-create or re-download it"
                    ) from None
                for i, values in enumerate(zip(*columns)):
                    yield row, values, nbytes if i == 0 else 0
                    row += 1


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def open_source(path: str):
    """The source reading ``path`` (see the module docstring's table)."""
    if os.path.isdir(path) or path.lower().endswith(".parquet"):
        return ArrowSource(path)
    return JsonlSource(path)


def resolve_inputs(inputs, keys) -> list:
    """The sources of the ``--input`` arguments ``inputs`` (paths or globs), in order, checked.

    Raises DataError for a glob that matches nothing, a missing file, a file that does not
    open, a missing or non-string column, or a missing optional package."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    sources = []
    for arg in map(os.fspath, inputs):
        if GLOB_CHARS & set(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise DataError(f"--input '{arg}': no file matches this glob")
            sources.extend(open_source(m) for m in matches)
        else:
            sources.append(open_source(arg))
    for s in sources:
        s.check(keys)
    return sources
