"""--tokenizer-type HuggingFaceTokenizer: a tokenizer.json goes from preprocessing to the final
summary of a training run, with the same tokenizer record and checks as sentencepiece."""

import hashlib
import json
import os

import numpy as np
import pytest

from tests.support.extras import require
from tests.support.hf_tokenizer import TEXTS, corpus


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    require("tokenizers")
    from data.tokenizer import load_tokenizer, train_hf_tokenizer

    d = tmp_path_factory.mktemp("hf")
    path = train_hf_tokenizer(corpus(200), 320, str(d / "tokenizer.json"))
    return load_tokenizer(path, "HuggingFaceTokenizer")


def test_interface_round_trips_and_keeps_special_text_ordinary(hf_tok):
    assert hf_tok.eod == 0 and hf_tok.vocab_size == 320
    for text in TEXTS:
        ids = hf_tok.encode(text)
        assert hf_tok.decode(ids) == text and hf_tok.eod not in ids  # "<|endoftext|>" text is not EOD
    assert hf_tok.decode(hf_tok.encode("ab") + [hf_tok.eod] + hf_tok.encode("c")) == "abc"
    assert hf_tok.sha256 == hashlib.sha256(open(hf_tok.model_path, "rb").read()).hexdigest()


def test_bad_tokenizer_files_are_data_errors(tmp_path, hf_tok):
    from data.indexed_dataset import DataError
    from data.tokenizer import load_tokenizer

    with pytest.raises(DataError, match="tokenizer.json not found"):
        load_tokenizer(str(tmp_path), "HuggingFaceTokenizer")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path), "HuggingFaceTokenizer")
    with pytest.raises(DataError, match="not a sentencepiece model"):
        load_tokenizer(hf_tok.model_path, "SentencePieceTokenizer")
    with pytest.raises(DataError, match="--tokenizer-type 'GPT2BPETokenizer' is unknown"):
        load_tokenizer(hf_tok.model_path, "GPT2BPETokenizer")


@pytest.mark.slow
def test_tokenizer_json_trains_from_preprocessing_to_final_summary(hf_tok, tmp_path, capsys):
    from data import preprocess
    from data.indexed_dataset import DataError, IndexedDataset, read_tokenizer_record
    from megazero import training
    from megazero.config import config_from_argv

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(120)), encoding="utf-8")
    assert (
        preprocess.main(
            [
                "--input",
                str(src),
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                os.path.dirname(hf_tok.model_path),  # the folder
                "--output-prefix",
                str(tmp_path / "c"),
                "--append-eod",
                "--workers",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    prefix = str(tmp_path / "c_text_document")
    record = read_tokenizer_record(prefix)
    assert record == dict(
        sha256=hf_tok.sha256, vocab_size=320, eod=0, model=hf_tok.model_path, type="HuggingFaceTokenizer"
    )
    ds = IndexedDataset(prefix)
    for i in (0, 57, 119):  # each document is its ids, then EOD
        assert ds[i].tolist() == hf_tok.encode(corpus(120)[i]) + [hf_tok.eod]
    run = tmp_path / "run"
    argv = [
        "--data-path",
        prefix,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        hf_tok.model_path,
        "--seq-length",
        "16",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--train-iters",
        "4",
        "--micro-batch-size",
        "2",
        "--split",
        "90,10",
        "--eval-iters",
        "1",
        "--eval-interval",
        "4",
        "--device",
        "cpu",
        "--run-dir",
        str(run),
        "--prompt",
        "def ",
        "--generate-tokens",
        "6",
    ]
    assert training.main(argv) == 0
    out = capsys.readouterr().out
    assert "final validation loss:" in out and "sample: def " in out
    summary = [json.loads(x) for x in open(run / "metrics.jsonl")][-1]
    assert summary["kind"] == "summary" and np.isfinite(summary["final_valid_loss"])
    assert summary["final_valid_loss"] < np.log(320)  # four steps beat the uniform guess
    # the same checks as sentencepiece: another tokenizer.json of the same size is refused
    from data.tokenizer import train_hf_tokenizer

    other = train_hf_tokenizer(corpus(50)[::-1] + ["zzz qqq"] * 30, 320, str(tmp_path / "o" / "tokenizer.json"))
    bad = list(argv)
    bad[bad.index(hf_tok.model_path)] = other
    with pytest.raises(DataError, match="was tokenized with .*not --tokenizer-model"):
        training.build_data(config_from_argv(bad, 1))
