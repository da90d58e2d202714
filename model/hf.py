"""Hugging Face interchange: megazero's canonical parameters <-> the tensors and
``config.json`` of ``transformers``' ``GPT2LMHeadModel`` (GPT-2 block, learned positions) or
``LlamaForCausalLM`` (LLaMA-style block, ``--position-embedding-type rope``; the second half
of this file, from ``llama_config``; Llama-3.x's RoPE scaling, ``MistralForCausalLM``,
``Qwen2ForCausalLM``'s q/k/v biases and ``Qwen3ForCausalLM``'s QK-norm and head size:
``model/hf_families.py``), and with
experts ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM``
(``model/hf_moe.py`` adds their MoE MLPs to the Llama map), ``GptOssForCausalLM``
(``model/hf_gpt_oss.py``) and, with multi-head latent attention, ``DeepseekV3ForCausalLM``
(``model/hf_deepseek.py``).

One name map, keyed by megazero's canonical parameter names (``model.gpt.canonical_shapes``),
gives each parameter's Hugging Face name and whether it is transposed: GPT-2 stores its
linear layers as ``Conv1D`` with weights ``[in, out]``, megazero as ``[out, in]``. The fused
QKV rows are ``[q; k; v]`` with the heads contiguous inside each in both (GPT-2 splits
``c_attn``'s output in three along the features, then into heads), so no permutation is
needed. Where the two computations could differ, the map is exact or refuses:

- GELU: megazero's MLP uses the exact (erf) GELU, ``activation_function = "gelu"``, or with
  ``openai_gelu`` (``--openai-gelu``) the tanh approximation, ``"gelu_new"`` (GPT-2's own
  default, that of ``GPT2Config()`` and the public checkpoints; ``"gelu_pytorch_tanh"`` is the
  same function, read as the same). Every other activation is refused on import
  (``HFConversionError`` names the setting).
- vocabulary: megazero pads it (``make_vocab_size_divisible_by`` x tp) with zero rows that are
  masked out of the softmax; the export keeps the ``vocab_size`` real rows, the import
  re-pads them for the layout at hand.
- biases, attention scaling (``1/sqrt(head_dim)``, no per-layer scaling, no upcast
  reordering), LayerNorm epsilon, tied or untied output layer, FFN width and positions
  are written to / checked against ``config.json``.
- any parameter or model setting this map does not know (e.g. another block type) is
  refused by name, so an export never writes a model that computes something else.

This file reads no file: ``model/hf_folder.py`` reads a folder from disk, turns the readers'
errors into HFConversionError and checks every tensor's shape against ``hf_shapes``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping, Optional

import torch

from megazero.config.schema import setting_named
from model import hf_deepseek, hf_families, hf_gpt_oss, hf_moe
from model.config import MLA_FIELDS, ROPE_SCALING_FIELDS, YARN_FIELDS, GPTConfig
from model.gpt import VOCAB_TENSORS, canonical_shapes, resize_vocab
from model.hf_config import HFConversionError
from model.hf_config import config_value as _value

# canonical name (per layer: after "layers.{i}.") -> (Hugging Face name, transposed)
_GLOBAL = {
    "embedding.word_embeddings.weight": ("transformer.wte.weight", False),
    "embedding.position_embeddings.weight": ("transformer.wpe.weight", False),
    "final_ln.weight": ("transformer.ln_f.weight", False),
    "final_ln.bias": ("transformer.ln_f.bias", False),
    "output.weight": ("lm_head.weight", False),
}
_LAYER = {
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}

# GPTConfig fields GPT-2's config.json expresses (or that do not change the computation);
# any other field with a non-default value is a difference the exporter refuses.
_MAPPED_FIELDS = {
    "vocab_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "seq_length",
    "max_position_embeddings",
    "hidden_dropout",
    "attention_dropout",
    "tie_embeddings",
    "layernorm_epsilon",
    "init_method_std",
    "make_vocab_size_divisible_by",
    "sequence_parallel",
    "params_dtype",
    "label_smoothing",
    "norm_backend",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "tp_overlap_grad_reduce",
    "openai_gelu",
    "mtp_loss_scaling_factor",  # the training loss's weight (the MTP modules themselves do not export)
}
# transformers' ACT2FN names -> GPTConfig.openai_gelu: "gelu" is the exact erf GELU
# (torch.nn.functional.gelu), "gelu_new" and "gelu_pytorch_tanh" its tanh approximation
# (F.gelu(approximate="tanh"), the same formula); an export writes the first name of each
_GELUS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


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
    hf_moe.check_export(gcfg)
    for f in dataclasses.fields(gcfg):
        if f.name in _MAPPED_FIELDS or f.default is dataclasses.MISSING:
            continue
        if getattr(gcfg, f.name) != f.default:
            raise HFConversionError(
                f"model setting {f.name} = {getattr(gcfg, f.name)!r} has no GPT-2 "
                "equivalent; only the GPT-2 block converts to GPT2LMHeadModel (a "
                "LLaMA-style block, --position-embedding-type rope, to LlamaForCausalLM)"
            )


def gpt2_config(gcfg: GPTConfig, eod: Optional[int] = None) -> dict:
    """``config.json`` of the GPT2LMHeadModel that computes what ``gcfg``'s model computes.

    ``eod``: the end-of-document id, written as BOS/EOS id. Raises HFConversionError when a
    model setting has no GPT-2 equivalent.
    """
    _check_block(gcfg)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": gcfg.vocab_size,
        "n_positions": gcfg.max_position_embeddings,
        "n_embd": gcfg.hidden_size,
        "n_layer": gcfg.num_layers,
        "n_head": gcfg.num_attention_heads,
        "n_inner": gcfg.ffn_hidden_size,
        "activation_function": "gelu_new" if gcfg.openai_gelu else "gelu",
        "layer_norm_epsilon": gcfg.layernorm_epsilon,
        "resid_pdrop": gcfg.hidden_dropout,
        "embd_pdrop": gcfg.hidden_dropout,
        "attn_pdrop": gcfg.attention_dropout,
        "initializer_range": gcfg.init_method_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": gcfg.tie_embeddings,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def gpt_config_from_hf(config: Mapping, **settings) -> GPTConfig:
    """The GPTConfig of a GPT-2 ``config.json`` (``settings``: other GPTConfig fields, e.g.
    ``seq_length`` or dropouts). Raises HFConversionError for another model type or a setting
    megazero computes differently (activation, attention scaling)."""
    if config.get("model_type") != "gpt2":
        raise HFConversionError(
            f"model_type {config.get('model_type')!r}: only GPT-2 (model_type 'gpt2') folders are read"
        )
    act = config.get("activation_function", "gelu_new")  # GPT2Config's default
    if act not in _GELUS:
        raise HFConversionError(
            f"activation_function {act!r}: megazero's GPT-2 MLP computes the exact erf "
            f"GELU ('gelu') or its tanh approximation ('gelu_new', 'gelu_pytorch_tanh'); "
            "another activation would compute something else"
        )
    for key, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("add_cross_attention", False),
    ):
        if config.get(key, want) != want:
            raise HFConversionError(f"{key} = {config[key]!r}: megazero's attention needs {want!r}")
    hidden, positions = _value(config, "n_embd", "size"), _value(config, "n_positions", "size")
    settings.setdefault("seq_length", positions)
    return GPTConfig(
        vocab_size=_value(config, "vocab_size", "size"),
        num_layers=_value(config, "n_layer", "size"),
        hidden_size=hidden,
        num_attention_heads=_value(config, "n_head", "size"),
        ffn_hidden_size=_value(config, "n_inner", "size", 4 * hidden),
        max_position_embeddings=positions,
        tie_embeddings=_value(config, "tie_word_embeddings", "flag", True),
        layernorm_epsilon=_value(config, "layer_norm_epsilon", "number", 1e-5),
        openai_gelu=_GELUS[act],
        **settings,
    )


def check_matches(config: Mapping, gcfg: GPTConfig) -> None:
    """Raise HFConversionError naming the first size or block option where ``config.json``
    (GPT-2, LLaMA, Mixtral or Qwen2-MoE) and the run's model (``gcfg``) differ, as the megazero
    flag to change: the MoE settings first (``model.hf_moe.MATCHED``), the dense MLP width only
    where some layer is dense."""
    theirs = config_from_hf(config, seq_length=gcfg.seq_length)
    all_moe = theirs.num_experts is not None and theirs.moe_layer_freq == 1  # no dense MLP: its width is moot
    for field, flag in hf_moe.MATCHED + (
        ("position_embedding_type", "--position-embedding-type"),
        ("normalization", "--normalization"),
        ("swiglu", "--swiglu"),
        ("openai_gelu", "--openai-gelu"),
        ("kv_heads", "--group-query-attention --num-query-groups"),
        *((name, setting_named(f"model.{name}").flag) for name in MLA_FIELDS),
        ("moe_router_num_groups", "--moe-router-num-groups"),
        ("moe_router_group_topk", "--moe-router-group-topk"),
        ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor"),
        ("rotary_base", "--rotary-base"),
        ("use_rope_scaling", "--use-rope-scaling"),
        ("rope_scaling_factor", "--rope-scaling-factor"),
        ("rope_scaling_low_freq_factor", "--rope-scaling-low-freq-factor"),
        ("rope_scaling_high_freq_factor", "--rope-scaling-high-freq-factor"),
        ("rope_scaling_original_max_position_embeddings", "--rope-scaling-original-max-position-embeddings"),
        ("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor"),
        *((name, setting_named(f"model.{name}").flag) for name in YARN_FIELDS),
        ("add_bias_linear", "--disable-bias-linear"),
        ("add_qkv_bias", "--add-qkv-bias"),
        ("window_size", "--window-size"),
        ("window_attn_skip_freq", "--window-attn-skip-freq"),
        ("vocab_size", "--vocab-size (or the tokenizer's vocabulary)"),
        ("num_layers", "--num-layers"),
        ("hidden_size", "--hidden-size"),
        ("num_attention_heads", "--num-attention-heads"),
        ("ffn_hidden_size", "--ffn-hidden-size"),
        ("max_position_embeddings", "--max-position-embeddings"),
        ("tie_embeddings", "--untie-embeddings-and-output-weights"),
        ("layernorm_epsilon", "--layernorm-epsilon"),
    ):
        if field == "ffn_hidden_size" and all_moe and gcfg.num_experts is not None:
            continue
        if getattr(theirs, field) != getattr(gcfg, field):
            raise HFConversionError(
                f"the folder's model has {field} = {getattr(theirs, field)}, this run "
                f"{getattr(gcfg, field)}; fix: set {flag} to match"
            )


def hf_shapes(gcfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> the shape in which a folder holding ``gcfg``'s model stores it:
    what ``to_hf_tensors`` writes (vocabulary tensors with ``vocab_size`` rows, GPT-2's linear
    weights ``[in, out]``, Llama's fused tensors split by ``llama_pieces``; no ``lm_head.weight``
    when tied; Qwen2-MoE's shared-expert gates ``[1, H]``). Raises HFConversionError for a
    parameter with no counterpart."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in canonical_shapes(gcfg, gcfg.vocab_size).items():
        if not is_llama(gcfg):
            target, transposed = hf_name(name)
            out[target] = tuple(reversed(shape)) if transposed else tuple(shape)
            continue
        if hf_gpt_oss.is_gpt_oss(gcfg) and hf_gpt_oss.expert_source(name) is not None:
            continue  # stacked per layer: hf_gpt_oss.expert_shapes
        parts = llama_pieces(name, gcfg)
        for (target, _, _), rows in zip(parts, _piece_rows(parts, shape[0])):
            out[target] = (out.get(target, (0,))[0] + rows,) + tuple(shape[1:])
    if hf_gpt_oss.is_gpt_oss(gcfg):
        out.update(hf_gpt_oss.expert_shapes(gcfg))
    out.update(hf_deepseek.bias_shapes(gcfg))
    return {**out, **{name: tuple(t.shape) for name, t in hf_moe.extra_tensors(gcfg).items()}}


def to_hf_tensors(
    full: Mapping[str, torch.Tensor], gcfg: GPTConfig, expert_bias: Optional[Mapping[int, list]] = None
) -> dict[str, torch.Tensor]:
    """GPT-2 tensors (fp32, contiguous) from megazero's full canonical tensors.

    Vocabulary tensors keep their ``vocab_size`` real rows. With tied embeddings
    ``lm_head.weight`` is left out (transformers ties it to ``transformer.wte.weight``).
    Raises HFConversionError for a missing or unknown parameter. A LLaMA-style ``gcfg`` gives
    LlamaForCausalLM's tensors (``to_llama_tensors``; ``expert_bias``: a checkpoint's
    ``{layer: E floats}``, DeepSeek-V3's ``e_score_correction_bias``).
    """
    if is_llama(gcfg):
        return to_llama_tensors(full, gcfg, expert_bias)
    _check_block(gcfg)
    out = {}
    for name in canonical_shapes(gcfg, gcfg.vocab_size):
        if name not in full:
            raise HFConversionError(f"the checkpoint lacks parameter {name!r}")
        target, transposed = hf_name(name)
        t = full[name].float()
        t = t[: gcfg.vocab_size] if name in VOCAB_TENSORS else t
        out[target] = (t.t() if transposed else t).contiguous()
    unknown = sorted(set(full) - set(canonical_shapes(gcfg, gcfg.vocab_size)))
    if unknown:
        raise HFConversionError(f"parameter {unknown[0]!r} has no counterpart in GPT2LMHeadModel")
    return out


class CanonicalView(Mapping):
    """Megazero's canonical full tensors read lazily from GPT-2 or (LLaMA-style ``gcfg``)
    LlamaForCausalLM tensors (e.g. a safetensors ``safe_open`` handle, or ``model.hf_folder.TensorFiles``
    over a sharded folder): ``view[name]`` loads,
    transposes or joins (``llama_pieces``) and pads one tensor, so a stage reads only its own
    parameters. Vocabulary tensors get ``padded_vocab`` rows."""

    def __init__(self, hf_tensors, gcfg: GPTConfig, padded_vocab: int):
        self._src, self._gcfg = hf_tensors, gcfg
        self._shapes = canonical_shapes(gcfg, padded_vocab)
        self._padded = padded_vocab
        self._stacked: dict[str, torch.Tensor] = {}  # gpt-oss: the last stacked expert tensor read

    def expert_bias(self, layer: int) -> Optional[torch.Tensor]:
        """MoE layer ``layer``'s expert bias ``[E]`` fp32 (DeepSeek-V3's ``e_score_correction_bias``,
        which ``model.gpt.GPTStage`` takes as its ``--moe-router-enable-expert-bias`` start), None
        for a family without one."""
        name = hf_deepseek.bias_name(layer)
        if name not in hf_deepseek.bias_shapes(self._gcfg):
            return None
        return _get(self._src, name).float()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        expert = hf_gpt_oss.expert_source(name) if hf_gpt_oss.is_gpt_oss(self._gcfg) else None
        if expert is not None:  # one layer's stack is read (and dequantized) once for its E experts
            stacked, j, part = expert
            if stacked not in self._stacked:
                self._stacked = {stacked: hf_gpt_oss.read_stacked(self._src, stacked)}
            t, target = hf_gpt_oss.expert_tensor(self._stacked[stacked], j, part), stacked
        elif is_llama(self._gcfg):
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
            raise HFConversionError(
                f"{target} has shape {tuple(t.shape)}, megazero's {name} needs {tuple(self._shapes[name])}"
            )
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def _get(src, key: str) -> torch.Tensor:
    """``src[key]`` of a dict or a safetensors handle; HFConversionError naming a missing key."""
    if key not in set(src.keys()):
        raise HFConversionError(f"the folder's safetensors files have no tensor {key!r}")
    return src.get_tensor(key) if hasattr(src, "get_tensor") else src[key]


# ---- LLaMA-style block <-> LlamaForCausalLM ------------------------------------------------
# LlamaForCausalLM (transformers' modeling_llama) computes exactly megazero's LLaMA-style block
# when: RoPE on the whole head (rotate-half pairs (x_j, x_{j+d/2}), inv_freq = theta^(-2j/d),
# as model/rope.py), RMSNorm (x * rsqrt(mean x^2 + eps) * w), SwiGLU MLP down(silu(gate) * up),
# key/value head j serving query heads j*heads/G .. (j+1)*heads/G - 1 (repeat_kv), scaling
# 1/sqrt(head_dim), one bias flag for q/k/v/o (attention_bias) and one for gate/up/down
# (mlp_bias); Llama-3.x's RoPE scaling and Qwen2's q/k/v-only biases are model/hf_families.py's.
# Its linears are [out, in] like megazero's, so nothing is transposed; the fused
# canonical tensors are split by rows.
_LLAMA_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "final_ln.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_LAYER = {
    "ln1.weight": "input_layernorm.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "attn.proj.bias": "self_attn.o_proj.bias",
    "mlp.fc2.weight": "mlp.down_proj.weight",
    "mlp.fc2.bias": "mlp.down_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's QK-norm (--qk-layernorm)
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}
_LLAMA_FIELDS = {
    "position_embedding_type",
    "rotary_base",
    *ROPE_SCALING_FIELDS,
    "add_qkv_bias",
    "kv_channels",
    "qk_layernorm",
    "hf_model_type",
    "window_size",  # written by the families that have a window (_check_llama refuses the others)
    "window_attn_skip_freq",
    "rotary_percent",
    "normalization",
    "swiglu",
    "num_query_groups",
    "add_bias_linear",
}


def is_llama(gcfg: GPTConfig) -> bool:
    """Whether ``gcfg`` converts to LlamaForCausalLM (rotary positions) rather than GPT-2."""
    return gcfg.position_embedding_type == "rope"


def _check_llama(gcfg: GPTConfig) -> None:
    """Raise HFConversionError naming the first setting LlamaForCausalLM cannot express."""
    for ok, what in (
        (
            gcfg.normalization == "RMSNorm",
            f"--normalization {gcfg.normalization}: LlamaForCausalLM has RMSNorm only; fix: --normalization RMSNorm",
        ),
        (
            gcfg.swiglu or hf_gpt_oss.is_gpt_oss(gcfg),
            "a GELU MLP (no --swiglu): LlamaForCausalLM's MLP is the SwiGLU down(silu(gate) * up); fix: --swiglu",
        ),
        (
            gcfg.rotary_percent == 1.0,
            f"--rotary-percent {gcfg.rotary_percent}: "
            "LlamaForCausalLM rotates the whole head (no partial rotary); fix: --rotary-percent 1.0",
        ),
        (
            not (gcfg.add_qkv_bias and hf_moe.is_moe(gcfg)),
            "--add-qkv-bias with --num-experts: megazero exports q/k/v-only biases as Qwen2ForCausalLM, "
            "which has no experts",
        ),
        (
            hf_families.window_pattern(gcfg)[0] is None
            or gcfg.hf_model_type == "mistral"
            or hf_families.is_qwen2(gcfg)
            or hf_families.is_qwen3(gcfg)
            or hf_gpt_oss.is_gpt_oss(gcfg),
            "--window-size: megazero writes a sliding window as MistralForCausalLM (a model read from a mistral "
            "folder), Qwen2ForCausalLM (--add-qkv-bias), Qwen3 / Qwen3-MoE (--qk-layernorm) or GptOssForCausalLM "
            "(--softmax-type learnable); Llama, Mixtral and Qwen2-MoE have none",
        ),
        (
            not (gcfg.qk_layernorm and (gcfg.add_bias_linear or gcfg.add_qkv_bias)),
            "--qk-layernorm with linear biases: megazero exports QK-norm as Qwen3ForCausalLM / "
            "Qwen3MoeForCausalLM, whose MLP has no bias (fix: --disable-bias-linear without --add-qkv-bias)",
        ),
    ):
        if not ok:
            raise HFConversionError(f"{what} (no exact LlamaForCausalLM equivalent)")
    oss, deepseek = hf_gpt_oss.is_gpt_oss(gcfg), hf_deepseek.is_deepseek(gcfg)
    if oss:
        hf_gpt_oss.check_export(gcfg)
    elif deepseek:
        hf_deepseek.check_export(gcfg)
    else:
        hf_moe.check_export(gcfg)
    mapped = _MAPPED_FIELDS | _LLAMA_FIELDS | (hf_gpt_oss.FIELDS if oss else set())
    mapped |= hf_deepseek.FIELDS if deepseek else set()
    for f in dataclasses.fields(gcfg):
        if f.name in mapped or f.default is dataclasses.MISSING:
            continue
        if hf_moe.is_moe(gcfg) and hf_moe.is_moe_field(f.name):
            continue
        if getattr(gcfg, f.name) != f.default:
            raise HFConversionError(
                f"model setting {f.name} = {getattr(gcfg, f.name)!r} has no LlamaForCausalLM equivalent"
            )


def llama_config(gcfg: GPTConfig, eod: Optional[int] = None) -> dict:
    """``config.json`` of the LlamaForCausalLM that computes what ``gcfg``'s model computes
    (``rope_theta`` both top-level, as transformers 4 reads it, and in ``rope_parameters``, as
    transformers 5 does; a scaled RoPE's table also as ``rope_scaling``, transformers 4's key).
    With q/k/v-only biases Qwen2's (``model.hf_families.qwen2_config``), with QK-norm Qwen3's; with
    experts, Mixtral's, Qwen2-MoE's or Qwen3-MoE's (``model.hf_moe.moe_config``); Mistral's for
    ``hf_model_type`` ``"mistral"`` (``model.hf_families.mistral_config``). Raises
    HFConversionError for a setting Llama (or with experts, those three; Mistral) cannot express."""
    _check_llama(gcfg)
    theta = float(gcfg.rotary_base)
    rope = hf_families.rope_parameters(gcfg, theta)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": gcfg.vocab_size,
        "hidden_size": gcfg.hidden_size,
        "intermediate_size": gcfg.ffn_hidden_size,
        "num_hidden_layers": gcfg.num_layers,
        "num_attention_heads": gcfg.num_attention_heads,
        "num_key_value_heads": gcfg.kv_heads,
        "head_dim": gcfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": gcfg.max_position_embeddings,
        "rms_norm_eps": gcfg.layernorm_epsilon,
        "rope_theta": theta,
        "rope_parameters": rope,
        **({} if rope["rope_type"] == "default" else {"rope_scaling": rope}),
        "attention_bias": gcfg.add_bias_linear,
        "mlp_bias": gcfg.add_bias_linear,
        "attention_dropout": gcfg.attention_dropout,
        "initializer_range": gcfg.init_method_std,
        "tie_word_embeddings": gcfg.tie_embeddings,
        "pretraining_tp": 1,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if hf_gpt_oss.is_gpt_oss(gcfg):
        return hf_gpt_oss.gpt_oss_config(config, gcfg)
    if hf_deepseek.is_deepseek(gcfg):
        return hf_deepseek.deepseek_config(config, gcfg)
    if gcfg.hf_model_type == "mistral":
        return hf_families.mistral_config(config, gcfg)
    if hf_families.is_qwen2(gcfg):
        return hf_families.qwen2_config(config, gcfg)
    if hf_moe.is_moe(gcfg):
        return hf_moe.moe_config(gcfg, config)
    return hf_families.qwen3_config(config, gcfg) if hf_families.is_qwen3(gcfg) else config


def llama_config_from_hf(config: Mapping, **settings) -> GPTConfig:
    """The LLaMA-style GPTConfig of a Llama (or Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE)
    ``config.json`` (``settings`` as in ``gpt_config_from_hf``; the families' fields come in it).
    Raises HFConversionError for a missing size or a setting megazero computes differently
    (activation, a RoPE scaling other than llama3 / linear / yarn, partial rotary, biases); ``head_dim``
    other than hidden / heads is ``kv_channels``."""
    hf_families.check_keys(config)
    H, heads = _value(config, "hidden_size", "size"), _value(config, "num_attention_heads", "size")
    rope = _value(config, "rope_parameters", "table", None) or _value(config, "rope_scaling", "table", {})
    positions = _value(config, "max_position_embeddings", "size", 2048)
    theta = _value(rope, "rope_theta", "number", _value(config, "rope_theta", "number", 10000.0))
    kv = _value(config, "num_key_value_heads", "size", heads)
    head_dim = _value(config, "head_dim", "size", H // heads)
    partial = _value(rope, "partial_rotary_factor", "number", _value(config, "partial_rotary_factor", "number", 1.0))
    bias = _value(config, "attention_bias", "flag", False)
    for ok, what in (
        (
            config.get("hidden_act", "silu") == "silu",
            f"hidden_act {config.get('hidden_act')!r}: megazero's SwiGLU gate is silu",
        ),
        (partial == 1.0, "partial_rotary_factor != 1: megazero's LLaMA export rotates whole heads"),
        (
            bias == _value(config, "mlp_bias", "flag", False),
            "attention_bias != mlp_bias: megazero's biases are all on (default) or all off "
            "(--disable-bias-linear), or on q/k/v only (--add-qkv-bias, model_type 'qwen2')",
        ),
    ):
        if not ok:
            raise HFConversionError(what)
    settings = {**hf_families.rope_settings_from_hf(rope, positions), **settings}
    settings.setdefault("seq_length", positions)
    settings.setdefault("add_bias_linear", bias)
    settings.setdefault("kv_channels", None if head_dim * heads == H else head_dim)  # --kv-channels
    return GPTConfig(
        vocab_size=_value(config, "vocab_size", "size"),
        num_layers=_value(config, "num_hidden_layers", "size"),
        hidden_size=H,
        num_attention_heads=heads,
        ffn_hidden_size=_value(config, "intermediate_size", "size"),
        max_position_embeddings=positions,
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        normalization="RMSNorm",
        swiglu=True,
        num_query_groups=None if kv == heads else kv,
        tie_embeddings=_value(config, "tie_word_embeddings", "flag", False),
        layernorm_epsilon=_value(config, "rms_norm_eps", "number", 1e-6),
        **settings,
    )


def hf_config(gcfg: GPTConfig, eod: Optional[int] = None) -> dict:
    """``config.json`` for ``gcfg``: Llama for a rotary (LLaMA-style) block, else GPT-2."""
    return llama_config(gcfg, eod) if is_llama(gcfg) else gpt2_config(gcfg, eod)


def config_from_hf(config: Mapping, **settings) -> GPTConfig:
    """The GPTConfig of a GPT-2, Llama (2 and 3.x), Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE or
    Qwen3-MoE ``config.json`` (Mistral, Qwen2, Qwen3: ``model.hf_families``; the MoE ones:
    ``model.hf_moe``); HFConversionError for another type."""
    if config.get("model_type") == "llama":
        return llama_config_from_hf(config, **settings)
    if config.get("model_type") == "mistral":
        return llama_config_from_hf(config, **hf_families.mistral_settings_from_hf(config), **settings)
    if config.get("model_type") == "qwen2":
        return llama_config_from_hf(config, **hf_families.qwen2_settings_from_hf(config), **settings)
    if config.get("model_type") == "qwen3":
        return llama_config_from_hf(config, **hf_families.qwen3_settings_from_hf(config), **settings)
    if config.get("model_type") == hf_gpt_oss.MODEL_TYPE:
        return GPTConfig(**{**hf_gpt_oss.settings_from_hf(config), **settings})
    if config.get("model_type") == hf_deepseek.MODEL_TYPE:
        return GPTConfig(**{**hf_deepseek.settings_from_hf(config), **settings})
    if config.get("model_type") in hf_moe.MODEL_TYPES:
        qwen3 = hf_families.qwen3_settings_from_hf(config) if config["model_type"] == "qwen3_moe" else {}
        return llama_config_from_hf(config, **hf_moe.moe_settings_from_hf(config), **qwen3, **settings)
    if config.get("model_type") != "gpt2":
        raise HFConversionError(
            f"model_type {config.get('model_type')!r}: only GPT-2 (model_type 'gpt2') and "
            "LLaMA-style (model_type 'llama', 'mistral', 'qwen2', 'qwen3', 'mixtral', 'qwen2_moe', 'qwen3_moe', "
            "'gpt_oss' or 'deepseek_v3') "
            "folders are read"
        )
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
        oss = hf_gpt_oss.layer_pieces(rest, pre) if hf_gpt_oss.is_gpt_oss(gcfg) else None
        if oss is not None:
            return oss
        deepseek = hf_deepseek.layer_pieces(rest, pre, gcfg) if hf_deepseek.is_deepseek(gcfg) else None
        if deepseek is not None:
            return deepseek
        moe = hf_moe.moe_pieces(rest, pre, gcfg)
        if moe is not None:
            return moe
        if rest in ("attn.qkv.weight", "attn.qkv.bias"):
            q, k, v = (f"{pre}self_attn.{x}_proj.{kind}" for x in "qkv")
            if gcfg.num_query_groups is None:
                return [(q, 0, None), (k, 0, None), (v, 0, None)]
            d, n = gcfg.head_dim, gcfg.num_attention_heads // gcfg.kv_heads * gcfg.head_dim
            return [
                p
                for g in range(gcfg.kv_heads)
                for p in ((q, g * n, (g + 1) * n), (k, g * d, (g + 1) * d), (v, g * d, (g + 1) * d))
            ]
        if rest in ("mlp.fc1.weight", "mlp.fc1.bias"):
            return [(f"{pre}mlp.gate_proj.{kind}", 0, None), (f"{pre}mlp.up_proj.{kind}", 0, None)]
    raise HFConversionError(f"parameter {canonical!r} has no counterpart in LlamaForCausalLM")


def _piece_rows(parts: list[tuple[str, int, Optional[int]]], rows: int) -> list[int]:
    """Rows of each ``llama_pieces`` piece of a canonical tensor of ``rows`` rows (pieces
    without bounds share the rows equally)."""
    return [rows // len(parts) if stop is None else stop - start for _, start, stop in parts]


def to_llama_tensors(
    full: Mapping[str, torch.Tensor], gcfg: GPTConfig, expert_bias: Optional[Mapping[int, list]] = None
) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM tensors (fp32, contiguous) from megazero's full canonical tensors:
    fused tensors split by ``llama_pieces``, vocabulary tensors cut to ``vocab_size`` rows,
    ``lm_head.weight`` left out when tied; with experts Mixtral's / Qwen2-MoE's (``model.hf_moe``:
    names, the shared expert's scale, its zero gate); DeepSeek-V3's interleaved rope rows and its
    ``e_score_correction_bias`` from ``expert_bias`` (``model.hf_deepseek``). Raises HFConversionError
    for a setting Llama cannot express or a missing / unknown parameter."""
    _check_llama(gcfg)
    names = canonical_shapes(gcfg, gcfg.vocab_size)
    unknown = sorted(set(full) - set(names))
    if unknown:
        raise HFConversionError(f"parameter {unknown[0]!r} has no counterpart in LlamaForCausalLM")
    pieces: dict[str, list] = {}
    oss = hf_gpt_oss.is_gpt_oss(gcfg)
    for name in names:
        if name not in full:
            raise HFConversionError(f"the checkpoint lacks parameter {name!r}")
        if oss and hf_gpt_oss.expert_source(name) is not None:
            continue  # stacked per layer below
        t = full[name].float() * hf_moe.export_scale(name, gcfg)
        t = t[: gcfg.vocab_size] if name in VOCAB_TENSORS else hf_deepseek.to_hf_rows(name, t, gcfg)
        parts = llama_pieces(name, gcfg)
        for (target, _, _), piece in zip(parts, t.split(_piece_rows(parts, t.shape[0]))):
            pieces.setdefault(target, []).append(piece)
    out = {target: torch.cat(ps).contiguous() for target, ps in pieces.items()}
    if oss:
        out.update(hf_gpt_oss.expert_tensors(full, gcfg))
    out.update(hf_deepseek.bias_tensors(gcfg, expert_bias))
    return {**out, **hf_moe.extra_tensors(gcfg)}


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
    scale = hf_moe.export_scale(canonical, gcfg)
    t = torch.cat(out) if scale == 1.0 else torch.cat(out) / scale
    return hf_deepseek.from_hf_rows(canonical, t, gcfg) if hf_deepseek.is_deepseek(gcfg) else t
