"""Global gradient norm over tp x pp x dp, each element of the full model counted once.

Clipping by the global L2 norm (Pascanu et al. 2013) must give the single-process norm
under every layout (docs/design.md, contract 1). Every rank sums the squares of the
gradient elements it is responsible for (accumulated in fp64, see "Precision"), and
one fp64 SUM all-reduce adds them:

- TP partitions are disjoint: all count; a TP-replicated parameter counts on TP rank 0
  only; of a weight tied across pipeline stages only one copy counts
  (``tags.counts_in_norm``). Summing over the model-parallel group (tp x pp) then counts
  every element of one model replica once.
- ZeRO-1/2 shards are disjoint over DP, so their sums are added over DP too (the reduction
  runs over the whole world); with plain DP (stage 0) every DP rank holds the full reduced
  gradient and the sum runs over the model-parallel group only. The caller asks the
  sharding strategy (``ShardingPolicy.shards_optimizer``), never the stage number.
- Hybrid sharding (``--zero-shard-size S``): shards are disjoint inside a shard group and
  replicated over the dp x cp / S replica groups, so the optimizer passes a buffer's pieces
  only where ``ShardedBuffer.replica_rank == 0`` and the sum still runs over the world.

The all-reduce leaves the same bits on every rank, so every rank computes the same clip
coefficient. ``clip_coefficient`` matches ``torch.nn.utils.clip_grad_norm_``.

Precision and launches: an fp32 sum of squares drifts with the element count (torch's CPU
``vector_norm`` of 25M fp32 values is 4e-3 off, and layouts that cut the buffer into other
pieces disagree), so no fp32 accumulator holds more than a few dozen squares, and every
partial sum is added in fp64. How, depends on the device (``squared_sum``):

- CUDA: one ``torch._foreach_norm(pieces, 2, dtype=float64)`` over the whole precomputed list
  of counted pieces, then the fp64 squares of those norms summed: 4 launches whatever the
  number of pieces (per-piece kernels cost about 1,500 launches per step on the 1.3B check
  model). The multi-tensor kernel converts each element to fp64 in registers, so
  the pass stays memory-bound. 1e-13 relative to an fp64 sum.
- CPU: torch's ``_foreach_norm`` loops over the pieces and upcasts each to fp64 (5x one fp32
  pass: 10.6 against 2.1 ms on 5.25M values, one thread), which made the norm the largest
  item of megazero's overhead over a plain PyTorch loop. So a piece is
  viewed as rows of ``ROW`` elements, each row's norm taken in fp32 (one pass, no copy) and
  the squared row norms summed in fp64; short pieces and the tail are upcast whole. 3.1 ms on
  the same values; off the fp64 sum by the fp32 rounding of each row's norm, averaged over
  the rows: 5e-11 on 5.25M values, at most a few 1e-9 on pieces of a thousand rows.

Either way, layouts that cut the gradient into other pieces agree far inside the 1e-9 the
layout tests ask. The all-reduce runs in fp64 too, and nothing here reads the result on the
host (``reduce_squared_sum``): the optimizer reads it once, and it doubles as the overflow check: one
host synchronisation for both.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from megazero import collectives as C
from megazero import tags
from megazero.process_groups import ProcessGroups

ROW = 64  # squares per fp32 accumulator on the CPU path
SMALL = 1 << 16  # CPU pieces up to this many elements are upcast to fp64 whole


def _cpu_piece_squares(flat: torch.Tensor) -> torch.Tensor:
    """Sum of squares of the 1-D ``flat`` as a 0-d fp64 tensor: rows of ``ROW`` squares in
    fp32, their sums added in fp64 (module docstring, "Precision and launches")."""
    if flat.numel() <= SMALL:
        return torch.linalg.vector_norm(flat, 2, dtype=torch.float64).square()
    body = flat.numel() - flat.numel() % ROW
    rows = flat[:body].view(-1, ROW)  # (n/ROW, ROW)
    sq = torch.linalg.vector_norm(rows, 2, dim=1).double().square().sum()
    if body < flat.numel():
        sq = sq + torch.linalg.vector_norm(flat[body:], 2, dtype=torch.float64).square()
    return sq


def uses_rows(device: torch.device) -> bool:
    """Whether ``squared_sum`` takes the rows path on ``device`` (the CPU) rather than the one
    multi-tensor call (module docstring, "Precision and launches")."""
    return device.type == "cpu"


def squared_sum(tensors: Iterable[torch.Tensor], device=None, exact: bool = False) -> torch.Tensor:
    """Sum of squares of every element of ``tensors`` as a one-element fp64 tensor.

    ``tensors``: any shapes and floating dtypes on one device (the optimizer passes a list it
    built once). On CUDA one multi-tensor fp64 norm call for the whole list; on the CPU rows of
    ``ROW`` fp32 squares per piece, added in fp64 (module docstring, "Precision and
    launches"), or with ``exact`` every square in fp64 as on CUDA (FP8 training: a clip
    coefficient whose last fp32 bit does not depend on the layout's pieces); no host
    synchronisation. ``device`` is used when ``tensors`` is empty (CPU when not given).
    """
    parts = [t for t in tensors if t.numel() > 0]
    if not parts:
        return torch.zeros(1, dtype=torch.float64, device=device)
    if uses_rows(parts[0].device) and not exact:
        return torch.stack([_cpu_piece_squares(t.reshape(-1)) for t in parts]).sum().reshape(1)
    norms = torch._foreach_norm(parts, 2, dtype=torch.float64)  # [()] per piece, fp64
    return torch.stack(norms).square().sum().reshape(1)


def reduce_squared_sum(
    counted: Iterable[torch.Tensor], groups: ProcessGroups, *, sharded_over_dp: bool, device=None, exact: bool = False
) -> torch.Tensor:
    """The global sum of squares as a one-element fp64 tensor, identical on every rank, left
    on the device (no host synchronisation): :func:`squared_sum` of this rank's ``counted``
    pieces (``exact`` as there), then one SUM all-reduce over ``groups.world`` when
    ``sharded_over_dp``, else over ``groups.mp`` (arguments as :func:`global_grad_norm`)."""
    sq = squared_sum(counted, device, exact)
    C.all_reduce_sum(sq, groups.world if sharded_over_dp else groups.mp)
    return sq


def global_grad_norm(
    counted: Iterable[torch.Tensor],
    groups: ProcessGroups,
    *,
    sharded_over_dp: bool,
    inv_scale: float = 1.0,
    device=None,
) -> float:
    """Global L2 norm from this rank's counted gradient pieces.

    Args:
        counted: the gradient elements this rank counts (caller applies
            ``tags.counts_in_norm`` and, for ZeRO, passes only its own shard).
        groups: process groups; SUM over ``groups.world`` when ``sharded_over_dp``, else
            over ``groups.mp`` (tensor x pipeline).
        sharded_over_dp: True when each DP rank holds a disjoint shard
            (``ShardingPolicy.shards_optimizer``: ZeRO-1/2).
        inv_scale: multiplies the result (``1 / loss_scale`` for still-scaled gradients).
        device: where to build the sum when ``counted`` is empty.

    Returns the norm as a Python float, identical on every rank (inf/NaN propagate); the
    squares are summed and all-reduced in fp64 (module docstring). Reads it on the host: one
    synchronisation (the optimizer uses :func:`reduce_squared_sum` to share it).
    """
    sq = reduce_squared_sum(counted, groups, sharded_over_dp=sharded_over_dp, device=device)
    return norm_from_squares(sq.item(), inv_scale)


def norm_from_squares(sq: float, inv_scale: float = 1.0) -> float:
    """``sqrt(sq) * inv_scale``: the norm from the global sum of squares read on the host."""
    return math.sqrt(sq) * inv_scale


def grad_norm_of_params(params: Iterable[torch.nn.Parameter], groups: ProcessGroups) -> float:
    """Global norm of the ``.grad`` of a model not wrapped in DataParallel.

    Every DP rank is assumed to hold the same (already reduced) gradients, so the sum runs
    over tp x pp only; parameters without ``.grad`` count as zero.
    """
    params = list(params)
    device = params[0].device if params else None
    grads = [p.grad for p in params if p.grad is not None and tags.counts_in_norm(p, groups.tp_rank)]
    return global_grad_norm(grads, groups, sharded_over_dp=False, device=device)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Factor to multiply gradients by: ``min(1, max_norm / (norm + 1e-6))``.

    Same rule as ``torch.nn.utils.clip_grad_norm_``. ``max_norm <= 0`` means no clipping
    (returns 1.0). A non-finite ``norm`` returns NaN (the caller must skip the step).
    """
    if max_norm <= 0:
        return 1.0
    if not math.isfinite(norm):
        return float("nan")
    return min(1.0, max_norm / (norm + 1e-6))
