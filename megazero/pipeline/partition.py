"""Which transformer layers each pipeline stage (and each model chunk) holds.

Non-interleaved (``vp_size == 1``): stage ``p`` holds one contiguous block of
``num_layers / pp_size`` layers, or the block given by an explicit ``layer_split``.

Interleaved (``vp_size == V > 1``, Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", sec. 2.2.2): the layers are cut into
``pp_size * V`` equal blocks; model chunk ``v`` of stage ``p`` holds block ``v * pp_size + p``
(Megatron-LM's layout), so the activations of one micro-batch visit stages
0, 1, ..., pp-1, 0, 1, ... ``V`` times. The position of a chunk in that order is its
*virtual stage* ``v * pp_size + p``.

V shape (``layout="v"``, the ZB-V schedule of Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", sec. 5): ``V == 2`` and stage ``p`` holds virtual stages ``p`` (chunk 0) and
``2 * pp_size - 1 - p`` (chunk 1), so a micro-batch goes down the stages and back up; the
turn at stage pp-1 stays on that rank, and stage 0 holds both the first and the last chunk.

The word and position embeddings live on virtual stage 0 (stage 0, chunk 0); the final
LayerNorm and the output layer on the last virtual stage (stage pp-1, chunk V-1). The
trainer builds each chunk with ``pre_process=is_pre_process(...)`` and
``post_process=is_post_process(...)``.
"""

from __future__ import annotations

from typing import Optional, Sequence


class PartitionError(ValueError):
    """A layer count that cannot be split over the pipeline as configured."""


def parse_layer_split(text: str) -> list[int]:
    """Parse ``--pipeline-layer-split`` ("3,5,4") into layer counts per stage.

    Raises PartitionError when an entry is not an integer.
    """
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PartitionError(
            f"--pipeline-layer-split {text!r} must be a comma list of integers, one per pipeline stage, e.g. '3,5'"
        ) from None


