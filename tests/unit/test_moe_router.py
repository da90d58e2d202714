"""MoE routing rules (megazero/moe/router.py) against closed forms built by hand: the top-k
choice and weights of each score function, the aux loss from the pre-drop top-k mask, the
sequence-wise aux loss, the z-loss, the expert-bias sign rule, the capacity drop of both
policies (against a brute-force rule), and the auxiliary gradient's entry into the backward."""

import math

import pytest
import torch

from megazero.moe import router as R


def _logits(T=12, E=6, seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def test_route_softmax_sigmoid_and_bias_by_hand():
    x = _logits()
    T, E = x.shape
    for pre in (False, True):
        r = R.route(x, 2, "softmax", pre_softmax=pre)
        for t in range(T):
            row = x[t].tolist()
            best = sorted(range(E), key=lambda e: (-row[e], e))[:2]
            assert r.experts[t].tolist() == best
            full = [math.exp(v) / sum(math.exp(u) for u in row) for v in row]
            want = (
                [full[e] for e in best]
                if pre
                else [math.exp(row[e]) / sum(math.exp(row[b]) for b in best) for e in best]
            )
            assert r.probs[t].tolist() == pytest.approx(want, rel=1e-6)
            assert r.scores[t].tolist() == pytest.approx(full, rel=1e-6)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 5.0])  # forces expert 5 into every choice
    r = R.route(x, 2, "sigmoid", expert_bias=bias)
    sig = torch.sigmoid(x)
    for t in range(T):
        others = sorted(range(5), key=lambda e: (-sig[t, e].item(), e))
        assert r.experts[t].tolist() == [5, others[0]]
        chosen = [sig[t, 5].item(), sig[t, others[0]].item()]  # the bias steers, never weighs
        assert r.probs[t].tolist() == pytest.approx([c / sum(chosen) for c in chosen], rel=1e-6)
        assert r.scores[t].tolist() == pytest.approx((sig[t] / sig[t].sum()).tolist(), rel=1e-6)
    one = R.route(x, 1, "sigmoid")
    assert one.probs[:, 0].tolist() == pytest.approx(sig.max(-1).values.tolist(), rel=1e-6)


def test_aux_loss_seq_aux_loss_and_z_loss_equal_their_closed_forms():
    x, k = _logits(T=16, E=4, seed=1), 2
    r = R.route(x, k, "softmax")
    T, E = x.shape

    def by_hand(rows):
        f = [sum(int(e) == i for t in rows for e in r.experts[t].tolist()) / (len(rows) * k) for i in range(E)]
        P = [sum(r.scores[t, i].item() for t in rows) / len(rows) for i in range(E)]
        return E * sum(a * b for a, b in zip(f, P))

    assert R.aux_loss(r.scores, r.experts, k, coeff=0.01).item() == pytest.approx(0.01 * by_hand(range(T)), rel=1e-6)
    seqs = [range(0, 8), range(8, 16)]
    assert R.seq_aux_loss(r.scores, r.experts, k, 8, coeff=0.5).item() == pytest.approx(
        0.5 * sum(by_hand(s) for s in seqs) / 2, rel=1e-6
    )
    lse = [math.log(sum(math.exp(v) for v in x[t].tolist())) for t in range(T)]
    assert R.z_loss(x, coeff=1e-3).item() == pytest.approx(1e-3 * sum(v * v for v in lse) / T, rel=1e-6)
    # every expert equally likely and equally chosen: the minimum, coeff x 1
    assert R.aux_loss(torch.full((8, 4), 0.25), torch.tensor([[0, 1], [2, 3]] * 4), 2).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="not whole sequences of 5"):
        R.seq_aux_loss(r.scores, r.experts, k, 5)


def test_expert_bias_sign_rule_and_capacity_drops_equal_the_brute_force_rule():
    counts = torch.tensor([10, 2, 6, 6])  # mean 6
    assert R.expert_bias_update(torch.zeros(4), counts, 1e-3).tolist() == pytest.approx([-1e-3, 1e-3, 0.0, 0.0])
    assert R.expert_capacity(16, 4, 2, 1.0) == 8 and R.expert_capacity(10, 4, 2, 1.1) == 6
    for seed in range(4):
        x = _logits(T=20, E=5, seed=seed)
        r = R.route(x, 2, "softmax")
        r.probs[3, 0] = r.probs[7, 0] = r.probs[7, 0].clone()  # a tie, broken to the earlier token
        for policy in R.DROP_POLICIES:
            keep = R.capacity_keep(r.probs, r.experts, 5, 4, policy)
            for e in range(5):
                mine = [(t, j) for t in range(20) for j in range(2) if r.experts[t, j] == e]
                key = (lambda a: (-r.probs[a].item(), a[0])) if policy == "probs" else (lambda a: a[0])
                kept = set(sorted(mine, key=key)[:4])
                assert {a for a in mine if keep[a]} == kept, (seed, policy, e)
    with pytest.raises(ValueError, match="--moe-expert-capacity-factor 0 must be > 0"):
        R.expert_capacity(16, 4, 2, 0)
    with pytest.raises(ValueError, match="--moe-token-drop-policy"):
        R.capacity_keep(r.probs, r.experts, 5, 4, "random")


