"""The one place that maps a ZeRO stage number to its sharding strategy.

Each strategy's ``stage`` is its policy's (:mod:`megazero.data_parallel.policy`, which the
config and the planner ask without building anything). Stages 0-2 live in
:mod:`megazero.data_parallel.sharding`, stage 3 (which builds on stage 2) in
:mod:`megazero.data_parallel.zero3`; this module imports both, so neither imports the other
back (Rajbhandari et al., SC'20, sec. 5: P_os, P_os+g, P_os+g+p).
"""

from __future__ import annotations

from megazero.data_parallel.policy import sharding_policy
from megazero.data_parallel.sharding import ShardingStrategy, Stage0, Stage1, Stage2
from megazero.data_parallel.zero3 import Stage3

STRATEGIES: dict[int, type[ShardingStrategy]] = {s.stage: s for s in (Stage0, Stage1, Stage2, Stage3)}


def make_strategy(stage: int) -> ShardingStrategy:
    """A fresh strategy of ZeRO stage ``stage`` (0-3). Raises ValueError for an unknown stage."""
    sharding_policy(stage)  # the error names the known stages
    return STRATEGIES[stage]()
