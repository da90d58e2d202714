"""Preference data for DPO and reward models: (prompt, chosen, rejected) records -> token pairs.

    python -m data.preference --input A.jsonl [B.parquet ...] --tokenizer-model M \\
        [--tokenizer-type HuggingFaceTokenizer] --output-prefix P [--seq-length T] \\
        [--prompt-key prompt] [--chosen-key chosen] [--rejected-key rejected] \\
        [--margin-key margin] [--messages-key messages]

A record (one JSON line, or one parquet row, read as ``data.sft`` reads them) is one of:

- ``{"prompt": P, "chosen": C, "rejected": R, "margin"?: m}``: the two responses of the
  prompt/response form of ``data.sft``, ``encode(P) + encode(C) + [EOD]`` and
  ``encode(P) + encode(R) + [EOD]``, the loss on the response and the EOD;
- chat, with the turns rendered exactly as ``data.sft`` renders ``messages`` (the same
  ``<|ROLE|>`` headers): ``{"chosen": [turns...], "rejected": [turns...]}`` (TRL's
  conversational preference form: both conversations share every turn but the last, which
  is the assistant's), or ``{"messages": [turns...], "chosen": {"role": "assistant",
  "content": ...}, "rejected": {...}}`` (the shared turns apart, one answer each). The loss
  is on the final assistant turn's content and the closing EOD only: earlier assistant
  turns are context, as TRL's and OpenRLHF's DPO trainers score only the completion.

``margin`` (a number, 0 when absent or null) is the preference strength some reward-model
losses subtract (LLaMA-2, section 3.2.2); it is stored, never interpreted here.

Output (record i of the inputs, in order, is pair i):

- ``P.bin/.idx``: Megatron's indexed dataset, document ``2i`` the chosen sequence and
  ``2i + 1`` the rejected one; ``P_loss_mask.bin/.idx`` the uint8 loss mask of the same
  lengths (``data.sft``'s pair: 1 on response tokens);
- ``P_pairs.npz``: ``margin`` float32 [N], and where each pair came from (``input`` int32 [N],
  an index into ``inputs``, the paths; ``position`` int64 [N], the JSONL line from 1 or the
  parquet row from 0), so an error at read time names the record as preprocessing would;
- ``P.tokenizer.json``.

Everything is written under temporary names and renamed when complete (the npz, the mask
pair, then the token pair); a bad record (a missing field, a non-string response, chat
conversations whose shared turns differ, a prompt that leaves no response token within
``--seq-length + 1`` tokens) ends the run with exit code 2 and one line naming file, line
(or row) and field, leaving nothing behind.

Training reads ``PreferencePairs(P)``; ``preference_micro_batches`` builds a micro-batch of
whole pairs, chosen in row 2j and rejected in row 2j + 1, so a pair is never split across
micro-batches or data-parallel ranks (a rank's share of a global batch is a range of pairs).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from data.indexed_dataset import (
    DataError,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    cli_exit,
    tmp_name,
    write_tokenizer_record,
)
from data.sft import SFTKeys, encode_record, iter_records, loss_mask_prefix, record_pieces


def pairs_path(prefix: str) -> str:
    """The per-pair file (margins and record positions) beside the token pair ``prefix``."""
    return prefix + "_pairs.npz"


@dataclass(frozen=True)
class PreferenceKeys:
    """The record fields, each set by the flag of the same name (``--prompt-key`` ...)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    margin: str = "margin"
    messages: str = "messages"


# -- one record -> two (pieces) lists ----------------------------------------------------------
def _missing(obj: dict, key: str, flag: str, where: str, keys: PreferenceKeys) -> None:
    if obj.get(key) is None:
        raise DataError(
            f"{where}: missing field {key!r} ({flag}); a preference record needs {keys.chosen!r} and "
            f"{keys.rejected!r}, and {keys.prompt!r} when they are strings"
        )


def _plain_pieces(obj: dict, where: str, keys: PreferenceKeys) -> list[list[tuple[str, bool]]]:
    _missing(obj, keys.prompt, "--prompt-key", where, keys)
    for key in (keys.prompt, keys.chosen, keys.rejected):
        if not isinstance(obj[key], str):
            raise DataError(
                f"{where}: field {key!r} is {type(obj[key]).__name__}, not a string (the prompt/response "
                "form; the chat form takes lists of turns for both answers)"
            )
    return [[(obj[keys.prompt], False), (obj[key], True)] for key in (keys.chosen, keys.rejected)]


