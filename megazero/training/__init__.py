"""The trainer: megazero's application layer, from settings to a finished run.

Unlike the library packages beside it, this package may import ``model/`` and ``data/``: it
is where the parallel machinery, the GPT and the data pipeline meet (Megatron-LM's split of
``megatron/core`` and ``megatron/training``). ``train.py`` is a thin entry over ``main``.

Modules, in the order a run meets them:

- ``startup``: everything that can fail before the first collective, the launcher's
  ``preflight``, the process groups;
- ``inputs``: datasets and tokenizer, each data-parallel rank's micro-batches;
- ``optimizer``: gradient buffers (ZeRO 0-3) and the (offloaded) Adam;
- ``trainer``: the ``Trainer`` and one iteration (``train_step``);
- ``factory``: ``build_trainer``, the one recipe settings -> data -> groups -> Trainer;
- ``evaluation``: validation loss, lm-evaluation-harness tasks, greedy generation;
- ``control``: early stops, faults, restarts;
- ``loop``: the training loop with logging, evaluation and checkpoints;
- ``entry``: ``main``, one rank's whole run;
- ``inference``: loading a checkpoint or Hugging Face folder for the generation and evaluation
  tools.
"""

from megazero.training.control import RunControl, finish_stop
from megazero.training.entry import main
from megazero.training.evaluation import check_harness, evaluate, final_sample, generate_ids, harness_scores
from megazero.training.factory import build_trainer
from megazero.training.inputs import build_data, data_signature, dp_micro_batches, tokenizer_record
from megazero.training.loop import run_loop, start_run, train
from megazero.training.optimizer import build_optimizer
from megazero.training.startup import check_memory, check_resume, preflight, prepare_run, resume_warnings, setup_groups
from megazero.training.trainer import StepOutcome, Trainer

__all__ = [
    "RunControl",
    "StepOutcome",
    "Trainer",
    "build_data",
    "build_optimizer",
    "build_trainer",
    "check_harness",
    "check_memory",
    "check_resume",
    "data_signature",
    "dp_micro_batches",
    "evaluate",
    "final_sample",
    "finish_stop",
    "generate_ids",
    "harness_scores",
    "main",
    "preflight",
    "prepare_run",
    "resume_warnings",
    "run_loop",
    "setup_groups",
    "start_run",
    "tokenizer_record",
    "train",
]
