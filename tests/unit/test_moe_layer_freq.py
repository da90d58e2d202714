"""``--moe-layer-freq`` in Megatron-LM's two forms: an integer N (every N-th layer from layer 0) and a
per-layer 0/1 pattern (comma list or ``([0]*1+[1]*3)``), DeepSeek-V3's ``first_k_dense_replace``;
dense layers keep ``--ffn-hidden-size``, MoE layers ``--moe-ffn-hidden-size``."""

import pytest

from megazero.config import config_from_argv
from megazero.config.schema import parse_moe_layer_freq
from model.build import build_gpt_config
from model.config import GPTConfig
from tests.support.config import fails

MOE = ["--num-layers", "4", "--num-experts", "4", "--moe-ffn-hidden-size", "24", "--ffn-hidden-size", "40"]
MOE += ["--mock-data", "--train-iters", "1", "--hidden-size", "32", "--num-attention-heads", "4"]


@pytest.mark.parametrize(
    "text, want",
    [
        ("1", 1),
        ("3", 3),
        ("0,1,1,1", [0, 1, 1, 1]),
        ("([0]*1+[1]*3)", [0, 1, 1, 1]),
        ("[1,0]*2", [1, 0, 1, 0]),
        ("([1]*3+[0]*1)*2", [1, 1, 1, 0, 1, 1, 1, 0]),
        ("[0] + [1]*3", [0, 1, 1, 1]),
    ],
)
def test_parse_reads_the_integer_the_comma_list_and_megatrons_pattern(text, want):
    assert parse_moe_layer_freq(text) == want


@pytest.mark.parametrize("text", ["(", "[2", "x", "[0]*", "([0]*1", "__import__('os')"])
def test_parse_refuses_other_text_naming_the_flag(text):
    with pytest.raises(ValueError, match=r"--moe-layer-freq .* fix: e\.g\. --moe-layer-freq 2"):
        parse_moe_layer_freq(text)


def test_first_k_dense_pattern_makes_the_first_layer_dense_with_its_own_width():
    cfg = config_from_argv(MOE + ["--moe-layer-freq", "([0]*1+[1]*3)"], 1)
    gcfg = build_gpt_config(cfg, 64)
    assert gcfg.moe_layer_freq == [0, 1, 1, 1]
    assert [gcfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    shapes = {e.name: e.shape for e in gcfg.parameter_spec(1)}
    assert shapes["layers.0.mlp.fc1.weight"] == (40, 32) and "layers.0.mlp.router.weight" not in shapes
    assert shapes["layers.1.mlp.experts.3.fc1.weight"] == (24, 32) and "layers.1.mlp.fc1.weight" not in shapes
    every_second = GPTConfig(64, 4, 32, 4, num_experts=4, moe_layer_freq=2)  # the integer form: layers 0, 2
    assert [every_second.is_moe_layer(i) for i in range(4)] == [True, False, True, False]


@pytest.mark.parametrize(
    "value, message",
    [
        ("0,1,1", "--moe-layer-freq lists 3 entries"),
        ("0,1,2,1", "--moe-layer-freq lists 4 entries"),
        ("0", "--moe-layer-freq 0 is not an integer >= 1"),
    ],
)
def test_a_pattern_of_the_wrong_length_or_values_is_one_line_naming_the_flag(value, message, capsys):
    err = fails(MOE + ["--moe-layer-freq", value], 1, capsys)
    assert message in err and "fix:" in err
