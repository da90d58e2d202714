"""Hugging Face interchange: megazero's canonical parameters <-> the tensors and
``config.json`` of ``transformers``' ``GPT2LMHeadModel`` (GPT-2 block, learned positions) or
``LlamaForCausalLM`` (LLaMA-style block, ``--position-embedding-type rope``; the second half
of this file, from ``llama_config``).

One name map, keyed by megazero's canonical parameter names (``model.gpt.canonical_shapes``),
gives each parameter's Hugging Face name and whether it is transposed: GPT-2 stores its
linear layers as ``Conv1D`` with weights ``[in, out]``, megazero as ``[out, in]``. The fused
QKV rows are ``[q; k; v]`` with the heads contiguous inside each in both (GPT-2 splits
``c_attn``'s output in three along the features, then into heads), so no permutation is
needed. Where the two computations could differ, the map is exact or refuses:

- GELU: megazero's MLP uses the exact (erf) GELU, ``activation_function = "gelu"``; GPT-2's
  own default ``"gelu_new"`` (tanh approximation) and every other activation are refused on
  import (``HFConversionError`` names the setting).
- vocabulary: megazero pads it (``make_vocab_size_divisible_by`` x tp) with zero rows that are
  masked out of the softmax; the export keeps the ``vocab_size`` real rows, the import
  re-pads them for the layout at hand.
- biases, attention scaling (``1/sqrt(head_dim)``, no per-layer scaling, no upcast
  reordering), LayerNorm epsilon, tied or untied output layer, FFN width and positions
  are written to / checked against ``config.json``.
- any parameter or model setting this map does not know (e.g. another block type) is
  refused by name, so an export never writes a model that computes something else.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, Mapping, Optional

import torch

from megazero.runtime.extras import require
from model.config import GPTConfig
from model.gpt import VOCAB_TENSORS, canonical_shapes, resize_vocab


class HFConversionError(ValueError):
    """A model or folder that cannot be converted exactly; the message names the difference."""


# canonical name (per layer: after "layers.{i}.") -> (Hugging Face name, transposed)
_GLOBAL = {"embedding.word_embeddings.weight": ("transformer.wte.weight", False),
           "embedding.position_embeddings.weight": ("transformer.wpe.weight", False),
           "final_ln.weight": ("transformer.ln_f.weight", False),
           "final_ln.bias": ("transformer.ln_f.bias", False),
           "output.weight": ("lm_head.weight", False)}
_LAYER = {"ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
          "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
          "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
          "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
          "mlp.fc1.weight": ("mlp.c_fc.weight", True), "mlp.fc1.bias": ("mlp.c_fc.bias", False),
          "mlp.fc2.weight": ("mlp.c_proj.weight", True), "mlp.fc2.bias": ("mlp.c_proj.bias", False)}

# GPTConfig fields GPT-2's config.json expresses (or that do not change the computation);
# any other field with a non-default value is a difference the exporter refuses.
_MAPPED_FIELDS = {"vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "seq_length", "max_position_embeddings", "hidden_dropout", "attention_dropout",
                  "tie_embeddings", "layernorm_epsilon", "init_method_std", "make_vocab_size_divisible_by",
                  "sequence_parallel", "params_dtype", "label_smoothing", "norm_backend",
                  "recompute_granularity", "recompute_method", "recompute_num_layers", "tp_overlap_grad_reduce"}
_GELU = "gelu"  # transformers' ACT2FN["gelu"]: exact erf GELU, as torch.nn.functional.gelu


_RUNTIME_FIELDS = ("params_dtype", "norm_backend", "sequence_parallel")  # not the model's math


def config_record(gcfg: GPTConfig) -> dict:
    """Every GPTConfig field that defines the model (plain data, for a checkpoint's meta)."""
    return {f.name: getattr(gcfg, f.name) for f in dataclasses.fields(gcfg) if f.name not in _RUNTIME_FIELDS}


def config_from_record(record: Mapping, **settings) -> GPTConfig:
    """The GPTConfig of ``config_record``'s output; ``settings`` override (e.g. dropout 0)."""
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{**{k: v for k, v in record.items() if k in known}, **settings})


