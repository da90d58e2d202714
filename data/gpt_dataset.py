"""GPT pretraining samples: fixed-length windows over EOD-separated documents, splits and blends.

A sample is ``seq_length + 1`` consecutive tokens of the stream formed by concatenating the
documents of one split in a shuffled order (tokens = sample[:-1], labels = sample[1:]);
consecutive samples share one token, and a sample runs across document boundaries (the EOD
token that ends each document separates them). Three indices describe it (the scheme of
Megatron-LM's GPTDataset, built here with vectorised numpy):

- document index ``doc_idx`` [E * D]: for each of the E epochs needed, a fresh permutation of
  the split's D documents (values are sequence ids in the .bin/.idx);
- sample index ``sample_idx`` [N + 1, 2]: (position in doc_idx, token offset) where sample i
  starts; sample i ends (inclusive) where sample i + 1 starts. Found with one cumsum over the
  document lengths and one searchsorted of the start positions i * seq_length;
- shuffle index ``shuffle_idx`` [N]: sample order; samples are shuffled within blocks of one
  epoch's worth of samples, so an epoch is (nearly) finished before the data repeats.

Every index is a pure function of (document lengths, seq_length, num_samples, seed), so all
ranks and nodes build the same ones. With a ``cache_dir`` they are saved as ``.npy`` under a
name hashing all those inputs, written to a temporary name and ``os.replace``d, so concurrent
ranks may build them at the same time and never read half a file.

Blending (``BlendedDataset``): sample i comes from the component whose realised count lags its
weight the most (greedy largest-error assignment, as Megatron's ``build_blending_indices``),
so after every prefix of n samples each component has within one sample of ``w_k * n``; each
component dataset is built with exactly the number of samples assigned to it.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from data.indexed_dataset import DataError, IndexedDataset, tmp_name
from data.sft import SFTDataset, open_loss_masks

_FORMAT = "megazero-gpt-indices-v2"  # v2: indices built for whole shuffle blocks


def parse_split(split: str) -> tuple[float, float, float]:
    """``--split "969,30,1"`` (or ``"98/2/0"``; fewer parts = 0) -> normalised (train, valid, test)
    fractions; raises DataError naming ``--split`` and the fix. This is the rule's one home:
    ``megazero.training.build_data`` applies it before launch (also with --mock-data, which reads no
    split but still gets a well-formed flag)."""
    try:
        vals = [float(p) for p in split.replace("/", ",").split(",")]
    except ValueError:
        vals = []
    if not 1 <= len(vals) <= 3 or any(v < 0 or not np.isfinite(v) for v in vals) or sum(vals) <= 0:
        raise DataError(
            f"--split {split!r} must be 1-3 non-negative proportions with a positive sum; "
            "fix: e.g. 969,30,1 (train, valid, test)"
        )
    vals += [0.0] * (3 - len(vals))
    total = sum(vals)
    return tuple(v / total for v in vals)


def split_ranges(num_docs: int, fractions) -> list[tuple[int, int]]:
    """Document ranges [start, end) of train/valid/test: boundaries round(cumsum(fraction) * D)."""
    bounds = [0] + [int(round(c * num_docs)) for c in np.cumsum(fractions)]
    bounds[-1] = num_docs
    return [(bounds[i], max(bounds[i], bounds[i + 1])) for i in range(3)]


def parse_data_path(data_path: list[str]) -> list[tuple[float, str]]:
    """``--data-path``: ``[prefix]`` or Megatron's blend ``[w1, p1, w2, p2, ...]`` ->
    [(weight normalised to sum 1, prefix)]. This is the rule's one home (megazero's config only
    checks that --data-path or --mock-data is given); ``require_files`` then checks the files.

    Raises DataError: no entry or an odd count, a weight that is not a number, negative or not
    finite, or weights summing to 0.
    """
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if len(data_path) == 0 or len(data_path) % 2:
        raise DataError(
            f"--data-path {' '.join(data_path)}: a blend is weight-prefix pairs, got "
            f"{len(data_path)} entries; fix: give one prefix or weight/prefix pairs, "
            "e.g. --data-path 0.7 A 0.3 B"
        )
    pairs = []
    for w, p in zip(data_path[0::2], data_path[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise DataError(
                f"--data-path: weight {w!r} (before {p}) is not a number; fix: give "
                "weight-prefix pairs, e.g. --data-path 0.7 A 0.3 B"
            ) from None
        if weight < 0 or not np.isfinite(weight):
            raise DataError(f"--data-path weight {w} of {p} is negative or not finite; fix: use finite weights >= 0")
        pairs.append((weight, p))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise DataError(
            f"--data-path weights {' '.join(data_path[0::2])} sum to 0; fix: give at least one positive weight"
        )
    return [(w / total, p) for w, p in pairs]


def require_files(blend: list[tuple[float, str]], flag: str = "--data-path") -> None:
    """Every prefix of a parsed ``--data-path`` (or the blend of ``flag``) has its ``PREFIX.bin``
    and ``PREFIX.idx``.

    Raises DataError naming ``flag``, the missing file and the fix (a prefix given with
    its ``.bin``/``.idx`` suffix is named as such)."""
    for _, prefix in blend:
        for path in (prefix + ".bin", prefix + ".idx"):
            if not os.path.isfile(path):
                hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
                raise DataError(
                    f"{flag} {prefix}: {path} not found{hint}; fix: correct the path or "
                    "create it with data/preprocess.py"
                )


def build_indices(
    sizes: np.ndarray, seq_ids: np.ndarray, seq_length: int, num_samples: int, seed: int, shuffle: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx [E*D], sample_idx [M+1, 2] int64, shuffle_idx [N] int64) for N = num_samples.

    M >= N: with shuffling, M is N rounded up to whole shuffle blocks (one epoch's samples).

    sizes: tokens per sequence of the whole dataset; seq_ids: the split's sequence ids [D].
    With shuffle=False documents keep their order and samples are in stream order.
    """
    lengths = sizes[seq_ids].astype(np.int64)
    per_epoch = int(lengths.sum())
    if per_epoch == 0:
        raise DataError("the split's documents hold no tokens")
    # Shuffling is within blocks of one epoch's worth of samples. Indices are built for whole
    # blocks and cut to num_samples afterwards, so the first k samples do not depend on
    # num_samples (on --train-iters): a run extended or resumed with more iterations
    # trains on the same samples in the same order.
    per_block = max(1, per_epoch // seq_length)
    wanted, num_samples = num_samples, (-(-num_samples // per_block) * per_block if shuffle else num_samples)
    need = num_samples * seq_length + 1
    epochs = -(-need // per_epoch)  # ceil
    perms = [
        np.random.default_rng([seed, e]).permutation(len(seq_ids)) if shuffle else np.arange(len(seq_ids))
        for e in range(epochs)
    ]
    order = np.concatenate(perms)  # [E*D] positions within the split
    doc_idx = seq_ids[order]
    doc_lengths = lengths[order]  # [E*D]
    cum = np.cumsum(doc_lengths)  # [E*D] end position (exclusive) of each document
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(cum, starts, side="right")  # document holding each start token
    sample_idx = np.stack([pos, starts - (cum[pos] - doc_lengths[pos])], axis=1)  # [N+1, 2]
    if shuffle:
        block = np.arange(num_samples) // per_block
        noise = np.random.default_rng([seed, 1 << 20]).random(num_samples)
        shuffle_idx = np.lexsort((noise, block)).astype(np.int64)[:wanted]  # random order within each block
    else:
        shuffle_idx = np.arange(num_samples, dtype=np.int64)
    return doc_idx.astype(np.int64), sample_idx.astype(np.int64), shuffle_idx


def _cached(cache_dir: str | None, key_parts: list, names: list[str], build):
    """Load arrays ``names`` from ``cache_dir`` under a hash of ``key_parts``, else build and save."""
    if cache_dir is None:
        return build()
    h = hashlib.sha256()
    for part in [_FORMAT] + key_parts:
        h.update(part.tobytes() if isinstance(part, np.ndarray) else repr(part).encode())
        h.update(b"\x00")
    paths = [os.path.join(cache_dir, f"{h.hexdigest()[:24]}_{n}.npy") for n in names]
    if all(os.path.isfile(p) for p in paths):
        try:
            return tuple(np.load(p, mmap_mode="r") for p in paths)
        except (ValueError, OSError):
            pass  # unreadable cache: rebuild and replace it
    arrays = build()
    os.makedirs(cache_dir, exist_ok=True)
    for p, a in zip(paths, arrays):
        tmp = tmp_name(p)
        with open(tmp, "wb") as f:
            np.save(f, a)
        os.replace(tmp, p)
    return arrays


class GPTDataset:
    """``num_samples`` samples of ``seq_length + 1`` tokens from documents [start, end) of a dataset.

    ``ds[i]`` -> np.ndarray int64 [seq_length + 1]. ``doc_range`` counts documents of the .idx
    document index. Raises DataError when the range holds no tokens.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_range: tuple[int, int],
        seq_length: int,
        num_samples: int,
        seed: int,
        cache_dir: str | None = None,
        shuffle: bool = True,
    ):
        if seq_length < 1 or num_samples < 0:
            raise DataError(f"seq_length {seq_length} must be >= 1 and num_samples {num_samples} >= 0")
        self.indexed, self.seq_length, self.num_samples = indexed, seq_length, num_samples
        a, b = doc_range
        seq_ids = np.arange(indexed.doc_idx[a], indexed.doc_idx[b], dtype=np.int64)
        sizes = np.asarray(indexed.sizes)
        if sizes[seq_ids].sum() == 0:
            raise DataError(
                f"{indexed.prefix}.idx: documents {a}..{b - 1} hold no tokens; use more data or another --split"
            )
        key = [seq_length, num_samples, seed, shuffle, seq_ids[:1], seq_ids[-1:], sizes[seq_ids]]
        self.doc_idx, self.sample_idx, self.shuffle_idx = _cached(
            cache_dir,
            key,
            ["doc_idx", "sample_idx", "shuffle_idx"],
            lambda: build_indices(sizes, seq_ids, seq_length, num_samples, seed, shuffle),
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        j = int(self.shuffle_idx[i])
        d0, o0 = (int(x) for x in self.sample_idx[j])
        d1, o1 = (int(x) for x in self.sample_idx[j + 1])
        get, docs = self.indexed.get, self.doc_idx
        if d0 == d1:
            parts = [get(int(docs[d0]), o0, o1 - o0 + 1)]
        else:
            parts = (
                [get(int(docs[d0]), o0)]
                + [get(int(docs[k])) for k in range(d0 + 1, d1)]
                + [get(int(docs[d1]), 0, o1 + 1)]
            )
        return np.concatenate(parts).astype(np.int64)


def blend_indices(weights, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index [N] int16, dataset_sample_index [N] int64) by greedy largest error.

    Sample i goes to argmax_k (w_k * (i + 1) - count_k) (first k on ties); dataset_sample_index
    counts 0, 1, 2, ... within each component. Weights must be normalised.
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    choice = [0] * num_samples
    ks = range(len(w))
    for i in range(num_samples):
        errors = [w[k] * (i + 1) - counts[k] for k in ks]
        k = errors.index(max(errors))
        choice[i] = k
        counts[k] += 1
    dataset_index = np.asarray(choice, dtype=np.int16)
    dataset_sample_index = np.zeros(num_samples, dtype=np.int64)
    for k in ks:  # running count within each component, vectorised per component
        mask = dataset_index == k
        dataset_sample_index[mask] = np.arange(int(mask.sum()))
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Samples drawn from several datasets in exact proportion to ``weights`` (see module doc)."""

    def __init__(self, datasets: list, dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        self.datasets = datasets
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


class MockGPTDataset:
    """Deterministic synthetic samples for tests and benchmarks, learnable by a small model.

    Sample i is an arithmetic progression modulo ``vocab_size``: start and step (1, 2 or 3) are
    drawn from ``np.random.default_rng([seed, i])``. ``ds[i]`` -> int64 [seq_length + 1].
    """

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int = 0):
        self.vocab_size, self.seq_length, self.num_samples, self.seed = vocab_size, seq_length, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, i])
        start, step = int(rng.integers(self.vocab_size)), int(rng.integers(1, 4))
        return (start + step * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size


def _build_split(indexed, ranges, weights, s, seq_length, seed, n, cache_dir, sft=None):
    live = [k for k in range(len(indexed)) if ranges[k][s][1] > ranges[k][s][0] and weights[k] > 0]
    if n == 0 or not live:
        return None

    def make(k, count):
        if sft is not None:  # (masks, packing, pad id): whole records with their loss mask
            masks, packing, pad_id = sft
            return SFTDataset(indexed[k], masks[k], ranges[k][s], seq_length, count, seed + s, packing, pad_id)
        return GPTDataset(indexed[k], ranges[k][s], seq_length, count, seed + s, cache_dir)

    if len(live) == 1:
        return make(live[0], n)
    w = np.asarray([weights[k] for k in live])
    key = ["blend", n, w]
    ds_index, ds_sample = _cached(
        cache_dir, key, ["blend_index", "blend_sample_index"], lambda: blend_indices(w / w.sum(), n)
    )
    counts = np.bincount(np.asarray(ds_index), minlength=len(live))
    parts = [make(k, int(c)) if c else None for k, c in zip(live, counts)]
    return BlendedDataset(parts, ds_index, ds_sample)


def check_vocab(indexed: IndexedDataset, vocab_size: int) -> None:
    """Raise DataError naming the file when a token id is >= vocab_size (tokenizer mismatch)."""
    top = int(indexed.tokens.max()) if indexed.num_tokens else -1
    low = int(indexed.tokens.min()) if indexed.num_tokens else 0
    if low < 0:
        raise DataError(
            f"{indexed.prefix}.bin: negative token id {low}; the file is corrupt or not a "
            f"token dataset, re-run data.preprocess"
        )
    if top >= vocab_size:
        raise DataError(
            f"{indexed.prefix}.bin: token id {top} >= vocabulary size {vocab_size}; the "
            f"dataset was made with another tokenizer, re-run data.preprocess with this one"
        )


def build_train_valid_test_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    vocab_size: int | None = None,
    sft: tuple[str, int] | None = None,
    fim=None,
):
    """(train, valid, test) datasets; each ``ds[i]`` -> np.ndarray int64 [seq_length + 1].

    ``sft``: (packing, pad id) for supervised fine-tuning data (``--sft``): every prefix has its
    loss-mask pair (data/sft.py) and ``ds[i]`` is an ``SFTDataset`` sample (tokens, loss mask).

    data_path: ``[prefix]`` or ``[w1, p1, w2, p2, ...]`` (Megatron style); split: e.g. "969,30,1",
    applied to each component's documents; num_samples: samples wanted per split (build with
    train_iters * global_batch_size for train); vocab_size: when given, every dataset's largest
    token id is checked against it (one pass over the .bin). Split s uses seed + s, so
    train/valid/test shuffles differ. A split with no documents (or 0 samples wanted)
    is None; in a blend, components without documents in a split are left out of that split
    and the others' weights renormalised. fim: a ``data.fim.FIMSettings``: every split's samples
    are read in fill-in-the-middle form (``data.fim.FIMDataset``, seeded with the split's seed).
    Raises DataError for a bad split string, bad weights, a missing / corrupt dataset or a
    vocabulary mismatch, before any index is built.
    """
    blend = parse_data_path(list(data_path))
    fractions = parse_split(split)
    if len(num_samples) != 3 or any(int(n) < 0 for n in num_samples):
        raise DataError(f"num_samples {num_samples}: need three non-negative counts (train, valid, test)")
    indexed = [IndexedDataset(p) for _, p in blend]
    if vocab_size is not None:
        for ds in indexed:
            check_vocab(ds, vocab_size)
    ranges = [split_ranges(ds.num_documents, fractions) for ds in indexed]
    weights = [w for w, _ in blend]
    if sft is not None:
        sft = ([open_loss_masks(p) for _, p in blend],) + tuple(sft)
    sets = [
        _build_split(indexed, ranges, weights, s, seq_length, seed, int(num_samples[s]), cache_dir, sft)
        for s in range(3)
    ]
    if fim is not None:  # plain token samples only (--fim-rate with --sft is refused by the config)
        from data.fim import FIMDataset

        sets = [None if ds is None else FIMDataset(ds, fim, seed + s) for s, ds in enumerate(sets)]
    return tuple(sets)
