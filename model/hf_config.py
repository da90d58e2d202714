"""Reading a Hugging Face ``config.json``: the conversion error and the typed value reader that
``model.hf`` (GPT-2, LLaMA) and ``model.hf_moe`` (Mixtral, Qwen2-MoE) share."""

from __future__ import annotations

import json
import math
from typing import Mapping


class HFConversionError(ValueError):
    """A model or folder that cannot be converted exactly; the message names the difference."""


_REQUIRED = object()
_KINDS = {
    "size": "a whole number >= 1",
    "count": "a whole number >= 0",
    "number": "a finite number > 0",
    "flag": "true or false",
    "table": "a JSON object",
}


def config_value(config: Mapping, key: str, kind: str, default=_REQUIRED):
    """``config[key]`` of ``kind`` (``_KINDS``); ``default`` when absent or null. Raises
    HFConversionError naming the key when it is required and absent, or of another kind."""
    v = config.get(key)
    if v is None:
        if default is _REQUIRED:
            raise HFConversionError(
                f"{key!r} is missing; fix: a complete config.json (as "
                "python -m scripts.convert_checkpoint --to-hf or save_pretrained writes it)"
            )
        return default
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    ok = {
        "size": number and isinstance(v, int) and v >= 1,
        "count": number and isinstance(v, int) and v >= 0,
        "flag": isinstance(v, bool),
        "number": number and math.isfinite(v) and v > 0,
        "table": isinstance(v, dict),
    }[kind]
    if not ok:
        raise HFConversionError(f"{key} = {json.dumps(v)[:60]} is not {_KINDS[kind]}; fix: correct config.json")
    return v
