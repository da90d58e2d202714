"""Tensor-parallel layers: column/row parallel linear, vocabulary-parallel embedding.

Megatron-LM (Shoeybi et al. 2019, sec. 3): a linear layer ``Y = X A^T + b`` is split
either by output features (column parallel: each rank holds rows of ``A`` in PyTorch's
``[out, in]`` convention and produces a slice of ``Y``) or by input features (row
parallel: each rank holds columns of ``A``, consumes a slice of ``X`` and the partial
products are summed). An MLP or attention block is column-then-row, so one all-reduce
forward and one backward suffice. The word embedding is split by vocabulary rows.

With sequence parallelism (Korthikanti et al. 2022, sec. 4.2) the activations outside the
column/row pair are ``[B, T/tp, H]``: the column layer all-gathers the sequence first and
the row layer reduce-scatters it afterwards.

Every parameter is tagged (``tags.py``); a rank keeps its partition of the full tensor it
is given (layout-independent initialisation, docs/design.md contract 1). At group size 1
each layer is the plain ``torch.nn.functional`` operation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megazero import collectives as C
from megazero import tags
from megazero.collectives import Group
from megazero.ops.fp8 import ACCUMULATE, Fp8Settings, check_weight_blocks, fp8_linear
from megazero.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)


def _partition_param(
    full: Optional[torch.Tensor],
    full_shape: tuple,
    dim: int,
    rank: int,
    size: int,
    stride: int,
    dtype: torch.dtype,
    device,
    name: str,
) -> nn.Parameter:
    """This rank's partition of ``full`` (or zeros of the partition's shape), tagged."""
    d = full_shape[dim]
    if d % (stride * size) != 0:
        raise ValueError(
            f"{name}: dimension {dim} of size {d} is not divisible by stride {stride} x tensor-parallel size {size}"
        )
    if full is None:
        shape = list(full_shape)
        shape[dim] = d // size
        part = torch.zeros(shape, dtype=dtype, device=device)
    else:
        if tuple(full.shape) != tuple(full_shape):
            raise ValueError(f"{name}: full tensor has shape {tuple(full.shape)}, expected {tuple(full_shape)}")
        part = tags.partition_tensor(full.detach(), dim, rank, size, stride)
        part = part.to(dtype=dtype, device=device if device is not None else full.device)
    return tags.set_partitioned(nn.Parameter(part), dim=dim, stride=stride)


def _replicated_param(
    full: Optional[torch.Tensor], shape: tuple, dtype, device, name: str, sequence_parallel: bool
) -> nn.Parameter:
    if full is None:
        t = torch.zeros(shape, dtype=dtype, device=device)
    else:
        if tuple(full.shape) != tuple(shape):
            raise ValueError(f"{name}: full tensor has shape {tuple(full.shape)}, expected {tuple(shape)}")
        t = full.detach().to(dtype=dtype, device=device if device is not None else full.device, copy=True)
    return tags.set_replicated(nn.Parameter(t), sequence_parallel=sequence_parallel)


class _ColumnLinearOverlap(torch.autograd.Function):
    """Column-parallel ``F.linear`` whose backward overlaps the input-gradient reduction with
    the weight-gradient matmul (Megatron-LM's async tensor-parallel all-reduce,
    ``LinearWithGradAccumulationAndAsyncCommunication``; Narayanan et al. 2021, sec. 4.1).

    Forward: ``x [B, T, in]`` (``[B, T/tp, in]`` with ``sp``: all-gathered along the sequence)
    -> ``[B, T, out/tp]``. Backward: ``dX = dY W`` is started as an async SUM all-reduce over
    TP (a reduce-scatter along the sequence with ``sp``); ``dW = (X^T dY)^T`` and
    ``db = sum(dY)`` are computed while it runs, then the handle is waited. The matmuls are
    the ones autograd runs for ``F.linear`` (``addmm``/``mm`` on the flattened tokens), so
    the gradients are bit-identical to the non-overlapped layer.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sp):
        full = gather_from_sequence_parallel_region(x, group) if sp else x  # (B, T, in)
        ctx.save_for_backward(full, weight)
        ctx.group, ctx.sp, ctx.has_bias = group, sp, bias is not None
        return F.linear(full, weight, bias)  # (B, T, out/tp)

    @staticmethod
    def backward(ctx, grad):
        full, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])  # (B*T, out/tp)
        dx = g2.mm(weight).view(full.shape)  # (B, T, in)
        if ctx.sp:
            front = dx.movedim(1, 0).contiguous()  # (T, B, in)
            out = torch.empty(
                (front.shape[0] // C.group_size(ctx.group), *front.shape[1:]), dtype=dx.dtype, device=dx.device
            )  # (T/tp, B, in)
            work = C.reduce_scatter_sum(out.view(-1), front.view(-1), ctx.group, async_op=True)
        else:
            work = C.all_reduce_sum(dx, ctx.group, async_op=True)
        x2 = full.reshape(-1, full.shape[-1])  # (B*T, in)
        dw = x2.t().mm(g2).t()  # (out/tp, in)
        db = g2.sum(0) if ctx.has_bias else None
        work.wait()
        if ctx.sp:
            dx = out.movedim(0, 1).contiguous()  # (B, T/tp, in)
        return dx, dw, db, None, None


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A [out, in]`` split by output rows: weight ``[out/tp, in]``.

    Input ``[B, T, in]`` (``[B, T/tp, in]`` with ``sequence_parallel``, all-gathered along
    the sequence first); output ``[B, T, out/tp]``, or ``[B, T, out]`` with
    ``gather_output``. ``stride`` > 1 means the full weight is ``stride`` stacked blocks
    (e.g. fused q, k, v) each split across ranks (``tags.partition_tensor``).

    ``overlap_grad_reduce`` (tp > 1, training): the backward overlaps the input-gradient
    reduction with the weight-gradient matmul (``_ColumnLinearOverlap``), bit-identical.

    ``fp8``: the GEMMs run in FP8 (``megazero.ops.fp8``, without the overlap) on the
    (sequence-gathered) input; scales spanning the ``out/tp`` split are reduced over TP. The
    weight is tagged ``fp8_weight``: ZeRO-3 with ``--fp8-param-gather`` hands it over quantised
    (``tags.fp8_gathered``), and the GEMMs use that instead of quantising it again.
    ``wide`` (a dtype; an FP8 model's output layer): input, product and output in ``wide`` and the
    input gradient summed over TP in it, as :func:`parallel_lm_logits` (without the overlap).

    Raises ValueError when ``out_features`` is not divisible by ``stride * tp``, when a
    full tensor has the wrong shape, or when ``gather_output`` is combined with
    ``stride > 1`` (the gathered columns would be in interleaved, not full, order).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        full_weight: Optional[torch.Tensor] = None,
        full_bias: Optional[torch.Tensor] = None,
        stride: int = 1,
        dtype: torch.dtype = torch.float32,
        device=None,
        overlap_grad_reduce: bool = True,
        fp8: Optional[Fp8Settings] = None,
        wide: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.overlap_grad_reduce, self.fp8, self.wide = overlap_grad_reduce, fp8, wide
        if wide is not None and fp8 is not None:
            raise ValueError("ColumnParallelLinear: wide= is for a layer outside FP8 (the output layer), not with fp8=")
        if gather_output and stride > 1:
            raise ValueError(f"ColumnParallelLinear: gather_output=True needs stride=1 (got stride {stride})")
        self.group = group
        self.tp_rank, self.tp_size = C.group_rank(group), C.group_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = _partition_param(
            full_weight,
            (out_features, in_features),
            0,
            self.tp_rank,
            self.tp_size,
            stride,
            dtype,
            device,
            "ColumnParallelLinear.weight",
        )
        if fp8 is not None:  # FP8 blocks lie on the logical weight: each stride block's shard holds whole ones
            shard = (out_features // (stride * self.tp_size), in_features)
            check_weight_blocks("ColumnParallelLinear.weight", shard, fp8)
            tags.set_fp8_weight(self.weight)
        self.bias = None
        if bias:
            self.bias = _partition_param(
                full_bias,
                (out_features,),
                0,
                self.tp_rank,
                self.tp_size,
                stride,
                dtype,
                device,
                "ColumnParallelLinear.bias",
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None:  # computed in ``wide``, its output in it (an FP8 model's output layer)
            y = parallel_lm_logits(x, self.weight, self.group, self.sequence_parallel, self.bias, self.wide)
            return gather_from_tp_region(y, self.group) if self.gather_output else y
        if self.overlap_grad_reduce and self.tp_size > 1 and torch.is_grad_enabled() and self.fp8 is None:
            y = _ColumnLinearOverlap.apply(
                x, self.weight, self.bias, self.group, self.sequence_parallel
            )  # (B, T, out/tp)
            return gather_from_tp_region(y, self.group) if self.gather_output else y
        dtype = x.dtype
        wide = ACCUMULATE if self.fp8 is not None and self.tp_size > 1 else None  # fp8: exact dX partial sums
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group, wide=wide)  # (B, T, in)
        else:
            x = copy_to_tp_region(x, self.group, wide=wide)
        if self.fp8 is not None:
            sharded = "N" if self.tp_size > 1 else ""
            y = fp8_linear(
                x, self.weight, self.bias, self.fp8, self.group, sharded, dtype, tags.fp8_gathered(self.weight)
            )
        else:
            y = F.linear(x, self.weight, self.bias)  # (B, T, out/tp)
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A [out, in]`` split by input columns: weight ``[out, in/tp]``.

    Input ``[B, T, in/tp]`` when ``input_is_parallel`` (else ``[B, T, in]``, split here).
    The partial products are summed over TP: output ``[B, T, out]`` (all-reduce), or
    ``[B, T/tp, out]`` with ``sequence_parallel`` (reduce-scatter along the sequence).
    The bias ``[out]`` is replicated and added after the reduction (at tp 1, with nothing to
    reduce, inside the matmul as ``nn.Linear`` adds it: one pass fewer); under sequence
    parallelism it is tagged ``sequence_parallel`` since each rank sees only ``T/tp``
    tokens and its gradient must be summed over TP (``data_parallel.finalize``).

    ``fp8``: the GEMM runs in FP8 (``megazero.ops.fp8``); scales spanning the ``in/tp`` split
    of the input and weight are reduced over TP; the weight is tagged ``fp8_weight`` as in
    :class:`ColumnParallelLinear`.

    Raises ValueError when ``in_features`` is not divisible by tp or a full tensor has the
    wrong shape.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        full_weight: Optional[torch.Tensor] = None,
        full_bias: Optional[torch.Tensor] = None,
        dtype: torch.dtype = torch.float32,
        device=None,
        fp8: Optional[Fp8Settings] = None,
    ):
        super().__init__()
        self.group, self.fp8 = group, fp8
        self.tp_rank, self.tp_size = C.group_rank(group), C.group_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = _partition_param(
            full_weight,
            (out_features, in_features),
            1,
            self.tp_rank,
            self.tp_size,
            1,
            dtype,
            device,
            "RowParallelLinear.weight",
        )
        if fp8 is not None:
            check_weight_blocks("RowParallelLinear.weight", (out_features, in_features // self.tp_size), fp8)
            tags.set_fp8_weight(self.weight)
        self.bias = None
        if bias:
            self.bias = _replicated_param(
                full_bias, (out_features,), dtype, device, "RowParallelLinear.bias", sequence_parallel
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # no partial sums to reduce: the bias joins the matmul (addmm), as in nn.Linear
            if self.fp8 is not None:  # the bias after the GEMM, as at tp > 1: one summation of its gradient
                y = fp8_linear(x, self.weight, None, self.fp8, weight_fp8=tags.fp8_gathered(self.weight))  # (B, T, out)
                return y if self.bias is None else y + self.bias
            return F.linear(x, self.weight, self.bias)  # (B, T, out)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)  # (B, T, in/tp)
        if self.fp8 is not None:  # the partial sums in ACCUMULATE, reduced in it, rounded once: one process's value
            partial = fp8_linear(
                x, self.weight, None, self.fp8, self.group, "K", ACCUMULATE, tags.fp8_gathered(self.weight)
            )  # (B, T, out)
        else:
            partial = F.linear(x, self.weight)  # (B, T, out), partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)  # (B, T/tp, out)
        else:
            y = reduce_from_tp_region(partial, self.group)  # (B, T, out)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Word embedding split by vocabulary rows: weight ``[V/tp, H]``.

    Rank ``r`` owns ids ``[vocab_start_index, vocab_end_index)``; other ids contribute
    zeros and the all-reduce over TP assembles the lookup (Shoeybi et al. 2019, sec. 3).
    Input ids ``[B, T]``; output ``[B, T, H]``, or ``[B, T/tp, H]`` with
    ``sequence_parallel`` (reduce-scatter instead of all-reduce; T divisible by tp).
    ``num_embeddings`` is the padded vocabulary size. Raises ValueError when it is not
    divisible by tp or the full weight has the wrong shape.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: Group,
        *,
        full_weight: Optional[torch.Tensor] = None,
        dtype: torch.dtype = torch.float32,
        device=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group = group
        self.tp_rank, self.tp_size = C.group_rank(group), C.group_size(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.weight = _partition_param(
            full_weight,
            (num_embeddings, embedding_dim),
            0,
            self.tp_rank,
            self.tp_size,
            1,
            dtype,
            device,
            "VocabParallelEmbedding.weight",
        )
        per_rank = num_embeddings // self.tp_size
        self.vocab_start_index = self.tp_rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)  # (B, T)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(emb, self.group)  # (B, T/tp, H)
        return reduce_from_tp_region(emb, self.group)  # (B, T, H)


class _WideLinear(torch.autograd.Function):
    """``x W^T (+ b)`` with ``x [..., H]`` already in a wide dtype (fp64), ``W [V, H]`` and ``b [V]``
    in theirs: the product and output in ``x``'s dtype, the weight widened only while a GEMM runs
    (saved as it is: no wide copy kept for the backward), ``x`` saved in ``narrow`` (exact when
    ``x`` was widened from it). Backward: ``dX`` in the wide dtype, ``dW``, ``db`` summed in it and
    rounded once to the parameters' dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, narrow):
        wide = x.dtype
        y = F.linear(x, weight.to(wide), None if bias is None else bias.to(wide))  # (..., V)
        ctx.save_for_backward(x.to(narrow), weight)
        ctx.wide, ctx.has_bias = wide, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]).to(ctx.wide)  # (M, V), (M, H)
        dx = grad.matmul(weight.to(ctx.wide))  # (..., H)
        dw = g2.t().mm(x2).to(weight.dtype)  # (V, H)
        db = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx, dw, db, None


def parallel_lm_logits(
    hidden: torch.Tensor,
    word_embedding_weight: torch.Tensor,
    group: Group,
    sequence_parallel: bool = False,
    bias: Optional[torch.Tensor] = None,
    wide: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Tied output layer: this rank's vocabulary slice of the logits.

    ``hidden [B, T, H]`` (``[B, T/tp, H]`` with ``sequence_parallel``, all-gathered first),
    ``word_embedding_weight [V/tp, H]`` (the rank's embedding partition), optional
    ``bias [V/tp]`` -> logits ``[B, T, V/tp]``. The entry mapping (Megatron's ``f``, or the
    sequence all-gather whose backward reduce-scatters) sums the hidden-state gradient over
    TP, since each rank's vocabulary slice contributes a part of it. ``wide`` (FP8 training,
    ``megazero.ops.fp8.ACCUMULATE``): the product, the logits and that gradient sum in ``wide``,
    so the hidden-state gradient rounds to one process's value under any tp (the gradient then
    enters FP8 quantisations, which a last-bit difference can move by a whole FP8 step); the
    input is kept in its own dtype and the weight is widened only while a GEMM runs.
    """
    narrow = hidden.dtype
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, group, wide=wide)  # (B, T, H)
    else:
        hidden = copy_to_tp_region(hidden, group, wide=wide)
    if wide is not None:
        return _WideLinear.apply(hidden, word_embedding_weight, bias, narrow)  # (B, T, V/tp) in wide
    return F.linear(hidden, word_embedding_weight, bias)  # (B, T, V/tp)
