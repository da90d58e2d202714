"""Reading and writing a Hugging Face model folder (``config.json`` + ``model.safetensors``, or
the sharded form ``model.safetensors.index.json`` + ``model-0000i-of-0000N.safetensors``) on
disk: the one boundary where the third-party readers' own errors become HFConversionError
naming the file, and where every tensor's name, shape and dtype are checked against the model
before any tensor is loaded (``model/hf.py`` is the name map; it reads no file).

Sharded folders follow the layout ``transformers``' ``save_pretrained`` writes above its
``max_shard_size`` (documented in its ``PreTrainedModel.save_pretrained`` and in huggingface_hub's
``split_torch_state_dict_into_shards``): the index is a JSON object whose ``weight_map`` names,
for every tensor, the shard file in the same folder that holds it; ``metadata.total_size`` is
the tensors' bytes. A folder with ``model.safetensors`` is read from it, as transformers does;
else from the index. Each tensor is read from the shard the index names, when asked for
(``TensorFiles``): a stage reads the shards of its own parameters only. ``write_tensors`` writes
either form (``shard_plan``: tensors in order, a new shard when the next would pass the limit,
a tensor above the limit alone).

What the readers raise for a file they cannot read (found by reading their Python APIs --
``safetensors/__init__.pyi``: ``SafetensorError`` derives from ``Exception`` only -- and by
feeding each a missing file, a directory, an empty, a truncated, a padded and a garbage
file, a header with bad JSON, bad UTF-8, an unknown dtype or offsets that contradict the
shapes; tests/launcher/test_hostile_inputs.py keeps the cases):

- ``open`` + ``json.load`` (config.json): OSError (missing, a directory, no permission),
  UnicodeDecodeError and json.JSONDecodeError (both ValueError), RecursionError (JSON nested
  too deep). Valid JSON that is not an object is refused here; a key that is missing or of
  the wrong kind by ``model.hf`` (HFConversionError naming the key).
- ``safetensors.safe_open`` (model.safetensors or a shard): OSError (missing; a directory gives "No such
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
import re
import sys
from typing import Iterator, Mapping, Optional

import torch

from megazero.runtime.extras import require
from model import hf_gpt_oss
from model.config import GPTConfig
from model.hf import CanonicalView, HFConversionError, check_matches, config_from_hf, hf_shapes
from model.hf_moe import check_extra_tensors

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors dtype codes megazero reads as weights
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default shard limit, that of transformers 4's save_pretrained
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # decimal, as huggingface_hub's parse_size_to_int
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


def folder_model_type(path: str) -> Optional[str]:
    """``GPTConfig.hf_model_type`` of a run started from folder ``path`` (``--from-hf``): ``"mistral"``
    when its ``config.json`` says so (Llama's computation, exported back as Mistral), ``"gpt_oss"``
    for a gpt-oss folder, else None; None too for a ``config.json`` that cannot be read
    (``check_folder`` names that error)."""
    try:
        kind = read_config(path).get("model_type")
        return kind if kind in ("mistral", hf_gpt_oss.MODEL_TYPE) else None
    except HFConversionError:
        return None


def folder_config(path: str, **settings) -> GPTConfig:
    """The GPTConfig of folder ``path``'s GPT-2 or Llama ``config.json`` (``model.hf.config_from_hf``;
    ``settings``: other GPTConfig fields). Raises HFConversionError naming the file."""
    config = read_config(path)
    try:
        return config_from_hf(config, **settings)
    except HFConversionError as e:
        raise HFConversionError(f"{os.path.join(path, 'config.json')}: {e}") from None


class TensorFiles:
    """The tensors of a folder's safetensors file(s) behind one ``safe_open``-like handle
    (``keys``, ``get_slice``, ``get_tensor``): ``weight_map`` gives each tensor's file name in
    folder ``path`` (every tensor in ``model.safetensors``, or the shard the index names);
    ``handles`` the open ``safe_open`` handle of each file. ``get_tensor`` reads one tensor's
    data from its file; a read error becomes HFConversionError naming that file."""

    def __init__(self, path: str, weight_map: Mapping[str, str], handles: Mapping):
        self.path, self.weight_map, self.handles = path, dict(weight_map), dict(handles)

    def file(self, name: str) -> str:
        """The path of the file holding tensor ``name`` (KeyError for an unknown name)."""
        return os.path.join(self.path, self.weight_map[name])

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def get_slice(self, name: str):
        return self.handles[self.weight_map[name]].get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        with reading(self.file(name)):
            return self.handles[self.weight_map[name]].get_tensor(name)


def read_index(path: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of folder ``path``'s
    ``model.safetensors.index.json``. Raises HFConversionError naming the index when it cannot
    be read, is not a JSON object with a ``weight_map`` object of file names, or names a file
    outside the folder."""
    file = os.path.join(path, INDEX)
    with reading(file), open(file, encoding="utf-8") as f:
        index = json.load(f)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFConversionError(f"{file}: has no 'weight_map' object of tensor name -> shard file; {_FIX}")
    for shard in weight_map.values():
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise HFConversionError(f"{file}: shard {shard!r} is not a file name in the folder; {_FIX}")
    return weight_map


