"""Which samples each data-parallel rank trains on: a pure function of the consumed-sample count.

Global batch g covers dataset samples ``[consumed, consumed + global_batch_size)`` in dataset
order (the dataset's own shuffle index already randomises that order from its seed). Data-
parallel rank r of dp takes the contiguous slice ``[consumed + r * GBS/dp, consumed + (r+1) *
GBS/dp)``, cut into micro-batches of ``micro_batch_size`` (the scheme of Megatron-LM's
``MegatronPretrainingSampler``). All tensor- and pipeline-parallel ranks of one data-parallel
rank therefore see the same micro-batches, and a run resumed at any consumed-sample count, with
any data-parallel size, continues with exactly the samples of an uninterrupted run.

Indices are never wrapped modulo the dataset length: build datasets with at least
``train_iters * global_batch_size`` samples (``build_train_valid_test_datasets`` does this when
given that count); asking past the end raises a DataError.
"""

from __future__ import annotations

import numpy as np
import torch

from data.indexed_dataset import DataError


def dp_sample_range(consumed_samples: int, global_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Dataset indices of this data-parallel rank's share of the global batch starting at ``consumed``."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} / dp_size {dp_size}: need 0 <= dp_rank < dp_size")
    if global_batch_size % dp_size:
        raise DataError(
            f"global batch size {global_batch_size} is not divisible by the data-parallel "
            f"size {dp_size}; choose a global batch that is a multiple of it"
        )
    if consumed_samples < 0:
        raise DataError(f"consumed_samples {consumed_samples} is negative")
    per_rank = global_batch_size // dp_size
    start = consumed_samples + dp_rank * per_rank
    return range(start, start + per_rank)


def get_micro_batches(
    dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of the global batch after ``consumed_samples`` samples.

    Returns GBS / (dp_size * micro_batch_size) pairs ``(tokens, labels)``, each a
    torch.LongTensor [micro_batch_size, T] with T = sample length - 1: tokens = sample[:-1],
    labels = sample[1:]. Raises DataError when the batch does not divide into micro-batches or
    the dataset is too short (the message gives the number of samples needed).
    """
    indices = dp_sample_range(consumed_samples, global_batch_size, dp_rank, dp_size)
    per_rank = len(indices)
    if micro_batch_size < 1 or per_rank % micro_batch_size:
        raise DataError(
            f"global batch size {global_batch_size} / data-parallel size {dp_size} = "
            f"{per_rank} samples per rank is not a multiple of micro batch size "
            f"{micro_batch_size}"
        )
    if consumed_samples + global_batch_size > len(dataset):  # same verdict on every rank
        raise DataError(
            f"dataset has {len(dataset)} samples but the global batch after "
            f"{consumed_samples} consumed samples needs {consumed_samples + global_batch_size}; "
            f"build it with num_samples >= train_iters * global_batch_size"
        )
    samples = np.stack([np.asarray(dataset[i], dtype=np.int64) for i in indices])  # [GBS/dp, T+1]
    batch = torch.from_numpy(samples)
    out = []
    for m in range(0, per_rank, micro_batch_size):
        mb = batch[m : m + micro_batch_size]  # [mbs, T+1]
        out.append((mb[:, :-1].contiguous(), mb[:, 1:].contiguous()))
    return out
