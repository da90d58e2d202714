"""The one place that maps a ZeRO stage number to its sharding strategy.

Stages 0-2 live in :mod:`megazero.data_parallel.sharding`, stage 3 (which builds on stage 2)
in :mod:`megazero.data_parallel.zero3`; this module imports both, so neither imports the other
back (Rajbhandari et al., SC'20, sec. 5: P_os, P_os+g, P_os+g+p).
"""
from __future__ import annotations

from megazero.data_parallel.sharding import ShardingStrategy, Stage0, Stage1, Stage2
from megazero.data_parallel.zero3 import Stage3

STRATEGIES: dict[int, type[ShardingStrategy]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}


def make_strategy(stage: int) -> ShardingStrategy:
    """A fresh strategy of ZeRO stage ``stage`` (0-3). Raises ValueError for an unknown stage."""
    if stage not in STRATEGIES:
        raise ValueError(f"zero_stage must be one of {sorted(STRATEGIES)}, got {stage}")
    return STRATEGIES[stage]()
