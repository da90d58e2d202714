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


def test_prompts_are_the_first_sft_windows_that_fit_and_data_prompts_reads_them(demo, capsys):
    """--prompts N: the first N SFT records (in order) whose prompt is at most --max-prompt-tokens
    sentencepiece tokens, the response as the answer; PROMPTS_JSONL names the file and
    python -m data.prompts --max-prompt-length preprocesses it with the same prompts and answers."""
    import sentencepiece

    from data.prompts import PromptSet
    from data.prompts import main as prompts_main

    sp = sentencepiece.SentencePieceProcessor(model_file=str(demo / "tokenizer.model"))
    assert main(["--data-dir", str(demo), "--sft-records", "30", "--pairs", "5"]) == 0
    sft = [json.loads(x) for x in open(demo / "post_train" / "sft.jsonl")]
    lengths = [len(sp.encode(r["prompt"])) for r in sft]
    limit = sorted(lengths)[len(lengths) // 2]  # about half the windows fit
    kept = [i for i, n in enumerate(lengths) if n <= limit][:6]
    assert len(kept) == 6 and kept[-1] > 5  # some earlier window is too long and left out
    want = [{"prompt": sft[i]["prompt"], "answer": sft[i]["response"]} for i in kept]
    capsys.readouterr()
    argv = ["--data-dir", str(demo), "--sft-records", "30", "--pairs", "5", "--prompts", "6"]
    assert main(argv + ["--max-prompt-tokens", str(limit)]) == 0
    out = capsys.readouterr().out.splitlines()
    path = str(demo / "post_train" / "prompts.jsonl")
    assert f"PROMPTS_JSONL={path}" in out and out[-1].startswith("SPLIT=")
    got = [json.loads(x) for x in open(path)]
    assert got == want
    prefix = str(demo / "post_train" / "rl")
    tok = str(demo / "tokenizer.model")
    assert prompts_main(["--input", path, "--tokenizer-model", tok, "--output-prefix", prefix,
                         "--max-prompt-length", str(limit)]) == 0  # fmt: skip
    ps = PromptSet(prefix)
    assert len(ps) == 6 and [ps.answer(i) for i in range(6)] == [r["answer"] for r in want]
    assert [ps.tokens(i) for i in range(6)] == [sp.encode(r["prompt"]) for r in want]


def test_too_few_prompts_that_fit_exit_2_with_one_line(demo):
    """More --prompts than SFT windows fit under --max-prompt-tokens, or --prompts below 1 with
    a bound below 1: exit code 2 and one line naming the setting and the fix; no prompts file."""
    import subprocess
    import sys

    cases = {
        ("--prompts", "25", "--max-prompt-tokens", "8"): "fix: fewer --prompts",
        ("--prompts", "-1"): "--prompts -1",
        ("--prompts", "3", "--max-prompt-tokens", "0"): "--max-prompt-tokens 0",
    }
    path = demo / "post_train" / "prompts.jsonl"
    for extra, want in cases.items():
        path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "data.post_train_demo", "--data-dir", str(demo), "--sft-records", "30"]
        r = subprocess.run([*argv, "--pairs", "5", *extra], capture_output=True, text=True)
        err = r.stderr.strip()
        assert r.returncode == 2 and want in err and "\n" not in err, (extra, err)
        assert not path.exists()
