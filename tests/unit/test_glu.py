"""gpt-oss's MLP pieces against transformers' own: the gated unit (``megazero.ops.activation.glu``
with --quick-geglu, --glu-linear-offset, --activation-func-clamp-value) against
``GptOssExperts._apply_gate``, the router with its bias against ``GptOssTopKRouter``, the MXFP4
dequantization (``model.mxfp4``) against ``convert_moe_packed_tensors``; the flags' refusals and
the router bias's spec row."""

import math

import pytest
import torch
import torch.nn.functional as F

from megazero.moe import router as R
from megazero.ops.activation import glu, quick_gelu
from model.mxfp4 import dequantize_mxfp4


def _gpt_oss():
    """transformers' gpt-oss modules and a tiny config (skips where transformers lacks them)."""
    try:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss import modeling_gpt_oss as M
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"transformers' gpt-oss is not importable: {e}")
    cfg = GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=6, num_experts_per_tok=2)
    return M, cfg


def test_gated_unit_equals_gpt_oss_apply_gate_on_the_deinterleaved_halves():
    """gpt-oss's gate (clamp 7, quick GELU 1.702, offset 1) to the last bit in fp32, on values of
    std 6 (so about a quarter of the gates and up values are clamped)."""
    M, cfg = _gpt_oss()
    experts = M.GptOssExperts(cfg)
    gate_up = torch.randn(5, 3, 2 * cfg.intermediate_size, generator=torch.Generator().manual_seed(0)) * 6
    want = experts._apply_gate(gate_up)  # gate_up interleaved: gate at even, up at odd columns
    ours = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1)  # megazero's [gate; up]
    got = glu(ours, quick_geglu=True, linear_offset=1.0, clamp_value=cfg.swiglu_limit)
    assert (experts.alpha, experts.limit) == (1.702, 7.0)
    assert (gate_up.abs() > 7).float().mean() > 0.2  # the clamp bites
    assert torch.equal(got, want)


def test_gated_unit_by_hand_and_off_is_swiglu_bit_for_bit():
    h = torch.tensor([[8.0, -0.5, -9.0, 2.0]])  # gate (8, -0.5), up (-9, 2)
    got = glu(h, quick_geglu=True, linear_offset=1.0, clamp_value=7.0)
    want = [7 * (1 / (1 + math.exp(-1.702 * 7))) * (-7 + 1), -0.5 / (1 + math.exp(0.851)) * (2 + 1)]
    assert torch.allclose(got, torch.tensor([want]), rtol=1e-6, atol=0)
    assert torch.equal(quick_gelu(torch.tensor([0.0, 1.0])), torch.tensor([0.0, 1 / (1 + math.exp(-1.702))]))
    x = torch.randn(4, 10)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(glu(x), F.silu(gate) * up)  # the options off: today's SwiGLU
    with pytest.raises(ValueError, match="--activation-func-clamp-value 0"):
        glu(x, clamp_value=0)


def test_router_with_bias_equals_gpt_oss_topk_router():
    """megazero's default softmax router (top-k of the logits, softmax over the k) on the biased
    fp32 logits chooses gpt-oss's experts in its order with its weights."""
    M, cfg = _gpt_oss()
    g = torch.Generator().manual_seed(1)
    router = M.GptOssTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.bias.copy_(torch.randn(router.bias.shape, generator=g) * 3)  # large enough to change choices
    x = torch.randn(40, cfg.hidden_size, generator=g)
    logits, scores, indices = router(x)
    got_logits = R.router_logits(x, router.weight, "fp32", router.bias)
    routing = R.route(got_logits, cfg.num_experts_per_tok)
    unbiased = R.route(R.router_logits(x, router.weight), cfg.num_experts_per_tok)
    assert torch.equal(got_logits, logits)
    assert torch.equal(routing.experts, indices)
    assert torch.allclose(routing.probs, scores, rtol=1e-6, atol=0)
    assert not torch.equal(unbiased.experts, indices)  # the bias matters


def _transformers_dequantize():
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"transformers' MXFP4 conversion is not importable: {e}")
    return convert_moe_packed_tensors


def test_mxfp4_equals_transformers_on_random_bytes():
    convert = _transformers_dequantize()
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), dtype=torch.uint8, generator=g)  # E=3, R=10 rows, 64 values each
    scales = torch.randint(0, 255, (3, 10, 2), dtype=torch.uint8, generator=g)  # every E8M0 code but NaN's
    want = convert(blocks, scales, dtype=torch.float32)
    got = dequantize_mxfp4(blocks, scales, transpose=True)
    assert want.shape == got.shape == (3, 64, 10) and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(dequantize_mxfp4(blocks, scales), want.transpose(1, 2))  # rows as stored: [out, in]