def validate_partition(
    num_layers: int, pp_size: int, vp_size: int = 1, layer_split: Optional[Sequence[int]] = None
) -> None:
    """Check that ``num_layers`` can be partitioned; returns None or raises PartitionError.

    Rules: ``num_layers, pp_size, vp_size >= 1``; ``vp_size > 1`` needs ``pp_size >= 2``
    and no ``layer_split``; without ``layer_split``, ``num_layers`` must be divisible by
    ``pp_size * vp_size``; with it, it has ``pp_size`` entries, each >= 1, summing to
    ``num_layers``. Messages name ``--num-layers``, ``--pp``, ``--virtual-pipeline-size``
    or ``--pipeline-layer-split`` and the fix.
    """
    if num_layers < 1 or pp_size < 1 or vp_size < 1:
        raise PartitionError(
            f"--num-layers ({num_layers}), --pp ({pp_size}) and --virtual-pipeline-size ({vp_size}) must all be >= 1"
        )
    if vp_size > 1 and pp_size < 2:
        raise PartitionError(
            f"--virtual-pipeline-size {vp_size} needs --pp >= 2 (got --pp {pp_size}); set --virtual-pipeline-size 1"
        )
    if layer_split is not None:
        _validate_split(num_layers, pp_size, vp_size, list(layer_split))
        return
    per = pp_size * vp_size
    if num_layers % per != 0:
        lo, hi = (num_layers // per) * per, (num_layers // per + 1) * per
        fix = f"use --num-layers {hi}" + (f" or {lo}" if lo > 0 else "")
        raise PartitionError(
            f"--num-layers {num_layers} is not divisible by --pp {pp_size} x "
            f"--virtual-pipeline-size {vp_size} = {per}: {fix}, change --pp or "
            f"--virtual-pipeline-size, or (non-interleaved) give --pipeline-layer-split "
            f"with {pp_size} counts summing to {num_layers}"
        )


def _validate_split(num_layers: int, pp_size: int, vp_size: int, split: list[int]) -> None:
    if vp_size > 1:
        raise PartitionError(
            f"--pipeline-layer-split cannot be combined with --virtual-pipeline-size {vp_size}; drop one of them"
        )
    if len(split) != pp_size:
        raise PartitionError(
            f"--pipeline-layer-split {split} has {len(split)} entries but "
            f"--pp is {pp_size}: give one layer count per stage"
        )
    if min(split) < 1:
        raise PartitionError(f"--pipeline-layer-split {split}: every stage needs >= 1 layer")
    if sum(split) != num_layers:
        raise PartitionError(
            f"--pipeline-layer-split {split} sums to {sum(split)} but --num-layers is {num_layers}: make them agree"
        )


LAYOUTS = ("interleaved", "v")


def chunk_layout(schedule: str) -> str:
    """How a schedule places model chunks on stages: "v" for zb-v, else "interleaved"."""
    return "v" if schedule == "zb-v" else "interleaved"


def layer_ids(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    vp_size: int = 1,
    vp_rank: int = 0,
    layer_split: Optional[Sequence[int]] = None,
    layout: str = "interleaved",
) -> list[int]:
    """Global ids of the layers in model chunk ``vp_rank`` of stage ``pp_rank``.

    Example: ``layer_ids(8, 2, 1) == [4, 5, 6, 7]``; interleaved
    ``layer_ids(8, 2, 1, vp_size=2, vp_rank=1) == [6, 7]`` (block 1*2+1 of 2 layers);
    ``layer_ids(5, 2, 1, layer_split=[2, 3]) == [2, 3, 4]``; V shape
    ``layer_ids(8, 2, 1, vp_size=2, vp_rank=1, layout="v") == [4, 5]`` (virtual stage 2).
    Raises PartitionError (see ``validate_partition``) or ValueError for a rank out of range.
    """
    validate_partition(num_layers, pp_size, vp_size, layer_split)
    if not (0 <= pp_rank < pp_size and 0 <= vp_rank < vp_size):
        raise ValueError(f"pp_rank {pp_rank} / vp_rank {vp_rank} outside pp {pp_size} x vp {vp_size}")
    if layer_split is not None:
        start = sum(layer_split[:pp_rank])
        return list(range(start, start + layer_split[pp_rank]))
    per_chunk = num_layers // (pp_size * vp_size)
    block = virtual_stage(pp_rank, pp_size, vp_rank, layout)
    return list(range(block * per_chunk, (block + 1) * per_chunk))


def virtual_stage(pp_rank: int, pp_size: int, vp_rank: int = 0, layout: str = "interleaved") -> int:
    """Position of chunk ``vp_rank`` of stage ``pp_rank`` in the forward order: v*pp + p
    (interleaved), or p for chunk 0 and 2*pp - 1 - p for chunk 1 (V shape)."""
    if layout == "v":
        return pp_rank if vp_rank == 0 else 2 * pp_size - 1 - pp_rank
    return vp_rank * pp_size + pp_rank


def stage_of(virtual: int, pp_size: int, layout: str = "interleaved") -> tuple[int, int]:
    """(pp_rank, chunk) holding virtual stage ``virtual``: the inverse of ``virtual_stage``."""
    if layout == "v":
        return (virtual, 0) if virtual < pp_size else (2 * pp_size - 1 - virtual, 1)
    return virtual % pp_size, virtual // pp_size


def is_pre_process(pp_rank: int, vp_rank: int = 0) -> bool:
    """True for the chunk that holds the embeddings (stage 0, chunk 0; any layout)."""
    return pp_rank == 0 and vp_rank == 0


def is_post_process(
    pp_rank: int, pp_size: int, vp_rank: int = 0, vp_size: int = 1, layout: str = "interleaved"
) -> bool:
    """True for the chunk with the final LayerNorm, output layer and loss (the last virtual
    stage: last stage, last chunk; stage 0's chunk 1 in the V shape)."""
    return virtual_stage(pp_rank, pp_size, vp_rank, layout) == pp_size * vp_size - 1
