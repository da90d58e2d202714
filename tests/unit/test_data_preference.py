"""Preference data (data/preference.py): chosen/rejected pairs with the loss on the answers only.

Records of the three forms (prompt/chosen/rejected, TRL's two conversations, shared messages
with one answer each) are preprocessed with a small Hugging Face tokenizer; the tokens in the
loss are counted again from the raw records, chat tokens equal data.sft's rendering, JSONL,
gzip and parquet inputs give byte-identical files; micro-batches keep a pair's two rows
together; bad records exit 2 with one line naming file, line or row and field, leaving nothing.
"""

import gzip
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.extras import require
from tests.support.hf_tokenizer import corpus
from tests.support.paths import REPO


def plain(i: int) -> dict:
    a, b = i % 7, i % 3 + 1
    r = {"prompt": f"# {a} + {b}\n", "chosen": f"print({a + b})\n", "rejected": f"print({a - b})\n"}
    if i % 2:
        r["margin"] = 0.5 * i
    return r


def two_conversations(i: int) -> dict:
    shared = [
        {"role": "system", "content": "short"},
        {"role": "user", "content": f"{i}*2?"},
        {"role": "assistant", "content": f"{2 * i}"},
        {"role": "user", "content": "and plus one?"},
    ]
    return {
        "chosen": shared + [{"role": "assistant", "content": f"{2 * i + 1}"}],
        "rejected": shared + [{"role": "assistant", "content": f"no, {i}"}],
    }


def shared_messages(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"say {i}"}],
        "chosen": {"role": "assistant", "content": f"{i}"},
        "rejected": {"role": "assistant", "content": f"{i + 1} or so"},
        "margin": float(i),
    }


FORMS = {"plain": plain, "conversations": two_conversations, "messages": shared_messages}
N = 6  # records per form


def answer(record: dict, side: str) -> str:
    """The text in the loss, from the raw record: the response, or the final turn's content."""
    value = record[side]
    return value if isinstance(value, str) else (value if isinstance(value, dict) else value[-1])["content"]


def conversation(record: dict, side: str) -> list:
    value = record[side]
    return record.get("messages", []) + ([value] if isinstance(value, dict) else value)


def _write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _sha(prefix):
    return [
        hashlib.sha256(open(prefix + ext, "rb").read()).hexdigest()
        for ext in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx")
    ]


@pytest.fixture(scope="module")
def pref(tmp_path_factory):
    """The tokenizer, the records of each form, their JSONL files and the preprocessed prefix."""
    require("tokenizers")
    from data.preference import preprocess_preference
    from data.tokenizer import load_tokenizer, train_hf_tokenizer

    d = tmp_path_factory.mktemp("pref")
    tok_path = train_hf_tokenizer(corpus(200), 320, str(d / "tokenizer.json"))
    recs = {name: [make(i) for i in range(N)] for name, make in FORMS.items()}
    files = [_write_jsonl(d / f"{name}.jsonl", rs) for name, rs in recs.items()]
    prefix = str(d / "pref")
    stats = preprocess_preference(files, tok_path, prefix, tokenizer_type="HuggingFaceTokenizer")
    return dict(
        tok=load_tokenizer(tok_path, "HuggingFaceTokenizer"),
        tok_path=tok_path,
        records=[r for rs in recs.values() for r in rs],
        recs=recs,
        files=files,
        prefix=prefix,
        stats=stats,
        dir=d,
    )