def test_auxiliary_gradient_enters_the_backward_as_if_added_to_the_loss():
    torch.manual_seed(0)
    w = torch.randn(6, 4, requires_grad=True)
    h = torch.randn(10, 6)

    def grads(inject: bool, scale: float):
        w.grad = None
        logits = h @ w
        r = R.route(logits, 2, "softmax")
        aux = R.aux_loss(r.scores, r.experts, 2, coeff=0.1) + R.z_loss(logits, coeff=0.01)
        out = (r.probs * torch.arange(1.0, 3.0)).sum(-1)
        if inject:
            R.AuxLossBackward.set_scale(scale)
            out = R.AuxLossBackward.apply(out, aux)
            out.sum().backward()
        else:
            (out.sum() + scale * aux).backward()
        return w.grad.clone()

    try:
        for scale in (1.0, 0.25):
            torch.testing.assert_close(grads(True, scale), grads(False, scale), rtol=1e-6, atol=1e-7)
    finally:
        R.AuxLossBackward.set_scale(1.0)


def test_router_refuses_bad_settings_by_name():
    x = _logits(E=4)
    with pytest.raises(ValueError, match=r"--moe-router-topk 5 must be in \[1, --num-experts 4\]"):
        R.route(x, 5)
    with pytest.raises(ValueError, match="needs --moe-router-score-function sigmoid"):
        R.route(x, 2, "softmax", expert_bias=torch.zeros(4))
    with pytest.raises(ValueError, match="--moe-router-score-function 'relu'"):
        R.route(x, 2, "relu")


def test_router_logits_in_fp32_keep_near_ties_of_a_bf16_model_apart():
    """Two experts whose logits differ by 2**-9 (below bf16's resolution at 1.0, 2**-7): the bf16
    GEMM rounds both to 1.0, an exact tie the top-1 gives to expert 0; the fp32 router (the
    default, --moe-router-dtype fp32) picks expert 1, as the exact logits say. The MoE layer of a
    bf16 model routes by the fp32 logits."""
    from model.config import GPTConfig
    from model.moe import MoEMLP

    bf16 = torch.bfloat16
    x = torch.tensor([[1.0, 1.0]], dtype=bf16)  # (N=1, H=2)
    w = torch.tensor([[1.0, 2.0**-9], [1.0, 2.0**-8], [-1.0, 0.0], [-1.0, 0.0]], dtype=bf16)  # (E=4, H)
    low, high = R.router_logits(x, w, "model"), R.router_logits(x, w)
    assert low.dtype == bf16 and low[0, 0] == low[0, 1]  # the tie the bf16 GEMM makes
    assert high.dtype == torch.float32 and high[0, 1] - high[0, 0] == 2.0**-9
    assert R.route(low, 1).experts.tolist() == [[0]] and R.route(high, 1).experts.tolist() == [[1]]
    with pytest.raises(ValueError, match="--moe-router-dtype 'fp16'"):
        R.router_logits(x, w, "fp16")

    for dtype, want in (("fp32", 1), ("model", 0)):
        cfg = GPTConfig(
            num_layers=1,
            hidden_size=2,
            num_attention_heads=1,
            ffn_hidden_size=4,
            seq_length=1,
            max_position_embeddings=1,
            vocab_size=8,
            params_dtype=bf16,
            num_experts=4,
            moe_router_topk=1,
            moe_ffn_hidden_size=4,
            moe_router_dtype=dtype,
            add_bias_linear=False,  # no router bias: the weight alone makes the near tie
        )
        moe = MoEMLP(cfg, None)
        with torch.no_grad():
            moe.router.weight.copy_(w)
        moe.record = []
        moe(x.view(1, 1, 2))
        assert moe.record[0][0].tolist() == [[want]], dtype