def tensor_files(path: str) -> tuple[TensorFiles, str]:
    """(the tensors of folder ``path``, the file that lists them: ``model.safetensors`` or the
    index). ``model.safetensors`` is read when present (as transformers does), else
    ``model.safetensors.index.json`` and every shard it names (headers only). Raises
    HFConversionError naming the file that is missing or cannot be read, MissingExtra without
    safetensors."""
    safe_open = require("safetensors", "--from-hf").safe_open
    single, index = os.path.join(path, SINGLE), os.path.join(path, INDEX)
    if os.path.exists(single) or not os.path.isfile(index):
        with reading(single):
            handle = safe_open(single, "pt")
        return TensorFiles(path, {k: SINGLE for k in handle.keys()}, {SINGLE: handle}), single
    weight_map, handles = read_index(path), {}
    for shard in sorted(set(weight_map.values())):
        file = os.path.join(path, shard)
        if not os.path.exists(file):
            raise HFConversionError(
                f"{file}: not found, though {INDEX} names it as a shard; fix: copy every shard the "
                "index names into the folder (or write the folder again)"
            )
        with reading(file):
            handles[shard] = safe_open(file, "pt")
    return TensorFiles(path, weight_map, handles), index


def _open(path: str, gcfg: GPTConfig) -> TensorFiles:
    """The tensors of folder ``path`` (``tensor_files``) after checking that they hold every
    tensor of ``gcfg``'s model (``model.hf.hf_shapes``) in that shape and a floating-point dtype,
    each in the file the index names, reading no tensor data but Qwen2-MoE's ``[1, H]``
    shared-expert gates (which must be zero: ``model.hf_moe.check_extra_tensors``). Raises
    HFConversionError naming the file and the tensor, MissingExtra without safetensors."""
    files, listing = tensor_files(path)
    held = {}
    for shard, handle in files.handles.items():
        with reading(os.path.join(path, shard)):
            held[shard] = set(handle.keys())
    for name, shape in hf_shapes(gcfg).items():
        packed = hf_gpt_oss.packed_names(name) if hf_gpt_oss.is_gpt_oss(gcfg) else None
        if name not in files.weight_map and packed is not None and all(p in files.weight_map for p in packed):
            _check_packed(files, packed, hf_gpt_oss.packed_shapes(name, shape))
            continue
        if name not in files.weight_map:
            raise HFConversionError(f"{listing} has no tensor {name!r}, which config.json's model has; {_FIX}")
        file = files.file(name)
        if name not in held[files.weight_map[name]]:
            raise HFConversionError(f"{file} has no tensor {name!r}, which {INDEX} puts there; {_FIX}")
        with reading(file):
            have, dtype = tuple(files.get_slice(name).get_shape()), files.get_slice(name).get_dtype()
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
        check_extra_tensors(files, gcfg)  # Qwen2-MoE's shared-expert gates: [1, H] each, read
    except HFConversionError as e:
        raise HFConversionError(f"{listing}: {e}") from None
    return files


def _check_packed(files: TensorFiles, names: tuple[str, str], shapes: tuple) -> None:
    """gpt-oss's MXFP4 ``*_blocks`` / ``*_scales`` pair: each in ``shapes`` and stored as uint8
    (``model.hf_gpt_oss.packed_shapes``). Raises HFConversionError naming the file and tensor."""
    for name, shape in zip(names, shapes):
        file = files.file(name)
        with reading(file):
            have, dtype = tuple(files.get_slice(name).get_shape()), files.get_slice(name).get_dtype()
        if have != shape or dtype != "U8":
            raise HFConversionError(
                f"{file}: MXFP4 tensor {name!r} is {dtype} {have}, config.json's model needs U8 {shape}; "
                "fix: a folder whose config.json describes its tensors"
            )