def test_the_stored_masks_are_the_final_answers(pref):
    """Per pair: the mask's ones are the answer's tokens plus EOD, counted from the raw record;
    the masked tokens decode to the answer; both sides share the unmasked context; chat tokens
    are data.sft's rendering of the conversation; margins are stored, 0 when absent."""
    from data.indexed_dataset import IndexedDataset
    from data.preference import PreferencePairs
    from data.sft import preprocess_sft

    tok, recs = pref["tok"], pref["records"]
    pairs = PreferencePairs(pref["prefix"])
    assert len(pairs) == len(recs) == 3 * N and pref["stats"]["pairs"] == 3 * N
    chats = [r for r in recs if not isinstance(r["chosen"], str)]
    convs = [{"messages": conversation(r, side)} for r in chats for side in ("chosen", "rejected")]
    sft_prefix = str(pref["dir"] / "sft_render")
    preprocess_sft(
        [_write_jsonl(pref["dir"] / "convs.jsonl", convs)],
        pref["tok_path"],
        sft_prefix,
        tokenizer_type="HuggingFaceTokenizer",
    )
    rendered = IndexedDataset(sft_prefix)
    loss_tokens, c = 0, 0
    for i, r in enumerate(recs):
        ct, cm, rt, rm, margin = pairs.pair(i)
        assert margin == np.float32(r.get("margin", 0.0))
        for side, t, m in (("chosen", ct, cm), ("rejected", rt, rm)):
            want = answer(r, side)
            assert int(m.sum()) == len(tok.encode(want)) + 1 and t[-1] == tok.eod and m[-1] == 1
            assert tok.decode(t[m > 0][:-1].tolist()) == want
            assert m[: len(m) - int(m.sum())].sum() == 0  # the answer is the tail
            loss_tokens += int(m.sum())
        assert ct[cm == 0].tolist() == rt[rm == 0].tolist()
        if isinstance(r["chosen"], str):
            assert tok.decode(ct[cm == 0].tolist()) == r["prompt"]
        else:
            assert ct.tolist() == rendered[c].tolist() and rt.tolist() == rendered[c + 1].tolist()
            c += 2
    assert c == 2 * len(chats) and pref["stats"]["loss_tokens"] == loss_tokens
    assert pairs.where(0) == f"{pref['files'][0]}:1" and pairs.where(N + 2) == f"{pref['files'][1]}:3"


def test_jsonl_gzip_and_parquet_give_identical_files(pref):
    """The same records as .jsonl.gz and as parquet (lists of structs, null margins) give
    byte-identical token and mask pairs and the same margins; parquet rows count from 0."""
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    from data.preference import PreferencePairs, preprocess_preference

    d = pref["dir"]
    gz, parquet = [], []
    for name, rs in pref["recs"].items():
        with gzip.open(d / f"{name}.jsonl.gz", "wt") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rs))
        gz.append(str(d / f"{name}.jsonl.gz"))
        cols = sorted({k for r in rs for k in r})
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in cols} for r in rs]), d / f"{name}.parquet")
        parquet.append(str(d / f"{name}.parquet"))
    want = PreferencePairs(pref["prefix"])
    for name, paths in (("gz", gz), ("parquet", parquet)):
        preprocess_preference(paths, pref["tok_path"], str(d / name), tokenizer_type="HuggingFaceTokenizer")
        assert _sha(str(d / name)) == _sha(pref["prefix"]), name
        got = PreferencePairs(str(d / name))
        assert got.margins.tolist() == want.margins.tolist()
    assert got.where(N + 2) == f"{parquet[1]}: row 2"


