"""A stage's parameters made one full tensor at a time (docs/design.md, contract 1 and "Model").

Layout-independent initialisation starts from full, unpartitioned tensors. Making them all
at once, as ``init_full_weights`` does, holds the whole stage in fp32 on every rank (28 GB for
a 7B model at tp 8). Here a stage's modules are made on the meta device,
each parameter is swapped for a placeholder that holds no memory (``use_placeholders``), and
then, one parameter at a time, its full tensor is made (or read), this rank's partition is
cut from it (``local_partition``) and copied to the device, and the full tensor is dropped.
A rank therefore holds its own partitions plus one full tensor and one partition of it in
flight; at ZeRO-3 the partition goes straight into the gather unit's shard
(``megazero.data_parallel.zero3.Stage3.init_params``), so not even the partition persists.
The values are those of slicing ``init_full_weights`` (tests/layouts/test_model_build.py compares
every parameter of several layouts bit for bit).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from megazero import tags

VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output.weight")


def resize_vocab(t: torch.Tensor, vocab_size: int, padded: int) -> torch.Tensor:
    """Keep the real rows of a vocabulary tensor and zero-pad them to ``padded`` rows."""
    return torch.nn.functional.pad(t[:vocab_size], (0, 0, 0, padded - vocab_size))


@torch.no_grad()
def use_placeholders(module: nn.Module, device) -> None:
    """Swap every parameter of ``module`` (made on the meta device) for a parameter of the same
    shape, dtype, ``requires_grad`` and attributes (partition tags) on ``device`` that holds no
    memory: a zero-stride view of one NaN element, so that reading it before its values are
    set gives NaN rather than plausible zeros. Parameters shared by two modules stay shared."""
    nan, swapped = {}, {}
    for sub in module.modules():
        for key, p in list(sub._parameters.items()):
            if p is None:
                continue
            if id(p) not in swapped:
                if p.dtype not in nan:
                    nan[p.dtype] = torch.full((1,), float("nan"), dtype=p.dtype, device=device)
                new = nn.Parameter(nan[p.dtype].expand(p.shape), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                swapped[id(p)] = new
            sub._parameters[key] = swapped[id(p)]


def local_partition(
    name: str, param: torch.Tensor, full: Mapping, tp_rank: int, tp_size: int, vocab_size: int, padded_vocab: int
) -> torch.Tensor:
    """This rank's partition of ``full[name]`` for ``param`` (its tags say how it is cut):
    the parameter's shape, the full tensor's dtype and device (fp32 on the host for
    ``model.spec.InitialWeights``). Vocabulary tensors may have any number of rows >=
    ``vocab_size`` (e.g. padded for another TP size): the real rows are kept and re-padded with
    zeros to ``padded_vocab``. Raises KeyError naming a missing tensor, ValueError on a shape
    mismatch."""
    try:
        src = full[name]  # not ``name in full``: a lazy mapping would make the tensor twice
    except KeyError:
        raise KeyError(f"full weights lack {name!r}, needed by this stage") from None
    if (
        name in VOCAB_TENSORS
        and tags.is_partitioned(param)
        and param.partition_dim == 0
        and param.partition_stride == 1
        and src.shape[0] >= vocab_size
    ):
        return _vocab_rows(src, param, tp_rank, vocab_size)
    if name in VOCAB_TENSORS:
        src = resize_vocab(src, vocab_size, padded_vocab)
    if tags.is_partitioned(param):
        rank, size = tags.partition_coords(param, tp_rank, tp_size)  # experts: over etp of the tp ranks
        src = tags.partition_tensor(src, param.partition_dim, rank, size, param.partition_stride)
    if src.shape != param.shape:
        raise ValueError(
            f"{name}: full tensor gives a partition of shape {tuple(src.shape)}, parameter is {tuple(param.shape)}"
        )
    return src


def _vocab_rows(src: torch.Tensor, param: torch.Tensor, tp_rank: int, vocab_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s rows of ``resize_vocab(src)`` without making the resized full tensor:
    ``[R >= vocab_size, H] -> [V_pad/tp, H]``, rows past ``vocab_size`` zero. Raises ValueError
    when ``src``'s row width differs from the parameter's."""
    if src.shape[1:] != param.shape[1:]:
        raise ValueError(
            f"vocabulary tensor has rows of shape {tuple(src.shape[1:])}, parameter rows are {tuple(param.shape[1:])}"
        )
    rows, start = param.shape[0], tp_rank * param.shape[0]
    real = max(0, min(start + rows, vocab_size) - start)  # rows of the real vocabulary here
    out = torch.zeros(param.shape, dtype=src.dtype, device=src.device)
    out[:real] = src[start : start + real]
    return out
