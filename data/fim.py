"""Fill-in-the-middle (FIM): a GPT sample rewritten at read time so that a left-to-right model
learns to infill (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the
Middle"; Megatron-LM's ``GPTFIMDataset`` and its flags ``--fim-rate``, ``--fim-spm-rate``,
``--fim-split-sample``, ``--fim-fragment-rate``, ``--fim-no-prefix``).

A *unit* of text is cut at two points drawn uniformly from its positions into prefix, middle
and suffix, then written in one of the paper's two orders (section 3; SPM as its appendix's
variant 2, the one Megatron uses, where prefix and middle stay contiguous):

    PSM:  <PRE> prefix <SUF> suffix <MID> middle
    SPM:  <PRE> <SUF> suffix <MID> prefix middle

Units, as Megatron's context-level FIM (the paper's appendix B.1): the sample is split at every
EOD token, and each non-empty document piece is one unit, transformed with probability
``rate``. With ``split_sample`` (a token id, e.g. a file separator), a document piece that holds
that token is first kept or not with probability ``rate``, and if kept each non-empty fragment
between split tokens is a unit transformed with probability ``fragment_rate``. The EOD and split
tokens stay in place. A unit whose decoded text starts with ``no_prefix`` is left as it is.

What differs from Megatron, on purpose:

- *Cut points at token boundaries.* Megatron decodes a unit to characters, cuts the text and
  re-tokenizes the three parts (the paper's character-level spans); here the cut falls between
  tokens, so no tokenizer runs in the data path and the transform is exactly invertible
  (``fim_inverse``). The model never sees a token split by the cursor position; prompts at
  inference should be cut at a token boundary too.
- *A pure function of (seed, sample index).* Megatron draws from one RandomState per dataset,
  so a sample depends on which samples were read before it (on the layout and on where a run
  resumed). Here sample ``i`` draws from ``np.random.default_rng([seed, i, FIM_TAG])``: every
  (tp, pp, dp) layout and every resume sees the same samples.
- *Length kept by cutting the content's end.* Each transformed unit adds 3 sentinels. Megatron
  cuts the output's last tokens (the last unit's middle, usually); here units are written in
  order into the fixed budget of ``len(sample)`` tokens and the last one written is shortened
  at its end *before* it is cut, so the sentinels displace the sample's last tokens: undoing
  the transform gives exactly the first ``len(sample) - 3k`` tokens of the original (k =
  transformed units). A unit that reaches the budget with fewer than 4 slots left is written
  as it is. The output never falls short of the length, so the pad sentinel (kept for
  Megatron's id layout and for prompts) is never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from data.indexed_dataset import DataError

FIM_TAG = 0x46494D  # "FIM": keeps these draws apart from other (seed, index) generators


@dataclass(frozen=True)
class FIMSentinels:
    """Token ids of the four FIM sentinels; ``appended``: ids added after the tokenizer's own
    vocabulary (else the tokenizer's own special tokens ``names``)."""

    prefix: int
    middle: int
    suffix: int
    pad: int
    names: tuple = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")
    appended: bool = True

    def ids(self) -> tuple[int, int, int, int]:
        return self.prefix, self.middle, self.suffix, self.pad

    def record(self) -> dict:
        """What a checkpoint's tokenizer record stores (generation and a resume read it)."""
        return dict(
            prefix=self.prefix,
            middle=self.middle,
            suffix=self.suffix,
            pad=self.pad,
            names=list(self.names),
            appended=self.appended,
        )


@dataclass(frozen=True)
class FIMSettings:
    """The transform's settings: rates are probabilities in [0, 1]; ``eod`` and ``split_sample``
    are token ids; ``fragment_rate`` None = ``rate``; ``decode`` (ids -> str) is needed only with
    ``no_prefix``."""

    rate: float
    spm_rate: float
    sentinels: FIMSentinels
    eod: int
    split_sample: Optional[int] = None
    fragment_rate: Optional[float] = None
    no_prefix: Optional[str] = None
    decode: Optional[Callable] = None


def _units(x: np.ndarray, fim: FIMSettings, rng) -> list[tuple[int, int, float]]:
    """(start, end, rate) of every piece of ``x`` in order: separators (EOD, split token) and
    units; a separator has rate -1 (never transformed), a unit the probability it is."""
    out = []
    seps = np.flatnonzero(x == fim.eod)
    for a, b in zip(np.concatenate([[0], seps + 1]), np.concatenate([seps, [len(x)]])):
        a, b = int(a), int(b)
        splits = (np.flatnonzero(x[a:b] == fim.split_sample) + a) if fim.split_sample is not None else []
        if len(splits) == 0:
            if b > a:
                out.append((a, b, fim.rate))
        else:  # Megatron: the document piece is kept with --fim-rate, then each fragment on its own
            frag = fim.rate if fim.fragment_rate is None else fim.fragment_rate
            keep = rng.random() < fim.rate
            for c, d in zip(np.concatenate([[a], splits + 1]), np.concatenate([splits, [b]])):
                if d > c:
                    out.append((int(c), int(d), frag if keep else 0.0))
                if d < b:
                    out.append((int(d), int(d) + 1, -1.0))
        if b < len(x):
            out.append((b, b + 1, -1.0))
    return out


def _skipped(x: np.ndarray, fim: FIMSettings) -> bool:
    """The unit's text starts with ``no_prefix`` (a character is at most 4 byte tokens, so the
    first 4 len + 4 tokens decode to at least that many characters)."""
    n = len(fim.no_prefix)
    return fim.decode(x[: 4 * n + 4].tolist()).startswith(fim.no_prefix)


def fim_sample(x: np.ndarray, fim: FIMSettings, seed: int, index: int) -> np.ndarray:
    """Sample ``index`` (int64 [L], original tokens ``x``) in FIM form: int64 [L], a pure function
    of (x, fim, seed, index). See the module docstring for the units, the orders and the cut."""
    rng = np.random.default_rng([seed, index, FIM_TAG])
    s = fim.sentinels
    out, room = [], len(x)
    for a, b, rate in _units(x, fim, rng):
        if room == 0:
            break
        n = b - a
        if rate > 0 and rng.random() < rate and room >= 4 and not (fim.no_prefix and _skipped(x[a:b], fim)):
            m = min(n, room - 3)  # shortened at its end to fit with its 3 sentinels
            i, j = np.sort(rng.integers(0, m + 1, size=2))
            pre, mid, suf = x[a : a + i], x[a + i : a + j], x[a + j : a + m]
            if rng.random() < fim.spm_rate:
                out += [[s.prefix, s.suffix], suf, [s.middle], pre, mid]
            else:
                out += [[s.prefix], pre, [s.suffix], suf, [s.middle], mid]
            room -= m + 3
        else:
            k = min(n, room)
            out.append(x[a : a + k])
            room -= k
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in out])


