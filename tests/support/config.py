"""Assertions on configuration errors: fails (the one-line ConfigError naming the setting)."""

import pytest

from megazero.config import (
    config_from_argv,
)


def fails(argv, world, capsys):
    """config_from_argv must exit with code 2 and one 'megazero: config error:' line; returns it."""
    with pytest.raises(SystemExit) as exc:
        config_from_argv(argv, world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megazero: config error: ") and err.count("\n") == 1, err
    return err
