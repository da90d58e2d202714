"""RoPE scaling (model/rope.py) and the config side of the Llama-3.x / Qwen2 map
(model/hf_families.py), in one process without ranks: Llama 3.1's frequency rule band by band
and against transformers' own ``llama3`` initialiser, YaRN's frequencies, attention factor and
cos/sin tables bit for bit transformers' ``yarn`` ones, linear scaling as divided positions,
scaling off bit-identical to the unscaled table, the megazero model with scaling and a
q/k/v-only bias equal to the oracle, every key of transformers' LlamaConfig / MistralConfig /
Qwen2Config / Qwen3Config / Qwen3MoeConfig classified, and what the import refuses, one line naming the key."""

import math
import re

import pytest
import torch

from model.config import GPTConfig
from model.rope import RopeScaling, RotaryTable, inv_frequencies, rotary_cos_sin, rotary_cos_sin_at
from tests.support.extras import require

# head_dim 8, base 10000: wavelengths 2 pi x (1, 10, 100, 1000) = 6.3, 63, 628, 6283 positions;
# with original context 64, low 1, high 8: pair 0 below 64/8 (kept), pair 1 between 8 and 64
# (interpolated), pairs 2 and 3 above 64 (slowed 4 times)
LLAMA3 = RopeScaling(llama3_factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0, original_max_positions=64)


def test_llama3_frequencies_follow_the_three_bands():
    plain = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    got = inv_frequencies(8, 10000.0, LLAMA3)
    s = (64 / (2 * math.pi / plain[1].item()) - 1.0) / (8.0 - 1.0)  # the mix of pair 1: 0.876
    assert 0 < s < 1
    assert got[0].item() == plain[0].item()
    assert got[1].item() == pytest.approx((1 - s) * plain[1].item() / 4 + s * plain[1].item(), rel=1e-6)
    assert got[2:].tolist() == pytest.approx((plain[2:] / 4).tolist(), rel=1e-7)


def test_llama3_frequencies_equal_transformers_initialiser():
    require("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0)
    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,  # head_dim 16: 8 pairs over the three bands
        max_position_embeddings=256,
        rope_parameters=dict(rope, original_max_position_embeddings=64),
    )
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = inv_frequencies(16, 10000.0, LLAMA3)
    assert attention_factor == 1.0  # cos and sin are not rescaled: nothing for megazero to add
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    assert not torch.allclose(ours, inv_frequencies(16, 10000.0), rtol=1e-3)  # the rewrite acts


# (options of transformers' yarn table, partial_rotary_factor): the ramp rounded outwards or not,
# DeepSeek's mscale ratio, other betas, a partial rotary dimension (DeepSeek-V3's rotates 64 of 192),
# an attention factor given outright
YARN_CASES = [
    (dict(factor=4.0), 1.0),
    (dict(factor=4.0, truncate=False), 1.0),
    (dict(factor=8.0, beta_fast=16, beta_slow=2, mscale=0.707, mscale_all_dim=0.707), 1.0),
    (dict(factor=4.0, mscale=1.0, mscale_all_dim=0.5, truncate=False), 0.5),
    (dict(factor=2.0, attention_factor=1.25), 0.5),
]


@pytest.mark.parametrize("options,partial", YARN_CASES)
def test_yarn_frequencies_factor_and_tables_equal_transformers(options, partial):
    require("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = dict(rope_type="yarn", rope_theta=10000.0, original_max_position_embeddings=64, **options)
    if partial != 1.0:
        rope["partial_rotary_factor"] = partial
    positions = int(64 * options["factor"])  # the extended context (transformers warns otherwise)
    hf = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=positions, rope_parameters=rope)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    rot = int(32 * partial)  # head_dim 32: 16 pairs (8 partial) over the ramp
    yarn = RopeScaling(
        yarn_factor=options["factor"],
        original_max_positions=64,
        beta_fast=options.get("beta_fast", 32.0),
        beta_slow=options.get("beta_slow", 1.0),
        mscale=options.get("mscale"),
        mscale_all_dim=options.get("mscale_all_dim"),
        attention_factor=options.get("attention_factor"),
        truncate=options.get("truncate", True),
    )
    ours = inv_frequencies(rot, 10000.0, yarn)
    assert torch.equal(ours, theirs) and yarn.cos_sin_factor == attention_factor
    plain = inv_frequencies(rot, 10000.0)
    assert ours[0] == plain[0] and ours[-1].item() == pytest.approx(plain[-1].item() / options["factor"], rel=1e-6)

    positions = torch.arange(200).reshape(2, 100)  # past the original 64
    cos_hf, sin_hf = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.bfloat16), positions)  # (B, T, rot) bf16
    cos, sin = rotary_cos_sin_at(positions, rot, 10000.0, torch.bfloat16, scaling=yarn)  # (B, 1, T, rot)
    assert torch.equal(cos[:, 0], cos_hf) and torch.equal(sin[:, 0], sin_hf)
    table = RotaryTable(200, rot, 10000.0, scaling=yarn)
    for dtype in (torch.float32, torch.bfloat16):
        want = rotary_cos_sin_at(positions, rot, 10000.0, dtype, scaling=yarn)
        assert all(torch.equal(a, b) for a, b in zip(table.at(positions, dtype), want))
        assert all(torch.equal(a, b[0, 0]) for a, b in zip(table.first(100, dtype), want))  # row 0: positions 0..99
    if "attention_factor" in options or "mscale" not in options:
        assert attention_factor > 1  # cos and sin are rescaled: a table without the factor would fail


