"""Text -> tokenizer -> .bin/.idx -> text is the identity (whitespace, unicode, huge and tiny docs)."""

import json
import os

import numpy as np
import pytest

from data.corpus import is_heldout, list_files, stdlib_root, write_corpus
from data.indexed_dataset import IndexedDataset
from data.preprocess import merge, preprocess
from data.tokenizer import load_tokenizer, train_tokenizer
from tests.support.data import TRICKY


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A vocabulary-400 BPE trained in the test on two stdlib modules and the tricky line."""
    d = tmp_path_factory.mktemp("tok")
    root = stdlib_root()
    texts = [open(os.path.join(root, f), encoding="utf-8", newline="").read() for f in ("textwrap.py", "shlex.py")] + [
        TRICKY
    ]
    with open(d / "train.jsonl", "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return load_tokenizer(train_tokenizer(str(d / "train.jsonl"), 400, str(d / "tok"), num_threads=1))


def test_tokenizer_interface(tok):
    assert tok.vocab_size == 400 and tok.eod == 1
    assert tok.eod not in tok.encode("<|eod|>")  # the text of the EOD piece is ordinary text
    assert tok.decode(tok.encode(TRICKY)) == TRICKY
    assert tok.decode(tok.encode("ab") + [tok.eod] + tok.encode("c")) == "abc"


def _stdlib_samples(max_per_kind=2):
    """Real stdlib files with tabs, with CRLF, with non-ASCII characters (as many as exist)."""
    root, found = stdlib_root(), {"\t": [], "\r\n": [], "nonascii": []}
    for rel in list_files(root):
        try:
            text = open(os.path.join(root, rel), encoding="utf-8", newline="").read()
        except UnicodeDecodeError:
            continue
        for kind, hit in (("\t", "\t" in text), ("\r\n", "\r\n" in text), ("nonascii", not text.isascii())):
            if hit and len(found[kind]) < max_per_kind:
                found[kind].append(text)
        if all(len(v) >= max_per_kind for v in found.values()):
            break
    return [t for v in found.values() for t in v]


def test_real_stdlib_files_round_trip(tok):
    texts = _stdlib_samples()
    assert len(texts) >= 3  # CPython ships files with tabs and non-ASCII characters
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_round_trip_through_bin_idx(tok, tmp_path, workers):
    big = (open(os.path.join(stdlib_root(), "textwrap.py"), encoding="utf-8").read() + TRICKY) * 40
    big = big[: 1 << 20]  # a 1 MB document (in characters)
    docs = [TRICKY, "x", big, "plain ascii\n", "日"]
    path = tmp_path / "in.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[0]}) + "\n\n")  # a blank line: ignored
        f.write(json.dumps({"text": ""}) + "\n")  # an empty document: skipped and counted
        for d in docs[1:]:
            f.write(json.dumps({"text": d}, ensure_ascii=bool(len(d) % 2)) + "\n")
    stats = preprocess(
        str(path), ["text"], tok.model_path, str(tmp_path / "out"), append_eod=True, workers=workers, progress=False
    )
    assert (stats["documents"], stats["empty"], stats["bad_lines"]) == (5, 1, 0)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.uint16 and ds.num_documents == 5 and ds.num_tokens == stats["tokens"]
    for i, text in enumerate(docs):
        ids = ds[i]
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1].tolist()  # length includes the EOD
        assert tok.decode(ids.tolist()) == text
    merged = str(tmp_path / "merged")
    merge([str(tmp_path / "out_text_document")] * 2, merged)
    m = IndexedDataset(merged)
    assert [tok.decode(m[i].tolist()) for i in range(len(m))] == docs + docs


def test_corpus_is_deterministic_and_file_disjoint(tmp_path):
    root = os.path.join(stdlib_root(), "json")  # a small package stands in for the whole stdlib
    c = write_corpus(str(tmp_path / "a"), root, heldout_per_10k=3000)
    write_corpus(str(tmp_path / "b"), root, heldout_per_10k=3000)
    for part in ("train", "heldout"):
        assert (
            open(tmp_path / "a" / f"{part}.jsonl", "rb").read() == open(tmp_path / "b" / f"{part}.jsonl", "rb").read()
        )
    rows = {
        part: [json.loads(line) for line in open(tmp_path / "a" / f"{part}.jsonl", encoding="utf-8")]
        for part in ("train", "heldout")
    }
    paths = {part: [r["path"] for r in rows[part]] for part in rows}
    assert paths["train"] == sorted(paths["train"]) and not set(paths["train"]) & set(paths["heldout"])
    assert paths["heldout"] and all(is_heldout(p, 3000) for p in paths["heldout"])
    assert sorted(paths["train"] + paths["heldout"]) == list_files(root)
    assert rows["train"][0]["text"] == open(os.path.join(root, paths["train"][0]), encoding="utf-8", newline="").read()
    assert (c["train"], c["heldout"]) == (len(paths["train"]), len(paths["heldout"]))


def test_tokenizer_record_guards_merge_and_training(tok, tmp_path):
    """preprocess writes PREFIX.tokenizer.json (the model's sha256); merge and training refuse
    data made with another model of the same vocabulary size, naming both sides."""
    import hashlib

    from data.indexed_dataset import DataError, read_tokenizer_record
    from megazero import training
    from megazero.config import config_from_argv

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": f"def f{i}(): return {i}\n"}) + "\n" for i in range(40)))
    preprocess(str(path), ["text"], tok.model_path, str(tmp_path / "a"), progress=False)
    a = str(tmp_path / "a_text_document")
    record = read_tokenizer_record(a)
    assert record["sha256"] == hashlib.sha256(open(tok.model_path, "rb").read()).hexdigest()
    assert (record["vocab_size"], record["eod"]) == (tok.vocab_size, tok.eod)
    other_dir = tmp_path / "other"  # another model with the same vocabulary size
    other_dir.mkdir()
    (other_dir / "t.jsonl").write_text(path.read_text() * 3 + json.dumps({"text": TRICKY}) + "\n")
    other = load_tokenizer(train_tokenizer(str(other_dir / "t.jsonl"), 400, str(other_dir / "tok"), num_threads=1))
    assert other.vocab_size == tok.vocab_size and other.sha256 != tok.sha256
    preprocess(str(path), ["text"], other.model_path, str(tmp_path / "b"), progress=False)
    b = str(tmp_path / "b_text_document")
    with pytest.raises(DataError, match="different models"):
        merge([a, b], str(tmp_path / "ab"))
    assert not os.path.exists(str(tmp_path / "ab") + ".bin")  # refused before writing
    merge([a, a], str(tmp_path / "aa"))
    assert read_tokenizer_record(str(tmp_path / "aa")) == record
    argv = [
        "--data-path",
        b,
        "--tokenizer-model",
        tok.model_path,
        "--seq-length",
        "8",
        "--num-layers",
        "2",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--train-iters",
        "2",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--split",
        "1",
        "--eval-iters",
        "0",
    ]
    with pytest.raises(
        DataError, match=f"b_text_document was tokenized with .*other/tok.model.*not --tokenizer-model {tok.model_path}"
    ):
        training.build_data(config_from_argv(argv, 1))
    argv[1] = a  # the matching model
    assert training.build_data(config_from_argv(argv, 1)).vocab_size == tok.vocab_size
    # the same data named by a relative path has the same signature (no false resume warning)
    rel = os.path.relpath(a)
    assert training.data_signature(config_from_argv(argv[:1] + [rel] + argv[2:], 1)) == training.data_signature(
        config_from_argv(argv, 1)
    )
    # a checkpoint trained with the other tokenizer is refused on resume (same vocabulary size)
    from megazero.checkpoint import CheckpointError

    cfg = config_from_argv(argv, 1)
    resume = {
        "iteration": 1,
        "extra": {"model": {}, "data": dict(training.data_signature(cfg), tokenizer=other.sha256)},
    }
    with pytest.raises(CheckpointError, match="was trained with another tokenizer"):
        training.check_resume(cfg, resume, tok.vocab_size)
    resume["extra"]["data"]["tokenizer"] = tok.sha256
    training.check_resume(cfg, resume, tok.vocab_size)
    # a damaged record is one clear error, never a crash
    from data.indexed_dataset import tokenizer_record_path

    for bad in (
        '{"sha256": null, "vocab_size": 400}',
        '{"sha256": 12, "vocab_size": 400}',
        '{"sha256": "%s", "vocab_size": "x"}' % ("a" * 64),
        "[1, 2",
    ):
        with open(tokenizer_record_path(a), "w") as f:
            f.write(bad)
        with pytest.raises(DataError, match="unreadable tokenizer record"):
            training.build_data(config_from_argv(argv, 1))