def _deepseek_v3_gate(E, k, groups, group_topk, norm, scaling, bias, seed=0):
    """transformers' DeepseekV3TopkRouter of a tiny config (H = 16) with a random weight and, when
    ``bias``, a random e_score_correction_bias of the size of the sigmoid scores' spread."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=E,
        num_experts_per_tok=k,
        n_group=groups,
        topk_group=group_topk,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
    )
    gate = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, 16, generator=g))
        if bias:
            gate.e_score_correction_bias.copy_(0.3 * torch.randn(E, generator=g))
    return gate


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("groups,group_topk", [(1, 1), (4, 2), (8, 3)])
def test_group_limited_sigmoid_routing_equals_transformers_deepseek_v3(groups, group_topk, bias):
    """16 experts, k = 4, 64 tokens: megazero's route (sigmoid, the gate's correction bias as the
    expert bias, --moe-router-num-groups/--moe-router-group-topk, scaling 2.5) chooses the experts
    transformers' DeepseekV3TopkRouter chooses (norm_topk_prob true, as DeepSeek-V3) with weights
    within 1e-6; one group of all experts is the ungrouped rule bit for bit."""
    E, k, scaling = 16, 4, 2.5
    gate = _deepseek_v3_gate(E, k, groups, group_topk, True, scaling, bias)
    h = torch.randn(2, 32, 16, generator=torch.Generator().manual_seed(1))
    logits, want_w, want_e = gate(h)  # (64, E), (64, k), (64, k)
    expert_bias = gate.e_score_correction_bias if bias else None
    r = R.route(logits, k, "sigmoid", expert_bias=expert_bias, num_groups=groups, group_topk=group_topk)
    scaled = R.route(
        logits, k, "sigmoid", expert_bias=expert_bias, num_groups=groups, group_topk=group_topk, scaling_factor=scaling
    )
    order = want_e.argsort(-1)  # transformers' top-k is unsorted: compare by expert
    got_order = scaled.experts.argsort(-1)
    assert torch.equal(scaled.experts.gather(1, got_order), want_e.gather(1, order))
    torch.testing.assert_close(scaled.probs.gather(1, got_order), want_w.gather(1, order), rtol=0, atol=1e-6)
    torch.testing.assert_close(scaled.probs, r.probs * scaling, rtol=0, atol=0)
    assert torch.equal(scaled.experts, r.experts)
    if groups == 1:
        plain = R.route(logits, k, "sigmoid", expert_bias=expert_bias)
        assert torch.equal(plain.experts, r.experts) and torch.equal(plain.probs, r.probs)
    else:  # the groups changed some token's choice: the test sees the group rule
        plain = R.route(logits, k, "sigmoid", expert_bias=expert_bias)
        assert not torch.equal(plain.experts, r.experts)


def test_group_limited_softmax_routing_by_hand():
    """Softmax scores (Megatron-LM groups the choice key: the logits, or the full softmax under
    pre-softmax): 8 experts in 4 groups of 2, the 2 groups with the largest top-2 sums kept, the
    k = 3 experts the largest keys inside them, weights as the ungrouped rule of those 3; the
    load-balancing scores stay the softmax over all experts."""
    x = _logits(T=20, E=8, seed=3)
    T, E = x.shape
    for pre in (False, True):
        r = R.route(x, 3, "softmax", pre_softmax=pre, num_groups=4, group_topk=2, scaling_factor=1.5)
        full = torch.softmax(x, -1)
        key = full if pre else x
        for t in range(T):
            row = key[t].tolist()
            sums = [row[2 * g] + row[2 * g + 1] for g in range(4)]
            kept = sorted(range(4), key=lambda g: (-sums[g], g))[:2]
            inside = [e for e in range(E) if e // 2 in kept]
            best = sorted(inside, key=lambda e: (-row[e], e))[:3]
            assert r.experts[t].tolist() == best
            chosen = [row[e] for e in best]
            want = chosen if pre else [math.exp(c) / sum(math.exp(u) for u in chosen) for c in chosen]
            assert r.probs[t].tolist() == pytest.approx([1.5 * w for w in want], rel=1e-6)
        torch.testing.assert_close(r.scores, full, rtol=0, atol=0)


def test_group_limited_routing_refuses_bad_sizes_by_name():
    x = _logits(E=8)
    with pytest.raises(ValueError, match="--moe-router-num-groups 3 does not divide --num-experts 8"):
        R.route(x, 2, "sigmoid", num_groups=3, group_topk=1)
    with pytest.raises(ValueError, match=r"--moe-router-group-topk 5 must be in \[1, --moe-router-num-groups 4\]"):
        R.route(x, 2, "sigmoid", num_groups=4, group_topk=5)
    with pytest.raises(ValueError, match="--moe-router-topk 5 exceeds the 2 x 2 experts of the kept groups"):
        R.route(x, 5, "sigmoid", num_groups=4, group_topk=2)
    with pytest.raises(ValueError, match="go together"):
        R.route(x, 2, "sigmoid", num_groups=4)
