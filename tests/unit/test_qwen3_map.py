"""Qwen3 and Qwen3-MoE ``config.json`` <-> GPTConfig (model/hf_families.py, model/hf_moe.py), without
tensors: a config shaped like the released Qwen3-30B-A3B one (``head_dim`` 128 against hidden /
heads = 64, ``num_experts``, ``norm_topk_prob`` true) reads as ``--kv-channels --qk-layernorm``
with megazero's default (renormalising) router and writes back; what neither class computes is
refused in one line naming the key or flag. Sliding windows: Qwen3's per-layer pattern (from
``use_sliding_window`` / ``max_window_layers`` or ``layer_types``) and Qwen3-MoE's all-layer window
read as ``--window-size W-1,0`` with ``--window-attn-skip-freq`` and write back the same keys."""

import re

import pytest


def _qwen3_moe_config(**change):
    """A config.json shaped like Qwen3-30B-A3B's (transformers 4 keys), at tiny sizes."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "decoder_sparse_step": 1,
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "max_position_embeddings": 256,
        "max_window_layers": 2,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 8,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 50,
        **change,
    }


def test_a_qwen3_moe_config_reads_as_kv_channels_qk_norm_and_experts_and_writes_back():
    from model.hf import config_from_hf, llama_config

    gcfg = config_from_hf(_qwen3_moe_config())
    assert (gcfg.kv_channels, gcfg.head_dim, gcfg.qk_layernorm, gcfg.add_bias_linear) == (16, 16, True, False)
    assert (gcfg.num_experts, gcfg.moe_router_topk, gcfg.moe_ffn_hidden_size, gcfg.moe_layer_freq) == (8, 2, 8, 1)
    assert not gcfg.moe_router_pre_softmax and gcfg.moe_shared_expert_intermediate_size is None
    assert gcfg.rotary_base == 1000000 and gcfg.num_query_groups == 2
    written = llama_config(gcfg)
    assert (written["model_type"], written["head_dim"], written["num_experts"], written["norm_topk_prob"]) == (
        "qwen3_moe",
        16,
        8,
        True,
    )
    assert config_from_hf(written) == gcfg
    dense = {k: v for k, v in _qwen3_moe_config(model_type="qwen3").items() if "expert" not in k}
    dense = {k: v for k, v in dense.items() if k not in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")}
    dense = {k: v for k, v in dense.items() if k not in ("moe_intermediate_size", "output_router_logits")}
    dense.pop("router_aux_loss_coef")
    qwen3 = config_from_hf(dense)
    assert (qwen3.kv_channels, qwen3.qk_layernorm, qwen3.num_experts) == (16, True, None)
    assert llama_config(qwen3)["model_type"] == "qwen3" and config_from_hf(llama_config(qwen3)) == qwen3


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(attention_bias=True), "attention_bias true"),
        (dict(mlp_only_layers=[0]), "MoE layers [1] (decoder_sparse_step 1, mlp_only_layers [0])"),
        (dict(decoder_sparse_step=2), "MoE layers [1] (decoder_sparse_step 2"),
        (dict(shared_expert_intermediate_size=16), "'shared_expert_intermediate_size' is unknown"),
        (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "rope type 'longrope'"),
    ],
)
def test_import_refuses_a_qwen3_moe_config_megazero_computes_differently(change, message):
    from model.hf import HFConversionError, config_from_hf

    with pytest.raises(HFConversionError, match=re.escape(message)):
        config_from_hf(_qwen3_moe_config(**change))


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(add_qkv_bias=True), "--qk-layernorm with linear biases"),
        (
            dict(num_experts=4, moe_shared_expert_intermediate_size=16),
            "--qk-layernorm with --moe-shared-expert-intermediate-size",
        ),
    ],
)
def test_export_refuses_qk_norm_where_qwen3_has_none(change, message):
    from model.hf import HFConversionError, hf_config
    from tests.support.hf_llama import llama_gcfg

    with pytest.raises(HFConversionError, match=re.escape(message)):
        hf_config(llama_gcfg(qk_layernorm=True, kv_channels=12, **change))


def _dense(**change):
    """The same config as a dense Qwen3 (no expert keys)."""
    moe_keys = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "moe_intermediate_size")
    moe_keys += ("output_router_logits", "router_aux_loss_coef", "num_experts", "num_experts_per_tok")
    config = {k: v for k, v in _qwen3_moe_config(model_type="qwen3").items() if k not in moe_keys}
    return {**config, **change}


@pytest.mark.parametrize(
    "change,size,freq,types",
    [  # max_window_layers 1: layer 0 full, layer 1 slides -> the 0/1 list (no N makes layer 1 full)
        (dict(use_sliding_window=True, sliding_window=64, max_window_layers=1), [63, 0], [0, 1], None),
        # layer_types as written: layer 2 (1-based) full -> Megatron-LM's integer form N = 2
        (
            dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
            [7, 0],
            [2],
            ["sliding_attention", "full_attention"],
        ),
        (dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), [7, 0], None, None),  # all slide
        (dict(use_sliding_window=True, sliding_window=256, max_window_layers=0), None, None, None),  # covers 256
        (dict(use_sliding_window=False, sliding_window=8, max_window_layers=0), None, None, None),  # switched off
    ],
)
def test_qwen3_sliding_layers_read_as_megatron_window_flags_and_write_back(change, size, freq, types):
    from model.hf import config_from_hf, llama_config

    gcfg = config_from_hf(_dense(**change))
    assert (gcfg.window_size, gcfg.window_attn_skip_freq) == (size, freq)
    written = llama_config(gcfg)
    assert written["use_sliding_window"] == (size is not None)
    assert written["sliding_window"] == (None if size is None else size[0] + 1)
    sliding = [gcfg.attention_window(i) is not None for i in range(2)]
    assert written["layer_types"] == ["sliding_attention" if s else "full_attention" for s in sliding]
    if types is not None:
        assert written["layer_types"] == types
    assert config_from_hf(written) == gcfg


def test_qwen3_moe_window_slides_every_layer_and_writes_back():
    from model.hf import config_from_hf, llama_config

    gcfg = config_from_hf(_qwen3_moe_config(use_sliding_window=True, sliding_window=64))
    assert (gcfg.window_size, gcfg.window_attn_skip_freq) == ([63, 0], None)
    written = llama_config(gcfg)
    assert (written["use_sliding_window"], written["sliding_window"]) == (True, 64)
    assert config_from_hf(written) == gcfg


@pytest.mark.parametrize(
    "change,message",
    [
        (
            dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "chunked_attention"]),
            "layer_types[1] = 'chunked_attention': megazero computes full_attention and sliding_attention layers only",
        ),
        (
            dict(use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]),
            "layer_types[0] = 'sliding_attention' without a window",
        ),
        (dict(layer_types=["full_attention"]), "is not a list of 2 layer types"),
    ],
)
def test_a_layer_pattern_the_flags_cannot_express_is_refused_in_one_line(change, message):
    from model.hf import HFConversionError, config_from_hf

    with pytest.raises(HFConversionError, match=re.escape(message)) as e:
        config_from_hf(_dense(**change))
    assert "\n" not in str(e.value)


def test_export_refuses_a_window_where_the_family_has_none_or_only_one_for_all_layers():
    from model.hf import HFConversionError, hf_config
    from tests.support.hf_llama import llama_gcfg

    with pytest.raises(HFConversionError, match=re.escape("--window-size: megazero writes a sliding window as")):
        hf_config(llama_gcfg(window_size=[7, 0]))  # a plain Llama block
    moe = dict(qk_layernorm=True, kv_channels=12, num_experts=4, window_size=[7, 0], window_attn_skip_freq=[2])
    with pytest.raises(HFConversionError, match=re.escape("Qwen3-MoE's sliding_window applies to every layer")):
        hf_config(llama_gcfg(**moe))
