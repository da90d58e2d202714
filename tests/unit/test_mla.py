"""Multi-head latent attention (model/mla.py) against transformers' DeepseekV3Attention, its rope
row permutation, and the configurations it refuses."""

from __future__ import annotations

import pytest
import torch

from megazero.config.schema import ConfigError
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel.random import RNGTracker
from model.config import GPTConfig
from model.mla import MultiLatentAttention, latent_cache_bytes, mla_softmax_scale, rope_rows_from_interleaved
from tests.support.config import fails

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402

H, HEADS, NOPE, ROPE, V, KV_LORA, T = 32, 4, 8, 4, 6, 12, 10
YARN = dict(factor=4.0, original=16, mscale=0.8, mscale_all_dim=1.0)


def _configs(q_lora, yarn: bool):
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    extra = {}
    if yarn:
        rope_parameters = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": YARN["factor"],
            "original_max_position_embeddings": YARN["original"],
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": YARN["mscale"],
            "mscale_all_dim": YARN["mscale_all_dim"],
        }
        extra = dict(
            yarn_rotary_scaling_factor=YARN["factor"],
            yarn_original_max_position_embeddings=YARN["original"],
            yarn_mscale=YARN["mscale"],
            yarn_mscale_all_dim=YARN["mscale_all_dim"],
        )
    hf = ds.DeepseekV3Config(
        vocab_size=64,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        max_position_embeddings=64,
        rope_interleave=True,
        rope_parameters=rope_parameters,
        attention_bias=False,
        attention_dropout=0.0,
        num_hidden_layers=1,
    )
    hf._attn_implementation = "eager"
    ours = GPTConfig(
        vocab_size=64,
        num_layers=1,
        hidden_size=H,
        num_attention_heads=HEADS,
        seq_length=T,
        max_position_embeddings=64,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        layernorm_epsilon=1e-6,  # transformers' q_a / kv_a norms use their default 1e-6
        position_embedding_type="rope",
        normalization="RMSNorm",
        add_bias_linear=False,
        multi_latent_attention=True,
        q_lora_rank=q_lora,
        kv_lora_rank=KV_LORA,
        qk_head_dim=NOPE,
        qk_pos_emb_head_dim=ROPE,
        v_head_dim=V,
        **extra,
    )
    return hf, ours


@torch.no_grad()
def _copy_weights(theirs, ours: MultiLatentAttention, q_lora) -> None:
    """transformers' interleaved rope rows -> megazero's rotate-half rows (rope_rows_from_interleaved)."""
    if q_lora is None:
        ours.q.weight.copy_(rope_rows_from_interleaved(theirs.q_proj.weight, HEADS, ROPE))
    else:
        ours.q_a.weight.copy_(theirs.q_a_proj.weight)
        ours.q_a_norm.weight.copy_(theirs.q_a_layernorm.weight)
        ours.q_b.weight.copy_(rope_rows_from_interleaved(theirs.q_b_proj.weight, HEADS, ROPE))
    ours.kv_a.weight.copy_(rope_rows_from_interleaved(theirs.kv_a_proj_with_mqa.weight, 1, ROPE))
    ours.kv_a_norm.weight.copy_(theirs.kv_a_layernorm.weight)
    ours.kv_b.weight.copy_(theirs.kv_b_proj.weight)
    ours.proj.weight.copy_(theirs.o_proj.weight)


@pytest.mark.parametrize("q_lora", [16, None])
@pytest.mark.parametrize("yarn", [False, True])
def test_mla_equals_deepseek_v3_attention(q_lora, yarn):
    torch.manual_seed(0)
    hf_cfg, cfg = _configs(q_lora, yarn)
    theirs = ds.DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    for p in theirs.parameters():  # norms too: not ones, so a missed norm weight shows
        p.data.normal_(0, 0.3)
    groups = ProcessGroups.single()
    ours = MultiLatentAttention(cfg, groups.tp, False, RNGTracker(0, 0, torch.device("cpu"))).eval()
    _copy_weights(theirs, ours, q_lora)
    x = torch.randn(2, T, H)
    rotary = ds.DeepseekV3RotaryEmbedding(hf_cfg)
    cos_sin = rotary(x, torch.arange(T).unsqueeze(0))
    causal = torch.full((T, T), float("-inf")).triu(1).view(1, 1, T, T)
    want, _ = theirs(x, cos_sin, causal)
    got = ours(x)
    assert got.shape == (2, T, H)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if yarn:  # mscale_all_dim's square enters the scale; cos/sin carry mscale / mscale_all_dim
        assert ours.softmax_scale == pytest.approx(
            (NOPE + ROPE) ** -0.5 * (0.1 * 1.0 * torch.tensor(4.0).log() + 1) ** 2
        )
        assert ours.softmax_scale == pytest.approx(theirs.scaling)


