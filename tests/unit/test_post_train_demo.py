"""data.post_train_demo: SFT records and preference pairs cut from the embedded corpus, checked
against the corpus files themselves."""

import json
import os

import pytest

from data.corpus import stdlib_root
from data.indexed_dataset import DataError
from data.post_train_demo import PROMPT_LINES, RESPONSE_LINES, main
from data.prepare import prepare


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    prepare(str(d), 400, 1, os.path.join(stdlib_root(), "json"), 3000, log=lambda *a: None)
    return d


def test_windows_are_real_lines_and_the_rejected_is_their_reversal(demo, capsys):
    """Every SFT response and chosen answer is the 4 lines that follow the 6 prompt lines in a
    corpus file; the rejected answer is those lines reversed; the held-out files' pairs come
    last and SPLIT counts them; the preprocessed prefixes exist."""
    assert main(["--data-dir", str(demo), "--sft-records", "20", "--pairs", "15"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    split = [int(x) for x in out[-1].removeprefix("SPLIT=").split(",")]
    corpus = {
        name: [json.loads(x)["text"] for x in open(demo / "corpus" / f"{name}.jsonl")] for name in ("train", "heldout")
    }
    sft = [json.loads(x) for x in open(demo / "post_train" / "sft.jsonl")]
    pairs = [json.loads(x) for x in open(demo / "post_train" / "pairs.jsonl")]
    assert len(sft) == 20 and split[0] == 15 and split[1] > 0 and len(pairs) == split[0] + split[1] and split[2] == 0

    def found(prompt, answer, texts):
        window = prompt + answer
        return any(window in t and prompt.count("\n") == PROMPT_LINES for t in texts)

    for r in sft:
        assert found(r["prompt"], r["response"], corpus["train"]) and r["response"].count("\n") <= RESPONSE_LINES
    for i, p in enumerate(pairs):
        texts = corpus["train"] if i < split[0] else corpus["heldout"]
        assert found(p["prompt"], p["chosen"], texts), i
        lines = p["chosen"].splitlines(keepends=True)
        assert p["rejected"] == "".join(reversed(lines)) != p["chosen"]
    for prefix in ("sft", "pref"):
        assert os.path.isfile(demo / "post_train" / f"{prefix}.bin")
    assert os.path.isfile(demo / "post_train" / "pref_pairs.npz")


def test_a_missing_corpus_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"corpus/train.jsonl not found; fix: python -m data.prepare --data-dir"):
        main(["--data-dir", str(tmp_path)])