@pytest.mark.parametrize("mbs", [2, 4])
def test_micro_batches_keep_each_pair_in_adjacent_rows(pref, mbs):
    """Rows 2j and 2j + 1 are pair start + j's chosen and rejected, cut to T + 1 tokens and
    right-padded at mask 0; labels are the tokens shifted by one; margins ride along."""
    import torch

    from data.preference import PreferencePairs, preference_micro_batches

    pairs, pad = PreferencePairs(pref["prefix"]), 1
    T = int(max(len(pairs.pair(i)[0]) for i in range(len(pairs)))) - 3  # the longest are cut
    cut = 0
    for start in range(0, len(pairs) - mbs // 2 + 1, mbs // 2):
        b = preference_micro_batches(pairs, start, mbs, T, pad)
        assert b.tokens.shape == b.labels.shape == b.loss_mask.shape == (mbs, T) and b.margin.shape == (mbs // 2,)
        for j in range(mbs // 2):
            ct, cm, rt, rm, margin = pairs.pair(start + j)
            assert b.margin[j].item() == np.float32(margin)
            for row, t, m in ((2 * j, ct, cm), (2 * j + 1, rt, rm)):
                seq = np.full(T + 1, pad)
                mask = np.zeros(T + 1)
                seq[: min(len(t), T + 1)], mask[: min(len(t), T + 1)] = t[: T + 1], m[: T + 1]
                cut += len(t) > T + 1
                assert b.tokens[row].tolist() == seq[:-1].tolist() and b.labels[row].tolist() == seq[1:].tolist()
                assert torch.equal(b.loss_mask[row], torch.tensor(mask[1:], dtype=torch.float32))
    assert cut > 0


def test_an_odd_micro_batch_and_a_prompt_too_long_at_read_time_are_refused(pref, tmp_path):
    from data.indexed_dataset import DataError
    from data.preference import PreferencePairs, preference_micro_batches, preprocess_preference

    with pytest.raises(DataError, match=r"^--micro-batch-size 3: .* must be even"):
        preference_micro_batches(PreferencePairs(pref["prefix"]), 0, 3, 32, 0)
    long = {"prompt": "value_1 = 7\n" * 40, "chosen": "a", "rejected": "b"}
    path = _write_jsonl(tmp_path / "long.jsonl", [plain(0), long])
    preprocess_preference([path], pref["tok_path"], str(tmp_path / "p"), tokenizer_type="HuggingFaceTokenizer")
    pairs = PreferencePairs(str(tmp_path / "p"))
    preference_micro_batches(pairs, 0, 2, 16, 0)
    with pytest.raises(DataError) as e:
        preference_micro_batches(pairs, 1, 2, 16, 0)
    assert str(e.value).startswith(f"{path}:2 (pair 1): the chosen sequence: the response starts at token ")
    assert "--seq-length 16 + 1 tokens" in str(e.value)


# -- bad input ------------------------------------------------------------------------------------
GOOD = plain(1)
SAY = {"role": "user", "content": "hi"}
CASES = {  # name: (records of bad.jsonl, extra flags, substrings of the one error line)
    "no chosen": ([GOOD, {"prompt": "p", "rejected": "r"}], [], ["bad.jsonl:2: ", "missing field 'chosen'"]),
    "renamed chosen key": (
        [GOOD],
        ["--chosen-key", "better"],
        ["bad.jsonl:1: ", "missing field 'better' (--chosen-key)"],
    ),
    "rejected not a string": (
        [GOOD, GOOD, {"prompt": "p", "chosen": "c", "rejected": 5}],
        [],
        ["bad.jsonl:3: ", "field 'rejected' is int, not a string"],
    ),
    "chat prefixes differ": (
        [
            GOOD,
            {
                "chosen": [SAY, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "b"}],
            },
        ],
        [],
        ["bad.jsonl:2: ", "fields 'chosen' and 'rejected' differ at turn 0"],
    ),
    "chat unknown role": (
        [
            {
                "messages": [{"role": "tool", "content": "x"}],
                "chosen": {"role": "assistant", "content": "a"},
                "rejected": {"role": "assistant", "content": "b"},
            }
        ],
        [],
        ["bad.jsonl:1: ", "field 'messages': turn 0 has unknown role 'tool'"],
    ),
    "conversation content not a string": (
        [{k: [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}] for k in ("chosen", "rejected")}],
        [],
        ["bad.jsonl:1: ", "field 'chosen': turn 0's 'content' is int, not a string"],
    ),
    "final turn not the assistant's": (
        [{"chosen": [SAY], "rejected": [SAY]}],
        [],
        ["bad.jsonl:1: ", "field 'chosen': the final turn must be the assistant's"],
    ),
    "margin not a number": ([dict(GOOD, margin="high")], [], ["bad.jsonl:1: ", "field 'margin' is 'high'"]),
    "prompt leaves nothing to score": (
        [GOOD, {"prompt": "value_1 = 7\n" * 40, "chosen": "a", "rejected": "b"}],
        ["--seq-length", "16"],
        ["bad.jsonl:2: ", "field 'chosen': the response starts at token", "--seq-length 16 + 1"],
    ),
}


def _listing(d):
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


def _cli(pref, tmp_path, path, extra):
    argv = [sys.executable, "-m", "data.preference", "--input", str(path), "--tokenizer-model", pref["tok_path"]]
    argv += ["--tokenizer-type", "HuggingFaceTokenizer", "--output-prefix", str(tmp_path / "out"), *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_records_exit_2_with_one_line_and_leave_nothing(pref, tmp_path, name):
    lines, extra, want = CASES[name]
    _write_jsonl(tmp_path / "bad.jsonl", lines)
    before = _listing(tmp_path)
    p = _cli(pref, tmp_path, tmp_path / "bad.jsonl", extra)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("error: ") and all(w in p.stderr for w in want), p.stderr
    assert _listing(tmp_path) == before


def test_a_bad_parquet_row_is_named_by_its_row(pref, tmp_path):
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    rows = [plain(0), {"prompt": "p", "chosen": "c", "rejected": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    before = _listing(tmp_path)
    p = _cli(pref, tmp_path, tmp_path / "bad.parquet", [])
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"{tmp_path / 'bad.parquet'}: row 1: missing field 'rejected' (--rejected-key)" in p.stderr
    assert _listing(tmp_path) == before
