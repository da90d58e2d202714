"""Optional extras in tests: skip when a package is not installed, fail instead under CI=true.

``scripts/test.sh`` installs the extras (pyproject's ``dev``, ``hf``, ``wandb``, ``data``, ``eval``); a test that needs
one calls ``require("transformers")`` so a developer without them still runs the rest, while
CI, where they must be present, cannot silently skip them.
"""

import importlib
import os

import pytest


def require(module: str):
    """The imported ``module``; skips the test when missing (fails when CI=true)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(
                f"CI=true but the optional extra {module!r} is missing ({e}); "
                "scripts/test.sh installs it with pip install -e .[dev,hf,wandb,data,eval]"
            )
        pytest.skip(f"optional extra {module!r} not installed (pip install -e .[dev,hf,wandb,data,eval])")
