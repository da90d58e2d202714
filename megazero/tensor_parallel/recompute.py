"""Activation recomputation that replays megazero's dropout streams exactly.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost") and Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 5): a
checkpointed region runs its forward without keeping its intermediate activations, stores
only its inputs, and runs the forward again, with autograd on, when the backward reaches it.

``torch.utils.checkpoint`` restores only torch's default generator; megazero's dropout draws
from the two streams of an ``RNGTracker`` (``"replicated"`` and ``"tp"``). ``recompute``
therefore captures, before the first forward, the state of both tracker streams and of the
device's default generator, sets them back for the replay and then returns them to where
they were at backward time, so that (a) the replay draws the same dropout masks as the first
forward and (b) the forwards of other micro-batches that ran in between (1F1B, interleaved)
see their streams undisturbed. This is what Megatron-LM's ``CheckpointFunction``
(``megatron/core/tensor_parallel/random.py``) does with its CUDA RNG tracker; the code here
is megazero's.

With sequence parallelism the inputs of a transformer layer are the ``[B, T/tp, H]`` chunks
of this rank, so the stored input of a layer region is the sequence-sharded one.
"""

from __future__ import annotations

from typing import Callable

import torch

from megazero.pipeline.weight_grad import split_in_b_pass
from megazero.tensor_parallel.random import RNGTracker, default_generator


def _capture(tracker: RNGTracker) -> tuple:
    """The state of the tracker's streams and of its device's default generator."""
    return tracker.get_state(), default_generator(tracker.device).get_state()


def _restore(tracker: RNGTracker, state: tuple) -> None:
    tracker.set_state(state[0])
    default_generator(tracker.device).set_state(state[1])


class _Recompute(torch.autograd.Function):
    """forward: run ``fn`` without autograd, keep the inputs and the RNG states;
    backward: replay ``fn`` with those states under autograd and back-propagate through it."""

    @staticmethod
    def forward(ctx, fn, tracker, *inputs):
        ctx.fn, ctx.tracker = fn, tracker
        ctx.rng = _capture(tracker)
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        now = _capture(ctx.tracker)
        _restore(ctx.tracker, ctx.rng)
        try:
            with torch.enable_grad():
                outputs = ctx.fn(*inputs)
        finally:
            _restore(ctx.tracker, now)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        wanted = [x for x in inputs if x.requires_grad]
        # inside a zero-bubble B pass: input gradients only, the weights' wait for W
        split = split_in_b_pass([o for o, _ in pairs], [g for _, g in pairs], wanted)
        if split is not None:
            by_id = {id(x): g for x, g in zip(wanted, split)}
            return (None, None) + tuple(by_id.get(id(x)) for x in inputs)
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(x.grad if x.requires_grad else None for x in inputs)


def recompute(fn: Callable, tracker: RNGTracker, *inputs: torch.Tensor):
    """``fn(*inputs)``, keeping only ``inputs`` for the backward and replaying ``fn`` there.

    ``inputs`` are tensors (e.g. a layer's input ``[B, T(/tp), H]``, or attention's q, k, v
    ``[B, n_head/tp, T, head_dim]``); ``fn`` returns a tensor or a tuple of tensors and may
    use dropout from ``tracker`` (its streams or, inside ``tracker.fork``, the default
    generator): the replay draws the same masks. Outside autograd (``torch.no_grad``, or no
    input and no parameter needing gradients) it is a plain call. ``fn`` must use parameters
    only through modules (their gradients are accumulated by the replay's backward), and the
    region's inputs must require grad for the backward to reach it (the layers' inputs do).
    """
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in inputs):
        return fn(*inputs)
    return _Recompute.apply(fn, tracker, *inputs)