def test_rope_rows_from_interleaved_orders_evens_then_odds():
    w = torch.arange(2 * 6, dtype=torch.float32).view(12, 1)  # 2 blocks of [nope (2); rope (4)]
    got = rope_rows_from_interleaved(w, 2, 4).view(-1).tolist()
    assert got == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]
    with pytest.raises(ValueError, match="blocks"):
        rope_rows_from_interleaved(w, 5, 4)


def test_softmax_scale_without_yarn():
    _, cfg = _configs(16, False)
    assert mla_softmax_scale(cfg) == pytest.approx(12**-0.5)


@pytest.mark.parametrize(
    "change, flag",
    [
        (dict(softmax_type="learnable"), "--softmax-type"),
        (dict(window_size=[4, 0]), "--window-size"),
        (dict(add_bias_linear=True), "linear biases"),
        (dict(position_embedding_type="learned_absolute"), "--position-embedding-type"),
        (dict(qk_layernorm=True), "--qk-layernorm"),
        (dict(num_query_groups=2), "--group-query-attention"),
    ],
)
def test_gptconfig_refuses(change, flag):
    _, cfg = _configs(16, False)
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ConfigError, match=f"--multi-latent-attention with {flag}.*fix"):
        cfg.validate(1)


CLI_MLA = ["--mock-data", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
CLI_MLA += ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear"]
CLI_MLA += ["--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4"]


def test_cli_builds_mla_config():
    from megazero.config import config_from_argv
    from model.build import build_gpt_config

    cfg = build_gpt_config(config_from_argv(CLI_MLA + ["--q-lora-rank", "16", "--v-head-dim", "6"], 1), 1001)
    assert (cfg.multi_latent_attention, cfg.q_lora_rank, cfg.kv_lora_rank) == (True, 16, 12)
    assert (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.rotary_dim) == (8, 4, 6, 4)
    for comm in ("p2p", "a2a"):  # context parallelism takes MLA (tests/layouts/test_mla.py trains it)
        run = config_from_argv(CLI_MLA + ["--cp", "2", "--cp-comm-type", comm], 2)
        assert (run.parallel.cp, run.parallel.cp_comm_type, run.model.multi_latent_attention) == (2, comm, True)


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (CLI_MLA + ["--softmax-type", "off-by-one"], 1, "with --softmax-type off-by-one is not supported"),
        (CLI_MLA + ["--window-size", "4,0"], 1, "with --window-size is not supported"),
        (CLI_MLA + ["--qk-pos-emb-head-dim", "3"], 1, "--qk-pos-emb-head-dim 3 is not supported; fix: an even"),
        (CLI_MLA[:-7] + ["--q-lora-rank", "16"], 1, "--q-lora-rank"),
    ],
)
def test_cli_refuses(argv, world, message, capsys):
    err = fails(argv, world, capsys)
    assert message in err
    assert "fix" in err


def _mla_stage():
    from model.gpt import GPTStage

    _, cfg = _configs(16, True)
    cfg.num_layers, cfg.tie_embeddings = 2, False
    return GPTStage(cfg, ProcessGroups.single(), range(2), True, True, seed=3).eval()


@torch.no_grad()
def test_kv_cache_decoders_equal_the_full_forward():
    """model/sampling.py's cache (prompt, then two tokens) gives the full forward's last logits;
    model/rollout.py's ``attend`` (6 slots, then 4 over the cache) gives the layer's full output,
    its cache the latent ``[B, 1, T, kv_lora]`` and the shared RoPE key ``[B, 1, T, r]``."""
    from model.rollout import attend
    from model.sampling import forward_cached

    stage = _mla_stage()
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    full = stage(ids)  # (B, T, V_pad)
    caches = [None, None]
    forward_cached(stage, ids[:, :8], caches)
    got = forward_cached(stage, ids[:, 8:], caches)  # (B, V)
    torch.testing.assert_close(got, full[:, -1, :64], rtol=0, atol=1e-5)
    attn = stage.layers["0"].attn
    x = torch.randn(2, T, H)
    want = attn(x)
    causal = torch.ones(T, T, dtype=torch.bool).tril().view(1, 1, T, T)
    positions = torch.arange(T).expand(2, T)
    first, cache = attend(attn, x[:, :6], None, positions[:, :6], causal[..., :6, :6])
    second, cache = attend(attn, x[:, 6:], cache, positions[:, 6:], causal[..., 6:, :])
    assert cache[0].shape == (2, 1, T, KV_LORA) and cache[1].shape == (2, 1, T, ROPE)
    torch.testing.assert_close(torch.cat([first, second], dim=1), want, rtol=0, atol=1e-5)


