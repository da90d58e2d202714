"""The block features of the open checkpoints' families, all at once, under the layouts their
own sweeps in ``test_train.py`` leave out: the interleaved schedule, zero-bubble ZB-V, ZeRO-3
over dp with full recomputation, cp 2 at ZeRO-2 with the all-to-all and cp 2 x tp 2 with the ring.

FEATURES is a LLaMA-style block with Llama-3.x's RoPE scaling (``llama3`` bands and ``linear``
interpolation on top), Qwen2's q/k/v-only bias, and Qwen3's heads of their own size
(``--kv-channels 12`` against hidden / heads = 16) with QK-norm, gpt-oss's attention sinks
(``--softmax-type learnable``: a learned logit per head in every softmax), and sliding-window attention
(Mistral's, gpt-oss's alternation: ``--window-size 5,0 --window-attn-skip-freq 2``, a window of
6 positions in the 16-token sequence on layers 1 and 3, full attention on 2 and 4; through the
plain SDPA mask, the ring, which skips the key chunks out of reach, and the all-to-all). Each layout trains 6 steps in
one spawn of 4 gloo ranks; its losses equal ``tests/support/reference.py``'s oracle (which
computes every feature on its own) within 1e-5 relative, its gradient norms and greedy sample
the single process's (``check_layout``), and the features change the losses. ZB-V and ZeRO-3
run tp 2 without sequence parallelism (cp2-p2p-tp2-sp runs the ring with it), where the QK-norm
weights' gradient is each rank's heads' part and must still be summed over tp (it was not: the
gradient norm 5e-5 low, the losses 3e-5 off by step 4, with Adam hiding the rest).
"""

import math

from tests.support.layouts import BASE, FEATURE_STEPS, LLAMA, MB4, WIDER, check_feature_sweep, reference_losses

FEATURES = LLAMA + WIDER
FEATURES += ["--use-rope-scaling", "--rope-scaling-factor", "4", "--rope-scaling-high-freq-factor", "32"]
FEATURES += ["--rope-scaling-original-max-position-embeddings", "256", "--rotary-seq-len-interpolation-factor", "2"]
FEATURES += ["--add-qkv-bias", "--kv-channels", "12", "--qk-layernorm", "--softmax-type", "learnable"]
WINDOW = ["--window-size", "5,0", "--window-attn-skip-freq", "2"]  # window 6 < seq 16, layers 2 and 4 full
FEATURES += WINDOW
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
LAYOUTS = {
    "tp2-pp2-sp-interleaved": ["--tp", "2", "--pp", "2", "--sequence-parallel", "--virtual-pipeline-size", "2"] + MB4,
    "tp2-pp2-zb-v": ["--tp", "2", "--pp", "2", "--pipeline-schedule", "zb-v"] + MB4,
    "tp2-dp2-zero3-recompute": ["--tp", "2", "--dp", "2", "--zero-stage", "3"] + RECOMPUTE,
    "cp2-a2a-dp2-zero2": ["--cp", "2", "--cp-comm-type", "a2a", "--dp", "2", "--zero-stage", "2"],
    "cp2-p2p-tp2-sp": ["--cp", "2", "--tp", "2", "--sequence-parallel"],
}


def test_every_block_feature_together_under_interleaved_zero_bubble_zero3_and_cp():
    check_feature_sweep(FEATURES, LAYOUTS, 4)
    unwindowed = reference_losses(BASE + FEATURES[: -len(WINDOW)], FEATURE_STEPS)
    windowed = reference_losses(BASE + FEATURES, FEATURE_STEPS)
    assert not math.isclose(windowed[-1], unwindowed[-1], rel_tol=1e-4)  # the window matters
