"""The backward of one (micro-batch, chunk) split into B (input gradient) and W (weight gradient).

Qi et al. 2024 ("Zero Bubble Pipeline Parallelism", ICLR, sec. 2): the previous stage waits
only for the gradient of this stage's input, so the backward is cut in two. B computes the
gradients along the activation path down to the chunk's input (what gets sent); W computes
the parameters' gradients from what B left behind: the saved forward inputs of each operator
and the gradient of its output. Nothing of the forward is recomputed.

How the cut is made here, without a layer of its own per operator: after the forward, the
autograd graph is walked once from the chunk's output. A node is on the *activation path*
when the chunk's input is reachable from it, or when two or more parameters are (the
embedding's sum of word and position lookups on the first stage, which has no input tensor),
or when it is a *source*: exactly one parameter reachable, and its output consumed by two or
more edges of the graph. A first stage with rotary positions has no position table, so its
word-embedding lookup is where the activations begin, read by the first norm and by the
residual add: the source stands for the missing input. B sums the gradients flowing into it,
as a plain backward does, and W runs it once. (Were it a weight-only child of both, W asking
the residual add for the embedding's gradient would also reach it through the add's other
child, the whole first layer, re-running backward steps that B ran and released and adding the
norm's share twice.) A node from which exactly one parameter and not the input is reachable,
and that is no source, is *weight-only*. A *boundary* is an activation-path node with a
weight-only child: ``addmm`` of a linear layer (child ``t`` -> weight), a norm (children ->
weight, bias), the embedding's reduction.

- B: ``torch.autograd.grad(output, inputs=[input] + [edges into every boundary])`` with the
  graph retained. The engine runs only nodes that lead to a requested edge and, inside each
  operator, only the outputs that lead there (``addmm`` computes ``dX = dY W`` but not
  ``dW``), and returns the gradient flowing into each boundary (its output gradient).
- W: per boundary, in the order B reached them, ``torch.autograd.grad`` from that boundary's
  edges with the captured gradients, asking only for the parameters behind its weight-only
  children: the engine re-enters the boundary operator computing only ``dW = X^T dY``
  (``db``, the norm's ``dgamma``/``dbeta``) from its saved tensors. Each parameter's gradient
  is then accumulated with ``torch.autograd.backward(param, dW)``: the parameter's own
  ``AccumulateGrad`` node, so the gradient hooks of ``data_parallel.ddp`` (buckets, ZeRO)
  fire in W exactly as they fire in a plain backward.

Exactness: each gradient is the same operator formula on the same tensors as in the fused
backward, and each parameter receives one accumulation per micro-batch, so when W runs in
micro-batch order per chunk (every zero-bubble schedule here does) the summed gradients are
bit-identical to 1F1B's. Not split: a parameter reached through two boundaries in one chunk
(a weight used twice in one forward, e.g. tied input and output embeddings in one chunk) raises
SplitBackwardError. No schedule meets it: a zero-bubble schedule needs pp >= 2, which puts the
embedding and the output layer in different chunks (ZB-V's V keeps a copy in each).

Vector boundaries (every parameter behind them 1-D: a norm's scale and shift, a bias added
after a row-parallel reduction) have their weight gradients computed in B, from the same
operator call as the input gradient, and kept (a few vectors) until W accumulates them: their
W would hold the operator's input and output gradient for an O(h) result. The output layer
(its weight tagged ``weight_grad_in_b`` by the model) is treated alike: its W would hold the
logits' gradient ``[B, T, V/tp]`` and its input ``[B, T, H]`` from B to W, where B's result
is ``[V/tp, H]`` (B then costs that matmul more; docs/performance.md). Their parameters
still receive their gradients in W, so gradient hooks and bucket order do not change.

Memory: B retains the graph for W, but the executor runs each chunk's forward (and its B, where
a recomputed region is replayed) under ``SavedTensors.hooks``: every tensor autograd saves goes
into a box. Before B, a post-hook on every node W will not run empties that node's boxes as
soon as B has run it (what a backward without ``retain_graph`` frees, freed as early); after
B, ``SavedTensors.keep_for_weight`` marks the boxes W reads (the saved tensors of the matrix
boundaries and of the nodes between them and their parameters: a linear's input, an
embedding's ids) by reading them once and empties the rest. From B to W a micro-batch then
holds those inputs and the captured output gradients (``planning.activations.
weight_grad_bytes``). W reading an emptied box raises SplitBackwardError. About as much as
its activations when attention keeps no score matrix (docs/performance.md): the paper's
ZB-H1 keeps 1F1B's peak on the first stage assuming W needs less than B (its Table 1).

Refused (``SplitBackwardError``): a matrix boundary that is a custom ``autograd.Function``
with both activation and weight children (its Python backward ignores which outputs are
needed, so B and W would each run it whole; e.g. the overlapped column-parallel linear). A
custom Function whose parameters are all vectors is a vector boundary like any other (apex's
fused LayerNorm / RMSNorm, which ``--kernels auto`` picks on CUDA): B runs its backward once,
for the input and the weight gradients together, and W only accumulates what B kept.

A recomputed region (full recomputation, ``tensor_parallel.recompute``) replays its forward
in B and splits its inner backward the same way (``split_in_b_pass``), so the forward is
re-run before B, not before W; of the replayed graph, W's share is held from B to W.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.autograd.graph import GradientEdge

from megazero.pipeline.saved_tensors import SavedTensors, SplitBackwardError, boxes_of, empty_after_run
from megazero.tags import is_weight_grad_in_b

_MANY = object()  # more than one parameter reachable


def _release_during_b(roots: list, weight_nodes: set) -> list:
    """Hooks that free the saved tensors of every node W does not run as soon as B has
    run it, as a backward without ``retain_graph`` would; returns their handles."""
    handles = []
    for node in _nodes_postorder(roots):
        if node in weight_nodes or hasattr(node, "variable"):
            continue
        boxes = boxes_of(node)
        if boxes:
            handles.append(node.register_hook(empty_after_run(boxes)))
    return handles


@dataclass
class _Item:
    """One boundary's share of W: ``grads`` flowing into ``node`` (captured in B) and the
    parameters behind its ``weight_children``; or, for a vector boundary, ``done``: the
    parameters' gradients B computed already."""

    node: object
    grads: tuple
    params: list
    weight_children: list
    done: Optional[list] = None


