"""Activation and temporary bytes of one rank, counted from what megazero's layers keep.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
sec. 4) count the tensors a transformer layer saves for its backward; this module does the
same for megazero's GPT layer (model/gpt.py), tensor by tensor, so the planner's numbers can
be checked against measurement (python -m scripts.plan --measure). Per layer and micro-batch, with
``q = s*b*h`` activation elements, ``t`` = tp, ``t_sp`` = tp under sequence parallelism
(else 1), ``f`` the FFN width and ``a`` the heads:

- both LayerNorm inputs ``2q/t_sp``; the inputs of QKV and ``fc1`` ``2q`` (all-gathered
  along the sequence first under SP, and saved gathered, as Megatron-LM does without its
  extra re-gather); QKV output ``3q/t`` (attention keeps q, k, v); attention output ``q/t``
  (``proj``'s input); GELU input and ``fc2`` input ``2fq/(h t)``;
- with ``--hidden-dropout`` > 0 two masks of the activation dtype, ``2q/t_sp``;
- with ``--attention-dropout`` > 0 on CPU ranks the attention core cannot use the fused
  kernel and keeps its scores, softmax and dropout mask, ``3*a*s^2*b/t`` (Korthikanti's
  ``5as/h`` term, here in the activation dtype); without attention dropout the fused kernel
  keeps only ``O(s)``. On CUDA (``ActivationSettings.platform``) flash, cuDNN and the
  memory-efficient kernel apply dropout inside and keep ``O(s)``; a call that no fused kernel
  takes (``attention_kernel``, ``context_parallel/sdpa_kernels.py``) keeps the math kernel's
  fp32 probabilities instead (``math_core_bytes``);
- with packed documents one additive ``[b, 1, s, s]`` mask per micro-batch in flight, shared by
  its layers, and with sliding-window layers (``--window-size``) one ``[1, 1, s, s]`` mask per
  chunk and micro-batch in flight, shared by its windowed layers; the document mask folds the
  window in, so with both it is one ``[b, 1, s, s]`` per distinct window of the chunk
  (``attention_mask_bytes``, ``chunk_mask_bytes``); not for the ring, nor with attention sinks,
  whose blockwise attention masks per block.

That is ``q(2/t_sp + 2 + (4 + 2f/h)/t)`` elements plus the dropout terms (with ``--kv-channels``
the QKV output and ``proj``'s input scale by ``A/h``, ``A`` = heads x head size: ``4A/h``); with 16-bit
activations, ``f = 4h`` and dropout on it is Korthikanti's ``sbh(10 + 24/t + 5as/(ht))``
up to the masks' width. Recomputation (sec. 5): ``selective`` drops the ``s^2`` term (the
core is replayed per layer in the backward, so one layer's core is alive at a time);
``full`` keeps one ``q/t_sp`` input per recomputed region and replays one region at a time.
The last stage keeps, per micro-batch, the fp32 softmax of its logits partition
``4*b*s*V_pad/t`` and the head's inputs, and has the logits and their gradient alive once;
with multi-token prediction each of its D modules keeps a block, its inputs and a head's
(``mtp_bytes``). A pipeline stage keeps each in-flight chunk output for its backward.
While a layer is back-propagated its activation gradients are alive too, at most about the
FFN-width gradient ``fq/(h t)`` at once (the GELU and ``fc1`` output gradients in turn).

Context parallelism (megazero/context_parallel, ``cp`` ranks): a rank holds ``T/cp`` tokens of
every sequence, so ``s`` above is ``T/cp`` in every per-token term (``q = (T/cp)*b*h``), the
head's logits included. The cp core saves its own output ``q/t`` besides ``proj``'s input (at
cp = 1 SDPA's output is ``proj``'s input viewed) and an O(s) log-sum-exp; attention dropout is
refused at cp > 1, so there is no ``s^2`` term kept. Alive once, inside one layer's attention
(``context_parallel_bytes``), with ``Tl = T/cp``, ``d`` the head size, ``h_l``/``G_l`` the
query/key-value heads per tp rank and ``acc`` = ``max(elt, 4)`` bytes (fp32 accumulation):

- ring (p2p, ``context_parallel/ring.py``): the K/V buffers, current and next,
  ``2 * 2*b*G_l*Tl*d*elt``, and in the backward the dK/dV accumulators, the one being added to
  and the one arriving (the one sent is freed once its send completes),
  ``2 * 2*b*G_l*Tl*d*acc``, and the dQ accumulator ``b*h_l*Tl*d*acc``;
  the scores of one row tile of a block pair ``b*h_l*rows*(Tl/2)*acc`` (``rows`` = the block's
  ``Tl/2`` queries, or fewer: ``blockwise.tile_rows`` keeps a tile within
  ``SCORE_TILE_BYTES``, 16 MiB), of which the backward holds two at once (P, computed in the
  scores' memory, and dP, turned into dS in place; the forward one, and logsumexp's reduction).
  Measured by scripts/bench/bench_context_parallel.py. So the ring's buffers shrink as ``1/cp``
  and its score tiles stay bounded; a tile is still an unfused matrix, where the fused kernel
  of cp = 1 keeps O(s). That is the einsum path (``--cp-ring-kernel einsum``); where the blocks
  run through a fused kernel (``auto``, ``context_parallel/fused_blocks.py``: always on CPU
  ranks, on CUDA where ``sdpa_kernels.ring_block_kernel`` says ``"efficient"``) no scores are kept, and a block's
  backward holds instead, with ``E = b*h_l*(Tl/2)*d``, the larger of: during the kernel, q,
  dO and the output in the kernel's layout and the kernel's dq, dk, dv (K/V expanded to
  ``h_l`` heads), ``6*E*elt``, plus the expanded K and V under grouped-query attention,
  ``2*E*elt``; after it, the kernel's gradients ``3*E*elt`` and their ``acc`` copies and
  sums over the group, ``(E + 2*b*G_l*(Tl/2)*d)*acc``; and with packed documents the block's
  additive bias ``b*(Tl/2)*(Tl/2)*elt`` (rows padded to 16 on CUDA). On CPU ranks one fused
  block's forward and backward measured 3.2-3.6 MiB resident at b 1, h_l 4, Tl/2 1024, d 16
  in fp32 (formula 1.5 MiB, the rest the kernel's own buffers; the einsum path 37 MiB).
- all-to-all (a2a, DeepSpeed-Ulysses): one all-to-all's send, receive and concatenation of a
  ``b*h_l*Tl*d`` tensor and the three gathered gradients of the backward, ``6*b*h_l*Tl*d*elt``;
  the attention itself runs in the fused kernel over ``h_l/cp`` heads of all T tokens (O(s)).

These are alive when the logits and the FFN-width gradient are not (the attention runs before
the head in the forward and after the MLP in the backward), so a stage counts the larger of
the two; the bound keeps the last layer's FFN inputs and the head's inputs, freed by then.
Attention sinks (``--softmax-type``) run every path through the ring's blockwise attention
(``ring.RingAttention``; at cp = 1 on one rank, under a2a on each rank's ``h_l/cp`` heads of all
T tokens): the core keeps its own output ``q/t`` and the O(s) log-sum-exp as at cp > 1, and its
buffers and blocks count as the ring's with C = 1 (``context_parallel_bytes``: no next K/V, no
arriving dK/dV, blocks of side ``T/2``). A block a sliding window cuts takes a ``[1, 1, n, n]``
bias on the fused path.

The sizes were measured on CPU ranks (``tests/tools/test_plan.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from megazero.context_parallel.blockwise import tile_rows
from megazero.context_parallel.sdpa_kernels import CudaPlatform, megazero_call, ring_block_kernel, split_offsets
from megazero.data_parallel.policy import BUCKETS_IN_FLIGHT, sharding_policy


@dataclass(frozen=True)
class ActivationSettings:
    """What decides activation memory besides the model sizes."""

    micro_batch_size: int
    tp: int
    sequence_parallel: bool
    activation_bytes: int
    """Bytes per element of the model dtype (4 fp32, 2 bf16/fp16)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: int = 1
    cp: int = 1
    """Context-parallel size (ranks): each rank holds ``T/cp`` tokens of every sequence."""
    cp_comm_type: str = "p2p"
    """Attention across the cp ranks, ``"p2p"`` (ring) or ``"a2a"`` (all-to-all); read at cp > 1."""
    cp_ring_kernel: str = "auto"
    """The ring blocks' kernel choice (``--cp-ring-kernel``): ``"auto"`` (fused where one exists) or ``"einsum"``."""
    documents: bool = False
    """Packed documents (``--reset-attention-mask``): SDPA takes a ``[b, 1, s, s]`` mask."""
    platform: Optional[CudaPlatform] = None
    """The GPU whose SDPA kernels run the attention (``sdpa_kernels``); None: CPU ranks."""
    logits_bytes: int = 4
    """Bytes per element of the head's logits, softmax and their gradient: 4 (fp32), 8 under FP8
    (``--fp8-format``: the output layer and the cross-entropy run in fp64, docs/precision.md)."""
    sinks: bool = False
    """Attention sinks (``--softmax-type learnable`` or ``off-by-one``): the core is the ring's
    blockwise attention, on one rank at cp = 1 and inside the all-to-all (``attention.local_attention``)."""


