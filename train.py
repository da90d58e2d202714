"""megazero's entry: parse the flags, build the run, train it.

``bash scripts/pretrain_gpt.sh`` launches this file through torchrun, one process per rank (it
reads WORLD_SIZE / RANK / LOCAL_RANK); ``python train.py ...`` runs one process. The run itself,
from the settings to the final summary, is ``megazero.training.main`` (docs/design.md):

1. settings: ``config_from_argv`` (flags or a DeepSpeed JSON) -> one ``Config``;
2. start-up checks on every rank before any collective: device, data, checkpoint, memory plan;
3. process groups of the layout (NCCL on GPUs, gloo on CPU);
4. ``build_trainer``: data -> model chunks -> ZeRO buffers and optimizer -> ``Trainer``;
5. the loop: train steps, logging, evaluation, checkpoints, early stops; the summary.

Nothing imports this file; tests, scripts and benchmarks use ``megazero.training``.
"""

import sys

from megazero.training import main

if __name__ == "__main__":
    sys.exit(main())