def test_linear_scaling_is_positions_divided_by_the_factor():
    positions = torch.arange(0, 30, 3).reshape(2, 5)  # multiples of 3
    cos, sin = rotary_cos_sin_at(positions, 8, 1000.0, scaling=RopeScaling(linear_factor=3.0))
    want_cos, want_sin = rotary_cos_sin_at(positions // 3, 8, 1000.0)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-6)


def test_scaling_off_is_the_unscaled_table_bit_for_bit():
    cfg = GPTConfig(vocab_size=10, num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16)
    cfg.position_embedding_type, cfg.rotary_base = "rope", 1000
    assert RopeScaling.of(cfg) is None
    inv = 1000 ** (-torch.arange(0, 8, 2, dtype=torch.float32) / 8)  # the formula before scaling existed
    assert torch.equal(inv_frequencies(8, 1000), inv)
    cos, sin = rotary_cos_sin(16, 8, 1000)
    table = RotaryTable.for_model(cfg)
    angles = torch.outer(torch.arange(16, dtype=torch.float32), inv)
    assert torch.equal(cos, torch.cat([angles, angles], -1).cos()) and torch.equal(table.cos, cos)
    assert torch.equal(table.sin, sin)
    scaled = RotaryTable.for_model(GPTConfig(**{**vars(cfg), "rotary_seq_len_interpolation_factor": 2.0}))
    assert torch.equal(scaled.cos[2], cos[1])  # position 2 at factor 2 turns as position 1: 2 x (f/2) exactly


@pytest.mark.parametrize(
    "features",
    [
        dict(use_rope_scaling=True, rope_scaling_factor=4.0, rope_scaling_high_freq_factor=8.0,
             rope_scaling_original_max_position_embeddings=64),
        dict(rotary_seq_len_interpolation_factor=2.5),
        dict(yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16, yarn_beta_fast=8.0,
             yarn_mscale=1.0, yarn_mscale_all_dim=0.5, yarn_correction_range_round_to_int=False,
             rotary_percent=0.5),
        dict(add_qkv_bias=True),
    ],
)  # fmt: skip
def test_the_model_with_scaling_or_a_qkv_bias_equals_the_oracle(features):
    from model.gpt import init_full_weights
    from tests.support.hf_convert import logits_of, single_stage
    from tests.support.hf_llama import llama_gcfg
    from tests.support.reference import ReferenceGPT, block_options

    gcfg = llama_gcfg(rotary_base=10000, max_position_embeddings=64, init_method_std=0.3, **features)
    full = init_full_weights(gcfg, seed=5)
    if gcfg.add_qkv_bias:
        assert [n for n in full if "bias" in n] == ["layers.0.attn.qkv.bias", "layers.1.attn.qkv.bias"]
        full = {n: t + 0.5 if n.endswith("bias") else t for n, t in full.items()}  # a bias that matters
    ids = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(0))
    ours = logits_of(single_stage(gcfg, full), ids)
    kwargs = block_options(gcfg)
    oracle = ReferenceGPT.from_full_weights(full, 50, 4, eps=1e-6, **kwargs)
    with torch.no_grad():
        want = oracle(ids)
        plain = ReferenceGPT.from_full_weights(
            {n: t for n, t in full.items() if "bias" not in n}, 50, 4, eps=1e-6, **{**kwargs, "rope_scaling": None}
        )(ids)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert (ours - plain).abs().max() > 1e-2 * want.abs().max()  # the feature matters: the test can fail