def _turns(value, key: str, where: str) -> list:
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and value:
        return value
    raise DataError(
        f'{where}: field {key!r} is {type(value).__name__}; a chat record needs a list of {{"role", "content"}} '
        "turns or one such turn"
    )


def _chat_render(turns: list, key: str, where: str) -> list[tuple[str, bool]]:
    """data.sft's rendering of ``turns``, the loss on the final (assistant) turn only."""
    try:
        pieces = record_pieces({key: turns}, where, SFTKeys(messages=key))
    except DataError as e:  # name the field where data.sft's line names only the turn
        msg = str(e)
        raise DataError(
            msg if repr(key) in msg else msg.replace(f"{where}: ", f"{where}: field {key!r}: ", 1)
        ) from None
    return [(text, False) for text, _ in pieces[:-1]] + [pieces[-1]]


def _chat_pieces(obj: dict, where: str, keys: PreferenceKeys) -> list[list[tuple[str, bool]]]:
    shared = obj.get(keys.messages)
    shared = [] if shared is None else _turns(shared, keys.messages, where)
    if shared:  # check the shared turns under their own field's name (a stand-in answer closes them)
        _chat_render(shared + [{"role": "assistant", "content": ""}], keys.messages, where)
    convs = [shared + _turns(obj[k], k, where) for k in (keys.chosen, keys.rejected)]
    for key, conv in zip((keys.chosen, keys.rejected), convs):
        last = conv[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            raise DataError(
                f"{where}: field {key!r}: the final turn must be the assistant's (the answer compared); "
                f"its role is {last.get('role') if isinstance(last, dict) else last!r}"
            )
    (c, r), kc, kr = convs, keys.chosen, keys.rejected
    if c[:-1] != r[:-1]:
        n = next((i for i, (a, b) in enumerate(zip(c[:-1], r[:-1])) if a != b), min(len(c), len(r)) - 1)
        raise DataError(
            f"{where}: fields {kc!r} and {kr!r} differ at turn {n}, before their final assistant turns "
            f"({len(c)} and {len(r)} turns); fix: the two conversations may differ only in the last turn"
        )
    return [_chat_render(conv, key, where) for key, conv in zip((kc, kr), convs)]


def _margin(obj: dict, where: str, keys: PreferenceKeys) -> float:
    m = obj.get(keys.margin)
    if m is None:
        return 0.0
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
        raise DataError(f"{where}: field {keys.margin!r} is {m!r}; a finite number or absent (--margin-key)")
    return float(m)


def pair_pieces(obj, where: str, keys: PreferenceKeys = PreferenceKeys()) -> tuple[list, list, float]:
    """One record -> (chosen pieces, rejected pieces, margin), pieces as ``data.sft.record_pieces``
    gives them: ``[(text, in_the_loss), ...]`` in order (module doc for the forms).

    Raises DataError naming ``where`` and the field: not an object, a missing chosen or rejected,
    a non-string prompt/response, a chat whose turns before the final answer differ, a final
    turn that is not the assistant's, a bad turn (data.sft's checks), a margin that is not a number.
    """
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a record must be a JSON object, not {type(obj).__name__}")
    _missing(obj, keys.chosen, "--chosen-key", where, keys)
    _missing(obj, keys.rejected, "--rejected-key", where, keys)
    chat = isinstance(obj[keys.chosen], (list, dict))
    chosen, rejected = (_chat_pieces if chat else _plain_pieces)(obj, where, keys)
    return chosen, rejected, _margin(obj, where, keys)


def check_scored(mask: np.ndarray, seq_length: int, what: str, where: str) -> None:
    """DataError unless a response token is a label within the first ``seq_length + 1`` tokens:
    ``mask[1 : seq_length + 1]`` (uint8 [n]) has a one (the first token is never a label).
    ``what`` names the sequence (the field, or chosen / rejected), ``where`` the record."""
    if not mask[1 : seq_length + 1].any():
        first = int(np.argmax(mask)) if mask.any() else len(mask)
        raise DataError(
            f"{where}: {what}: the response starts at token {first}, so none of it is within "
            f"--seq-length {seq_length} + 1 tokens; fix: shorten the prompt, raise --seq-length, or drop the record"
        )


# -- records -> files ----------------------------------------------------------------------------
def _position(where: str) -> int:
    """The line (``file:7``) or row (``file: row 7``) of an ``iter_records`` location."""
    return int(re.split(r"[: ]", where)[-1])


def preprocess_preference(
    inputs: list[str],
    model_path: str,
    output_prefix: str,
    keys: PreferenceKeys = PreferenceKeys(),
    tokenizer_type: str = "SentencePieceTokenizer",
    seq_length: Optional[int] = None,
) -> dict:
    """Tokenize the records of ``inputs`` into ``output_prefix`` (module doc for the files).

    ``seq_length``: when given, a pair whose chosen or rejected has no response label within
    ``seq_length + 1`` tokens is an error here (``check_scored``). Returns stats: pairs, tokens,
    loss_tokens, prefix. Raises DataError on bad input; no output file survives an error."""
    from data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path, tokenizer_type)
    if seq_length is not None and seq_length < 1:
        raise DataError(f"--seq-length {seq_length}: must be at least 1")
    stats = dict(pairs=0, tokens=0, loss_tokens=0, prefix=output_prefix)
    margins, sources, positions = [], [], []
    tmp = None
    try:
        with (
            IndexedDatasetBuilder(output_prefix, best_dtype(tok.vocab_size)) as tokens,
            IndexedDatasetBuilder(loss_mask_prefix(output_prefix), np.uint8) as masks,
        ):
            for k, path in enumerate(inputs):
                for where, obj in iter_records([path]):
                    chosen, rejected, margin = pair_pieces(obj, where, keys)
                    for side, pieces in (("chosen", chosen), ("rejected", rejected)):
                        ids, mask = encode_record(pieces, tok)
                        if seq_length is not None:
                            check_scored(mask, seq_length, f"field {getattr(keys, side)!r}", where)
                        tokens.add_document(ids)
                        masks.add_document(mask)
                        stats["tokens"] += len(ids)
                        stats["loss_tokens"] += int(mask.sum())
                    margins.append(margin)
                    sources.append(k)
                    positions.append(_position(where))
                    stats["pairs"] += 1
            if stats["pairs"] == 0:
                raise DataError(f"{', '.join(inputs)}: no records")
            tmp = tmp_name(pairs_path(output_prefix))
            with open(tmp, "wb") as f:
                np.savez(
                    f,
                    margin=np.asarray(margins, dtype=np.float32),
                    input=np.asarray(sources, dtype=np.int32),
                    position=np.asarray(positions, dtype=np.int64),
                    inputs=np.asarray([os.fspath(p) for p in inputs], dtype=str),
                )
            os.replace(tmp, pairs_path(output_prefix))
            tmp = None
            masks.finalize()
            tokens.finalize()
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    write_tokenizer_record(output_prefix, tok.record())
    return stats


