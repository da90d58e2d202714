"""Supervised fine-tuning data: prompt/response and chat records -> tokens with a loss mask.

    python -m data.sft --input A.jsonl [B.parquet ...] --tokenizer-model M \\
        [--tokenizer-type HuggingFaceTokenizer] --output-prefix P \\
        [--sft-prompt-key prompt] [--sft-response-key response] [--sft-messages-key messages]

A record is one JSON object per line (or one row of a ``.parquet`` file, with pyarrow) in one
of two forms:

- ``{"prompt": P, "response": R}`` (the keys set by ``--sft-prompt-key`` /
  ``--sft-response-key``, NeMo's ``prompt_template "{input} {output}"`` without the space):
  tokens ``encode(P) + encode(R) + [EOD]``, the loss on ``encode(R)`` and the EOD;
- ``{"messages": [{"role": "system"|"user"|"assistant", "content": C}, ...]}`` (the chat form
  of OpenAI / Hugging Face ``apply_chat_template`` inputs): turn n is the header text
  ``"<|ROLE|>\\n"`` (``"\\n<|ROLE|>\\n"`` after the first turn) and then ``encode(C)``; the loss is
  on the content tokens of the assistant turns, and on the closing EOD when the last turn
  is the assistant's. Headers, system and user turns are context only.

Each record is one document of ``P.bin/.idx`` (Megatron's indexed dataset, ending with the
tokenizer's EOD id) and of the loss-mask pair ``P_loss_mask.bin/.idx`` (uint8, the same
lengths: 1 where the token is a response token, the loss of the position that predicts it).
Both are written under temporary names and renamed when complete (the mask pair first), with
``P.tokenizer.json`` beside them; a bad record (not JSON, a missing field, an unknown role,
no assistant turn) ends the run with exit code 2 and one line naming file, line and field,
leaving nothing behind.

Training (``--sft``, ``--sft-packing``) reads both pairs through ``SFTDataset``: a sample is
whole records, never a record split across samples (records longer than ``seq_length + 1``
tokens keep their first ``seq_length + 1``):

- ``pad``: one record per sample, padded with EOD tokens whose loss mask is 0;
- ``pack``: records in a shuffled order filled greedily into samples of ``seq_length + 1``
  tokens (next-fit: a record that does not fit the space left starts the next sample, the
  rest padded), as NeMo's packed sequences. Each record ends with EOD, so
  ``--reset-attention-mask`` / ``--reset-position-ids`` keep the packed records apart.

``sample[i]`` is ``(tokens [T+1], loss_mask [T+1])``; ``sft_micro_batches`` turns a global
batch into this data-parallel rank's ``(tokens, labels, loss_mask)`` ``[micro, T]`` (the mask
of the labels: ``loss_mask[1:]``), the triple the trainer carries through every layout
(megazero/context_parallel/sequence.py ``shard_micro_batch``). The sample order is a pure
function of (document lengths, seq_length, num_samples, seed, packing).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from data.indexed_dataset import (
    DataError,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    cli_exit,
    write_tokenizer_record,
)

ROLES = ("system", "user", "assistant")
PACKINGS = ("pack", "pad")


def loss_mask_prefix(prefix: str) -> str:
    """The prefix of the loss-mask pair beside the token pair ``prefix``."""
    return prefix + "_loss_mask"


@dataclass(frozen=True)
class SFTKeys:
    """The record fields: ``prompt`` / ``response`` (--sft-prompt-key / --sft-response-key) and
    ``messages`` (--sft-messages-key, the chat form, used when a record has it)."""

    prompt: str = "prompt"
    response: str = "response"
    messages: str = "messages"


# -- records -> tokens and loss mask -----------------------------------------------------------
def _text(obj: dict, key: str, flag: str, where: str, keys: SFTKeys) -> str:
    if key not in obj:
        raise DataError(
            f"{where}: missing field {key!r} ({flag}); a record needs {keys.prompt!r} and "
            f"{keys.response!r}, or {keys.messages!r}"
        )
    if not isinstance(obj[key], str):
        raise DataError(f"{where}: field {key!r} is {type(obj[key]).__name__}, not a string")
    return obj[key]


def _chat_pieces(messages, where: str, keys: SFTKeys) -> list[tuple[str, bool]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f'{where}: field {keys.messages!r} must be a non-empty list of {{"role": ..., "content": ...}} turns'
        )
    pieces = []
    for n, turn in enumerate(messages):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DataError(f"{where}: turn {n} of {keys.messages!r} needs fields 'role' and 'content'")
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            raise DataError(f"{where}: turn {n} has unknown role {role!r}; fix: one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: turn {n}'s 'content' is {type(content).__name__}, not a string")
        pieces.append((("\n" if n else "") + f"<|{role}|>\n", False))
        pieces.append((content, role == "assistant"))
    return pieces


def record_pieces(obj, where: str, keys: SFTKeys = SFTKeys()) -> list[tuple[str, bool]]:
    """One record -> its texts in order, each with whether it is in the loss (module doc).

    Raises DataError naming ``where`` (``file:line``) and the field: not an object, a missing
    or non-string field, an unknown role, no text in the loss."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a record must be a JSON object, not {type(obj).__name__}")
    if obj.get(keys.messages) is not None:  # a parquet row of a prompt/response record has a null
        pieces = _chat_pieces(obj[keys.messages], where, keys)
    else:
        pieces = [
            (_text(obj, keys.prompt, "--sft-prompt-key", where, keys), False),
            (_text(obj, keys.response, "--sft-response-key", where, keys), True),
        ]
    if not any(loss for _, loss in pieces):
        raise DataError(
            f"{where}: no assistant turn, so nothing of the record is in the loss; fix: add one or drop the record"
        )
    return pieces