@dataclass
class WeightGradWork:
    """What B leaves for W of one (micro-batch, chunk): one ``_Item`` per boundary, in the
    order B reached them, and the boxes of its saved tensors (None: none boxed). Holds the
    graph alive."""

    items: list = field(default_factory=list)
    saved: Optional[SavedTensors] = None

    def __len__(self) -> int:
        return len(self.items)

    def weight_nodes(self) -> list:
        """The nodes W runs: the matrix boundaries and everything from their weight-only
        children down to the parameters."""
        out = [it.node for it in self.items if it.done is None]
        out += _nodes_postorder([c for it in self.items if it.done is None for c in it.weight_children])
        return out


def _nodes_postorder(roots: list) -> list:
    """Every node reachable from ``roots``, children before parents (iterative DFS)."""
    order, seen, stack = [], set(), [(r, False) for r in roots if r is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in seen)
    return order


def _classify(roots: list, input_nodes: set):
    """Per node: (leads to an input or a source, the one parameter node reachable / _MANY /
    None). A *source* is an operator from which one parameter is reachable whose output feeds
    two or more edges of the graph (module docstring); it counts as an input."""
    order = _nodes_postorder(roots)
    fed: dict = {}  # node -> edges of the graph that consume its output
    for node in order:
        for c, _ in node.next_functions:
            if c is not None:
                fed[c] = fed.get(c, 0) + 1
    info = {}
    for node in order:
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf
            is_input = node in input_nodes
            info[node] = (is_input, None if is_input else node)
            continue
        to_input, reach = False, None
        for c, _ in node.next_functions:
            if c is None:
                continue
            ci, cr = info[c]
            to_input = to_input or ci
            if cr is not None:
                reach = cr if reach is None or reach is cr else _MANY
        source = not to_input and reach is not None and reach is not _MANY and fed.get(node, 0) > 1
        info[node] = (to_input or source, reach)
    return info


def _on_activation_path(info, node) -> bool:
    to_input, reach = info[node]
    return to_input or reach is _MANY


