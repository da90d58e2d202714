"""``build_trainer``: the one recipe from settings to a ready Trainer.

settings (a ``Config`` or command-line flags) -> data (``build_data``: tokenizer, datasets,
vocabulary size) -> process groups of the layout (``ProcessGroups.build``) -> ``Trainer``. The
training loop, the tests, the benchmarks and ``python -m scripts.plan`` all build through here, so the
order of these steps is written once.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from data.run_data import RunData
from megazero.config import Config, config_from_argv, layout_topology
from megazero.process_groups import ProcessGroups
from megazero.training.inputs import build_data
from megazero.training.trainer import Trainer


def build_trainer(
    cfg: Union[Config, Sequence[str]],
    world_size: Optional[int] = None,
    *,
    data: Optional[RunData] = None,
    groups: Optional[ProcessGroups] = None,
    device: Union[str, torch.device] = "cpu",
    **collaborators,
) -> Trainer:
    """A Trainer for ``cfg`` on this rank, with the run's data at ``trainer.data``.

    ``cfg``: a ``Config``, or flags as ``train.py`` takes them (parsed by ``config_from_argv`` at
    ``world_size``, default: the default process group's size, 1 without one). ``data``: the
    run's ``RunData`` (default ``build_data(cfg)``; pass ``prepare_run(cfg)``'s to resume with
    ``--load``). ``groups``: the layout's process groups (default ``ProcessGroups.build`` of the
    layout's topology with ``--distributed-timeout-s``, a collective when the world has more than
    one rank). ``device``: where the
    model lives. ``collaborators``: ``Trainer``'s keyword arguments (``stop_flags``, ``fault``,
    ``trail``, ``monitor``); ``eod`` defaults to the tokenizer's end-of-document id.

    Raises ConfigError (a bad flag), DataError (an unusable corpus or tokenizer).
    """
    if not isinstance(cfg, Config):
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        cfg = config_from_argv(list(cfg), world_size)
    data = build_data(cfg) if data is None else data
    if groups is None:
        groups = ProcessGroups.build(layout_topology(cfg), timeout_s=cfg.parallel.distributed_timeout_s)
    collaborators.setdefault("eod", None if data.tokenizer is None else data.tokenizer.eod)
    trainer = Trainer(cfg, groups, torch.device(device), data.vocab_size, data=data, **collaborators)
    return trainer
