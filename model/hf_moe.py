"""Hugging Face interchange of the LLaMA-style block with Mixture-of-Experts MLPs:
megazero's canonical MoE parameters <-> ``MixtralForCausalLM`` (no shared expert),
``Qwen2MoeForCausalLM`` (with a shared expert) or ``Qwen3MoeForCausalLM`` (``--qk-layernorm``,
no shared expert). ``model/hf.py`` keeps the attention, norm,
embedding and dense-MLP maps (LlamaForCausalLM's names, which both models share) and calls
this file for what MoE adds; like it, this file reads no file.

What the two models compute (transformers 5's ``modeling_mixtral`` / ``modeling_qwen2_moe``,
read for this map), and why the map is exact:

- Router: ``gate.weight [E, H]`` (no bias) gives the logits; both take ``softmax`` over all E
  experts, then the top-k of those probabilities. Mixtral divides the k by their sum, which
  equals megazero's default (softmax over the k largest logits, ``--moe-router-pre-softmax``
  off: the top-k of the logits and of their softmax are the same experts, softmax being
  monotone). Qwen2-MoE divides only with ``norm_topk_prob``: ``norm_topk_prob = not
  moe_router_pre_softmax`` (pre-softmax: the top-k of the full softmax, not renormalised, as
  ``megazero.moe.router.route``). Experts are SwiGLU MLPs ``down(silu(gate x) * up x)``
  without biases: Mixtral ``w1`` = gate, ``w3`` = up, ``w2`` = down; Qwen2-MoE
  ``gate_proj``/``up_proj``/``down_proj``; megazero's ``fc1`` is ``[gate; up]``.
- Qwen2-MoE's shared expert is gated: ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``,
  ``shared_expert_gate`` a ``[1, H]`` linear without bias. megazero adds the shared expert
  ungated. No finite gate gives exactly 1 (``sigmoid(w x)`` depends on x unless ``w = 0``),
  but ``w = 0`` gives exactly ``sigmoid(0) = 1/2`` for every token, and scaling by a power of
  two is exact in binary floating point (no rounding, barring overflow / underflow), so the
  export writes the gate as zeros and ``down_proj`` as ``2 * fc2``: ``1/2 * (2 W h) = W h`` bit
  for bit. The import reads ``fc2 = down_proj / 2`` and refuses a folder whose gate is not
  all zero (a real Qwen checkpoint's gate depends on the token: megazero has no such gate).
- Qwen3-MoE (``modeling_qwen3_moe``): Qwen3's attention (``model/hf_families.py``) and
  Qwen2-MoE's router and expert names without the shared expert; its router, like
  Qwen2-MoE's, takes the top-k of the full softmax and divides by their sum only with
  ``norm_topk_prob`` (Qwen3-30B-A3B: true, megazero's default router), so ``norm_topk_prob =
  not moe_router_pre_softmax``. Its experts count is ``num_experts`` (transformers 5 writes
  ``num_local_experts``; both are read).
- Layers: Mixtral's are all MoE; Qwen2-MoE's layer ``i`` is MoE unless listed in
  ``mlp_only_layers`` and when ``(i + 1) % decoder_sparse_step == 0``; megazero's when ``i %
  moe_layer_freq == 0`` (Qwen3-MoE: the same rule). The export writes ``decoder_sparse_step =
  1`` and the dense layers as ``mlp_only_layers``; the import finds the ``moe_layer_freq``
  giving the same set or refuses.

Refused by name (``HFConversionError``), since neither model computes it: the GPT-2 block
with experts, linear biases, sigmoid scores, the expert bias, a capacity factor (both models
are dropless); without a shared expert (Mixtral) also the pre-softmax router and dense
layers. On import: Qwen2-MoE's ``qkv_bias``, sliding-window attention, a non-zero shared
expert gate. The training-only settings (load-balancing type and coefficients, z-loss, drop
policy, bias update rate) do not change the forward and are not written, except
``router_aux_loss_coef`` (transformers adds its own load-balancing loss, normalised
differently from megazero's, only with ``output_router_logits``, written false).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from model.config import GPTConfig
from model.hf_config import HFConversionError, config_value
from model.hf_families import every_layer_window

# (field, flag) of the MoE settings that define the forward, in the order a mismatch is named
MATCHED = (
    ("num_experts", "--num-experts"),
    ("moe_router_topk", "--moe-router-topk"),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
    ("moe_layer_freq", "--moe-layer-freq"),
    ("moe_router_score_function", "--moe-router-score-function"),
    ("moe_router_pre_softmax", "--moe-router-pre-softmax"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
    ("moe_router_linear_bias", "--moe-router-linear-bias"),
    ("moe_expert_capacity_factor", "--moe-expert-capacity-factor"),
)
MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def is_moe_field(name: str) -> bool:
    """Whether GPTConfig field ``name`` is an MoE setting (``check_export`` judges those)."""
    return name == "num_experts" or name.startswith("moe_")


def is_moe(gcfg: GPTConfig) -> bool:
    """Whether ``gcfg`` has MoE layers (``--num-experts``)."""
    return gcfg.num_experts is not None


def is_qwen(gcfg: GPTConfig) -> bool:
    """Whether an MoE ``gcfg`` exports as Qwen2MoeForCausalLM (it has a shared expert) rather
    than MixtralForCausalLM; not with multi-head latent attention (DeepSeek-V3's ungated shared
    experts, ``model/hf_deepseek.py``)."""
    return gcfg.moe_shared_expert_intermediate_size is not None and not gcfg.multi_latent_attention


def is_qwen3_moe(gcfg: GPTConfig) -> bool:
    """Whether an MoE ``gcfg`` exports as Qwen3MoeForCausalLM: QK-norm (``--qk-layernorm``)."""
    return is_moe(gcfg) and gcfg.qk_layernorm


def architecture(gcfg: GPTConfig) -> str:
    """The transformers class an MoE ``gcfg`` exports as."""
    if is_qwen3_moe(gcfg):
        return "Qwen3MoeForCausalLM"
    return "Qwen2MoeForCausalLM" if is_qwen(gcfg) else "MixtralForCausalLM"


def check_export(gcfg: GPTConfig) -> None:
    """Raise HFConversionError naming the first MoE setting neither Mixtral nor Qwen2-MoE
    computes (module docstring); nothing for a dense ``gcfg``."""
    if not is_moe(gcfg):
        return
    both = "MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM"
    arch = architecture(gcfg)
    free = is_qwen(gcfg) or is_qwen3_moe(gcfg)  # routers that may skip the renormalisation, dense layers
    for refused, what in (
        (
            is_qwen3_moe(gcfg) and is_qwen(gcfg),
            "--qk-layernorm with --moe-shared-expert-intermediate-size: megazero exports QK-norm with "
            "experts as Qwen3MoeForCausalLM, which has no shared expert",
        ),
        (
            gcfg.position_embedding_type != "rope",
            "--num-experts with the GPT-2 block (learned positions): "
            f"{both} are LLaMA-style; fix: --position-embedding-type rope --normalization RMSNorm --swiglu",
        ),
        (
            gcfg.add_bias_linear,
            f"--num-experts with linear biases: {both} have no biases in their linears; fix: --disable-bias-linear",
        ),
        (
            gcfg.moe_router_enable_expert_bias,
            f"--moe-router-enable-expert-bias: {both} have no expert bias in their routers",
        ),
        (gcfg.moe_router_linear_bias, f"--moe-router-linear-bias: {both} have no bias in their routers"),
        (
            gcfg.moe_router_score_function != "softmax",
            f"--moe-router-score-function {gcfg.moe_router_score_function}: {both} score the experts with a softmax",
        ),
        (
            gcfg.moe_router_num_groups is not None,
            f"--moe-router-num-groups {gcfg.moe_router_num_groups}: {both} route over all experts (no groups)",
        ),
        (
            gcfg.moe_router_topk_scaling_factor is not None,
            f"--moe-router-topk-scaling-factor {gcfg.moe_router_topk_scaling_factor}: {both} do not scale the weights",
        ),
        (
            gcfg.moe_expert_capacity_factor is not None,
            f"--moe-expert-capacity-factor {gcfg.moe_expert_capacity_factor}: {both} are dropless (no expert capacity)",
        ),
        (
            not free and gcfg.moe_router_pre_softmax,
            "--moe-router-pre-softmax without a shared "
            "expert: MixtralForCausalLM renormalises the top-k weights (Qwen2MoeForCausalLM, which can leave "
            "them, needs --moe-shared-expert-intermediate-size; Qwen3MoeForCausalLM --qk-layernorm)",
        ),
        (
            not free and gcfg.moe_layer_freq != 1,
            f"--moe-layer-freq {gcfg.moe_layer_freq} without "
            "a shared expert: every MixtralForCausalLM layer is an MoE layer (Qwen2MoeForCausalLM, which has "
            "dense layers, needs --moe-shared-expert-intermediate-size; Qwen3MoeForCausalLM --qk-layernorm)",
        ),
    ):
        if refused:
            raise HFConversionError(f"{what} (no exact {arch} equivalent)")


def moe_config(gcfg: GPTConfig, llama: dict) -> dict:
    """``config.json`` of the Mixtral or Qwen2-MoE model computing ``gcfg``'s (``check_export``
    first), from the LlamaForCausalLM ``llama`` config of the same attention and norms."""
    check_export(gcfg)
    base = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    common = {
        "num_experts_per_tok": gcfg.moe_router_topk,
        "output_router_logits": False,
        "router_aux_loss_coef": gcfg.moe_aux_loss_coeff,
    }
    dense = [i for i in range(gcfg.num_layers) if not gcfg.is_moe_layer(i)]
    if is_qwen3_moe(gcfg):  # Qwen3-MoE: Qwen3's attention (head_dim kept), routed experts only
        return {
            **base,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": False,
            "intermediate_size": gcfg.ffn_hidden_size,
            "moe_intermediate_size": gcfg.moe_ffn_hidden_size,
            "num_experts": gcfg.num_experts,
            "norm_topk_prob": not gcfg.moe_router_pre_softmax,
            "decoder_sparse_step": 1,
            "mlp_only_layers": dense,
            "use_sliding_window": every_layer_window(gcfg, "Qwen3-MoE") is not None,
            "sliding_window": every_layer_window(gcfg, "Qwen3-MoE"),
            **common,
        }
    if not is_qwen(gcfg):
        return {
            **base,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": gcfg.moe_ffn_hidden_size,
            "num_local_experts": gcfg.num_experts,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            **common,
        }
    if gcfg.kv_channels is None:
        base.pop("head_dim")  # not a Qwen2MoeConfig field: its attention then takes hidden / heads
    return {
        **base,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "intermediate_size": gcfg.ffn_hidden_size,
        "moe_intermediate_size": gcfg.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": gcfg.moe_shared_expert_intermediate_size,
        "num_experts": gcfg.num_experts,
        "norm_topk_prob": not gcfg.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "qkv_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": gcfg.num_layers,
        **common,
    }


def moe_settings_from_hf(config: Mapping) -> dict:
    """GPTConfig MoE fields of a Mixtral or Qwen2-MoE ``config.json`` (its ``intermediate_size``
    is the dense MLP's, Mixtral's that of its experts, which ``model.hf.llama_config_from_hf``
    reads as ``ffn_hidden_size``).
    Raises HFConversionError naming a key megazero computes differently or cannot read."""
    L = config_value(config, "num_hidden_layers", "size")
    positions = config_value(config, "max_position_embeddings", "size", 2048)
    if config.get("model_type") == "mixtral":
        window = config_value(config, "sliding_window", "size", None)
        if window is not None and window < positions:
            raise HFConversionError(
                f"sliding_window {window} < max_position_embeddings {positions}: megazero's attention is full causal"
            )
        ffn = config_value(config, "intermediate_size", "size")
        E, k = config_value(config, "num_local_experts", "size"), config_value(config, "num_experts_per_tok", "size")
        moe = dict(num_experts=E, moe_router_topk=k, moe_ffn_hidden_size=ffn)
    elif config.get("model_type") == "qwen3_moe":  # no shared expert; attention: hf_families.qwen3_settings_from_hf
        E = config_value(config, "num_experts", "size", None) or config_value(config, "num_local_experts", "size")
        k = config_value(config, "num_experts_per_tok", "size")
        moe = dict(
            num_experts=E,
            moe_router_topk=k,
            moe_layer_freq=_layer_freq(config, L),
            moe_ffn_hidden_size=config_value(config, "moe_intermediate_size", "size"),
            moe_router_pre_softmax=not config_value(config, "norm_topk_prob", "flag", False),
        )
    else:
        for key, ok in (("qkv_bias", False), ("use_sliding_window", False)):
            if config_value(config, key, "flag", True if key == "qkv_bias" else False) != ok:
                raise HFConversionError(
                    f"{key} true: megazero's LLaMA-style attention with experts has "
                    f"{'no q/k/v biases' if key == 'qkv_bias' else 'no sliding window'}"
                )
        freq = _layer_freq(config, L)
        E, k = config_value(config, "num_experts", "size"), config_value(config, "num_experts_per_tok", "size")
        moe = dict(
            num_experts=E,
            moe_router_topk=k,
            moe_layer_freq=freq,
            moe_ffn_hidden_size=config_value(config, "moe_intermediate_size", "size"),
            moe_shared_expert_intermediate_size=config_value(config, "shared_expert_intermediate_size", "size"),
            moe_router_pre_softmax=not config_value(config, "norm_topk_prob", "flag", False),
        )
    if k > E:
        raise HFConversionError(f"num_experts_per_tok {k} exceeds the {E} experts")
    return moe


def _layer_freq(config: Mapping, L: int) -> int:
    """``--moe-layer-freq`` of a Qwen2-MoE / Qwen3-MoE ``config.json`` of ``L`` layers: layer ``i`` is
    MoE unless in ``mlp_only_layers`` and when ``(i + 1) % decoder_sparse_step == 0``. Raises
    HFConversionError naming both keys when that set is not every n-th layer from layer 0."""
    step = config_value(config, "decoder_sparse_step", "size", 1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise HFConversionError(f"mlp_only_layers = {dense!r} is not a list of layer indices")
    layers = [i for i in range(L) if i not in dense and (i + 1) % step == 0]
    freq = next((f for f in range(1, L + 1) if layers == list(range(0, L, f))), None)
    if freq is None:
        raise HFConversionError(
            f"MoE layers {layers} (decoder_sparse_step {step}, mlp_only_layers {dense}) are "
            "not every n-th layer from layer 0, the only pattern of megazero's "
            "--moe-layer-freq"
        )
    return freq


def moe_pieces(rest: str, pre: str, gcfg: GPTConfig) -> Optional[list[tuple[str, int, Optional[int]]]]:
    """``model.hf.llama_pieces`` of an MoE MLP parameter ``rest`` (the canonical name after
    ``layers.{i}.``; ``pre`` the Hugging Face layer prefix ``model.layers.{i}.``): Mixtral's
    ``block_sparse_moe.gate`` / ``experts.j.w1, w3`` (fc1 = [gate; up]) / ``w2``, or Qwen2-MoE's
    ``mlp.gate`` / ``mlp.experts.j.gate_proj, up_proj`` / ``down_proj`` and ``mlp.shared_expert.*``.
    None for another name (attention, norms, a dense MLP: Llama's names)."""
    if not is_moe(gcfg) or not rest.startswith(("mlp.router.", "mlp.experts.", "mlp.shared_experts.")):
        return None
    qwen = is_qwen(gcfg) or is_qwen3_moe(gcfg)  # Qwen2-MoE's names, which Qwen3-MoE keeps
    moe = f"{pre}mlp." if qwen else f"{pre}block_sparse_moe."
    parts = rest.split(".")
    if rest == "mlp.router.weight":
        return [(f"{moe}gate.weight", 0, None)]
    if parts[1] == "experts" and len(parts) == 5 and parts[3:] in (["fc1", "weight"], ["fc2", "weight"]):
        expert = f"{moe}experts.{parts[2]}."
        gate, up, down = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
    elif (
        parts[1] == "shared_experts"
        and qwen
        and len(parts) == 4
        and parts[2:] in (["fc1", "weight"], ["fc2", "weight"])
    ):
        expert, (gate, up, down) = f"{moe}shared_expert.", ("gate_proj", "up_proj", "down_proj")
    else:
        return None
    if parts[-2] == "fc1":
        return [(f"{expert}{gate}.weight", 0, None), (f"{expert}{up}.weight", 0, None)]
    return [(f"{expert}{down}.weight", 0, None)]


def export_scale(canonical: str, gcfg: GPTConfig) -> float:
    """The factor the export multiplies canonical tensor ``canonical`` by (the import divides):
    2 for Qwen2-MoE's shared-expert ``down_proj`` (its gate is exactly 1/2), else 1."""
    return 2.0 if is_moe(gcfg) and is_qwen(gcfg) and canonical.endswith("mlp.shared_experts.fc2.weight") else 1.0


def _gates(gcfg: GPTConfig) -> list[str]:
    """Qwen2-MoE's ``shared_expert_gate`` tensor names of ``gcfg``'s MoE layers (none for Mixtral)."""
    if not (is_moe(gcfg) and is_qwen(gcfg)):
        return []
    return [f"model.layers.{i}.mlp.shared_expert_gate.weight" for i in range(gcfg.num_layers) if gcfg.is_moe_layer(i)]


def extra_tensors(gcfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Tensors a folder holds with no canonical counterpart: Qwen2-MoE's zero shared-expert
    gates ``[1, H]`` (fp32), one per MoE layer."""
    return {name: torch.zeros(1, gcfg.hidden_size, device="cpu") for name in _gates(gcfg)}


def check_extra_tensors(src, gcfg: GPTConfig) -> None:
    """Raise HFConversionError unless every shared-expert gate in ``src`` (a dict or a
    safetensors handle) is all zero, the gate megazero's ungated shared expert is (reads those
    ``[1, H]`` tensors only)."""
    for name in _gates(gcfg):
        gate = src.get_tensor(name) if hasattr(src, "get_tensor") else src[name]
        if bool(gate.float().ne(0).any()):
            raise HFConversionError(
                f"{name} is not zero: its shared expert is weighted by sigmoid(gate x), a "
                "per-token gate megazero's shared expert does not have (only a zero gate, "
                "a constant 1/2, converts exactly)"
            )
