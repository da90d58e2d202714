"""Reading a Hugging Face model folder (``config.json`` + ``model.safetensors``) from disk: the
one boundary where the third-party readers' own errors become HFConversionError naming the
file, and where every tensor's name, shape and dtype are checked against the model before
any tensor is loaded (``model/hf.py`` is the name map; it reads no file).

What the readers raise for a file they cannot read (found by reading their Python APIs --
``safetensors/__init__.pyi``: ``SafetensorError`` derives from ``Exception`` only -- and by
feeding each a missing file, a directory, an empty, a truncated, a padded and a garbage
file, a header with bad JSON, bad UTF-8, an unknown dtype or offsets that contradict the
shapes; tests/launcher/test_hostile_inputs.py keeps the cases):

- ``open`` + ``json.load`` (config.json): OSError (missing, a directory, no permission),
  UnicodeDecodeError and json.JSONDecodeError (both ValueError), RecursionError (JSON nested
  too deep). Valid JSON that is not an object is refused here; a key that is missing or of
  the wrong kind by ``model.hf`` (HFConversionError naming the key).
- ``safetensors.safe_open`` (model.safetensors): OSError (missing; a directory gives "No such
  device"); ``SafetensorError`` for everything else: safe_open validates the whole header at
  open (header too small or too large, invalid JSON or UTF-8, unknown dtype, offsets that do
  not match the shapes, a file shorter or longer than its header says, i.e. truncated). After
  that, ``get_slice(name).get_shape()`` / ``get_dtype()`` read no data and raise nothing.
- ``get_tensor`` then ``.float()``: a dtype torch cannot convert (e.g. F4: NotImplementedError)
  or that is not a real floating-point weight (integers, bool, complex, fp8 with scales) --
  refused before loading by the dtype check (``FLOAT_DTYPES``).

A folder's ``tokenizer.json`` is read by data/tokenizer.py (DataError); safetensors itself is
the optional extra ``hf`` (``megazero.runtime.extras.require``: MissingExtra).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Iterator

from megazero.runtime.extras import require
from model.config import GPTConfig
from model.hf import CanonicalView, HFConversionError, check_matches, config_from_hf, hf_shapes
from model.hf_moe import check_extra_tensors

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors dtype codes megazero reads as weights
_FIX = (
    "fix: the file is missing, damaged or truncated; write the folder again (python -m scripts.convert_checkpoint "
    "--to-hf, or save_pretrained with safetensors) or copy it again"
)


def reader_errors() -> tuple[type[BaseException], ...]:
    """The exception types the readers of a folder raise for a file they cannot read (see the
    module docstring); ``safetensors.SafetensorError`` once safetensors is imported."""
    st = sys.modules.get("safetensors")
    return (OSError, ValueError, RecursionError) + ((st.SafetensorError,) if st is not None else ())


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """Turn a reader error (``reader_errors``) raised inside the block into HFConversionError
    naming ``path``, the reader's reason and the fix (one line); HFConversionError passes."""
    try:
        yield
    except HFConversionError:
        raise
    except reader_errors() as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
        raise HFConversionError(f"{path}: cannot be read ({type(e).__name__}: {reason[:200]}); {_FIX}") from None


def read_config(path: str) -> dict:
    """The JSON object of folder ``path``'s ``config.json``. Raises HFConversionError naming
    the file when it cannot be read or is not a JSON object."""
    file = os.path.join(path, "config.json")
    with reading(file), open(file, encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise HFConversionError(f"{file}: holds a JSON {type(config).__name__}, not an object; {_FIX}")
    return config


def folder_config(path: str, **settings) -> GPTConfig:
    """The GPTConfig of folder ``path``'s GPT-2 or Llama ``config.json`` (``model.hf.config_from_hf``;
    ``settings``: other GPTConfig fields). Raises HFConversionError naming the file."""
    config = read_config(path)
    try:
        return config_from_hf(config, **settings)
    except HFConversionError as e:
        raise HFConversionError(f"{os.path.join(path, 'config.json')}: {e}") from None


def _open(path: str, gcfg: GPTConfig):
    """A ``safe_open`` handle of folder ``path``'s model.safetensors after checking that it holds
    every tensor of ``gcfg``'s model (``model.hf.hf_shapes``) in that shape and a floating-point
    dtype, reading no tensor data but Qwen2-MoE's ``[1, H]`` shared-expert gates (which must be
    zero: ``model.hf_moe.check_extra_tensors``). Raises HFConversionError naming the file and the tensor,
    MissingExtra without safetensors."""
    safe_open = require("safetensors", "--from-hf").safe_open
    file = os.path.join(path, "model.safetensors")
    with reading(file):
        handle = safe_open(file, "pt")
        stored = {k: (tuple(handle.get_slice(k).get_shape()), handle.get_slice(k).get_dtype()) for k in handle.keys()}
    for name, shape in hf_shapes(gcfg).items():
        if name not in stored:
            raise HFConversionError(f"{file} has no tensor {name!r}, which config.json's model has; {_FIX}")
        have, dtype = stored[name]
        if have != shape:
            raise HFConversionError(
                f"{file}: tensor {name!r} has shape {have}, config.json's model needs "
                f"{shape}; fix: a folder whose config.json describes its tensors (write it "
                "again with python -m scripts.convert_checkpoint --to-hf)"
            )
        if dtype not in FLOAT_DTYPES:
            raise HFConversionError(
                f"{file}: tensor {name!r} has dtype {dtype}; megazero reads weights stored "
                f"as {', '.join(FLOAT_DTYPES)}; fix: save the model unquantized"
            )
    try:
        with reading(file):
            check_extra_tensors(handle, gcfg)  # Qwen2-MoE's shared-expert gates: [1, H] each, read
    except HFConversionError as e:
        raise HFConversionError(f"{file}: {e}") from None
    return handle


def open_folder(path: str, gcfg: GPTConfig, padded_vocab: int) -> CanonicalView:
    """The canonical full tensors of folder ``path``'s ``model.safetensors``, read lazily
    (``model.hf.CanonicalView``), vocabulary tensors padded to ``padded_vocab`` rows; every
    tensor's name, shape and dtype is checked first against ``gcfg`` (reading no data).
    Raises HFConversionError naming the file, MissingExtra without safetensors."""
    return CanonicalView(_open(path, gcfg), gcfg, padded_vocab)


def check_folder(path: str, gcfg: GPTConfig) -> None:
    """Raise HFConversionError (naming the file) unless folder ``path`` holds ``gcfg``'s model:
    its ``config.json`` matches (``model.hf.check_matches``: the flag to change) and its
    ``model.safetensors`` holds every tensor in the shape and dtype that model needs; both
    files readable. MissingExtra without safetensors. Reads headers only."""
    config = read_config(path)
    try:
        check_matches(config, gcfg)
    except HFConversionError as e:
        raise HFConversionError(f"{os.path.join(path, 'config.json')}: {e}") from None
    _open(path, gcfg)