def encode_record(pieces: list[tuple[str, bool]], tok) -> tuple[np.ndarray, np.ndarray]:
    """``record_pieces`` -> (token ids int64 [n], loss mask uint8 [n]) ending with the EOD id,
    whose mask is that of the last piece (the response ends there)."""
    ids, mask = [], []
    for text, loss in pieces:
        t = tok.encode(text) if text else []
        ids += t
        mask += [int(loss)] * len(t)
    ids.append(tok.eod)
    mask.append(int(pieces[-1][1]))
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def _jsonl_records(path: str) -> Iterator[tuple[str, object]]:
    """(``file:line``, record) of a JSONL file, plain, ``.gz`` or ``.zst`` (``data.sources``'
    reader: a truncated or corrupt compressed file is a DataError, never a shorter corpus)."""
    from data.sources import JsonlSource

    src = JsonlSource(path)
    src.check([])
    for lineno, line, _ in src.items([], 0):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def _parquet_records(path: str) -> Iterator[tuple[str, object]]:
    """(``file: row N``, record) of every row of a parquet file, 1,024 rows decoded at a time
    (the chat form's ``messages`` column is a list of structs, so rows are read whole). Rows
    count from 0, as ``data.preprocess`` counts them (``data.sources``) and as ``ds[i]``."""
    from data.sources import require_data_extra

    pyarrow = require_data_extra("pyarrow", f"--input {path}")
    pq = require_data_extra("pyarrow.parquet", f"--input {path}")
    try:
        rows = pq.ParquetFile(path)
        row = 0
        for batch in rows.iter_batches(batch_size=1024):
            for obj in batch.to_pylist():
                yield f"{path}: row {row}", obj
                row += 1
    except (OSError, pyarrow.ArrowException) as e:
        raise DataError(f"{path}: unreadable parquet file ({e})") from None


def iter_records(paths: list[str]) -> Iterator[tuple[str, object]]:
    """(``file:line`` (from 1) or ``file: row N`` (from 0), record) of every record of ``paths`` in order (JSONL,
    ``.jsonl.gz``, ``.jsonl.zst`` or ``.parquet``). Raises DataError for a missing file or a
    bad line."""
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{path}: input file not found (--input)")
        yield from (_parquet_records(path) if path.endswith(".parquet") else _jsonl_records(path))


