"""Partition metadata carried by every parameter (docs/design.md, "Partition tags").

Gradient clipping, gradient synchronisation and checkpoints read these tags and nothing
else (never parameter names):

- ``tensor_model_parallel`` (bool): True when the parameter is one TP partition of a larger
  tensor; then ``partition_dim`` and ``partition_stride`` say how (stride > 1 means the
  full tensor is ``stride`` interleaved blocks, each cut into ``tp`` pieces, as for a fused
  QKV weight whose q, k and v blocks are each split by head).
- ``sequence_parallel`` (bool): a TP-replicated parameter of which each TP rank computes only a
  part of the gradient: one that sees sequence-partitioned activations (LayerNorm weight/bias,
  row-parallel bias under ``--sequence-parallel``; Korthikanti et al. 2022, sec. 4.2.2), or one
  applied to each rank's own attention heads (QK-norm weights, with or without sequence
  parallelism). Its gradient must be summed over the TP group.
- ``weight_grad_in_b`` (bool): under a zero-bubble schedule, B computes this parameter's
  weight gradient and hands it to W (``pipeline/weight_grad.py``): the output layer's, whose
  W would otherwise hold the logits' gradient ``[B, T, V/tp]`` from B to W.
- ``partition_size`` (int, optional): the number of TP ranks a partition is cut over when
  fewer than tp: a routed expert under ``--expert-tensor-parallel-size`` etp < tp is cut over
  etp ranks (this rank's piece ``tp_rank % etp``) and replicated over the tp / etp others
  (``partition_coords``).
- ``fp8_weight`` (bool): the weight of an FP8 GEMM (``tensor_parallel.layers``) whose tensorwise
  scale is that of the whole logical tensor; ZeRO-3's ``--fp8-param-gather`` gathers it as FP8 bytes
  (``data_parallel.zero3_fp8``) and sets ``fp8_gathered``, the ``(q, scale)`` the GEMM uses, while
  it is gathered (None otherwise).
- ``shared_embedding`` (bool): one copy of a weight tied across pipeline stages (word
  embedding on the first stage, output layer on the last); the copy on the last stage is
  not counted again by norms.
"""

from __future__ import annotations

import torch


def set_partitioned(param: torch.Tensor, dim: int, stride: int = 1) -> torch.Tensor:
    """Tag ``param`` as a TP partition along ``dim`` with ``stride``; returns it."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride
    return param


def set_partition_size(param: torch.Tensor, size: int) -> torch.Tensor:
    """Tag a TP partition cut over ``size`` of the tp ranks (a divisor of tp; the expert
    tensor-parallel size) instead of all of them; returns it."""
    param.partition_size = size
    return param


def partition_coords(param: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(rank, size)``: which of how many pieces of the full tensor this rank's partition of
    ``param`` is: ``(tp_rank % etp, etp)`` for a parameter tagged ``set_partition_size(etp)``
    (etp consecutive tp ranks hold the pieces, Megatron-LM's expert rank order), else
    ``(tp_rank, tp_size)``."""
    size = getattr(param, "partition_size", None)
    return (tp_rank, tp_size) if size is None else (tp_rank % size, size)


