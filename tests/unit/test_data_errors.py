"""Bad input: every case exits 2 with one line naming the file and the problem, and leaves nothing."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data.gpt_dataset import build_train_valid_test_datasets
from data.indexed_dataset import DataError, IndexedDatasetBuilder
from data.tokenizer import train_tokenizer
from tests.support.paths import REPO

ROOT = str(REPO)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    with open(d / "t.jsonl", "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n")
    return train_tokenizer(str(d / "t.jsonl"), 300, str(d / "tok"), num_threads=1)


def _jsonl(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _dataset(prefix, docs=((3, 4, 1), (5, 1))):
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for d in docs:
            b.add_document(d)
        b.finalize()


def _truncate_bin(d):
    _dataset(str(d / "trunc"))
    with open(d / "trunc.bin", "r+b") as f:
        f.truncate(7)


def _swap_idx(d):
    _dataset(str(d / "swap"))
    _dataset(str(d / "other"), docs=((1,),))
    os.replace(d / "other.idx", d / "swap.idx")
    os.remove(d / "other.bin")


GOOD = json.dumps({"text": "def g():\n    pass\n"})
PRE = ["data.preprocess", "--output-prefix", "{d}/out", "--append-eod", "--tokenizer-model", "{model}"]
CASES = {  # name: (setup(dir), argv, substrings the one-line message must contain)
    "missing input": (None, PRE + ["--input", "{d}/nothere.jsonl"], ["nothere.jsonl: input file not found"]),
    "not json": (
        lambda d: _jsonl(d / "bad.jsonl", [GOOD, "{oops", GOOD]),
        PRE + ["--input", "{d}/bad.jsonl"],
        ["bad.jsonl:2: not valid JSON", "--skip-bad-lines"],
    ),
    "not json, 2 workers": (
        lambda d: _jsonl(d / "bad.jsonl", [GOOD] * 40 + ["[1, 2"] + [GOOD] * 40),
        PRE + ["--input", "{d}/bad.jsonl", "--workers", "2"],
        ["bad.jsonl:41: not valid JSON"],
    ),
    "missing key": (
        lambda d: _jsonl(d / "nokey.jsonl", [GOOD, GOOD, json.dumps({"txt": "a"})]),
        PRE + ["--input", "{d}/nokey.jsonl"],
        ["nokey.jsonl:3: needs string field(s) ['text']"],
    ),
    "only empty documents": (
        lambda d: _jsonl(d / "empty.jsonl", [json.dumps({"text": ""})] * 3),
        PRE + ["--input", "{d}/empty.jsonl"],
        ["empty.jsonl: no non-empty documents"],
    ),
    "not utf-8": (
        lambda d: open(d / "latin.jsonl", "wb").write(b'{"text": "caf\xe9"}\n'),
        PRE + ["--input", "{d}/latin.jsonl"],
        ["latin.jsonl:1: not UTF-8"],
    ),
    "missing tokenizer": (
        lambda d: _jsonl(d / "ok.jsonl", [GOOD]),
        [
            "data.preprocess",
            "--input",
            "{d}/ok.jsonl",
            "--tokenizer-model",
            "{d}/no.model",
            "--output-prefix",
            "{d}/out",
        ],
        ["no.model: tokenizer model not found"],
    ),
    "merge missing prefix": (
        None,
        ["data.preprocess", "--merge", "{d}/nope", "--output-prefix", "{d}/out"],
        ["nope.idx", "dataset not found"],
    ),
    "merge truncated bin": (
        _truncate_bin,
        ["data.preprocess", "--merge", "{d}/trunc", "--output-prefix", "{d}/out"],
        ["trunc.bin has 7 bytes but", "trunc.idx implies 10"],
    ),
    "merge mismatched idx": (
        _swap_idx,
        ["data.preprocess", "--merge", "{d}/swap", "--output-prefix", "{d}/out"],
        ["swap.bin has 10 bytes but", "swap.idx implies 2"],
    ),
    "tokenizer missing input": (
        None,
        ["data.tokenizer", "--input", "{d}/nothere.jsonl", "--out-prefix", "{d}/tok"],
        ["nothere.jsonl: input file not found"],
    ),
    "tokenizer bad line": (
        lambda d: _jsonl(d / "bad.jsonl", [GOOD, "nope"]),
        ["data.tokenizer", "--input", "{d}/bad.jsonl", "--out-prefix", "{d}/tok"],
        ["bad.jsonl:2: not a JSON object"],
    ),
    "tokenizer tiny vocab": (
        lambda d: _jsonl(d / "ok.jsonl", [GOOD]),
        ["data.tokenizer", "--input", "{d}/ok.jsonl", "--out-prefix", "{d}/tok", "--vocab-size", "100"],
        ["--vocab-size 100: must be at least 267"],
    ),
    "corpus missing root": (
        None,
        ["data.corpus", "--out", "{d}/c", "--root", "{d}/nodir"],
        ["nodir: no readable .py files"],
    ),
}


def _listing(d):
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


@pytest.mark.parametrize("name", list(CASES))
def test_cli_bad_input(tmp_path, model, name):
    setup, argv, needles = CASES[name]
    if setup:
        setup(tmp_path)
    before = _listing(tmp_path)
    args = [a.format(d=tmp_path, model=model) for a in argv]
    p = subprocess.run([sys.executable, "-m"] + args, cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("[")]  # drop bar
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    for needle in needles:
        assert needle.format(d=tmp_path) in lines[0]
    assert _listing(tmp_path) == before  # no partial output


def test_skip_bad_lines_counts_them(tmp_path, model):
    _jsonl(tmp_path / "bad.jsonl", [GOOD, "{oops", json.dumps({"x": 1}), json.dumps({"text": ""}), GOOD])
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "data.preprocess",
            "--input",
            str(tmp_path / "bad.jsonl"),
            "--tokenizer-model",
            model,
            "--output-prefix",
            str(tmp_path / "o"),
            "--append-eod",
            "--skip-bad-lines",
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert "2 documents" in p.stdout and "1 empty documents and 2 bad lines" in p.stdout
    assert sorted(os.listdir(tmp_path)) == [
        "bad.jsonl",
        "o_text_document.bin",
        "o_text_document.idx",
        "o_text_document.tokenizer.json",
    ]


API_CASES = {  # name: (data_path with {d}, split, substrings of the DataError); vocabulary is 5
    "token id past the vocabulary": (["{d}/a"], "1,0,0", ["a.bin: token id 5 >= vocabulary size 5"]),
    "split does not parse": (["{d}/a"], "96,x,4", ["--split '96,x,4'", "e.g. 969,30,1"]),
    "split too many parts": (["{d}/a"], "1,1,1,1", ["--split '1,1,1,1'"]),
    "negative weight": (["-0.5", "{d}/a", "1.5", "{d}/b"], "1,0,0", ["weight -0.5 of", "a is negative"]),
    "weight not a number": (["x", "{d}/a", "1", "{d}/b"], "1,0,0", ["weight 'x'"]),
    "unpaired blend": (["0.5", "{d}/a", "0.5"], "1,0,0", ["weight/prefix pairs"]),
    "missing blend path": (["0.5", "{d}/a", "0.5", "{d}/missing"], "1,0,0", ["missing.idx: file not found"]),
}


@pytest.mark.parametrize("name", list(API_CASES))
def test_dataset_bad_input(tmp_path, name):
    data_path, split, needles = API_CASES[name]
    _dataset(str(tmp_path / "a"))
    _dataset(str(tmp_path / "b"))
    before = _listing(tmp_path)
    with pytest.raises(DataError) as e:
        build_train_valid_test_datasets(
            [p.format(d=tmp_path) for p in data_path], split, 4, 0, (10, 0, 0), str(tmp_path / "cache"), vocab_size=5
        )
    for needle in needles:
        assert needle.format(d=tmp_path) in str(e.value)
    assert _listing(tmp_path) == before


def test_preprocess_and_sft_number_parquet_rows_alike(tmp_path, model):
    """One parquet file whose row 2 (counting from 0, as ``ds[2]`` and pandas' ``iloc[2]``) lacks
    its text: data.preprocess and data.sft both name it ``row 2``; JSONL lines count from 1."""
    from tests.support.extras import require

    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None], "prompt": ["p", "q", None], "response": ["r", "s", None]}), path)
    runs = {
        "data.preprocess": ["--json-keys", "text", "--output-prefix", str(tmp_path / "pre")],
        "data.sft": ["--output-prefix", str(tmp_path / "sft")],
    }
    for tool, extra in runs.items():
        argv = [sys.executable, "-m", tool, "--input", str(path), "--tokenizer-model", model, *extra]
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
        assert p.returncode == 2 and len(errors) == 1, (tool, p.stderr)
        assert f"{path}: row 2: " in errors[0], (tool, errors[0])
