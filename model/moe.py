"""The Mixture-of-Experts MLP of a transformer block and its per-step bookkeeping.

``MoEMLP`` routes each token to ``k`` of ``E`` experts (``megazero/moe/router.py``: softmax or
sigmoid scores, aux / sequence-aux / z losses, DeepSeek-V3's aux-loss-free expert bias, capacity
drops), dispatches the tokens to the ranks holding their experts (``megazero/moe/dispatch.py``:
all-to-all or all-gather over the expert-parallel group) and combines the weighted outputs;
``ExpertMLP`` is one expert (the rank's experts run as one grouped product,
``torch._grouped_mm``, where ``grouped_mm_available`` says the device and shapes allow it). ``moe_step_end`` closes a
step: the routing statistics summed over dp x cp and
pp, and the expert-bias update from the global token counts. Under context parallelism every cp
rank routes the whole micro-batch (its router logits all-gathered over cp) and runs the experts
on its own tokens. ``model/gpt.py`` (the blocks) re-exports these names.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megazero import collectives as C
from megazero.context_parallel.zigzag import merge_from_ranks, split_for_rank
from megazero.moe.dispatch import DISPATCHERS, gather_rows, local_experts
from megazero.ops.activation import glu
from megazero.ops.fp8 import fp8_linear
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from model.config import GPTConfig


class _Linear(nn.Module):
    """The weight ``[out, in]`` (and bias) of one linear layer, applied by its owner with
    ``F.linear`` (an expert's partition; its tags come from the spec in ``GPTStage``)."""

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None


class ExpertMLP(nn.Module):
    """One expert (or the shared expert) of inner width ``ffn``: this rank's ``ffn/tp`` hidden
    units (a routed expert's ``ffn/etp`` under expert tensor parallelism, ``tp`` then being etp)
    of the block's MLP (GELU, or a gated unit with ``fc1 = [gate; up]``: SwiGLU, or gpt-oss's
    clamped quick GEGLU, ``megazero.ops.activation.glu``), as ``MLP`` partitions them. ``forward``
    returns the rank's *partial* sum of ``fc2`` (no reduction, no ``fc2`` bias): ``MoEMLP``
    reduces every expert's output in one all-reduce and adds the biases."""

    def __init__(self, cfg: GPTConfig, ffn: int, tp: int, device=None):
        super().__init__()
        H, local = cfg.hidden_size, ffn // tp
        self.gated, self.gelu_approximate = cfg.gated_linear_unit, "tanh" if cfg.openai_gelu else "none"
        self.glu_options, self.fp8 = cfg.glu_options, cfg.fp8
        self.fc1 = _Linear(2 * local if self.gated else local, H, cfg.add_bias_linear, cfg.params_dtype, device)
        self.fc2 = _Linear(H, local, cfg.add_bias_linear, cfg.params_dtype, device)

    @property
    def scales_per_call(self) -> bool:
        """Whether an output row depends on the call's other rows: under FP8 a tensorwise scale
        spans the call's tokens and the weight gradient quantises along them, so the expert-parallel
        dispatchers run it on each source micro-batch's rows apart (``dispatch.run_by_source``)."""
        return self.fp8 is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n, H]`` -> the partial ``fc2`` output ``[n, H]``; under FP8 (unsliced experts only:
        the config checks refuse FP8 experts under tp > 1) both GEMMs quantise with ``fp8_linear``,
        except on no rows, where there is no scale to take and the plain product gives the empty
        output and zero gradients."""
        if self.fp8 is not None and x.shape[0] > 0:
            h = fp8_linear(x, self.fc1.weight, self.fc1.bias, self.fp8)  # (n, F) or (n, 2F)
            return fp8_linear(self.activation(h), self.fc2.weight, None, self.fp8)  # (n, H)
        h = F.linear(x, self.fc1.weight, self.fc1.bias)  # (n, F/tp) or (n, 2F/tp)
        return F.linear(self.activation(h), self.fc2.weight)  # (n, H), partial over tp

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """``fc1``'s output ``[n, 2F/tp]`` (gated) or ``[n, F/tp]`` -> the ``fc2`` input ``[n, F/tp]``."""
        if self.gated:
            return glu(h, **self.glu_options)
        return F.gelu(h, approximate=self.gelu_approximate)

    @staticmethod
    def grouped_forward(experts: list, rows: torch.Tensor, sizes: list[int]) -> Optional[torch.Tensor]:
        """``forward`` of ``experts[j]`` on its ``sizes[j]`` consecutive rows of ``rows [S, H]``
        as two grouped GEMMs (``torch._grouped_mm``, the weights stacked ``[n, in, out]`` as
        transposed views, which gives the per-expert ``F.linear`` bitwise on CPU); None where
        it is not offered (see :func:`grouped_mm_available`; experts with biases: ``F.linear``
        adds them inside the GEMM; FP8 experts; widths whose fp32 rows are not 16-byte multiples),
        and the caller loops."""
        e0 = experts[0]
        align = 16 // rows.element_size()  # the kernel wants every row stride a multiple of 16 bytes
        if (
            e0.fc1.bias is not None
            or e0.fp8 is not None
            or not grouped_mm_available(rows)
            or any(d % align for d in (*e0.fc1.weight.shape, *e0.fc2.weight.shape))
        ):
            return None
        offs = group_offsets(sizes, rows.device)
        w1 = torch.stack([e.fc1.weight for e in experts]).transpose(1, 2)  # (n, H, F/tp or 2F/tp)
        h = e0.activation(torch._grouped_mm(rows, w1, offs=offs))  # (S, F/tp)
        w2 = torch.stack([e.fc2.weight for e in experts]).transpose(1, 2)  # (n, F/tp, H)
        return torch._grouped_mm(h, w2, offs=offs)  # (S, H), partial over tp


