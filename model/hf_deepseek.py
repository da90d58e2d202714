"""Hugging Face interchange of DeepSeek-V3 (``model_type`` ``deepseek_v3``, ``DeepseekV3ForCausalLM``):
its ``config.json`` and the tensors that differ from ``model/hf.py``'s Llama map. Like that file it
reads no file (``model/hf_folder.py`` does).

What DeepSeek-V3 computes (transformers 5's ``modeling_deepseek_v3``, read for this map; DeepSeek-AI
2024, "DeepSeek-V3 Technical Report", sec. 2.1), and megazero's settings for each piece:

- attention: multi-head latent attention (model/mla.py, ``--multi-latent-attention`` with
  ``--q-lora-rank`` = ``q_lora_rank`` (null: one ``q_proj``), ``--kv-lora-rank``, ``--qk-head-dim`` =
  ``qk_nope_head_dim``, ``--qk-pos-emb-head-dim`` = ``qk_rope_head_dim``, ``--v-head-dim``); no biases
  (``attention_bias`` false); every head its own key and value (``num_key_value_heads`` = heads);
  the latent norms ``q_a_layernorm`` / ``kv_a_layernorm`` use transformers' fixed epsilon 1e-6, so
  ``rms_norm_eps`` must be 1e-6 too (megazero has one ``--layernorm-epsilon``). DeepSeek's rope rows
  are interleaved pairs (``rope_interleave`` true, every released folder): the import reorders them
  to megazero's rotate-half order (``model.mla.rope_rows_from_interleaved``: the last
  ``qk_rope_head_dim`` rows of each head of ``q_b_proj`` / ``q_proj`` and of ``kv_a_proj_with_mqa``),
  the export puts them back (``rope_rows_to_interleaved``), so a folder round-trips bit for bit.
  RoPE: ``rope_parameters`` as every family (``model.hf_families.rope_settings_from_hf``); under
  yarn the scores are also scaled by ``mscale_all_dim``'s square (``model.mla.mla_softmax_scale``).
- MLP: layers ``0 .. first_k_dense_replace - 1`` are dense SwiGLU MLPs of ``intermediate_size``
  (``--ffn-hidden-size``), the others Mixtures of Experts: ``--moe-layer-freq`` as Megatron-LM's
  pattern, k zeros then ones (an integer 1 when k = 0). Each MoE layer: ``n_routed_experts``
  (``--num-experts``) SwiGLU experts of ``moe_intermediate_size`` (``--moe-ffn-hidden-size``), one
  shared expert of ``n_shared_experts * moe_intermediate_size``
  (``--moe-shared-expert-intermediate-size``), added ungated; the router ``gate.weight [E, H]``
  (fp32 logits) with sigmoid scores (``--moe-router-score-function sigmoid``), the experts chosen by
  the scores plus ``e_score_correction_bias [E]`` (megazero's expert bias,
  ``--moe-router-enable-expert-bias``, read from and written to the folder), among the
  ``topk_group`` best of ``n_group`` groups (``--moe-router-group-topk`` / ``--moe-router-num-groups``;
  one group: no flag), weighted by their scores divided by their sum (``norm_topk_prob`` true; with
  k = 1 megazero keeps the score, which is ``norm_topk_prob`` false) times ``routed_scaling_factor``
  (``--moe-router-topk-scaling-factor``; 1.0: no flag).
- multi-token prediction (``num_nextn_predict_layers``, the ``model.layers.{L}.*`` tensors past the
  last layer in DeepSeek's folders): transformers' causal LM does not read them and neither does the
  import (a note in docs/checkpoints.md); the export writes 0 and no such tensors.

``KEYS`` classifies every key of ``DeepseekV3Config().to_dict()`` (plus the legacy rope keys, the
alias ``num_local_experts`` and the extra keys of DeepSeek's released ``config.json``: ``scoring_func``,
``topk_method``, ``moe_layer_freq`` checked, ``auto_map``, ``aux_loss_alpha``, ``seq_aux``, ``ep_size``
without effect) as mapped, checked or without effect; ``model.hf_families.check_keys``
refuses any other.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from model import hf_families
from model.config import MLA_FIELDS, GPTConfig
from model.hf_config import HFConversionError, config_value
from model.mla import rope_rows_from_interleaved

MODEL_TYPE = "deepseek_v3"
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, the eps of q_a_layernorm / kv_a_layernorm

KEYS = {
    "mapped": tuple(k for k in hf_families.COMMON_MAPPED if k != "num_key_value_heads")
    + ("moe_intermediate_size", "n_shared_experts", "n_routed_experts", "num_local_experts")
    + ("routed_scaling_factor", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace")
    + ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"),
    "checked": (
        "hidden_act",
        "attention_bias",
        "num_key_value_heads",
        "head_dim",
        "qk_head_dim",
        "norm_topk_prob",
        "rope_interleave",
        "scoring_func",
        "topk_method",
        "moe_layer_freq",
    ),
    "no_effect": {
        **hf_families.COMMON_NO_EFFECT,
        **hf_families.ROUTER_NO_EFFECT,
        "pretraining_tp": "read by no transformers 5 DeepSeek-V3 layer",
        "num_nextn_predict_layers": "multi-token prediction modules: their tensors (model.layers.{L}.*) are not "
        "read by transformers' causal LM nor by megazero's import (the export writes 0)",
        "num_mtp_layers": "transformers' alias of num_nextn_predict_layers",
        # keys of DeepSeek's released config.json (its remote code), which transformers' class keeps unread
        "auto_map": "the remote-code classes of DeepSeek's own modeling file; transformers' class computes the same",
        "aux_loss_alpha": "the weight of DeepSeek's training-time balance loss (megazero's: --moe-aux-loss-coeff)",
        "seq_aux": "whether that loss is per sequence (megazero's: --moe-router-load-balancing-type seq_aux_loss)",
        "ep_size": "the expert-parallel size DeepSeek trained with (megazero's: --expert-model-parallel-size)",
    },
}

# DeepseekV3Config's defaults (transformers 5), what transformers computes for a key a config.json leaves out
DEFAULTS = dict(
    first_k_dense_replace=3,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    num_experts_per_tok=8,
    max_position_embeddings=4096,
    intermediate_size=18432,
)

# GPTConfig fields a DeepSeek-V3 export expresses beyond Llama's (model.hf._check_llama)
FIELDS = set(MLA_FIELDS)

# canonical layer tensor (after "layers.{i}.") -> DeepSeek-V3's (after "model.layers.{i}.")
_ATTENTION = {
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.q_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b.weight": "self_attn.q_b_proj.weight",
    "attn.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b.weight": "self_attn.kv_b_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


def is_deepseek(gcfg: GPTConfig) -> bool:
    """Whether ``gcfg`` converts as DeepseekV3ForCausalLM: multi-head latent attention (no other
    family has it)."""
    return gcfg.multi_latent_attention


_SIZES = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "kv_lora_rank")
_SIZES += ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _first_k_dense(config: Mapping, L: int) -> int:
    return min(config_value(config, "first_k_dense_replace", "count", DEFAULTS["first_k_dense_replace"]), L)


def _check_hf(config: Mapping) -> None:
    """Raise HFConversionError naming the first key whose value megazero computes differently."""
    heads = config_value(config, "num_attention_heads", "size")
    nope, rope = (config_value(config, key, "size", DEFAULTS[key]) for key in ("qk_nope_head_dim", "qk_rope_head_dim"))
    k = config_value(config, "num_experts_per_tok", "size", DEFAULTS["num_experts_per_tok"])
    rope_table = config_value(config, "rope_parameters", "table", None) or {}
    shared = config_value(config, "n_shared_experts", "count", DEFAULTS["n_shared_experts"])
    for bad, what in (
        (config.get("hidden_act", "silu") != "silu", f"hidden_act {config.get('hidden_act')!r}: the gate is silu"),
        (config_value(config, "attention_bias", "flag", False), "attention_bias true: megazero's MLA has no biases"),
        (
            config_value(config, "num_key_value_heads", "size", heads) != heads,
            f"num_key_value_heads {config.get('num_key_value_heads')} != num_attention_heads {heads}: "
            "transformers would repeat MLA's per-head keys; megazero's MLA has one key and value per head",
        ),
        (config_value(config, "head_dim", "size", rope) != rope, f"head_dim != qk_rope_head_dim {rope}"),
        (config_value(config, "qk_head_dim", "size", nope + rope) != nope + rope, f"qk_head_dim != {nope} + {rope}"),
        (
            config_value(config, "norm_topk_prob", "flag", True) != (k > 1),
            f"norm_topk_prob {config.get('norm_topk_prob', True)} with num_experts_per_tok {k}: megazero divides "
            "the sigmoid weights of k > 1 experts by their sum and keeps a single expert's score",
        ),
        (
            not config_value(config, "rope_interleave", "flag", True),
            "rope_interleave false: megazero reads DeepSeek's interleaved rope rows (every released folder)",
        ),
        (
            config_value(config, "rms_norm_eps", "number", LATENT_NORM_EPS) != LATENT_NORM_EPS,
            f"rms_norm_eps {config.get('rms_norm_eps')}: transformers' latent norms keep 1e-6 and megazero has "
            "one --layernorm-epsilon for every norm",
        ),
        (
            config_value(rope_table, "partial_rotary_factor", "number", 1.0) != 1.0,
            "rope_parameters.partial_rotary_factor != 1: MLA rotates all qk_rope_head_dim dimensions",
        ),
        (shared < 1, "n_shared_experts 0: megazero's map needs a shared expert"),
        (
            config.get("scoring_func", "sigmoid") != "sigmoid",
            f"scoring_func {config.get('scoring_func')!r}: DeepSeek-V3's scores are sigmoids",
        ),
        (
            config.get("topk_method", "noaux_tc") != "noaux_tc",
            f"topk_method {config.get('topk_method')!r}: megazero routes as DeepSeek-V3's noaux_tc (biased groups)",
        ),
        (config.get("moe_layer_freq", 1) != 1, f"moe_layer_freq {config.get('moe_layer_freq')}: transformers reads 1"),
    ):
        if bad:
            raise HFConversionError(what)


def settings_from_hf(config: Mapping) -> dict:
    """GPTConfig fields of a ``deepseek_v3`` ``config.json`` (all of them but a run's overrides).
    Raises HFConversionError naming a key megazero computes differently or does not know."""
    hf_families.check_keys(config, KEYS)
    _check_hf(config)
    H, heads = config_value(config, "hidden_size", "size"), config_value(config, "num_attention_heads", "size")
    L = config_value(config, "num_hidden_layers", "size")
    positions = config_value(config, "max_position_embeddings", "size", DEFAULTS["max_position_embeddings"])
    rope = config_value(config, "rope_parameters", "table", None) or config_value(config, "rope_scaling", "table", {})
    theta = config_value(rope, "rope_theta", "number", config_value(config, "rope_theta", "number", 10000.0))
    size = {key: config_value(config, key, "size", DEFAULTS[key]) for key in _SIZES}
    E = config_value(config, "num_local_experts", "size", None) or size["n_routed_experts"]
    k, F = size["num_experts_per_tok"], size["moe_intermediate_size"]
    if k > E:
        raise HFConversionError(f"num_experts_per_tok {k} exceeds the {E} experts")
    G = config_value(config, "n_group", "size", DEFAULTS["n_group"] if "n_group" not in config else 1)
    group_k = config_value(config, "topk_group", "size", DEFAULTS["topk_group"] if "topk_group" not in config else 1)
    q_lora = config.get("q_lora_rank", DEFAULTS["q_lora_rank"])
    if G > 1 and (E % G or E // G < 2):
        raise HFConversionError(f"n_group {G} with {E} experts: transformers sums the top 2 of each of G equal groups")
    dense = _first_k_dense(config, L)
    scaling = float(config_value(config, "routed_scaling_factor", "number", DEFAULTS["routed_scaling_factor"]))
    return dict(
        vocab_size=config_value(config, "vocab_size", "size"),
        num_layers=L,
        hidden_size=H,
        num_attention_heads=heads,
        ffn_hidden_size=size["intermediate_size"],
        max_position_embeddings=positions,
        seq_length=positions,
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        tie_embeddings=config_value(config, "tie_word_embeddings", "flag", False),
        layernorm_epsilon=LATENT_NORM_EPS,
        multi_latent_attention=True,
        q_lora_rank=None if q_lora is None else config_value(config, "q_lora_rank", "size", DEFAULTS["q_lora_rank"]),
        kv_lora_rank=size["kv_lora_rank"],
        qk_head_dim=size["qk_nope_head_dim"],
        qk_pos_emb_head_dim=size["qk_rope_head_dim"],
        v_head_dim=size["v_head_dim"],
        num_experts=E,
        moe_router_topk=k,
        moe_ffn_hidden_size=F,
        moe_shared_expert_intermediate_size=F * config_value(config, "n_shared_experts", "size", 1),
        moe_layer_freq=1 if dense == 0 else [0] * dense + [1] * (L - dense),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=G if G > 1 else None,
        moe_router_group_topk=group_k if G > 1 else None,
        moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
        **hf_families.rope_settings_from_hf(rope, positions),
    )


def dense_layers(gcfg: GPTConfig) -> Optional[int]:
    """``first_k_dense_replace`` of ``gcfg``: the k of ``--moe-layer-freq`` k zeros then ones (an
    integer 1: 0), None when its MoE layers have another pattern."""
    freq, L = gcfg.moe_layer_freq, gcfg.num_layers
    if freq == 1:
        return 0
    if isinstance(freq, list):
        k = freq.index(1) if 1 in freq else L
        if freq == [0] * k + [1] * (L - k):
            return k
    return None


def check_export(gcfg: GPTConfig) -> None:
    """Raise HFConversionError naming the first setting of an MLA ``gcfg`` that DeepseekV3ForCausalLM
    does not compute (module docstring)."""
    moe = gcfg.num_experts is not None
    F, shared = gcfg.moe_ffn_hidden_size, gcfg.moe_shared_expert_intermediate_size
    G = gcfg.moe_router_num_groups
    for refused, what in (
        (
            not moe,
            "--multi-latent-attention without --num-experts: megazero writes MLA as DeepSeek-V3, whose "
            "layers past first_k_dense_replace are MoE layers",
        ),
        (
            moe and dense_layers(gcfg) is None,
            f"--moe-layer-freq {gcfg.moe_layer_freq}: DeepSeek-V3's dense "
            "layers are the first k (first_k_dense_replace; fix: k zeros then ones)",
        ),
        (
            moe and gcfg.moe_router_score_function != "sigmoid",
            "--moe-router-score-function softmax: DeepSeek-V3 scores experts with a sigmoid",
        ),
        (moe and gcfg.moe_router_pre_softmax, "--moe-router-pre-softmax: DeepSeek-V3's scores are sigmoids"),
        (moe and gcfg.moe_router_linear_bias, "--moe-router-linear-bias: DeepSeek-V3's router has no bias"),
        (moe and gcfg.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor: DeepSeek-V3 is dropless"),
        (
            moe and (shared is None or shared % F),
            f"--moe-shared-expert-intermediate-size {shared}: DeepSeek-V3's "
            f"shared expert is n_shared_experts x --moe-ffn-hidden-size {F} wide",
        ),
        (
            moe and G is not None and gcfg.num_experts // G < 2,
            f"--moe-router-num-groups {G}: transformers sums "
            "the top 2 scores of each group, so a group needs 2 experts",
        ),
        (gcfg.add_bias_linear, "linear biases (fix: --disable-bias-linear): DeepSeek-V3 has none"),
        (
            gcfg.layernorm_epsilon != LATENT_NORM_EPS,
            f"--layernorm-epsilon {gcfg.layernorm_epsilon}: DeepSeek-V3's "
            "latent norms use 1e-6 (fix: --layernorm-epsilon 1e-6)",
        ),
        (
            gcfg.normalization != "RMSNorm" or not gcfg.swiglu,
            "DeepSeek-V3 has RMSNorm and SwiGLU (--normalization RMSNorm --swiglu)",
        ),
        (gcfg.kv_channels is not None, "--kv-channels: MLA's head sizes are its own flags"),
    ):
        if refused:
            raise HFConversionError(f"{what} (no exact DeepseekV3ForCausalLM equivalent)")


def deepseek_config(llama: dict, gcfg: GPTConfig) -> dict:
    """``config.json`` of the DeepseekV3ForCausalLM computing ``gcfg``'s model (``check_export``
    first), from the LlamaForCausalLM ``llama`` config of the same norms and RoPE."""
    check_export(gcfg)
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    keep += ("max_position_embeddings", "rms_norm_eps", "rope_parameters", "attention_dropout")
    keep += ("initializer_range", "tie_word_embeddings", "bos_token_id", "eos_token_id", "use_cache")
    G = gcfg.moe_router_num_groups
    scaling = gcfg.moe_router_topk_scaling_factor
    return {
        **{key: llama[key] for key in keep},
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": MODEL_TYPE,
        "num_key_value_heads": gcfg.num_attention_heads,
        "hidden_act": "silu",
        "attention_bias": False,
        "q_lora_rank": gcfg.q_lora_rank,
        "kv_lora_rank": gcfg.kv_lora_rank,
        "qk_nope_head_dim": gcfg.qk_head_dim,
        "qk_rope_head_dim": gcfg.qk_pos_emb_head_dim,
        "v_head_dim": gcfg.v_head_dim,
        "qk_head_dim": gcfg.qk_head_dim + gcfg.qk_pos_emb_head_dim,
        "head_dim": gcfg.qk_pos_emb_head_dim,
        "rope_interleave": True,
        "moe_intermediate_size": gcfg.moe_ffn_hidden_size,
        "n_routed_experts": gcfg.num_experts,
        "n_shared_experts": gcfg.moe_shared_expert_intermediate_size // gcfg.moe_ffn_hidden_size,
        "num_experts_per_tok": gcfg.moe_router_topk,
        "first_k_dense_replace": dense_layers(gcfg),
        "n_group": 1 if G is None else G,
        "topk_group": 1 if G is None else gcfg.moe_router_group_topk,
        "norm_topk_prob": gcfg.moe_router_topk > 1,
        "routed_scaling_factor": 1.0 if scaling is None else scaling,
        "num_nextn_predict_layers": 0,
        "output_router_logits": False,
        "pretraining_tp": 1,
        "dtype": "float32",
    }


def layer_pieces(rest: str, pre: str, gcfg: GPTConfig) -> Optional[list[tuple[str, int, Optional[int]]]]:
    """``model.hf.llama_pieces`` of a DeepSeek-V3 layer tensor ``rest`` (canonical name after
    ``layers.{i}.``; ``pre`` = ``model.layers.{i}.``) that is not Llama's: MLA's projections and norms,
    the router, the routed experts' and the shared experts' SwiGLU (``fc1`` = ``[gate; up]``); None
    for another name (norms, ``o_proj``, a dense MLP: Llama's names)."""
    if rest in _ATTENTION:
        return [(pre + _ATTENTION[rest], 0, None)]
    parts = rest.split(".")
    if len(parts) == 5 and parts[:2] == ["mlp", "experts"]:
        expert, fc = f"{pre}mlp.experts.{parts[2]}.", parts[3]
    elif len(parts) == 4 and parts[:2] == ["mlp", "shared_experts"]:
        expert, fc = f"{pre}mlp.shared_experts.", parts[2]
    else:
        return None
    if parts[-1] != "weight" or fc not in ("fc1", "fc2"):
        return None
    if fc == "fc1":
        return [(f"{expert}gate_proj.weight", 0, None), (f"{expert}up_proj.weight", 0, None)]
    return [(f"{expert}down_proj.weight", 0, None)]


def _rope_blocks(canonical: str, gcfg: GPTConfig) -> Optional[int]:
    """Row blocks ending in rope rows of canonical tensor ``canonical``: heads for ``q`` / ``q_b``, 1 for
    ``kv_a``, None for a tensor without rope rows."""
    if canonical.endswith(("attn.q.weight", "attn.q_b.weight")):
        return gcfg.num_attention_heads
    return 1 if canonical.endswith("attn.kv_a.weight") else None


def rope_rows_to_interleaved(weight: torch.Tensor, blocks: int, rope: int) -> torch.Tensor:
    """The inverse of ``model.mla.rope_rows_from_interleaved``: the last ``rope`` rows of each of
    ``blocks`` row blocks of ``weight [rows, cols]`` from megazero's rotate-half order back to
    DeepSeek's interleaved pairs. A new tensor of the same shape; ValueError as that function."""
    rows_at = torch.arange(rope, dtype=torch.float32, device=weight.device).view(rope, 1)
    order = rope_rows_from_interleaved(rows_at, 1, rope)  # (rope, 1): the interleaved row of each of ours
    inverse = order.view(-1).long().argsort()  # (rope,): our row of each interleaved row
    rows = weight.shape[0]
    if rows % blocks or rows // blocks < rope:
        raise ValueError(f"{rows} rows do not split into {blocks} blocks ending in {rope} rope rows")
    w = weight.reshape(blocks, rows // blocks, *weight.shape[1:]).clone()  # (blocks, rows/blocks, cols)
    w[:, -rope:] = w[:, -rope:][:, inverse]
    return w.reshape(weight.shape)


def from_hf_rows(canonical: str, t: torch.Tensor, gcfg: GPTConfig) -> torch.Tensor:
    """Canonical tensor ``canonical`` from its DeepSeek-V3 rows ``t`` (rope rows reordered)."""
    blocks = _rope_blocks(canonical, gcfg)
    return t if blocks is None else rope_rows_from_interleaved(t, blocks, gcfg.qk_pos_emb_head_dim)


def to_hf_rows(canonical: str, t: torch.Tensor, gcfg: GPTConfig) -> torch.Tensor:
    """DeepSeek-V3's rows of canonical tensor ``canonical`` ``t`` (rope rows interleaved)."""
    blocks = _rope_blocks(canonical, gcfg)
    return t if blocks is None else rope_rows_to_interleaved(t, blocks, gcfg.qk_pos_emb_head_dim)


def bias_name(layer: int) -> str:
    """The folder's name of MoE layer ``layer``'s router correction bias ``[E]`` (megazero's expert bias)."""
    return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"


def bias_shapes(gcfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """``e_score_correction_bias`` ``[E]`` of every MoE layer of an MLA ``gcfg`` (none otherwise)."""
    if not is_deepseek(gcfg) or gcfg.num_experts is None:
        return {}
    return {bias_name(i): (gcfg.num_experts,) for i in range(gcfg.num_layers) if gcfg.is_moe_layer(i)}


def bias_tensors(gcfg: GPTConfig, expert_bias: Optional[Mapping[int, list]]) -> dict[str, torch.Tensor]:
    """The folder's ``e_score_correction_bias`` tensors (fp32): ``expert_bias`` ``{layer: E floats}``
    (a checkpoint's ``moe_expert_bias``, ``model.moe_state.expert_bias_state``), zeros for a layer it
    lacks (a model without ``--moe-router-enable-expert-bias``: no bias is a zero bias)."""
    out = {}
    for name, shape in bias_shapes(gcfg).items():
        layer = int(name.split(".")[2])
        values = (expert_bias or {}).get(layer)
        out[name] = torch.zeros(shape, device="cpu") if values is None else torch.tensor(values, device="cpu")
    return out
