"""Flat gradient layout for ZeRO: one contiguous buffer, fixed-size buckets, equal shards.

The layout follows Megatron-LM's distributed optimizer
(``megatron/core/distributed/param_and_grad_buffer.py``) and
ZeRO's partitioning (Rajbhandari et al., SC'20, sec. 5): the parameters of one model chunk
(one dtype) are laid end to end in *reverse* registration order, because backward produces
gradients roughly last layer first, so the first bucket fills first. The flat stream is cut
into buckets at fixed boundaries; a parameter may straddle a boundary. Each bucket's size
is a multiple of the data-parallel size N (the bucket size is rounded up to one, and the
last bucket is zero-padded), so every DP rank owns an equal contiguous shard of EVERY
bucket, and a reduce-scatter of one bucket gives each rank its shard.

Coordinate systems (``OwnedRange(world, local, grad)`` in docs/design.md, "Data parallel
and optimizer"), all in elements:

- *world*: an index into the padded flat buffer of this chunk, ``[0, padded_numel)``; the
  same on every DP rank. ``param_range[p]`` and ``Bucket.range`` are world ranges.
- *local*: an index into the concatenation of one DP rank's shards of all buckets, in
  bucket order, ``[0, padded_numel / N)``. The optimizer's fp32 main params, moments and
  the ZeRO-2 gradient shard are local-coordinate tensors (an fp32 model's main params
  are its parameters, which live in world coordinates: see ``sharding.py``).
- *param*: an index into one parameter's flattened ``view(-1)``.

Bucket ``k`` (world ``[s, e)``, shard ``n = (e - s) / N``) gives rank ``r`` the world range
``[s + r n, s + (r + 1) n)``, which is local range ``[L_k, L_k + n)`` with ``L_k`` the
sum of the earlier buckets' shards.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional

import torch


@dataclass(frozen=True)
class Range:
    """Half-open element interval ``[start, end)`` of a flat tensor (coordinates named by use)."""

    start: int
    end: int

    def __post_init__(self):
        if not 0 <= self.start <= self.end:
            raise ValueError(f"Range({self.start}, {self.end}) needs 0 <= start <= end")

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: "Range") -> Optional["Range"]:
        """The common part, or ``None`` when it is empty."""
        s, e = max(self.start, other.start), min(self.end, other.end)
        return Range(s, e) if s < e else None

    def shift(self, offset: int) -> "Range":
        """The same interval moved by ``offset`` (may be negative, result must stay >= 0)."""
        return Range(self.start + offset, self.end + offset)


@dataclass(frozen=True)
class Bucket:
    """One bucket: its world range, this rank's shard of it, and the params overlapping it.

    ``shard_world`` / ``shard_local``: this rank's shard in world / local coordinates.
    ``params``: indices (into ``GradBuffer.params``) of the parameters overlapping it.
    """

    index: int
    range: Range
    shard_world: Range
    shard_local: Range
    params: tuple[int, ...]

    @property
    def shard_size(self) -> int:
        return self.shard_local.size


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class GradBuffer:
    """Layout of one flat gradient buffer over ``params`` for ``dp_size`` DP ranks.

    Args:
        params: parameters of one model chunk, in registration order (duplicates removed).
        bucket_size: elements per bucket; rounded up to a multiple of ``dp_size``.
        dp_size, dp_rank: data-parallel size N and this rank's index in the DP group.

    Attributes: ``params`` (reverse registration order, the buffer order), ``param_range``
    (id(param) -> world Range), ``numel`` (elements of all params), ``padded_numel``
    (a multiple of N), ``buckets`` (list[Bucket]), ``shard_numel`` (local size =
    ``padded_numel / N``). This class holds the layout only; ``sharding.ShardedBuffer`` owns storage.

    Raises ValueError for an empty parameter list, ``bucket_size < 1`` or a
    non-contiguous parameter (its flat view would not alias it) other than a zero-stride
    placeholder (``model.materialize.use_placeholders``: its values come from elsewhere).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], bucket_size: int, dp_size: int, dp_rank: int):
        unique = list({id(p): p for p in params}.values())
        if not unique:
            raise ValueError("GradBuffer: no parameters")
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
        for p in unique:
            if not p.is_contiguous() and any(p.stride()):
                raise ValueError(f"GradBuffer: parameter of shape {tuple(p.shape)} is not contiguous")
        self.params = unique[::-1]
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.param_range: dict[int, Range] = {}
        offset = 0
        for p in self.params:
            self.param_range[id(p)] = Range(offset, offset + p.numel())
            offset += p.numel()
        self.numel = offset
        self.padded_numel = round_up(offset, dp_size)
        self.bucket_size = round_up(bucket_size, dp_size)
        self.buckets = self._make_buckets()
        self.shard_numel = self.padded_numel // dp_size
        # id(param) -> indices of the buckets it overlaps (a parameter may span several)
        self.param_buckets: dict[int, tuple[int, ...]] = {
            id(p): tuple(b.index for b in self.buckets if i in b.params) for i, p in enumerate(self.params)
        }
        # increasing ends, for the range look-ups below (bisect instead of a scan per call)
        self._shard_local_ends = [b.shard_local.end for b in self.buckets]
        self._param_ends = [self.param_range[id(p)].end for p in self.params]

    def _make_buckets(self) -> list[Bucket]:
        buckets, local = [], 0
        for k, start in enumerate(range(0, self.padded_numel, self.bucket_size)):
            world = Range(start, min(start + self.bucket_size, self.padded_numel))
            n = world.size // self.dp_size
            shard_world = Range(start + self.dp_rank * n, start + (self.dp_rank + 1) * n)
            members = tuple(
                i for i, p in enumerate(self.params) if self.param_range[id(p)].intersect(world) is not None
            )
            buckets.append(Bucket(k, world, shard_world, Range(local, local + n), members))
            local += n
        return buckets

    def shard_world_range(self, bucket: Bucket, rank: int) -> Range:
        """World range of DP rank ``rank``'s shard of ``bucket``."""
        n = bucket.range.size // self.dp_size
        return Range(bucket.range.start + rank * n, bucket.range.start + (rank + 1) * n)

    def local_to_world(self, local: Range, rank: int) -> list[tuple[Range, Range]]:
        """Split rank ``rank``'s local range into ``(world range, local range)`` pieces.

        Every rank's shards have the same local layout, so ``rank`` only moves the world
        position. Pieces come in increasing local order, one per bucket touched.
        """
        pieces = []
        for b in self.buckets[bisect.bisect_right(self._shard_local_ends, local.start) :]:
            if b.shard_local.start >= local.end:
                break
            part = b.shard_local.intersect(local)
            if part is None:
                continue
            world0 = self.shard_world_range(b, rank).start - b.shard_local.start
            pieces.append((part.shift(world0), part))
        return pieces

    def param_pieces(self, world: Range) -> list[tuple[torch.nn.Parameter, Range, Range]]:
        """Parameters overlapping world range ``world`` as ``(param, param range, world range)``.

        Padding (world indices past ``numel``) belongs to no parameter and is skipped.
        """
        out = []
        for p in self.params[bisect.bisect_right(self._param_ends, world.start) :]:
            r = self.param_range[id(p)]
            if r.start >= world.end:
                break
            part = r.intersect(world)
            if part is not None:
                out.append((p, part.shift(-r.start), part))
        return out