def hf_name(canonical: str) -> tuple[str, bool]:
    """(GPT-2 tensor name, transposed?) of a canonical megazero parameter name.

    Raises HFConversionError for a name the GPT-2 block does not have.
    """
    if canonical in _GLOBAL:
        return _GLOBAL[canonical]
    parts = canonical.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3 and parts[2] in _LAYER:
        name, transposed = _LAYER[parts[2]]
        return f"transformer.h.{parts[1]}.{name}", transposed
    raise HFConversionError(f"parameter {canonical!r} has no counterpart in Hugging Face's GPT2LMHeadModel")


def _check_block(gcfg: GPTConfig) -> None:
    for f in dataclasses.fields(gcfg):
        if f.name in _MAPPED_FIELDS or f.default is dataclasses.MISSING:
            continue
        if getattr(gcfg, f.name) != f.default:
            raise HFConversionError(f"model setting {f.name} = {getattr(gcfg, f.name)!r} has no GPT-2 "
                                    "equivalent; only the GPT-2 block converts to GPT2LMHeadModel (a "
                                    "LLaMA-style block, --position-embedding-type rope, to LlamaForCausalLM)")


def gpt2_config(gcfg: GPTConfig, eod: Optional[int] = None) -> dict:
    """``config.json`` of the GPT2LMHeadModel that computes what ``gcfg``'s model computes.

    ``eod``: the end-of-document id, written as BOS/EOS id. Raises HFConversionError when a
    model setting has no GPT-2 equivalent.
    """
    _check_block(gcfg)
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": gcfg.vocab_size,
            "n_positions": gcfg.max_position_embeddings, "n_embd": gcfg.hidden_size,
            "n_layer": gcfg.num_layers, "n_head": gcfg.num_attention_heads, "n_inner": gcfg.ffn_hidden_size,
            "activation_function": _GELU, "layer_norm_epsilon": gcfg.layernorm_epsilon,
            "resid_pdrop": gcfg.hidden_dropout, "embd_pdrop": gcfg.hidden_dropout,
            "attn_pdrop": gcfg.attention_dropout, "initializer_range": gcfg.init_method_std,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": gcfg.tie_embeddings,
            "bos_token_id": eod, "eos_token_id": eod, "use_cache": True, "torch_dtype": "float32"}


def gpt_config_from_hf(config: Mapping, **settings) -> GPTConfig:
    """The GPTConfig of a GPT-2 ``config.json`` (``settings``: other GPTConfig fields, e.g.
    ``seq_length`` or dropouts). Raises HFConversionError for another model type or a setting
    megazero computes differently (activation, attention scaling)."""
    if config.get("model_type") != "gpt2":
        raise HFConversionError(f"model_type {config.get('model_type')!r}: only GPT-2 (model_type 'gpt2') "
                                "folders are read")
    act = config.get("activation_function", "gelu_new")
    if act != _GELU:
        raise HFConversionError(f"activation_function {act!r}: megazero's MLP uses the exact erf GELU "
                                f"('{_GELU}'); a tanh-approximated or other activation would compute "
                                "something else")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if config.get(key, want) != want:
            raise HFConversionError(f"{key} = {config[key]!r}: megazero's attention needs {want!r}")
    hidden = config["n_embd"]
    settings.setdefault("seq_length", config["n_positions"])
    return GPTConfig(vocab_size=config["vocab_size"], num_layers=config["n_layer"], hidden_size=hidden,
                     num_attention_heads=config["n_head"], ffn_hidden_size=config.get("n_inner") or 4 * hidden,
                     max_position_embeddings=config["n_positions"],
                     tie_embeddings=config.get("tie_word_embeddings", True),
                     layernorm_epsilon=config.get("layer_norm_epsilon", 1e-5), **settings)