def _boundaries(roots: list, info) -> list:
    """(node, [weight-only children], [param nodes behind them]), parents before children."""
    out = []
    for node in reversed(_nodes_postorder(roots)):
        if hasattr(node, "variable") or not (_on_activation_path(info, node) or node in roots):
            continue
        weights, children = [], []
        for c, _ in node.next_functions:
            if c is None or _on_activation_path(info, c):
                continue
            if info[c][1] is not None:
                children.append(c)
                if info[c][1] not in weights:
                    weights.append(info[c][1])
        if weights:
            out.append((node, children, weights))
    return out


def _refuse_fused(bounds: list, vector: list, info) -> None:
    """Raise SplitBackwardError for a matrix boundary that is a custom ``autograd.Function``
    with an activation child: its Python backward computes every gradient whichever are
    asked for, so B and W would each run it whole. A vector boundary is accepted (apex's
    fused norms): B runs its backward once and keeps its weight gradients for W."""
    for (node, _, _), v in zip(bounds, vector):
        if v or not isinstance(node, torch.autograd.function.BackwardCFunction):
            continue
        if any(c is not None and _on_activation_path(info, c) for c, _ in node.next_functions):
            raise SplitBackwardError(
                f"{type(node).__name__}: a custom autograd.Function computes both an activation "
                f"gradient and a matrix weight gradient, so its backward cannot be split into B "
                f"and W (zero-bubble schedules); build the model without it (e.g. "
                f"--no-async-tensor-model-parallel-allreduce)"
            )


def _num_inputs(node) -> int:
    return len(node._input_metadata)


def backward_input(
    outputs: torch.Tensor,
    output_grad: Optional[torch.Tensor],
    input_tensor: Optional[torch.Tensor],
    saved: Optional[SavedTensors] = None,
) -> tuple[Optional[torch.Tensor], WeightGradWork]:
    """B of one (micro-batch, chunk): the input's gradient, and the work W will do.

    ``outputs`` is the chunk's output ``[B, T, H]`` (with ``output_grad`` of the same shape)
    or, on the last virtual stage, the 0-d (scaled) loss (``output_grad`` None).
    ``input_tensor`` is the received activation (a leaf with ``requires_grad``) or None on
    the first virtual stage. ``saved``: the boxes the chunk's forward filled (``SavedTensors``);
    B runs under them too (a replayed region saves into them) and empties every box W does
    not read. Returns ``(grad of input_tensor or None, WeightGradWork)``; no parameter's
    ``.grad`` changes. A recomputed region met on the way (full recomputation) replays its
    forward here and splits its own backward the same way (``split_in_b_pass``): its W joins
    this micro-batch's. Raises SplitBackwardError.
    """
    work = WeightGradWork(saved=saved)
    _B_PASSES.append(work)
    try:
        if saved is None:
            grads = _split([outputs], [output_grad], [] if input_tensor is None else [input_tensor], work)
        else:
            with saved.hooks():
                grads = _split([outputs], [output_grad], [] if input_tensor is None else [input_tensor], work)
    finally:
        _B_PASSES.pop()
    if saved is not None:
        saved.keep_for_weight(work.weight_nodes())
    return (grads[0] if input_tensor is not None else None), work


# The B passes running, innermost last. A recomputed region's backward runs inside the
# engine (on its device thread under CUDA), so it finds the pass here, not in an argument.
_B_PASSES: list = []


def split_in_b_pass(outputs: list, grads: list, inputs: list) -> Optional[list]:
    """For a custom Function whose backward runs its own autograd pass over ``outputs``
    (``tensor_parallel.recompute``): inside a B pass, compute only the gradients of
    ``inputs`` (leaves) and add the region's weight work to the pass's W; returns them, or
    None outside a B pass (then back-propagate as usual)."""
    if not _B_PASSES:
        return None
    return _split(outputs, grads, inputs, _B_PASSES[-1])


def _grad_in_b(param_node) -> bool:
    """A parameter whose weight gradient B computes: a vector (1-D), or one tagged
    ``weight_grad_in_b`` (the output layer's: ``megazero.tags``)."""
    return param_node.variable.dim() == 1 or is_weight_grad_in_b(param_node.variable)


