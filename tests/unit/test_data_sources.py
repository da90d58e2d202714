"""data.preprocess over every input format: one corpus as JSONL, JSONL.gz, JSONL.zst, two parquet
shards (a glob), a Hugging Face ``datasets`` folder and a mix of files gives byte-identical
``.bin/.idx``; bad shards, columns and globs exit 2 with one line and leave nothing behind."""

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from data.corpus import stdlib_root
from data.indexed_dataset import DataError, IndexedDataset
from data.preprocess import main, preprocess
from data.tokenizer import load_tokenizer, train_tokenizer
from tests.support.extras import require
from tests.support.paths import REPO

ROOT = str(REPO)
N_DOCS = 300


def _documents():
    """300 texts cut from a stdlib module at varying lengths, with non-ASCII text, CRLF and tabs."""
    src = open(os.path.join(stdlib_root(), "textwrap.py"), encoding="utf-8", newline="").read()
    extras = ["Ünïcödé ☃ 日本語 😀", "tabs\tand\r\nCRLF", "a literal ▁ and <|eod|>", "x"]
    docs, pos = [], 0
    for i in range(N_DOCS):
        n = 20 + (i * 37) % 400
        docs.append(src[pos : pos + n] + extras[i % len(extras)] * (i % 3))
        pos = (pos + n) % (len(src) - 500)
    docs[17] = ""  # an empty document: skipped and counted in every format
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """{name: --input arguments} for the same documents in every format, the documents, the model."""
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    zstd, datasets = require("zstandard"), require("datasets")
    d = tmp_path_factory.mktemp("corpus")
    docs = _documents()
    lines = "".join(
        json.dumps({"id": i, "text": t}, ensure_ascii=bool(i % 2)) + "\n" for i, t in enumerate(docs)
    ).encode("utf-8")
    (d / "all.jsonl").write_bytes(lines)
    (d / "all.jsonl.gz").write_bytes(gzip.compress(lines))
    half = lines.index(b"\n", len(lines) // 3) + 1  # two frames, cut mid-line (as zstd -c a b > c)
    (d / "all.jsonl.zst").write_bytes(
        zstd.ZstdCompressor().compress(lines[: half + 7]) + zstd.ZstdCompressor().compress(lines[half + 7 :])
    )
    table = pa.table({"id": list(range(N_DOCS)), "text": docs})
    os.makedirs(d / "pq")
    pq.write_table(table.slice(0, 140), d / "pq" / "shard-00000.parquet", row_group_size=32)
    pq.write_table(table.slice(140), d / "pq" / "shard-00001.parquet", row_group_size=64)
    datasets.Dataset.from_dict({"text": docs, "id": list(range(N_DOCS))}).save_to_disk(str(d / "hf"), num_shards=2)
    (d / "head.jsonl.gz").write_bytes(gzip.compress(b"".join(lines.splitlines(True)[:100])))
    pq.write_table(table.slice(100), d / "tail.parquet")
    model = train_tokenizer(str(d / "all.jsonl"), 400, str(d / "tok"), num_threads=1)
    inputs = {
        "jsonl": [d / "all.jsonl"],
        "jsonl.gz": [d / "all.jsonl.gz"],
        "jsonl.zst": [d / "all.jsonl.zst"],
        "parquet shards (glob)": [d / "pq" / "shard-*.parquet"],
        "datasets folder": [d / "hf"],
        "jsonl.gz + parquet": [d / "head.jsonl.gz", d / "tail.parquet"],
    }
    return {k: [str(p) for p in v] for k, v in inputs.items()}, docs, model


def _sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_every_format_gives_the_same_bytes(corpus, tmp_path):
    inputs, docs, model = corpus
    tok = load_tokenizer(model)
    digests = {}
    for i, (name, args) in enumerate(inputs.items()):
        workers = 2 if name.startswith("parquet") else 1  # the pool and its bounded window too
        prefix = str(tmp_path / f"o{i}")
        s = preprocess(args, ["text"], model, prefix, append_eod=True, workers=workers, progress=False, chunk_rows=50)
        assert (s["documents"], s["empty"], s["bad_lines"]) == (N_DOCS - 1, 1, 0), name
        out = prefix + "_text_document"
        digests[name] = (_sha256(out + ".bin"), _sha256(out + ".idx"))
    assert len(set(digests.values())) == 1, digests
    ds = IndexedDataset(out)  # and the bytes are the right ones: each document's ids + EOD
    want = [tok.encode(t) + [tok.eod] for t in docs if t]
    assert ds.num_documents == len(want) and ds.num_tokens == sum(map(len, want))
    for j, ids in enumerate(want):
        assert ds[j].tolist() == ids


def _listing(d):
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


def _bad_inputs(d, corpus):
    """name: (--input arguments, --json-keys, substrings of the one-line message)."""
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    datasets = require("datasets")
    inputs, docs, _ = corpus
    gz = open(inputs["jsonl.gz"][0], "rb").read()
    (d / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    zs = open(inputs["jsonl.zst"][0], "rb").read()
    (d / "bad.jsonl.zst").write_bytes(zs[:40] + bytes(64) + zs[104:])
    (d / "cut.jsonl.zst").write_bytes(zs[:-5])  # zstandard's own stream_reader ends quietly here
    (d / "junk.parquet").write_bytes(b"PAR1 this is not parquet at all")
    pq.write_table(pa.table({"content": ["a", "b"]}), d / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), d / "ints.parquet")
    pq.write_table(pa.table({"text": ["def f(): pass", "x = 1", None]}), d / "null.parquet")
    datasets.Dataset.from_dict({"body": ["a"]}).save_to_disk(str(d / "hf_nocol"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(d / "hf_dict"))
    os.makedirs(d / "plain_dir")
    shutil.copytree(inputs["datasets folder"][0], d / "hf_cut")
    arrow = d / "hf_cut" / "data-00001-of-00002.arrow"
    arrow.write_bytes(arrow.read_bytes()[:-8])  # cut at a message boundary: would read as shorter
    pq.write_table(pa.table({"text": docs[:200]}), d / "mid.parquet", row_group_size=50, use_dictionary=False)
    raw = bytearray((d / "mid.parquet").read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)  # a damaged page: the footer still reads
    (d / "mid.parquet").write_bytes(bytes(raw))
    return {
        "glob matching nothing": (
            [f"{d}/none/*.parquet"],
            ["text"],
            [f"--input '{d}/none/*.parquet': no file matches"],
        ),
        "missing column": (
            [inputs["jsonl"][0], str(d / "nocol.parquet")],
            ["text"],
            ["nocol.parquet: no column 'text' (--json-keys text); its columns: content"],
        ),
        "column not string": ([str(d / "ints.parquet")], ["text"], ["ints.parquet: column 'text' has type int64"]),
        "corrupt parquet": ([str(d / "junk.parquet")], ["text"], ["junk.parquet: not a readable parquet file"]),
        "null row": (
            [str(d / "null.parquet")],
            ["text"],
            ["null.parquet: row 2: needs string field(s) ['text']", "--skip-bad-lines"],
        ),
        "truncated gzip after a good shard": (
            inputs["jsonl.zst"] + [str(d / "cut.jsonl.gz")],
            ["text"],
            ["cut.jsonl.gz:", "corrupt or truncated gzip data"],
        ),
        "corrupt zstd": ([str(d / "bad.jsonl.zst")], ["text"], ["bad.jsonl.zst:1: corrupt or truncated zstd data"]),
        "truncated zstd": ([str(d / "cut.jsonl.zst")], ["text"], ["cut.jsonl.zst:", "ends inside a Zstandard frame"]),
        "datasets folder missing column": (
            [str(d / "hf_nocol")],
            ["text"],
            ["data-00000-of-00001.arrow: no column 'text'", "its columns: body"],
        ),
        "DatasetDict folder": (
            [str(d / "hf_dict")],
            ["text"],
            ["hf_dict: a DatasetDict folder (splits train)", f"--input {d}/hf_dict/train"],
        ),
        "datasets shard cut short": (
            [str(d / "hf_cut")],
            ["text"],
            ["data-00001-of-00002.arrow: truncated (no Arrow end-of-stream marker)"],
        ),
        "damaged parquet page": ([str(d / "mid.parquet")], ["text"], ["mid.parquet: rows from ", "unreadable"]),
        "plain directory": ([str(d / "plain_dir")], ["text"], ["plain_dir: a directory without state.json"]),
    }


def test_bad_inputs_name_the_file_and_leave_nothing(corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    cases = _bad_inputs(d, corpus)
    model = corpus[2]
    for name, (args, keys, needles) in cases.items():
        before = _listing(d)
        argv = [
            "--input",
            *args,
            "--json-keys",
            *keys,
            "--tokenizer-model",
            model,
            "--output-prefix",
            str(d / "out"),
            "--append-eod",
            "--no-progress",
            "--chunk-rows",
            "16",
        ]
        # two workers where the error comes mid-stream: the pool's reader thread hands it over
        with pytest.raises(DataError) as e:
            main(argv + (["--workers", "2"] if "after a good shard" in name else []))
        msg = str(e.value)
        assert "\n" not in msg, name
        for needle in needles:
            assert needle in msg, (name, msg)
        assert _listing(d) == before, name
    # the CLI end to end: exit 2, one line on stderr, no output
    before = _listing(d)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "data.preprocess",
            "--input",
            str(d / "null.parquet"),
            "--tokenizer-model",
            model,
            "--output-prefix",
            str(d / "out"),
            "--workers",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("[")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("error: ") and "null.parquet: row 2: needs string field(s)" in lines[0]
    assert _listing(d) == before
    # --skip-bad-lines skips the null row and counts it
    s = preprocess([str(d / "null.parquet")], ["text"], model, str(d / "skip"), skip_bad_lines=True, progress=False)
    assert (s["documents"], s["bad_lines"]) == (2, 1)


def test_a_missing_extra_is_named_with_its_install_line(corpus, tmp_path, monkeypatch):
    from megazero.runtime.extras import missing_extra_message

    inputs, _, model = corpus
    for module, arg in (("pyarrow", inputs["datasets folder"][0]), ("zstandard", inputs["jsonl.zst"][0])):
        monkeypatch.setitem(sys.modules, module, None)
        with pytest.raises(DataError) as e:
            preprocess([arg], ["text"], model, str(tmp_path / "o"), progress=False)
        assert str(e.value) == missing_extra_message(module, f"--input {arg}")
        assert str(e.value).endswith("fix: pip install -e .[data]")
        assert os.listdir(tmp_path) == []
