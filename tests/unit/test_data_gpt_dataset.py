"""GPT samples: golden reconstruction of the token stream, epochs, splits, exact blends, ranks agree."""

import hashlib
import os

import numpy as np
import pytest

from data.gpt_dataset import (
    GPTDataset,
    MockGPTDataset,
    blend_indices,
    build_indices,
    build_train_valid_test_datasets,
    parse_split,
    split_ranges,
)
from data.indexed_dataset import DataError, IndexedDataset, IndexedDatasetBuilder
from tests.support.distributed import run_distributed

EOD = 1


def make_dataset(prefix: str, num_docs: int, seed: int, max_len: int = 40) -> list[np.ndarray]:
    """Random documents of 1..max_len tokens (ids 2..99), each ending in EOD, written to prefix."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(2, 100, rng.integers(0, max_len)), EOD) for _ in range(num_docs)]
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for d in docs:
            b.add_document(d)
        b.finalize()
    return docs


def test_one_unshuffled_epoch_reconstructs_the_token_stream(tmp_path):
    docs = make_dataset(str(tmp_path / "d"), 50, seed=0)
    ds_idx = IndexedDataset(str(tmp_path / "d"))
    assert ds_idx.sizes.tolist() == [len(d) for d in docs]  # each length counts its EOD
    stream = np.concatenate(docs).astype(np.int64)
    S = 7
    n = (len(stream) - 1) // S  # every sample of one epoch
    ds = GPTDataset(ds_idx, (0, 50), S, n, seed=3, shuffle=False)
    samples = [ds[i] for i in range(n)]
    assert all(s.dtype == np.int64 and s.shape == (S + 1,) for s in samples)
    rebuilt = np.concatenate([samples[0]] + [s[1:] for s in samples[1:]])  # drop 1-token overlaps
    assert np.array_equal(rebuilt, stream[: n * S + 1])
    assert len(stream) - len(rebuilt) < S


def test_epochs_are_different_permutations_and_samples_follow_them(tmp_path):
    make_dataset(str(tmp_path / "d"), 30, seed=1)
    idx = IndexedDataset(str(tmp_path / "d"))
    S, per_epoch = 5, idx.num_tokens
    n = (3 * per_epoch) // S - 1  # needs three epochs
    ds = GPTDataset(idx, (0, 30), S, n, seed=11)
    doc_idx = np.asarray(ds.doc_idx)
    assert len(doc_idx) == 3 * 30
    epochs = [doc_idx[e * 30 : (e + 1) * 30] for e in range(3)]
    for e in epochs:
        assert sorted(e.tolist()) == list(range(30))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    shuffle = np.asarray(ds.shuffle_idx)
    assert sorted(shuffle.tolist()) == list(range(n)) and not np.array_equal(shuffle, np.arange(n))
    per_block = per_epoch // S  # samples are shuffled within one epoch's worth of samples
    assert np.array_equal(shuffle[:per_block] // per_block, np.zeros(per_block, dtype=np.int64))
    stream = np.concatenate([idx[int(d)] for d in doc_idx]).astype(np.int64)
    inverse = np.argsort(shuffle)
    for j in (0, 1, n // 2, n - 1):
        assert np.array_equal(ds[int(inverse[j])], stream[j * S : j * S + S + 1])


def test_split_parsing_and_ranges():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    for bad in ("a,b", "1,2,3,4", "-1,2,3", "0,0,0", ""):
        with pytest.raises(DataError, match=f"--split '{bad}'"):
            parse_split(bad)
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(3, parse_split("1,0,0")) == [(0, 3), (3, 3), (3, 3)]


@pytest.mark.parametrize("k", [2, 20])
def test_blend_shares_are_within_one_sample_at_every_prefix(k):
    weights = np.array([0.999, 0.001]) if k == 2 else np.random.default_rng(5).dirichlet(np.ones(k))
    n = 4000
    index, sample = blend_indices(weights, n)
    onehot = np.zeros((n, k))
    onehot[np.arange(n), index] = 1
    counts = np.cumsum(onehot, axis=0)  # [n, k] samples of each component after each prefix
    exact = np.arange(1, n + 1)[:, None] * weights[None, :]
    assert np.abs(counts - exact).max() <= 1.0
    for c in range(k):
        assert np.array_equal(sample[index == c], np.arange(int(counts[-1, c])))


@pytest.mark.parametrize("k", [2, 20])
def test_built_blend_never_indexes_past_a_component(tmp_path, k):
    weights = [0.999, 0.001] if k == 2 else list(np.random.default_rng(6).dirichlet(np.ones(k)))
    data_path = []
    for c in range(k):
        make_dataset(str(tmp_path / f"c{c}"), 20, seed=100 + c)
        data_path += [str(weights[c]), str(tmp_path / f"c{c}")]
    train, valid, test = build_train_valid_test_datasets(
        data_path, "90,10,0", 8, 1, (1500, 60, 10), str(tmp_path / "cache")
    )
    assert test is None  # no test documents
    for ds, n in ((train, 1500), (valid, 60)):
        assert len(ds) == n
        counts = np.bincount(ds.dataset_index, minlength=k)
        assert np.abs(counts - n * np.asarray(weights)).max() <= 1.0
        for c, part in enumerate(ds.datasets):
            used = ds.dataset_sample_index[ds.dataset_index == c]
            assert (part is None and used.size == 0) or used.max() == len(part) - 1
        for i in range(n):
            assert ds[i].shape == (9,)


def test_mock_dataset_is_deterministic():
    a, b = MockGPTDataset(50, 8, 10, seed=2), MockGPTDataset(50, 8, 10, seed=2)
    assert all(np.array_equal(a[i], b[i]) for i in range(10))
    assert a[3].dtype == np.int64 and a[3].shape == (9,) and 0 <= a[3].min() and a[3].max() < 50
    assert not np.array_equal(a[3], MockGPTDataset(50, 8, 10, seed=3)[3])
    step = (a[3][1] - a[3][0]) % 50
    assert np.array_equal(np.diff(a[3]) % 50, np.full(8, step))  # learnable: a progression mod V


def _hashes(train, valid) -> dict:
    out = {}
    for name, ds in (("train", train), ("valid", valid)):
        for attr in ("doc_idx", "sample_idx", "shuffle_idx"):
            out[f"{name}.{attr}"] = hashlib.sha256(np.ascontiguousarray(getattr(ds, attr))).hexdigest()
    return out


def _build_on_rank(rank, world, prefix, cache_dir):
    import torch.distributed as dist

    train, valid, _ = build_train_valid_test_datasets([prefix], "80,20,0", 16, 7, (3000, 50, 0), cache_dir)
    dist.barrier()  # every rank has written (or found) the cache
    files = {
        f: hashlib.sha256(open(os.path.join(cache_dir, f), "rb").read()).hexdigest()
        for f in sorted(os.listdir(cache_dir))
    }
    return _hashes(train, valid), files, [int(x) for x in train[123]]


def test_index_files_identical_on_four_ranks_and_independent_of_dp(tmp_path):
    prefix = str(tmp_path / "d")
    make_dataset(prefix, 200, seed=4)
    results = run_distributed(_build_on_rank, 4, prefix, str(tmp_path / "cache"))
    train, valid, _ = build_train_valid_test_datasets([prefix], "80,20,0", 16, 7, (3000, 50, 0), None)
    single = _hashes(train, valid)  # one process, no cache: the dp=1 result
    assert all(r == results[0] for r in results)
    assert results[0][0] == single and results[0][2] == train[123].tolist()
    assert len(results[0][1]) == 6 and not any(".tmp." in f for f in results[0][1])
    again = build_train_valid_test_datasets([prefix], "80,20,0", 16, 7, (3000, 50, 0), str(tmp_path / "cache"))
    assert _hashes(again[0], again[1]) == single  # loaded from the cache


def test_index_building_is_vectorised_for_large_inputs():
    sizes = np.random.default_rng(0).integers(1, 2000, 200_000).astype(np.int32)  # ~200M tokens
    doc_idx, sample_idx, shuffle_idx = build_indices(sizes, np.arange(len(sizes)), 2048, 50_000, 0)
    m = sample_idx.shape[0] - 1  # rounded up to whole shuffle blocks (one epoch of samples)
    per_block = int(sizes.sum()) // 2048
    assert m % per_block == 0 and 50_000 <= m < 50_000 + per_block and shuffle_idx.shape == (50_000,)
    assert shuffle_idx.max() < m
    d, o = sample_idx[-1]
    assert np.cumsum(sizes[doc_idx].astype(np.int64))[d] - sizes[doc_idx[d]] + o == m * 2048


def test_sample_order_does_not_depend_on_the_number_of_samples():
    """The first k samples are the same whatever num_samples (--train-iters) asks for, so a run
    extended or resumed with more iterations sees the samples of the shorter run first."""
    from data.gpt_dataset import build_indices

    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 40, size=50)
    seq_ids = np.arange(50)
    per_epoch_samples = int(sizes.sum()) // 8
    runs = {n: build_indices(sizes, seq_ids, 8, n, seed=11) for n in (5, per_epoch_samples + 3, 4 * per_epoch_samples)}
    k = 5
    first = {n: [tuple(r[1][r[2][i]]) for i in range(k)] for n, r in runs.items()}
    assert len({tuple(v) for v in first.values()}) == 1, first
    assert all(len(r[2]) == n for n, r in runs.items())
    longest = runs[4 * per_epoch_samples]
    mid = runs[per_epoch_samples + 3]
    for i in range(per_epoch_samples + 3):  # the longer run's order extends the shorter one's
        assert tuple(mid[1][mid[2][i]]) == tuple(longest[1][longest[2][i]])
