"""FLOP accounting for GPT training, device peak throughput, and model FLOPs utilisation.

Formula (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", sec. 5.1, generalised to any FFN width). Only matrix
multiplications are counted; a ``(m, k) @ (k, n)`` product costs ``2*m*k*n`` FLOPs.
With ``l`` layers, hidden size ``h``, FFN size ``f``, sequence length ``s``, padded
vocabulary ``V`` and global batch ``B`` (so ``B*s`` tokens per iteration), the forward
pass costs per token

    per layer:  2*(3*h*h  [QKV]  +  h*h  [attention output projection]  +  2*h*f  [MLP])
                + 2*2*s*h  [attention scores Q K^T and probabilities @ V]
    logits:     2*h*V

and one training iteration costs

    F = B*s * ( k * l * (2*(4*h*h + 2*h*f) + 4*s*h)  +  3 * 2*h*V )

with ``k = 3`` (forward + backward, the backward being twice the forward) or ``k = 4``
with full activation recomputation (the layers' forward runs twice; the logits are not
recomputed). For ``f = 4h`` this is the paper's expression
``F = 72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h))`` (``k = 3``) and
``F = 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h))`` (``k = 4``).

``spec_flops_per_iteration`` computes the same count from a model's parameter spec
(``megazero.param_spec``): ``2 * elements`` per token for every matmul weight, so the
LLaMA-style block's grouped-query QKV and three SwiGLU matrices are counted as they are,
without a formula per block. The trainer uses it.

Conventions, as in the paper: the causal attention is counted in full (the ``s x s``
score matrix, not its lower triangle); head count does not change the count; layer norm,
softmax, GELU, biases, embedding look-ups and the optimizer are not counted. With
``recompute=True`` the count includes the recomputed forward, so the ratio to peak is the
hardware FLOPs utilisation (HFU); pass ``recompute=False`` for model FLOPs utilisation (MFU,
Chowdhery et al. 2022, PaLM, appendix B). (torch's non-reentrant checkpoint stops
recomputing once the saved tensors are rebuilt, so it skips each layer's last matmul; the
formula counts the full recomputation, as the paper does.)

Sliding-window attention (``--window-size``): a windowed layer's scores and probability-value
products are charged ``min(W, s)`` keys per query instead of ``s`` (``attention_keys``). These are
model FLOPs, the work the model needs, as Megatron-LM's MFU counts it, not what the kernel
executes: the plain SDPA path takes a ``[1, 1, s, s]`` additive mask and computes the whole
masked ``s x s`` square (a fused kernel skips only whole masked tiles); the ring and its
one-rank form under attention sinks skip the blocks wholly outside the window. Attention sinks
add one logit per head and row to the softmax, no matmul: no FLOPs.

Context parallelism changes none of this: it splits each sequence, not the batch, so an
iteration still trains ``B*s`` tokens and the attention is still counted over the whole
``s x s`` (the cp ranks together compute its causal half, as one rank does). ``throughput``
divides by the whole world, tp x cp x pp x dp ranks.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch

from megazero.param_spec import ParamSpec, matmul_params

# Dense (no sparsity) peak matmul throughput in FLOP/s from NVIDIA's data sheets, keyed by
# name fragments of ``torch.cuda.get_device_name`` (upper-cased), first match wins.
# ``torch.float32`` is the plain FP32 rate: PyTorch runs fp32 matmuls without TF32 by default
# (``torch.backends.cuda.matmul.allow_tf32 = False``). ``TF32`` is the dense TF32 tensor-core
# rate (half the sparse figure of the data sheets), the peak of fp32 matmuls under ``--tf32``;
# a GPU without TF32 (V100) has no such entry and keeps its FP32 rate.
TF32 = "tf32"
_PEAKS: tuple[tuple[tuple[str, ...], dict], ...] = (
    (("H100", "PCIE"), {torch.bfloat16: 756e12, torch.float16: 756e12, TF32: 378e12, torch.float32: 51e12}),
    (("H100", "NVL"), {torch.bfloat16: 835e12, torch.float16: 835e12, TF32: 417.5e12, torch.float32: 60e12}),
    (("H100",), {torch.bfloat16: 989e12, torch.float16: 989e12, TF32: 494.5e12, torch.float32: 67e12}),
    (("H200",), {torch.bfloat16: 989e12, torch.float16: 989e12, TF32: 494.5e12, torch.float32: 67e12}),
    (("A100",), {torch.bfloat16: 312e12, torch.float16: 312e12, TF32: 156e12, torch.float32: 19.5e12}),
    (("V100",), {torch.float16: 125e12, torch.float32: 15.7e12}),
)


def gpt_flops_per_iteration(
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    seq_length: int,
    padded_vocab_size: int,
    global_batch_size: int,
    num_heads: Optional[int] = None,
    recompute: bool = False,
) -> float:
    """FLOPs of one training iteration (forward + backward) of a GPT, matmuls only.

    ``F = B*s * (k*l*(2*(4*h*h + 2*h*f) + 4*s*h) + 6*h*V)`` with ``k = 3``, or ``k = 4``
    when ``recompute`` (full activation recomputation re-runs every layer's forward); see
    the module docstring for each term. Causal attention is counted in full, as in
    Narayanan et al. 2021, sec. 5.1. ``num_heads`` does not change the count; when given
    it is only checked to divide ``hidden_size``.

    Returns FLOPs (not FLOP/s) as a float, summed over all devices of the iteration.
    Raises ValueError naming the setting when a size is not positive or ``num_heads`` does
    not divide ``hidden_size``.
    """
    sizes = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        seq_length=seq_length,
        padded_vocab_size=padded_vocab_size,
        global_batch_size=global_batch_size,
    )
    for name, value in sizes.items():
        if int(value) != value or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if num_heads is not None and (num_heads <= 0 or hidden_size % num_heads):
        raise ValueError(f"num_heads={num_heads} must be positive and divide hidden_size={hidden_size}")
    h, f, s = hidden_size, ffn_hidden_size, seq_length
    layer_forward = 2 * (3 * h * h + h * h + 2 * h * f) + 2 * 2 * s * h  # per token
    logits_forward = 2 * h * padded_vocab_size  # per token
    layer_passes = 4 if recompute else 3
    per_token = layer_passes * num_layers * layer_forward + 3 * logits_forward
    return float(global_batch_size * s * per_token)


def attention_keys(seq_length: int, window: Optional[int] = None) -> int:
    """Keys each query is charged for in one layer's attention FLOPs: ``s`` (``seq_length``,
    tokens) for full causal attention, counted in full as Narayanan et al. 2021 do (the whole
    ``s x s`` square, the masked triangle included), and ``min(W, s)`` for a sliding window W
    (Jiang et al. 2023, Mistral 7B, sec. 2). The causal keys a windowed layer really needs are
    ``sum_i min(i + 1, W) = s W - W (W - 1) / 2`` over queries ``i < s`` (``W <= s``); charging
    ``W`` keys to every query adds the ``W (W - 1) / 2`` masked corner, as the full count adds
    the masked triangle, so ``W >= s`` gives the full layer's ``s`` and ``W = 1`` the diagonal
    only. Raises ValueError for ``W < 1``."""
    if window is None:
        return seq_length
    if window < 1:
        raise ValueError(f"sliding window W = {window} must be at least 1 (--window-size L,0 gives W = L + 1)")
    return min(window, seq_length)


def spec_flops_per_iteration(
    spec: Iterable[ParamSpec],
    *,
    seq_length: int,
    attention_width: int,
    global_batch_size: int,
    recompute: bool = False,
    windows: Optional[Sequence[Optional[int]]] = None,
    mtp_num_layers: int = 0,
) -> float:
    """FLOPs of one training iteration read off a model's parameter spec (matmuls only).

    The same count as :func:`gpt_flops_per_iteration` for any block: a weight ``W`` marked
    ``matmul`` costs ``2 * numel(W)`` FLOPs per token forward (so the GPT-2 layer's
    ``2*(4*h*h + 2*h*f)``, a SwiGLU MLP's ``2*3*h*f``, a grouped-query QKV's
    ``2*h*(heads + 2*G)*d``), attention adds ``2*2*s*attention_width`` per layer and token
    (``attention_width`` = query heads x head size; keys shared by a group do not change
    it), the output layer ``2*h*V``:
    ``F = B*s * (k * (2*layer_matmuls + l*4*s*a) + 3 * 2*output_elements)``, ``k = 3`` or
    4 with ``recompute``. ``windows``: each layer's sliding window W or None
    (``GPTConfig.attention_window``; None: every layer full), which charges that layer's
    attention ``attention_keys(s, W)`` keys per query in place of ``s``. ``mtp_num_layers`` D
    (multi-token prediction, DeepSeek-V3 sec. 2.2): the modules' matmul weights are ``head``
    entries of the spec, counted with the head (``3 * 2 * elements``, not recomputed); each
    depth adds its block's full causal attention ``3 * 2*2*s*a`` and a second pass through the
    output layer ``3 * 2*V*h`` per token. Returns FLOPs as a
    float (all devices). Raises ValueError when the spec has no layer, a size is not positive
    or ``windows`` does not give one entry per layer.
    """
    spec = list(spec)
    layer, num_layers, head = matmul_params(spec)
    if num_layers == 0 or min(seq_length, attention_width, global_batch_size) <= 0:
        raise ValueError(
            f"spec with {num_layers} layers, seq_length={seq_length}, attention_width="
            f"{attention_width}, global_batch_size={global_batch_size}: all must be positive"
        )
    windows = [None] * num_layers if windows is None else list(windows)
    if len(windows) != num_layers:
        raise ValueError(f"windows gives {len(windows)} layers' windows, the spec has {num_layers} layers")
    keys = sum(attention_keys(seq_length, w) for w in windows)  # summed over the layers
    layers_forward = 2 * layer + 2 * 2 * keys * attention_width  # per token
    per_token = (4 if recompute else 3) * layers_forward + 3 * 2 * head
    if mtp_num_layers:
        output = sum(e.numel for e in spec if e.vocab and (e.matmul or e.tied_output))  # the output layer
        per_token += mtp_num_layers * 3 * (2 * 2 * attention_keys(seq_length, None) * attention_width + 2 * output)
    return float(global_batch_size * seq_length * per_token)


def peak_flops_for_name(device_name: str, dtype: torch.dtype, tf32: bool = False) -> Optional[float]:
    """Dense peak matmul FLOP/s of one GPU named ``device_name`` at ``dtype``: the peak of the
    precision its matmuls actually run in, so fp32 with ``tf32`` (``--tf32``) is the TF32
    tensor-core rate (about 7x the FP32 rate on H100), where the GPU has one.

    Matches fragments of the name (case-insensitive): H100 PCIe, H100 NVL, H100 (SXM), H200
    (as H100 SXM), A100,
    V100. Returns None for an unknown device or a dtype the table lacks (e.g. bf16 on V100).
    """
    name = device_name.upper()
    for fragments, peaks in _PEAKS:
        if all(fragment in name for fragment in fragments):
            if tf32 and dtype == torch.float32 and TF32 in peaks:
                return peaks[TF32]
            return peaks.get(dtype)
    return None


def peak_flops(device: Union[torch.device, str], dtype: torch.dtype, tf32: bool = False) -> Optional[float]:
    """Dense peak matmul FLOP/s of ``device`` at ``dtype`` (``tf32``: fp32 matmuls on TF32
    tensor cores, ``--tf32``), or None when unknown.

    On CUDA the name comes from ``torch.cuda.get_device_name(device)`` and is looked up
    with :func:`peak_flops_for_name`. A CPU has no table entry: None (MFU shown as "n/a";
    the trainer may pass a ``--peak-tflops`` value instead).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device), dtype, tf32)