def set_replicated(param: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
    """Tag ``param`` as identical on every TP rank; returns it."""
    param.tensor_model_parallel = False
    param.partition_dim = -1
    param.partition_stride = 1
    param.sequence_parallel = sequence_parallel
    return param


def set_shared_embedding(param: torch.Tensor, counted_here: bool) -> torch.Tensor:
    """Tag one copy of a cross-stage tied weight; ``counted_here`` is True on one copy only."""
    param.shared_embedding = True
    param.shared_counted_here = counted_here
    return param


def set_expert_parallel(param: torch.Tensor) -> torch.Tensor:
    """Tag a parameter of a routed expert held by this expert-parallel rank alone:
    its gradient is reduced and its optimizer state sharded over the expert-data-parallel
    group, not over all dp x cp replicas (Megatron-LM marks these ``allreduce = False``)."""
    param.expert_parallel = True
    return param


def set_weight_grad_in_b(param: torch.Tensor) -> torch.Tensor:
    """Tag ``param`` so a split backward computes its weight gradient in B (module docstring)."""
    param.weight_grad_in_b = True
    return param


def set_fp8_weight(param: torch.Tensor) -> torch.Tensor:
    """Tag ``param`` as an FP8 GEMM's weight (module docstring); returns it."""
    param.fp8_weight = True
    param.fp8_gathered = None
    return param


def is_fp8_weight(param: torch.Tensor) -> bool:
    return bool(getattr(param, "fp8_weight", False))


def fp8_gathered(param: torch.Tensor):
    """The ``(q [N, K] float8_e4m3fn, scale [1, 1] fp32)`` ZeRO-3's FP8 all-gather made of
    ``param`` while it is gathered, else None (the GEMM quantises ``param`` itself)."""
    return getattr(param, "fp8_gathered", None)


def is_weight_grad_in_b(param: torch.Tensor) -> bool:
    return bool(getattr(param, "weight_grad_in_b", False))


def is_expert_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_parallel", False))


def set_weight_decay(param: torch.Tensor, decays: bool) -> torch.Tensor:
    """Tag whether AdamW decays ``param`` (the model's parameter spec decides); returns it."""
    param.weight_decay = decays
    return param


def decays(param: torch.Tensor) -> bool:
    """Whether AdamW decays ``param``: its ``set_weight_decay`` tag, else Megatron-LM's rule
    (matrices decay; biases and norm weights, ``ndim < 2``, do not)."""
    return bool(getattr(param, "weight_decay", param.dim() >= 2))


def set_hidden_matrix(param: torch.Tensor, hidden: bool) -> torch.Tensor:
    """Tag whether ``param`` is a hidden-layer matrix that Muon orthogonalises (the model's
    parameter spec decides: 2-D and neither an embedding nor the output head); returns it."""
    param.hidden_matrix = hidden
    return param


def is_hidden_matrix(param: torch.Tensor) -> bool:
    """Whether Muon updates ``param`` (its ``set_hidden_matrix`` tag; untagged: False, so
    AdamW updates it)."""
    return bool(getattr(param, "hidden_matrix", False))


def is_partitioned(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "sequence_parallel", False))


def is_shared_embedding(param: torch.Tensor) -> bool:
    return bool(getattr(param, "shared_embedding", False))


def counts_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """True when this rank's copy of ``param`` is the one that counts in a global norm.

    A TP partition always counts (the partitions are disjoint); a TP-replicated parameter
    counts only on TP rank 0; of a cross-stage tied pair only the copy with
    ``shared_counted_here`` counts. Summing over tp x pp x dp then counts each element of
    the full model exactly once (ZeRO shards are disjoint, so they sum too).
    """
    if is_shared_embedding(param) and not getattr(param, "shared_counted_here", True):
        return False
    return is_partitioned(param) or tp_rank == 0


def partition_tensor(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """Rank ``rank``'s partition of ``full`` along ``dim`` (a contiguous copy).

    With ``stride`` s, ``full`` is s equal blocks along ``dim``; each block is cut into
    ``size`` pieces and the rank takes piece ``rank`` of every block, concatenated.
    Shapes: full ``[..., D, ...]`` -> ``[..., D/size, ...]``.

    Raises ValueError when ``D`` is not divisible by ``stride * size``.
    """
    d = full.shape[dim]
    if d % (stride * size) != 0:
        raise ValueError(f"dimension {dim} of size {d} is not divisible by stride {stride} x partitions {size}")
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def join_partitions(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of ``partition_tensor``: the full tensor from every rank's partition, in rank order.

    Each partition is ``stride`` blocks along ``dim``; block j of the full tensor is block j
    of every partition, concatenated in rank order. Shapes: ``size`` x ``[..., D/size, ...]``
    -> ``[..., D, ...]``.
    """
    blocks = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([torch.cat([b[j] for b in blocks], dim=dim) for j in range(stride)], dim=dim)
