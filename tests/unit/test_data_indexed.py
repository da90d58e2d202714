"""The .bin/.idx format: byte-exact layout from the format description, reader checks, merge."""

import os
import struct

import numpy as np
import pytest

from data.indexed_dataset import DataError, IndexedDataset, IndexedDatasetBuilder, best_dtype, write_index

DOCS = [[5, 6, 7], [65000], [1, 2]]


def _expected_idx(code: int, itemsize: int) -> bytes:
    """The index of DOCS, written by hand from the layout (magic, version, dtype code, counts,
    int32 lengths, int64 byte pointers, int64 document index)."""
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<Q", 3)
        + struct.pack("<Q", 4)
        + struct.pack("<3i", 3, 1, 2)
        + struct.pack("<3q", 0, 3 * itemsize, 4 * itemsize)
        + struct.pack("<4q", 0, 1, 2, 3)
    )


@pytest.mark.parametrize("vocab,code,fmt", [(8192, 8, "<6H"), (70000, 4, "<6i")])
def test_idx_and_bin_bytes_match_hand_computed_layout(tmp_path, vocab, code, fmt):
    prefix = str(tmp_path / "d")
    dtype = best_dtype(vocab)
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for d in DOCS:
            b.add_document(d)
        b.finalize()
    itemsize = struct.calcsize(fmt) // 6
    assert open(prefix + ".idx", "rb").read() == _expected_idx(code, itemsize)
    assert open(prefix + ".bin", "rb").read() == struct.pack(fmt, 5, 6, 7, 65000, 1, 2)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype) and len(ds) == 3 and ds.num_documents == 3
    assert [ds[i].tolist() for i in range(3)] == DOCS
    assert ds.get(0, 1, 2).tolist() == [6, 7]
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temporary files left


def test_merge_concatenates_documents(tmp_path):
    prefixes = []
    for k, docs in enumerate((DOCS, [[9], [8, 8, 8]])):
        p = str(tmp_path / f"p{k}")
        with IndexedDatasetBuilder(p, np.uint16) as b:
            for d in docs:
                b.add_document(d)
            b.finalize()
        prefixes.append(p)
    out = str(tmp_path / "m")
    with IndexedDatasetBuilder(out, np.uint16) as b:
        for p in prefixes:
            b.merge(p)
        b.finalize()
    m = IndexedDataset(out)
    assert [m[i].tolist() for i in range(len(m))] == DOCS + [[9], [8, 8, 8]]
    assert m.doc_idx.tolist() == [0, 1, 2, 3, 4, 5]
    assert m.pointers.tolist() == [0, 6, 8, 12, 14]


def _write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for d in docs:
            b.add_document(d)
        b.finalize()


def test_reader_rejects_truncated_or_mismatched_pairs(tmp_path):
    p = str(tmp_path / "a")
    _write(p, DOCS)
    with open(p + ".bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match=r"a\.bin has 10 bytes but .*a\.idx implies 12"):
        IndexedDataset(p)
    _write(p, DOCS)
    with open(p + ".idx", "r+b") as f:
        f.truncate(40)
    with pytest.raises(DataError, match=r"a\.idx: 40 bytes but its header"):
        IndexedDataset(p)
    q = str(tmp_path / "b")
    _write(p, DOCS)
    _write(q, [[1]])
    os.replace(q + ".idx", p + ".idx")  # an index that belongs to another .bin
    with pytest.raises(DataError, match=r"a\.bin has 12 bytes but .*a\.idx implies 2"):
        IndexedDataset(p)
    os.remove(p + ".bin")
    with pytest.raises(DataError, match=r"a\.bin: file not found"):
        IndexedDataset(p)


def test_token_that_does_not_fit_dtype_leaves_nothing(tmp_path):
    p = str(tmp_path / "c")
    with pytest.raises(DataError, match=r"c\.bin: token id 70000 does not fit dtype uint16"):
        with IndexedDatasetBuilder(p, np.uint16) as b:
            b.add_document([1, 2])
            b.add_document([70000])
    with pytest.raises(DataError, match="token id -1 does not fit"):
        with IndexedDatasetBuilder(p, np.uint16) as b:
            b.add_document([-1])
    assert os.listdir(tmp_path) == []


def test_write_index_of_empty_dataset_reads_back(tmp_path):
    p = str(tmp_path / "e")
    write_index(p + ".idx", np.int32, [], [0])
    open(p + ".bin", "wb").close()
    ds = IndexedDataset(p)
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