def check_matches(config: Mapping, gcfg: GPTConfig) -> None:
    """Raise HFConversionError naming the first size or block option where ``config.json``
    (GPT-2 or LLaMA) and the run's model (``gcfg``) differ, as the megazero flag to change."""
    theirs = config_from_hf(config, seq_length=gcfg.seq_length)
    for field, flag in (("position_embedding_type", "--position-embedding-type"),
                        ("normalization", "--normalization"), ("swiglu", "--swiglu"),
                        ("kv_heads", "--group-query-attention --num-query-groups"),
                        ("rotary_base", "--rotary-base"), ("add_bias_linear", "--disable-bias-linear"),("vocab_size", "--vocab-size (or the tokenizer's vocabulary)"),
                        ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                        ("num_attention_heads", "--num-attention-heads"),
                        ("ffn_hidden_size", "--ffn-hidden-size"),
                        ("max_position_embeddings", "--max-position-embeddings"),
                        ("tie_embeddings", "--untie-embeddings-and-output-weights"),
                        ("layernorm_epsilon", "--layernorm-epsilon")):
        if getattr(theirs, field) != getattr(gcfg, field):
            raise HFConversionError(f"the folder's model has {field} = {getattr(theirs, field)}, this run "
                                    f"{getattr(gcfg, field)}; fix: set {flag} to match")


def open_folder(path: str, gcfg: GPTConfig, padded_vocab: int) -> "CanonicalView":
    """The canonical full tensors of a Hugging Face GPT-2 or Llama folder's ``model.safetensors``,
    read lazily (``CanonicalView``), vocabulary tensors padded to ``padded_vocab`` rows.
    Raises MissingExtra (megazero.runtime.extras) without safetensors."""
    safe_open = require("safetensors", "--from-hf").safe_open
    return CanonicalView(safe_open(os.path.join(path, "model.safetensors"), "pt"), gcfg, padded_vocab)


def check_folder(path: str, gcfg: GPTConfig) -> None:
    """Raise HFConversionError unless folder ``path`` holds ``gcfg``'s model: its
    ``config.json`` matches (``check_matches``) and its safetensors have every tensor.
    OSError / ValueError for an unreadable file; MissingExtra without safetensors."""
    safe_open = require("safetensors", "--from-hf").safe_open
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        check_matches(json.load(f), gcfg)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    for name in canonical_shapes(gcfg, gcfg.vocab_size):
        if name == "output.weight" and gcfg.tie_embeddings:
            continue
        targets = [p[0] for p in llama_pieces(name, gcfg)] if is_llama(gcfg) else [hf_name(name)[0]]
        for target in targets:
            if target not in keys:
                raise HFConversionError(f"model.safetensors has no tensor {target!r}")


