"""Checkpoints: one layout-independent format (``core``: save, load, peek, atomic publish,
keep-N), the sharded pieces DCP reads and writes (``shards``), the run's checkpoint
manager (``manager``: when to save, the asynchronous save in flight, resume) and a
checkpoint rewritten with full tensors (``consolidate``).

The format's public functions are importable from the package, ``megazero.checkpoint.save``.
"""

from megazero.checkpoint.consolidate import consolidate_checkpoint  # noqa: F401
from megazero.checkpoint.core import (  # noqa: F401
    CheckpointError,
    PendingSave,
    file_checksum,
    iteration_dir,
    latest_iteration,
    load,
    peek,
    prune,
    publish,
    read_full_tensors,
    read_full_weights,
    read_partitions,
    rng_files,
    save,
    saved_iterations,
)
