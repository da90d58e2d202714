"""Token dispatch for expert parallelism: each (token, chosen expert) assignment of a
micro-batch reaches the rank holding that expert and its output comes back.

Expert parallelism (GShard, Lepikhin et al. 2021, sec. 3.2; Megatron-LM's
``--expert-model-parallel-size``) gives each of the EP ranks of an ``ep`` group ``E/EP``
experts (global indices ``[ep_rank E/EP, (ep_rank+1) E/EP)``). Every rank routes its own tokens
with the replicated router, so routing, capacity drops and the load-balancing losses are those
of expert-parallel size 1; only where the experts run changes. Two dispatchers, Megatron-LM's
``--moe-token-dispatcher-type``:

- :func:`alltoall_experts`: the kept assignments, sorted by expert (token order inside an
  expert), are sent to their expert's rank: first the counts (``[E]`` int64 per rank, one
  all-to-all), then the tokens (one variable-size ``all_to_all_single``); each local expert runs
  on what it received, and the outputs return by the reverse all-to-all. Per MoE layer and
  micro-batch a rank puts ``8 E + 4 H (S + R)`` bytes (fp32) into all-to-alls in the forward
  and ``4 H (S + R)`` in the backward, with ``S`` the assignments it sends and ``R`` those it
  receives; over the ep group sum R = sum S.
- :func:`allgather_experts`: the ep group's tokens, weights and assignments are all-gathered,
  each rank computes its local experts on every token routed to them, and the partial outputs
  are reduce-scattered back (summed over the ep ranks).

An expert whose result on a row depends on the call's other rows (``scales_per_call``: FP8 current
scaling) runs once per source micro-batch's chunk of what it receives (:func:`run_by_source`), so
it quantises as at expert-parallel size 1 (docs/precision.md).

Both return ``[N, W]``: the routing-weighted sum over each token's kept assignments of the
expert outputs, the same arithmetic as the loop of ``model.gpt.MoEMLP`` at EP = 1 (outputs
scaled by their weights and added token by token in expert order). The exchanges are autograd
Functions (an all-to-all's backward is the all-to-all with the splits swapped; all-gather and
reduce-scatter are each other's backward), so the expert gradients sum the tokens of every
ep rank and the routing weights' gradients return to the router that made them.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from megazero import collectives as C
from megazero.moe.router import assignment_counts

Expert = Callable[[torch.Tensor], torch.Tensor]  # rows [n, H] -> outputs [n, W]


def run_expert(expert: Expert, rows: torch.Tensor, pad_to=None) -> torch.Tensor:
    """``expert(rows)`` for ``rows [n, H]`` -> ``[n, W]``; with ``pad_to`` (Megatron-LM's
    ``--moe-pad-expert-input-to-capacity``) the expert computes on ``[pad_to, H]``: the rows,
    then zero rows, whose outputs are cut off (so no gradient reaches them). Raises ValueError
    when ``n > pad_to`` (more rows than the capacity allows)."""
    if pad_to is None:
        return expert(rows)
    n = rows.shape[0]
    if n > pad_to:
        raise ValueError(f"an expert received {n} rows, more than its padded capacity {pad_to}")
    return expert(torch.cat([rows, rows.new_zeros((pad_to - n, *rows.shape[1:]))]))[:n]


class _AllToAll(torch.autograd.Function):
    """``[sum(in_splits), ...]`` -> ``[sum(out_splits), ...]`` over ``group``; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        return C.all_to_all_single(out, x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        return C.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    """``[n, ...]`` of every ep rank -> ``[EP n, ...]`` in group-rank order; backward: the SUM
    reduce-scatter of the gradient (this rank's rows of every rank's contribution)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows_raw(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    """``[EP n, ...]`` -> the SUM over the ep ranks of this rank's ``[n, ...]`` rows; backward:
    the all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows_raw(grad, ctx.group), None


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, ...]`` of every rank of ``group`` -> ``[size n, ...]`` in group-rank order; with
    autograd (:class:`_GatherRows`) when ``x`` requires grad."""
    if x.requires_grad and torch.is_grad_enabled():
        return _GatherRows.apply(x, group)
    return _gather_rows_raw(x, group)


def _gather_rows_raw(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((C.group_size(group) * x.shape[0], *x.shape[1:]))
    C.all_gather_into(out.view(-1), x.contiguous().view(-1), group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // C.group_size(group), *x.shape[1:]))
    C.reduce_scatter_sum(out.view(-1), x.contiguous().view(-1), group)
    return out


def _expert_order(assigned: torch.Tensor, first: int, n: int):
    """The assignments of ``assigned [N, k]`` to experts ``first .. first+n-1`` (any other
    value, e.g. -1 for a dropped one, left out), sorted by expert with token order inside an
    expert, without a host sync: ``(order [N k], counts [n])`` where the first ``sum(counts)``
    entries of ``order`` index the kept assignments of the token-major flattening (the others
    sort last) and ``counts`` are the rows of each expert (int64, on the device). The caller
    reads ``counts`` on the host once (the one sync of a dispatch) and cuts ``order`` with
    :func:`_kept`."""
    flat = assigned.reshape(-1) - first
    key = torch.where((flat >= 0) & (flat < n), flat, n)  # the experts in order, then everything left out
    order = torch.sort(key, stable=True).indices  # stable: token-major inside an expert
    return order, assignment_counts(key, n)


def _kept(order: torch.Tensor, kept: int, k: int, assigned: torch.Tensor):
    """``(token [S], slot [S], expert [S])`` of the first ``kept`` entries of an
    :func:`_expert_order` order (``S = kept``, known on the host)."""
    rows = order[:kept]
    return rows // k, rows % k, assigned.reshape(-1)[rows]


def run_blocks(experts: list, rows: torch.Tensor, sizes: list[int], pad_to=None, sources=None) -> torch.Tensor:
    """``experts[j]`` on its block of ``sizes[j]`` consecutive rows of ``rows [S, H]`` ->
    ``[S, W]`` in the same order: one grouped matrix product when the experts offer it
    (a ``grouped_forward(experts, rows, sizes)`` returning a tensor, e.g. ``model.gpt.ExpertMLP``
    where torch has a grouped GEMM for the device and dtype; not with ``pad_to``), else a loop
    over the blocks (``run_expert``). Both give the same numbers (tests/layouts/test_moe_ep.py).

    ``sources``: the rows of each block per source micro-batch, ``sources[j]`` a list of counts
    summing to ``sizes[j]`` (an expert's block is source-major: the dispatchers below). Experts
    whose ``scales_per_call`` is true (FP8 ones: a scale per tensor, and the weight gradient's
    quantisation along the tokens, take the whole call's rows) then run once per non-empty source
    chunk (:func:`run_by_source`), so each quantises and contracts one micro-batch's rows as
    expert-parallel size 1 does."""
    if sources is not None and experts and getattr(experts[0], "scales_per_call", False):
        return run_by_source(experts, rows, sizes, sources, pad_to)
    grouped = getattr(experts[0], "grouped_forward", None) if experts else None
    if pad_to is None and grouped is not None:
        y = grouped(experts, rows, sizes)
        if y is not None:
            return y
    return torch.cat([run_expert(e, b, pad_to) for e, b in zip(experts, rows.split(sizes))])


def run_by_source(
    experts: list, rows: torch.Tensor, sizes: list[int], sources: list[list[int]], pad_to=None
) -> torch.Tensor:
    """``experts[j]`` on each source's chunk of its block of ``rows [S, H]`` (``sizes``, ``sources``
    as :func:`run_blocks`), one call per non-empty chunk (one call on the empty block when every
    chunk is empty, so the expert's gradients still arrive) -> ``[S, W]`` in row order. A chunk is
    what the expert receives at expert-parallel size 1 from that source's micro-batch, in the same
    (token) order, so each call is the single rank's call for that micro-batch: the same FP8
    scales, the same GEMM shapes; ``pad_to`` (the whole block's padded rows) pads each chunk to
    ``pad_to / len(sources[j])``, the single rank's capacity. The weight gradients of the calls sum
    in autograd (with two sources ``g0 + g1``, the single rank's accumulation ``(0 + g0) + g1``
    bit for bit; with more, in autograd's order)."""
    out = []
    for e, block, counts in zip(experts, rows.split(sizes), sources):
        chunks = [c for c in block.split(counts) if c.shape[0] > 0] or [block]
        per = None if pad_to is None else pad_to // len(counts)
        out += [run_expert(e, c, per) for c in chunks]
    return torch.cat(out)


def local_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    assigned: torch.Tensor,
    experts: Mapping[int, Expert],
    pad_to=None,
    sources: int = 1,
) -> torch.Tensor:
    """The routing-weighted sum of the outputs of ``experts`` (consecutive global indices) on
    the rows assigned to them: ``x [N, H]``, ``weights [N, k]``, ``assigned [N, k]`` (int64,
    -1 or an expert not in ``experts``: skipped) -> ``[N, W]``. The assignments are sorted by
    expert once (token order inside an expert), the rows gathered once and split, each expert
    runs on its block (also on none; ``pad_to``: ``run_expert``), and one ``index_add`` in that
    order adds them up (``run_blocks``: one grouped GEMM where offered): the arithmetic of a loop over experts adding
    each expert's weighted
    outputs token by token, without one ``[N, H]`` copy and one ``[N, H]`` gradient per expert.
    ``sources``: the rows are that many equal blocks of source micro-batches (the all-gather
    dispatcher's ep ranks), whose per-expert counts go to ``run_blocks``."""
    first, n = min(experts), len(experts)
    order, counts = _expert_order(assigned, first, n)
    if sources > 1:
        blocks = (assigned - first).view(sources, -1)  # (sources, N/sources k)
        per_source = torch.stack([assignment_counts(b, n) for b in blocks])  # (sources, n)
        split = per_source.t().tolist()  # the one host sync: [n][sources]
        sizes = [sum(c) for c in split]
    else:
        split, sizes = None, counts.tolist()  # the one host sync
    tok, slot, _ = _kept(order, sum(sizes), assigned.shape[1], assigned)
    y = run_blocks([experts[first + j] for j in range(n)], x[tok], sizes, pad_to, split)  # rows by expert
    return x.new_zeros((x.shape[0], y.shape[1])).index_add(0, tok, y * weights[tok, slot, None])


def alltoall_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    assigned: torch.Tensor,
    experts: Mapping[int, Expert],
    num_experts: int,
    group,
    ep_rank: int,
    capacity=None,
) -> torch.Tensor:
    """The weighted expert outputs of this rank's tokens through the all-to-all dispatcher
    (module docstring): ``x [N, H]``, ``weights [N, k]`` (the routing weights), ``assigned
    [N, k]`` (int64 expert of each assignment, -1 for a dropped one); ``experts`` this rank's
    experts by global index (``E/EP`` of them, ``ep_rank``'s block), each run on every row it
    receives (also on none, so its gradients arrive), padded with zero rows to EP x ``capacity``
    rows when ``capacity`` is given (``run_expert``). Returns ``[N, W]``."""
    ep = C.group_size(group)
    local, pad_to = num_experts // ep, None if capacity is None else ep * capacity
    order, counts = _expert_order(assigned, 0, num_experts)  # counts: [E] to each expert
    recv_counts = torch.empty_like(counts)
    C.all_to_all_single(recv_counts, counts, [local] * ep, [local] * ep, group)  # [EP sources x E/EP]
    both = torch.cat([counts, recv_counts]).tolist()  # the one host sync
    sent, got = both[:num_experts], both[num_experts:]
    send_rows = [sum(sent[r * local : (r + 1) * local]) for r in range(ep)]
    recv_rows = [sum(got[r * local : (r + 1) * local]) for r in range(ep)]
    tok, slot, _ = _kept(order, sum(send_rows), assigned.shape[1], assigned)
    received = _AllToAll.apply(x[tok], recv_rows, send_rows, group)  # [R, H], source-major
    # reorder expert-major (source order inside an expert), run each local expert, restore the order
    expert_of_row = (
        torch.arange(local, device=x.device).repeat(ep).repeat_interleave(recv_counts, output_size=sum(recv_rows))
    )  # the size known on the host: no sync
    perm = torch.sort(expert_of_row, stable=True).indices  # [R] expert-major
    mine = [experts[ep_rank * local + j] for j in range(local)]
    sources = [[got[r * local + j] for r in range(ep)] for j in range(local)]  # [E/EP][EP sources]
    y = run_blocks(mine, received[perm], [sum(c) for c in sources], pad_to, sources)
    y = torch.zeros_like(y).index_copy(0, perm, y)  # [R, W] source-major
    back = _AllToAll.apply(y, send_rows, recv_rows, group)  # [S, W] expert-sorted
    out = x.new_zeros((x.shape[0], back.shape[1]))
    return out.index_add(0, tok, back * weights[tok, slot, None])


def allgather_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    assigned: torch.Tensor,
    experts: Mapping[int, Expert],
    num_experts: int,
    group,
    ep_rank: int,
    capacity=None,
) -> torch.Tensor:
    """The weighted expert outputs of this rank's tokens through the all-gather dispatcher
    (module docstring); arguments and result as :func:`alltoall_experts`. Every rank of the
    ep group must hold the same number of tokens N (one micro-batch shape)."""
    ep = C.group_size(group)
    local, pad_to = num_experts // ep, None if capacity is None else ep * capacity
    x_all = _GatherRows.apply(x, group)  # [EP N, H]
    w_all = _GatherRows.apply(weights, group)  # [EP N, k]
    a_all = assigned.new_empty((x_all.shape[0], assigned.shape[1]))
    C.all_gather_into(a_all.view(-1), assigned.contiguous().view(-1), group)
    mine = {e: experts[e] for e in range(ep_rank * local, (ep_rank + 1) * local)}
    out = local_experts(x_all, w_all, a_all, mine, pad_to, sources=ep)  # [EP N, W]
    return _ReduceScatterRows.apply(out, group)  # [N, W]


DISPATCHERS = {"alltoall": alltoall_experts, "allgather": allgather_experts}
"""``--moe-token-dispatcher-type`` -> its function."""
