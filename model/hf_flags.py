"""The megazero model flags of a Hugging Face folder: the command line (Megatron-LM's spelling,
the flags of ``megazero.config.schema``) whose model is the one ``model.hf.config_from_hf`` reads
from the folder's ``config.json``, so that ``--from-hf FOLDER`` plus these flags passes
``model.build.check_from_hf`` without typing a size by hand.

Each GPTConfig field is either a model setting, printed through its schema setting
(``setting_named``: flag, type and default), or one of ``RUN_FIELDS``, which the run chooses
(sequence length, dropout, kernels, recomputation, the MoE training losses) or which
``--from-hf`` itself gives (``hf_model_type``). A field in neither group, a value the flags
cannot carry (a non-integer ``rotary_base``) or a reward model's value head is refused by name
(``HFConversionError``), never left out: a printed line always describes the whole model.

Spelling: a switch appears when it differs from its default (``--untie-embeddings-and-output-weights``,
``--disable-bias-linear``, ``--no-yarn-correction-range-round-to-int``); a value flag when its value
differs from the flag's default, the sizes always; lists comma-joined (``--window-size 7,0``); a value
that starts with ``-`` is written ``--flag=value`` so that argparse does not take it for a flag.
"""

from __future__ import annotations

import dataclasses
import os

from megazero.config.schema import setting_named
from model.config import GPTConfig
from model.hf_config import HFConversionError
from model.hf_folder import check_folder, folder_config

# GPTConfig fields a run chooses (or --from-hf gives): not part of the folder's model, never printed
RUN_FIELDS = frozenset(
    {
        "seq_length",
        "hidden_dropout",
        "attention_dropout",
        "init_method_std",
        "make_vocab_size_divisible_by",
        "sequence_parallel",
        "tp_overlap_grad_reduce",
        "params_dtype",
        "fp8_format",  # a precision choice of the run (--fp8-format, --fp8-recipe, --fp8-block)
        "fp8_recipe",
        "fp8_block",
        "label_smoothing",
        "norm_backend",
        "cp_comm_type",
        "cp_ring_kernel",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "hf_model_type",  # read from the folder's config.json by --from-hf (model.hf_folder.folder_model_type)
        "moe_router_dtype",
        "moe_router_load_balancing_type",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_token_drop_policy",
        "moe_pad_expert_input_to_capacity",
        "moe_router_bias_update_rate",
        "moe_token_dispatcher_type",
        "mtp_loss_scaling_factor",  # the training loss's weight of the MTP modules (which are the model's)
    }
)
# printed whatever their value, so that the line reads as the model's shape
_ALWAYS = (
    "vocab_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "max_position_embeddings",
    "layernorm_epsilon",
)
# GPTConfig field -> its schema setting where the names differ (others: "model.<field>")
_SETTING = {"vocab_size": "data.vocab_size"}


def _text(value) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def _value_flag(flag: str, value) -> list[str]:
    text = _text(value)
    return [f"{flag}={text}"] if text.startswith("-") else [flag, text]


def _setting_flags(name: str, value, always: bool) -> list[str]:
    """The flags giving setting ``name`` (``"model.num_layers"``) the value ``value``."""
    s = setting_named(name)
    if s.base is bool:
        return [s.flag] if value != s.default else []
    if s.base is int and isinstance(value, float):
        if not value.is_integer():
            raise HFConversionError(f"{s.flag} takes a whole number; the model has {value!r}, which no flag expresses")
        value = int(value)
    if value is None or (value == s.default and not always):
        return []
    return _value_flag(s.flag, value)


def model_flags(gcfg: GPTConfig) -> list[str]:
    """The megazero flags (argv words, Megatron-LM spelling) that give a run ``gcfg``'s model: every
    GPTConfig field outside ``RUN_FIELDS``, in GPTConfig's field order; the sizes, ``--vocab-size``,
    ``--layernorm-epsilon`` and (with RoPE) ``--rotary-base`` always, other settings where they differ
    from their flag's default; ``tie_embeddings`` False as ``--untie-embeddings-and-output-weights``,
    ``num_query_groups`` G as ``--group-query-attention --num-query-groups G``,
    ``--moe-ffn-hidden-size`` always with experts.

    Raises HFConversionError naming the field for a value no flag expresses: a field this map does
    not know (a GPTConfig field added without a flag here), a non-integer ``rotary_base``, a value
    head (a reward model: ``--post-train rm`` is a run's mode, not a model flag)."""
    out: list[str] = []
    for f in dataclasses.fields(gcfg):
        name, value = f.name, getattr(gcfg, f.name)
        if name in RUN_FIELDS:
            continue
        if name == "value_head":
            if value:
                raise HFConversionError(
                    "value_head: a reward model's head is --post-train rm, not a model flag; fix: print the "
                    "flags of its language model (value_head False)"
                )
        elif name == "tie_embeddings":
            out += _setting_flags("model.untie_embeddings_and_output_weights", not value, False)
        elif name == "num_query_groups":
            if value is not None:
                out += ["--group-query-attention"] + _value_flag("--num-query-groups", value)
        elif name == "moe_ffn_hidden_size":
            out += _setting_flags("model.moe_ffn_hidden_size", value, gcfg.num_experts is not None)
        else:
            try:
                setting = _SETTING.get(name, f"model.{name}")
                rope = name == "rotary_base" and gcfg.position_embedding_type == "rope"
                out += _setting_flags(setting, value, name in _ALWAYS or rope)
            except StopIteration:
                raise HFConversionError(
                    f"GPTConfig field {name} = {value!r} has no megazero flag known to model.hf_flags; "
                    "fix: add it to model_flags (or RUN_FIELDS when a run chooses it)"
                ) from None
    return out


def folder_flags(path: str) -> list[str]:
    """``model_flags`` of Hugging Face folder ``path`` (``model.hf_folder.folder_config``), after
    checking that the folder holds that model (``model.hf_folder.check_folder``: config.json and
    every tensor's shape and dtype; headers only), so a run given ``--from-hf path`` and these flags
    starts. Raises HFConversionError naming the folder or file and the fix when ``path`` is not a
    folder, holds no ``config.json`` or holds a model megazero does not read; MissingExtra
    (``megazero.runtime.extras``) without safetensors."""
    if not os.path.isdir(path):
        raise HFConversionError(f"{path} is not a folder; fix: a Hugging Face model folder (config.json + safetensors)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise HFConversionError(
            f"{path} holds no config.json, so it is not a Hugging Face model folder; fix: the folder "
            "save_pretrained or python -m scripts.convert_checkpoint --to-hf wrote"
        )
    gcfg = folder_config(path)
    check_folder(path, gcfg)
    return model_flags(gcfg)
