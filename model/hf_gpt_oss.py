"""Hugging Face interchange of OpenAI's gpt-oss (``model_type`` ``gpt_oss``, ``GptOssForCausalLM``):
its ``config.json`` and the tensors that differ from ``model/hf.py``'s Llama map. Like that file it
reads no file (``model/hf_folder.py`` does, and asks ``packed_names`` about MXFP4 tensors).

What gpt-oss computes (transformers 5's ``modeling_gpt_oss``, read for this map), and megazero's
settings for each piece:

- attention: Llama's with biases on q, k, v and o (``attention_bias``, true in the released
  models), heads of ``head_dim`` (``--kv-channels``), grouped-query, and a learned sink logit per
  head in every softmax (``self_attn.sinks``: ``--softmax-type learnable``, ``attn.sinks``);
  ``layer_types`` alternate ``sliding_attention`` (``sliding_window`` W keys) and
  ``full_attention``: ``--window-size W-1,0`` with ``--window-attn-skip-freq`` listing the layers;
  RoPE of rope type ``yarn`` (``model.rope``; ``truncate`` false in the released models).
- every MLP is a Mixture of Experts: the router is a linear with a bias (``mlp.router.weight
  [E, H]``, ``mlp.router.bias [E]``: ``--moe-router-linear-bias``), the top-k of its
  logits are softmaxed over the k (megazero's softmax router without ``--moe-router-pre-softmax``),
  and each expert computes ``down((up + 1) * g * sigmoid(1.702 g)) + b`` with ``g`` = the gate
  clamped to at most ``swiglu_limit`` and ``up`` clamped to ``[-limit, limit]``: ``--quick-geglu
  --glu-linear-offset 1 --activation-func-clamp-value limit`` (Megatron-LM's gpt-oss flags), with
  biases (``--add-bias-linear``, the default). The experts of a layer are stacked:
  ``gate_up_proj [E, H, 2F]`` (``x @ W``; gate and up columns interleaved, gate first),
  ``gate_up_proj_bias [E, 2F]`` (the same interleaving), ``down_proj [E, F, H]``,
  ``down_proj_bias [E, H]``; megazero's ``experts.{j}.fc1`` is ``[gate; up]`` ``[2F, H]`` and
  ``fc2`` ``[H, F]``, so the map transposes and de-interleaves. ``intermediate_size`` is F.
- a released folder (``quantization_config.quant_method`` ``mxfp4``) holds ``gate_up_proj`` and
  ``down_proj`` as ``*_blocks`` / ``*_scales`` (MXFP4, ``model/mxfp4.py``), rows as ``[out, in]``;
  they are dequantized to fp32 on import (exact: every MXFP4 value is an fp32 number). The export
  writes the weights unquantized.
- norms RMSNorm (``rms_norm_eps``), untied output (``tie_word_embeddings`` false in the releases).

``KEYS`` classifies every key of ``GptOssConfig().to_dict()`` (plus ``quantization_config`` and
the legacy rope keys) as mapped, checked or without effect; ``model.hf_families.check_keys``
refuses any other.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from model import hf_families
from model.config import GPTConfig
from model.hf_config import HFConversionError, config_value
from model.mxfp4 import dequantize_mxfp4

MODEL_TYPE = "gpt_oss"
QUICK_GELU_ALPHA = 1.702  # transformers' swiglu_alpha default; megazero's --quick-geglu constant

KEYS = {
    "mapped": hf_families.COMMON_MAPPED
    + ("head_dim", "num_local_experts", "num_experts", "num_experts_per_tok", "sliding_window", "layer_types")
    + ("swiglu_limit", "quantization_config"),
    "checked": ("swiglu_alpha", "attention_bias"),
    "no_effect": {
        **hf_families.COMMON_NO_EFFECT,
        **hf_families.ROUTER_NO_EFFECT,
        "hidden_act": "read by no gpt-oss layer (its experts' activation is the clamped quick GEGLU)",
    },
}

# GPTConfig fields a gpt-oss export expresses beyond Llama's (model.hf._check_llama)
FIELDS = {
    "softmax_type",
    "quick_geglu",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "window_size",
    "window_attn_skip_freq",
}

# canonical expert tensor (after "mlp.experts.{j}.") -> the stacked tensor of the layer
_EXPERT = {
    "fc1.weight": "gate_up_proj",
    "fc1.bias": "gate_up_proj_bias",
    "fc2.weight": "down_proj",
    "fc2.bias": "down_proj_bias",
}
_LAYER = {
    "attn.sinks": "self_attn.sinks",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
}


def is_gpt_oss(gcfg: GPTConfig) -> bool:
    """Whether ``gcfg`` converts as GptOssForCausalLM: read from a ``gpt_oss`` folder, or with
    learned attention sinks (no other family has them)."""
    return gcfg.hf_model_type == MODEL_TYPE or gcfg.softmax_type == "learnable"


def window_fields(config: Mapping, num_layers: int, positions: int) -> dict:
    """``window_size`` / ``window_attn_skip_freq`` of a gpt-oss config's ``layer_types`` (transformers'
    default when absent: even layers sliding) and ``sliding_window`` W (``hf_families.window_settings``).
    Raises HFConversionError naming ``layer_types`` for another layer type or a list of the wrong
    length, ``sliding_window`` for sliding layers without a window."""
    window = config_value(config, "sliding_window", "size", None)
    types = config.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
    ]
    if not isinstance(types, list) or len(types) != num_layers:
        raise HFConversionError(f"layer_types = {str(types)[:60]} is not a list of {num_layers} layer types")
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if bad:
        raise HFConversionError(f"layer_types holds {bad[0]!r}: gpt-oss layers are sliding_attention or full_attention")
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and window is None:
        raise HFConversionError("layer_types has sliding_attention layers but sliding_window is null")
    return hf_families.window_settings(sliding, window, positions)


def settings_from_hf(config: Mapping) -> dict:
    """GPTConfig fields of a ``gpt_oss`` ``config.json`` (all of them but the overrides a run
    gives). Raises HFConversionError naming a key megazero computes differently."""
    hf_families.check_keys(config, KEYS)
    if config_value(config, "attention_bias", "flag", True) is not True:
        raise HFConversionError(
            "attention_bias false: gpt-oss then has no q/k/v/o biases but keeps the experts' and the router's, "
            "which no megazero block does (its biases are all on or all off)"
        )
    alpha = config_value(config, "swiglu_alpha", "number", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise HFConversionError(f"swiglu_alpha {alpha}: megazero's --quick-geglu gate is x * sigmoid(1.702 x)")
    quant = config.get("quantization_config")
    if quant is not None and (not isinstance(quant, Mapping) or quant.get("quant_method") != "mxfp4"):
        raise HFConversionError(
            f"quantization_config {str(quant)[:60]}: megazero reads gpt-oss experts unquantized or as MXFP4 only"
        )
    H, heads = config_value(config, "hidden_size", "size"), config_value(config, "num_attention_heads", "size")
    L = config_value(config, "num_hidden_layers", "size")
    positions = config_value(config, "max_position_embeddings", "size", 131072)
    rope = config_value(config, "rope_parameters", "table", None) or config_value(config, "rope_scaling", "table", {})
    theta = config_value(rope, "rope_theta", "number", config_value(config, "rope_theta", "number", 150000.0))
    kv = config_value(config, "num_key_value_heads", "size", heads)
    head_dim = config_value(config, "head_dim", "size", H // heads)
    E = config_value(config, "num_local_experts", "size", None) or config_value(config, "num_experts", "size")
    k = config_value(config, "num_experts_per_tok", "size")
    if k > E:
        raise HFConversionError(f"num_experts_per_tok {k} exceeds the {E} experts")
    F = config_value(config, "intermediate_size", "size")
    return dict(
        vocab_size=config_value(config, "vocab_size", "size"),
        num_layers=L,
        hidden_size=H,
        num_attention_heads=heads,
        ffn_hidden_size=F,
        max_position_embeddings=positions,
        seq_length=positions,
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        normalization="RMSNorm",
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(config_value(config, "swiglu_limit", "number", 7.0)),
        num_query_groups=None if kv == heads else kv,
        kv_channels=None if head_dim * heads == H else head_dim,
        add_bias_linear=True,
        softmax_type="learnable",
        tie_embeddings=config_value(config, "tie_word_embeddings", "flag", False),
        layernorm_epsilon=config_value(config, "rms_norm_eps", "number", 1e-5),
        num_experts=E,
        moe_router_topk=k,
        moe_router_linear_bias=True,
        moe_ffn_hidden_size=F,
        hf_model_type=MODEL_TYPE,
        **hf_families.rope_settings_from_hf(rope, positions),
        **window_fields(config, L, positions),
    )


def check_export(gcfg: GPTConfig) -> None:
    """Raise HFConversionError naming the first setting of ``gcfg`` that GptOssForCausalLM does not
    compute (module docstring)."""
    for refused, what in (
        (gcfg.num_experts is None, "no --num-experts: every gpt-oss MLP is a Mixture of Experts"),
        (gcfg.moe_layer_freq != 1, f"--moe-layer-freq {gcfg.moe_layer_freq}: every gpt-oss layer is an MoE layer"),
        (gcfg.moe_shared_expert_intermediate_size is not None, "a shared expert: gpt-oss has none"),
        (gcfg.softmax_type != "learnable", f"--softmax-type {gcfg.softmax_type}: gpt-oss learns a sink per head"),
        (not gcfg.add_bias_linear, "--disable-bias-linear: gpt-oss has biases on q/k/v/o, the router and experts"),
        (gcfg.add_qkv_bias and not gcfg.add_bias_linear, "--add-qkv-bias"),
        (gcfg.qk_layernorm, "--qk-layernorm: gpt-oss has no QK-norm"),
        (gcfg.swiglu, "--swiglu: gpt-oss's experts use --quick-geglu"),
        (not gcfg.quick_geglu, "no --quick-geglu: gpt-oss's gate is x * sigmoid(1.702 x)"),
        (gcfg.glu_linear_offset != 1.0, f"--glu-linear-offset {gcfg.glu_linear_offset}: gpt-oss multiplies by up + 1"),
        (gcfg.activation_func_clamp_value is None, "no --activation-func-clamp-value: gpt-oss clamps (swiglu_limit)"),
        (not gcfg.moe_router_linear_bias, "no --moe-router-linear-bias: gpt-oss's router has a bias"),
        (gcfg.moe_router_score_function != "softmax", "a sigmoid router: gpt-oss softmaxes its top-k logits"),
        (gcfg.moe_router_pre_softmax, "--moe-router-pre-softmax: gpt-oss softmaxes over the top-k logits"),
        (gcfg.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias: gpt-oss has no expert bias"),
        (gcfg.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor: gpt-oss is dropless"),
        (gcfg.moe_router_num_groups is not None, "--moe-router-num-groups: gpt-oss routes over all experts"),
        (gcfg.moe_router_topk_scaling_factor is not None, "--moe-router-topk-scaling-factor: gpt-oss is unscaled"),
        (gcfg.rotary_percent != 1.0, f"--rotary-percent {gcfg.rotary_percent}: gpt-oss rotates whole heads"),
    ):
        if refused:
            raise HFConversionError(f"{what} (no exact GptOssForCausalLM equivalent)")
    windows = {gcfg.attention_window(i) for i in range(gcfg.num_layers)} - {None}
    if len(windows) > 1:
        raise HFConversionError(f"layers with windows {sorted(windows)}: gpt-oss has one sliding_window")


def gpt_oss_config(llama: dict, gcfg: GPTConfig) -> dict:
    """``config.json`` of the GptOssForCausalLM computing ``gcfg``'s model (``check_export``
    first), from the LlamaForCausalLM ``llama`` config of the same attention, norms and RoPE."""
    check_export(gcfg)
    windows = [gcfg.attention_window(i) for i in range(gcfg.num_layers)]
    keep = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "attention_dropout",
        "initializer_range",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "use_cache",
    )
    return {
        **{key: llama[key] for key in keep},
        "architectures": ["GptOssForCausalLM"],
        "model_type": MODEL_TYPE,
        "intermediate_size": gcfg.moe_ffn_hidden_size,
        "num_local_experts": gcfg.num_experts,
        "num_experts_per_tok": gcfg.moe_router_topk,
        "attention_bias": True,
        "hidden_act": "silu",
        "swiglu_alpha": QUICK_GELU_ALPHA,
        "swiglu_limit": gcfg.activation_func_clamp_value,
        "sliding_window": next((w for w in windows if w is not None), None),
        "layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows],
        "output_router_logits": False,
        "router_aux_loss_coef": gcfg.moe_aux_loss_coeff,
        "dtype": "float32",
    }


def layer_pieces(rest: str, pre: str) -> Optional[list[tuple[str, int, Optional[int]]]]:
    """``model.hf.llama_pieces`` of a gpt-oss layer tensor ``rest`` that is not Llama's (the sinks,
    the router's weight and bias; ``pre`` = ``model.layers.{i}.``), or None."""
    if rest in _LAYER:
        return [(pre + _LAYER[rest], 0, None)]
    return None


