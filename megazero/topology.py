"""Pure rank arithmetic for 3D parallelism: global rank <-> (tp, dp, pp) coordinates.

The order is "tp-dp-pp": tensor-parallel ranks are innermost (adjacent global ranks, so one
TP group sits on one node and its all-reduces stay on NVLink), then data-parallel, then
pipeline stages outermost, as in Megatron-LM (Narayanan et al. 2021, sec. 3.3):

    tp_rank = rank % tp
    dp_rank = (rank // tp) % dp
    pp_rank = rank // (tp * dp)

This module imports no torch.distributed; it is the one place where the order is written.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coord:
    """Position of one rank in the (tp, dp, pp) grid."""

    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Topology:
    """A (tp, pp, dp) layout of ``world_size = tp * pp * dp`` ranks.

    Raises:
        ValueError: a size below 1.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coord(self, rank: int) -> Coord:
        """Coordinates of global ``rank``. Raises ValueError when rank is outside the world."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return Coord(tp=rank % self.tp, dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp))

    def rank(self, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at coordinates (tp, dp, pp)."""
        if not (0 <= tp < self.tp and 0 <= dp < self.dp and 0 <= pp < self.pp):
            raise ValueError(f"coordinate (tp={tp}, dp={dp}, pp={pp}) outside {self}")
        return tp + self.tp * (dp + self.dp * pp)

    # Group membership: every function returns the sorted global ranks of the group that
    # contains ``rank``; *_groups() return all groups of a kind (each a sorted list).
    def tp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(t, c.dp, c.pp) for t in range(self.tp)]

    def dp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(c.tp, d, c.pp) for d in range(self.dp)]

    def pp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(c.tp, c.dp, p) for p in range(self.pp)]

    def mp_group(self, rank: int) -> list[int]:
        """Model-parallel group: all tp x pp ranks that hold one replica of the model."""
        c = self.coord(rank)
        return sorted(self.rank(t, c.dp, p) for t in range(self.tp) for p in range(self.pp))

    def embedding_group(self, rank: int) -> list[int]:
        """First and last stage at this rank's (tp, dp): the holders of tied embedding copies.

        With pp == 1 the group is the rank alone (the tie is inside one module).
        """
        c = self.coord(rank)
        return sorted({self.rank(c.tp, c.dp, 0), self.rank(c.tp, c.dp, self.pp - 1)})

    def tp_groups(self) -> list[list[int]]:
        return _unique(self.tp_group(r) for r in range(self.world_size))

    def dp_groups(self) -> list[list[int]]:
        return _unique(self.dp_group(r) for r in range(self.world_size))

    def pp_groups(self) -> list[list[int]]:
        return _unique(self.pp_group(r) for r in range(self.world_size))

    def mp_groups(self) -> list[list[int]]:
        return _unique(self.mp_group(r) for r in range(self.world_size))

    def embedding_groups(self) -> list[list[int]]:
        return _unique(self.embedding_group(r) for r in range(self.world_size))


def _unique(groups) -> list[list[int]]:
    seen, out = set(), []
    for g in groups:
        if tuple(g) not in seen:
            seen.add(tuple(g))
            out.append(list(g))
    return out
