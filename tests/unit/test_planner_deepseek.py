"""The planner on a DeepSeek-V3-shaped model (MLA with a query latent, layer 0 dense by
``--moe-layer-freq 0,1,1``, 8 routed experts plus a shared one): its parameter counts per pipeline
rank and per expert-parallel rank are the built stages' ``numel``; the FLOPs read off the spec are the
explicit count of every matmul (MLA's five projections, the attention over ``n + r`` score and ``v``
value dimensions, the dense MLP, the router, k of the E routed experts and the shared expert)."""

from megazero.param_spec import matmul_params
from megazero.planning import memory
from megazero.planning.flops import spec_flops_per_iteration
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from model.config import GPTConfig
from model.gpt import GPTStage
from model.spec import build_spec

H, HEADS, Q, KV, N, R, V_DIM = 32, 4, 16, 12, 8, 4, 6  # hidden, heads, q / kv latents, nope, rope, value dims
F, FM, S, E, K, L = 48, 16, 32, 8, 2, 3  # dense MLP, expert, shared widths; experts; top-k; layers


def _cfg() -> GPTConfig:
    return GPTConfig(
        vocab_size=100,
        num_layers=L,
        hidden_size=H,
        num_attention_heads=HEADS,
        ffn_hidden_size=F,
        seq_length=16,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        tie_embeddings=False,
        make_vocab_size_divisible_by=8,
        multi_latent_attention=True,
        q_lora_rank=Q,
        kv_lora_rank=KV,
        qk_head_dim=N,
        qk_pos_emb_head_dim=R,
        v_head_dim=V_DIM,
        num_experts=E,
        moe_router_topk=K,
        moe_ffn_hidden_size=FM,
        moe_shared_expert_intermediate_size=S,
        moe_layer_freq=[0, 1, 1],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
    )


def _attention_matmuls() -> int:
    """MLA's weights per layer: q_a, q_b, kv_a, kv_b, output projection."""
    return H * Q + Q * HEADS * (N + R) + H * (KV + R) + KV * HEADS * (N + V_DIM) + HEADS * V_DIM * H


def test_planned_parameters_equal_the_built_stages_under_pp_and_ep():
    cfg = _cfg()
    topo = Topology(pp=2)
    stages = [  # layers 0, 1 on stage 0 (the dense layer and one MoE layer), layer 2 on stage 1
        GPTStage(cfg, ProcessGroups(topo, rank=0), [0, 1], True, False, 0),
        GPTStage(cfg, ProcessGroups(topo, rank=1), [2], False, True, 0),
    ]
    for r, stage in enumerate(stages):
        assert sum(p.numel() for p in stage.parameters()) == memory.params_per_rank(cfg, 1, 2, r, layer_split=[2, 1])
    norms = 2 * H + Q + KV
    moe_layer = norms + _attention_matmuls() + E * H + E * 3 * H * FM + 3 * H * S
    dense_layer = norms + _attention_matmuls() + 3 * H * F
    head = 2 * 104 * H + H  # embedding and output (padded vocabulary 104) and the final norm
    assert memory.params_per_rank(cfg, 1, 1, 0) == dense_layer + 2 * moe_layer + head
    # expert parallelism 2: a rank holds 4 of the 8 routed experts of each MoE layer
    routed = 2 * E * 3 * H * FM
    assert memory.params_per_rank(cfg, 1, 1, 0, ep=2) == dense_layer + 2 * moe_layer + head - routed // 2
    assert memory.expert_params_per_rank(cfg, 1, 1, 0, ep=2) == routed // 2


def test_flops_of_mla_first_k_dense_and_active_experts_equal_the_explicit_count():
    cfg = _cfg()
    s, B, Vp = 16, 3, 104
    spec = build_spec(cfg, Vp)
    attention = 2 * 2 * s * cfg.attention_flops_width  # scores over n + r dims, values over v dims
    assert attention == 2 * s * HEADS * (N + R) + 2 * s * HEADS * V_DIM
    dense = 2 * (_attention_matmuls() + 3 * H * F) + attention
    moe = 2 * (_attention_matmuls() + E * H + K * 3 * H * FM + 3 * H * S) + attention  # k of E experts active
    hand = B * s * (3 * (dense + 2 * moe) + 3 * 2 * H * Vp)
    got = spec_flops_per_iteration(spec, seq_length=s, attention_width=cfg.attention_flops_width, global_batch_size=B)
    assert got == hand
    layer, layers, out = matmul_params(spec)  # the active matmul parameters: top-k of the routed + shared
    assert (layer, layers, out) == (
        L * _attention_matmuls() + 3 * H * F + 2 * (E * H + K * 3 * H * FM + 3 * H * S),
        L,
        H * Vp,
    )
