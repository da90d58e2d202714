"""data.prepare: the whole pipeline on a small package, idempotent, with the launcher's last lines."""

import os

import pytest

from data.corpus import stdlib_root
from data.gpt_dataset import build_train_valid_test_datasets
from data.indexed_dataset import DataError, IndexedDataset
from data.prepare import main, prepare
from data.tokenizer import load_tokenizer


def test_prepare_runs_once_and_then_skips_every_step(tmp_path, capsys):
    root = os.path.join(stdlib_root(), "json")  # a small package stands in for the stdlib
    argv = [
        "--data-dir",
        str(tmp_path),
        "--vocab-size",
        "400",
        "--workers",
        "1",
        "--root",
        root,
        "--heldout-per-10k",
        "3000",
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3:] == [
        f"HELDOUT_DATA_PATH={tmp_path}/stdlib_heldout_text_document",
        f"DATA_PATH={tmp_path}/stdlib_text_document",
        f"TOKENIZER_MODEL={tmp_path}/tokenizer.model",
    ]
    outputs = sorted(os.listdir(tmp_path))
    assert outputs == [
        "corpus",
        "stdlib_heldout_text_document.bin",
        "stdlib_heldout_text_document.idx",
        "stdlib_heldout_text_document.tokenizer.json",
        "stdlib_text_document.bin",
        "stdlib_text_document.idx",
        "stdlib_text_document.tokenizer.json",
        "tokenizer.model",
        "tokenizer.vocab",
    ]
    stamps = {f: os.stat(tmp_path / f).st_mtime_ns for f in outputs}
    assert main(argv) == 0
    assert "[prepare]" not in capsys.readouterr().out  # every step skipped
    assert {f: os.stat(tmp_path / f).st_mtime_ns for f in outputs} == stamps
    tok = load_tokenizer(str(tmp_path / "tokenizer.model"))
    ds = IndexedDataset(str(tmp_path / "stdlib_text_document"))
    assert ds.num_documents == 4 and tok.vocab_size == 400  # json/: 5 files, tool.py held out
    text = open(os.path.join(root, "decoder.py"), encoding="utf-8", newline="").read()
    assert any(tok.decode(ds[i].tolist()) == text for i in range(len(ds)))
    train, valid, test = build_train_valid_test_datasets(
        [str(tmp_path / "stdlib_text_document")], "3,1,0", 16, 0, (20, 5, 5), None, vocab_size=tok.vocab_size
    )
    assert len(train) == 20 and len(valid) == 5 and test is None
    with pytest.raises(DataError, match="vocabulary 400 != --vocab-size 512"):
        prepare(str(tmp_path), 512, 1, root)


def test_prepare_without_heldout_files(tmp_path):
    root = os.path.join(stdlib_root(), "json")  # at the default 1% none of its 5 files is held out
    out = prepare(str(tmp_path), 400, 1, root, log=lambda s: None)
    assert out["heldout_data_path"] is None
    assert IndexedDataset(out["data_path"]).num_documents == 5