def fim_inverse(y: np.ndarray, sentinels: FIMSentinels, eod: int, split_sample: Optional[int] = None) -> np.ndarray:
    """The original tokens of a FIM sample ``y`` (int64 [L] -> int64 [L - 3k], k = its units in
    FIM form): a unit starts at a prefix sentinel and ends before the next EOD / split token or at
    the end. PSM ``<PRE> p <SUF> s <MID> m`` -> p m s; SPM ``<PRE> <SUF> s <MID> pm`` -> pm s (a
    PSM unit with an empty prefix reads the same both ways). Pad tokens end the sample."""
    y = np.asarray(y, dtype=np.int64)
    stops = [t for t in (eod, split_sample, sentinels.pad) if t is not None]
    out, i, n = [], 0, len(y)
    while i < n and y[i] != sentinels.pad:
        if y[i] != sentinels.prefix:
            out.append(y[i : i + 1])
            i += 1
            continue
        j = i + 1
        while j < n and y[j] not in stops:
            j += 1
        body = y[i + 1 : j]
        k_suf = int(np.flatnonzero(body == sentinels.suffix)[0])
        k_mid = int(np.flatnonzero(body == sentinels.middle)[0])
        pre, suf, rest = body[:k_suf], body[k_suf + 1 : k_mid], body[k_mid + 1 :]
        out += [pre, rest, suf]
        i = j
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class FIMDataset:
    """``inner`` with every sample in FIM form: ``ds[i] = fim_sample(inner[i], fim, seed, i)``,
    int64 [seq_length + 1]. Wraps a split's dataset (single or blended), so ``i`` is the index
    the samplers ask for."""

    def __init__(self, inner, fim: FIMSettings, seed: int):
        if fim.no_prefix and fim.decode is None:
            raise ValueError("FIMSettings.no_prefix needs a decode function")
        self.inner, self.fim, self.seed = inner, fim, seed

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> np.ndarray:
        return fim_sample(np.asarray(self.inner[i], dtype=np.int64), self.fim, self.seed, i)


def build_fim(
    tok,
    sentinels: FIMSentinels,
    *,
    rate: float,
    spm_rate: float,
    split_sample: Optional[str] = None,
    fragment_rate: Optional[float] = None,
    no_prefix: Optional[str] = None,
) -> FIMSettings:
    """FIMSettings for tokenizer ``tok`` (data.tokenizer) and its ``sentinels``
    (``data.tokenizer.add_fim_sentinels``).

    ``split_sample`` is a token's text (Megatron's ``--fim-split-sample``), resolved to its id.
    Raises DataError naming ``--fim-split-sample`` when it is no token of ``tok``, or the EOD or
    a sentinel."""
    split_id = None
    if split_sample is not None:
        split_id = tok.token_id(split_sample)
        if split_id is None:
            raise DataError(
                f"--fim-split-sample {split_sample!r} is not a token of --tokenizer-model "
                f"{tok.model_path}; fix: give the text of one of its tokens (e.g. a file separator)"
            )
        if split_id in sentinels.ids() or split_id == tok.eod:
            raise DataError(
                f"--fim-split-sample {split_sample!r} is token {split_id}, which is also the EOD or a "
                f"FIM sentinel (ids {', '.join(map(str, sentinels.ids()))}); fix: choose another token"
            )
    return FIMSettings(
        rate=rate,
        spm_rate=spm_rate,
        sentinels=sentinels,
        eod=tok.eod,
        split_sample=split_id,
        fragment_rate=fragment_rate,
        no_prefix=no_prefix,
        decode=tok.decode if no_prefix else None,
    )
