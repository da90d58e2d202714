"""GPT-2-style or LLaMA-style decoder built from megazero's tensor-parallel layers.

The model (Radford et al. 2019; nanoGPT's layout) is: word + learned position embedding,
``num_layers`` pre-LayerNorm blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``, a final
LayerNorm and an output layer tied to the word embedding (or its own ``output.weight``).
The LLaMA-style options (Touvron et al. 2023) swap parts of the same structure: rotary
positions inside attention instead of the table (model/rope.py), RMSNorm, a SwiGLU MLP,
grouped-query attention, linears without bias; ``model/spec.py`` lists the parameters
each choice has, and the stage takes its partition tags from that list.
Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019, sec. 3): the fused QKV and
``fc1`` are column-parallel (each rank holds whole heads / ``F/tp`` hidden units), ``proj``
and ``fc2`` are row-parallel, the word embedding and logits are split by vocabulary rows and
the loss is computed without gathering the logits. With sequence parallelism (Korthikanti
et al. 2022) the LayerNorm / dropout / residual activations are ``[B, T/tp, H]``.

Dropout draws from an ``RNGTracker``: the embedding and residual dropouts act on a
replicated region (same mask on every TP rank, the ``"replicated"`` stream), or, with
sequence parallelism, on different token chunks (the ``"tp"`` stream); attention dropout acts
on this rank's heads (``"tp"`` stream). ``scaled_dot_product_attention`` draws its dropout
from the global generator, so it runs inside ``tracker.fork("tp")``, which swaps the tp
stream in for the call.

Initialisation is layout independent (docs/design.md, contract 1): every full tensor comes
from (seed, canonical name) alone (``model.spec.InitialWeights``) and a stage keeps its
partitions, made one full tensor at a time (model/materialize.py).

Context parallelism and packed documents (megazero/context_parallel): a micro-batch may come
with a ``SequenceInfo`` (``seq``): the rank then holds ``T/cp`` tokens of each sequence (two
zigzag chunks), positions come from ``seq.position_ids``, and attention runs across the cp
ranks (ring or all-to-all) and inside documents (``seq.segment_ids``). Without ``seq`` the
model is exactly the single-sequence one (positions 0..T-1, causal SDPA).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from megazero import collectives as C
from megazero.context_parallel.attention import all_to_all_attention, local_attention, ring_attention
from megazero.context_parallel.sequence import SequenceInfo
from megazero.moe.dispatch import DISPATCHERS, gather_rows, local_experts
from megazero.ops.norm import LayerNorm, RMSNorm
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel import tags
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                             VocabParallelEmbedding, parallel_lm_logits)
from megazero.tensor_parallel.mappings import (gather_from_sequence_parallel_region, gather_from_tp_region,
                                               reduce_scatter_to_sequence_parallel_region)
from megazero.tensor_parallel.random import RNGTracker, dropout
from megazero.tensor_parallel.recompute import recompute
from model.config import GPTConfig
from model.materialize import VOCAB_TENSORS, local_partition, resize_vocab, use_placeholders  # noqa: F401
from model.rope import RotaryTable, apply_rotary
from model.spec import InitialWeights, canonical_shapes, init_full_weights, spec_by_name  # noqa: F401 (re-export)


# SDPA expands the key/value heads itself (``enable_gqa``, torch >= 2.5): no repeated K/V tensors
SDPA_GQA = torch.__version__ >= (2, 5)


class Embedding(nn.Module):
    """Vocabulary-parallel word embedding plus learned positions (replicated over TP).

    tokens ``[B, T]`` -> ``[B, T, H]`` (``[B, T/tp, H]`` with sequence parallelism: the word
    lookup is reduce-scattered along the sequence and this chunk's positions are added, so
    the position-embedding gradient is partial per rank and tagged ``sequence_parallel``).
    With ``with_positions=False`` it holds only the word embedding (the last stage's copy
    of a tied weight, or a first stage with rotary positions).
    """

    def __init__(self, cfg: GPTConfig, group, sp: bool, with_positions: bool, device=None):
        super().__init__()
        self.group, self.sp = group, sp
        self.word_embeddings = VocabParallelEmbedding(
            cfg.padded_vocab(C.group_size(group)), cfg.hidden_size, group,
            dtype=cfg.params_dtype, device=device, sequence_parallel=sp)
        if with_positions:
            # _weight: start from zeros (load_full_weights fills it) without drawing from
            # torch's global generator, which nn.Embedding's own init would advance
            zeros = torch.zeros(cfg.max_position_embeddings, cfg.hidden_size,
                                dtype=cfg.params_dtype, device=device)
            self.position_embeddings = nn.Embedding(*zeros.shape, _weight=zeros)
        self.with_positions = with_positions

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``position_ids [B, T]`` of the tokens (default ``0..T-1``); with sequence
        parallelism this rank adds those of its ``T/tp`` chunk."""
        x = self.word_embeddings(tokens)                             # (B, T or T/tp, H)
        if not self.with_positions:  # RoPE: positions enter in attention
            return x
        start = C.group_rank(self.group) * x.shape[1] if self.sp else 0
        if position_ids is None:
            positions = torch.arange(start, start + x.shape[1], device=tokens.device)
        else:
            positions = position_ids[:, start:start + x.shape[1]]   # (B, T or T/tp)
        return x + self.position_embeddings(positions)


