"""The type of a parameter spec: every parameter of a model declared once, as plain data.

``model/`` writes the spec of its blocks (``model.spec.build_spec``); megazero reads it
without importing ``model`` (docs/design.md, "Dependency direction"): the memory planner counts
each rank's parameters from it (``memory.params_per_rank``), the FLOP count takes its
matmul weights (``flops.spec_flops_per_iteration``), and the model's initialisation,
partition tags and checkpoint names come from the same entries. A new block is then a
change in ``model/`` alone (torchtitan's model args play this role; docs/design.md,
"Conventions" 7).

Vocabulary of a spec entry:

- ``part``: where the tensor lives in a pipeline, ``"embedding"`` (the first stage),
  ``"layer"`` (transformer layer ``layer``) or ``"head"`` (the last stage: final norm,
  untied output weight).
- ``partition_dim`` / ``partition_stride``: the tensor-parallel partition
  (``megazero.tags.partition_tensor``); ``None`` means replicated over TP, counted
  once in a global norm (on TP rank 0), while a partition counts on every TP rank.
- ``tied_output``: the tensor is also the output layer's weight; a last stage without the
  embedding keeps its own copy (tagged ``shared_embedding``, counted on the first stage).
- ``head_copy``: a last stage without the embedding keeps a copy of the tensor, as of a
  ``tied_output`` one, without it being the output layer (the word embedding that multi-token
  prediction reads, model/mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

INIT_RULES = ("normal", "scaled_normal", "zeros", "ones")
PARTS = ("embedding", "layer", "head")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the full (unpartitioned) model.

    ``shape`` is the full shape (vocabulary rows padded); ``init`` one of ``INIT_RULES``
    (``normal``: N(0, std); ``scaled_normal``: N(0, std / sqrt(2 * num_layers)), GPT-2's
    residual projections; ``zeros``; ``ones``); ``weight_decay`` whether AdamW decays it;
    ``matmul``: a weight multiplied with every token's activations (counted by the FLOP
    formula); ``vocab``: its rows are the padded vocabulary (rows past the real vocabulary
    are zero).
    """

    name: str
    shape: tuple[int, ...]
    part: str
    layer: Optional[int] = None
    partition_dim: Optional[int] = None
    partition_stride: int = 1
    init: str = "normal"
    weight_decay: bool = True
    matmul: bool = False
    vocab: bool = False
    tied_output: bool = False
    head_copy: bool = False
    active: float = 1.0
    """Fraction of the tokens whose activations meet this weight: 1, or k / E for an expert of
    a top-k Mixture of Experts (the FLOP count takes active parameters only)."""

    def __post_init__(self):
        if self.init not in INIT_RULES or self.part not in PARTS:
            raise ValueError(f"{self.name}: init {self.init!r} / part {self.part!r} unknown")
        if (self.part == "layer") != (self.layer is not None):
            raise ValueError(f"{self.name}: a layer index goes with part 'layer' only")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def copied_to_head(self) -> bool:
        """A last stage without the embedding holds its own copy (``tied_output`` or ``head_copy``)."""
        return self.tied_output or self.head_copy

    @property
    def counted_once_in_norm(self) -> bool:
        """Replicated over TP: one copy counts in a global norm (TP rank 0)."""
        return self.partition_dim is None

    def local_numel(self, tp: int) -> int:
        """Elements one of ``tp`` tensor-parallel ranks holds."""
        return self.numel if self.partition_dim is None else self.numel // tp


def chunk_entries(
    spec: Iterable[ParamSpec], layer_ids: Sequence[int], pre_process: bool, post_process: bool
) -> list[ParamSpec]:
    """The entries of the parameters a model chunk holds: its layers, the embedding when
    ``pre_process``, the head when ``post_process`` (plus a copy of a ``tied_output`` tensor
    when the chunk holds the head but not the embedding, and of a ``head_copy`` one)."""
    ids = set(layer_ids)
    return [
        e
        for e in spec
        if (e.part == "layer" and e.layer in ids)
        or (e.part == "embedding" and pre_process)
        or (e.part == "head" and post_process)
        or (e.copied_to_head and post_process and not pre_process)
    ]


def params_on_chunk(
    spec: Iterable[ParamSpec], layer_ids: Sequence[int], pre_process: bool, post_process: bool, tp: int
) -> int:
    """Parameters (elements) one TP rank of a model chunk holds (``chunk_entries``)."""
    return sum(e.local_numel(tp) for e in chunk_entries(spec, layer_ids, pre_process, post_process))


def gather_units(
    spec: Iterable[ParamSpec],
    layer_ids: Sequence[int],
    pre_process: bool,
    post_process: bool,
    tp: int,
    persistence_threshold: int = 0,
) -> dict[str, int]:
    """ZeRO-3 gather units of one model chunk: unit name -> elements one TP rank gathers
    (unpadded), as ``model.build.zero3_units`` and ``data_parallel.zero3_gather.split_units``
    form them: ``"embedding"`` (without a tied word embedding), ``"layers.{i}"``, ``"final_ln"``,
    ``"mtp.{k}"`` (each multi-token prediction module),
    ``"output"`` (untied), then ``"chunk"``: the chunk's remaining parameters (the tied word
    embedding, gathered around the whole chunk). A parameter with fewer than
    ``persistence_threshold`` elements on the rank stays whole and joins no unit; a unit left
    empty is dropped."""
    ids, units, rest = set(layer_ids), {}, 0
    for e in spec:
        n = e.local_numel(tp)
        if n < persistence_threshold:
            continue
        if e.copied_to_head and (pre_process or post_process):
            rest += n
            continue
        key = (
            f"layers.{e.layer}"
            if e.part == "layer" and e.layer in ids
            else "embedding"
            if e.part == "embedding" and pre_process
            else ".".join(e.name.split(".")[: 2 if e.name.startswith("mtp.") else 1])
            if e.part == "head" and post_process
            else None
        )
        if key is not None:
            units[key] = units.get(key, 0) + n
    return {**units, "chunk": rest} if rest else units


def matmul_params(spec: Iterable[ParamSpec]) -> tuple[int, int, int]:
    """(matmul weight elements of all layers, number of layers, output-layer elements).
    Experts count their ``active`` fraction (k / E each: the k experts a token meets).

    The output layer is the untied ``matmul`` head weight or the ``tied_output`` embedding.
    """
    layer, layers, head = 0, set(), 0
    for e in spec:
        if e.part == "layer":
            layers.add(e.layer)
            layer += e.numel * e.active if e.matmul else 0
        elif (e.part == "head" and e.matmul) or e.tied_output:
            head += e.numel
    return round(layer), len(layers), head
