"""``data.prompts`` (RL prompts with reference answers), ``data.print_tasks`` (the demo's
verifiable task) and ``megazero.post_training.rewards`` (reward functions and where a score goes)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch

from tests.support.extras import require
from tests.support.hf_tokenizer import corpus
from tests.support.paths import REPO


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    require("tokenizers")
    from data.tokenizer import train_hf_tokenizer

    return train_hf_tokenizer(corpus(200), 320, str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_prompts_are_the_text_before_an_sft_response_and_keep_their_answers(tok, tmp_path):
    """A plain prompt's tokens are encode(prompt); a chat prompt's are the ids data.sft gives the
    same turns up to the assistant's content (its header included); answers are kept as text
    (numbers as their decimal text), and each prompt names its line."""
    from data.prompts import PromptSet, preprocess_prompts
    from data.sft import encode_record, record_pieces
    from data.tokenizer import load_tokenizer

    turns = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "2 + 3?"}]
    recs = [{"prompt": "# 2 + 3 =", "answer": " 5 "}, {"messages": turns, "answer": 5}, {"prompt": "x", "answer": 2.5}]
    src = _write(tmp_path / "p.jsonl", recs)
    stats = preprocess_prompts([src], tok, str(tmp_path / "out"), tokenizer_type="HuggingFaceTokenizer")
    t = load_tokenizer(tok, "HuggingFaceTokenizer")
    got = PromptSet(str(tmp_path / "out"))
    assert stats["prompts"] == len(got) == 3
    assert got.tokens(0) == t.encode("# 2 + 3 =") and got.answer(0) == " 5 "
    ids, mask = encode_record(record_pieces({"messages": turns + [{"role": "assistant", "content": "5"}]}, ""), t)
    first = int(mask.nonzero()[0][0])  # the first token of the assistant's content
    assert got.tokens(1) == ids[:first].tolist() and got.answer(1) == "5" and got.answer(2) == "2.5"
    assert got.where(1) == f"{src}:2"


@pytest.mark.parametrize(
    "rec,field",
    [
        ({"answer": "1"}, "'prompt'"),
        ({"prompt": "p"}, "'answer'"),
        ({"prompt": 3, "answer": "1"}, "'prompt'"),
        ({"prompt": "", "answer": "1"}, "'prompt'"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "a"},
         "assistant"),
        ({"prompt": "p", "answer": ["a"]}, "'answer'"),
    ],
)  # fmt: skip
def test_bad_records_exit_2_with_one_line_and_leave_nothing(tok, tmp_path, rec, field):
    src = _write(tmp_path / "p.jsonl", [{"prompt": "fine", "answer": "1"}, rec])
    p = subprocess.run(
        [sys.executable, "-m", "data.prompts", "--input", src, "--tokenizer-model", tok,
         "--tokenizer-type", "HuggingFaceTokenizer", "--output-prefix", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=str(REPO), timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"{src}:2" in p.stderr and field in p.stderr, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p.jsonl"]


def test_a_prompt_above_the_length_limit_is_refused(tok, tmp_path):
    from data.indexed_dataset import DataError
    from data.prompts import preprocess_prompts

    src = _write(tmp_path / "p.jsonl", [{"prompt": "a b c d e f g h", "answer": "1"}])
    with pytest.raises(DataError, match="--max-prompt-length 2"):
        preprocess_prompts([src], tok, str(tmp_path / "o"), tokenizer_type="HuggingFaceTokenizer", max_prompt_length=2)


def _printed(code: str) -> str:
    """What the one-line program prints, run here (the generator never runs it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    return out.getvalue().strip()


def test_print_tasks_answers_are_what_the_programs_print(tmp_path):
    """Every kind's answer equals the program's real output; the SFT file's noisy share is
    wrong and near --noise; the files are seeded."""
    from data.print_tasks import KINDS, main, records, sft_records

    recs = records(64, 3)
    assert len(recs) == 64 and len({r["prompt"] for r in recs}) > 50
    for r in recs:
        code = r["prompt"].split("\n")[0]
        assert _printed(code) == r["answer"], (code, r["answer"])
    sft = sft_records(400, 3, 0.25)
    right = sum(_printed(r["prompt"].split("\n")[0]) == r["response"].strip() for r in sft)
    assert 0.65 < right / 400 < 0.85 and sft == sft_records(400, 3, 0.25) and len(KINDS) == 4
    assert main(["--output", str(tmp_path / "p.jsonl"), "--count", "8"]) == 0
    assert [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()] == records(8, 0)


def test_reward_functions_and_where_the_score_goes(tmp_path, monkeypatch):
    """exact compares stripped texts; python:MODULE:FN loads a user's verifier; bad specs and a
    non-number result are one-line errors naming --reward; the score lands on each row's last
    response token (its EOD, or the last token of a row cut by the length limit), not a pad."""
    from megazero.post_training.rewards import exact_match, parse_reward, score, token_rewards

    assert exact_match("p", " cba\n", "cba") == 1.0 and exact_match("p", "cb a", "cba") == 0.0
    (tmp_path / "my_verifier.py").write_text(
        "def check(p, r, a):\n    return float(len(r))\n\ndef bad(p, r, a):\n    return 'x'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = parse_reward("python:my_verifier:check")
    assert score(fn, "python:my_verifier:check", "p", "abc", "a") == 3.0
    for spec, want in (("exact-ish", "--reward exact"), ("python:nope_module:f", "does not import"),
                       ("python:my_verifier:missing", "has no 'missing'")):  # fmt: skip
        with pytest.raises(ValueError, match=want) as e:
            parse_reward(spec)
        assert f"--reward {spec}" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="finite number"):
        score(parse_reward("python:my_verifier:bad"), "python:my_verifier:bad", "p", "r", "a")

    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1.0]])  # row 0 ended by EOD at 3, then pads
    got = token_rewards(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(got, torch.tensor([[0, 0, 0, 2.0, 0, 0], [0, 0, 0, 0, 0, -1.0]]))
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        token_rewards(torch.tensor([1.0, 1.0]), torch.tensor([[1, 0], [0, 0.0]]))


def test_reward_model_inputs_are_the_tokens_the_reward_model_scores():
    """--reward rm:DIR: the directory is read off the spec (``rm:`` alone is a one-line error);
    each row's sequence is its prompt and its response without the closing EOD (the reward
    model scores the token whose label is the EOD), a row cut by the length limit whole, an
    EOD-only response the prompt alone (length 1: its last token is scored)."""
    from megazero.post_training.rewards import RewardError, reward_model_dir, reward_model_inputs

    assert reward_model_dir("rm:/runs/rm") == "/runs/rm" and reward_model_dir("exact") is None
    assert reward_model_dir("python:m:f") is None
    with pytest.raises(RewardError, match="fix: --reward rm:DIR") as e:
        reward_model_dir("rm:")
    assert "\n" not in str(e.value)
    eod = 0
    tokens = torch.tensor([[5, 6, eod, 9], [7, 8, 9, 4], [eod, 3, 3, 3], [5, eod, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    seqs, lengths = reward_model_inputs([[1, 2], [3]], 2, tokens, mask, eod)
    assert seqs == [[1, 2, 5, 6], [1, 2, 7, 8, 9, 4], [3], [3, 5]]
    assert lengths == [2, 4, 1, 1]
    seqs, lengths = reward_model_inputs([[1, 2], [3]], 2, tokens, mask, None)  # no EOD: every token kept
    assert seqs[0] == [1, 2, 5, 6, eod] and lengths[2] == 1 and seqs[2] == [3, eod]
