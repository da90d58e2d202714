"""What a run reads: the tokenizer, the three splits and the vocabulary size, by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class RunData:
    """The data of one run, as ``megazero.training.build_data`` / ``megazero.training.prepare_run`` return it.

    ``tokenizer`` (None with mock data), ``train`` / ``valid`` / ``test`` (datasets of
    ``(tokens, labels)`` samples of ``seq_length`` int64 tokens each; ``valid``/``test`` None
    when the split gives them no documents), ``vocab_size`` (real tokens, before padding),
    ``resume`` (the meta of the checkpoint the run resumes from, or None), ``ptx`` (``--post-train
    ppo --ptx-coef``: the pretraining dataset of its language-model term, else None).
    """

    tokenizer: Any
    train: Any
    valid: Any
    test: Any
    vocab_size: int
    resume: Optional[dict] = None
    ptx: Any = None  # --post-train ppo --ptx-coef: the pretraining sequences of the ptx term
