"""A checkpoint rewritten with one full tensor per key (``python -m scripts.convert_checkpoint
--consolidate``): the format megazero saved before sharded checkpoints, which ``load`` reads
under any layout like the sharded one.

The output ``OUT/iter_<N>/`` holds a DCP directory with every key ``"<name>/<state>"`` as ONE
full tensor, ``meta.pt`` with the new files' sizes and CRC-32, and the input's ``rng_<rank>.pt``
files; ``OUT/latest`` points at it (``publish``: temporary name, then rename). It runs in one
process and holds every full tensor (offline use); the input's CRC-32 is checked first.
"""

from __future__ import annotations

import os
import shutil
import warnings

import torch

from megazero.checkpoint.core import (
    CheckpointError,
    file_checksum,
    iteration_dir,
    peek,
    publish,
    read_full_tensors,
    rng_files,
)


def consolidate_checkpoint(load: str, out: str) -> str:
    """Write the latest checkpoint under ``load`` with full tensors under the new root ``out``
    (see the module docstring); returns the written iteration directory.

    Raises CheckpointError when ``out`` exists and is not an empty folder, or for a damaged
    input (a missing, truncated or corrupt file, named)."""
    import torch.distributed.checkpoint as dcp

    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise CheckpointError(
            f"--consolidate {out} exists and is not empty (or not a folder); fix: choose a new folder"
        )
    peek(load, verify=True)
    meta, src, full = read_full_tensors(load)
    tmp = iteration_dir(out, meta["iteration"]) + ".tmp"
    os.makedirs(tmp)
    with warnings.catch_warnings():  # DCP warns that it saves in one process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(full, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
    del full
    for name in rng_files(meta["layout"]):
        shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
    files = [n for n in os.listdir(tmp) if n.endswith(".distcp") or n.startswith("rng_") or n == ".metadata"]
    meta = dict(meta, files={n: file_checksum(os.path.join(tmp, n)) for n in sorted(files)})
    with open(os.path.join(tmp, "meta.pt"), "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())
    return publish(out, meta["iteration"], tmp)