def _q(g, a: ActivationSettings) -> int:
    """Activation elements ``(T/cp)*b*h`` of one micro-batch on one rank (before tp)."""
    return g.seq_length // a.cp * a.micro_batch_size * g.hidden_size


def head_size(g) -> int:
    """``g.head_dim`` (``--kv-channels``), or ``hidden / heads`` for sizes that do not carry one."""
    return getattr(g, "head_dim", g.hidden_size // g.num_attention_heads)


def _attention_ratio(g) -> float:
    """``A / h``: the width of the query heads together (``heads * head_dim``) over the hidden
    size; 1 unless ``--kv-channels`` sets another head size, which scales QKV's output and
    ``proj``'s input."""
    return g.num_attention_heads * head_size(g) / g.hidden_size


def layer_bytes(g, a: ActivationSettings, with_core: bool = True) -> float:
    """Bytes one layer keeps for the backward of one micro-batch without full recomputation;
    ``with_core=False`` leaves out the attention core's ``s^2`` tensors (selective)."""
    q, t = _q(g, a), a.tp
    t_sp = t if a.sequence_parallel else 1
    elements = q * (2 / t_sp + 2 + (4 * _attention_ratio(g) + 2 * g.ffn_hidden_size / g.hidden_size) / t)
    if a.hidden_dropout > 0:
        elements += 2 * q / t_sp
    elements += core_elements(g, a) if with_core else 0
    return elements * a.activation_bytes + (math_core_bytes(g, a) if with_core else 0.0)


def core_elements(g, a: ActivationSettings) -> float:
    """Elements the attention core keeps besides q, k, v and ``proj``'s input: with attention
    dropout the unfused core's scores, softmax and dropout mask, ``3as^2b/t``; at cp > 1 or
    with sinks (no dropout there: the config refuses it) the ring's or the all-to-all's own
    output ``q/t`` (``ring.RingAttention`` saves it, at C = 1 too); else 0 (the fused kernel
    keeps only its ``O(s)`` statistics and its output is ``proj``'s input)."""
    if a.cp > 1 or a.sinks:
        return _q(g, a) * _attention_ratio(g) / a.tp
    if a.attention_dropout <= 0 or a.platform is not None:
        return 0.0
    return 3 * g.num_attention_heads * g.seq_length**2 * a.micro_batch_size / a.tp


def attention_kernel(g, a: ActivationSettings) -> str:
    """The kernel of one layer's attention core (``sdpa_kernels.megazero_call``): ``"cpu"`` on
    CPU ranks, the ring's block kernel at cp > 1 under p2p and with sinks on any path
    (``sdpa_kernels.ring_block_kernel``: ``"efficient"`` or ``"einsum"``; the one-rank ring of
    sinks always takes ``"auto"``), else the CUDA SDPA kernel of
    ``a.platform`` for this rank's heads (``h/tp``, or ``h/(tp cp)`` under a2a), head size,
    dtype (``activation_bytes``: 4 fp32, 2 bf16), documents and dropout."""
    if a.platform is None:
        return "cpu"
    split = a.tp * (a.cp if a.cp > 1 else 1)
    h, G, d = g.num_attention_heads // split, g.kv_heads // split, head_size(g)
    dtype = torch.float32 if a.activation_bytes == 4 else torch.bfloat16
    ring = a.cp > 1 and a.cp_comm_type != "a2a"
    if ring or a.sinks:
        return "einsum" if ring and a.cp_ring_kernel == "einsum" else ring_block_kernel(dtype, d, a.platform)
    offsets = split_offsets(G != h, h, G, d) if a.cp == 1 else (0, 0, 0)
    dropout = a.attention_dropout if a.cp == 1 and not a.documents else 0.0
    return megazero_call(
        dtype, h, G, d, documents=a.documents, dropout=dropout, offsets=offsets, plat=a.platform
    ).kernel


def math_core_bytes(g, a: ActivationSettings) -> float:
    """Bytes one layer's attention keeps when CUDA SDPA falls back to its math kernel
    (``attention_kernel`` is ``"math"``, 0 otherwise): the fp32 probabilities ``[b, h_l, s, s]``
    (``h_l`` this rank's heads: ``h/tp``, or ``h/(tp cp)`` over all ``s`` tokens under a2a), and
    with dropout its boolean mask and the dropped probabilities, ``(4 + 1 + 4) b h_l s^2``."""
    if attention_kernel(g, a) != "math":
        return 0.0
    heads = g.num_attention_heads // (a.tp * a.cp)
    per_score = 4 + (5 if a.attention_dropout > 0 and a.cp == 1 and not a.documents else 0)
    return float(per_score * a.micro_batch_size * heads * g.seq_length**2)


def document_mask_bytes(g, a: ActivationSettings) -> float:
    """Bytes of the document mask one micro-batch keeps (``attention.document_mask``: one
    additive ``[b, 1, s, s]`` of the activation dtype, its rows padded to 16, shared by the
    layers; over all ``s`` tokens under a2a); 0 without documents, for the ring, whose
    block masks are built per block, and with sinks (the blockwise path's, also per block)."""
    return attention_mask_bytes(g, a, frozenset({None})) if a.documents else 0.0


def layer_windows(g, layer_ids) -> frozenset:
    """The distinct sliding windows W of the layers ``layer_ids`` (0-based), None standing for
    full causal attention: ``g.attention_window(i)`` (``GPTConfig``, from ``--window-size`` and
    ``--window-attn-skip-freq``); ``{None}`` for sizes without that method."""
    window = getattr(g, "attention_window", None)
    return frozenset(window(i) if window is not None else None for i in layer_ids)


def attention_mask_bytes(g, a: ActivationSettings, windows: frozenset = frozenset({None})) -> float:
    """Bytes of the additive attention masks one micro-batch-chunk keeps, one per distinct window
    in ``windows`` (``layer_windows`` of the chunk), each ``s x ceil16(s)`` elements of the
    activation dtype (rows padded to 16, ``attention.document_mask``), ``s`` = ``T`` (under a2a
    the mask covers all T tokens):

    - with packed documents one ``[b, 1, s, s]`` per distinct window, full layers included: the
      document mask already folds the window in (``local_attention`` caches one per window), so
      a windowed chunk's mask is not counted twice, but a chunk of windowed and full layers
      keeps two;
    - without documents one ``[1, 1, s, s]`` per distinct W, none for full layers (the plain
      causal SDPA takes no mask): ``Attention._window_mask`` (cp = 1, the stage's
      ``mask_cache``) or ``local_attention``'s inside the all-to-all.

    0 for the ring (cp > 1, p2p) and with sinks: the blockwise attention builds its masks per
    block (``context_parallel_bytes``). Sinks with an odd ``T`` take explicit scores with a
    boolean mask instead, not counted."""
    if a.sinks or (a.cp > 1 and a.cp_comm_type != "a2a"):
        return 0.0
    s = g.seq_length
    one = s * (-(-s // 16) * 16) * a.activation_bytes  # one [1, 1, s, s] mask, rows padded to 16
    if a.documents:
        return float(len(windows) * a.micro_batch_size * one)
    return float(sum(one for w in windows if w is not None))


def chunk_mask_bytes(g, a: ActivationSettings, windows: frozenset, num_layers: int) -> tuple[float, float]:
    """(mask bytes one chunk keeps per in-flight micro-batch, mask bytes it holds once) of
    ``attention_mask_bytes``. The fused kernels save the mask for the backward, so each
    micro-batch in flight keeps its own; but the sliding-window mask of a stage without
    documents at cp = 1 lives in the stage's ``mask_cache``, which each forward clears, so
    where the core is replayed in the backward (selective recomputation, or full recomputation
    of every layer of the chunk) no micro-batch keeps it and the cache holds one at a time."""
    total = attention_mask_bytes(g, a, windows)
    replayed = a.recompute_granularity == "selective" or (
        a.recompute_granularity == "full" and (a.recompute_method == "uniform" or a.recompute_num_layers >= num_layers)
    )
    if replayed and not a.documents and a.cp == 1:
        return 0.0, total
    return total, 0.0


class ContextParallelBytes(NamedTuple):
    """Bytes alive once inside one layer's context-parallel attention (module docstring)."""

    kv_buffers: float
    """ring: K/V current and next, the dK/dV accumulators and dQ's; a2a: the all-to-all buffers."""
    scores: float
    """ring: what one block holds at once in the backward (the einsum path's score tiles, or the
    fused path's copies and bias); a2a: 0 (fused kernel)."""

    @property
    def total(self) -> float:
        return self.kv_buffers + self.scores


def context_parallel_bytes(g, a: ActivationSettings, windowed: bool = False) -> ContextParallelBytes:
    """What one layer's cp attention, or with sinks the one-rank ring, has alive at once, per
    rank, in bytes (zeros at cp = 1 without sinks).

    Reads ``g.seq_length`` (T, tokens), ``g.num_attention_heads``, ``g.kv_heads`` (G),
    ``g.hidden_size``; ``a.cp``, ``a.cp_comm_type``, ``a.tp``, ``a.micro_batch_size``,
    ``a.activation_bytes``, ``a.sinks``; ``windowed``: a layer of the stage has a sliding window
    (a block it cuts takes a ``[1, 1, n, n]`` bias on the fused path). The formulas are in the
    module docstring; ``T/(2 cp)`` is the zigzag chunk (``context_parallel/zigzag.py``), one
    block's side. With sinks at cp = 1 the ring runs on one rank (``local_attention``) with one
    K/V stack, one dK/dV accumulator and dQ's, and blocks of side ``T/2``; under a2a with sinks
    each rank runs it over ``h_l/cp`` heads of all T tokens, besides the all-to-all's buffers.
    """
    if a.cp == 1 and not a.sinks:
        return ContextParallelBytes(0.0, 0.0)
    b, elt = a.micro_batch_size, a.activation_bytes
    T, d = g.seq_length, head_size(g)
    h_l, G_l = g.num_attention_heads // a.tp, g.kv_heads // a.tp
    if a.cp > 1 and a.cp_comm_type == "a2a":
        a2a = 6.0 * b * h_l * (T // a.cp) * d * elt  # send, receive, concatenation; three gradients
        if not a.sinks:
            return ContextParallelBytes(a2a, 0.0)
        inner = _ring_bytes(a, b, h_l // a.cp, G_l // a.cp, T, 1, d, windowed)
        return ContextParallelBytes(a2a + inner.kv_buffers, inner.scores)
    return _ring_bytes(a, b, h_l, G_l, T // a.cp, a.cp, d, windowed)


def _ring_bytes(a: ActivationSettings, b: int, h_l: int, G_l: int, Tl: int, C: int, d: int, windowed: bool):
    """``ContextParallelBytes`` of ``ring.RingAttention`` over ``C`` ranks holding ``Tl`` tokens
    of ``h_l`` query and ``G_l`` key/value heads each (module docstring)."""
    elt, acc = a.activation_bytes, max(a.activation_bytes, 4)
    q_l = b * h_l * Tl * d  # elements of this rank's q
    kv = 2 * b * G_l * Tl * d  # one K/V pair [2, b, G/tp, T/cp, d]
    copies = 2 if C > 1 else 1  # the ring's next K/V and arriving dK/dV; none on one rank
    buffers = copies * kv * elt + copies * kv * acc + q_l * acc
    n = Tl // 2  # one block's side, T/(2 cp)
    dtype = torch.float32 if elt == 4 else torch.bfloat16
    fused = a.platform is None or ring_block_kernel(dtype, d, a.platform) == "efficient"
    if (a.cp_ring_kernel == "auto" or C == 1) and fused:
        E = b * h_l * n * d  # elements of one block's q
        during = (6 + (2 if G_l != h_l else 0)) * E * elt  # the kernel's inputs and gradients
        after = 3 * E * elt + (E + 2 * b * G_l * n * d) * acc  # its gradients and their fp32 sums
        width = n if a.platform is None else -(-n // 16) * 16
        bias_rows = b if a.documents else (1 if windowed else 0)  # a block cut by documents or the window
        return ContextParallelBytes(float(buffers), float(max(during, after) + bias_rows * n * width * elt))
    rows = tile_rows(b, h_l, n, n, acc)  # the block's queries run in row tiles
    return ContextParallelBytes(float(buffers), 2.0 * b * h_l * rows * n * acc)


def chunk_bytes(g, a: ActivationSettings, num_layers: int) -> tuple[float, float]:
    """(bytes a chunk of ``num_layers`` layers keeps per in-flight micro-batch, bytes alive
    once while a recomputed region is replayed in the backward)."""
    selective = a.recompute_granularity == "selective"
    full_layer = layer_bytes(g, a)
    kept_layer = layer_bytes(g, a, with_core=not selective)
    if a.recompute_granularity != "full":
        replay = core_elements(g, a) * a.activation_bytes + math_core_bytes(g, a) if selective else 0.0
        return num_layers * kept_layer, replay
    t_sp = a.tp if a.sequence_parallel else 1
    region_input = _q(g, a) / t_sp * a.activation_bytes
    n = a.recompute_num_layers
    if a.recompute_method == "uniform":
        regions = math.ceil(num_layers / n)
        return regions * region_input, min(n, num_layers) * full_layer
    recomputed = min(n, num_layers)
    kept = recomputed * region_input + (num_layers - recomputed) * full_layer
    return kept, (full_layer if recomputed else 0.0)


def head_bytes(g, a: ActivationSettings, padded_vocab: int) -> tuple[float, float]:
    """(bytes the last stage's head keeps per micro-batch, bytes alive once): kept are the
    final LayerNorm input ``q/t_sp``, the logits' input ``q`` and the fp32 softmax partition
    ``4*b*s*V_pad/t`` (fp64 under FP8: ``a.logits_bytes``); alive once are the logits and their
    gradient, two more partitions (three with the vocabulary-parallel cross-entropy at tp > 1)."""
    t_sp = a.tp if a.sequence_parallel else 1
    partition = a.logits_bytes * a.micro_batch_size * (g.seq_length // a.cp) * padded_vocab / a.tp
    kept = _q(g, a) * (1 / t_sp + 1) * a.activation_bytes + partition
    return kept, (2 if a.tp == 1 else 3) * partition


def mtp_bytes(g, a: ActivationSettings, padded_vocab: int) -> float:
    """Bytes the last stage's multi-token prediction modules (``g.mtp_num_layers`` D, model/mtp.py)
    keep per micro-batch: per depth one block never recomputed (``layer_bytes``), the inputs of its
    two norms and of ``eh_proj`` (``4 q/t_sp``: the embedding, the hidden state and their ``2 q/t_sp``
    concatenation) and a head's (``head_bytes``); 0 without them."""
    D = getattr(g, "mtp_num_layers", 0)
    if not D:
        return 0.0
    q_sp = _q(g, a) / (a.tp if a.sequence_parallel else 1) * a.activation_bytes
    return D * (layer_bytes(g, a) + 4 * q_sp + head_bytes(g, a, padded_vocab)[0])


def weight_grad_bytes(
    g, a: ActivationSettings, num_layers: int, first_stage: bool, last_stage: bool, padded_vocab: int
) -> float:
    """Bytes a split backward (zero-bubble schedules, ``pipeline/weight_grad.py``) holds for one
    micro-batch-chunk from its B to its W, in place of its activations (B frees the rest): per
    linear layer its saved input and the gradient of its output. Per transformer layer the
    inputs are the fused q/k/v's and the first MLP linear's ``q`` each (the all-gathered input
    with sequence parallelism), the attention projection's ``q/t`` and the second MLP linear's
    ``q ffn/(H t)``; the output gradients the q/k/v's ``q (h + 2 G)/(h t)``, the first MLP
    linear's ``q ffn (2 with SwiGLU)/(H t)`` and the two row-parallel linears' partial sums
    ``q`` each. The first stage adds the embedding's output gradient ``q/t_sp``, the last
    stage the output layer's weight gradient ``V_pad h / t``, which B computes (tagged
    ``weight_grad_in_b``: its W would hold the layer's input ``q`` and the logits' gradient
    ``b s V_pad / t``). Norms and bias additions get their gradients in B (a few vectors,
    not counted)."""
    q, t = _q(g, a), a.tp
    t_sp = t if a.sequence_parallel else 1
    r = _attention_ratio(g)
    qkv = (g.num_attention_heads + 2 * g.kv_heads) / g.num_attention_heads * r
    ffn = g.ffn_hidden_size / g.hidden_size
    ffn_out = ffn * (2 if getattr(g, "gated_linear_unit", False) else 1)
    inputs = 2 + (r + ffn) / t
    grads = 2 + (qkv + ffn_out) / t
    elements = num_layers * q * (inputs + grads)
    if first_stage:
        elements += q / t_sp
    if last_stage:
        elements += padded_vocab * g.hidden_size / t
    return elements * a.activation_bytes


def stage_activation_bytes(
    g,
    a: ActivationSettings,
    layers_per_chunk: list[int],
    inflight: int,
    first_stage: bool,
    last_stage: bool,
    pp: int,
    padded_vocab: int,
    awaiting_weight: int = 0,
    windows_per_chunk: Optional[list[frozenset]] = None,
) -> float:
    """Peak activation bytes of one rank: ``inflight`` micro-batch-chunks kept (the schedule's
    peak, spread over the chunks in turn; a split backward's ``awaiting_weight`` more hold
    ``weight_grad_bytes`` each) plus one replayed region and one layer's activation
    gradients, and each chunk's attention masks (``chunk_mask_bytes`` of its entry in
    ``windows_per_chunk``, the ``layer_windows`` of its layers; None: no window anywhere).
    Pipelined (pp > 1): each kept micro-batch-chunk that is not the last stage's also keeps its
    output ``q/t_sp`` for the backward, and a received and a sent tensor are in flight. The
    first stage adds, at tp > 1, the full partial-sum embedding before its reduction; the last
    stage the head (``head_bytes``) and the multi-token prediction modules (``mtp_bytes``) for
    each of its micro-batches. At cp > 1 or with sinks the
    attention's temporaries (``context_parallel_bytes``) count instead of the FFN gradient and
    the head's logits when they are larger (they are never alive together)."""
    q_sp = _q(g, a) / (a.tp if a.sequence_parallel else 1) * a.activation_bytes
    windows = windows_per_chunk or [frozenset({None})] * len(layers_per_chunk)
    masks = [chunk_mask_bytes(g, a, w, n) for w, n in zip(windows, layers_per_chunk)]
    kept = [chunk_bytes(g, a, n) for n in layers_per_chunk]
    per_chunk = max(k + m for (k, _), (m, _) in zip(kept, masks))
    once = max(r for _, r in kept) + sum(m for _, m in masks)
    transient = _q(g, a) * g.ffn_hidden_size / (g.hidden_size * a.tp) * a.activation_bytes
    if pp > 1:
        per_chunk += q_sp
        once += 2 * q_sp
    if first_stage and a.tp > 1:
        once += _q(g, a) * a.activation_bytes
    total = inflight * per_chunk + once
    if awaiting_weight:
        total += awaiting_weight * max(
            weight_grad_bytes(g, a, n, first_stage, last_stage, padded_vocab) for n in layers_per_chunk
        )
    if last_stage:
        head_kept, head_once = head_bytes(g, a, padded_vocab)
        last_inflight = inflight if pp == 1 else max(1, inflight // len(layers_per_chunk))
        total += last_inflight * (head_kept + mtp_bytes(g, a, padded_vocab))
        transient += head_once
    windowed = any(w is not None for ws in windows for w in ws)
    return total + max(transient, context_parallel_bytes(g, a, windowed).total)


def temporary_bytes(
    psi: int,
    dp: int,
    zero_stage: int,
    param_bytes: int,
    grad_bytes: int,
    reduce_bucket: int,
    allgather_bucket: int,
    buckets_in_flight: int = BUCKETS_IN_FLIGHT,
    zero3_max_live: Optional[int] = None,
) -> tuple[float, float]:
    """(bytes alive during the backward, bytes alive during the optimizer step) beyond the
    model states, as megazero's ZeRO strategies bound them (``DistributedOptimizer.
    bucket_bound_bytes``), asking the stage's policy (``data_parallel.policy``): a stage that
    shards gradients stages ``staging_slots(buckets_in_flight)`` reduce buckets of gradients in
    the backward; the step holds an fp32 scratch of one owned bucket piece when gradients are
    not fp32, or, where parameters are gathered after the step, the all-gather buffers
    (``allgather_bucket / N`` elements per rank, N + 1 of them, in the model dtype). A stage
    that shards parameters adds the gathered parameters to the backward's bytes: at most
    ``zero3_max_live`` elements (``--zero3-max-live-parameters``; ``zero3_gather`` gathers per
    layer, prefetches only under that bound and releases idle layers to stay under it) and
    never more than the stage's ``psi``. Raises ValueError for a stage without a policy."""
    policy = sharding_policy(zero_stage)
    shard = math.ceil(psi / dp) if policy.shards_optimizer else psi
    bucket = min(reduce_bucket, psi)
    staging = policy.staging_slots(buckets_in_flight) * bucket * grad_bytes
    piece = min(math.ceil(bucket / dp) if policy.shards_optimizer else bucket, shard)
    scratch = 4 * piece if grad_bytes != 4 else 0
    if policy.shards_params:
        live = psi if zero3_max_live is None else min(psi, zero3_max_live)
        return float(staging + live * param_bytes), float(scratch)
    gather = (min(max(1, allgather_bucket // dp), shard) * (dp + 1) * param_bytes) if policy.gathers_after_step else 0
    return float(staging), float(max(scratch, gather))
