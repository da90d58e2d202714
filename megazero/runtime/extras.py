"""The optional extras of ``pyproject.toml`` (``[project.optional-dependencies]``) and the one
import guard for their packages.

``require(module, what)`` imports an optional package where a feature needs it. When the
package is missing it raises MissingExtra with the one line the launcher's preflight and the
scripts print before exit code 2, naming the feature, the extra and the command:

    --from-hf needs the optional extra hf (safetensors is not installed); fix: pip install -e .[hf]

``EXTRA_OF`` maps each optional package to its extra (tests/launcher/test_hostile_inputs.py checks it
against pyproject.toml). ``data/`` may not import megazero, so data/tokenizer.py (``tokenizers``)
and data/sources.py (``pyarrow``, ``zstandard``) word their own guards with
``missing_extra_message``'s form (tests compare).
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA_OF = {
    "transformers": "hf",
    "safetensors": "hf",
    "tokenizers": "hf",
    "wandb": "wandb",
    "pyarrow": "data",
    "zstandard": "data",
    "datasets": "data",
    "lm_eval": "eval",
}


class MissingExtra(ImportError):
    """An optional package that the requested feature needs is not installed (or does not
    import); the message is one line naming the feature, the extra and the fix."""


def missing_extra_message(module: str, what: str, reason: str = "is not installed") -> str:
    """``<what> needs the optional extra <extra> (<module> <reason>); fix: pip install -e .[<extra>]``."""
    extra = EXTRA_OF[module.split(".")[0]]
    return f"{what} needs the optional extra {extra} ({module} {reason}); fix: pip install -e .[{extra}]"


def require(module: str, what: str) -> ModuleType:
    """``importlib.import_module(module)`` for an optional package of ``EXTRA_OF`` that ``what``
    (a flag or script, e.g. ``"--from-hf"``) needs.

    Raises MissingExtra (an ImportError) with ``missing_extra_message``'s one line when the
    package is not installed, or when it is installed but fails to import (the line then
    quotes the import error); KeyError for a module that is not an optional package.
    """
    top = module.split(".")[0]
    if top not in EXTRA_OF:
        raise KeyError(f"{module} is not an optional package of pyproject.toml (EXTRA_OF)")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        # not installed, or installed but broken (a dependency or binary extension missing)
        missing = isinstance(e, ModuleNotFoundError) and (e.name or top).split(".")[0] == top
        reason = "is not installed" if missing else "cannot be imported: " + " ".join(str(e).split())
        raise MissingExtra(missing_extra_message(module, what, reason)) from None
