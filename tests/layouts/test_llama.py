"""The LLaMA-style block (RoPE, RMSNorm, SwiGLU, grouped-query attention, no linear biases,
untied output) and the parameter spec that declares every block's parameters once.

RoPE is checked against its closed form, grouped-query attention at G = 1 (multi-query),
G = heads (multi-head) and between against both the oracle and closed-form rewrites of the
weights; every bad combination of the flags exits with code 2 naming the setting; the
planner and the FLOP count read the spec. The block under the 11 trainer layouts is in
tests/layouts/test_train.py.
"""

import math
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megazero import tags
from megazero.planning import memory
from megazero.planning.flops import gpt_flops_per_iteration, spec_flops_per_iteration
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from model.config import GPTConfig, default_ffn_hidden_size
from model.gpt import VOCAB_TENSORS, GPTStage, init_full_weights
from model.rope import apply_rotary, rotary_cos_sin
from model.spec import build_spec
from tests.support.distributed import run_distributed
from tests.support.model import assert_rel_close, train_stage
from tests.support.paths import REPO
from tests.support.reference import ReferenceGPT, block_options, random_batches, rope_rotate

SEED = 1234
ADAM = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    num_query_groups=2,
    add_bias_linear=False,
    tie_embeddings=False,
)


def llama_cfg(**kw) -> GPTConfig:
    base = dict(
        vocab_size=101,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **LLAMA,
    )
    base.update(kw)
    return GPTConfig(**base)


def reference(cfg: GPTConfig, full=None) -> ReferenceGPT:
    full = init_full_weights(cfg, SEED) if full is None else full
    return ReferenceGPT.from_full_weights(full, cfg.vocab_size, cfg.num_attention_heads, **block_options(cfg))


def reference_losses(cfg: GPTConfig, batches, steps: int):
    from tests.support.reference import train_reference

    return train_reference(
        init_full_weights(cfg, SEED),
        batches,
        vocab_size=cfg.vocab_size,
        num_heads=cfg.num_attention_heads,
        steps=steps,
        block=block_options(cfg),
        **ADAM,
    )


