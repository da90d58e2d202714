"""DeepSeek's multi-head latent attention (model/mla.py) under tp 2 with sequence parallelism, tp 2
without it (with selective recomputation of the attention core), pp 2 (GPipe), context parallelism
(cp 2 on the ring with tp 2 and sequence parallelism, cp 2 on the all-to-all), the interleaved
schedule (tp 2 x pp 2 x 2 virtual stages, with sequence parallelism), zero-bubble ZB-V and ZeRO-3
with full recomputation.

The block is LLaMA-style (RMSNorm, SwiGLU, no biases, untied output) with MLA: a low-rank query
(q_lora 16), a key/value latent of 12, heads of 8 + 4 RoPE query/key dimensions and 6 value
dimensions, and YaRN with mscale_all_dim (the softmax scale times its square, cos and sin times
mscale / mscale_all_dim). One spawn of 4 gloo ranks trains each layout FEATURE_STEPS (6) steps
(a layout of 2 model-parallel ranks runs dp 2);
the losses equal tests/support/reference.py's oracle (which computes the latents, the shared RoPE
key and the scale on its own) within 1e-5 relative, the gradient norms and the seeded sample (the
KV-cache decoder with MLA's latent cache) the single process's (``check_layout``). Under cp the
keys (8 + 4 dimensions) and values (6) of different head sizes go round the ring as one message or
through the all-to-all, and the shared RoPE key is rotated at its tokens' zigzag positions. Under tp
the replicated ``q_a`` / ``kv_a`` weights and their norms see only their rank's heads' gradient,
which must be summed over tp: without sequence parallelism only the ``MLA_REPLICATED`` tag does it
(dropped, the tp2-selective layout fails)."""

from tests.support.layouts import LLAMA, MB4, WIDER, check_feature_sweep

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]


def _without(flags: list, drop: dict) -> list:
    """``flags`` less each flag of ``drop`` (name -> how many values follow it)."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in drop:
            i += 1 + drop[flags[i]]
            continue
        out.append(flags[i])
        i += 1
    return out


# MLA has its own heads and RoPE width: no query groups, no --rotary-percent
MLA = _without(LLAMA, {"--group-query-attention": 0, "--num-query-groups": 1, "--rotary-percent": 1}) + WIDER
MLA += ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12"]
MLA += ["--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]
MLA += ["--yarn-rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8"]
MLA += ["--yarn-mscale", "0.8", "--yarn-mscale-all-dim", "1"]
LAYOUTS = {
    "tp2-sp": ["--tp", "2", "--sequence-parallel"] + MB4,
    "tp2-selective": ["--tp", "2", "--recompute-granularity", "selective"] + MB4,
    "pp2-gpipe": ["--pp", "2", "--pipeline-schedule", "gpipe"] + MB4,
    "cp2-p2p-tp2-sp": ["--cp", "2", "--tp", "2", "--sequence-parallel"],
    "cp2-a2a": ["--cp", "2", "--cp-comm-type", "a2a"],
    "tp2-pp2-sp-interleaved": ["--tp", "2", "--pp", "2", "--sequence-parallel", "--virtual-pipeline-size", "2"] + MB4,
    "tp2-pp2-zb-v": ["--tp", "2", "--pp", "2", "--pipeline-schedule", "zb-v"] + MB4,
    "tp2-dp2-zero3-recompute": ["--tp", "2", "--dp", "2", "--zero-stage", "3"] + RECOMPUTE,
}


def test_mla_under_tp_sp_pp_cp_interleaved_zbv_and_zero3_equals_reference():
    check_feature_sweep(MLA, LAYOUTS, 4)