@torch.no_grad()
def test_latent_cache_greedy_decoding_equals_the_full_forward():
    """Greedy decoding with the latent cache (model/sampling.py): at each of 6 steps the cached
    logits equal the full forward's over the tokens so far within 1e-5 and their argmax is the
    same token, ``sample`` returns those tokens, and each layer's cache holds ``(kv_lora_rank +
    qk_pos_emb_head_dim) x 4`` bytes a token (fp32, ``latent_cache_bytes``), against ``heads x (n
    + r + v) x 4`` for the expanded keys and values."""
    from model.sampling import forward_cached, sample

    stage = _mla_stage()
    prompt = [5, 17, 3, 40, 9]
    ids, caches, new = list(prompt), [None, None], torch.tensor([prompt])
    for _ in range(6):
        got = forward_cached(stage, new, caches)  # (1, V)
        full = stage(torch.tensor([ids]))[:, -1, :64]  # (1, V)
        torch.testing.assert_close(got, full, rtol=0, atol=1e-5)
        assert int(got.argmax()) == int(full.argmax())
        ids.append(int(got.argmax()))
        new = torch.tensor([[ids[-1]]])
    assert sample(stage, prompt, 6, temperature=0.0) == ids
    per_token = (KV_LORA + ROPE) * 4
    assert latent_cache_bytes(stage.cfg, torch.float32) == per_token < HEADS * (NOPE + ROPE + V) * 4
    for cache in caches:  # prompt + 5 tokens seen, one row
        assert cache.seen == len(ids) - 1 == cache.k.shape[2]
        assert (cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()) == (
            per_token * cache.seen
        )


def test_hugging_face_export_refuses_mla_without_experts():
    """MLA exports as DeepSeek-V3 (model/hf_deepseek.py), whose layers past the first k are MoE."""
    from dataclasses import replace

    from model.hf import HFConversionError, hf_config

    _, cfg = _configs(16, False)
    with pytest.raises(HFConversionError, match="--multi-latent-attention without --num-experts"):
        hf_config(replace(cfg, swiglu=True))


def test_flops_count_mla_matmuls_and_attention():
    """Per token forward: 2 x every MLA weight, plus QK^T over heads (n + r) and PV over heads v."""
    from megazero.planning.flops import spec_flops_per_iteration
    from model.spec import build_spec

    _, cfg = _configs(16, False)
    B, s = 2, T
    spec = build_spec(cfg, 128)
    flops = spec_flops_per_iteration(spec, seq_length=s, attention_width=cfg.attention_flops_width, global_batch_size=B)
    attn = 16 * H + HEADS * 12 * 16 + (KV_LORA + ROPE) * H + HEADS * (NOPE + V) * KV_LORA + H * HEADS * V
    mlp = 3 * H * cfg.ffn_hidden_size if cfg.swiglu else 2 * H * cfg.ffn_hidden_size
    layer = 2 * (attn + mlp) + 2 * s * HEADS * (NOPE + ROPE) + 2 * s * HEADS * V
    assert flops == B * s * (3 * layer + 3 * 2 * H * 128)


@torch.no_grad()
def test_packed_documents_attend_inside_each_document():
    """Two packed documents (positions restarting at the second): each token's output equals that
    document's own forward, alone."""
    from megazero.context_parallel.sequence import SequenceInfo

    attn = _mla_stage().layers["1"].attn
    x = torch.randn(2, T, H)
    split = 4
    segments = torch.tensor([0] * split + [1] * (T - split)).expand(2, T)
    positions = torch.cat([torch.arange(split), torch.arange(T - split)]).expand(2, T)
    got = attn(x, SequenceInfo(None, positions, segments))
    want = torch.cat([attn(x[:, :split]), attn(x[:, split:])], dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
