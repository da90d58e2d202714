"""Data-parallel sampling: resuming at any consumed-sample count with any dp size loses nothing."""

import numpy as np
import pytest
import torch

from data.gpt_dataset import MockGPTDataset
from data.indexed_dataset import DataError
from data.samplers import get_micro_batches

GBS, MBS, T = 8, 2, 6


def global_batch(ds, consumed, dp):
    """Tokens [GBS, T] of one global batch, gathered over all dp ranks in rank order."""
    rows = []
    for r in range(dp):
        mbs = get_micro_batches(ds, consumed, GBS, MBS, r, dp)
        assert len(mbs) == GBS // dp // MBS
        for tokens, labels in mbs:
            assert tokens.dtype == torch.long and tokens.shape == (MBS, T) == labels.shape
            assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are tokens shifted by one
            rows.append(tokens)
    return torch.cat(rows)


def test_resume_at_any_consumed_count_with_any_dp_size():
    ds = MockGPTDataset(vocab_size=97, seq_length=T, num_samples=200, seed=1)
    steps = 10
    uninterrupted = [global_batch(ds, g * GBS, dp=1) for g in range(steps)]
    stream = torch.cat(uninterrupted)  # [steps * GBS, T]
    expected = torch.from_numpy(np.stack([ds[i][:-1] for i in range(steps * GBS)]))
    assert torch.equal(stream, expected)  # batch g is samples [g*GBS, (g+1)*GBS) in dataset order
    for dp in (1, 2, 4):
        for resume_step in (0, 3, 7):
            resumed = [global_batch(ds, g * GBS, dp) for g in range(resume_step, steps)]
            assert torch.equal(torch.cat(resumed), stream[resume_step * GBS :])
        for consumed in (1, 5, 13):  # also when consumed is not a multiple of the global batch
            assert torch.equal(
                global_batch(ds, consumed, dp),
                torch.from_numpy(np.stack([ds[i][:-1] for i in range(consumed, consumed + GBS)])),
            )


def test_each_dp_rank_gets_a_contiguous_slice():
    ds = MockGPTDataset(vocab_size=97, seq_length=T, num_samples=64, seed=0)
    ((tokens, labels),) = get_micro_batches(ds, 16, 8, 2, dp_rank=3, dp_size=4)
    assert torch.equal(tokens, torch.from_numpy(np.stack([ds[22][:-1], ds[23][:-1]])))
    assert torch.equal(labels, torch.from_numpy(np.stack([ds[22][1:], ds[23][1:]])))


@pytest.mark.parametrize(
    "args,msg",
    [
        ((0, 6, 2, 0, 4), "global batch size 6 is not divisible by the data-parallel size 4"),
        ((0, 8, 3, 0, 2), "4 samples per rank is not a multiple of micro batch size 3"),
        ((60, 8, 2, 0, 2), "dataset has 64 samples but .* needs 68"),
        ((0, 8, 2, 2, 2), "dp_rank 2 / dp_size 2"),
    ],
)
def test_bad_batch_arithmetic_is_a_clear_error(args, msg):
    ds = MockGPTDataset(vocab_size=97, seq_length=T, num_samples=64, seed=0)
    with pytest.raises(DataError, match=msg):
        get_micro_batches(ds, *args)