def expert_source(canonical: str) -> Optional[tuple[str, int, str]]:
    """``(stacked Hugging Face name, expert j, canonical part)`` of an expert tensor
    ``layers.{i}.mlp.experts.{j}.{fc1|fc2}.{weight|bias}``, or None for another name."""
    parts = canonical.split(".")
    if len(parts) != 7 or parts[0] != "layers" or parts[2:4] != ["mlp", "experts"]:
        return None
    part = ".".join(parts[5:])
    if part not in _EXPERT:
        return None
    return f"model.layers.{parts[1]}.mlp.experts.{_EXPERT[part]}", int(parts[4]), part


def expert_shapes(gcfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The stacked expert tensors of every layer and their shapes in a (unquantized) folder."""
    E, H, F = gcfg.num_experts, gcfg.hidden_size, gcfg.moe_ffn_hidden_size
    shapes = {"gate_up_proj": (E, H, 2 * F), "gate_up_proj_bias": (E, 2 * F), "down_proj": (E, F, H)}
    shapes["down_proj_bias"] = (E, H)
    return {f"model.layers.{i}.mlp.experts.{n}": s for i in range(gcfg.num_layers) for n, s in shapes.items()}


def packed_names(name: str) -> Optional[tuple[str, str]]:
    """The MXFP4 ``(blocks, scales)`` names a released folder holds for stacked weight ``name``
    (``gate_up_proj``, ``down_proj``), None for another tensor (biases are never packed)."""
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return f"{name}_blocks", f"{name}_scales"
    return None


def packed_shapes(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of ``packed_names(name)`` for the unquantized ``shape [E, in, out]``: blocks
    ``[E, out, in/32, 16]`` and scales ``[E, out, in/32]`` (rows stored ``[out, in]``)."""
    E, fan_in, fan_out = shape
    return (E, fan_out, fan_in // 32, 16), (E, fan_out, fan_in // 32)


def _tensor(src, key: str) -> torch.Tensor:
    return src.get_tensor(key) if hasattr(src, "get_tensor") else src[key]


def read_stacked(src, name: str) -> torch.Tensor:
    """Stacked expert tensor ``name`` of ``src`` (a dict or a safetensors handle) in fp32, in the
    unquantized layout (``expert_shapes``): read as it is, or dequantized from its MXFP4 blocks and
    scales. Raises HFConversionError naming the tensor when neither form is there."""
    keys = set(src.keys())
    if name in keys:
        return _tensor(src, name).float()
    packed = packed_names(name)
    if packed is not None and all(p in keys for p in packed):
        blocks, scales = (_tensor(src, p) for p in packed)
        return dequantize_mxfp4(blocks, scales, transpose=True)  # (E, in, out)
    raise HFConversionError(f"the folder's safetensors files have no tensor {name!r}")


def expert_tensor(stacked: torch.Tensor, j: int, part: str) -> torch.Tensor:
    """Canonical expert tensor ``part`` of expert ``j`` from its layer's stacked fp32 tensor."""
    t = stacked[j]
    if part == "fc1.weight":  # (H, 2F), columns gate0, up0, gate1, ... -> [gate; up] rows (2F, H)
        return torch.cat([t[:, 0::2].t(), t[:, 1::2].t()]).contiguous()
    if part == "fc1.bias":
        return torch.cat([t[0::2], t[1::2]])
    if part == "fc2.weight":  # (F, H) -> (H, F)
        return t.t().contiguous()
    return t.clone()


def expert_tensors(full: Mapping[str, torch.Tensor], gcfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The stacked expert tensors (fp32, unquantized) of megazero's full canonical tensors."""
    out = {}
    F = gcfg.moe_ffn_hidden_size
    for i in range(gcfg.num_layers):
        experts = [f"layers.{i}.mlp.experts.{j}." for j in range(gcfg.num_experts)]
        gate_up = []
        for e in experts:
            w = full[e + "fc1.weight"].float()  # (2F, H) = [gate; up]
            inter = torch.empty(w.shape[1], 2 * F, device=w.device)
            inter[:, 0::2], inter[:, 1::2] = w[:F].t(), w[F:].t()
            gate_up.append(inter)
        pre = f"model.layers.{i}.mlp.experts."
        out[pre + "gate_up_proj"] = torch.stack(gate_up)
        biases = []
        for e in experts:
            b = full[e + "fc1.bias"].float()
            inter = torch.empty(2 * F, device=b.device)
            inter[0::2], inter[1::2] = b[:F], b[F:]
            biases.append(inter)
        out[pre + "gate_up_proj_bias"] = torch.stack(biases)
        out[pre + "down_proj"] = torch.stack([full[e + "fc2.weight"].float().t() for e in experts]).contiguous()
        out[pre + "down_proj_bias"] = torch.stack([full[e + "fc2.bias"].float() for e in experts])
    return out
