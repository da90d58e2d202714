"""A byte-fallback BPE tokenizer (sentencepiece) that round-trips any text exactly, code included,
and, behind the same interface, a Hugging Face ``tokenizer.json`` (``HFTokenizer``; Megatron's
``--tokenizer-type HuggingFaceTokenizer``).

Train: ``python -m data.tokenizer --input X.jsonl --vocab-size 8192 --out-prefix P`` writes
``P.model`` (and ``P.vocab``). Load: ``load_tokenizer("P.model")``.

Choices (sentencepiece trainer options, documented behaviour):
- ``model_type=bpe, byte_fallback=True``: a character outside the vocabulary becomes its UTF-8
  bytes ``<0x..>``, so no input is unrepresentable and ``unk`` never appears.
- whitespace is kept as is: ``normalization_rule_name=identity`` (no NFKC),
  ``remove_extra_whitespaces=False``, ``add_dummy_prefix=False``,
  ``allow_whitespace_only_pieces=True`` (indentation pieces) and ``split_by_whitespace=False``
  (pieces may span a space, e.g. ``"    def"``; 10% fewer tokens on code).
- training sentences are chunks of whole lines of ~1000 characters *with* their newlines
  (sentencepiece's file reader would drop them), so pieces like ``"):\\n"`` are learned.
- input is capped: a shuffled sample of at most ``input_sentence_size`` chunks (default 40000,
  ~40 MB), so training takes well under 2 minutes on 2 cores.
- ids: 0 ``<unk>``, 1 ``<|eod|>`` (the end-of-document id, a control symbol: the text
  ``"<|eod|>"`` in a document is encoded as ordinary characters, never as id 1), then 256
  byte pieces, then merges.

sentencepiece writes spaces as U+2581 ("▁") inside pieces and turns every "▁" back into a
space when decoding, so a literal "▁" in the text would not survive. ``encode`` therefore
encodes each literal "▁" as its three UTF-8 byte pieces, and ``decode`` maps ids to bytes
with its own table (pieces with "▁" -> space, byte pieces -> that byte, controls -> nothing).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import os
import random

import sentencepiece as spm

from data.fim import FIMSentinels
from data.indexed_dataset import DataError, cli_exit, tmp_name

EOD_PIECE = "<|eod|>"
_SPACE_MARK = "\u2581"


class Tokenizer:
    """Interface the rest of megazero uses: ``vocab_size``, ``eod``, ``encode``, ``decode``."""

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise DataError(
                f"{model_path}: tokenizer model not found; train one with "
                f"`python -m data.tokenizer` or run `python -m data.prepare`"
            )
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.load(model_path)
        except (RuntimeError, OSError) as e:
            raise DataError(f"{model_path}: not a sentencepiece model ({e}); retrain it") from None
        self.vocab_size: int = self.sp.get_piece_size()
        eod = self.sp.piece_to_id(EOD_PIECE)
        self.eod: int = eod if eod != self.sp.unk_id() else self.sp.eos_id()
        if self.eod < 0:
            raise DataError(f"{model_path}: has no end-of-document piece {EOD_PIECE!r} or </s>")
        self._mark_ids = [self.sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE_MARK.encode("utf-8")]
        self.sha256: str = model_sha256(model_path)  # identifies the model file
        self._bytes = [self._piece_bytes(i) for i in range(self.vocab_size)]
        self.fim: FIMSentinels | None = None  # set by add_fim_sentinels

    def record(self) -> dict:
        """What ``data.preprocess`` stores beside a dataset (``PREFIX.tokenizer.json``)."""
        return {
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "model": os.path.abspath(self.model_path),
        }

    def token_id(self, text: str) -> int | None:
        """The id of the piece spelled ``text`` (None when the model has none)."""
        i = self.sp.piece_to_id(text)
        return None if i == self.sp.unk_id() and text != self.sp.id_to_piece(i) else i

    def _append_ids(self, n: int) -> int:
        """Grow the vocabulary by ``n`` ids that decode to nothing; returns the first."""
        first = self.vocab_size
        self._bytes += [b""] * n
        self.vocab_size += n
        return first

    def _piece_bytes(self, i: int) -> bytes:
        if self.sp.is_byte(i):
            return bytes([int(self.sp.id_to_piece(i)[3:5], 16)])
        if self.sp.is_control(i) or self.sp.is_unknown(i):
            return b""
        return self.sp.id_to_piece(i).replace(_SPACE_MARK, " ").encode("utf-8")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOD appended). ``decode(encode(text)) == text`` for any str."""
        if _SPACE_MARK not in text:
            return self.sp.encode(text)
        parts = text.split(_SPACE_MARK)
        ids: list[int] = []
        for k, seg in enumerate(self.sp.encode(parts)):
            if k:
                ids.extend(self._mark_ids)
            ids.extend(seg)
        return ids

    def decode(self, ids) -> str:
        """Text of ``ids``; the EOD id decodes to nothing, invalid UTF-8 byte runs to U+FFFD."""
        table = self._bytes
        return b"".join(table[int(i)] for i in ids).decode("utf-8", errors="replace")


TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer")  # Megatron's --tokenizer-type names
HF_EOD_TOKENS = ("<|endoftext|>", "<|eod|>", "<|end_of_text|>", "</s>", "<eos>")


def hf_tokenizers(what: str):
    """The ``tokenizers`` package (pyproject's optional extra ``hf``) that ``what`` needs.

    Raises DataError with megazero's one-line form for a missing optional extra
    (``megazero.runtime.extras.missing_extra_message``, which data/ may not import; a test
    keeps the two equal) when it is not installed or does not import."""
    try:
        import tokenizers
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and (e.name or "tokenizers").split(".")[0] == "tokenizers"
        reason = "is not installed" if missing else "cannot be imported: " + " ".join(str(e).split())
        raise DataError(
            f"{what} needs the optional extra hf (tokenizers {reason}); fix: pip install -e .[hf]"
        ) from None
    return tokenizers


def tokenizer_file(path: str) -> str:
    """The file a tokenizer path names: ``path`` itself, or ``path/tokenizer.json`` for a
    directory (a Hugging Face model folder)."""
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (a ``tokenizer.json``), behind the same interface
    as :class:`Tokenizer`: ``vocab_size``, ``eod``, ``encode``, ``decode``, ``sha256``, ``record``.

    ``model_path`` is a ``tokenizer.json`` or a folder holding one. ``vocab_size`` counts the
    added tokens. The EOD id is the first of ``HF_EOD_TOKENS`` the vocabulary has. As with the
    sentencepiece tokenizer, special-token text inside a document is encoded as ordinary text
    (``encode_special_tokens``), never as the EOD id, and no BOS/EOS is added; ``decode`` drops
    special tokens. Raises DataError for a missing or unreadable file, no EOD token, or
    without the tokenizers package (``hf_tokenizers``).
    """

    def __init__(self, model_path: str):
        path = tokenizer_file(model_path)
        if not os.path.isfile(path):
            raise DataError(
                f"{path}: tokenizer.json not found (--tokenizer-model with --tokenizer-type "
                "HuggingFaceTokenizer names a tokenizer.json or a folder holding one)"
            )
        _HF = hf_tokenizers("--tokenizer-type HuggingFaceTokenizer").Tokenizer
        try:
            self.tok = _HF.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None
        self.tok.encode_special_tokens = True
        self.model_path = path
        self.vocab_size: int = self.tok.get_vocab_size(with_added_tokens=True)
        eod = next((self.tok.token_to_id(t) for t in HF_EOD_TOKENS if self.tok.token_to_id(t) is not None), None)
        if eod is None:
            raise DataError(
                f"{path}: has none of the end-of-document tokens {', '.join(HF_EOD_TOKENS)}; fix: "
                "add one as a special token"
            )
        self.eod: int = eod
        self.sha256: str = model_sha256(path)
        self._own_size = self.vocab_size  # ids past it were appended (add_fim_sentinels)
        self.fim: FIMSentinels | None = None

    def record(self) -> dict:
        """What ``data.preprocess`` stores beside a dataset (``PREFIX.tokenizer.json``)."""
        return {
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "model": os.path.abspath(self.model_path),
            "type": "HuggingFaceTokenizer",
        }

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Text of ``ids``, special tokens (EOD) and appended ids dropped."""
        return self.tok.decode([int(i) for i in ids if int(i) < self._own_size], skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled ``text`` (None when the tokenizer has none)."""
        return self.tok.token_to_id(text)

    def _append_ids(self, n: int) -> int:
        """Grow the vocabulary by ``n`` ids that decode to nothing; returns the first."""
        first = self.vocab_size
        self.vocab_size += n
        return first


# FIM sentinel spellings of common tokenizers, in the order prefix, middle, suffix, pad:
# Megatron-LM / StarCoder (also the names of appended ids), then Qwen2.5-Coder.
FIM_TOKEN_SETS = (
    ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"),
    ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>"),
)


def add_fim_sentinels(tok, names=None) -> FIMSentinels:
    """The prefix/middle/suffix/pad sentinels of ``tok`` (a :class:`Tokenizer` or
    :class:`HFTokenizer`), set as ``tok.fim`` and returned.

    ``names`` (``--fim-tokens``, four token texts): those tokens, each of which must exist.
    None: the first of ``FIM_TOKEN_SETS`` the tokenizer has all of; when it has none of them,
    four new ids ``vocab_size .. vocab_size + 3`` appended after its vocabulary (``vocab_size``
    grows by 4; they decode to nothing). Idempotent. Raises DataError naming ``--fim-tokens``
    when a named token is missing, a set is only partly present, or two sentinels (or a
    sentinel and the EOD) share an id.
    """
    if tok.fim is not None:
        return tok.fim
    where = f"--tokenizer-model {tok.model_path}"
    if names is not None:
        ids = [tok.token_id(n) for n in names]
        missing = [n for n, i in zip(names, ids) if i is None]
        if missing:
            raise DataError(
                f"--fim-tokens: {missing[0]!r} is not a token of {where}; fix: name four of its "
                "tokens (prefix middle suffix pad) or drop --fim-tokens to append new ids"
            )
        found = FIMSentinels(*ids, names=tuple(names), appended=False)
    else:
        found = None
        for cand in FIM_TOKEN_SETS:
            ids = [tok.token_id(n) for n in cand]
            have = [n for n, i in zip(cand, ids) if i is not None]
            if len(have) == 4:
                found = FIMSentinels(*ids, names=cand, appended=False)
                break
            if have:
                lack = next(n for n, i in zip(cand, ids) if i is None)
                raise DataError(
                    f"--fim-tokens: {where} has the FIM token {have[0]!r} but not {lack!r}; fix: "
                    "give its four FIM tokens with --fim-tokens PREFIX MIDDLE SUFFIX PAD"
                )
        if found is None:
            first = tok._append_ids(4)
            found = FIMSentinels(first, first + 1, first + 2, first + 3)
    ids = found.ids()
    if len(set(ids)) < 4 or tok.eod in ids:
        raise DataError(
            f"--fim-tokens: the FIM sentinels of {where} ({', '.join(found.names)}) have ids "
            f"{', '.join(map(str, ids))} (EOD {tok.eod}): two of them, or one and the EOD, share an id; "
            "fix: name four distinct tokens other than the EOD"
        )
    tok.fim = found
    return found


def train_hf_tokenizer(texts, vocab_size: int, out_path: str, eod_token: str = "<|endoftext|>") -> str:
    """Train a GPT-2-style byte-level BPE ``tokenizer.json`` on an iterable of strings (any text
    round-trips: every byte is in the alphabet); ``eod_token`` is id 0. Returns ``out_path``.
    Raises DataError without the tokenizers package (``hf_tokenizers``)."""
    hf = hf_tokenizers("training a Hugging Face tokenizer")
    _HF, decoders, models, pre_tokenizers, trainers = (
        hf.Tokenizer,
        hf.decoders,
        hf.models,
        hf.pre_tokenizers,
        hf.trainers,
    )

    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eod_token],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = tmp_name(out_path)
    tok.save(tmp)
    os.replace(tmp, out_path)
    return out_path


def sentencepiece_to_hf(tok: Tokenizer):
    """A ``tokenizers.Tokenizer`` that encodes as ``tok`` (this module's sentencepiece BPE) does.

    sentencepiece's BPE merges, anywhere in the text, the adjacent pair whose merged piece
    has the highest score; Hugging Face's BPE merges the pair of lowest rank. So the vocabulary
    is the same ids, every split ``a + b`` of a piece is a merge, ranked by the merged piece's
    id (sentencepiece orders BPE pieces by score), and the whole text is one word (no
    pre-tokenizer, as ``split_by_whitespace=False``). Pieces carry real spaces instead of
    "▁", so a literal "▁" matches no piece and falls back to its three UTF-8 bytes, as
    ``Tokenizer.encode`` does; characters without a piece fall back to bytes in both.
    Control pieces become special tokens (dropped by decode). Callers must still compare
    encodings (``data.tokenizer_export.hf_tokenizer_of`` does). Raises DataError for a piece type this
    mapping does not cover, or without the tokenizers package (``hf_tokenizers``).
    """
    hf = hf_tokenizers("exporting a sentencepiece tokenizer to Hugging Face")
    AddedToken, _HF, decoders, models = hf.AddedToken, hf.Tokenizer, hf.decoders, hf.models

    sp, vocab, special = tok.sp, {}, []
    for i in range(tok.vocab_size):
        piece = sp.id_to_piece(i)
        if sp.is_control(i) or sp.is_unknown(i):
            special.append(piece)
        elif not sp.is_byte(i):
            if sp.is_unused(i) or piece.replace(_SPACE_MARK, " ") in vocab:
                raise DataError(f"{tok.model_path}: piece {piece!r} (id {i}) has no exact tokenizers equivalent")
            piece = piece.replace(_SPACE_MARK, " ")
        vocab[piece] = i
    ranked = sorted(
        (i, vocab[p[:k]], vocab[p[k:]], p[:k], p[k:])
        for p, i in vocab.items()
        if p not in special and not sp.is_byte(i)
        for k in range(1, len(p))
        if p[:k] in vocab and p[k:] in vocab
    )
    hf = _HF(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in ranked],
            unk_token=sp.id_to_piece(sp.unk_id()),
            byte_fallback=True,
        )
    )
    hf.add_special_tokens([AddedToken(p, special=True) for p in special])
    hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return hf


@functools.lru_cache(maxsize=8)
def fim_record(model_path: str, tokenizer_type: str, names=None) -> dict:
    """The FIM sentinels ``add_fim_sentinels`` gives the tokenizer at ``model_path`` (``names``:
    ``--fim-tokens``), as the record a checkpoint stores (``FIMSentinels.record``); cached."""
    tok = load_tokenizer(model_path, tokenizer_type)
    return add_fim_sentinels(tok, None if names is None else list(names)).record()  # callers must not mutate it


def model_sha256(model_path: str) -> str:
    """sha256 (hex) of the bytes of a tokenizer model file (a folder: its tokenizer.json): what
    ``PREFIX.tokenizer.json`` and checkpoints record to tell tokenizers apart. Raises OSError
    when unreadable."""
    with open(tokenizer_file(model_path), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_tokenizer(model_path: str, tokenizer_type: str = "SentencePieceTokenizer"):
    """A :class:`Tokenizer` (sentencepiece model written by ``train_tokenizer``) or an
    :class:`HFTokenizer` (``tokenizer.json``), by Megatron's ``--tokenizer-type`` name.
    Raises DataError if missing/invalid or for an unknown type."""
    if tokenizer_type == "SentencePieceTokenizer":
        return Tokenizer(model_path)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HFTokenizer(model_path)
    raise DataError(f"--tokenizer-type {tokenizer_type!r} is unknown; choose one of {', '.join(TOKENIZER_TYPES)}")


def iter_jsonl_texts(path: str, key: str = "text"):
    """Yield ``obj[key]`` of every JSONL line; raises DataError naming file and line on bad input."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: input file not found")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                text = obj[key]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(
                    f"{path}:{lineno}: not a JSON object with a string {key!r} field; fix the line or drop it"
                ) from None
            if isinstance(text, str) and text:
                yield text


def training_chunks(texts, max_chars: int = 1000, hard_max: int = 4000):
    """Cut texts into chunks of whole lines (newlines kept) of about ``max_chars`` characters."""
    for text in texts:
        buf: list[str] = []
        n = 0
        for line in text.splitlines(keepends=True):
            while len(line) > hard_max:
                yield line[:hard_max]
                line = line[hard_max:]
            buf.append(line)
            n += len(line)
            if n >= max_chars:
                yield "".join(buf)
                buf, n = [], 0
        if buf:
            yield "".join(buf)


def reservoir_sample(items, k: int, seed: int) -> list:
    """A uniform sample of ``k`` items from a stream (all of them if fewer), order shuffled."""
    rng = random.Random(seed)
    out: list = []
    for n, item in enumerate(items):
        if n < k:
            out.append(item)
        else:
            j = rng.randrange(n + 1)
            if j < k:
                out[j] = item
    rng.shuffle(out)
    return out


def train_tokenizer(
    input_path: str,
    vocab_size: int,
    out_prefix: str,
    key: str = "text",
    input_sentence_size: int = 40000,
    num_threads: int = 2,
    seed: int = 1234,
    character_coverage: float | None = None,
) -> str:
    """Train a BPE model on the ``key`` texts of a JSONL file; returns ``out_prefix + ".model"``.

    ``character_coverage`` (share of characters that get their own piece; the rest use byte
    fallback) defaults to 0.9999, or 0.99 below a 2048 vocabulary so tiny test vocabularies fit.
    Writes ``.model`` and ``.vocab`` atomically. Raises DataError for a missing/bad input file or
    a vocabulary too small for the 258 reserved pieces (unk, EOD, 256 bytes).
    """
    if vocab_size < 259 + 8:
        raise DataError(f"--vocab-size {vocab_size}: must be at least 267 (258 reserved pieces + merges)")
    chunks = reservoir_sample(training_chunks(iter_jsonl_texts(input_path, key)), input_sentence_size, seed)
    if not chunks:
        raise DataError(f"{input_path}: no non-empty {key!r} texts to train on")
    if character_coverage is None:
        character_coverage = 0.9999 if vocab_size >= 2048 else 0.99
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(chunks),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=character_coverage,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_by_whitespace=False,
            split_digits=False,
            max_sentencepiece_length=16,
            max_sentence_length=1 << 16,
            unk_id=0,
            eos_id=1,
            eos_piece=EOD_PIECE,
            bos_id=-1,
            pad_id=-1,
            hard_vocab_limit=True,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=False,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataError(
            f"{input_path}: sentencepiece training failed ({str(e).strip()}); "
            f"'too high' needs a smaller --vocab-size or more text, 'smaller than required_chars' "
            f"a larger one"
        ) from None
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n" for i in range(sp.get_piece_size()))
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    for ext, data in ((".vocab", vocab.encode("utf-8")), (".model", model.getvalue())):
        tmp = tmp_name(out_prefix + ext)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, out_prefix + ext)
    return out_prefix + ".model"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.tokenizer", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--json-key", default="text", help="field holding the text")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--out-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument(
        "--input-sentence-size",
        type=int,
        default=40000,
        help="cap on training chunks (~1000 characters each), sampled at random",
    )
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    path = train_tokenizer(
        args.input, args.vocab_size, args.out_prefix, args.json_key, args.input_sentence_size, args.threads
    )
    print(f"wrote {path} (vocab {load_tokenizer(path).vocab_size})")
    return 0


if __name__ == "__main__":
    cli_exit(main)
