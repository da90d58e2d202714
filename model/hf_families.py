"""The Hugging Face families beyond Llama-2: Llama-3.x (``model_type`` ``llama`` with RoPE
scaling), Mistral (``mistral``), Qwen2 / Qwen2.5 (``qwen2``), Qwen3 (``qwen3``) and the key table
of Qwen3-MoE (``qwen3_moe``, whose experts are ``model/hf_moe.py``'s). ``model/hf.py`` keeps the
tensor map they share with LlamaForCausalLM (the same tensor names; Qwen2 adds q/k/v biases); this file reads and writes
what differs in ``config.json`` and classifies every key a folder may hold. Like ``model/hf.py``
it reads no file.

What the two models compute beyond Llama-2 (transformers 5's ``modeling_llama``,
``modeling_qwen2`` and ``modeling_rope_utils``, read for this map):

- RoPE scaling (``rope_parameters``, in transformers 4 ``rope_scaling``): rope type ``llama3``
  rewrites the frequencies with ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
  ``original_max_position_embeddings`` (``max_position_embeddings`` when absent), rope type
  ``linear`` divides them by ``factor``; neither rescales cos/sin (their attention factor is 1).
  Rope type ``yarn`` (``_compute_yarn_parameters``) ramps between kept and divided frequencies with
  ``factor`` (``max_position_embeddings / original_max_position_embeddings`` when null),
  ``original_max_position_embeddings``, ``beta_fast`` (32 when absent), ``beta_slow`` (1) and
  ``truncate`` (true), and multiplies cos and sin by ``attention_factor`` (derived from ``factor``,
  ``mscale`` and ``mscale_all_dim`` when absent). All three are megazero's
  ``model.rope.RopeScaling`` (``--use-rope-scaling`` with the ``--rope-scaling-*`` flags;
  ``--rotary-seq-len-interpolation-factor``; ``--yarn-rotary-scaling-factor`` with the ``--yarn-*``
  flags). Other rope types (``dynamic``, ``longrope``, ...) are refused by name, and so is any
  key of a rope table megazero would not read.
- Mistral (``modeling_mistral``): Llama's block without biases (no ``attention_bias`` /
  ``mlp_bias`` keys: none is read) with ``head_dim`` (``--kv-channels``) and ``sliding_window``
  W: every layer's query at position i sees keys j with ``i - W < j <= i`` (``masking_utils``'
  ``sliding_window_overlay``), all earlier positions when W is null or at least
  ``max_position_embeddings`` (megazero's full causal attention). A shorter W is megazero's
  ``--window-size W-1,0`` on every layer (``megazero.config.shape.layer_window``). Llama computes
  the same model otherwise, so ``GPTConfig.hf_model_type`` remembers the family and the export
  writes MistralForCausalLM again (``mistral_config``), with the window.
- Qwen2's attention: ``q_proj``, ``k_proj``, ``v_proj`` with bias, ``o_proj`` and the MLP
  without (``--disable-bias-linear --add-qkv-bias``); a layer whose ``layer_types`` entry is
  ``sliding_attention`` sees only its last ``sliding_window`` keys (transformers derives
  ``layer_types`` from ``use_sliding_window``: layers from ``max_window_layers`` on slide; and
  drops the window when ``use_sliding_window`` is false). The pattern becomes ``--window-size
  W-1,0`` with ``--window-attn-skip-freq`` (None when every layer slides, N when every N-th is
  full, else the 0/1 list; ``window_settings``); a window covering ``max_position_embeddings`` is
  full attention; a layer type other than full or sliding attention is refused. The export
  writes ``use_sliding_window``, ``sliding_window``, ``max_window_layers`` and ``layer_types``
  back (``window_keys``). Qwen3-MoE's window, when on, applies to every layer.
- Qwen3's attention (``modeling_qwen3``): heads of ``head_dim`` dimensions whatever
  ``hidden_size / num_attention_heads`` is (``q_proj`` ``[heads * head_dim, H]``, ``o_proj``
  ``[H, heads * head_dim]``: megazero's ``--kv-channels``; every family's ``head_dim`` maps to it,
  since all their attention classes read it), and ``q_norm`` / ``k_norm``, an RMSNorm
  (``rms_norm_eps``) of each head of q and of k after the projection and before RoPE
  (``--qk-layernorm``); no biases (``attention_bias`` true would put one on q, k, v and o but
  none on the MLP, which no megazero block has: refused); the sliding-window rule of Qwen2.
  Qwen3-MoE has the same attention and Qwen2-MoE's experts without the shared one.

``KEYS`` lists, per model type, every key of transformers' ``LlamaConfig().to_dict()`` /
``MistralConfig`` / ``Qwen2Config`` / ``Qwen3Config`` / ``Qwen3MoeConfig`` (plus the legacy ``rope_scaling`` /
``rope_theta``, and ``head_dim`` / ``num_experts`` that Qwen3-MoE folders carry) as ``mapped``
(read into a GPTConfig field), ``checked`` (read and refused unless it has the value megazero
computes) or ``no_effect`` (with the reason it does not change logits or loss);
``check_keys`` refuses a key outside the three, since transformers keeps an unknown key as a
config attribute its modeling code may read (tests/layouts/test_hf_families.py asserts the
lists are complete for the installed transformers).
"""