def open_folder(path: str, gcfg: GPTConfig, padded_vocab: int) -> CanonicalView:
    """The canonical full tensors of folder ``path``'s ``model.safetensors`` or shards, read lazily
    (``model.hf.CanonicalView``: each tensor from its own file when asked for), vocabulary
    tensors padded to ``padded_vocab`` rows; every tensor's name, shape and dtype is checked
    first against ``gcfg`` (reading no data).
    Raises HFConversionError naming the file, MissingExtra without safetensors."""
    return CanonicalView(_open(path, gcfg), gcfg, padded_vocab)


def check_folder(path: str, gcfg: GPTConfig) -> None:
    """Raise HFConversionError (naming the file) unless folder ``path`` holds ``gcfg``'s model:
    its ``config.json`` matches (``model.hf.check_matches``: the flag to change) and its
    ``model.safetensors`` (or the shards its index names) holds every tensor in the shape and
    dtype that model needs; every file readable. MissingExtra without safetensors. Reads headers only."""
    config = read_config(path)
    try:
        check_matches(config, gcfg)
    except HFConversionError as e:
        raise HFConversionError(f"{os.path.join(path, 'config.json')}: {e}") from None
    _open(path, gcfg)


def parse_shard_size(text) -> int:
    """Bytes of a shard-size limit: an integer number of bytes (``2000000``) or a number with a
    decimal unit KB, MB, GB or TB (``500MB``, ``1.5GB``; 1 GB = 10**9 bytes), the sizes
    ``save_pretrained(max_shard_size=...)`` accepts. Raises ValueError (message: the accepted
    forms) for anything else or a size below one byte."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)?\s*", str(text), re.IGNORECASE)
    size = None
    if m and m.group(2):
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    elif m and m.group(1).isdigit():
        size = int(m.group(1))
    if size is None or size < 1:
        raise ValueError(f"{text!r} is not a size: give bytes (2000000) or a number with KB, MB, GB or TB (500MB, 5GB)")
    return size


def shard_plan(tensors: Mapping[str, torch.Tensor], max_shard_size: int) -> list[list[str]]:
    """Tensor names per shard, in ``tensors``' order: a tensor joins the current shard unless
    that would take it past ``max_shard_size`` bytes (then a new shard starts); a tensor larger
    than the limit gets a shard of its own (huggingface_hub's ``split_torch_state_dict_into_shards``
    rule, so an export shards as ``save_pretrained`` would)."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if nbytes > max_shard_size:
            shards.append([name])
            continue
        if current and size + nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return shards + ([current] if current else [])


def write_tensors(tensors: Mapping[str, torch.Tensor], folder: str, max_shard_size: int) -> list[str]:
    """Write ``tensors`` into ``folder`` as ``model.safetensors``, or, when they take more than
    one shard of ``max_shard_size`` bytes (``shard_plan``), as ``model-0000i-of-0000N.safetensors``
    shards plus ``model.safetensors.index.json`` (``metadata.total_size``: the tensors' bytes;
    ``weight_map``: name -> shard). Each file is written under a temporary name and renamed,
    the index last, so a failure leaves no file that looks complete (the caller writes into a
    temporary folder of its own). Returns the file names written. Raises OSError from the
    writes, MissingExtra without safetensors."""
    save_file = require("safetensors.torch", "--to-hf").save_file
    plan = shard_plan(tensors, max_shard_size)
    names = (
        [SINGLE]
        if len(plan) <= 1
        else [f"model-{i:05d}-of-{len(plan):05d}.safetensors" for i in range(1, len(plan) + 1)]
    )
    for file, keys in zip(names, plan or [[]]):
        tmp = os.path.join(folder, file + ".tmp")
        save_file({k: tensors[k] for k in keys}, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(folder, file))
    if len(plan) <= 1:
        return names
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {k: file for file, keys in zip(names, plan) for k in keys},
    }
    tmp = os.path.join(folder, INDEX + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
    os.replace(tmp, os.path.join(folder, INDEX))
    return names + [INDEX]
