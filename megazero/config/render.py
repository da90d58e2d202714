"""A Config rendered for people and files: ``describe`` (one line per setting, with where it
came from) for the log and TensorBoard, ``to_dict`` (plain JSON data) for checkpoints."""

from __future__ import annotations

import dataclasses
from typing import Any

from megazero.config.schema import Config, get_value, settings


def to_dict(cfg: Config) -> dict[str, Any]:
    """The settings as nested plain data (JSON-serialisable), without sources and warnings."""
    out = {
        f.name: dataclasses.asdict(getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
        if dataclasses.is_dataclass(getattr(cfg, f.name))
    }
    out["deepspeed_config"] = cfg.deepspeed_config
    return out


def describe(cfg: Config) -> str:
    """One line per setting, ``section.name = value  [source]``, then the warnings."""
    lines = []
    for s in settings():
        src = cfg.sources.get(s.name)
        lines.append(f"{s.name:<46} = {get_value(cfg, s.name)!r}" + (f"   [{src}]" if src else ""))
    lines += [f"warning: {w}" for w in cfg.warnings]
    return "\n".join(lines)
