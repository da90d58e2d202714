"""Activation and temporary bytes of one rank, counted from what megazero's layers keep.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
sec. 4) count the tensors a transformer layer saves for its backward; this module does the
same for megazero's GPT layer (model/gpt.py), tensor by tensor, so the planner's numbers can
be checked against measurement (scripts/plan.py --measure). Per layer and micro-batch, with
``q = s*b*h`` activation elements, ``t`` = tp, ``t_sp`` = tp under sequence parallelism
(else 1), ``f`` the FFN width and ``a`` the heads:

- both LayerNorm inputs ``2q/t_sp``; the inputs of QKV and ``fc1`` ``2q`` (all-gathered
  along the sequence first under SP, and saved gathered, as Megatron-LM does without its
  extra re-gather); QKV output ``3q/t`` (attention keeps q, k, v); attention output ``q/t``
  (``proj``'s input); GELU input and ``fc2`` input ``2fq/(h t)``;
- with ``--hidden-dropout`` > 0 two masks of the activation dtype, ``2q/t_sp``;
- with ``--attention-dropout`` > 0 the attention core cannot use the fused kernel and keeps
  its scores, softmax and dropout mask, ``3*a*s^2*b/t`` (Korthikanti's ``5as/h`` term, here
  in the activation dtype); without attention dropout the fused kernel keeps only ``O(s)``.

That is ``q(2/t_sp + 2 + (4 + 2f/h)/t)`` elements plus the dropout terms; with 16-bit
activations, ``f = 4h`` and dropout on it is Korthikanti's ``sbh(10 + 24/t + 5as/(ht))``
up to the masks' width. Recomputation (sec. 5): ``selective`` drops the ``s^2`` term (the
core is replayed per layer in the backward, so one layer's core is alive at a time);
``full`` keeps one ``q/t_sp`` input per recomputed region and replays one region at a time.
The last stage keeps, per micro-batch, the fp32 softmax of its logits partition
``4*b*s*V_pad/t`` and the head's inputs, and has the logits and their gradient alive once.
A pipeline stage keeps each in-flight chunk output for its backward.
While a layer is back-propagated its activation gradients are alive too, at most about the
FFN-width gradient ``fq/(h t)`` at once (the GELU and ``fc1`` output gradients in turn).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


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


def _q(g, a: ActivationSettings) -> int:
    return g.seq_length * a.micro_batch_size * g.hidden_size


def layer_bytes(g, a: ActivationSettings, with_core: bool = True) -> float:
    """Bytes one layer keeps for the backward of one micro-batch without full recomputation;
    ``with_core=False`` leaves out the attention core's ``s^2`` tensors (selective)."""
    q, t = _q(g, a), a.tp
    t_sp = t if a.sequence_parallel else 1
    elements = q * (2 / t_sp + 2 + (4 + 2 * g.ffn_hidden_size / g.hidden_size) / t)
    if a.hidden_dropout > 0:
        elements += 2 * q / t_sp
    elements += core_elements(g, a) if with_core else 0
    return elements * a.activation_bytes


def core_elements(g, a: ActivationSettings) -> float:
    """Elements the unfused attention core keeps (scores, softmax, dropout mask): ``3as^2b/t``;
    0 without attention dropout (the fused kernel keeps only its ``O(s)`` statistics)."""
    if a.attention_dropout <= 0:
        return 0.0
    return 3 * g.num_attention_heads * g.seq_length ** 2 * a.micro_batch_size / a.tp