class Attention(nn.Module):
    """Causal self-attention over this rank's ``n_head/tp`` heads.

    ``[B, T(/tp), H] -> [B, T(/tp), H]``. Multi-head: the QKV weight is column-parallel with
    stride 3 over the canonical ``[q; k; v]`` rows, so each rank holds q, k and v of whole
    heads. Grouped-query (``num_query_groups`` G, Ainslie et al. 2023): the rows are G blocks
    ``[q of heads/G heads; k; v]`` and each rank holds ``G/tp`` whole groups (model/spec.py);
    each key/value head serves the ``heads/G`` query heads of its group. With
    ``position_embedding_type == "rope"`` q and k are rotated by the stage's ``rope`` table
    (model/rope.py; made here when not given).
    """

    def __init__(self, cfg: GPTConfig, group, sp: bool, tracker: RNGTracker, device=None, cp=None,
                 rope: Optional[RotaryTable] = None):
        super().__init__()
        H, tp = cfg.hidden_size, C.group_size(group)
        self.cp = cp  # (cp group, its global ranks in cp order) or None
        self.cp_comm_type = cfg.cp_comm_type
        self.heads_local, self.head_dim = cfg.num_attention_heads // tp, cfg.head_dim
        self.grouped = cfg.num_query_groups is not None
        self.groups_local = cfg.kv_heads // tp
        self.q_per_group = cfg.num_attention_heads // cfg.kv_heads
        self.rotary = (cfg.rotary_dim, cfg.rotary_base) if cfg.position_embedding_type == "rope" else None
        if self.rotary is not None and rope is None:
            rope = RotaryTable.for_model(cfg, device)
        self.rope = rope
        self.dropout_p, self.tracker = cfg.attention_dropout, tracker
        self.recompute_core = cfg.recompute_granularity == "selective"
        rows = (cfg.num_attention_heads + 2 * cfg.kv_heads) * cfg.head_dim if self.grouped else 3 * H
        self.qkv = ColumnParallelLinear(H, rows, group, sequence_parallel=sp,
                                        stride=1 if self.grouped else 3, bias=cfg.add_bias_linear,
                                        dtype=cfg.params_dtype, device=device,
                                        overlap_grad_reduce=cfg.tp_overlap_grad_reduce)
        self.proj = RowParallelLinear(H, H, group, input_is_parallel=True, bias=cfg.add_bias_linear,
                                      sequence_parallel=sp, dtype=cfg.params_dtype,
                                      device=device)

    def _split_heads(self, qkv: torch.Tensor):
        """``(B, T, rows/tp)`` -> q ``(B, n_head/tp, T, d)``, k and v ``(B, kv_heads/tp, T, d)``."""
        if not self.grouped:  # rows [q; k; v], each of h = n_head/tp whole heads
            q, k, v = rearrange(qkv, "b t (qkv h d) -> qkv b h t d", qkv=3, d=self.head_dim)
            return q, k, v
        # rows: g = G/tp blocks [q of heads/G heads; k; v], so r = heads/G + 2 heads a block
        qkv = rearrange(qkv, "b t (g r d) -> b g r t d", g=self.groups_local, d=self.head_dim)
        q = rearrange(qkv[:, :, :self.q_per_group], "b g r t d -> b (g r) t d")  # group-major heads
        return q, qkv[:, :, -2], qkv[:, :, -1]                   # k, v: (B, G/tp, T, d)

    def forward(self, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
        q, k, v = self._split_heads(self.qkv(x))            # (B, heads/tp or G/tp, T, d)
        T = q.shape[2]
        if self.rotary is not None:
            if seq is None:
                cos, sin = self.rope.first(T, q.dtype)                           # (T, rot)
            else:  # this rank's positions: zigzag chunks, or restarting per document
                cos, sin = self.rope.at(seq.position_ids, q.dtype)               # (B, 1, T, rot)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if seq is not None:  # K/V stay query groups: the ring sends G/tp heads, not heads/tp
            core = functools.partial(self._context_core, seq=seq)
            y = recompute(core, self.tracker, q, k, v) if self.recompute_core else core(q, k, v)
            return self.proj(rearrange(y, "b h t d -> b t (h d)"))
        if self.q_per_group > 1 and not SDPA_GQA:  # each key/value head serves its group's query heads
            k, v = (t.repeat_interleave(self.q_per_group, dim=1) for t in (k, v))  # (B, heads/tp, T, d)
        if self.recompute_core:  # selective recomputation: keep q, k, v only
            y = recompute(self._core, self.tracker, q, k, v)
        else:
            y = self._core(q, k, v)
        y = rearrange(y, "b h t d -> b t (h d)")                   # (B, T, n_head/tp * d = H/tp)
        return self.proj(y)

    def _context_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      seq: SequenceInfo) -> torch.Tensor:
        """Causal attention of this rank's ``T/cp`` queries over the whole sequence, inside
        documents when ``seq.segment_ids`` is set: q ``(B, heads/tp, T/cp, d)``, k and v
        ``(B, G/tp, T/cp, d)`` -> ``(B, heads/tp, T/cp, d)``. No attention dropout (the
        config refuses it with cp > 1; with packed documents alone it is applied nowhere either,
        so it is refused there too)."""
        if self.cp is None:
            return local_attention(q, k, v, token_index=seq.token_index, segment_ids=seq.segment_ids)
        group, ranks = self.cp
        if self.cp_comm_type == "a2a":
            return all_to_all_attention(q, k, v, group=group, token_index=seq.token_index,
                                        segment_ids=seq.segment_ids)
        return ring_attention(q, k, v, group=group, cp_ranks=ranks, token_index=seq.token_index,
                              segment_ids=seq.segment_ids)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal mask), dropout, times v: (B, n_head/tp, T, head_dim).

        k and v have ``G/tp`` heads under grouped-query attention when SDPA expands them itself
        (``SDPA_GQA``): query head h reads key/value head ``h // (heads/G)``, as
        ``repeat_interleave`` would give, with the same forward values (its K/V gradients sum
        the group's heads in another order: equal to rounding, tests/test_model_build.py)."""
        p = self.dropout_p if self.training else 0.0
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        if p > 0:
            with self.tracker.fork("tp"):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, **gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with exact (erf) GELU (tanh-approximated with ``openai_gelu``), or with ``swiglu``
    ``fc2(silu(gate) * up)`` where ``fc1`` gives ``[gate; up]`` (Shazeer 2020, "GLU Variants
    Improve Transformer", eq. 6; stride 2, so each rank holds F/tp of each); fc1 column-,
    fc2 row-parallel."""

    def __init__(self, cfg: GPTConfig, group, sp: bool, device=None):
        super().__init__()
        H, F_ = cfg.hidden_size, cfg.ffn_hidden_size
        self.swiglu = cfg.swiglu
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"   # torch's two GELUs
        self.fc1 = ColumnParallelLinear(H, 2 * F_ if self.swiglu else F_, group, sequence_parallel=sp,
                                        stride=2 if self.swiglu else 1, bias=cfg.add_bias_linear,
                                        dtype=cfg.params_dtype, device=device,
                                        overlap_grad_reduce=cfg.tp_overlap_grad_reduce)
        self.fc2 = RowParallelLinear(F_, H, group, input_is_parallel=True, bias=cfg.add_bias_linear,
                                     sequence_parallel=sp, dtype=cfg.params_dtype,
                                     device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)                                     # (B, T, F/tp), or (B, T, 2F/tp)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)                   # (B, T, F/tp) each
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(h, approximate=self.gelu_approximate))


class _Linear(nn.Module):
    """The weight ``[out, in]`` (and bias) of one linear layer, applied by its owner with
    ``F.linear`` (an expert's partition; its tags come from the spec in ``GPTStage``)."""

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None


class ExpertMLP(nn.Module):
    """One expert (or the shared expert) of inner width ``ffn``: this rank's ``ffn/tp`` hidden
    units of the block's MLP (GELU, or SwiGLU with ``fc1 = [gate; up]``), as ``MLP`` partitions
    them. ``forward`` returns the rank's *partial* sum of ``fc2`` (no reduction, no ``fc2``
    bias): ``MoEMLP`` reduces every expert's output in one all-reduce and adds the biases."""

    def __init__(self, cfg: GPTConfig, ffn: int, tp: int, device=None):
        super().__init__()
        H, local = cfg.hidden_size, ffn // tp
        self.swiglu, self.gelu_approximate = cfg.swiglu, "tanh" if cfg.openai_gelu else "none"
        self.fc1 = _Linear(2 * local if cfg.swiglu else local, H, cfg.add_bias_linear, cfg.params_dtype, device)
        self.fc2 = _Linear(H, local, cfg.add_bias_linear, cfg.params_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.fc1.weight, self.fc1.bias)           # (n, F/tp) or (n, 2F/tp)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return F.linear(h, self.fc2.weight)                       # (n, H), partial over tp

    @staticmethod
    def grouped_forward(experts: list, rows: torch.Tensor, sizes: list[int]) -> Optional[torch.Tensor]:
        """``forward`` of ``experts[j]`` on its ``sizes[j]`` consecutive rows of ``rows [S, H]``
        as two grouped GEMMs (``torch._grouped_mm``, the weights stacked ``[n, in, out]`` as
        transposed views, which gives the per-expert ``F.linear`` bitwise on CPU); None where
        it is not offered (see :func:`grouped_mm_available`; experts with biases: ``F.linear``
        adds them inside the GEMM; widths whose fp32 rows are not 16-byte multiples), and the
        caller loops."""
        e0 = experts[0]
        align = 16 // rows.element_size()   # the kernel wants every row stride a multiple of 16 bytes
        if (e0.fc1.bias is not None or not grouped_mm_available(rows)
                or any(d % align for d in (*e0.fc1.weight.shape, *e0.fc2.weight.shape))):
            return None
        offs = torch.tensor(sizes, device=rows.device).cumsum(0).to(torch.int32)
        w1 = torch.stack([e.fc1.weight for e in experts]).transpose(1, 2)      # (n, H, F/tp or 2F/tp)
        h = torch._grouped_mm(rows, w1, offs=offs)
        if e0.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=e0.gelu_approximate)
        w2 = torch.stack([e.fc2.weight for e in experts]).transpose(1, 2)      # (n, F/tp, H)
        return torch._grouped_mm(h, w2, offs=offs)                             # (S, H), partial over tp


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether the experts run as grouped GEMMs on ``x``'s device and dtype: torch's
    ``_grouped_mm`` on CPU in fp32 (checked equal to the loop, tests/test_moe_ep.py). Other
    devices and dtypes loop until checked there (CUDA's kernel wants bf16 on sm90+)."""
    return hasattr(torch, "_grouped_mm") and x.device.type == "cpu" and x.dtype == torch.float32


class MoEMLP(nn.Module):
    """Mixture-of-Experts MLP of one layer (issue 22): ``[B, T, H] -> [B, T, H]``.

    The router (``router.weight [E, H]``, replicated over tp) scores the micro-batch's ``B*T``
    tokens; ``megazero.moe.router.route`` picks each token's k experts and weights, and with a
    capacity factor ``capacity_keep`` drops the assignments over capacity (dropped: that
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

    Sequence parallelism (``sp``): input and output ``[B, T/tp, H]``; the router runs on the
    rank's positions, its logits and the tokens are all-gathered over tp (routing, drops and
    losses those of the whole micro-batch), the partial outputs reduce-scattered and the bias
    term added on the rank's positions (docs/design.md). Under full recomputation only the
    forward with autograd (the replay) counts and attaches the auxiliary losses.
    """

    def __init__(self, cfg: GPTConfig, group, device=None, state_device=None, ep=None, sp: bool = False):
        super().__init__()
        self.cfg, self.group, self.sp, E = cfg, group, sp, cfg.num_experts
        tp = C.group_size(group)
        self.ep_group, self.ep_rank = (None, 0) if ep is None else ep
        local = E // C.group_size(self.ep_group)
        self.router = _Linear(E, cfg.hidden_size, False, cfg.params_dtype, device)
        self.experts = nn.ModuleDict({str(e): ExpertMLP(cfg, cfg.moe_ffn_hidden_size, tp, device)
                                      for e in range(self.ep_rank * local, (self.ep_rank + 1) * local)})
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = None if shared is None else ExpertMLP(cfg, shared, tp, device)
        state_device = torch.device("cpu") if state_device is None else state_device
        self.expert_bias = (torch.zeros(E, device=state_device) if cfg.moe_router_enable_expert_bias else None)
        self.token_counts = torch.zeros(E, dtype=torch.int64, device=state_device)
        self.dropped = torch.zeros((), dtype=torch.int64, device=state_device)
        self.aux_sum = torch.zeros((), device=state_device)
        self.z_sum = torch.zeros((), device=state_device)
        self.record: Optional[list] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H] -> [B, T, H]``; with sequence parallelism ``[B, T/tp, H]`` in and out."""
        from megazero.moe import router as R
        from megazero.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region

        cfg, E, k = self.cfg, self.cfg.num_experts, self.cfg.moe_router_topk
        B, T, H = x.shape
        logits = F.linear(x, self.router.weight)                                      # (B, T(/tp), E)
        if self.sp:   # the router ran on this rank's T/tp positions; route the micro-batch's N
            logits, inp, T = self._gather_sequence(logits, x)
        else:
            inp = copy_to_tp_region(x, self.group)
        logits, inp = logits.reshape(B * T, E), inp.reshape(B * T, H)                 # (N, E), (N, H)
        routing = R.route(logits, k, cfg.moe_router_score_function, cfg.moe_router_pre_softmax,
                          self.expert_bias)
        experts, weights, keep = routing.experts, routing.probs, None                 # (N, k)
        if cfg.moe_expert_capacity_factor is not None:
            capacity = R.expert_capacity(B * T, E, k, cfg.moe_expert_capacity_factor)
            keep = R.capacity_keep(routing.probs, experts, E, capacity, cfg.moe_token_drop_policy)
            weights = weights * keep
        weights = weights.to(x.dtype)
        assigned = experts if keep is None else experts.masked_fill(~keep, -1)
        pad_to = capacity if cfg.moe_pad_expert_input_to_capacity else None
        out = self._routed(inp, copy_to_tp_region(weights, self.group), assigned, pad_to)  # (N, H), partial over tp
        if self.shared_experts is not None:
            out = out + self.shared_experts(inp)
        if self.sp:
            out = reduce_scatter_to_sequence_parallel_region(out.view(B, T, H), self.group)  # (B, T/tp, H)
            weights, experts = (self._local_rows(t.view(B, T, k)) for t in (weights, experts))
        else:
            out = reduce_from_tp_region(out, self.group)                             # (N, H)
        out = self._add_biases(out.reshape(-1, H), weights, experts)
        if self.training and torch.is_grad_enabled():   # under full recomputation: the replay only
            out = self._auxiliary_losses(out, logits, routing, T)
            with torch.no_grad():
                self.token_counts += R.assignment_counts(routing.experts, E)
                if keep is not None:
                    self.dropped += keep.numel() - keep.sum()
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

    def _local_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> this tp rank's sequence chunk ``[B T/tp, ...]`` (no autograd hook:
        the gradient of the other rows is zero here and comes from their own rank)."""
        n = t.shape[1] // C.group_size(self.group)
        r = C.group_rank(self.group)
        return t[:, r * n:(r + 1) * n].reshape(-1, t.shape[-1])

    def _add_biases(self, out: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``out [n, H]`` plus the fc2 biases of each token's experts weighted by its routing
        weights ``[n, k]`` (``experts [n, k]``), and the shared expert's."""
        if not self.cfg.add_bias_linear:
            return out
        b2 = torch.stack([ex.fc2.bias for ex in self.experts.values()])              # (E/EP, H)
        if self.ep_group is not None:
            b2 = gather_rows(b2, self.ep_group)                                      # (E, H)
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
            return dispatch(inp, w_tp, assigned, self.experts_by_index, self.cfg.num_experts, self.ep_group,
                            self.ep_rank, pad_to)
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


class Block(nn.Module):
    """Pre-norm transformer block with residual dropout (``hidden_dropout``); its MLP is an
    ``MoEMLP`` when ``moe`` (``state_device``: where the MoE's counters and expert bias live;
    ``ep``: its (expert-parallel group, ep rank), None without expert parallelism)."""

    def __init__(self, cfg: GPTConfig, group, sp: bool, tracker: RNGTracker, device=None, cp=None,
                 rope: Optional[RotaryTable] = None, moe: bool = False, state_device=None, ep=None):
        super().__init__()
        self.ln1 = _norm(cfg, device)
        self.attn = Attention(cfg, group, sp, tracker, device, cp, rope)
        self.ln2 = _norm(cfg, device)
        self.mlp = MoEMLP(cfg, group, device, state_device, ep, sp) if moe else MLP(cfg, group, sp, device)
        self.tracker, self.p = tracker, cfg.hidden_dropout
        self.region = "tp" if sp else "replicated"

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.tracker.generator(self.region), self.training)

    def forward(self, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln1(x), seq))
        return x + self._drop(self.mlp(self.ln2(x)))


def _norm(cfg: GPTConfig, device) -> nn.Module:
    """``cfg.normalization`` over H (tags come from the spec in ``GPTStage``)."""
    norm = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return norm(cfg.hidden_size, eps=cfg.layernorm_epsilon, backend=cfg.norm_backend,
                dtype=cfg.params_dtype, device=device)


class GPTStage(nn.Module):
    """One pipeline model chunk of the GPT: optional embedding, some blocks, optional head.

    Args:
        cfg: model sizes; validated against the TP size (ValueError names the setting).
        groups: this rank's ProcessGroups; ``groups.tp`` partitions the layers.
        layer_ids: global ids of the blocks held here (``layers.{id}.*`` parameter names).
        pre_process: holds the embedding (first chunk of the first stage).
        post_process: holds the final LayerNorm and the output layer (last chunk).
        seed: initialisation seed (``init_full_weights``); the dropout tracker, unless
            given, is seeded with ``seed + 100 * pp_rank`` (Megatron's convention).
        full_weights: canonical full tensors to slice instead of ``InitialWeights(cfg, seed,
            tp)`` (a mapping; a lazy one, e.g. ``model.hf.CanonicalView``, is read one tensor
            at a time).
        rng_tracker: share one tracker between the chunks of an interleaved schedule.
        device: where the parameters live and the dropout masks are drawn (default CPU);
            build the stage on its device rather than moving it, since the tracker's
            generators stay on the device they were made for.
        materialize: give the parameters their initial values now (``materialize()``), one
            at a time. False: they stay placeholders holding no memory (NaN when read) until
            whoever owns their storage fills them from ``initial_partition`` -- ZeRO-3's
            ``DataParallel(initial_values=...)``, which writes each straight into its shard.

    With tied embeddings a last stage that is not also the first keeps its own copy of the
    word-embedding partition (same name, same initial value); when ``pp_size > 1`` both
    copies are tagged ``shared_embedding`` (counted in norms on the first stage only) and
    the trainer sums their gradients over the embedding group.
    """

    def __init__(self, cfg: GPTConfig, groups: ProcessGroups, layer_ids: Iterable[int],
                 pre_process: bool, post_process: bool, seed: int, *,
                 full_weights: Optional[Mapping[str, torch.Tensor]] = None,
                 rng_tracker: Optional[RNGTracker] = None, device=None, materialize: bool = True):
        super().__init__()
        cfg.validate(groups.tp_size)
        self.cfg, self.groups, self.tp = cfg, groups, groups.tp
        self.layer_ids = list(layer_ids)
        self.pre_process, self.post_process = pre_process, post_process
        self.padded_vocab = cfg.padded_vocab(groups.tp_size)
        self.sp = cfg.sequence_parallel and groups.tp_size > 1
        self.device = torch.device(device if device is not None else "cpu")
        self.rng_tracker = rng_tracker or RNGTracker(seed + 100 * groups.pp_rank,
                                                     groups.tp_rank, self.device)
        self._build_modules(cfg, groups)
        use_placeholders(self, self.device)
        self._tag_from_spec()
        if groups.pp_size > 1 and cfg.tie_embeddings and (pre_process or post_process):
            tags.set_shared_embedding(self.embedding.word_embeddings.weight,
                                      counted_here=pre_process)
        self._initial = InitialWeights(cfg, seed, groups.tp_size) if full_weights is None else full_weights
        self.materialized = False
        if materialize:
            self.materialize()

    def _build_modules(self, cfg: GPTConfig, groups: ProcessGroups) -> None:
        """The embedding, blocks and head on the meta device (no memory; ``use_placeholders``
        moves them to ``self.device``), sharing one rotary table made on the device."""
        meta, pre, post = "meta", self.pre_process, self.post_process
        if pre or (post and cfg.tie_embeddings):
            with_positions = pre and cfg.position_embedding_type == "learned_absolute"
            self.embedding = Embedding(cfg, self.tp, self.sp, with_positions, meta)
        cp = (groups.cp, groups.cp_ranks) if groups.cp_size > 1 else None
        rope = RotaryTable.for_model(cfg, self.device) if cfg.position_embedding_type == "rope" else None
        ep = (groups.ep, groups.ep_rank) if groups.ep_size > 1 else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, self.tp, self.sp, self.rng_tracker, meta, cp, rope,
                                                   moe=cfg.is_moe_layer(i), state_device=self.device, ep=ep)
                                     for i in self.layer_ids})
        if post:
            self.final_ln = _norm(cfg, meta)
            if not cfg.tie_embeddings:
                self.output = ColumnParallelLinear(
                    cfg.hidden_size, self.padded_vocab, self.tp, bias=False,
                    sequence_parallel=self.sp, dtype=cfg.params_dtype, device=meta,
                    overlap_grad_reduce=cfg.tp_overlap_grad_reduce)

    def _tag_from_spec(self) -> None:
        """Partition tags of every parameter from its spec entry (model/spec.py); a parameter
        the spec does not declare, or whose partition shape disagrees, is a ValueError."""
        spec, tp = spec_by_name(self.cfg, self.padded_vocab), self.groups.tp_size
        for name, p in self.named_parameters():
            e = spec.get(name)
            if e is None:
                raise ValueError(f"parameter {name!r} is not declared in model/spec.py")
            local = list(e.shape)
            if e.partition_dim is not None:
                local[e.partition_dim] //= tp
                tags.set_partitioned(p, e.partition_dim, e.partition_stride)
            else:
                tags.set_replicated(p, sequence_parallel=self.sp)
            if self.groups.ep_size > 1 and ".mlp.experts." in name:
                tags.set_expert_parallel(p)
            tags.set_weight_decay(p, e.weight_decay)
            if tuple(local) != tuple(p.shape):
                raise ValueError(f"{name}: spec gives a partition of shape {tuple(local)}, the "
                                 f"module holds {tuple(p.shape)}")

    def _partition(self, name: str, full: Mapping) -> torch.Tensor:
        g = self.groups
        return local_partition(name, self.get_parameter(name), full, g.tp_rank, g.tp_size,
                               self.cfg.vocab_size, self.padded_vocab)

    @torch.no_grad()
    def initial_partition(self, name: str) -> torch.Tensor:
        """This rank's partition of parameter ``name``'s initial value: a new tensor of the
        parameter's shape and dtype on ``self.device``, cut from its full tensor alone (made by
        ``InitialWeights`` or read from ``full_weights``), which is dropped on return. Raises
        KeyError naming a missing tensor, ValueError on a shape mismatch, RuntimeError once the
        stage has materialized (its source is dropped then)."""
        if self._initial is None:
            raise RuntimeError(f"{name}: the stage's initial values were already given to its parameters")
        p = self.get_parameter(name)
        src = self._partition(name, self._initial)
        if tags.is_partitioned(p) and src.dtype == p.dtype and src.device == self.device:
            return src   # already a new contiguous tensor (tags.partition_tensor): no third copy
        return torch.empty(p.shape, dtype=p.dtype, device=self.device).copy_(src)

    @torch.no_grad()
    def materialize(self) -> None:
        """Give every parameter its initial value, one at a time (``initial_partition``): at
        most one full tensor and one partition exist beyond the parameters already made.
        Drops the source of the values (``full_weights`` is not kept alive by the stage)."""
        for name, p in self.named_parameters():
            p.data = self.initial_partition(name)
        self._initial, self.materialized = None, True

    @torch.no_grad()
    def load_full_weights(self, full: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's partition of each canonical full tensor into the (materialized)
        parameters, one tensor at a time (``model.materialize.local_partition``: vocabulary
        tensors of any padding, partitions from each parameter's tags). Raises KeyError naming
        a missing tensor, ValueError on a shape mismatch."""
        for name, p in self.named_parameters():
            p.copy_(self._partition(name, full))

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None,
                seq: Optional[SequenceInfo] = None) -> torch.Tensor:
        """Run this chunk.

        ``x``: token ids ``[B, T]`` with ``pre_process``, else hidden ``[B, T, H]``
        (``[B, T/tp, H]`` with sequence parallelism); ``T`` is this rank's ``T/cp`` tokens
        when ``seq`` (their positions and documents) is given. Returns, with ``post_process``,
        per-token losses ``[B, T]`` fp32 when ``labels [B, T]`` is given, else this rank's
        vocabulary partition of the logits ``[B, T, V_pad/tp]``; otherwise the hidden
        states for the next stage. Raises ValueError when ``T`` exceeds
        ``max_position_embeddings`` or (sequence parallel) is not divisible by tp.
        """
        if self.pre_process:
            if x.shape[1] > self.cfg.max_position_embeddings:
                raise ValueError(f"sequence of {x.shape[1]} tokens exceeds "
                                 f"--max-position-embeddings {self.cfg.max_position_embeddings}")
            x = self.embedding(x, None if seq is None else seq.position_ids)  # (B, T(/tp), H)
            region = "tp" if self.sp else "replicated"
            x = dropout(x, self.cfg.hidden_dropout, self.rng_tracker.generator(region),
                        self.training)
        x = self._run_layers(x, seq)
        if not self.post_process:
            return x
        x = self.final_ln(x)
        if self.cfg.tie_embeddings:
            logits = parallel_lm_logits(x, self.embedding.word_embeddings.weight, self.tp,
                                        sequence_parallel=self.sp)  # (B, T, V_pad/tp)
        else:
            logits = self.output(x)                                  # (B, T, V_pad/tp)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(
            logits, labels, self.tp, label_smoothing=self.cfg.label_smoothing,
            vocab_size=self.cfg.vocab_size, padded_vocab_size=self.padded_vocab)

    def _run_layers(self, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
        """The blocks of this chunk, ``[B, T(/tp), H]`` in and out, with full recomputation as
        Megatron-LM lays it out: ``uniform`` makes each group of ``recompute_num_layers``
        consecutive layers one recomputed region; ``block`` recomputes the first
        ``recompute_num_layers`` layers of the chunk one by one and runs the rest normally."""
        layers, cfg = list(self.layers.values()), self.cfg
        if cfg.recompute_granularity != "full" or not self.training:
            for layer in layers:
                x = layer(x) if seq is None else layer(x, seq)
            return x
        n = cfg.recompute_num_layers
        if cfg.recompute_method == "uniform":
            groups = [layers[i:i + n] for i in range(0, len(layers), n)]
            regions = [(group, True) for group in groups]
        else:
            regions = [([layer], i < n) for i, layer in enumerate(layers)]
        for group, recomputed in regions:
            run = functools.partial(_run_group, group, seq=seq)
            x = recompute(run, self.rng_tracker, x) if recomputed else run(x)
        return x


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
    table[:, E + 1:] /= C.group_size(dp_group) * num_microbatches
    for m in held.values():
        m.update_expert_bias(dp_group)
    rows = table.cpu().tolist()                       # one host transfer per step
    layers = {i: {"tokens_per_expert": [int(v) for v in r[:E]], "dropped": int(r[E]),
                  "assignments": int(sum(r[:E])), "aux_loss": r[E + 1], "z_loss": r[E + 2]}
              for i, r in zip(ids, rows)}
    return {"moe_aux_loss": sum(r[E + 1] for r in rows), "moe_z_loss": sum(r[E + 2] for r in rows),
            "moe_layers": layers}


def _run_group(layers: list, x: torch.Tensor, seq: Optional[SequenceInfo] = None) -> torch.Tensor:
    for layer in layers:
        x = layer(x) if seq is None else layer(x, seq)
    return x


@torch.no_grad()
def generate_greedy(stage: GPTStage, prompt_ids: torch.Tensor, max_new_tokens: int
                    ) -> torch.Tensor:
    """Greedy decoding with a whole-model stage (pp == 1): ``[B, T0] -> [B, T0 + new]``.

    Each step runs the last ``max_position_embeddings`` tokens without dropout, gathers the
    vocabulary partitions of the last position's logits over TP and takes the argmax over
    the real vocabulary (padded columns ignored). Under sequence parallelism the context is
    right-padded to a multiple of tp, which causal attention keeps invisible to the real
    positions. Raises ValueError when the stage lacks the embedding or the output layer.
    """
    if not (stage.pre_process and stage.post_process):
        raise ValueError("generate_greedy needs the whole model in one stage (pp == 1)")
    cfg, tp = stage.cfg, stage.groups.tp_size
    window = cfg.max_position_embeddings
    if stage.sp:
        window -= window % tp
    was_training = stage.training
    stage.eval()
    ids = prompt_ids
    try:
        for _ in range(max_new_tokens):
            context = ids[:, -window:]                               # (B, t)
            t = context.shape[1]
            if stage.sp:
                context = F.pad(context, (0, (-t) % tp))             # (B, t rounded up to tp)
            logits = stage(context)[:, t - 1]                        # (B, V_pad/tp)
            logits = gather_from_tp_region(logits, stage.tp)[:, :cfg.vocab_size]  # (B, V)
            ids = torch.cat([ids, logits.argmax(dim=-1, keepdim=True)], dim=1)
    finally:
        stage.train(was_training)
    return ids
