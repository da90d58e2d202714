"""The one load function: command line -> DeepSpeed file -> derivation -> checks.

``config_from_argv`` is what train.py, the launcher's preflight and the scripts call; it is
pure (the world size is passed in), so every rank runs it before any process group exists
(docs/design.md, contract 3).
"""

from __future__ import annotations

import math
import os
import sys

from megazero.config.checks import validate
from megazero.config.cli import parse_args
from megazero.config.deepspeed import load_deepspeed_config
from megazero.config.derive import finalize
from megazero.config.schema import Config, ConfigError


def config_from_argv(
    argv: list[str], world_size: int, *, print_warnings: bool = True, needs_data: bool = True
) -> Config:
    """parse -> DeepSpeed file -> finalize -> validate. Pure: needs no process group.

    On ConfigError prints ``megazero: config error: <message>`` to stderr and exits with code 2.
    Warnings go to ``cfg.warnings`` and, when ``print_warnings``, to stderr. ``needs_data=False``
    (a tool that reads no training data, e.g. scripts/plan.py) accepts a run without
    ``--data-path`` / ``--mock-data``; a training run keeps the default.
    """
    try:
        cfg = parse_args(argv)
        warnings = load_deepspeed_config(cfg.deepspeed_config, cfg) if cfg.deepspeed_config else []
        warnings += finalize(cfg, world_size)
        validate(cfg, world_size, needs_data=needs_data)
    except ConfigError as e:
        print(f"megazero: config error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    cfg.warnings = warnings
    for w in warnings if print_warnings else ():
        print(f"megazero: config warning: {w}", file=sys.stderr, flush=True)
    return cfg


def resolve_run_dir(cfg: Config, stamp: str) -> str:
    """Set ``--run-dir`` to ``runs/<stamp>`` when not given; every rank must pass the same stamp."""
    if cfg.log.run_dir is None:
        cfg.log.run_dir = os.path.join("runs", stamp)
    return cfg.log.run_dir


def parallel_sizes(argv: list[str]) -> tuple[int, int, int, int]:
    """(tp, cp, pp, dp) as ``argv`` asks for them: the layout flags under any of their names
    (e.g. --tp or --tensor-model-parallel-size), then a ``--deepspeed-config`` file's
    ``sequence_parallel_size`` for a ``--cp`` not given; 1 for each size given nowhere (dp
    too). For the launcher, which must know how many ranks to start before any rank reads the
    config, and for tools that plan a run without launching it. Settings that do not parse,
    or a file that does not load, give 1s here and their error from ``config_from_argv``,
    which reads the same argv next."""
    try:
        cfg = parse_args(argv)
        if cfg.deepspeed_config:
            load_deepspeed_config(cfg.deepspeed_config, cfg)
    except (ConfigError, SystemExit, OSError):
        return (1, 1, 1, 1)
    p = cfg.parallel
    return (p.tp, p.cp, p.pp, p.dp or 1)


def world_size_of(argv: list[str]) -> int:
    """tp x cp x pp x dp of ``parallel_sizes(argv)``: the ranks the layout asks for."""
    return math.prod(parallel_sizes(argv))
