"""A run's tokenizer as Hugging Face files (``write_hf_tokenizer``), so that
``AutoTokenizer.from_pretrained(out)`` encodes exactly as megazero does; used by
``python -m scripts.convert_checkpoint --to-hf``.

A Hugging Face ``tokenizer.json`` is written as is. A sentencepiece model is converted
(``data.tokenizer.sentencepiece_to_hf``) and exported only when it encodes a check set
(``check_texts``: unicode, whitespace, a literal "▁", standard-library files) exactly as
``Tokenizer.encode`` does, else refused: the conversion is exact for the BPE models
``train_tokenizer`` writes, and the check guards every other.
"""

from __future__ import annotations

import json
import os

from data.indexed_dataset import DataError

CHECK_TEXTS = (
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé ☃ 日本語 — emoji 😀\ttab\r\nCRLF",
    "  leading and trailing spaces  ",
    "a literal \u2581 and \u2581\u2581",
    "x\n\n\t \n",
)


def check_texts(count: int = 40) -> list[str]:
    """Texts an exported sentencepiece tokenizer must encode exactly as megazero does: a few
    hand-made ones (unicode, whitespace, "▁") and the first ``count`` standard-library files."""
    from data.corpus import list_files, stdlib_root

    root, texts = stdlib_root(), list(CHECK_TEXTS)
    for rel in list_files(root)[:count]:
        try:
            texts.append(open(os.path.join(root, rel), encoding="utf-8", newline="").read())
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def hf_tokenizer_of(tok):
    """A ``tokenizers.Tokenizer`` giving ``tok``'s ids: the run's own tokenizer.json, or the
    converted sentencepiece model after a check that it encodes ``check_texts`` identically.

    Raises DataError when the sentencepiece model has no exact equivalent (naming the first
    text whose ids differ), or without the tokenizers package."""
    from data.tokenizer import HFTokenizer, sentencepiece_to_hf

    if isinstance(tok, HFTokenizer):
        return tok.tok
    hf = sentencepiece_to_hf(tok)
    for text in check_texts():
        if hf.encode(text, add_special_tokens=False).ids != tok.encode(text):
            raise DataError(
                f"the sentencepiece tokenizer {tok.model_path} has no exact Hugging Face "
                f"equivalent (the ids of {text[:40]!r} differ); fix: train with "
                "--tokenizer-type HuggingFaceTokenizer, or pass one with --tokenizer-model"
            )
    return hf


def write_hf_tokenizer(tok, out: str, max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into the existing folder ``out``:
    a ``PreTrainedTokenizerFast`` that encodes as ``tok`` (a ``data.tokenizer`` tokenizer) does,
    its end-of-document token as both BOS and EOS, ``max_length`` its ``model_max_length``.

    Raises DataError when no exact equivalent exists (``hf_tokenizer_of``)."""
    hf = hf_tokenizer_of(tok)
    hf.save(os.path.join(out, "tokenizer.json"))
    eod = hf.id_to_token(tok.eod)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eod,
        "eos_token": eod,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
