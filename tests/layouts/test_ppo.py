"""PPO with a critic (``--post-train ppo``): updates on stored rollouts under every layout equal
PPO written from the papers in plain PyTorch, and a resumed run continues the critic and the KL
controller.

The print-task prompts and the text reward of ``tests/layouts/test_grpo.py``. One process samples
and trains two iterations (policy, critic, KL-shaped rewards, GAE, whitening); ``tests/support/
rl.py``'s ``plain_ppo`` replays its rollouts on the reference GPT (policy and seeded critic, two
``torch.optim.Adam``). One process replays them with micro-batches of 1 and 4, and with the
adaptive KL controller, two passes per rollout, gamma 0.9 / lambda 0.8, clipped scores, no value
clipping and its own critic lr; eight gloo ranks replay them under tp2-pp2-dp2 ZeRO-3,
cp2-tp2-dp2 ZeRO-2, dp4 x tp2 ZeRO-3 with the optimizer on the host and the ZB-V layout with the
LLaMA block. Every
iteration's policy loss, gradient norm and critic loss, the policy's parameters and the
critic's (from ``ROOT/critic``) equal the plain run's within 1e-6; so does the pretraining-loss
term (``--ptx-coef``) in one process and under cp2-tp2-dp2.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.preference import assert_same_as_plain
from tests.support.rl import grpo_runs, plain_ppo, prompt_task

MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 48 --micro-batch-size 2 "
    "--global-batch-size 8 --grpo-prompts-per-step 4 --grpo-group-size 2 --max-new-tokens 8 "
    "--lr 2e-3 --seed 7 --eval-iters 0 --device cpu --split 1 --tokenizer-type HuggingFaceTokenizer "
    "--make-vocab-size-divisible-by 8 --lr-warmup-iters 0 --adam-eps 1e-4 --lr-decay-style constant "
    "--weight-decay 0 --clip-grad 0 --reward python:tests.support.rl:text_reward --train-iters 8 "
    "--init-kl-coef 0.1"
).split()
VARIANTS = {
    "micro-batch 1": ["--micro-batch-size", "1"],
    "micro-batch 4": ["--micro-batch-size", "4"],
    "adaptive kl, 2 passes, gamma lam, clipped scores, critic lr": (
        "--kl-target 0.001 --kl-horizon 16 --grpo-iterations 2 --gamma 0.9 --lam 0.8 "
        "--clip-reward-value 0.6 --critic-lr 5e-3"
    ).split(),
}
LLAMA = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention "
    "--num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights --ffn-hidden-size 64"
).split()
LAYOUTS = {
    "tp2-pp2-dp2 zero-3": "--tp 2 --pp 2 --dp 2 --zero-stage 3",
    "cp2-tp2-dp2 zero-2": "--cp 2 --tp 2 --dp 2 --zero-stage 2",
    "dp4-tp2 zero-3 cpu offload": "--dp 4 --tp 2 --zero-stage 3 --offload-optimizer cpu",
    "dp2-tp2-pp2 zb-v llama": "--dp 2 --tp 2 --pp 2 --pipeline-schedule zb-v " + " ".join(LLAMA),
}
KEYS = ("loss", "grad_norm", "rl_critic_loss")
PTX = ["--ptx-coef", "0.5"]
PTX_LAYOUT = "--cp 2 --tp 2 --dp 2 --zero-stage 1"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return prompt_task(tmp_path_factory, "ppo", MODEL, "ppo")


@pytest.fixture(scope="module")
def sampled(task):
    """One process: three iterations, and two saved (for the resume)."""
    runs = [(task["argv"], [None] * 3), (task["argv"] + ["--save", str(task["dir"] / "two")], [None] * 2)]
    return run_distributed(grpo_runs, 1, runs, params=True, timeout_s=600)[0][0]


@pytest.fixture(scope="module")
def replays(task, sampled):
    stored = sampled["rollouts"][:2]
    base, d = task["argv"], task["dir"]
    single = [(base + v, stored) for v in VARIANTS.values()] + [(base + ["--load", str(d / "two")], [None])]
    single.append((base + task["ptx"] + PTX, stored))
    one = run_distributed(grpo_runs, 1, single, params=True, timeout_s=600)
    eight = [(base + f.split() + ["--save", str(d / f"layout{i}")], stored) for i, f in enumerate(LAYOUTS.values())]
    eight.append((base + PTX_LAYOUT.split() + task["ptx"] + PTX + ["--save", str(d / "ptx")], stored))
    got = run_distributed(grpo_runs, 8, eight, timeout_s=900)[0]
    return dict(zip([*VARIANTS, "reload", "ptx"], one[0])), dict(zip([*LAYOUTS, "ptx"], got))


def _same(got: dict, want: dict, what: str) -> None:
    assert_same_as_plain(KEYS, got, want, what)
    for name, q in want["critic"].items():
        c = got["critic"][name][: q.shape[0]]
        assert torch.allclose(c, q, rtol=0, atol=1e-6), (what, "critic", name, float((c - q).abs().max()))


def test_one_process_equals_plain_pytorch(task, sampled):
    """Two sampled iterations: policy and critic losses, gradient norms, both models' parameters
    within 1e-6; the first update's ratio is 1 within 1e-6 and clips nothing; the KL coefficient
    is the fixed one."""
    want = plain_ppo(task["argv"], sampled["rollouts"][:2])
    got = dict(sampled, steps=sampled["steps"][:2])
    assert got["steps"][0]["rl_first_ratio_deviation"] < 1e-6 and got["steps"][0]["rl_first_clip_fraction"] == 0.0
    assert all(s["rl_kl_coef"] == 0.1 for s in got["steps"])
    for g, w in zip(got["steps"], want["steps"]):
        for k in KEYS:
            assert abs(g[k] - w[k]) <= 1e-6 * max(1.0, abs(w[k])), (k, g[k], w[k])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_process_variants_equal_plain_pytorch(task, sampled, replays, name):
    single, _ = replays
    extra = [] if name.startswith("micro-batch") else VARIANTS[name]
    _same(single[name], plain_ppo(task["argv"] + extra, sampled["rollouts"][:2]), name)
    if name.startswith("adaptive"):
        coefs = [s["rl_kl_coef"] for s in single[name]["steps"]]
        assert coefs[0] == 0.1 and coefs[1] != 0.1, coefs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_plain_pytorch(task, sampled, replays, name):
    """Each layout: losses, gradient norms, the saved policy and critic within 1e-6."""
    from megazero.checkpoint import read_full_weights

    _, eight = replays
    root = task["dir"] / f"layout{list(LAYOUTS).index(name)}"
    got = dict(eight[name], params=read_full_weights(str(root))[1], critic=read_full_weights(str(root / "critic"))[1])
    llama = "llama" in name  # ZB-V with RoPE, RMSNorm, SwiGLU, GQA: its own plain run, no ratio check
    _same(got, plain_ppo(task["argv"] + (LLAMA if llama else []), sampled["rollouts"][:2]), name)
    first = got["steps"][0]
    if not llama:
        assert first["rl_first_ratio_deviation"] < 1e-6 and first["rl_first_clip_fraction"] == 0.0, first


def test_a_resumed_run_continues_the_critic_and_the_controller(sampled, replays):
    """A trainer built afresh in another process, loading iteration 2's checkpoint (policy,
    ``ROOT/critic``, the KL coefficient), samples iteration 3's rollout bit for bit and its update
    gives the same policy and critic losses."""
    again = replays[0]["reload"]
    a, b = sampled["rollouts"][2], again["rollouts"][0]
    for k in ("tokens", "mask", "log_probs", "scores"):
        assert torch.equal(a[k], b[k]), k
    for k in ("loss", "rl_critic_loss", "rl_kl_coef"):
        assert again["steps"][0][k] == sampled["steps"][2][k], k


def test_the_ptx_term_equals_plain_pytorch_in_one_process_and_under_cp2_tp2_dp2(task, sampled, replays):
    """--ptx-coef 0.5 with the test corpus: after each policy step a step on 0.5 x the token-mean
    language-model loss of the next pretraining batch; the policy, critic and ptx losses and both
    models' parameters equal the plain run's within 1e-6, in one process and under cp2-tp2-dp2
    ZeRO-1 (the pretraining sequences sharded over cp like any batch)."""
    from megazero.checkpoint import read_full_weights

    single, eight = replays
    want = plain_ppo(task["argv"] + task["ptx"] + PTX, sampled["rollouts"][:2])
    assert all(s["rl_ptx_loss"] is not None and s["rl_ptx_loss"] > 0 for s in want["steps"])
    keys = (*KEYS, "rl_ptx_loss")
    assert_same_as_plain(keys, dict(single["ptx"], params=single["ptx"]["params"]), want, "ptx one process")
    root = task["dir"] / "ptx"
    got = dict(eight["ptx"], params=read_full_weights(str(root))[1], critic=read_full_weights(str(root / "critic"))[1])
    assert_same_as_plain(keys, got, want, "ptx cp2-tp2-dp2")
    without = plain_ppo(task["argv"], sampled["rollouts"][:2])
    moved = max(float((want["params"][k] - without["params"][k]).abs().max()) for k in want["params"])
    assert moved > 1e-4, moved  # the term changes the policy


def test_bad_ppo_settings_exit_2_with_one_line(task, capsys):
    """Before any rank starts: --ptx-coef without its data, --sequence-parallel (per-token values),
    --gamma above 1, --ptx-data-path of a missing prefix: exit 2, one line naming the setting and
    the fix."""
    from megazero.training.startup import preflight

    cases = {
        "--ptx-coef 0.5": (["--ptx-coef", "0.5"], "--ptx-data-path"),
        "--sequence-parallel": (["--tp", "2", "--sequence-parallel"], "drop --sequence-parallel"),
        "--gamma 1.5": (["--gamma", "1.5"], "--gamma 1"),
        "--ptx-data-path": (["--ptx-coef", "0.5", "--ptx-data-path", str(task["dir"] / "nope")], "data/preprocess.py"),
    }
    for what, (extra, fix) in cases.items():
        world = 2 if "--tp" in extra else 1
        try:
            code = preflight(task["argv"] + extra, world)
        except SystemExit as e:
            code = e.code
        msg = capsys.readouterr().err.strip()
        assert code == 2 and what.split()[0] in msg and fix in msg and "\n" not in msg, (what, msg)
