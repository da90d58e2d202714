"""Hugging Face interchange for the GPT-2 block: megazero's canonical parameters <-> the
tensors and ``config.json`` of ``transformers``' ``GPT2LMHeadModel``.

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
                  "sequence_parallel", "params_dtype", "label_smoothing", "norm_backend"}
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
                                    "equivalent; only the GPT-2 block converts to GPT2LMHeadModel")


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
    """Raise HFConversionError naming the first size where ``config.json`` and the run's
    model (``gcfg``) differ, as the megazero flag to change."""
    theirs = gpt_config_from_hf(config, seq_length=gcfg.seq_length)
    for field, flag in (("vocab_size", "--vocab-size (or the tokenizer's vocabulary)"),
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
    """The canonical full tensors of a Hugging Face GPT-2 folder's ``model.safetensors``,
    read lazily (``CanonicalView``), vocabulary tensors padded to ``padded_vocab`` rows."""
    from safetensors import safe_open

    return CanonicalView(safe_open(os.path.join(path, "model.safetensors"), "pt"), gcfg, padded_vocab)


def check_folder(path: str, gcfg: GPTConfig) -> None:
    """Raise HFConversionError unless folder ``path`` holds ``gcfg``'s model: its
    ``config.json`` matches (``check_matches``) and its safetensors have every tensor.
    OSError / ValueError for an unreadable file."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        check_matches(json.load(f), gcfg)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    for name in canonical_shapes(gcfg, gcfg.vocab_size):
        target = hf_name(name)[0]
        if name == "output.weight" and gcfg.tie_embeddings:
            continue
        if target not in keys:
            raise HFConversionError(f"model.safetensors has no tensor {target!r}")


def to_hf_tensors(full: Mapping[str, torch.Tensor], gcfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT-2 tensors (fp32, contiguous) from megazero's full canonical tensors.

    Vocabulary tensors keep their ``vocab_size`` real rows. With tied embeddings
    ``lm_head.weight`` is left out (transformers ties it to ``transformer.wte.weight``).
    Raises HFConversionError for a missing or unknown parameter.
    """
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
    """Megazero's canonical full tensors read lazily from GPT-2 tensors (e.g. a safetensors
    ``safe_open`` handle): ``view[name]`` loads, transposes and pads one tensor, so a stage
    reads only its own parameters. Vocabulary tensors get ``padded_vocab`` rows."""

    def __init__(self, hf_tensors, gcfg: GPTConfig, padded_vocab: int):
        self._src, self._gcfg = hf_tensors, gcfg
        self._shapes = canonical_shapes(gcfg, padded_vocab)
        self._padded = padded_vocab

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
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
