"""Sharded checkpoint pieces: which boxes of which full tensors a rank owns, and DCP planners.

A rank owns, for each of its parameters, runs of the flattened TENSOR-PARALLEL partition
(its ZeRO shard; all of it at ZeRO-0). Each run is written to, and read from, a
``torch.distributed.checkpoint`` (DCP) key ``"<name>/<state>"`` whose size is the FULL
(unpartitioned) shape, as chunks with global offsets:

1. a flat range of a row-major ``[R, C, ...]`` tensor is a few boxes, each contiguous in
   memory (``flat_boxes``: for 2-D a partial row, full rows, a partial row);
2. a box of a TP partition along ``partition_dim`` with stride s is cut at the s block
   boundaries and each piece moved to its place in the full tensor (``to_global``; the
   inverse of ``tags.partition_tensor``).

The chunks are views of the optimizer's own state (fp32 main params and Adam moments), so
saving hands DCP no copy (DCP's file writer copies one chunk at a time to serialize it), and
loading reads straight into them. ``SavePlanner``/``LoadPlanner`` are DCP's default
planners given these chunks instead of a state dict of tensors: DCP's save validation
checks that every key's chunks cover its full tensor without overlap, and its load
resharding (``create_read_items_for_chunk_list``) reads only the saved pieces that overlap
this rank's chunks, whatever layout saved them (one full-tensor chunk per key for the older
format).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megazero import tags

STATE_KEYS = ("main_param", "exp_avg", "exp_avg_sq")


@dataclass
class Chunk:
    """One box of a full tensor: ``offsets``/``sizes`` in the full tensor's coordinates and
    ``tensor`` (shape ``sizes``, fp32) its data: a view of the optimizer's state."""

    offsets: tuple
    sizes: tuple
    tensor: torch.Tensor

    @property
    def md(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))