def preprocess_sft(
    inputs: list[str],
    model_path: str,
    output_prefix: str,
    keys: SFTKeys = SFTKeys(),
    tokenizer_type: str = "SentencePieceTokenizer",
) -> dict:
    """Tokenize the records of ``inputs`` into ``output_prefix`` (tokens) and its loss-mask pair.

    Returns stats: records, tokens, loss_tokens (mask ones), prefix. Raises DataError on bad
    input; no output file survives an error."""
    from data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path, tokenizer_type)
    stats = dict(records=0, tokens=0, loss_tokens=0, prefix=output_prefix)
    with (
        IndexedDatasetBuilder(output_prefix, best_dtype(tok.vocab_size)) as tokens,
        IndexedDatasetBuilder(loss_mask_prefix(output_prefix), np.uint8) as masks,
    ):
        for where, obj in iter_records(inputs):
            ids, mask = encode_record(record_pieces(obj, where, keys), tok)
            tokens.add_document(ids)
            masks.add_document(mask)
            stats["records"] += 1
            stats["tokens"] += len(ids)
            stats["loss_tokens"] += int(mask.sum())
        if stats["records"] == 0:
            raise DataError(f"{', '.join(inputs)}: no records")
        masks.finalize()
        tokens.finalize()
    write_tokenizer_record(output_prefix, tok.record())
    return stats