# -- RoPE -----------------------------------------------------------------------------------


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rope_dot_product_depends_only_on_relative_position(percent):
    """q at position m and k at n, rotated: q_m . k_n equals the closed form
    sum_j Re[(q_j + i q_j') conj(k_j + i k_j') e^{i (m - n) theta_j}] + the unrotated part."""
    d, T, base = 16, 12, 10000.0
    rot = int(d * percent)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    cos, sin = rotary_cos_sin(T, rot, base, dtype=torch.float64)  # (T, rot)
    qs = apply_rotary(q.expand(1, 1, T, d), cos, sin)[0, 0]  # (T, d): q at every position
    ks = apply_rotary(k.expand(1, 1, T, d), cos, sin)[0, 0]
    dots = qs @ ks.T  # (T, T): [m, n]
    theta = base ** (-torch.arange(rot // 2, dtype=torch.float64) * 2 / rot)
    qc, kc = torch.complex(q[: rot // 2], q[rot // 2 : rot]), torch.complex(k[: rot // 2], k[rot // 2 : rot])
    for m in range(T):
        for n in range(T):
            closed = (qc * kc.conj() * torch.polar(torch.ones_like(theta), (m - n) * theta)).real.sum()
            closed += q[rot:] @ k[rot:]
            assert abs(dots[m, n] - closed) < 1e-6  # the angles are computed in fp32
    for shift in range(1, 4):  # same relative position, other absolute positions: same dot product
        torch.testing.assert_close(dots[shift:, shift:], dots[:-shift, :-shift], rtol=0, atol=1e-6)
    assert not torch.allclose(dots[0, 0], dots[5, 0])  # it does depend on m - n
    x = torch.randn(2, 3, T, d, generator=g, dtype=torch.float64)
    torch.testing.assert_close(apply_rotary(x, cos, sin), rope_rotate(x, rot, base), rtol=0, atol=1e-6)


# -- grouped-query attention ----------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_llama_block_matches_reference_for_every_group_count(groups):
    """G = 1 (multi-query), 2, 4 = heads (multi-head): logits and every gradient equal the
    oracle's under canonical names, and 5 AdamW steps give its losses."""
    cfg = llama_cfg(num_query_groups=groups)
    batches = random_batches(cfg.vocab_size, cfg.seq_length, 5, 4, seed=7)
    stage = GPTStage(cfg, ProcessGroups.single(), range(cfg.num_layers), True, True, SEED)
    ref = reference(cfg)
    tokens, labels = batches[0]
    torch.testing.assert_close(stage(tokens)[..., : cfg.vocab_size], ref(tokens), rtol=0, atol=2e-6)
    (stage(tokens, labels).sum() / labels.numel()).backward()
    ref.loss(tokens, labels).backward()
    grads = dict(stage.named_parameters())
    assert grads.keys() == ref.canonical_parameters().keys()
    for name, p in ref.canonical_parameters().items():
        g = grads[name].grad
        g = g[: cfg.vocab_size] if name in VOCAB_TENSORS else g
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    stage.zero_grad(set_to_none=True)
    assert_rel_close(train_stage(stage, batches, 5), reference_losses(cfg, batches, 5), 1e-5)


def _as_multi_head(full: dict, cfg: GPTConfig) -> dict:
    """The same model with the GPT-2 ``[q; k; v]`` QKV layout: each query head gets a copy
    of its group's key and value rows."""
    heads, G, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    n = heads // G
    out = dict(full)
    for i in range(cfg.num_layers):
        w = full[f"layers.{i}.attn.qkv.weight"].view(G, n + 2, d, -1)  # per group: n q heads, k, v
        q = w[:, :n].reshape(heads * d, -1)
        k = w[:, n].repeat_interleave(n, dim=0).reshape(heads * d, -1)
        v = w[:, n + 1].repeat_interleave(n, dim=0).reshape(heads * d, -1)
        out[f"layers.{i}.attn.qkv.weight"] = torch.cat([q, k, v])
    return out


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_query_equals_multi_head_with_shared_key_value_heads(groups):
    """Closed form of grouped-query attention: G groups equal multi-head attention whose key
    and value heads are copies of the group's; G = heads is multi-head attention itself."""
    cfg = llama_cfg(num_query_groups=groups)
    mha = llama_cfg(num_query_groups=None)
    full = init_full_weights(cfg, SEED)
    grouped = GPTStage(cfg, ProcessGroups.single(), range(2), True, True, SEED)
    plain = GPTStage(mha, ProcessGroups.single(), range(2), True, True, SEED, full_weights=_as_multi_head(full, cfg))
    tokens = random_batches(cfg.vocab_size, cfg.seq_length, 1, 3, seed=3)[0][0]
    torch.testing.assert_close(grouped(tokens), plain(tokens), rtol=0, atol=2e-6)
    qkv = dict(grouped.named_parameters())["layers.0.attn.qkv.weight"]
    assert qkv.shape == ((4 + 2 * groups) * 8, 32)


def _tp_groups(rank, world, cfgs, batches, steps):
    groups = ProcessGroups.build(Topology(tp=2))
    out = []
    for cfg in cfgs:
        stage = GPTStage(cfg, groups, range(cfg.num_layers), True, True, SEED)
        out.append(train_stage(stage, batches, steps))
    return out


def test_llama_block_tensor_parallel_with_groups_between_and_equal_heads():
    """tp 2 holds whole groups: G = 2 (one per rank), G = 4 = heads, and G = 2 with sequence
    parallelism give the single-process losses (one spawn, three models)."""
    cfgs = [
        llama_cfg(num_query_groups=2),
        llama_cfg(num_query_groups=4),
        llama_cfg(num_query_groups=2, sequence_parallel=True),
    ]
    batches = random_batches(101, 16, 5, 4, seed=9)
    out = run_distributed(_tp_groups, 2, cfgs, batches, 5)
    for r in range(2):
        for cfg, losses in zip(cfgs, out[r]):
            assert_rel_close(losses, reference_losses(cfg, batches, 5), 1e-5)


# -- bad combinations ---------------------------------------------------------------------

BASE = [
    "--mock-data",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
]
BAD = [  # (world, flags, words the message must hold)
    (1, ["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3 does not divide"),
    (
        2,
        ["--tp", "2", "--group-query-attention", "--num-query-groups", "1"],
        "--num-query-groups 1 is not divisible by --tp 2",
    ),
    (1, ["--num-query-groups", "2"], "--num-query-groups has no effect without --group-query-attention"),
    (1, ["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent 0.0 is outside (0, 1]"),
    (1, ["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "--rotary-percent 1.5 is outside"),
    (1, ["--position-embedding-type", "rope", "--rotary-percent", "0.125"], "--rotary-percent 0.125 rotates 1"),
    (1, ["--rotary-percent", "0.5"], "--rotary-percent has no effect without --position-embedding-type rope"),
    (1, ["--rotary-base", "500"], "--rotary-base has no effect without"),
    (1, ["--position-embedding-type", "rope", "--rotary-base", "0"], "--rotary-base 0 is out of range"),
    (
        2,
        ["--tp", "2", "--swiglu", "--ffn-hidden-size", "65"],
        "--ffn-hidden-size 65 is not divisible by --tp 2 (a gated MLP, --swiglu",
    ),
    (1, ["--swiglu", "--hidden-size", "16"], "--swiglu derives --ffn-hidden-size 0"),
    (1, ["--normalization", "BatchNorm"], "--normalization"),
    (1, ["--position-embedding-type", "alibi"], "--position-embedding-type"),
]


@pytest.mark.parametrize("world,flags,words", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_bad_combination_exits_2_naming_the_setting(world, flags, words, capsys):
    from megazero.config import config_from_argv

    with pytest.raises(SystemExit) as e:
        config_from_argv(BASE + flags, world)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megazero: config error:") and words in err, err


def test_model_config_refuses_the_same_combinations():
    for kw, words in (
        (dict(num_query_groups=3), "--num-query-groups 3 does not divide"),
        (dict(rotary_percent=0.0), "--rotary-percent 0.0 is outside"),
        (dict(ffn_hidden_size=65), "(a gated MLP, --swiglu"),
    ):
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            llama_cfg(**kw).validate(2 if "swiglu" in words else 1)
    with pytest.raises(ValueError, match="--num-query-groups 2 is not divisible by --tp 4"):
        llama_cfg().validate(4)


def test_train_py_exits_2_before_any_process_group():
    repo = REPO
    run = subprocess.run(
        [sys.executable, "train.py", *BASE, "--group-query-attention", "--num-query-groups", "3"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--num-query-groups 3 does not divide" in run.stderr


def test_swiglu_ffn_default_follows_megatron():
    assert default_ffn_hidden_size(4096, True) == 10880 and default_ffn_hidden_size(4096, False) == 16384
    from megazero.config import config_from_argv

    assert config_from_argv(BASE + ["--swiglu"], 1).model.ffn_hidden_size == 64
    assert config_from_argv(BASE, 1).model.ffn_hidden_size == 128


# -- the spec and its readers ---------------------------------------------------------------


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_spec_names_tags_and_planner_count_match_built_stages(block):
    """Every built parameter is a spec entry with its tags; the planner's count (from the
    spec) equals the built pipeline stages' for the GPT-2 and the LLaMA-style block."""
    cfg = (
        llama_cfg() if block == "llama" else llama_cfg(**{k: GPTConfig.__dataclass_fields__[k].default for k in LLAMA})
    )
    spec = {e.name: e for e in build_spec(cfg, cfg.padded_vocab(1))}
    topo = Topology(pp=2)
    stages = [
        GPTStage(cfg, ProcessGroups(topo, rank=0), [0], True, False, SEED),
        GPTStage(cfg, ProcessGroups(topo, rank=1), [1], False, True, SEED),
    ]
    names = set()
    for r, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            e = spec[name]
            names.add(name)
            assert p.partition_dim == (-1 if e.partition_dim is None else e.partition_dim)
            assert p.partition_stride == e.partition_stride and tags.decays(p) == e.weight_decay == (p.dim() >= 2)
        assert sum(p.numel() for p in stage.parameters()) == memory.params_per_rank(cfg, 1, 2, r)
    assert names == set(spec)
    assert ("embedding.position_embeddings.weight" in spec) == (block == "gpt2")
    assert ("layers.0.attn.qkv.bias" in spec) == ("final_ln.bias" in spec) == (block == "gpt2")


def _measured_flops(cfg: GPTConfig, batch: int) -> int:
    """FLOPs torch's FlopCounterMode sees in one forward+backward of the reference."""
    full = init_full_weights(cfg, SEED)
    model = ReferenceGPT.from_full_weights(full, cfg.padded_vocab(1), cfg.num_attention_heads, **block_options(cfg))
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length))
    with FlopCounterMode(display=False) as counter:
        model.loss(tokens, tokens).backward()
    return counter.get_total_flops()


def test_flops_read_from_the_spec():
    """GPT-2: the spec's count is Narayanan et al.'s formula; LLaMA-style (GQA's smaller QKV,
    SwiGLU's three matrices, untied output): the count torch's FlopCounterMode measures."""
    gpt2 = llama_cfg(**{k: GPTConfig.__dataclass_fields__[k].default for k in LLAMA})
    kw = dict(seq_length=16, attention_width=32, global_batch_size=3)
    assert spec_flops_per_iteration(build_spec(gpt2, 128), **kw) == gpt_flops_per_iteration(
        num_layers=2, hidden_size=32, ffn_hidden_size=128, seq_length=16, padded_vocab_size=128, global_batch_size=3
    )
    cfg = llama_cfg(vocab_size=128)
    h, f, d, G, s, l, V = 32, 64, 8, 2, 16, 2, 128
    hand = 3 * s * (3 * l * (2 * (h * (4 + 2 * G) * d + h * h + 3 * h * f) + 4 * s * h) + 6 * h * V)
    assert spec_flops_per_iteration(build_spec(cfg, V), **kw) == hand == _measured_flops(cfg, 3)
    assert math.isclose(
        spec_flops_per_iteration(build_spec(cfg, V), **kw, recompute=True),
        hand + 3 * s * l * (2 * (h * (4 + 2 * G) * d + h * h + 3 * h * f) + 4 * s * h),
    )
