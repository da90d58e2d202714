"""Dropout randomness under tensor parallelism (Megatron's "model-parallel RNG").

Shoeybi et al. 2019, sec. 3: dropout inside a partitioned region (attention probabilities
of this rank's heads, the MLP's ``F/tp`` hidden units) must draw *different* masks on
different TP ranks, otherwise the partitions are correlated; dropout in a replicated region
(after the row-parallel reduction, on the residual stream) must draw the *same* mask on
every TP rank, since all ranks compute the same activation.

``RNGTracker`` keeps two generators:

- ``"replicated"``: seeded with ``seed`` on every TP rank;
- ``"tp"``: seeded with ``seed + 2718 + tp_rank``.

The caller chooses ``seed`` and folds in what must differ between pipeline stages or data
parallel ranks (the trainer passes e.g. ``seed + 100 * pp_rank``); the tracker adds only the
TP offset. Under sequence parallelism the replicated-region activations are ``[B, T/tp, H]``
chunks of different tokens, so those masks should come from the ``"tp"`` generator
(Korthikanti et al. 2022, sec. 4.2.2); that choice is the model's.

A layout change on resume (different tp) cannot reproduce the old masks of ``"tp"``
regions; ``get_state``/``set_state`` restore the same layout exactly. Under another layout
every rank instead calls ``reseed(resume_seed(seed, iteration))`` with the seed it was built
with: one rule for all ranks, so TP-replicated streams stay equal, and the streams after the
resume differ from those of the run's first iterations. A resume on another device type
(saved on CPU, resumed on CUDA or back) re-seeds by the same rule: a CPU generator's state
(MT19937, 5056 bytes) cannot be given to a CUDA one (Philox, 16 bytes), nor the reverse, so
``get_state`` records the device type and ``saved_device`` reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch

TP_SEED_OFFSET = 2718
NAMES = ("replicated", "tp")


def resume_seed(seed: int, iteration: int) -> int:
    """The seed a tracker built with ``seed`` restarts from when a resume at ``iteration``
    cannot restore its saved streams (another layout): 62 bits of
    sha256("{seed}:resume:{iteration}") (room left for the TP offset), the same rule on every rank."""
    digest = hashlib.sha256(f"{seed}:resume:{iteration}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**62 - 1)


def default_generator(device: torch.device) -> torch.Generator:
    """The global generator that ``torch.nn.functional.dropout`` uses on ``device``."""
    if device.type == "cpu":
        return torch.default_generator
    backend = getattr(torch, device.type)
    index = device.index if device.index is not None else backend.current_device()
    return backend.default_generators[index]


class RNGTracker:
    """Two dropout generators, one replicated across TP ranks and one per TP rank.

    Args:
        seed: base seed (the caller folds in pipeline stage / data-parallel offsets).
        tp_rank: this rank's tensor-parallel rank.
        device: where the masks are drawn (a generator draws on its own device type).
    """

    def __init__(self, seed: int, tp_rank: int, device="cpu"):
        self.device = torch.device(device)
        self.seed, self.tp_rank = seed, tp_rank
        self._gens = {name: torch.Generator(device=self.device) for name in NAMES}
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart both streams from ``seed`` (replicated) and ``seed + 2718 + tp_rank``."""
        self.seed = seed
        self._gens["replicated"].manual_seed(seed)
        self._gens["tp"].manual_seed(seed + TP_SEED_OFFSET + self.tp_rank)

    def generator(self, name: str) -> torch.Generator:
        """The generator of region ``name`` (``"replicated"`` or ``"tp"``).

        Raises KeyError naming the valid regions otherwise.
        """
        if name not in self._gens:
            raise KeyError(f"unknown RNG region {name!r}; expected one of {NAMES}")
        return self._gens[name]

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[torch.Generator]:
        """Make region ``name``'s stream the global one on ``device`` inside the block.

        For code that only draws from the global generator (``F.dropout``,
        ``scaled_dot_product_attention(dropout_p=...)``). On exit the region's advanced
        state is kept and the global generator is restored.
        """
        gen = self.generator(name)
        glob = default_generator(self.device)
        saved = glob.get_state()
        glob.set_state(gen.get_state())
        try:
            yield gen
        finally:
            gen.set_state(glob.get_state())
            glob.set_state(saved)

    def get_state(self) -> dict:
        """``{"seed", "tp_rank", "device", "replicated": ByteTensor, "tp": ByteTensor}`` for
        checkpoints; ``device`` is the device type whose generators drew the streams."""
        state = {name: g.get_state() for name, g in self._gens.items()}
        state.update(seed=self.seed, tp_rank=self.tp_rank, device=self.device.type)
        return state

    def saved_device(self, state: dict) -> str:
        """The device type whose generators ``state`` holds: the one ``get_state`` recorded,
        or, for a state saved before it was recorded, this tracker's type when every
        stream's state has the size of this tracker's (CPU's MT19937: 5056 bytes; CUDA's
        Philox: 16 bytes), else ``"another device type"``. A state restores only where this
        is ``self.device.type`` (``set_state``)."""
        if "device" in state:
            return state["device"]
        own = {name: g.get_state().numel() for name, g in self._gens.items()}
        fits = all(state[name].numel() == n for name, n in own.items())
        return self.device.type if fits else "another device type"

    def set_state(self, state: dict) -> None:
        """Restore what ``get_state`` returned.

        Raises ValueError on a different tp_rank, or on a state drawn on another device
        type (``saved_device``: a CPU generator's state does not fit a CUDA one's, nor the
        reverse; the caller re-seeds instead, module docstring)."""
        if state["tp_rank"] != self.tp_rank:
            raise ValueError(f"RNG state was saved by tp_rank {state['tp_rank']}, this is tp_rank {self.tp_rank}")
        saved = self.saved_device(state)
        if saved != self.device.type:
            raise ValueError(
                f"RNG state was drawn on {saved}, this tracker draws on {self.device.type}; "
                f"re-seed with reseed(resume_seed(seed, iteration)) instead"
            )
        self.seed = state["seed"]
        for name, g in self._gens.items():
            g.set_state(state[name])


def dropout(x: torch.Tensor, p: float, generator: torch.Generator, training: bool = True) -> torch.Tensor:
    """Inverted dropout with an explicit generator: ``x * mask / (1 - p)``.

    ``mask ~ Bernoulli(1 - p)`` has the shape of ``x`` and is drawn from ``generator``
    (which must live on ``x``'s device type). Identity when not training or ``p == 0``;
    zeros when ``p == 1``. Raises ValueError when ``p`` is outside ``[0, 1]``.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    mask = torch.empty_like(x).bernoulli_(1.0 - p, generator=generator)
    return x * mask * (1.0 / (1.0 - p))
