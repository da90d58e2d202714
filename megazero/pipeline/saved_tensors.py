"""Boxes for the tensors autograd saves, so a split backward can free part of a retained graph.

``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` replaces what a node stores for
each saved tensor by whatever ``pack`` returns; here a ``_Box`` holding the tensor, detached
(a box holding an operator's own output with its ``grad_fn`` would form a cycle with the node
that Python's collector cannot see, and leak). Emptying a box frees the tensor (unless
something else holds it) while the node and its graph stay alive: B of a zero-bubble schedule
(``weight_grad.py``) keeps the graph for W but empties every box W will not read. Reading an
emptied box raises ``SplitBackwardError``, so a missed tensor fails loudly, never computes.
"""

from __future__ import annotations

import torch

_MARKING = [False]  # SavedTensors.keep_for_weight is reading the boxes W needs
_COLLECTING: list = []  # boxes_of is reading a node's boxes into the last list


class SplitBackwardError(RuntimeError):
    """The autograd graph of a chunk cannot be split into B and W (module docstring)."""


class _Box:
    """One saved tensor (detached: a box holding an operator's own output must not hold its
    ``grad_fn``, or node and box keep each other alive) and whether W reads it."""

    __slots__ = ("tensor", "keep")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.keep = tensor, False


def _unpack(box: _Box) -> torch.Tensor:
    if box.tensor is None:
        raise SplitBackwardError(
            "a weight-gradient pass (W) read a saved tensor that its B released: an operator "
            "between a boundary and its parameters was not marked by SavedTensors.keep_for_weight"
        )
    if _MARKING[0]:
        box.keep = True
    if _COLLECTING:
        _COLLECTING[-1].append(box)
    return box.tensor


class SavedTensors:
    """The tensors autograd saves for one (micro-batch, chunk), each in a ``_Box``, so that
    after B the ones W does not read can be freed while the graph stays alive for W (module
    docstring). Use ``with saved.hooks():`` around the forward and the B pass."""

    def __init__(self):
        self.boxes: list[_Box] = []

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> _Box:
        box = _Box(tensor.detach())
        self.boxes.append(box)
        return box

    def keep_for_weight(self, nodes: list) -> None:
        """Keep the saved tensors of ``nodes`` (read once, marking their boxes) and empty every
        other box: their memory is freed unless something else holds the tensor."""
        _MARKING[0] = True
        try:
            for node in nodes:
                _read_saved(node)
        finally:
            _MARKING[0] = False
        for box in self.boxes:
            if not box.keep:
                box.tensor = None
        self.boxes = [b for b in self.boxes if b.keep]

    def release(self) -> None:
        """Empty every box (after W)."""
        for box in self.boxes:
            box.tensor = None
        self.boxes = []

    def held_bytes(self) -> int:
        """Bytes of the distinct storages the boxes still hold (a parameter's included)."""
        seen = {}
        for b in self.boxes:
            if b.tensor is not None:
                s = b.tensor.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())


_SAVED_NAMES: dict = {}  # node type -> its ``_saved_*`` attribute names


def _read_saved(node) -> None:
    """Unpack every tensor ``node`` saved (a custom Function's ``saved_tensors``, a built-in
    node's ``_saved_*`` attributes)."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        node.saved_tensors
        return
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = [n for n in dir(node) if n.startswith("_saved_")]
    for name in names:
        getattr(node, name)


def boxes_of(node) -> list:
    """The boxes of the tensors ``node`` saved (empty when they were not boxed)."""
    _COLLECTING.append([])
    try:
        _read_saved(node)
    finally:
        got = _COLLECTING.pop()
    return [b for b in got if isinstance(b, _Box)]


def empty_after_run(boxes: list):
    """A node post-hook emptying ``boxes`` once the node ran in B (W never runs it)."""

    def hook(grad_inputs, grad_outputs):
        for b in boxes:
            b.tensor = None

    return hook
