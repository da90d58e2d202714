"""The command line of megazero's config, generated from the schema's fields.

Megatron-style long flags (plus ``--tp/--pp/--dp``), one option per setting of
``schema.settings()``: its flags, type, choices and help text (meaning, unit, default) all
come from the field's metadata. ``flags_table()`` renders the same metadata as the README's
Markdown table, so ``--help`` and the README cannot disagree.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable

from megazero.config.schema import Config, ConfigError, Setting, set_value, setting_named, settings


def integer(text: str) -> int:
    """An integer flag value; accepts DeepSpeed-style ``5e8`` when it is a whole number.

    Raises ValueError when the text is not a whole number.
    """
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise ValueError(text) from None
        return int(value)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message}; fix: see `python train.py --help` for the flags")


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A field's ``parse`` as an argparse type: its ValueError's message becomes the error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def _help(s: Setting) -> str:
    m = s.field.metadata
    unit = f" [{m['unit']}]" if m["unit"] else ""
    if s.base is bool:
        return m["help"] + unit + (" (on by default; this flag turns it off)" if s.field.default else "")
    return f"{m['help']}{unit} (default: {s.default})"


def _option(s: Setting) -> dict[str, Any]:
    """argparse keywords of one setting's option."""
    kw: dict[str, Any] = dict(dest=s.name, help=_help(s).replace("%", "%%"))
    meta = s.field.metadata
    if s.base is not bool and not meta["choices"]:
        kw["metavar"] = s.name.split(".")[-1].upper()
    if s.base is bool:
        kw["action"] = "store_false" if s.field.default else "store_true"
    elif meta["parse"] is not None:
        kw["type"] = _argument_type(meta["parse"])
    elif s.base is list:
        kw.update(nargs="+", type=str)
    else:
        kw["type"] = {int: integer, float: float, str: str}[s.base]
        if meta["choices"]:
            kw["choices"] = meta["choices"]
    return kw


@functools.lru_cache(maxsize=None)
def build_parser() -> argparse.ArgumentParser:
    """The argparse parser, one option per setting; absent flags leave no attribute.

    Its ``error`` raises ConfigError instead of exiting.
    """
    parser = _Parser(
        prog="train.py",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
        description="megazero: 3D-parallel GPT pretraining (see README.md).",
    )
    groups: dict[str, Any] = {}
    for s in settings():
        section = s.name.split(".")[0] if "." in s.name else "files"
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        groups[section].add_argument(*s.flags, **_option(s))
    return parser


def parse_args(argv: list[str]) -> Config:
    """Defaults overridden by the flags in ``argv``; records each given flag in ``cfg.sources``.

    Raises ConfigError on an unknown flag or a value of the wrong type (message names the flag).
    """
    cfg = Config()
    for name, value in vars(build_parser().parse_args(list(argv))).items():
        set_value(cfg, name, value)
        cfg.sources[name] = setting_named(name).flag
    return cfg


def flags_table() -> str:
    """A Markdown table of every flag: flags, default, unit, meaning (for the README)."""
    rows = ["| flag | default | unit | meaning |", "|---|---|---|---|"]
    for s in settings():
        meta = s.field.metadata
        shown = "off" if s.base is bool else f"`{s.default}`"
        meaning = meta["help"] + (f" ({' / '.join(meta['choices'])})" if meta["choices"] else "")
        if s.base is bool and s.field.default:
            meaning += " (on by default; the flag turns it off)"
        flags = ", ".join(f"`{f}`" for f in s.flags)
        rows.append(f"| {flags} | {shown} | {meta['unit']} | {meaning.replace('|', '/')} |")
    return "\n".join(rows)