def _is_vector(bound, matrix_params: set) -> bool:
    """A boundary whose parameters all have their gradients computed in B (``_grad_in_b``)
    and are reached by no matrix boundary (module docstring)."""
    return all(_grad_in_b(p) and p not in matrix_params for p in bound[2])


def _split(outputs: list, grads: list, inputs: list, work: WeightGradWork) -> list:
    """B over ``outputs`` with ``grads`` (None for a scalar): returns the gradients of
    ``inputs`` (None where unused) and appends the boundaries' items to ``work``."""
    roots = [o.grad_fn for o in outputs]
    input_nodes = {torch.autograd.graph.get_gradient_edge(x).node for x in inputs}
    info = _classify(roots, input_nodes)
    bounds = _boundaries(roots, info)
    matrix = {p for b in bounds if not all(_grad_in_b(q) for q in b[2]) for p in b[2]}
    vector = [_is_vector(b, matrix) for b in bounds]
    _refuse_fused(bounds, vector, info)
    edges = [
        GradientEdge(node, i) for (node, _, _), v in zip(bounds, vector) if not v for i in range(_num_inputs(node))
    ]
    vparams = list(dict.fromkeys(p for b, v in zip(bounds, vector) if v for p in b[2]))
    wanted = list(inputs) + edges + [p.variable for p in vparams]
    handles = []
    if work.saved is not None:  # the nodes W runs: matrix boundaries and below their weights
        matrix_bounds = [b for b, v in zip(bounds, vector) if not v]
        handles = _release_during_b(
            roots,
            {n for n, _, _ in matrix_bounds}
            | set(_nodes_postorder([c for _, children, _ in matrix_bounds for c in children])),
        )
    try:
        got = (
            list(torch.autograd.grad(outputs, wanted, grad_outputs=grads, retain_graph=True, allow_unused=True))
            if wanted
            else []
        )
    finally:
        for h in handles:
            h.remove()
    captured = got[len(inputs) : len(inputs) + len(edges)]
    computed = dict(zip(vparams, got[len(inputs) + len(edges) :]))
    for (node, children, params), v in zip(bounds, vector):
        if v:  # each parameter's gradient once, at its first vector boundary
            done = [computed.pop(p, None) for p in params]
            work.items.append(_Item(node, (), [p.variable for p in params], children, done))
            continue
        n = _num_inputs(node)
        node_grads, captured = tuple(captured[:n]), captured[n:]
        work.items.append(_Item(node, node_grads, [p.variable for p in params], children))
    return got[: len(inputs)]


def backward_weight(work: WeightGradWork) -> None:
    """W: compute each matrix boundary's weight gradients from what B captured (a vector
    boundary's B computed already) and accumulate them into the parameters through their
    ``AccumulateGrad`` nodes (gradient hooks fire), in B's order. Releases the graph and
    the saved tensors. A parameter reached by several boundaries gets the sum."""
    uses: dict[int, int] = {}
    for it in work.items:
        for p in it.params:
            uses[id(p)] = uses.get(id(p), 0) + 1
    partial: dict[int, torch.Tensor] = {}
    for it in work.items:
        if it.done is not None:
            got = it.done
        else:
            live = [(GradientEdge(it.node, i), g) for i, g in enumerate(it.grads) if g is not None]
            got = (
                torch.autograd.grad(
                    [e for e, _ in live],
                    it.params,
                    grad_outputs=[g for _, g in live],
                    retain_graph=True,
                    allow_unused=True,
                )
                if live
                else [None] * len(it.params)
            )
        ready = []
        for p, g in zip(it.params, got):
            uses[id(p)] -= 1
            if g is not None and id(p) in partial:
                g = partial.pop(id(p)) + g
            elif g is None:
                g = partial.pop(id(p), None)
            if g is not None and uses[id(p)] > 0:
                partial[id(p)] = g
            elif g is not None:
                ready.append((p, g))
        if ready:  # AccumulateGrad of each: .grad += g, the gradient hooks fire
            torch.autograd.backward([p for p, _ in ready], [g for _, g in ready])
    work.items.clear()
    if work.saved is not None:
        work.saved.release()