@pytest.mark.parametrize(
    "family",
    [
        "LlamaConfig",
        "MistralConfig",
        "Qwen2Config",
        "Qwen3Config",
        "Qwen3MoeConfig",
        "GptOssConfig",
        "DeepseekV3Config",
    ],
)
def test_every_key_of_the_transformers_config_class_is_classified(family):
    require("transformers")
    import transformers

    from model import hf_deepseek, hf_gpt_oss
    from model.hf_families import KEYS

    types = {"LlamaConfig": "llama", "MistralConfig": "mistral", "Qwen2Config": "qwen2", "Qwen3Config": "qwen3"}
    types["Qwen3MoeConfig"] = "qwen3_moe"
    own = {"GptOssConfig": hf_gpt_oss.KEYS, "DeepseekV3Config": hf_deepseek.KEYS}
    table = own[family] if family in own else KEYS[types[family]]
    mapped, checked, no_effect = set(table["mapped"]), set(table["checked"]), set(table["no_effect"])
    assert not (mapped & checked) and not (mapped & no_effect) and not (checked & no_effect)
    keys = set(getattr(transformers, family)().to_dict())
    assert {"rope_parameters", "vocab_size", "tie_word_embeddings"} <= keys  # the class really was listed
    assert sorted(keys - mapped - checked - no_effect) == []
    assert all(len(reason) > 10 for reason in table["no_effect"].values())


