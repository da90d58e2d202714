"""Preference pairs for the post-training tests: a small Hugging Face tokenizer and
``python -m data.preference``'s files, written into one folder."""

from __future__ import annotations

import json

from tests.support.extras import require
from tests.support.hf_tokenizer import corpus


def write_pairs(folder, records: list[dict]) -> tuple[str, str]:
    """(tokenizer path, data prefix) of ``records`` (``data.preference``'s record forms)
    preprocessed under ``folder`` (a ``pathlib.Path``) with a 320-token byte-level BPE."""
    require("tokenizers")
    from data.preference import preprocess_preference
    from data.tokenizer import train_hf_tokenizer

    tok = train_hf_tokenizer(corpus(200), 320, str(folder / "tokenizer.json"))
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess_preference(
        [str(folder / "pairs.jsonl")], tok, str(folder / "pref"), tokenizer_type="HuggingFaceTokenizer"
    )
    return tok, str(folder / "pref")
