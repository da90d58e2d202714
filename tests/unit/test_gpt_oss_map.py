"""gpt-oss's map (model/hf_gpt_oss.py) at tiny sizes, in one process: a released-style folder whose
experts are MXFP4 ``*_blocks`` / ``*_scales`` (``quantization_config`` mxfp4) gives the logits of
transformers' GptOssForCausalLM holding the same weights dequantized (within 1e-5); its stacked
tensors map to megazero's experts and back bit for bit; a computation-changing key, a missing
scale tensor or a block of the wrong shape stops the import in one line naming it; and the
export refuses, by flag, a model gpt-oss does not compute."""

import dataclasses
import json

import pytest
import torch

from tests.support.extras import require

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    sliding_window=4,
    swiglu_limit=1.5,
    initializer_range=0.2,
    rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=2.0, truncate=False, original_max_position_embeddings=32
    ),
)


def _random_mxfp4(shape, generator):
    """MXFP4 ``(blocks [E, R, C/32, 16], scales [E, R, C/32])`` of a ``[E, R, C]`` weight: random
    E2M1 codes (up to 6 in size) and block scales 2**-7 .. 2**-4 (scale bytes 120..123)."""
    E, R, C = shape
    blocks = torch.randint(0, 256, (E, R, C // 32, 16), generator=generator, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(120, 124, (E, R, C // 32), generator=generator, dtype=torch.int64).to(torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(MXFP4 folder, transformers model with the dequantized weights)."""
    require("transformers")
    require("safetensors")
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    from model.mxfp4 import dequantize_mxfp4

    d = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**SIZES)).eval()
    g = torch.Generator().manual_seed(1)
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out], rows stored [out, in]
                blocks, scales = _random_mxfp4((p.shape[0], p.shape[2], p.shape[1]), g)
                p.copy_(dequantize_mxfp4(blocks, scales, transpose=True))
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            else:
                tensors[name] = p.detach().clone()
    save_file(tensors, str(d / "model.safetensors"))
    config = json.loads(GptOssConfig(**SIZES).to_json_string())
    config.update(architectures=["GptOssForCausalLM"], quantization_config={"quant_method": "mxfp4"})
    (d / "config.json").write_text(json.dumps(config))
    return d, model


def _stage(folder):
    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_model
    from tests.support.generate import generate_args

    stage, _ = load_model(generate_args(str(folder)), ProcessGroups.single(), torch.device("cpu"), need_tokenizer=False)
    return stage


def test_mxfp4_folder_gives_the_dequantized_models_logits(quantized):
    folder, hf = quantized
    stage = _stage(folder)
    assert (stage.cfg.hf_model_type, stage.cfg.softmax_type, stage.cfg.quick_geglu) == ("gpt_oss", "learnable", True)
    assert (stage.cfg.activation_func_clamp_value, stage.cfg.window_size) == (1.5, [3, 0])
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = stage.eval()(ids)[..., :64], hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


def test_stacked_experts_map_to_megazero_and_back_bit_for_bit(quantized):
    from model.hf import canonical_shapes, to_hf_tensors
    from model.hf_gpt_oss import expert_tensors

    folder, hf = quantized
    stage = _stage(folder)
    full = {n: p.detach() for n, p in stage.named_parameters()}
    assert set(full) == set(canonical_shapes(stage.cfg, stage.padded_vocab))
    back = expert_tensors(full, stage.cfg)
    for name, p in hf.named_parameters():
        if ".mlp.experts." in name:
            assert torch.equal(back[name], p.detach()), name
    out = to_hf_tensors(
        {n: t[:64] if "word_embeddings" in n or n == "output.weight" else t for n, t in full.items()}, stage.cfg
    )
    assert sorted(out) == sorted(n for n, _ in hf.named_parameters())
    assert all(torch.equal(out[n], p.detach()) for n, p in hf.named_parameters())


def _copy(folder, dst, config=None, drop=(), change=None):
    """A copy of ``folder`` with ``config.json`` edited, tensors dropped or one tensor replaced."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if k not in drop}
    if change:
        tensors.update(change)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "case, edit, named",
    [
        ("unknown key", dict(config={"attn_logit_softcapping": 30.0}), "'attn_logit_softcapping'"),
        ("alpha", dict(config={"swiglu_alpha": 1.0}), "swiglu_alpha 1.0"),
        ("no attention bias", dict(config={"attention_bias": False}), "attention_bias false"),
        ("quantization", dict(config={"quantization_config": {"quant_method": "fp8"}}), "quantization_config"),
        ("layer type", dict(config={"layer_types": ["chunked_attention", "full_attention"]}), "'chunked_attention'"),
        (
            "missing scales",
            dict(drop=("model.layers.1.mlp.experts.down_proj_scales",)),
            "'model.layers.1.mlp.experts.down_proj'",
        ),
        (
            "block shape",
            dict(
                change={"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(4, 64, 2, 8, dtype=torch.uint8)}
            ),
            "gate_up_proj_blocks",
        ),
    ],
)
def test_a_bad_folder_stops_naming_the_key_or_tensor(quantized, tmp_path, case, edit, named):
    from model.hf_config import HFConversionError

    folder, _ = quantized
    bad = _copy(folder, tmp_path / "bad", **edit)
    with pytest.raises(HFConversionError) as e:
        _stage(bad)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, flag",
    [
        (dict(activation_func_clamp_value=None), "--activation-func-clamp-value"),
        (dict(glu_linear_offset=0.0), "--glu-linear-offset"),
        (dict(add_bias_linear=False), "--disable-bias-linear"),
        (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
        (dict(moe_router_num_groups=2, moe_router_group_topk=1), "--moe-router-num-groups"),
        (dict(moe_router_topk_scaling_factor=2.5), "--moe-router-topk-scaling-factor"),
        (dict(window_size=[3, 0], window_attn_skip_freq=None, num_layers=2), None),  # every layer windowed: fine
    ],
)
def test_the_export_refuses_what_gpt_oss_does_not_compute(quantized, change, flag):
    from model.hf import hf_config
    from model.hf_config import HFConversionError

    folder, _ = quantized
    cfg = dataclasses.replace(_stage(folder).cfg, **change)
    if flag is None:
        written = hf_config(cfg)
        assert written["layer_types"] == ["sliding_attention"] * 2 and written["sliding_window"] == 4
        return
    with pytest.raises(HFConversionError, match=flag):
        hf_config(cfg)
