"""Reinforcement learning (``--post-train grpo``): updates on stored rollouts under every layout
equal GRPO written from the papers in plain PyTorch, and rollouts are reproducible.

Prompts are the demo's print tasks (``data.print_tasks``) with a small Hugging Face tokenizer;
the reward is ``tests.support.rl.text_reward`` (many values for an untrained model's responses).
One process samples two rollouts and trains on them; ``tests/support/rl.py``'s ``plain_grpo``
replays them on the reference GPT with ``torch.optim.Adam`` (constant lr, no weight decay or
clipping). One process then replays the stored rollouts with micro-batches of 1 and 4, each
advantage kind, each loss aggregation, the KL penalty with each estimator, several iterations
per rollout, the zero-variance filter, the KL in the rewards and the LLaMA block; eight gloo
ranks replay them under tp2-pp2-dp2 ZeRO-3, cp2-tp2-dp2 ZeRO-2, dp4 x tp2 ZeRO-3 with the
optimizer on the host, dp 2 and 8 (ranks whose rows all weigh 0), ZB-V, interleaved pp 4, and
cp2 x dp4 with the KL in the rewards (whole rows gathered over cp). Every iteration's loss and
gradient norm and the parameters after the last one equal the plain run's within 1e-6; on the
first update of each rollout the ratio is 1 within 1e-6 (the trainer's log-probabilities of
the sampled tokens equal the sampler's, under any layout) and no token is clipped.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.preference import assert_same_as_plain
from tests.support.rl import grpo_runs, plain_grpo, prompt_task

MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 48 --micro-batch-size 2 "
    "--global-batch-size 8 --grpo-prompts-per-step 4 --grpo-group-size 4 --max-new-tokens 8 "
    "--lr 2e-3 --seed 7 --eval-iters 0 --device cpu --split 1 --tokenizer-type HuggingFaceTokenizer "
    "--make-vocab-size-divisible-by 8 --lr-warmup-iters 0 --adam-eps 1e-4 --lr-decay-style constant "
    "--weight-decay 0 --clip-grad 0 --reward python:tests.support.rl:text_reward --train-iters 8"
).split()
LLAMA = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention "
    "--num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights --ffn-hidden-size 64"
).split()
KL = ["--grpo-kl-beta", "0.1"]
FILTER = ["--grpo-filter-groups-with-same-reward"]
VARIANTS = {  # one process, replaying the stored rollouts
    "micro-batch 1": ["--micro-batch-size", "1"],
    "micro-batch 4": ["--micro-batch-size", "4"],
    "rloo seq-mean kl-k3 2 iterations filter": [
        *KL,
        "--grpo-advantage",
        "rloo",
        "--grpo-loss-agg",
        "seq-mean-token-mean",
        "--grpo-iterations",
        "2",
        "--grpo-filter-groups-with-same-reward",
    ],
    "dr_grpo sum-norm kl-k2 temperature 0.7": [
        "--grpo-kl-beta",
        "0.05",
        "--grpo-kl-estimator",
        "k2",
        "--grpo-advantage",
        "dr_grpo",
        "--grpo-loss-agg",
        "seq-mean-token-sum-norm",
        "--temperature",
        "0.7",
    ],
    "kl-k1 asymmetric clip": [*KL, "--grpo-kl-estimator", "k1", "--grpo-clamp-eps-upper", "0.28"],
    "kl in reward k1 filter": [*KL, "--grpo-kl-in-reward", "--grpo-kl-estimator", "k1", *FILTER],
    "llama": LLAMA,
}
LAYOUTS = {  # name: (layout flags, the model and loss flags its plain run uses)
    "tp2-pp2-dp2 zero-3 kl": ("--tp 2 --pp 2 --dp 2 --zero-stage 3", KL),
    "cp2-tp2-dp2 zero-2 llama": ("--cp 2 --tp 2 --dp 2 --zero-stage 2", LLAMA),
    "dp4-tp2 zero-3 cpu offload seq-mean": (
        "--dp 4 --tp 2 --zero-stage 3 --offload-optimizer cpu",
        ["--grpo-loss-agg", "seq-mean-token-mean"],
    ),
    "dp2-tp2-pp2 zb-v llama kl ref-offload": (
        "--dp 2 --tp 2 --pp 2 --pipeline-schedule zb-v --ref-offload",
        [*KL, *LLAMA],
    ),
    "interleaved pp4 vp2 dp2 kl": (
        "--pp 4 --virtual-pipeline-size 2 --dp 2 --micro-batch-size 1",
        [*KL, "--num-layers", "8"],
    ),
    "dp8 micro-batch 1 filter": ("--dp 8 --micro-batch-size 1", FILTER),
    "dp2-tp4 filter": ("--dp 2 --tp 4", FILTER),
    "cp2-dp4 kl in reward": ("--cp 2 --dp 4", [*KL, "--grpo-kl-in-reward"]),
}
KEYS = ("loss", "grad_norm")
FULL = "--tp 2 --pp 2 --dp 2 --zero-stage 3"  # three whole iterations, rollouts included


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return prompt_task(tmp_path_factory, "grpo", MODEL, "grpo")


@pytest.fixture(scope="module")
def sampled(task):
    """One process samples and trains on three rollouts, and (a second run) on two, saved; the
    stored rollouts are the first two, the second one's first group then given equal rewards (a
    group the filter leaves out: dp 8's ranks 0-3 hold only its rows)."""
    runs = [(task["argv"], [None] * 3), (task["argv"] + ["--save", str(task["dir"] / "two")], [None] * 2)]
    got = run_distributed(grpo_runs, 1, runs, params=True, timeout_s=600)[0][0]
    stored = [dict(r) for r in got["rollouts"][:2]]
    flat = stored[1]["scores"].clone()
    flat[:4] = 0.5
    stored[1]["scores"] = flat
    return got, stored