def _llama31_config(**change):
    """A config.json shaped like Meta's Llama-3.1 one (transformers 4 keys), at tiny sizes."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "max_position_embeddings": 1024,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": True,
        "vocab_size": 50,
        **change,
    }


def test_a_llama31_config_reads_as_rope_scaling_and_writes_back():
    from model.hf import config_from_hf, llama_config

    gcfg = config_from_hf(_llama31_config(), hidden_dropout=0.0, attention_dropout=0.0)
    assert (gcfg.use_rope_scaling, gcfg.rope_scaling_factor, gcfg.rope_scaling_high_freq_factor) == (True, 8.0, 4.0)
    assert (gcfg.rope_scaling_original_max_position_embeddings, gcfg.rotary_base) == (64, 500000)
    assert not gcfg.add_bias_linear and not gcfg.add_qkv_bias and gcfg.rotary_seq_len_interpolation_factor is None
    written = llama_config(gcfg)
    assert (
        written["rope_parameters"]
        == written["rope_scaling"]
        == {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    )
    assert config_from_hf(written, hidden_dropout=0.0, attention_dropout=0.0) == gcfg


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(rope_scaling={"type": "yarn", "factor": 16.0, "finetuned": True}), "rope_parameters.finetuned"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}), "beta_fast = 0 is not"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope type 'dynamic'"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 32}), "rope_parameters.beta_fast"),
        (dict(quantization_config={"quant_method": "fp8"}), "config.json key 'quantization_config' is unknown"),
        (dict(attention_bias=True), "attention_bias != mlp_bias"),
        (dict(model_type="qwen2", use_sliding_window=False, layer_types=["full_attention", "sliding_attention"]),
         "layer_types[1] = 'sliding_attention' without a window"),
        (dict(model_type="qwen2", layer_types=["full_attention", "chunked_attention"]), "layer_types[1]"),
    ],
)  # fmt: skip
def test_import_refuses_what_megazero_computes_differently_in_one_line(change, message):
    from model.hf import HFConversionError, config_from_hf

    config = _llama31_config(**change)
    if config["model_type"] == "qwen2":
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
            config.pop(key)
    with pytest.raises(HFConversionError, match=re.escape(message)) as e:
        config_from_hf(config)
    assert "\n" not in str(e.value)


def test_a_transformers4_yarn_config_reads_with_transformers_defaults_and_writes_back():
    """Legacy ``rope_scaling`` with ``type`` yarn and only factor / original context (as Qwen's model
    cards give it): beta 32 / 1, truncate true, no mscale; exported as ``rope_parameters`` with those
    values written out, which reads back to the same GPTConfig."""
    from model.hf import config_from_hf, llama_config

    rope = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 256}
    gcfg = config_from_hf(_llama31_config(rope_scaling=rope), hidden_dropout=0.0, attention_dropout=0.0)
    assert (gcfg.yarn_rotary_scaling_factor, gcfg.yarn_original_max_position_embeddings) == (4.0, 256)
    assert (gcfg.yarn_beta_fast, gcfg.yarn_beta_slow, gcfg.yarn_correction_range_round_to_int) == (32.0, 1.0, True)
    assert (gcfg.yarn_mscale, gcfg.yarn_mscale_all_dim, gcfg.yarn_attention_factor, gcfg.use_rope_scaling) == (
        None, None, None, False
    )  # fmt: skip
    written = llama_config(gcfg)
    assert written["rope_parameters"] == written["rope_scaling"] == {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
    }  # fmt: skip
    assert config_from_hf(written, hidden_dropout=0.0, attention_dropout=0.0) == gcfg
    no_factor = config_from_hf(_llama31_config(rope_scaling={"rope_type": "yarn", "mscale_all_dim": 0}))
    assert (no_factor.yarn_rotary_scaling_factor, no_factor.yarn_mscale_all_dim) == (1.0, 0.0)  # 1024 / 1024


def test_a_qwen25_window_that_covers_every_position_is_full_attention():
    from model.hf import config_from_hf

    config = {k: v for k, v in _llama31_config().items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    config.update(model_type="qwen2", use_sliding_window=True, sliding_window=1024, max_window_layers=0)
    gcfg = config_from_hf(config)
    assert (gcfg.add_bias_linear, gcfg.add_qkv_bias, gcfg.qkv_bias) == (False, True, True)
    assert gcfg.window_size is None
    config.update(sliding_window=16, max_window_layers=1)  # layer 1 sees its last 16 positions
    gcfg = config_from_hf(config)
    assert (gcfg.window_size, gcfg.window_attn_skip_freq) == ([15, 0], [0, 1])


def test_export_refuses_both_scalings_and_a_qkv_bias_with_experts():
    from model.hf import HFConversionError, hf_config
    from tests.support.hf_llama import llama_gcfg

    with pytest.raises(HFConversionError, match="one rope type"):
        hf_config(llama_gcfg(use_rope_scaling=True, rotary_seq_len_interpolation_factor=2.0))
    with pytest.raises(HFConversionError, match="--use-rope-scaling with --yarn-rotary-scaling-factor: a Hugging"):
        hf_config(llama_gcfg(use_rope_scaling=True, yarn_rotary_scaling_factor=2.0))
    with pytest.raises(HFConversionError, match="--add-qkv-bias with --num-experts"):
        hf_config(llama_gcfg(add_qkv_bias=True, num_experts=2, moe_router_topk=1))


def test_flags_need_their_feature_and_sane_bands(capsys):
    from megazero.config import config_from_argv

    base = ["--mock-data", "--position-embedding-type", "rope"]
    cfg = config_from_argv(base + ["--use-rope-scaling", "--rope-scaling-factor", "32"], 1)
    assert (cfg.model.use_rope_scaling, cfg.model.rope_scaling_factor) == (True, 32.0)
    yarn = ["--yarn-rotary-scaling-factor", "40", "--yarn-mscale", "1", "--yarn-mscale-all-dim", "1"]
    m = config_from_argv(base + yarn + ["--no-yarn-correction-range-round-to-int"], 1).model
    assert (m.yarn_rotary_scaling_factor, m.yarn_mscale_all_dim, m.yarn_correction_range_round_to_int) == (40, 1, False)
    for argv, message in (
        (["--rope-scaling-factor", "32"], "--rope-scaling-factor"),
        (["--add-qkv-bias"], "--add-qkv-bias"),
        (["--use-rope-scaling", "--rope-scaling-low-freq-factor", "4"], "--rope-scaling-high-freq-factor 4.0 is not"),
        (["--yarn-beta-fast", "16"], "--yarn-beta-fast"),
        (["--yarn-rotary-scaling-factor", "0.5"], "--yarn-rotary-scaling-factor"),
        (["--yarn-rotary-scaling-factor", "4", "--use-rope-scaling"], "--yarn-rotary-scaling-factor with --use-rope"),
        (["--yarn-rotary-scaling-factor", "4", "--rotary-seq-len-interpolation-factor", "2"], "one RoPE scaling"),
        (["--yarn-rotary-scaling-factor", "4", "--yarn-beta-fast", "0.5"], "--yarn-beta-fast 0.5 is below"),
        (["--yarn-rotary-scaling-factor", "4", "--yarn-mscale", "0.7"], "--yarn-mscale 0.7 without --yarn-mscale-all"),
    ):
        with pytest.raises(SystemExit) as e:
            config_from_argv(base + argv, 1)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