def flat_boxes(shape: tuple, start: int, end: int) -> list[tuple[tuple, tuple]]:
    """Boxes ``(offsets, sizes)`` covering elements ``[start, end)`` of a row-major tensor of
    ``shape``, in memory order; each box is one contiguous run. At most ``2 ndim - 1`` boxes
    (2-D: a partial row, the full rows, a partial row). ``[]`` for an empty range."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner, rest = math.prod(shape[1:]), tuple(shape[1:])

    def in_row(row: int, a: int, b: int) -> list:
        return [((row,) + o, (1,) + s) for o, s in flat_boxes(rest, a - row * inner, b - row * inner)]

    out, a = [], start
    if a % inner:  # partial leading row
        stop = min(end, (a // inner + 1) * inner)
        out += in_row(a // inner, a, stop)
        a = stop
    rows = (end - a) // inner
    if rows > 0:  # whole rows
        out.append(((a // inner,) + (0,) * len(rest), (rows,) + rest))
        a += rows * inner
    if a < end:  # partial trailing row
        out += in_row(a // inner, a, end)
    return out


def global_shape(param: torch.Tensor, tp_size: int) -> tuple:
    """The full (unpartitioned) shape of ``param`` (``tp_size`` x its partition dim; etp x for an
    expert cut over etp ranks, ``tags.partition_coords``)."""
    shape = list(param.shape)
    if tags.is_partitioned(param):
        shape[param.partition_dim] *= tags.partition_coords(param, 0, tp_size)[1]
    return tuple(shape)


def to_global(
    param: torch.Tensor, offsets: tuple, sizes: tuple, tp_rank: int, tp_size: int
) -> list[tuple[tuple, tuple, int, int]]:
    """Pieces ``(global offsets, sizes, local start, length)`` of the local box ``(offsets,
    sizes)`` of TP partition ``param``: the box is cut at the ``partition_stride`` block
    boundaries of ``partition_dim`` (``local start``/``length`` along that dim, relative to
    the box) and each piece placed where ``tags.partition_tensor`` took it from."""
    if not tags.is_partitioned(param):
        return [(tuple(offsets), tuple(sizes), 0, sizes[0] if sizes else 0)]
    tp_rank, tp_size = tags.partition_coords(param, tp_rank, tp_size)  # an expert cut over etp ranks
    d, s = param.partition_dim, param.partition_stride
    block = param.shape[d] // s
    out, i, end = [], offsets[d], offsets[d] + sizes[d]
    while i < end:
        stop = min(end, (i // block + 1) * block)
        g = list(offsets)
        g[d] = (i // block) * block * tp_size + tp_rank * block + i % block
        size = list(sizes)
        size[d] = stop - i
        out.append((tuple(g), tuple(size), i - offsets[d], stop - i))
        i = stop
    return out


def writes_here(param: torch.Tensor, tp_rank: int, dp_rank: int, sharded_over_dp: bool) -> bool:
    """Whether this rank's copy of ``param``'s owned runs is the one written: replicated
    copies (TP-replicated parameters, every DP rank at ZeRO-0, the uncounted copy of a weight
    tied across stages) are written once."""
    if tags.is_shared_embedding(param) and not getattr(param, "shared_counted_here", True):
        return False
    return (tags.is_partitioned(param) or tp_rank == 0) and (sharded_over_dp or dp_rank == 0)


def owned_chunks(
    optimizer, groups, select: Optional[Callable[[torch.Tensor], bool]] = None
) -> tuple[dict[str, list[Chunk]], dict[str, tuple]]:
    """(``{"<name>/<state>": [Chunk]}``, ``{name: (param, full shape)}``) of this rank's owned
    runs (``optimizer.owned_state()``), only of parameters where ``select(param)`` holds
    (default: all). Every chunk's tensor is a view of the optimizer's state."""
    chunks: dict[str, list[Chunk]] = {}
    params: dict[str, tuple] = {}
    for name, p, pr, *views in optimizer.owned_state():
        params[name] = (p, global_shape(p, groups.tp_size))
        if select is not None and not select(p):
            continue
        pos = pr.start
        for offsets, sizes in flat_boxes(tuple(p.shape), pr.start, pr.end):
            n = math.prod(sizes)
            for g, size, lo, length in to_global(p, offsets, sizes, groups.tp_rank, groups.tp_size):
                for key, view in zip(STATE_KEYS, views):
                    t = view[pos - pr.start : pos - pr.start + n].view(sizes)
                    if tags.is_partitioned(p):
                        t = t.narrow(p.partition_dim, lo, length)
                    chunks.setdefault(f"{name}/{key}", []).extend(_contiguous(g, size, t))
            pos += n
    return chunks, params


def partition_chunks(param: torch.Tensor, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> list[Chunk]:
    """The chunks of the full tensor that rank ``tp_rank``'s TP partition ``param`` is: its
    whole box cut at the ``partition_stride`` blocks (``to_global``), each chunk a view of
    ``tensor`` (the partition's values, ``param``'s shape), for reading straight into it. A
    replicated parameter is one chunk, the whole tensor."""
    shape = tuple(param.shape)
    out = []
    for g, size, lo, length in to_global(param, (0,) * len(shape), shape, tp_rank, tp_size):
        view = tensor.narrow(param.partition_dim, lo, length) if tags.is_partitioned(param) else tensor
        out.append(Chunk(g, size, view))
    return out


def _contiguous(offsets: tuple, sizes: tuple, t: torch.Tensor) -> list[Chunk]:
    """``Chunk(offsets, sizes, t)`` split along its leading dims until every piece is one
    contiguous run of memory (a box narrowed along a later dim by a partition stride)."""
    if t.is_contiguous():
        return [Chunk(tuple(offsets), tuple(sizes), t)]
    j = next(i for i, n in enumerate(sizes) if n > 1)
    out = []
    for i in range(sizes[j]):
        o, s = list(offsets), list(sizes)
        o[j], s[j] = o[j] + i, 1
        out += _contiguous(tuple(o), tuple(s), t.narrow(j, i, 1))
    return out


def compact_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, on the CPU) as a tensor whose storage is exactly its own bytes, a
    slice of ``t``'s storage sharing its memory: DCP's file writer then writes it as is
    (it copies any tensor whose storage is larger than the tensor, and keeps the last copy
    of every key until the rank's file is closed)."""
    begin = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()[begin : begin + t.numel() * t.element_size()]
    return torch.empty(0, dtype=t.dtype, device="cpu").set_(storage).view(t.shape)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner writing ``chunks`` (``{key: [Chunk]}``) with their global
    offsets and ``sizes`` (``{key: full shape}``); the state dict given to ``dcp.save`` is
    ignored (pass ``{}``). ``resolve_data`` hands DCP a CPU tensor of one chunk: a
    ``compact_view`` of the state when it is on the CPU (no copy), a one-chunk host copy when
    it is on a GPU (DCP keeps the last copy of each key until the rank's file is closed)."""

    def __init__(self, chunks: dict[str, list[Chunk]], sizes: dict[str, tuple]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks, self.sizes = chunks, sizes
        self.by_index = {(k, tuple(c.offsets)): c for k, cs in chunks.items() for c in cs}

    def create_local_plan(self) -> SavePlan:
        props = TensorProperties(dtype=torch.float32)
        self.plan = SavePlan(
            [
                WriteItem(
                    index=MetadataIndex(key, torch.Size(c.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=c.md, properties=props, size=torch.Size(self.sizes[key])),
                )
                for key, cs in self.chunks.items()
                for c in cs
            ]
        )
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        t = self.by_index[(write_item.index.fqn, tuple(write_item.index.offset))].tensor.detach()
        return compact_view(t) if t.device.type == "cpu" else t.cpu()


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner reading, for each ``Chunk`` of ``chunks``, the overlapping
    pieces of the saved chunks (any saved layout) straight into the chunk's tensor; the state
    dict given to ``dcp.load`` is ignored (pass ``{}``)."""

    def __init__(self, chunks: dict[str, list[Chunk]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        return LoadPlan(
            [
                item
                for key, cs in self.chunks.items()
                for item in create_read_items_for_chunk_list(key, md[key], [c.md for c in cs])
            ]
        )

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.chunks[index.fqn][index.index].tensor