def mfu(achieved_flops_per_s_per_device: float, peak_flops_per_device: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation as a fraction (0.42 = 42 %), or None when the peak is unknown.

    Both arguments are FLOP/s of one device. Raises ValueError for a non-positive peak.
    """
    if peak_flops_per_device is None:
        return None
    if peak_flops_per_device <= 0:
        raise ValueError(f"peak FLOP/s per device must be positive, got {peak_flops_per_device}")
    return achieved_flops_per_s_per_device / peak_flops_per_device


def throughput(
    *,
    flops_per_iteration: float,
    tokens_per_iteration: int,
    iteration_time_s: float,
    world_size: int,
    peak_flops_per_device: Optional[float],
) -> dict[str, Optional[float]]:
    """The perf values of one iteration, keyed as :meth:`Monitor.log_iteration` expects.

    Returns ``tokens_per_s`` (all devices together), ``tflops_per_device`` (achieved
    ``flops_per_iteration / (iteration_time_s * world_size) / 1e12``) and ``mfu``
    (fraction, or None without a peak). Raises ValueError for a non-positive time or
    world size.
    """
    if iteration_time_s <= 0 or world_size <= 0:
        raise ValueError(f"iteration_time_s ({iteration_time_s}) and world_size ({world_size}) must be positive")
    per_device = flops_per_iteration / (iteration_time_s * world_size)  # FLOP/s
    return {
        "tokens_per_s": tokens_per_iteration / iteration_time_s,
        "tflops_per_device": per_device / 1e12,
        "mfu": mfu(per_device, peak_flops_per_device),
    }