# -- reading and micro-batches -------------------------------------------------------------------
class PreferencePairs:
    """The pairs written by ``preprocess_preference`` at ``prefix`` (module doc).

    ``len(pairs)``: N pairs; ``pair(i)`` -> (chosen_tokens int64 [n_c], chosen_mask uint8 [n_c],
    rejected_tokens int64 [n_r], rejected_mask uint8 [n_r], margin float); ``where(i)``: the
    record's ``file:line`` or ``file: row N``. Raises DataError naming the missing or
    inconsistent file and the fix (rebuild with python -m data.preference).
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        path = pairs_path(prefix)
        if not os.path.isfile(path):
            raise DataError(
                f"{path}: file not found (the per-pair margins); fix: make {prefix} with python -m data.preference"
            )
        self.tokens = IndexedDataset(prefix)
        self.masks = IndexedDataset(loss_mask_prefix(prefix))
        with np.load(path) as z:
            self.margins, self.inputs = z["margin"], [str(p) for p in z["inputs"]]
            self.input, self.position = z["input"], z["position"]
        if (
            self.tokens.num_documents != 2 * len(self.margins)
            or not np.array_equal(self.tokens.sizes, self.masks.sizes)
            or not np.array_equal(self.tokens.doc_idx, self.masks.doc_idx)
        ):
            raise DataError(
                f"{prefix}: {self.tokens.num_documents} documents, {self.masks.num_documents} masks and "
                f"{len(self.margins)} pairs do not agree (two documents a pair, masks of the same lengths); "
                "rebuild all with python -m data.preference"
            )

    def __len__(self) -> int:
        return len(self.margins)

    def where(self, i: int) -> str:
        path, pos = self.inputs[int(self.input[i])], int(self.position[i])
        return f"{path}: row {pos}" if path.endswith(".parquet") else f"{path}:{pos}"

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
        if not 0 <= i < len(self):
            raise IndexError(f"pair {i} out of range [0, {len(self)})")
        c, r = int(self.tokens.doc_idx[2 * i]), int(self.tokens.doc_idx[2 * i + 1])
        return (
            np.asarray(self.tokens[c], dtype=np.int64),
            np.asarray(self.masks[c], dtype=np.uint8),
            np.asarray(self.tokens[r], dtype=np.int64),
            np.asarray(self.masks[r], dtype=np.uint8),
            float(self.margins[i]),
        )


class PreferenceSplit:
    """One split of the pairs as a sequence dataset for training: sample ``2k`` is the chosen and
    ``2k + 1`` the rejected sequence of the ``k``-th pair drawn, so data.sft's ``sft_micro_batches``
    slices it into ``(tokens, labels, loss_mask)`` micro-batches and a data-parallel rank's
    share (an even number of samples) holds whole pairs.

    ``pairs``: a PreferencePairs; ``indices``: the pair ids of this split (``--split`` applied
    to the pairs in file order); ``num_samples``: the sequences it must serve; ``seq_length``:
    tokens per sample (each sample has ``seq_length + 1``: right-padded with ``pad_id`` at
    mask 0, cut at ``seq_length + 1``); ``seed``: the pairs are drawn in a fresh permutation of
    ``indices`` each epoch (numpy ``default_rng((seed, epoch))``), so the order does not depend
    on the layout. ``dataset[i]`` -> (ids int64 [T + 1], mask uint8 [T + 1]); ``pair_of(i)``:
    the pair id of sample ``i``. Raises DataError for an empty split, and, on reading, for a
    sequence with no response label within ``seq_length + 1`` tokens (naming its record)."""

    def __init__(self, pairs: PreferencePairs, indices, num_samples: int, seq_length: int, seed: int, pad_id: int):
        self.pairs, self.indices = pairs, np.asarray(indices, dtype=np.int64)
        if len(self.indices) == 0:
            raise DataError(f"{pairs.prefix}: the split holds no pair; fix: give it a positive share in --split")
        self.num_samples, self.seq_length, self.seed, self.pad_id = num_samples, seq_length, seed, pad_id
        self._epoch, self._order = -1, None

    def __len__(self) -> int:
        return self.num_samples

    def pair_of(self, i: int) -> int:
        k = i // 2
        epoch, j = divmod(k, len(self.indices))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng((self.seed, epoch)).permutation(self.indices)
        return int(self._order[j])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        p = self.pair_of(i)
        ct, cm, rt, rm, _ = self.pairs.pair(p)
        t, m, side = (ct, cm, "chosen") if i % 2 == 0 else (rt, rm, "rejected")
        check_scored(m, self.seq_length, f"the {side} sequence", f"{self.pairs.where(p)} (pair {p})")
        cap = self.seq_length + 1
        ids = np.full(cap, self.pad_id, dtype=np.int64)
        mask = np.zeros(cap, dtype=np.uint8)
        k = min(len(t), cap)
        ids[:k], mask[:k] = t[:k], m[:k]
        return ids, mask


def split_margins(
    split: "PreferenceSplit",
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> list:
    """The margins of this data-parallel rank's micro-batches of ``split``, in the order
    ``data.sft.sft_micro_batches`` slices the same samples: one float32 tensor ``[micro/2]`` per
    micro-batch (the margin of the pair in rows 2j, 2j + 1; 0 for a record without one). Raises
    DataError as ``sft_micro_batches`` does for sizes that do not divide."""
    import torch

    from data.samplers import dp_sample_range

    indices = list(dp_sample_range(consumed_samples, global_batch_size, dp_rank, dp_size))
    if micro_batch_size < 2 or micro_batch_size % 2 or len(indices) % micro_batch_size:
        raise DataError(
            f"--micro-batch-size {micro_batch_size}: {len(indices)} samples per data-parallel rank must split "
            "into micro-batches of whole pairs (an even size that divides them)"
        )
    margins = np.asarray([split.pairs.margins[split.pair_of(i)] for i in indices[0::2]], dtype=np.float32)
    n = micro_batch_size // 2
    return [torch.from_numpy(margins[m : m + n].copy()) for m in range(0, len(margins), n)]


def preference_splits(prefix: str, split: str, num_samples, seq_length: int, seed: int, pad_id: int):
    """(train, valid, test) ``PreferenceSplit`` of the pairs at ``prefix`` by ``--split``
    (``data.gpt_dataset.split_ranges`` over the pairs in file order; an empty valid or test
    split is None); ``num_samples`` the sequences each must serve. Raises DataError."""
    from data.gpt_dataset import parse_split, split_ranges

    pairs = PreferencePairs(prefix)
    out = []
    for (a, b), n, name in zip(split_ranges(len(pairs), parse_split(split)), num_samples, ("train", "valid", "test")):
        if b > a:
            out.append(PreferenceSplit(pairs, range(a, b), n, seq_length, seed, pad_id))
        elif name == "train":
            raise DataError(f"--split {split} leaves no pair of {prefix} for training; fix: e.g. --split 95,5,0")
        else:
            out.append(None)
    return tuple(out)


class PreferenceBatch(NamedTuple):
    """One micro-batch of B/2 pairs: ``tokens``, ``labels`` int64 [B, T], ``loss_mask`` float32
    [B, T] (rows 2j chosen, 2j + 1 rejected, of pair start + j), ``margin`` float32 [B/2]."""

    tokens: object
    labels: object
    loss_mask: object
    margin: object


def preference_micro_batches(pairs, start: int, micro_batch_size: int, seq_length: int, pad_id: int):
    """The micro-batch of pairs ``start .. start + micro_batch_size/2 - 1`` as a PreferenceBatch.

    Each sequence keeps its first ``seq_length + 1`` tokens, right-padded with ``pad_id`` at
    mask 0; tokens = seq[:-1], labels = seq[1:], loss_mask = mask[1:] (data.sft's triple).
    A data-parallel rank takes a range of whole pairs, so ``start`` counts pairs.

    Raises DataError: an odd ``micro_batch_size`` (--micro-batch-size), pairs past the end, and
    a pair with no response label within ``seq_length + 1`` tokens (naming its record)."""
    import torch

    if micro_batch_size < 2 or micro_batch_size % 2:
        raise DataError(
            f"--micro-batch-size {micro_batch_size}: preference training puts a chosen and a rejected "
            "sequence of one pair in the same micro-batch, so it must be even; fix: e.g. --micro-batch-size "
            f"{max(2, micro_batch_size + 1)}"
        )
    n = micro_batch_size // 2
    if start < 0 or start + n > len(pairs):
        raise DataError(f"{pairs.prefix}: pairs {start}..{start + n - 1} asked, but it holds {len(pairs)}")
    cap = seq_length + 1
    ids = np.full((micro_batch_size, cap), pad_id, dtype=np.int64)
    mask = np.zeros((micro_batch_size, cap), dtype=np.float32)
    margin = np.zeros(n, dtype=np.float32)
    for j in range(n):
        ct, cm, rt, rm, margin[j] = pairs.pair(start + j)
        for row, side, t, m in ((2 * j, "chosen", ct, cm), (2 * j + 1, "rejected", rt, rm)):
            check_scored(m, seq_length, f"the {side} sequence", f"{pairs.where(start + j)} (pair {start + j})")
            k = min(len(t), cap)
            ids[row, :k], mask[row, :k] = t[:k], m[:k]
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)  # [B, T+1]
    return PreferenceBatch(
        ids_t[:, :-1].contiguous(), ids_t[:, 1:].contiguous(), mask_t[:, 1:].contiguous(), torch.from_numpy(margin)
    )


def main(argv: Optional[list[str]] = None) -> int:
    from data.tokenizer import TOKENIZER_TYPES

    p = argparse.ArgumentParser(prog="python -m data.preference", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or .parquet files")
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin/.idx, PREFIX_loss_mask.*, PREFIX_pairs.npz"
    )
    p.add_argument("--seq-length", type=int, default=None, help="refuse pairs with no response label within it + 1")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--chosen-key", default="chosen")
    p.add_argument("--rejected-key", default="rejected")
    p.add_argument("--margin-key", default="margin")
    p.add_argument("--messages-key", default="messages", help="the chat form's shared turns")
    args = p.parse_args(argv)
    keys = PreferenceKeys(args.prompt_key, args.chosen_key, args.rejected_key, args.margin_key, args.messages_key)
    s = preprocess_preference(
        args.input, args.tokenizer_model, args.output_prefix, keys, args.tokenizer_type, args.seq_length
    )
    print(
        f"{s['pairs']} pairs, {s['tokens']} tokens, {s['loss_tokens']} of them in the loss -> "
        f"{s['prefix']}.bin/.idx, {loss_mask_prefix(s['prefix'])}.bin/.idx, {pairs_path(s['prefix'])}"
    )
    return 0


if __name__ == "__main__":
    cli_exit(main)
