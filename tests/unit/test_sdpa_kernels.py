"""The CUDA SDPA kernel oracle (megazero/context_parallel/sdpa_kernels.py) and the calls it shapes.

Hand cases check ``select_kernel`` against the rules of PyTorch's ``sdp_utils.cpp`` cited in the
module (flash: 16-bit, no mask tensor, head dim <= 256; efficient: fp32 too, masks, head dim
and offsets aligned to 4 (fp32) or 8 (16-bit) elements, no GQA in torch 2.13; cuDNN: first on
sm90 with cuDNN > 9.15.0, 16-bit, masks, GQA, head dim <= 128 and a multiple of 8, dropout
in 1/16). Then: no accepted configuration with a head dim that is a multiple of 8 lands on the
math kernel, docs/long-sequences.md holds ``attention_table()``, the planner counts what stays
on math, and on CPU the new forms of the call (an additive shared document mask, K/V expanded)
give today's results.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megazero.context_parallel.attention import document_mask, local_attention
from megazero.context_parallel.blockwise import block_mask
from megazero.context_parallel.sdpa_kernels import (
    SM80,
    SM90,
    CudaPlatform,
    SdpaCall,
    accepted_configs,
    attention_table,
    config_kernel,
    megazero_call,
    refusals,
    ring_block_kernel,
    select_kernel,
)
from megazero.context_parallel.sequence import Packing, shard_micro_batch
from megazero.planning.activations import (
    ActivationSettings,
    attention_kernel,
    document_mask_bytes,
    layer_bytes,
    math_core_bytes,
)
from megazero.process_groups import ProcessGroups
from model.gpt import GPTStage
from tests.support.zero import tiny_cfg

DOCS = Path(__file__).resolve().parents[2] / "docs" / "long-sequences.md"
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    "call, plat, kernel",
    [
        (SdpaCall(FP32, 8, 8, 64), SM90, "efficient"),  # flash and cuDNN: 16-bit only
        (SdpaCall(BF16, 8, 8, 128), SM90, "cudnn"),  # cuDNN first on sm90 with cuDNN 9.15.1
        (SdpaCall(BF16, 8, 8, 128), SM80, "flash"),  # default order: flash, efficient, math
        (SdpaCall(BF16, 8, 8, 128), replace(SM90, cudnn_version=91500), "flash"),  # needs > 9.15.0
        (SdpaCall(BF16, 8, 8, 64, mask="bool"), SM80, "efficient"),  # flash takes no mask tensor
        (SdpaCall(BF16, 8, 8, 64, mask="additive"), SM90, "cudnn"),
        (SdpaCall(FP32, 8, 2, 64, enable_gqa=True), SM90, "math"),  # efficient: no GQA in 2.13
        (SdpaCall(FP32, 8, 2, 64, enable_gqa=True), replace(SM90, efficient_gqa=True), "efficient"),
        (SdpaCall(BF16, 8, 2, 64, enable_gqa=True), SM80, "flash"),
        (SdpaCall(BF16, 8, 2, 64, enable_gqa=False), SM80, "math"),  # flash needs the flag
        (SdpaCall(BF16, 8, 2, 64, enable_gqa=False), SM90, "cudnn"),  # cuDNN does not
        (SdpaCall(BF16, 8, 2, 64, enable_gqa=True, mask="additive"), SM80, "math"),
        (SdpaCall(BF16, 8, 2, 64, enable_gqa=True, mask="additive"), SM90, "cudnn"),
        (SdpaCall(BF16, 8, 8, 256), SM90, "flash"),  # cuDNN <= 128 without the d256 frontend
        (SdpaCall(BF16, 8, 8, 256), replace(SM90, cudnn_version=92300, cudnn_frontend_d256=True), "cudnn"),
        (SdpaCall(BF16, 8, 8, 320), SM90, "efficient"),  # flash <= 256
        (SdpaCall(BF16, 8, 8, 36), SM80, "flash"),  # flash has no alignment rule
        (SdpaCall(BF16, 8, 8, 36, mask="bool"), SM90, "math"),  # efficient and cuDNN: multiples of 8
        (SdpaCall(FP32, 8, 8, 36, mask="bool"), SM90, "efficient"),  # fp32: multiples of 4
        (SdpaCall(FP32, 8, 8, 30), SM90, "math"),
        (SdpaCall(FP32, 8, 8, 64, offsets=(0, 2, 0)), SM90, "math"),  # k 8 bytes off 16
        (SdpaCall(BF16, 8, 8, 64, dropout=0.1), SM90, "flash"),  # cuDNN: dropout in 1/16
        (SdpaCall(BF16, 8, 8, 64, dropout=0.125), SM90, "cudnn"),
        (SdpaCall(BF16, 8, 8, 64), replace(SM90, deterministic=True), "flash"),
        (SdpaCall(BF16, 8, 8, 64, seq_q=16, seq_k=32), SM80, "efficient"),  # flash: causal square
    ],
)
def test_select_kernel_follows_the_cited_rules(call, plat, kernel):
    assert select_kernel(call, plat) == kernel, refusals(call, plat)


def test_refusals_name_the_rule():
    why = refusals(SdpaCall(FP32, 8, 2, 64, enable_gqa=True, mask="additive"), SM90)
    assert why == {
        "cudnn": "dtype float32",
        "flash": "attn_mask tensor",
        "efficient": "fewer key/value heads than query heads (no GQA)",
    }


def test_gqa_in_fp32_or_with_documents_expands_kv_for_the_efficient_kernel():
    got = megazero_call(FP32, 8, 2, 64, documents=False, offsets=(0, 256, 320))
    assert (got.expand_kv, got.kernel, got.call.kv_heads, got.call.enable_gqa) == (True, "efficient", 8, False)
    got = megazero_call(BF16, 8, 2, 64, documents=True, plat=SM80)
    assert (got.expand_kv, got.kernel, got.call.mask) == (True, "efficient", "additive")
    got = megazero_call(BF16, 8, 2, 64, documents=True, plat=SM90)  # cuDNN takes GQA with a mask
    assert (got.expand_kv, got.kernel) == (False, "cudnn")
    got = megazero_call(BF16, 8, 2, 64, documents=False, plat=SM80)
    assert (got.expand_kv, got.kernel, got.call.enable_gqa) == (False, "flash", True)


@pytest.mark.parametrize("plat", [SM80, SM90], ids=["sm80", "sm90"])
def test_no_accepted_configuration_lands_on_math_at_head_dims_of_8(plat):
    configs = accepted_configs()
    assert len(configs) == 42  # cp none 18 (dropout only without documents), p2p 12, a2a 12
    for c in configs:
        for d in (8, 64, 96, 128, 192, 256, 320, 512):
            assert config_kernel(c, d, plat)[0] != "math", (c, d)


def test_what_stays_on_math_is_16_bit_documents_with_head_dims_not_of_8():
    on_math = {(c.cp, c.dtype, c.gqa) for c in accepted_configs() if config_kernel(c, 36, SM90)[0] == "math"}
    assert on_math == {(cp, dt, gqa) for cp in ("none", "a2a") for dt in (BF16, FP16) for gqa in (False, True)}
    assert all(c.documents for c in accepted_configs() if config_kernel(c, 36, SM90)[0] == "math")


def test_the_docs_table_is_the_functions_output():
    text = DOCS.read_text()
    start, end = "<!-- attention-kernels:start -->\n", "<!-- attention-kernels:end -->"
    assert start in text and end in text, "docs/long-sequences.md lost the table's markers"
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == attention_table(), "regenerate: python -c 'from megazero.context_parallel." + (
        "sdpa_kernels import attention_table; print(attention_table())'"
    )


class _Sizes:
    seq_length, hidden_size, num_attention_heads, kv_heads, ffn_hidden_size = 4096, 1152, 32, 8, 4608


def test_ring_blocks_take_the_efficient_kernel_where_it_takes_the_dtype_and_head_dim():
    """The ring calls the memory-efficient kernel per block (``fused_blocks``): float32 at head
    dims of 4, 16-bit at head dims of 8; float64 and 16-bit head dim 36 stay on the einsums."""
    assert ring_block_kernel(torch.float32, 36, SM90) == "efficient"
    assert ring_block_kernel(BF16, 36, SM90) == ring_block_kernel(FP16, 36, SM80) == "einsum"
    assert ring_block_kernel(BF16, 320, SM80) == "efficient"
    assert ring_block_kernel(torch.float64, 128, SM90) == "einsum"
    assert config_kernel(accepted_configs()[0]._replace(cp="p2p", gqa=True), 64, SM90) == ("efficient", True)
    a = ActivationSettings(micro_batch_size=2, tp=2, sequence_parallel=False, activation_bytes=2, platform=SM90)
    assert attention_kernel(_Sizes(), replace(a, cp=2)) == "einsum"  # head size 36 in bf16
    assert attention_kernel(_Sizes(), replace(a, cp=2, activation_bytes=4)) == "efficient"


def test_planner_counts_the_math_kernels_scores_and_the_shared_document_mask():
    g = _Sizes()  # head size 36: 16-bit documents stay on math
    a = ActivationSettings(micro_batch_size=2, tp=2, sequence_parallel=False, activation_bytes=2, documents=True)
    cuda = replace(a, platform=SM90)
    assert attention_kernel(g, a) == "cpu" and math_core_bytes(g, a) == 0
    assert attention_kernel(g, cuda) == "math"
    assert math_core_bytes(g, cuda) == 4 * 2 * (32 // 2) * 4096**2  # fp32 [b, h/tp, s, s]
    assert layer_bytes(g, cuda) - layer_bytes(g, a) == math_core_bytes(g, cuda)
    assert document_mask_bytes(g, cuda) == 2 * 4096 * 4096 * 2  # one [b, 1, s, s] bf16 per micro-batch
    assert document_mask_bytes(g, replace(cuda, cp=2)) == 0  # the ring masks per block
    fp32 = replace(cuda, activation_bytes=4)
    assert attention_kernel(g, fp32) == "efficient" and math_core_bytes(g, fp32) == 0
    dropout = replace(a, documents=False, attention_dropout=0.1)
    assert layer_bytes(g, replace(dropout, platform=SM90)) < layer_bytes(g, dropout)  # fused dropout on CUDA


# -- CPU equality of the new call forms ----------------------------------------------------
def _inputs(G: int, T: int = 40, d: int = 8):
    g = torch.Generator().manual_seed(G)
    q = torch.randn(2, 4, T, d, generator=g, requires_grad=True)
    k, v = (torch.randn(2, G, T, d, generator=g, requires_grad=True) for _ in range(2))
    seg = torch.cumsum((torch.rand(2, T, generator=g) < 0.15).long(), dim=1)
    return q, k, v, seg


def _grads(y, q, k, v):
    dy = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    return torch.autograd.grad(y, (q, k, v), dy)


@pytest.mark.parametrize("G", [1, 2, 4])
def test_additive_document_mask_gives_the_boolean_masks_results_bit_for_bit(G):
    q, k, v, seg = _inputs(G)
    pos = torch.arange(q.shape[2])
    keep = block_mask(pos, pos, seg, seg, causal=True)[:, None]  # the boolean mask of before
    extra = {"enable_gqa": True} if G != 4 else {}
    y_bool = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, **extra)
    y = local_attention(q, k, v, segment_ids=seg)
    assert torch.equal(y, y_bool)
    for a, b in zip(_grads(y, q, k, v), _grads(y_bool, q, k, v)):
        assert torch.equal(a, b)
    mask = document_mask(pos, seg, torch.float32)
    assert mask.shape == (2, 1, 40, 40) and mask.stride(2) == 48  # rows padded to 16 elements


def test_expanded_kv_equals_enable_gqa_in_fp32():
    q, k, v, seg = _inputs(2)
    mask = document_mask(torch.arange(q.shape[2]), seg, torch.float32)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ke, ve = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    y_exp = F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)
    assert torch.equal(y, y_exp)
    for a, b in zip(_grads(y, q, k, v), _grads(y_exp, q, k, v)):  # dK/dV: the group summed
        assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-6


def test_the_layers_of_a_micro_batch_share_one_document_mask(monkeypatch):
    cfg = tiny_cfg(num_layers=3, seq_length=32)
    stage = GPTStage(cfg, ProcessGroups.single(), range(3), True, True, seed=5)
    tokens = torch.randint(1, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    tokens[:, 9], tokens[0, 20] = 0, 0  # EOD id 0: three documents in row 0, two in row 1
    x, labels, seq = shard_micro_batch(tokens, tokens, cp=1, cp_rank=0, packing=Packing(0, reset_attention_mask=True))
    masks = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kw):
        masks.append(kw.get("attn_mask"))
        return sdpa(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    stage(x, labels, seq=seq).sum().backward()
    assert len(masks) == 3 and all(m is masks[0] for m in masks), "one mask per layer, not one per micro-batch"
    assert masks[0].dtype == torch.float32 and masks[0].shape == (2, 1, 32, 32)


def _cfg_and_model(hidden: int, extra=()):
    from megazero.config import config_from_argv
    from model.build import build_gpt_config

    argv = ["--num-layers", "2", "--hidden-size", str(hidden), "--num-attention-heads", "8", "--seq-length", "1024"]
    argv += ["--vocab-size", "101", "--micro-batch-size", "1", "--global-batch-size", "1", *extra]
    cfg = config_from_argv(argv, 1, print_warnings=False, needs_data=False)
    return cfg, build_gpt_config(cfg, 101)


def test_the_start_warning_names_what_runs_on_math_and_the_plan_counts_it():
    from megazero.planning.plan import attention_math_warning, plan_memory

    cfg, gpt = _cfg_and_model(288, ["--bf16", "--reset-attention-mask"])  # head size 36
    warning = attention_math_warning(cfg, gpt, SM90)
    assert "head size 36" in warning and "--reset-attention-mask" in warning and "math kernel" in warning
    assert "32.0 MiB" in warning  # 4 bytes * 1 * 8 heads * 1024^2
    assert attention_math_warning(cfg, gpt, None) is None  # CPU ranks
    on_cpu, on_gpu = plan_memory(cfg, gpt), plan_memory(cfg, gpt, on_cuda=True, platform=SM90)
    assert on_gpu.activation_bytes - on_cpu.activation_bytes >= 4 * 8 * 1024**2
    cfg, gpt = _cfg_and_model(512, ["--bf16", "--reset-attention-mask"])  # head size 64
    assert attention_math_warning(cfg, gpt, SM90) is None
    assert attention_math_warning(cfg, gpt, CudaPlatform(sm=(8, 0))) is None


@pytest.mark.parametrize("docs", [False, True])
def test_the_expanded_call_path_equals_todays_on_cpu(monkeypatch, docs):
    """The CUDA branch that expands K/V (taken where ``expand_kv_for`` says so), forced on CPU:
    the same output bit for bit, K/V gradients equal to rounding (the group summed)."""
    import megazero.context_parallel.attention as attention

    q, k, v, seg = _inputs(2)
    seg = seg if docs else None
    y = local_attention(q, k, v, segment_ids=seg)
    grads = _grads(y, q, k, v)
    monkeypatch.setattr(attention, "expand_kv_for", lambda *a, **kw: True)
    y_exp = local_attention(q, k, v, segment_ids=seg)
    assert torch.equal(y, y_exp)
    for a, b in zip(grads, _grads(y_exp, q, k, v)):
        assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-6


def test_the_models_expanded_core_equals_enable_gqa_on_cpu(monkeypatch):
    import model.gpt as gpt

    cfg = tiny_cfg(num_layers=2, seq_length=16, num_attention_heads=4, num_query_groups=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    losses, grads = [], []
    for expand in (False, True):
        monkeypatch.setattr(gpt, "expand_kv_for", lambda *a, expand=expand, **kw: expand)
        stage = GPTStage(cfg, ProcessGroups.single(), range(2), True, True, seed=5)
        loss = stage(tokens, tokens).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in stage.parameters()])
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