def to_hf_tensors(full: Mapping[str, torch.Tensor], gcfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT-2 tensors (fp32, contiguous) from megazero's full canonical tensors.

    Vocabulary tensors keep their ``vocab_size`` real rows. With tied embeddings
    ``lm_head.weight`` is left out (transformers ties it to ``transformer.wte.weight``).
    Raises HFConversionError for a missing or unknown parameter. A LLaMA-style ``gcfg`` gives
    LlamaForCausalLM's tensors (``to_llama_tensors``).
    """
    if is_llama(gcfg):
        return to_llama_tensors(full, gcfg)
    _check_block(gcfg)
    out = {}
    for name in canonical_shapes(gcfg, gcfg.vocab_size):
        if name not in full:
            raise HFConversionError(f"the checkpoint lacks parameter {name!r}")
        target, transposed = hf_name(name)
        t = full[name].float()
        t = t[:gcfg.vocab_size] if name in VOCAB_TENSORS else t
        out[target] = (t.t() if transposed else t).contiguous()
    unknown = sorted(set(full) - set(canonical_shapes(gcfg, gcfg.vocab_size)))
    if unknown:
        raise HFConversionError(f"parameter {unknown[0]!r} has no counterpart in GPT2LMHeadModel")
    return out


class CanonicalView(Mapping):
    """Megazero's canonical full tensors read lazily from GPT-2 or (LLaMA-style ``gcfg``)
    LlamaForCausalLM tensors (e.g. a safetensors ``safe_open`` handle): ``view[name]`` loads,
    transposes or joins (``llama_pieces``) and pads one tensor, so a stage reads only its own
    parameters. Vocabulary tensors get ``padded_vocab`` rows."""

    def __init__(self, hf_tensors, gcfg: GPTConfig, padded_vocab: int):
        self._src, self._gcfg = hf_tensors, gcfg
        self._shapes = canonical_shapes(gcfg, padded_vocab)
        self._padded = padded_vocab

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        if is_llama(self._gcfg):
            t, target = _join_llama(self._src, name, self._gcfg), name
        else:
            target, transposed = hf_name(name)
            if name == "output.weight" and self._gcfg.tie_embeddings:
                target = "transformer.wte.weight"
            t = _get(self._src, target).float()
            t = t.t().contiguous() if transposed else t
        if name in VOCAB_TENSORS:
            t = resize_vocab(t, self._gcfg.vocab_size, self._padded)
        if tuple(t.shape) != tuple(self._shapes[name]):
            raise HFConversionError(f"{target} has shape {tuple(t.shape)}, megazero's {name} needs "
                                    f"{tuple(self._shapes[name])}")
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def _get(src, key: str) -> torch.Tensor:
    """``src[key]`` of a dict or a safetensors handle; HFConversionError naming a missing key."""
    if key not in set(src.keys()):
        raise HFConversionError(f"the folder's model.safetensors has no tensor {key!r}")
    return src.get_tensor(key) if hasattr(src, "get_tensor") else src[key]


# ---- LLaMA-style block <-> LlamaForCausalLM ------------------------------------------------
# LlamaForCausalLM (transformers' modeling_llama) computes exactly megazero's LLaMA-style block
# when: RoPE on the whole head (rotate-half pairs (x_j, x_{j+d/2}), inv_freq = theta^(-2j/d),
# as model/rope.py), RMSNorm (x * rsqrt(mean x^2 + eps) * w), SwiGLU MLP down(silu(gate) * up),
# key/value head j serving query heads j*heads/G .. (j+1)*heads/G - 1 (repeat_kv), scaling
# 1/sqrt(head_dim), one bias flag for q/k/v/o (attention_bias) and one for gate/up/down
# (mlp_bias). Its linears are [out, in] like megazero's, so nothing is transposed; the fused
# canonical tensors are split by rows.
_LLAMA_GLOBAL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                 "final_ln.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LLAMA_LAYER = {"ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
                "attn.proj.weight": "self_attn.o_proj.weight", "attn.proj.bias": "self_attn.o_proj.bias",
                "mlp.fc2.weight": "mlp.down_proj.weight", "mlp.fc2.bias": "mlp.down_proj.bias"}
_LLAMA_FIELDS = {"position_embedding_type", "rotary_base", "rotary_percent", "normalization", "swiglu",
                 "num_query_groups", "add_bias_linear"}


def is_llama(gcfg: GPTConfig) -> bool:
    """Whether ``gcfg`` converts to LlamaForCausalLM (rotary positions) rather than GPT-2."""
    return gcfg.position_embedding_type == "rope"


def _check_llama(gcfg: GPTConfig) -> None:
    """Raise HFConversionError naming the first setting LlamaForCausalLM cannot express."""
    for ok, what in ((gcfg.normalization == "RMSNorm", f"--normalization {gcfg.normalization}: "
                      "LlamaForCausalLM has RMSNorm only; fix: --normalization RMSNorm"),
                     (gcfg.swiglu, "a GELU MLP (no --swiglu): LlamaForCausalLM's MLP is the SwiGLU "
                      "down(silu(gate) * up); fix: --swiglu"),
                     (gcfg.rotary_percent == 1.0, f"--rotary-percent {gcfg.rotary_percent}: "
                      "LlamaForCausalLM rotates the whole head (no partial rotary); fix: --rotary-percent 1.0")):
        if not ok:
            raise HFConversionError(f"{what} (no exact LlamaForCausalLM equivalent)")
    for f in dataclasses.fields(gcfg):
        if f.name in _MAPPED_FIELDS | _LLAMA_FIELDS or f.default is dataclasses.MISSING:
            continue
        if getattr(gcfg, f.name) != f.default:
            raise HFConversionError(f"model setting {f.name} = {getattr(gcfg, f.name)!r} has no "
                                    "LlamaForCausalLM equivalent")


def llama_config(gcfg: GPTConfig, eod: Optional[int] = None) -> dict:
    """``config.json`` of the LlamaForCausalLM that computes what ``gcfg``'s model computes
    (``rope_theta`` both top-level, as transformers 4 reads it, and in ``rope_parameters``, as
    transformers 5 does). Raises HFConversionError for a setting Llama cannot express."""
    _check_llama(gcfg)
    theta = float(gcfg.rotary_base)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": gcfg.vocab_size,
            "hidden_size": gcfg.hidden_size, "intermediate_size": gcfg.ffn_hidden_size,
            "num_hidden_layers": gcfg.num_layers, "num_attention_heads": gcfg.num_attention_heads,
            "num_key_value_heads": gcfg.kv_heads, "head_dim": gcfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": gcfg.max_position_embeddings, "rms_norm_eps": gcfg.layernorm_epsilon,
            "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "attention_bias": gcfg.add_bias_linear, "mlp_bias": gcfg.add_bias_linear,
            "attention_dropout": gcfg.attention_dropout, "initializer_range": gcfg.init_method_std,
            "tie_word_embeddings": gcfg.tie_embeddings, "pretraining_tp": 1, "bos_token_id": eod,
            "eos_token_id": eod, "use_cache": True, "torch_dtype": "float32"}


def llama_config_from_hf(config: Mapping, **settings) -> GPTConfig:
    """The LLaMA-style GPTConfig of a Llama ``config.json`` (``settings`` as in
    ``gpt_config_from_hf``). Raises HFConversionError for a missing size or a setting megazero
    computes differently (activation, RoPE scaling or partial rotary, head_dim, biases)."""
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in config]
    if missing:
        raise HFConversionError(f"config.json of model_type 'llama' lacks {missing[0]!r}")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    H, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    for ok, what in ((config.get("hidden_act", "silu") == "silu", f"hidden_act {config.get('hidden_act')!r}: "
                      "megazero's SwiGLU gate is silu"),
                     (rope.get("rope_type", rope.get("type", "default")) == "default",
                      f"rope type {rope.get('rope_type', rope.get('type'))!r}: megazero's RoPE is unscaled"),
                     (rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) == 1.0,
                      "partial_rotary_factor != 1: megazero's LLaMA export rotates whole heads"),
                     (config.get("head_dim", H // heads) * heads == H, f"head_dim {config.get('head_dim')} * "
                      f"heads {heads} != hidden_size {H}: megazero's heads split the hidden size"),
                     (config.get("attention_bias", False) == config.get("mlp_bias", False),
                      "attention_bias != mlp_bias: megazero has one bias flag (--disable-bias-linear)")):
        if not ok:
            raise HFConversionError(what)
    settings.setdefault("seq_length", config.get("max_position_embeddings", 2048))
    return GPTConfig(vocab_size=config["vocab_size"], num_layers=config["num_hidden_layers"], hidden_size=H,
                     num_attention_heads=heads, ffn_hidden_size=config["intermediate_size"],
                     max_position_embeddings=config.get("max_position_embeddings", 2048),
                     position_embedding_type="rope", rotary_base=int(theta) if float(theta).is_integer() else theta,
                     normalization="RMSNorm", swiglu=True, num_query_groups=None if kv == heads else kv,
                     add_bias_linear=config.get("attention_bias", False),
                     tie_embeddings=config.get("tie_word_embeddings", False),
                     layernorm_epsilon=config.get("rms_norm_eps", 1e-6), **settings)


def hf_config(gcfg: GPTConfig, eod: Optional[int] = None) -> dict:
    """``config.json`` for ``gcfg``: Llama for a rotary (LLaMA-style) block, else GPT-2."""
    return llama_config(gcfg, eod) if is_llama(gcfg) else gpt2_config(gcfg, eod)


def config_from_hf(config: Mapping, **settings) -> GPTConfig:
    """The GPTConfig of a GPT-2 or Llama ``config.json``; HFConversionError for another type."""
    if config.get("model_type") == "llama":
        return llama_config_from_hf(config, **settings)
    if config.get("model_type") != "gpt2":
        raise HFConversionError(f"model_type {config.get('model_type')!r}: only GPT-2 (model_type 'gpt2') "
                                "and LLaMA (model_type 'llama') folders are read")
    return gpt_config_from_hf(config, **settings)


def llama_pieces(canonical: str, gcfg: GPTConfig) -> list[tuple[str, int, Optional[int]]]:
    """Llama row pieces ``(name, start, stop)`` whose concatenation (in order, stop None =
    all rows) is megazero's canonical tensor ``canonical``.

    Grouped QKV (G groups): per group ``[q of its heads/G heads; k; v]`` (model/spec.py), so
    group ``g`` takes q_proj rows ``g*n .. (g+1)*n`` (``n = heads/G * head_dim``) and k_proj /
    v_proj rows ``g*d .. (g+1)*d``; multi-head QKV is ``[q; k; v]``; SwiGLU fc1 is ``[gate;
    up]``. Raises HFConversionError for a name the LLaMA-style block does not have.
    """
    if canonical in _LLAMA_GLOBAL:
        return [(_LLAMA_GLOBAL[canonical], 0, None)]
    parts = canonical.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3:
        pre, rest = f"model.layers.{parts[1]}.", parts[2]
        kind = rest.rsplit(".", 1)[-1]
        if rest in _LLAMA_LAYER:
            return [(pre + _LLAMA_LAYER[rest], 0, None)]
        if rest in ("attn.qkv.weight", "attn.qkv.bias"):
            q, k, v = (f"{pre}self_attn.{x}_proj.{kind}" for x in "qkv")
            if gcfg.num_query_groups is None:
                return [(q, 0, None), (k, 0, None), (v, 0, None)]
            d, n = gcfg.head_dim, gcfg.num_attention_heads // gcfg.kv_heads * gcfg.head_dim
            return [p for g in range(gcfg.kv_heads)
                    for p in ((q, g * n, (g + 1) * n), (k, g * d, (g + 1) * d), (v, g * d, (g + 1) * d))]
        if rest in ("mlp.fc1.weight", "mlp.fc1.bias"):
            return [(f"{pre}mlp.gate_proj.{kind}", 0, None), (f"{pre}mlp.up_proj.{kind}", 0, None)]
    raise HFConversionError(f"parameter {canonical!r} has no counterpart in LlamaForCausalLM")


def to_llama_tensors(full: Mapping[str, torch.Tensor], gcfg: GPTConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM tensors (fp32, contiguous) from megazero's full canonical tensors:
    fused tensors split by ``llama_pieces``, vocabulary tensors cut to ``vocab_size`` rows,
    ``lm_head.weight`` left out when tied. Raises HFConversionError for a setting Llama cannot
    express or a missing / unknown parameter."""
    _check_llama(gcfg)
    names = canonical_shapes(gcfg, gcfg.vocab_size)
    unknown = sorted(set(full) - set(names))
    if unknown:
        raise HFConversionError(f"parameter {unknown[0]!r} has no counterpart in LlamaForCausalLM")
    pieces: dict[str, list] = {}
    for name in names:
        if name not in full:
            raise HFConversionError(f"the checkpoint lacks parameter {name!r}")
        t = full[name].float()
        t = t[:gcfg.vocab_size] if name in VOCAB_TENSORS else t
        parts = llama_pieces(name, gcfg)
        sizes = [t.shape[0] // len(parts) if stop is None else stop - start for _, start, stop in parts]
        for (target, _, _), piece in zip(parts, t.split(sizes)):
            pieces.setdefault(target, []).append(piece)
    return {target: torch.cat(ps).contiguous() for target, ps in pieces.items()}


def _join_llama(src, canonical: str, gcfg: GPTConfig) -> torch.Tensor:
    """Canonical tensor ``canonical`` (unpadded) read from Llama tensors ``src``."""
    if canonical == "output.weight" and gcfg.tie_embeddings:
        canonical = "embedding.word_embeddings.weight"
    loaded: dict[str, torch.Tensor] = {}
    out = []
    for target, start, stop in llama_pieces(canonical, gcfg):
        if target not in loaded:
            loaded[target] = _get(src, target).float()
        out.append(loaded[target][start:stop])
    return torch.cat(out)