def chunk_bytes(g, a: ActivationSettings, num_layers: int) -> tuple[float, float]:
    """(bytes a chunk of ``num_layers`` layers keeps per in-flight micro-batch, bytes alive
    once while a recomputed region is replayed in the backward)."""
    selective = a.recompute_granularity == "selective"
    full_layer = layer_bytes(g, a)
    kept_layer = layer_bytes(g, a, with_core=not selective)
    if a.recompute_granularity != "full":
        replay = core_elements(g, a) * a.activation_bytes if selective else 0.0
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
    ``4*b*s*V_pad/t``; alive once are the logits and their gradient, two more partitions
    (three with the vocabulary-parallel cross-entropy at tp > 1)."""
    t_sp = a.tp if a.sequence_parallel else 1
    partition = 4 * a.micro_batch_size * g.seq_length * padded_vocab / a.tp
    kept = _q(g, a) * (1 / t_sp + 1) * a.activation_bytes + partition
    return kept, (2 if a.tp == 1 else 3) * partition


def stage_activation_bytes(g, a: ActivationSettings, layers_per_chunk: list[int], inflight: int,
                           first_stage: bool, last_stage: bool, pp: int, padded_vocab: int) -> float:
    """Peak activation bytes of one rank: ``inflight`` micro-batch-chunks kept (the schedule's
    peak, spread over the chunks in turn) plus one replayed region and one layer's activation
    gradients. Pipelined (pp > 1): each kept micro-batch-chunk that is not the last stage's
    also keeps its output ``q/t_sp`` for the backward, and a received and a sent tensor are in
    flight. The first stage adds, at tp > 1, the full partial-sum embedding before its
    reduction; the last stage the head (``head_bytes``) for each of its micro-batches."""
    q_sp = _q(g, a) / (a.tp if a.sequence_parallel else 1) * a.activation_bytes
    kept = [chunk_bytes(g, a, n) for n in layers_per_chunk]
    per_chunk = max(k for k, _ in kept)
    once = max(r for _, r in kept)
    once += _q(g, a) * g.ffn_hidden_size / (g.hidden_size * a.tp) * a.activation_bytes
    if pp > 1:
        per_chunk += q_sp
        once += 2 * q_sp
    if first_stage and a.tp > 1:
        once += _q(g, a) * a.activation_bytes
    total = inflight * per_chunk + once
    if last_stage:
        head_kept, head_once = head_bytes(g, a, padded_vocab)
        last_inflight = inflight if pp == 1 else max(1, inflight // len(layers_per_chunk))
        total += last_inflight * head_kept + head_once
    return total


def temporary_bytes(psi: int, dp: int, zero_stage: int, param_bytes: int, grad_bytes: int,
                    reduce_bucket: int, allgather_bucket: int, buckets_in_flight: int = 2,
                    zero3_max_live: Optional[int] = None) -> tuple[float, float]:
    """(bytes alive during the backward, bytes alive during the optimizer step) beyond the
    model states, as megazero's ZeRO strategies bound them (``DistributedOptimizer.
    bucket_bound_bytes``): ZeRO-2/3 stage up to ``buckets_in_flight + 2`` reduce buckets of
    gradients in the backward; the step holds an fp32 scratch of one owned bucket piece when
    gradients are not fp32, or, at stages 1-3, the all-gather buffers
    (``allgather_bucket / N`` elements per rank, N + 1 of them, in the model dtype). ZeRO-3
    adds the gathered parameters to the backward's bytes: at most ``zero3_max_live``
    elements (``--zero3-max-live-parameters``; ``zero3_gather`` gathers per layer, prefetches
    only under that bound and releases idle layers to stay under it) and never more than the
    stage's ``psi``; it needs no all-gather after the step."""
    shard = psi if zero_stage == 0 else math.ceil(psi / dp)
    bucket = min(reduce_bucket, psi)
    staging = (buckets_in_flight + 2) * bucket * grad_bytes if zero_stage >= 2 else 0
    if zero_stage == 3:
        live = psi if zero3_max_live is None else min(psi, zero3_max_live)
        return float(staging + live * param_bytes), float(4 * min(math.ceil(bucket / dp), shard)
                                                         if grad_bytes != 4 else 0)
    piece = min(bucket if zero_stage == 0 else math.ceil(bucket / dp), shard)
    scratch = 4 * piece if grad_bytes != 4 else 0
    gather = (min(max(1, allgather_bucket // dp), shard) * (dp + 1) * param_bytes) if zero_stage > 0 else 0
    return float(staging), float(max(scratch, gather))