@pytest.fixture(scope="module")
def replays(task, sampled):
    """The stored rollouts replayed: each variant in one process, then (the same process, a new
    trainer) the run loading iteration 2's checkpoint for one iteration; each layout on eight
    ranks (saved after the last iteration). Two spawns."""
    _, stored = sampled
    base, d = task["argv"], task["dir"]
    single = [(base + extra, stored) for extra in VARIANTS.values()]
    eight = [
        (base + model + flags.split() + ["--save", str(d / f"layout{i}")], stored)
        for i, (flags, model) in enumerate(LAYOUTS.values())
    ]
    eight.append((base + FULL.split() + ["--save", str(d / "full")], [None] * 3))
    single.append((base + ["--load", str(d / "two")], [None]))
    one = run_distributed(grpo_runs, 1, single, params=True, timeout_s=600)[0]
    got = run_distributed(grpo_runs, 8, eight, timeout_s=900)[0]
    return dict(zip([*VARIANTS, "reload"], one)), dict(zip([*LAYOUTS, "full"], got))


def test_sampling_and_training_in_one_process_equal_plain_pytorch(task, sampled):
    """The full loop (sample, score, advantages, update) of two iterations equals GRPO written in
    plain PyTorch on the same rollouts; each rollout's first update has ratio 1 within 1e-6 and
    clips nothing; the rewards are the text reward's of the decoded responses."""
    got, _ = sampled
    assert_same_as_plain(KEYS, got, plain_grpo(task["argv"], got["rollouts"]), "sampled")
    for step, r in zip(got["steps"], got["rollouts"]):
        assert step["rl_first_ratio_deviation"] < 1e-6 and step["rl_first_clip_fraction"] == 0.0, step
        assert math.isclose(step["rl_reward"], float(r["scores"].mean()), rel_tol=1e-12)
        assert set(r["scores"].tolist()) <= {0.0, 0.25, 0.5, 0.75, 1.0} and len(set(r["scores"].tolist())) > 1


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_process_variants_equal_plain_pytorch(task, sampled, replays, name):
    """Each variant replaying the stored rollouts: losses, gradient norms and parameters within 1e-6."""
    _, stored = sampled
    single, _ = replays
    extra = [] if name.startswith("micro-batch") else VARIANTS[name]
    assert_same_as_plain(KEYS, single[name], plain_grpo(task["argv"] + extra, stored), name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_plain_pytorch(task, sampled, replays, name):
    """Each layout replaying the stored rollouts: losses, gradient norms and the saved
    parameters within 1e-6 of the plain run; on the first update (the first rollout was sampled
    by one process with the same weights) the ratio is 1 within 1e-6 and nothing is clipped."""
    from megazero.checkpoint import read_full_weights

    _, stored = sampled
    _, eight = replays
    flags, model = LAYOUTS[name]
    got = dict(eight[name], params=read_full_weights(str(task["dir"] / f"layout{list(LAYOUTS).index(name)}"))[1])
    assert_same_as_plain(KEYS, got, plain_grpo(task["argv"] + model, stored), name)
    if "--num-layers" not in model and "llama" not in name:  # the sampler's model before its first update: ratio 1
        first = got["steps"][0]
        assert first["rl_first_ratio_deviation"] < 1e-6 and first["rl_first_clip_fraction"] == 0.0, (name, first)


def test_the_filter_leaves_a_flat_group_out_and_its_ranks_hold_only_zero_weights(sampled, replays):
    """The second stored rollout's first group has equal rewards: its share of the zero-variance
    fraction is 1/4, and under dp 8 the four ranks holding its rows contribute no weighted token,
    yet the run equals the plain run (checked above) and its second iteration moves the model."""
    _, stored = sampled
    _, eight = replays
    run = eight["dp8 micro-batch 1 filter"]
    assert run["steps"][1]["rl_zero_variance_fraction"] >= 0.25
    assert torch.equal(stored[1]["scores"][:4], torch.full((4,), 0.5, dtype=stored[1]["scores"].dtype))
    assert run["steps"][1]["grad_norm"] > 0


def test_full_iterations_under_tp2_pp2_dp2_zero3_equal_one_process(task, sampled, replays):
    """Three whole iterations (rollout under the layout: pipeline decoding, ZeRO-3 units held for
    the rollout, rows split over dp; then the update) give the one process's rollouts token for
    token, log-probabilities within 1e-6, the same rewards, and parameters within 1e-6."""
    from megazero.checkpoint import read_full_weights

    one, _ = sampled
    _, eight = replays
    full = eight["full"]
    for a, b in zip(one["rollouts"], full["rollouts"], strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["mask"], b["mask"])
        assert torch.allclose(a["log_probs"], b["log_probs"], rtol=0, atol=1e-6)
        assert torch.equal(a["scores"], b["scores"])
    got = dict(full, params=read_full_weights(str(task["dir"] / "full"))[1])
    assert_same_as_plain(KEYS, got, dict(one, params=one["params"]), "full")


def test_a_rollout_after_a_reload_is_bit_identical(sampled, replays):
    """A trainer built afresh (another process than the one that saved) loading the checkpoint
    saved after iteration 2 samples iteration 3's rollout bit for bit as the run that went on
    (tokens, log-probabilities, rewards), and its update gives the same loss."""
    one, _ = sampled
    again = replays[0]["reload"]
    a, b = one["rollouts"][2], again["rollouts"][0]
    for k in ("tokens", "mask", "log_probs", "scores"):
        assert torch.equal(a[k], b[k]), k
    assert b["prompt_keys"] == a["prompt_keys"] == [8, 9, 10, 11]
    assert again["steps"][0]["loss"] == one["steps"][2]["loss"]


def test_bad_grpo_settings_exit_2_with_one_line(task, capsys):
    """Before any rank starts (the launcher's preflight): --mock-data, a rollout that does not cut
    into whole optimizer steps, no room for a response, MoE, label smoothing, a reward module that
    does not import, a prompt longer than the room left: exit 2, one line naming the setting and
    the fix; nothing is written."""
    from megazero.training.startup import preflight

    cases = {
        "--mock-data": (["--mock-data"], "data.prompts"),
        "--global-batch-size 6": (["--global-batch-size", "6"], "--global-batch-size 16"),
        "--max-new-tokens 48": (["--max-new-tokens", "48"], "--seq-length 112"),
        "--num-experts 4": (["--num-experts", "4"], "drop --num-experts"),
        "--label-smoothing 0.1": (["--label-smoothing", "0.1"], "drop --label-smoothing"),
        "--reward python:no_such_module_here:f": (["--reward", "python:no_such_module_here:f"], "PYTHONPATH"),
        "--max-new-tokens 40": (["--max-new-tokens", "40"], "--max-prompt-length 8"),
    }
    before = sorted(p.name for p in task["dir"].iterdir())
    for what, (extra, fix) in cases.items():
        try:
            code = preflight(task["argv"] + extra, 1)
        except SystemExit as e:
            code = e.code
        msg = capsys.readouterr().err.strip()
        assert code == 2 and what.split()[0] in msg and fix in msg and "\n" not in msg, (what, msg)
    assert sorted(p.name for p in task["dir"].iterdir()) == before
