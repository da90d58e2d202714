"""Mistral ``config.json`` <-> GPTConfig (model/hf_families.py), without tensors: a config shaped
like Mistral-7B-v0.3's (transformers 4 keys, ``sliding_window`` null) with ``head_dim`` 16
against hidden / heads = 8 reads as Llama's block with ``--kv-channels 16`` and writes back as
MistralForCausalLM (``hf_model_type``); a window W shorter than ``max_position_embeddings`` reads
as ``--window-size W-1,0`` on every layer and writes back, one covering it is full attention; the export refuses what
Mistral lacks; a ``--from-hf`` folder's family is read from its config.json."""

import dataclasses
import json
import re

import pytest


def _mistral_config(**change):
    """A config.json shaped like Mistral-7B-v0.3's, at tiny sizes (heads of 16, not hidden / heads)."""
    return {
        "architectures": ["MistralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "max_position_embeddings": 256,
        "model_type": "mistral",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0",
        "use_cache": True,
        "vocab_size": 50,
        **change,
    }


def test_a_mistral_config_reads_as_llamas_block_and_writes_back_as_mistral():
    from model.hf import config_from_hf, llama_config

    gcfg = config_from_hf(_mistral_config())
    assert (gcfg.hf_model_type, gcfg.kv_channels, gcfg.head_dim, gcfg.num_query_groups) == ("mistral", 16, 16, 2)
    assert (gcfg.add_bias_linear, gcfg.add_qkv_bias, gcfg.qk_layernorm) == (False, False, False)
    assert (gcfg.rotary_base, gcfg.swiglu, gcfg.normalization) == (1000000, True, "RMSNorm")
    assert (gcfg.tie_embeddings, gcfg.layernorm_epsilon) == (False, 1e-5)
    written = llama_config(gcfg)
    assert (written["model_type"], written["architectures"], written["head_dim"]) == (
        "mistral",
        ["MistralForCausalLM"],
        16,
    )
    assert written["sliding_window"] is None and not {"attention_bias", "mlp_bias", "pretraining_tp"} & set(written)
    assert config_from_hf(written) == gcfg
    llama = llama_config(dataclasses.replace(gcfg, hf_model_type=None))  # the same block, family not remembered
    assert (llama["model_type"], llama["attention_bias"]) == ("llama", False)


@pytest.mark.parametrize("window", [16, 255])
def test_a_window_below_the_context_reads_as_window_size_and_writes_back(window):
    from model.hf import HFConversionError, check_matches, config_from_hf, llama_config

    # window 255 of 256 positions: the query at position 255 does not see key 0
    gcfg = config_from_hf(_mistral_config(sliding_window=window))
    assert (gcfg.window_size, gcfg.window_attn_skip_freq) == ([window - 1, 0], None)
    assert [gcfg.attention_window(i) for i in range(2)] == [window, window]
    written = llama_config(gcfg)
    assert (written["model_type"], written["sliding_window"]) == ("mistral", window)
    assert config_from_hf(written) == gcfg
    with pytest.raises(HFConversionError, match=re.escape("fix: set --window-size to match")):
        check_matches(written, dataclasses.replace(gcfg, window_size=None))  # a --from-hf run without the flag


@pytest.mark.parametrize("window", [256, 4096, None])
def test_a_window_covering_the_context_imports_as_full_attention(window):
    from model.hf import config_from_hf

    gcfg = config_from_hf(_mistral_config(sliding_window=window))
    assert (gcfg.hf_model_type, gcfg.max_position_embeddings, gcfg.kv_channels) == ("mistral", 256, 16)
    assert gcfg.window_size is None


def test_every_mistral_key_is_classified_and_an_unknown_one_refused():
    from model.hf import HFConversionError, config_from_hf

    with pytest.raises(HFConversionError, match="config.json key 'layer_types' is unknown to megazero's mistral map"):
        config_from_hf(_mistral_config(layer_types=["full_attention", "sliding_attention"]))


def test_the_export_refuses_what_mistral_does_not_have():
    from model.hf import HFConversionError, hf_config
    from tests.support.hf_llama import llama_gcfg

    base = dict(hf_model_type="mistral", add_bias_linear=False)
    for change, flag in (
        (dict(add_qkv_bias=True), "--add-qkv-bias"),
        (dict(qk_layernorm=True), "--qk-layernorm"),
        (dict(add_bias_linear=True), "linear biases"),
    ):
        message = f"hf_model_type 'mistral' (a model read from a mistral folder) with {flag}"
        with pytest.raises(HFConversionError, match=re.escape(message)):
            hf_config(llama_gcfg(**{**base, **change}))
    assert hf_config(llama_gcfg(**base))["model_type"] == "mistral"
    with pytest.raises(HFConversionError, match=re.escape("Mistral's sliding_window applies to every layer")):
        hf_config(llama_gcfg(**base, window_size=[7, 0], window_attn_skip_freq=[2]))


def test_a_from_hf_folder_gives_its_family_to_the_run(tmp_path):
    from model.hf_folder import folder_model_type

    for model_type, want in (("mistral", "mistral"), ("llama", None)):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps(_mistral_config(model_type=model_type)))
        assert folder_model_type(str(tmp_path / model_type)) == want
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert folder_model_type(str(tmp_path / "broken")) is None  # check_folder names that error