# -- samples: whole records, packed or padded --------------------------------------------------
def next_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Sample index of each record [n] when records in this order fill samples of ``capacity``
    tokens greedily (a record that does not fit the space left starts the next sample)."""
    out = np.empty(len(lengths), dtype=np.int64)
    sample, used = 0, 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > capacity and used > 0:
            sample, used = sample + 1, 0
        out[i] = sample
        used += n
    return out


def build_sft_index(
    lengths: np.ndarray, capacity: int, num_samples: int, seed: int, packing: str
) -> tuple[np.ndarray, np.ndarray]:
    """(records [K] positions in ``lengths``, starts [num_samples + 1]): sample i holds records
    ``records[starts[i]:starts[i+1]]``. Epoch e visits every record once in the order of
    ``default_rng([seed, e]).permutation``; with ``pack`` its records are next-fit into
    samples (no sample spans two epochs), with ``pad`` each record is a sample. The first k
    samples do not depend on ``num_samples``: a run extended or resumed sees the same ones."""
    lengths = np.minimum(lengths.astype(np.int64), capacity)
    orders, counts, total, epoch = [], [], 0, 0
    while total < num_samples:
        perm = np.random.default_rng([seed, epoch]).permutation(len(lengths))
        which = next_fit(lengths[perm], capacity) if packing == "pack" else np.arange(len(perm))
        per_sample = np.bincount(which)
        orders.append(perm)
        counts.append(per_sample)
        total += len(per_sample)
        epoch += 1
    counts = np.concatenate(counts)[:num_samples] if counts else np.zeros(0, dtype=np.int64)
    starts = np.zeros(num_samples + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    records = np.concatenate(orders)[: starts[-1]] if orders else np.zeros(0, dtype=np.int64)
    return records.astype(np.int64), starts


class SFTDataset:
    """``num_samples`` samples of ``seq_length + 1`` tokens, each whole records of documents
    [start, end) of ``tokens`` with their loss mask from ``masks`` (module doc).

    ``ds[i]`` -> (tokens int64 [T+1], loss_mask uint8 [T+1]); padding is ``pad_id`` with mask 0.
    ``records(i)``: the document ids in sample i. Raises DataError when the two pairs'
    lengths differ or the range holds no documents.
    """

    def __init__(
        self,
        tokens: IndexedDataset,
        masks: IndexedDataset,
        doc_range: tuple[int, int],
        seq_length: int,
        num_samples: int,
        seed: int,
        packing: str = "pack",
        pad_id: int = 0,
    ):
        if packing not in PACKINGS:
            raise DataError(f"--sft-packing {packing!r}: one of {', '.join(PACKINGS)}")
        if not np.array_equal(tokens.sizes, masks.sizes) or not np.array_equal(tokens.doc_idx, masks.doc_idx):
            raise DataError(
                f"{masks.prefix}.idx: its lengths differ from {tokens.prefix}.idx; rebuild both with python -m data.sft"
            )
        a, b = doc_range
        if b <= a:
            raise DataError(f"{tokens.prefix}: documents {a}..{b - 1}: an empty range")
        self.tokens, self.masks, self.pad_id = tokens, masks, pad_id
        self.capacity, self.num_samples = seq_length + 1, num_samples
        self.first_doc = a
        seq_ids = np.arange(tokens.doc_idx[a], tokens.doc_idx[b], dtype=np.int64)
        order, self.starts = build_sft_index(
            np.asarray(tokens.sizes)[seq_ids], self.capacity, num_samples, seed, packing
        )
        self.order = seq_ids[order]

    def __len__(self) -> int:
        return self.num_samples

    def records(self, i: int) -> np.ndarray:
        """Sequence (= document) ids of the records in sample ``i``."""
        return self.order[self.starts[i] : self.starts[i + 1]]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        cap = self.capacity
        ids = np.full(cap, self.pad_id, dtype=np.int64)
        mask = np.zeros(cap, dtype=np.uint8)
        at = 0
        for s in self.records(i).tolist():
            n = min(int(self.tokens.sizes[s]), cap - at)
            ids[at : at + n] = self.tokens.get(s, 0, n)
            mask[at : at + n] = self.masks.get(s, 0, n)
            at += n
        return ids, mask


def open_loss_masks(prefix: str) -> IndexedDataset:
    """The loss-mask pair of the SFT dataset ``prefix``; DataError naming the fix when missing."""
    mp = loss_mask_prefix(prefix)
    if not (os.path.isfile(mp + ".bin") and os.path.isfile(mp + ".idx")):
        raise DataError(
            f"--data-path {prefix} with --sft: {mp}.bin/.idx not found (the loss mask); fix: "
            "make the data with python -m data.sft, or drop --sft"
        )
    return IndexedDataset(mp)


def sft_micro_batches(
    dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[tuple]:
    """This data-parallel rank's micro-batches of SFT samples (``data.samplers.get_micro_batches``'
    slicing): ``(tokens, labels, loss_mask)``, int64, int64 and float32 ``[micro, T]``, with
    tokens = sample[:-1], labels = sample[1:], loss_mask = mask[1:]. Raises DataError as
    get_micro_batches does."""
    import torch

    from data.samplers import dp_sample_range

    indices = dp_sample_range(consumed_samples, global_batch_size, dp_rank, dp_size)
    if micro_batch_size < 1 or len(indices) % micro_batch_size:
        raise DataError(
            f"global batch size {global_batch_size} / data-parallel size {dp_size} = "
            f"{len(indices)} samples per rank is not a multiple of micro batch size {micro_batch_size}"
        )
    if consumed_samples + global_batch_size > len(dataset):
        raise DataError(
            f"dataset has {len(dataset)} samples but the global batch after {consumed_samples} "
            f"consumed samples needs {consumed_samples + global_batch_size}"
        )
    pairs = [dataset[i] for i in indices]
    ids = torch.from_numpy(np.stack([p[0] for p in pairs]))  # [GBS/dp, T+1]
    mask = torch.from_numpy(np.stack([p[1] for p in pairs]).astype(np.float32))
    return [
        (
            ids[m : m + micro_batch_size, :-1].contiguous(),
            ids[m : m + micro_batch_size, 1:].contiguous(),
            mask[m : m + micro_batch_size, 1:].contiguous(),
        )
        for m in range(0, len(indices), micro_batch_size)
    ]


def main(argv: Optional[list[str]] = None) -> int:
    from data.tokenizer import TOKENIZER_TYPES

    p = argparse.ArgumentParser(prog="python -m data.sft", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="JSONL (.jsonl, .jsonl.gz) or .parquet files")
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx and PREFIX_loss_mask.bin/.idx")
    p.add_argument("--sft-prompt-key", default="prompt")
    p.add_argument("--sft-response-key", default="response")
    p.add_argument("--sft-messages-key", default="messages", help="the chat form's list of turns")
    args = p.parse_args(argv)
    keys = SFTKeys(args.sft_prompt_key, args.sft_response_key, args.sft_messages_key)
    s = preprocess_sft(args.input, args.tokenizer_model, args.output_prefix, keys, args.tokenizer_type)
    print(
        f"{s['records']} records, {s['tokens']} tokens, {s['loss_tokens']} of them in the loss -> "
        f"{s['prefix']}.bin/.idx, {loss_mask_prefix(s['prefix'])}.bin/.idx"
    )
    return 0


if __name__ == "__main__":
    cli_exit(main)