from __future__ import annotations

from typing import Mapping, Optional

from model.config import GPTConfig
from model.hf_config import HFConversionError, config_value

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

COMMON_MAPPED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "tie_word_embeddings",
)
COMMON_NO_EFFECT = {
    "_name_or_path": "where the folder came from",
    "architectures": "the class name; model_type chooses the map",
    "transformers_version": "the writer's version",
    "dtype": "storage dtype; megazero reads every tensor as fp32 and casts to its --fp16/--bf16",
    "torch_dtype": "transformers 4's name of dtype",
    "bos_token_id": "a token id for generation (the tokenizer in the folder gives megazero's EOD)",
    "eos_token_id": "a token id for generation",
    "pad_token_id": "a token id for generation",
    "use_cache": "transformers' KV cache switch (same logits either way)",
    "output_attentions": "what transformers returns, not what it computes",
    "output_hidden_states": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
    "id2label": "labels of a classification head (no such head in a causal LM)",
    "label2id": "labels of a classification head (no such head in a causal LM)",
    "problem_type": "loss of a classification head (no such head in a causal LM)",
    "chunk_size_feed_forward": "read by no Llama or Qwen2 layer (BERT-style chunking)",
    "is_encoder_decoder": "read by no decoder-only model class",
    "initializer_range": "the init of new weights; every weight is read from the folder",
    "attention_dropout": "training-time dropout; the run's --attention-dropout decides (0 in released models)",
    "model_type": "chooses this map (config_from_hf)",
}
_WINDOW = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
ROUTER_NO_EFFECT = {
    "output_router_logits": "whether transformers returns router logits and adds its own load-balancing loss "
    "to its loss; megazero's --moe-aux-loss-coeff decides its own (written false)",
    "router_aux_loss_coef": "the weight of that transformers-only loss (megazero's: --moe-aux-loss-coeff)",
}
KEYS = {
    "llama": {
        "mapped": COMMON_MAPPED + ("attention_bias", "mlp_bias", "head_dim"),
        "checked": ("hidden_act", "partial_rotary_factor"),
        "no_effect": {
            **COMMON_NO_EFFECT,
            "pretraining_tp": "read by no transformers 5 Llama layer (transformers 4 split matmuls: same sums)",
        },
    },
    "mistral": {
        "mapped": COMMON_MAPPED + ("head_dim", "sliding_window"),
        "checked": ("hidden_act", "partial_rotary_factor"),
        "no_effect": dict(COMMON_NO_EFFECT),
    },
    "qwen2": {
        "mapped": COMMON_MAPPED + ("head_dim",) + _WINDOW,
        "checked": ("hidden_act", "partial_rotary_factor"),
        "no_effect": dict(COMMON_NO_EFFECT),
    },
    "qwen3": {
        "mapped": COMMON_MAPPED + ("head_dim",) + _WINDOW,
        "checked": ("hidden_act", "partial_rotary_factor", "attention_bias"),
        "no_effect": dict(COMMON_NO_EFFECT),
    },
    "qwen3_moe": {  # head_dim: not a Qwen3MoeConfig field, but real folders carry it and the attention reads it
        "mapped": COMMON_MAPPED
        + ("head_dim", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
        + ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
        + _WINDOW,
        "checked": ("hidden_act", "partial_rotary_factor", "attention_bias"),
        "no_effect": {**COMMON_NO_EFFECT, **ROUTER_NO_EFFECT},
    },
}


def check_keys(config: Mapping, table: Optional[Mapping] = None) -> None:
    """Raise HFConversionError naming the first key of a ``llama``, ``mistral``, ``qwen2``, ``qwen3``
    or ``qwen3_moe`` ``config.json`` that ``KEYS`` does not classify, or of another family's that
    ``table`` (its own mapped / checked / no_effect lists, e.g. ``model.hf_gpt_oss.KEYS``) does not;
    nothing for other model types."""
    table = KEYS.get(config.get("model_type")) if table is None else table
    if table is None:
        return
    known = set(table["mapped"]) | set(table["checked"]) | set(table["no_effect"])
    for key in config:
        if key not in known:
            raise HFConversionError(
                f"config.json key {key!r} is unknown to megazero's {config['model_type']} map and may change "
                "what transformers computes; fix: remove it if it does not (docs/checkpoints.md lists the keys)"
            )


_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "linear": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"},
    "llama3": {
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
    "yarn": {
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    },
}


def rope_settings_from_hf(rope: Mapping, positions: int) -> dict:
    """GPTConfig RoPE-scaling fields of a ``rope_parameters`` (or ``rope_scaling``) table; ``positions``:
    ``max_position_embeddings``, llama3's and yarn's fallback original context. Raises HFConversionError
    naming a rope type megazero does not compute or a key of it megazero would not read."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_KEYS:
        raise HFConversionError(
            f"rope type {kind!r}: megazero's RoPE is unscaled, 'linear', 'llama3' or 'yarn'; another scaling "
            "would compute other angles"
        )
    extra = sorted(set(rope) - _ROPE_KEYS[kind])
    if extra:
        raise HFConversionError(f"rope_parameters.{extra[0]} with rope type {kind!r}: megazero would not read it")
    if kind == "linear":
        return dict(rotary_seq_len_interpolation_factor=float(config_value(rope, "factor", "number")))
    if kind == "default":
        return {}
    if kind == "yarn":
        return _yarn_settings_from_hf(rope, positions)
    return dict(
        use_rope_scaling=True,
        rope_scaling_factor=float(config_value(rope, "factor", "number")),
        rope_scaling_low_freq_factor=float(config_value(rope, "low_freq_factor", "number")),
        rope_scaling_high_freq_factor=float(config_value(rope, "high_freq_factor", "number")),
        rope_scaling_original_max_position_embeddings=config_value(
            rope, "original_max_position_embeddings", "size", positions
        ),
    )


def _yarn_settings_from_hf(rope: Mapping, positions: int) -> dict:
    """GPTConfig ``yarn_*`` fields of a ``yarn`` rope table, with transformers' defaults for absent keys
    (``mscale`` / ``mscale_all_dim`` may be 0, which transformers reads as absent, as megazero does)."""
    original = config_value(rope, "original_max_position_embeddings", "size", positions)
    out = dict(
        yarn_rotary_scaling_factor=float(config_value(rope, "factor", "number", positions / original)),
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(config_value(rope, "beta_fast", "number", 32.0)),
        yarn_beta_slow=float(config_value(rope, "beta_slow", "number", 1.0)),
        yarn_correction_range_round_to_int=config_value(rope, "truncate", "flag", True),
    )
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        v = rope.get(key)
        if v is None:
            continue
        if key != "attention_factor" and v == 0:
            out[f"yarn_{key}"] = 0.0
        else:
            out[f"yarn_{key}"] = float(config_value(rope, key, "number"))
    return out


def rope_parameters(gcfg: GPTConfig, theta: float) -> dict:
    """The ``rope_parameters`` table of ``gcfg``'s RoPE (type ``default``, ``llama3``, ``linear`` or
    ``yarn``; yarn's ``mscale``, ``mscale_all_dim`` and ``attention_factor`` only when set). Raises
    HFConversionError when two scalings are on (transformers has one rope type)."""
    on = [
        flag
        for flag, set_ in (
            ("--use-rope-scaling", gcfg.use_rope_scaling),
            ("--rotary-seq-len-interpolation-factor", gcfg.rotary_seq_len_interpolation_factor is not None),
            ("--yarn-rotary-scaling-factor", gcfg.yarn_rotary_scaling_factor is not None),
        )
        if set_
    ]
    if len(on) > 1:
        raise HFConversionError(
            f"{on[0]} with {on[1]}: a Hugging Face config has one rope type (no exact LlamaForCausalLM equivalent)"
        )
    if gcfg.yarn_rotary_scaling_factor is not None:
        optional = {"mscale": gcfg.yarn_mscale, "mscale_all_dim": gcfg.yarn_mscale_all_dim}
        optional["attention_factor"] = gcfg.yarn_attention_factor
        return {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": gcfg.yarn_rotary_scaling_factor,
            "original_max_position_embeddings": gcfg.yarn_original_max_position_embeddings,
            "beta_fast": gcfg.yarn_beta_fast,
            "beta_slow": gcfg.yarn_beta_slow,
            "truncate": gcfg.yarn_correction_range_round_to_int,
            **{k: v for k, v in optional.items() if v is not None},
        }
    if gcfg.use_rope_scaling:
        return {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": gcfg.rope_scaling_factor,
            "low_freq_factor": gcfg.rope_scaling_low_freq_factor,
            "high_freq_factor": gcfg.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": gcfg.rope_scaling_original_max_position_embeddings,
        }
    if gcfg.rotary_seq_len_interpolation_factor is not None:
        return {"rope_type": "linear", "rope_theta": theta, "factor": gcfg.rotary_seq_len_interpolation_factor}
    return {"rope_type": "default", "rope_theta": theta}


def window_pattern(gcfg: GPTConfig) -> tuple:
    """``(W, sliding)``: the one sliding window of ``gcfg``'s windowed layers (None when no layer is
    windowed) and, per layer, whether it is (``GPTConfig.attention_window``)."""
    windows = [gcfg.attention_window(i) for i in range(gcfg.num_layers)]
    W = next((w for w in windows if w is not None), None)
    return W, [w is not None for w in windows]


def window_settings(sliding: list, window, positions: int) -> dict:
    """GPTConfig window fields of a folder whose layers slide where ``sliding`` (one bool per layer)
    with transformers' window ``window`` W: ``window_size [W-1, 0]`` and ``window_attn_skip_freq``
    None (every layer slides), ``[N]`` (Megatron-LM's integer form matches: layers N, 2N, ... full)
    or the 0/1 list; nothing when no layer slides or W covers ``positions`` (full attention)."""
    if window is None or window >= positions or not any(sliding):
        return {}
    L, size = len(sliding), [window - 1, 0]
    if all(sliding):
        return dict(window_size=size)
    for N in range(2, L + 1):
        if [n % N != 0 for n in range(1, L + 1)] == list(sliding):
            return dict(window_size=size, window_attn_skip_freq=[N])
    return dict(window_size=size, window_attn_skip_freq=[int(x) for x in sliding])


def window_keys(gcfg: GPTConfig) -> dict:
    """Qwen2 / Qwen3 window keys of ``gcfg``: ``use_sliding_window``, ``sliding_window`` W (null when
    no layer slides), ``max_window_layers`` (the layers before the first sliding one) and
    ``layer_types`` (``sliding_attention`` / ``full_attention`` per layer), which transformers 5
    reads as they are."""
    W, sliding = window_pattern(gcfg)
    return {
        "use_sliding_window": W is not None,
        "sliding_window": W,
        "max_window_layers": sliding.index(True) if W is not None else gcfg.num_layers,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }


def every_layer_window(gcfg: GPTConfig, family: str):
    """The window W every layer of ``gcfg`` has (None: no window), for a family whose
    ``sliding_window`` applies to all layers (Mistral, Qwen3-MoE). Raises HFConversionError naming
    --window-attn-skip-freq when some layers are windowed and others not."""
    W, sliding = window_pattern(gcfg)
    if W is not None and not all(sliding):
        raise HFConversionError(
            f"--window-attn-skip-freq keeps some layers full: {family}'s sliding_window applies to every layer "
            "(fix: no --window-attn-skip-freq, or a Qwen2/Qwen3 export, whose layer_types say it per layer)"
        )
    return W


def mistral_config(llama: dict, gcfg: GPTConfig) -> dict:
    """``config.json`` of the MistralForCausalLM computing what the LlamaForCausalLM config ``llama``
    would: no ``attention_bias`` / ``mlp_bias`` / ``pretraining_tp`` (Mistral has no biases),
    ``head_dim`` always written, ``sliding_window`` W of ``--window-size W-1,0`` (null: full causal
    attention). Raises HFConversionError naming the setting when ``gcfg`` has biases, QK-norm or
    experts, or windows only some layers (``every_layer_window``)."""
    for on, flag in (
        (gcfg.add_bias_linear, "linear biases (fix: --disable-bias-linear)"),
        (gcfg.add_qkv_bias, "--add-qkv-bias"),
        (gcfg.qk_layernorm, "--qk-layernorm"),
        (gcfg.num_experts is not None, "--num-experts"),
    ):
        if on:
            raise HFConversionError(
                f"hf_model_type 'mistral' (a model read from a mistral folder) with {flag}: MistralForCausalLM "
                "has Llama's block without biases, QK-norm or experts"
            )
    window = every_layer_window(gcfg, "Mistral")
    base = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    return {**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window}


def mistral_settings_from_hf(config: Mapping) -> dict:
    """GPTConfig fields of a ``mistral`` ``config.json`` beyond Llama's: no biases, ``hf_model_type``
    ``"mistral"``, and a ``sliding_window`` W below ``max_position_embeddings`` as ``window_size
    [W-1, 0]`` on every layer (one covering the context is full causal attention)."""
    positions = config_value(config, "max_position_embeddings", "size", 2048)  # megazero's context when absent
    L = config_value(config, "num_hidden_layers", "size")
    window = config_value(config, "sliding_window", "size", None)
    return dict(add_bias_linear=False, hf_model_type="mistral", **window_settings([True] * L, window, positions))


def is_qwen2(gcfg: GPTConfig) -> bool:
    """Whether a dense LLaMA-style ``gcfg`` exports as Qwen2ForCausalLM: a bias on q/k/v only
    (``--disable-bias-linear --add-qkv-bias``)."""
    return gcfg.add_qkv_bias and not gcfg.add_bias_linear and gcfg.num_experts is None


def qwen2_config(llama: dict, gcfg: GPTConfig) -> dict:
    """``config.json`` of the Qwen2ForCausalLM computing what the LlamaForCausalLM config ``llama``
    would with q/k/v biases: no ``attention_bias`` / ``mlp_bias`` / ``pretraining_tp`` /
    ``head_dim`` unless ``--kv-channels`` sets it (Qwen2 fixes the first two, derives the last from
    hidden / heads otherwise), the sliding window per layer (``window_keys``)."""
    dropped = ("attention_bias", "mlp_bias", "pretraining_tp") + (("head_dim",) if gcfg.kv_channels is None else ())
    base = {k: v for k, v in llama.items() if k not in dropped}
    return {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **window_keys(gcfg)}


def qwen2_settings_from_hf(config: Mapping) -> dict:
    """GPTConfig fields of a ``qwen2`` ``config.json``: q/k/v biases only, and its sliding-window
    layers (``qwen_window_settings``; HFConversionError naming ``layer_types`` for a pattern the
    flags cannot express)."""
    return dict(add_bias_linear=False, add_qkv_bias=True, **qwen_window_settings(config))


def is_qwen3(gcfg: GPTConfig) -> bool:
    """Whether a LLaMA-style ``gcfg`` exports as Qwen3 (dense) or Qwen3-MoE: ``--qk-layernorm``."""
    return gcfg.qk_layernorm


def qwen3_config(llama: dict, gcfg: GPTConfig) -> dict:
    """``config.json`` of the Qwen3ForCausalLM computing what the LlamaForCausalLM config ``llama``
    would with QK-norm: no ``mlp_bias`` / ``pretraining_tp``, ``attention_bias`` false (the export
    refuses biases first), ``head_dim`` always written (Qwen3Config's default is 128), the sliding
    window per layer (``window_keys``)."""
    base = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp")}
    return {
        **base,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        **window_keys(gcfg),
    }


def qwen3_settings_from_hf(config: Mapping) -> dict:
    """GPTConfig fields of a ``qwen3`` or ``qwen3_moe`` ``config.json`` beyond Llama's: QK-norm, no
    biases, and the sliding window (Qwen3: per layer, ``qwen_window_settings``; Qwen3-MoE: on every
    layer when ``use_sliding_window``). Raises HFConversionError naming ``attention_bias`` when true
    (q/k/v/o biases without MLP biases) or a ``layer_types`` entry megazero does not compute."""
    if config_value(config, "attention_bias", "flag", False):
        raise HFConversionError(
            "attention_bias true: Qwen3 then biases q, k, v and o but not the MLP, which no megazero block does"
        )
    if config.get("model_type") != "qwen3_moe":
        window = qwen_window_settings(config)
    else:  # Qwen3MoeConfig drops the window unless use_sliding_window; then every layer slides
        positions = config_value(config, "max_position_embeddings", "size", 32768)
        L = config_value(config, "num_hidden_layers", "size")
        on = config_value(config, "use_sliding_window", "flag", False)
        size = config_value(config, "sliding_window", "size", None) if on else None
        window = window_settings([True] * L, size, positions)
    return dict(qk_layernorm=True, add_bias_linear=False, **window)


def qwen_window_settings(config: Mapping) -> dict:
    """GPTConfig window fields of a Qwen2 / Qwen3 ``config.json`` (``window_settings``): its
    ``layer_types``, or, without them, those transformers derives (``sliding_attention`` from
    layer ``max_window_layers`` on when ``use_sliding_window``, whose ``sliding_window`` W is null
    otherwise). Raises HFConversionError naming ``layer_types`` for a list of the wrong length, a
    type other than full or sliding attention, or a sliding layer without a window."""
    positions = config_value(config, "max_position_embeddings", "size", 32768)
    L = config_value(config, "num_hidden_layers", "size")
    use = config_value(config, "use_sliding_window", "flag", False)
    window = config_value(config, "sliding_window", "size", None) if use else None
    first = config_value(config, "max_window_layers", "count", 28)
    types = config.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(L)
    ]
    if not isinstance(types, list) or len(types) != L:
        raise HFConversionError(f"layer_types = {str(types)[:60]} is not a list of {L} layer types")
    for i, kind in enumerate(types):
        if kind not in ("full_attention", "sliding_attention"):
            raise HFConversionError(
                f"layer_types[{i}] = {kind!r}: megazero computes full_attention and sliding_attention layers only"
            )
        if kind == "sliding_attention" and window is None:
            raise HFConversionError(
                f"layer_types[{i}] = 'sliding_attention' without a window (use_sliding_window {use}, "
                f"sliding_window {config.get('sliding_window')}): fix: use_sliding_window true with a sliding_window"
            )
    return window_settings([kind == "sliding_attention" for kind in types], window, positions)