def test_mxfp4_by_hand_from_the_e2m1_table():
    # byte 0x71: low nibble 1 (0.5) first, high 7 (6.0); 0xF8: 8 (-0.0), 15 (-6.0); 0x2B: 11 (-1.5), 2 (1.0)
    blocks = torch.tensor([[[0x71, 0xF8], [0x2B, 0x00]], [[0x71, 0x00], [0x00, 0x00]]], dtype=torch.uint8)
    scales = torch.tensor([[127, 130], [1, 255]], dtype=torch.uint8)  # 2**0, 2**3; 2**-126, NaN
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (2, 8)
    assert got[0].tolist() == [0.5, 6.0, -0.0, -6.0, -1.5 * 8, 1.0 * 8, 0.0, 0.0]
    assert got[1, :4].tolist() == [0.5 * 2.0**-126, 6.0 * 2.0**-126, 0.0, 0.0] and got[1, 4:].isnan().all()
    with pytest.raises(ValueError, match="without its last dim"):
        dequantize_mxfp4(blocks, scales[:, :1])


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--swiglu", "--quick-geglu"], "--quick-geglu"),
        (["--glu-linear-offset", "1"], "--glu-linear-offset"),
        (["--activation-func-clamp-value", "7"], "--activation-func-clamp-value"),
        (["--quick-geglu", "--activation-func-clamp-value", "0"], "--activation-func-clamp-value"),
        (["--quick-geglu", "--openai-gelu"], "--openai-gelu"),
    ],
)
def test_bad_gated_unit_settings_exit_2_naming_the_flag(extra, named, capsys):
    from megazero.config import config_from_argv

    with pytest.raises(SystemExit) as exc:
        config_from_argv(["--mock-data", "--device", "cpu"] + extra, 1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megazero: config error: ") and err.count("\n") == 1 and named in err, err


def test_router_bias_is_a_replicated_zero_initialised_undecayed_row_with_its_flag():
    from megazero.config import config_from_argv
    from model.build import build_gpt_config
    from model.spec import InitialWeights, spec_by_name

    argv = ["--mock-data", "--device", "cpu", "--num-experts", "4", "--quick-geglu", "--glu-linear-offset", "1"]
    gcfg = build_gpt_config(config_from_argv(argv + ["--moe-router-linear-bias"], 1), 1024)
    spec = spec_by_name(gcfg, 1024)
    e = spec["layers.0.mlp.router.bias"]
    assert (e.shape, e.partition_dim, e.weight_decay) == ((4,), None, False)
    assert torch.equal(InitialWeights(gcfg, 7)["layers.0.mlp.router.bias"], torch.zeros(4))
    H = gcfg.hidden_size
    assert spec["layers.0.mlp.experts.0.fc1.weight"].shape == (2 * 4 * H, H)  # gated: [gate; up] of 4H, as Megatron
    bare = build_gpt_config(config_from_argv(argv, 1), 1024)  # linear biases alone add none
    assert "layers.0.mlp.router.bias" not in spec_by_name(bare, 1024)
    assert "layers.0.mlp.experts.0.fc1.bias" in spec_by_name(bare, 1024)
    alone = build_gpt_config(config_from_argv(argv + ["--disable-bias-linear", "--moe-router-linear-bias"], 1), 1024)
    assert "layers.0.mlp.router.bias" in spec_by_name(alone, 1024)


def test_dense_gpt_oss_mlp_equals_the_oracle_and_its_clamp_bites():
    """The dense MLP with gpt-oss's unit (biases on, clamp 0.1 at init std 0.02) in one process:
    logits and every gradient equal tests/support/reference.py's under canonical names; without
    the clamp the logits move by far more than that tolerance."""
    from megazero.process_groups import ProcessGroups
    from model.config import GPTConfig
    from model.gpt import VOCAB_TENSORS, GPTStage, init_full_weights
    from tests.support.reference import ReferenceGPT, block_options, random_batches

    def both(**unit):
        cfg = GPTConfig(
            vocab_size=101,
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            ffn_hidden_size=48,
            seq_length=16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            position_embedding_type="rope",
            normalization="RMSNorm",
            quick_geglu=True,
            glu_linear_offset=1.0,
            **unit,
        )
        stage = GPTStage(cfg, ProcessGroups.single(), range(2), True, True, 5)
        ref = ReferenceGPT.from_full_weights(init_full_weights(cfg, 5), 101, 4, **block_options(cfg))
        return cfg, stage, ref

    cfg, stage, ref = both(activation_func_clamp_value=0.1)
    tokens, labels = random_batches(101, 16, 1, 4, seed=3)[0]
    logits = stage(tokens)[..., :101]
    torch.testing.assert_close(logits, ref(tokens), rtol=0, atol=2e-6)
    (stage(tokens, labels).sum() / labels.numel()).backward()
    ref.loss(tokens, labels).backward()
    grads = dict(stage.named_parameters())
    assert grads.keys() == ref.canonical_parameters().keys()
    for name, p in ref.canonical_parameters().items():
        g = grads[name].grad[:101] if name in VOCAB_TENSORS else grads[name].grad
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    _, free, _ = both()
    assert (free(tokens)[..., :101] - logits).abs().max() > 1e-4