def group_offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    """The grouped GEMM's ``offs``: the running row ends of ``sizes`` ``[n]`` int32 on
    ``device``, copied from page-locked memory without blocking on CUDA (a plain
    ``torch.tensor(..., device=cuda)`` from a Python list copies from pageable memory, which
    waits for the device: a host sync per MoE layer)."""
    ends = torch.tensor(sizes, dtype=torch.int64, device="cpu").cumsum(0).to(torch.int32)
    if torch.device(device).type == "cuda":
        return ends.pin_memory().to(device, non_blocking=True)
    return ends.to(device)


_GROUPED_CHECKED: dict = {}  # (device, dtype) -> whether the grouped GEMM matched the loop there


def grouped_matches_loop(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` on ``device`` in ``dtype`` gives a per-expert ``F.linear``'s
    result, on a small fixed problem (4 experts of 5, 0, 11 and 16 rows, 64 -> 128, inputs
    rounded to ``dtype`` first): equal within one unit of ``dtype``'s rounding of the output
    (relative 2**-7 for bf16, the same products accumulated in another order), False when the
    kernel refuses the device (CUDA's wants sm90 or newer) or differs."""
    try:
        g = torch.Generator().manual_seed(0)
        sizes = [5, 0, 11, 16]
        rows = torch.randn(sum(sizes), 64, generator=g, device="cpu").to(device, dtype)
        w = torch.randn(len(sizes), 128, 64, generator=g, device="cpu").to(device, dtype)  # (n, out, in)
        got = torch._grouped_mm(rows, w.transpose(1, 2), offs=group_offsets(sizes, device)).float()
        want = torch.cat([F.linear(b, w[j]) for j, b in enumerate(rows.split(sizes))]).float()
    except (RuntimeError, NotImplementedError):
        return False
    tol = torch.finfo(dtype).eps
    return bool(((got - want).abs() <= tol * want.abs() + tol).all())


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether the experts run as grouped GEMMs on ``x``'s device and dtype: torch's
    ``_grouped_mm`` on CPU in fp32 (equal to the loop bitwise: tests/layouts/test_moe.py), and on
    CUDA in bf16 where ``grouped_matches_loop`` passes on that device (checked once per device;
    the kernel wants sm90 or newer). Elsewhere the experts loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return x.dtype == torch.float32
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    key = (str(x.device), x.dtype)
    if key not in _GROUPED_CHECKED:
        _GROUPED_CHECKED[key] = grouped_matches_loop(x.device, x.dtype)
    return _GROUPED_CHECKED[key]


class MoEMLP(nn.Module):
    """Mixture-of-Experts MLP of one layer: ``[B, T, H] -> [B, T, H]``.

    The router (``router.weight [E, H]`` and, with ``moe_router_linear_bias``, ``router.bias [E]``, both
    replicated over tp; fp32 logits by default) scores the micro-batch's ``B*T`` tokens;
    ``megazero.moe.router.route`` picks each token's k experts and weights, and with a capacity
    factor ``capacity_keep`` drops the assignments over capacity (dropped: that
    expert adds nothing to the token). Each expert runs on its assigned tokens (gather, expert
    MLP, scale by the weight, ``index_add`` back; an expert with no token runs on an empty
    batch so its gradients still arrive), the shared expert on all tokens; the partial sums
    over tp are all-reduced once, then the ``fc2`` biases are added weighted by the routing
    weights. The routing weights enter the expert path through ``copy_to_tp_region``, so their
    gradient (and the router's) is the full one on every tp rank.

    Training forwards (grad enabled) add the load-balancing loss (``aux_loss`` or
    ``seq_aux_loss`` of the pre-drop assignment) and the z-loss of this micro-batch through
    ``AuxLossBackward`` (its scale set by the trainer: ``Trainer._run``), accumulate the step's
    ``aux_sum`` / ``z_sum`` (for the log) and the pre-drop ``token_counts [E]`` (for the expert
    bias, ``update_expert_bias``). ``record``: when a list, ``(experts [N, k], keep [N, k] or
    None)`` of every training forward is appended (tests).

    Expert parallelism (``ep = (ep group, ep rank)`` with EP ranks): this rank holds the E/EP
    experts ``[ep_rank E/EP, (ep_rank+1) E/EP)``, keyed by their global index (``experts["5"]``,
    so names, initial values and checkpoints are those of EP = 1), and the assignments travel to
    their experts' ranks and back (``megazero.moe.dispatch``, ``cfg.moe_token_dispatcher_type``);
    routing, drops and losses stay on the rank that holds the tokens. The ``fc2`` biases of all
    E experts are all-gathered over ep for the bias term (their gradients reduce-scattered back).

    Expert tensor parallelism (``etp`` < tp, Megatron-LM's ``--expert-tensor-parallel-size``):
    every routed expert is sliced over etp ranks (``F/etp`` hidden units, the partition
    ``tp_rank % etp``) and each block of etp consecutive tp ranks runs them on its own range of
    the rows (``_token_share``), with or without sequence parallelism; the router, the shared
    expert (sliced over tp) and the reduction over tp stay as at etp = tp.

    Sequence parallelism (``sp``): input and output ``[B, T/tp, H]``; the router runs on the
    rank's positions, its logits and the tokens are all-gathered over tp (routing, drops and
    losses those of the whole micro-batch), the partial outputs reduce-scattered and the bias
    term added on the rank's positions (docs/design.md). Under full recomputation only the
    forward with autograd (the replay) counts and attaches the auxiliary losses.

    Context parallelism (``cp_group``, the layer's cp group; None at cp 1; a forward with
    ``cp_share``, i.e. of a sharded micro-batch, not a decoding step): the rank holds
    ``T/cp`` tokens of each sequence (zigzag chunks, megazero/context_parallel/zigzag.py). Its
    router logits are all-gathered over cp and put back in sequence order (``_gather_context``),
    so every cp rank routes the whole micro-batch: capacity, drops, aux / sequence-aux / z losses
    those of cp 1. The experts then run on the rank's own tokens only (``_context_rows``), and
    ``token_counts`` / ``dropped`` count those (summed over dp x cp in ``moe_step_end``);
    ``record`` holds the whole micro-batch's routing on every cp rank.
    """

    #: the forward reads the router's, the experts' and the shared expert's parameters itself
    #: (``F.linear``, grouped GEMMs, the fc2 biases) without calling those modules, so a forward
    #: pre-hook that must see them ready (``--overlap-param-gather``'s wait,
    #: megazero/data_parallel/param_gather.py) goes on this module, not on theirs.
    reads_descendant_parameters = True

    def __init__(
        self,
        cfg: GPTConfig,
        group,
        device=None,
        state_device=None,
        ep=None,
        sp: bool = False,
        cp_group=None,
        etp: Optional[int] = None,
    ):
        super().__init__()
        self.cfg, self.group, self.sp, self.cp_group, E = cfg, group, sp, cp_group, cfg.num_experts
        tp = C.group_size(group)
        self.etp = tp if etp is None else etp
        self.ep_group, self.ep_rank = (None, 0) if ep is None else ep
        local = E // C.group_size(self.ep_group)
        self.router = _Linear(E, cfg.hidden_size, cfg.moe_router_linear_bias, cfg.params_dtype, device)
        self.experts = nn.ModuleDict(
            {
                str(e): ExpertMLP(cfg, cfg.moe_ffn_hidden_size, self.etp, device)
                for e in range(self.ep_rank * local, (self.ep_rank + 1) * local)
            }
        )
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = None if shared is None else ExpertMLP(cfg, shared, tp, device)
        state_device = torch.device("cpu") if state_device is None else state_device
        self.expert_bias = torch.zeros(E, device=state_device) if cfg.moe_router_enable_expert_bias else None
        self.token_counts = torch.zeros(E, dtype=torch.int64, device=state_device)
        self.dropped = torch.zeros((), dtype=torch.int64, device=state_device)
        self.aux_sum = torch.zeros((), device=state_device)
        self.z_sum = torch.zeros((), device=state_device)
        self.record: Optional[list] = None

    def forward(self, x: torch.Tensor, cp_share: bool = False) -> torch.Tensor:
        """``[B, T, H] -> [B, T, H]``; with sequence parallelism ``[B, T/tp, H]`` in and out.
        ``cp_share``: ``T`` is this cp rank's ``T/cp`` tokens of each sequence (a forward of
        sharded micro-batches, where the block has a ``SequenceInfo``), routed over the whole
        sequences; False: whole sequences on every cp rank (decoding), routed here alone."""
        from megazero.moe import router as R
        from megazero.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region

        cfg, E, k = self.cfg, self.cfg.num_experts, self.cfg.moe_router_topk
        B, T, H = x.shape
        logits = R.router_logits(x, self.router.weight, cfg.moe_router_dtype, self.router.bias)  # (B, T(/tp), E)
        if self.sp:  # the router ran on this rank's T/tp positions; route the micro-batch's N
            logits, inp, T = self._gather_sequence(logits, x)
        else:
            inp = copy_to_tp_region(x, self.group)
        cp = self.cp_group if cp_share else None
        logits = self._gather_context(logits, cp)  # (B, T cp, E): the micro-batch's whole sequences
        S = logits.shape[1]  # the sequence length (T x cp)
        logits, inp = logits.reshape(B * S, E), inp.reshape(B * T, H)  # (B S, E), (N, H)
        routing = R.route(
            logits,
            k,
            cfg.moe_router_score_function,
            cfg.moe_router_pre_softmax,
            self.expert_bias,
            cfg.moe_router_num_groups,
            cfg.moe_router_group_topk,
            cfg.moe_router_topk_scaling_factor,
        )
        experts, weights, keep, capacity = routing.experts, routing.probs, None, None  # (B S, k)
        if cfg.moe_expert_capacity_factor is not None:
            capacity = R.expert_capacity(B * S, E, k, cfg.moe_expert_capacity_factor)
            keep = R.capacity_keep(routing.probs, experts, E, capacity, cfg.moe_token_drop_policy)
            weights = weights * keep
        weights = weights.to(x.dtype)
        assigned = experts if keep is None else experts.masked_fill(~keep, -1)
        weights, experts, assigned = (self._context_rows(t, B, cp) for t in (weights, experts, assigned))  # (N, k)
        routed = self._token_share(assigned)  # etp < tp: this etp block's share of the rows
        pad_to = capacity if cfg.moe_pad_expert_input_to_capacity else None
        out = self._routed(inp, copy_to_tp_region(weights, self.group), routed, pad_to)  # (N, H), partial over tp
        if self.shared_experts is not None:
            out = out + self.shared_experts(inp)
        if self.sp:
            out = reduce_scatter_to_sequence_parallel_region(out.view(B, T, H), self.group)  # (B, T/tp, H)
            weights, experts = (self._local_rows(t.view(B, T, k)) for t in (weights, experts))
        else:
            out = reduce_from_tp_region(out, self.group)  # (N, H)
        out = self._add_biases(out.reshape(-1, H), weights, experts)
        if self.training and torch.is_grad_enabled():  # under full recomputation: the replay only
            out = self._auxiliary_losses(out, logits, routing, S)
            with torch.no_grad():
                self.token_counts += R.assignment_counts(self._context_rows(routing.experts, B, cp), E)
                if keep is not None:
                    self.dropped += (~self._context_rows(keep, B, cp)).sum()
            if self.record is not None:
                self.record.append((routing.experts.detach().clone(), None if keep is None else keep.clone()))
        return out.view(x.shape)

    def _gather_sequence(self, logits: torch.Tensor, x: torch.Tensor):
        """Sequence parallelism: ``logits [B, T/tp, E]`` and ``x [B, T/tp, H]`` of this rank's
        positions -> the micro-batch's ``[B, T, E]`` (backward: this rank's rows of the gradient,
        which every tp rank computes whole) and ``[B, T, H]`` (backward: SUM reduce-scatter of
        the experts' partial gradients), and ``T``."""
        logits = gather_from_sequence_parallel_region(logits, self.group, grad_reduce_scatter=False)
        return logits, gather_from_sequence_parallel_region(x, self.group), logits.shape[1]

    @staticmethod
    def _gather_context(logits: torch.Tensor, cp_group) -> torch.Tensor:
        """Context parallelism: ``logits [B, T/cp, E]`` of this cp rank's zigzag chunks -> the
        micro-batch's ``[B, T, E]`` in sequence order, the same on every cp rank (an all-gather
        over cp). Backward: the SUM reduce-scatter. This rank's rows get the routing weights'
        gradient from this rank alone and the auxiliary losses' from every cp rank (each adds the
        micro-batch's losses whole), so cp times; the gradient mean over dp x cp then gives the
        gradient of cp 1. The identity without a ``cp_group``."""
        if cp_group is None:
            return logits
        cp = C.group_size(cp_group)
        rows = gather_rows(logits.transpose(0, 1), cp_group)  # (cp T/cp, B, E), cp-rank order
        return merge_from_ranks(rows.chunk(cp), 0, cp).transpose(0, 1)  # (B, T, E), sequence order

    @staticmethod
    def _context_rows(t: torch.Tensor, B: int, cp_group) -> torch.Tensor:
        """``[B T, ...]`` of the micro-batch's whole sequences (batch-major) -> this cp rank's
        zigzag chunks ``[B T/cp, ...]`` (autograd: the other rows' gradient is zero here); the
        identity without a ``cp_group``."""
        if cp_group is None:
            return t
        cp = C.group_size(cp_group)
        part = split_for_rank(t.view(B, -1, *t.shape[1:]), 1, C.group_rank(cp_group), cp)  # (B, T/cp, ...)
        return part.reshape(-1, *t.shape[1:])

    def _token_share(self, assigned: torch.Tensor) -> torch.Tensor:
        """Expert tensor parallelism (etp < tp): ``assigned [N, k]`` with every row outside this
        rank's share set to -1 (no expert). The tp group is ``tp / etp`` blocks of etp ranks
        (block ``tp_rank // etp``); block j runs the routed experts on the j-th of ``tp / etp``
        consecutive row ranges (``torch.tensor_split``), its etp ranks each on their slice of
        every expert, so the tp reduction that follows sums disjoint token ranges and, inside a
        range, the etp partial sums: the output of etp = tp. The experts' weight gradients then
        hold one range's tokens, and the tp / etp blocks' are summed by the expert-data-parallel
        reduction they are folded into (megazero/topology.py). The identity at etp = tp."""
        tp = C.group_size(self.group)
        if self.etp == tp:
            return assigned
        blocks, j = tp // self.etp, C.group_rank(self.group) // self.etp
        rows = torch.arange(assigned.shape[0], device=assigned.device)
        mine = torch.zeros_like(rows, dtype=torch.bool)
        mine[rows.tensor_split(blocks)[j]] = True
        return assigned.masked_fill(~mine[:, None], -1)

    def _local_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> this tp rank's sequence chunk ``[B T/tp, ...]`` (no autograd hook:
        the gradient of the other rows is zero here and comes from their own rank)."""
        n = t.shape[1] // C.group_size(self.group)
        r = C.group_rank(self.group)
        return t[:, r * n : (r + 1) * n].reshape(-1, t.shape[-1])

    def _add_biases(self, out: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``out [n, H]`` plus the fc2 biases of each token's experts weighted by its routing
        weights ``[n, k]`` (``experts [n, k]``), and the shared expert's."""
        if not self.cfg.add_bias_linear:
            return out
        b2 = torch.stack([ex.fc2.bias for ex in self.experts.values()])  # (E/EP, H)
        if self.ep_group is not None:
            b2 = gather_rows(b2, self.ep_group)  # (E, H)
        out = out + (weights[..., None] * b2[experts]).sum(1)
        if self.shared_experts is not None:
            out = out + self.shared_experts.fc2.bias
        return out

    def _routed(self, inp: torch.Tensor, w_tp: torch.Tensor, assigned: torch.Tensor, pad_to=None) -> torch.Tensor:
        """The routing-weighted sum of each token's kept experts, ``(N, H)`` partial over tp:
        every expert here on its tokens (``dispatch.local_experts``: gather, expert MLP, scale,
        ``index_add`` in expert order), or through the ep group's dispatcher. ``pad_to``: each expert's capacity
        (``--moe-pad-expert-input-to-capacity``, ``dispatch.run_expert``)."""
        if self.ep_group is not None:
            dispatch = DISPATCHERS[self.cfg.moe_token_dispatcher_type]
            return dispatch(
                inp, w_tp, assigned, self.experts_by_index, self.cfg.num_experts, self.ep_group, self.ep_rank, pad_to
            )
        return local_experts(inp, w_tp, assigned, self.experts_by_index, pad_to)

    @property
    def experts_by_index(self) -> dict:
        """This rank's experts by global index."""
        return {int(name): ex for name, ex in self.experts.items()}

    def _auxiliary_losses(self, out: torch.Tensor, logits: torch.Tensor, routing, seq_length: int) -> torch.Tensor:
        """``out`` carrying this micro-batch's load-balancing and z-loss into the backward."""
        from megazero.moe import router as R

        cfg, k, total = self.cfg, self.cfg.moe_router_topk, None
        if cfg.moe_router_load_balancing_type != "none" and cfg.moe_aux_loss_coeff > 0:
            if cfg.moe_router_load_balancing_type == "aux_loss":
                aux = R.aux_loss(routing.scores, routing.experts, k, cfg.moe_aux_loss_coeff)
            else:
                aux = R.seq_aux_loss(routing.scores, routing.experts, k, seq_length, cfg.moe_aux_loss_coeff)
            self.aux_sum += aux.detach()
            total = aux
        if cfg.moe_z_loss_coeff:
            z = R.z_loss(logits, cfg.moe_z_loss_coeff)
            self.z_sum += z.detach()
            total = z if total is None else total + z
        return out if total is None else R.AuxLossBackward.apply(out, total)

    @torch.no_grad()
    def update_expert_bias(self, dp_group) -> None:
        """End of a step: sum the step's token counts over ``dp_group`` (the ranks that share
        this router and see other tokens), apply ``router.expert_bias_update`` (every dp rank
        then holds the same bias) and start the next step's counts and losses from zero."""
        from megazero.moe import router as R

        if self.expert_bias is not None:
            counts = self.token_counts.clone()
            C.all_reduce_sum(counts, dp_group)
            self.expert_bias.copy_(R.expert_bias_update(self.expert_bias, counts, self.cfg.moe_router_bias_update_rate))
        self.token_counts.zero_()
        self.dropped.zero_()
        self.aux_sum.zero_()
        self.z_sum.zero_()


def moe_step_end(chunks: Iterable[nn.Module], groups: ProcessGroups, dp_group, num_microbatches: int) -> dict:
    """After a training step, on every rank (collective over ``dp_group`` and the pp group):
    the step's MoE statistics for the log and the expert-bias update.

    One table ``[L, E + 3]`` fp64 (L = the model's MoE layers, every stage filling in its own
    rows): per layer the pre-drop tokens per expert, the dropped assignments, and the
    coefficient-weighted aux and z-loss sums over the rank's micro-batches; SUM over
    ``dp_group`` (the replicas that see other tokens; tp ranks hold the same values) then over
    pp, so every rank, the logging last stage included, holds the whole model's. Returns
    ``{"moe_aux_loss", "moe_z_loss"}``: the losses summed over the layers and averaged over the
    micro-batches and dp ranks (what the step added to the training loss), and ``"moe_layers"``:
    ``{layer id: {"tokens_per_expert": [E ints], "dropped": int, "assignments": int (N k per
    micro-batch, summed), "aux_loss": float, "z_loss": float}}`` (losses: that layer's mean over
    the micro-batches). Then each layer's bias takes its update from the step's token counts
    summed over ``dp_group`` (``MoEMLP.update_expert_bias``)."""
    held = {int(i): b.mlp for c in chunks for i, b in c.layers.items() if isinstance(b.mlp, MoEMLP)}
    cfg = next(iter(chunks)).cfg
    E, ids = cfg.num_experts, [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    table = torch.zeros(len(ids), E + 3, dtype=torch.float64, device=next(iter(chunks)).device)
    for i, m in held.items():
        row = table[ids.index(i)]
        row[:E] = m.token_counts
        row[E], row[E + 1], row[E + 2] = m.dropped, m.aux_sum, m.z_sum
    C.all_reduce_sum(table, dp_group)
    if groups.pp_size > 1:
        C.all_reduce_sum(table, groups.pp)
    table[:, E + 1 :] /= C.group_size(dp_group) * num_microbatches
    for m in held.values():
        m.update_expert_bias(dp_group)
    rows = table.tolist()  # one host transfer per step
    layers = {
        i: {
            "tokens_per_expert": [int(v) for v in r[:E]],
            "dropped": int(r[E]),
            "assignments": int(sum(r[:E])),
            "aux_loss": r[E + 1],
            "z_loss": r[E + 2],
        }
        for i, r in zip(ids, rows)
    }
    return {
        "moe_aux_loss": sum(r[E + 1] for r in rows),
        "moe_z_loss": sum(r[E + 2] for r in rows),
        "moe_layers": layers,
    }
