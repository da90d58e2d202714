"""DeepSeek-V3 ``config.json`` <-> GPTConfig (model/hf_deepseek.py), mostly without tensors: a config
shaped like DeepSeek's released one (its remote-code keys, transformers 4's ``rope_scaling``) at tiny
sizes reads as MLA + first-k-dense + grouped sigmoid routing with the expert bias and writes back;
keys a folder leaves out take transformers' defaults; every value neither side computes alike is one
line naming the key (import) or the flag (export); the rope-row reorder round-trips; multi-token
prediction tensors past the last layer are ignored."""

import pytest
import torch

from model.hf_config import HFConversionError
from tests.support.extras import require


def _released_config(**change):
    """The keys of DeepSeek-V3's released config.json (its quantization_config dropped: megazero reads
    unquantized tensors), at tiny sizes."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 72,
        "kv_lora_rank": 16,
        "max_position_embeddings": 640,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 8,
        "moe_layer_freq": 1,
        "n_group": 4,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 5,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "use_cache": True,
        "v_head_dim": 8,
        "vocab_size": 50,
        **change,
    }


def test_a_released_deepseek_v3_config_reads_as_mla_first_k_dense_and_grouped_sigmoid_routing():
    from model.hf import config_from_hf, llama_config

    g = config_from_hf(_released_config())
    assert (g.multi_latent_attention, g.q_lora_rank, g.kv_lora_rank) == (True, 24, 16)
    assert (g.qk_head_dim, g.qk_pos_emb_head_dim, g.v_head_dim, g.layernorm_epsilon) == (8, 4, 8, 1e-6)
    assert (g.num_experts, g.moe_router_topk, g.moe_ffn_hidden_size, g.ffn_hidden_size) == (16, 4, 8, 72)
    assert g.moe_layer_freq == [0, 0, 0, 1, 1] and g.moe_shared_expert_intermediate_size == 8
    assert (g.moe_router_score_function, g.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (g.moe_router_num_groups, g.moe_router_group_topk, g.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert (g.yarn_rotary_scaling_factor, g.yarn_original_max_position_embeddings, g.yarn_mscale_all_dim) == (
        40.0,
        16,
        1.0,
    )
    assert not g.add_bias_linear and not g.tie_embeddings and g.swiglu and g.normalization == "RMSNorm"
    written = llama_config(g)
    assert written["architectures"] == ["DeepseekV3ForCausalLM"] and written["first_k_dense_replace"] == 3
    assert (written["n_group"], written["topk_group"], written["n_shared_experts"], written["head_dim"]) == (4, 2, 1, 4)
    assert (written["rope_interleave"], written["num_nextn_predict_layers"], written["qk_head_dim"]) == (True, 0, 12)
    assert config_from_hf(written) == g


def test_one_group_unit_scaling_and_two_shared_experts():
    from model.hf import config_from_hf, llama_config

    g = config_from_hf(
        _released_config(n_group=1, topk_group=1, routed_scaling_factor=1.0, n_shared_experts=2, q_lora_rank=None)
    )
    assert (g.moe_router_num_groups, g.moe_router_group_topk, g.moe_router_topk_scaling_factor) == (None, None, None)
    assert (g.moe_shared_expert_intermediate_size, g.q_lora_rank) == (16, None)
    written = llama_config(g)
    assert (written["n_group"], written["topk_group"], written["routed_scaling_factor"]) == (1, 1, 1.0)
    assert (written["n_shared_experts"], written["q_lora_rank"]) == (2, None)
    dense = config_from_hf(_released_config(first_k_dense_replace=0, num_experts_per_tok=1, norm_topk_prob=False))
    assert (dense.moe_layer_freq, dense.moe_router_topk) == (1, 1)
    assert llama_config(dense)["norm_topk_prob"] is False


def test_absent_keys_take_transformers_defaults():
    """A config.json holding only the sizes: the rest is what DeepseekV3Config() computes."""
    require("transformers")
    import transformers

    from model.hf import config_from_hf

    sizes = dict(vocab_size=50, hidden_size=32, num_attention_heads=4, num_hidden_layers=4, model_type="deepseek_v3")
    g = config_from_hf(sizes)
    d = transformers.DeepseekV3Config(**sizes)
    assert (g.q_lora_rank, g.kv_lora_rank, g.qk_head_dim, g.qk_pos_emb_head_dim, g.v_head_dim) == (
        d.q_lora_rank,
        d.kv_lora_rank,
        d.qk_nope_head_dim,
        d.qk_rope_head_dim,
        d.v_head_dim,
    )
    assert (g.num_experts, g.moe_router_topk, g.moe_router_num_groups, g.moe_router_group_topk) == (
        d.n_routed_experts,
        d.num_experts_per_tok,
        d.n_group,
        d.topk_group,
    )
    assert g.moe_layer_freq == [0] * d.first_k_dense_replace + [1] * (4 - d.first_k_dense_replace)
    assert (g.moe_router_topk_scaling_factor, g.ffn_hidden_size, g.moe_ffn_hidden_size) == (
        d.routed_scaling_factor,
        d.intermediate_size,
        d.moe_intermediate_size,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(attention_bias=True), "attention_bias true"),
        (dict(num_key_value_heads=2), "num_key_value_heads 2 != num_attention_heads 4"),
        (dict(norm_topk_prob=False), "norm_topk_prob False with num_experts_per_tok 4"),
        (dict(num_experts_per_tok=1), "norm_topk_prob True with num_experts_per_tok 1"),
        (dict(rope_interleave=False), "rope_interleave false"),
        (dict(rms_norm_eps=1e-5), "rms_norm_eps 1e-05"),
        (dict(n_shared_experts=0), "n_shared_experts 0"),
        (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
        (dict(topk_method="greedy"), "topk_method 'greedy'"),
        (dict(moe_layer_freq=2), "moe_layer_freq 2"),
        (dict(n_group=3), "n_group 3 with 16 experts"),
        (dict(num_experts_per_tok=17), "num_experts_per_tok 17 exceeds the 16 experts"),
        (dict(quantization_config={"quant_method": "fp8"}), "config.json key 'quantization_config' is unknown"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
    ],
)
def test_a_value_megazero_computes_otherwise_is_refused_naming_the_key(change, message):
    from model.hf import config_from_hf

    with pytest.raises(HFConversionError) as e:
        config_from_hf(_released_config(**change))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False), "score-function softmax"),
        (dict(moe_layer_freq=[1, 0, 1, 1, 1]), "--moe-layer-freq [1, 0, 1, 1, 1]"),
        (dict(moe_layer_freq=2), "--moe-layer-freq 2"),
        (dict(moe_shared_expert_intermediate_size=None), "--moe-shared-expert-intermediate-size None"),
        (dict(moe_shared_expert_intermediate_size=12), "--moe-shared-expert-intermediate-size 12"),
        (dict(moe_router_linear_bias=True), "--moe-router-linear-bias"),
        (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
        (dict(layernorm_epsilon=1e-5), "--layernorm-epsilon 1e-05"),
        (dict(num_experts=None), "--multi-latent-attention without --num-experts"),
        (dict(moe_router_num_groups=16, moe_router_group_topk=4), "--moe-router-num-groups 16"),
    ],
)
def test_an_export_deepseek_v3_cannot_express_is_refused_naming_the_flag(change, message):
    import dataclasses

    from model.hf import config_from_hf, llama_config

    g = dataclasses.replace(config_from_hf(_released_config()), **change)
    with pytest.raises(HFConversionError) as e:
        llama_config(g)
    assert message in str(e.value) and "no exact DeepseekV3ForCausalLM equivalent" in str(e.value)


def test_rope_rows_to_interleaved_undoes_the_import_reorder():
    from model.hf_deepseek import rope_rows_to_interleaved
    from model.mla import rope_rows_from_interleaved

    w = torch.arange(3 * 10 * 2, dtype=torch.float32).view(30, 2)  # 3 heads of [nope (4); rope (6)] rows
    ours = rope_rows_from_interleaved(w, 3, 6)
    assert ours[4:10, 0].tolist() == [8.0, 12.0, 16.0, 10.0, 14.0, 18.0]  # rows 0, 2, 4 then 1, 3, 5 of the rope
    assert torch.equal(rope_rows_to_interleaved(ours, 3, 6), w)
    assert torch.equal(ours[:4], w[:4])  # nope rows stay


def test_multi_token_prediction_tensors_past_the_last_layer_are_ignored(tmp_path):
    """A folder with a ``model.layers.{L}.*`` MTP block (as DeepSeek's releases) reads as without it."""
    require("transformers")
    require("safetensors")
    import transformers
    from safetensors.torch import load_file, save_file

    from model.hf_folder import folder_config, open_folder

    config = transformers.DeepseekV3Config(
        **{k: v for k, v in _released_config().items() if k in ("vocab_size", "hidden_size", "intermediate_size")},
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=8,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    mtp = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    save_file({**tensors, **mtp, "model.layers.2.eh_proj.weight": torch.ones(32, 64)}, tmp_path / "model.safetensors")
    g = folder_config(str(tmp_path))
    view = open_folder(str(tmp_path), g, g.padded_vocab(1))
    assert g.num_layers == 2 and not any(name.startswith("layers.2.") for name in view)
    assert torch.equal(view["layers.1.mlp.router.weight"], tensors["model.layers.1.mlp.gate.weight"])
    assert torch.equal(view.expert_bias(1), tensors["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert view.expert_bias(0) is None  # the dense layer has no router


@pytest.mark.parametrize(
    "change, flag",
    [
        (dict(q_lora_rank=8), "--q-lora-rank"),
        (dict(qk_pos_emb_head_dim=8), "--qk-pos-emb-head-dim"),
        (dict(moe_layer_freq=1), "--moe-layer-freq"),
        (dict(moe_router_num_groups=2, moe_router_group_topk=1), "--moe-router-num-groups"),
        (dict(moe_router_topk_scaling_factor=None), "--moe-router-topk-scaling-factor"),
        (dict(moe_router_enable_expert_bias=False), "--moe-router-enable-expert-bias"),
    ],
)
def test_a_run_whose_flags_differ_from_the_folder_is_told_the_flag(change, flag):
    """``--from-hf`` with the folder's printed flags but one (``model.hf.check_matches``)."""
    import dataclasses

    from model.hf import check_matches, config_from_hf

    config = _released_config()
    ours = dataclasses.replace(config_from_hf(config), **change)
    with pytest.raises(HFConversionError, match=f"fix: set {flag} to match"):
        check_matches(config, ours)
    check_matches(config, config_from_hf(config))  # the folder's own model passes


def test_print_flags_of_a_refused_folder_is_one_line_and_exit_2(tmp_path, capsys):
    import json

    from scripts.convert_checkpoint import main

    (tmp_path / "config.json").write_text(json.dumps(_released_config(rope_interleave=False)))
    assert main(["--print-flags", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convert_checkpoint: error: ") and "rope_interleave false" in err
