"""Preference optimisation (``--post-train dpo``): three steps under every layout equal DPO
written from the papers in plain PyTorch, and the reference model is the one asked for.

Pairs are written by ``python -m data.preference`` from arithmetic records (chosen and rejected
of different lengths) with a small Hugging Face tokenizer. ``tests/support/preference.py``'s
``plain_post_training`` runs each loss on the reference GPT with ``torch.optim.Adam`` (constant
lr, no weight decay or clipping). One process runs each loss (DPO, IPO, SimPO, hinge; label
smoothing with the RPO term), the LLaMA block, and micro-batches of 1, 2 and 4 pairs; eight gloo
ranks run tp2-pp2-dp2 at ZeRO-1, cp2-tp2-dp2 with the LLaMA block, ZB-V, dp 8 at ZeRO-3, ZeRO-3
with sequence parallelism, cp 2 at ZeRO-2, interleaved pp 4, dp 4 at ZeRO-3 with the optimizer
on the host, and dp 2 with 3 accumulated micro-batches. Every step's loss, gradient norm and
reward metrics and the parameters after the last step equal the plain run's within 1e-6. A
reference model read from a checkpoint (``--ref-load``) gives step 1's loss of the reference GPT
run on both weight sets; a resumed run keeps comparing with the recorded reference, not the
policy it loaded; ``--finetune`` starts at iteration 0 from the loaded weights, which are also
the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.distributed import run_distributed
from tests.support.preference import assert_same_as_plain, plain_cache, train_runs, write_pairs

T, STEPS, PAIRS = 32, 3, 64
MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 16 --lr 2e-3 --seed 7 --eval-iters 0 --device cpu --split 1 "
    "--tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 8 --lr-warmup-iters 0 --adam-eps 1e-4 "
    "--lr-decay-style constant --weight-decay 0 --clip-grad 0"
).split()  # eps 1e-4: Adam's first steps move a weight whose gradient is rounding noise by a whole lr, not by noise
LLAMA = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention "
    "--num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights --ffn-hidden-size 64"
).split()
LOSSES = {
    "sigmoid": [],
    # IPO with Adam's eps 1e-3: its first step (lr 2e-3) takes the loss from 1 to 0.43, and at eps
    # 1e-4 weights with gradients near eps carry fp32 rounding noise of 1e-6 in one process already
    "ipo": ["--dpo-loss", "ipo", "--dpo-beta", "0.5", "--adam-eps", "1e-3"],
    "simpo": ["--dpo-loss", "simpo", "--dpo-beta", "2.0", "--simpo-gamma", "0.3"],
    "hinge": ["--dpo-loss", "hinge"],
    "cdpo-rpo": ["--dpo-label-smoothing", "0.1", "--dpo-sft-weight", "0.5"],
}


def records() -> list[dict]:
    out = []
    for i in range(PAIRS):
        a, b = i % 7, i % 3 + 1
        rec = {"prompt": f"# {a} + {b} =", "chosen": f" {a + b}", "rejected": f" {a * b + 5} or so"}
        if i % 4 == 0:  # a chat pair: shared messages, a chosen and a rejected final turn
            rec = {
                "messages": [{"role": "user", "content": f"{a} + {b}?"}],
                "chosen": {"role": "assistant", "content": f"{a + b}"},
                "rejected": {"role": "assistant", "content": f"{a - b} I think"},
            }
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def pref(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    tok, prefix = write_pairs(d, records())
    return dict(dir=d, argv=MODEL + ["--data-path", prefix, "--tokenizer-model", tok, "--post-train", "dpo"])


KEYS = ("loss", "grad_norm", "rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin")


SINGLE = dict(
    LOSSES, llama=LLAMA, **{"micro-batch 4": ["--micro-batch-size", "4"], "micro-batch 8": ["--micro-batch-size", "8"]}
)
LAYOUTS = {  # name: (layout flags, the model and loss flags its plain reference runs with)
    "tp2-pp2-dp2 zero-1": ("--tp 2 --pp 2 --dp 2 --zero-stage 1", []),
    "cp2-tp2-dp2 llama": ("--cp 2 --tp 2 --dp 2", LLAMA),
    "tp2-pp2-dp2 zb-v cdpo-rpo": ("--tp 2 --pp 2 --dp 2 --pipeline-schedule zb-v", LOSSES["cdpo-rpo"]),
    "dp8 zero-3 simpo": ("--dp 8 --zero-stage 3", LOSSES["simpo"]),
    "tp2-pp2-dp2 zero-3 sp ipo": ("--tp 2 --pp 2 --dp 2 --zero-stage 3 --sequence-parallel", LOSSES["ipo"]),
    "cp2-tp2-dp2 zero-2 hinge": ("--cp 2 --tp 2 --dp 2 --zero-stage 2", LOSSES["hinge"]),
    "interleaved pp4 vp2 dp2 zero-1 ref-offload": (
        "--pp 4 --virtual-pipeline-size 2 --dp 2 --zero-stage 1 --ref-offload",
        ["--num-layers", "8"],
    ),
    "dp4-tp2 zero-3 cpu offload simpo": ("--dp 4 --tp 2 --zero-stage 3 --offload-optimizer cpu", LOSSES["simpo"]),
    "dp2-tp4 accumulation 3": ("--dp 2 --tp 4 --gradient-accumulation-steps 3", ["--global-batch-size", "12"]),
}


@pytest.fixture(scope="module")
def runs(pref):
    """One process: each loss, the LLaMA block, micro-batches of 2 and 4 pairs; eight ranks:
    each layout, saved after its last step. Two spawns."""
    base, d = pref["argv"] + ["--train-iters", str(STEPS)], pref["dir"]
    single = [(base + extra, STEPS) for extra in SINGLE.values()]
    eight = [
        (base + model + flags.split() + ["--save", str(d / f"layout{i}")], STEPS)
        for i, (flags, model) in enumerate(LAYOUTS.values())
    ]
    one = run_distributed(train_runs, 1, single, params=True, timeout_s=600)[0]
    got = run_distributed(train_runs, 8, eight, timeout_s=600)[0]
    return dict(zip(SINGLE, one)), dict(zip(LAYOUTS, got))


@pytest.fixture(scope="module")
def plain(pref):
    """The plain PyTorch run of a model and loss (flags) -> its steps and final parameters."""
    return plain_cache(pref["argv"], STEPS)


def test_the_first_step_compares_the_policy_with_itself(runs):
    """Reference = the seeded initial policy: step 1's rewards are 0 and its loss is each loss's
    value at a zero margin (log 2; IPO 1/(2 beta)^2; hinge 1), and the losses then fall."""
    single, _ = runs
    at_zero = dict(sigmoid=math.log(2), ipo=(1 / (2 * 0.5)) ** 2, hinge=1.0, llama=math.log(2))
    for name, want in at_zero.items():
        first = single[name]["steps"][0]
        assert math.isclose(first["loss"], want, rel_tol=1e-9), (name, first)
        assert first["rewards_chosen"] == first["rewards_rejected"] == 0.0
    for name, run in single.items():
        losses = [s["loss"] for s in run["steps"]]
        assert losses[-1] < losses[0], (name, losses)


@pytest.mark.parametrize("name", list(SINGLE))
def test_one_process_equals_plain_pytorch(runs, plain, name):
    """Each loss and block, and micro-batches of 1, 2 and 4 pairs: 3 steps' losses, gradient
    norms and rewards and the parameters after equal the plain run within 1e-6."""
    single, _ = runs
    assert_same_as_plain(KEYS, single[name], plain([] if name.startswith("micro-batch") else SINGLE[name]), name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_plain_pytorch(pref, runs, plain, name):
    """Each layout (dp 2, 4 and 8; ZeRO 0-3, offload; tp, sp, cp, pp 1F1B, ZB-V and
    interleaved; accumulation 3): the same 3 steps and saved parameters within 1e-6."""
    from megazero.checkpoint import read_full_weights

    _, eight = runs
    got = dict(eight[name], params=read_full_weights(str(pref["dir"] / f"layout{list(LAYOUTS).index(name)}"))[1])
    assert_same_as_plain(KEYS, got, plain(LAYOUTS[name][1]), name)


def _sequence_logps(model, tokens, labels, mask):
    with torch.no_grad():
        logits = model(tokens)
        each = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (each.reshape(labels.shape).double() * mask.double()).sum(dim=1)


def test_a_checkpointed_reference_a_resume_and_finetune(pref):
    """--ref-load A (A: the policy after 2 steps): step 1's loss is the mean over the first global
    batch's pairs of -log sigmoid(beta ((pi_w - ref_w) - (pi_l - ref_l))), with both models as
    the reference GPT. Resuming A for step 3 gives the uninterrupted run's step 3 (the reference
    stays the recorded seeded one). --finetune from A starts at iteration 0 with A as policy and
    reference: loss log 2."""
    from data.sft import sft_micro_batches
    from megazero import training
    from megazero.checkpoint import read_full_weights
    from megazero.config import config_from_argv
    from model.build import build_gpt_config
    from model.spec import init_full_weights
    from tests.support.reference import ReferenceGPT

    base, d = pref["argv"], pref["dir"]
    a = str(d / "ckpt_a")
    runs = [
        (base + ["--train-iters", "3"], 3),  # uninterrupted
        (base + ["--train-iters", "3", "--save", a], 2),  # A: saved after step 2
        (base + ["--train-iters", "3", "--load", a], 1),  # resumed: step 3
        (base + ["--train-iters", "1", "--ref-load", a], 1),
        (base + ["--train-iters", "1", "--load", a, "--finetune"], 1),
    ]
    whole, _, resumed, ref_load, finetune = run_distributed(train_runs, 1, runs, timeout_s=600)[0]
    assert resumed["start"] == 2 and math.isclose(resumed["steps"][0]["loss"], whole["steps"][2]["loss"], rel_tol=1e-9)
    assert finetune["start"] == 0 and finetune["iteration"] == 0
    assert math.isclose(finetune["steps"][0]["loss"], math.log(2), rel_tol=1e-9)

    cfg = config_from_argv(base + ["--train-iters", "1"], 1)
    data = training.build_data(cfg)
    gcfg = build_gpt_config(cfg, data.vocab_size)
    policy = ReferenceGPT.from_full_weights(init_full_weights(gcfg, 7), data.vocab_size, 4)
    reference = ReferenceGPT.from_full_weights(read_full_weights(a)[1], data.vocab_size, 4)
    ((tokens, labels, mask),) = sft_micro_batches(data.train, 0, 16, 16, 0, 1)
    h = _sequence_logps(policy, tokens, labels, mask) - _sequence_logps(reference, tokens, labels, mask)
    want = float(-F.logsigmoid(0.1 * (h[0::2] - h[1::2])).mean())
    got = ref_load["steps"][0]["loss"]
    assert math.isclose(got, want, rel_tol=1e-5) and abs(want - math.log(2)) > 1e-3, (got, want)


def _reference_bytes(rank, world, argv):
    """One step of ``argv``: (its values, the reference's parameter bytes, the device bytes its
    storages hold after the step, the bytes its host copy holds)."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    cfg = config_from_argv(argv, world)
    trainer = build_trainer(cfg, data=training.prepare_run(cfg))
    values = trainer.train_step(trainer.next_batches()).values
    params = [p for c in trainer.post.chunks for p in c.parameters()]
    held = sum(p.untyped_storage().nbytes() for p in params)
    host = trainer.post.resident.nbytes if trainer.post.resident is not None else None
    out = values, sum(p.numel() * p.element_size() for p in params), held, host
    trainer.close()
    return out


def test_the_plan_counts_the_reference_and_ref_offload_keeps_it_on_the_host(pref):
    """The memory plan adds the reference model, Psi x 4 bytes (fp32) per rank, exactly the bytes
    of the reference the trainer builds; SimPO has none. With --ref-offload the reference's
    storages hold 0 bytes after a step, its host copy holds those bytes, the step is bit for bit
    the same, and a GPU's plan leaves the reference out (a CPU run's host is its planned memory)."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.planning.plan import plan_stages
    from model.build import build_gpt_config

    argv = pref["argv"] + ["--train-iters", "1"]
    (plain_run, offloaded) = [run_distributed(_reference_bytes, 1, a)[0] for a in (argv, argv + ["--ref-offload"])]
    assert plain_run[0] == offloaded[0]
    assert plain_run[2] == plain_run[1] > 0 and offloaded[2] == 0 and offloaded[3] == offloaded[1] == plain_run[1]

    def planned(extra, on_cuda=False):
        cfg = config_from_argv(argv + extra, 1)
        (stage,) = plan_stages(cfg, build_gpt_config(cfg, training.build_data(cfg).vocab_size), on_cuda=on_cuda)
        return stage

    stage = planned([])
    assert stage.reference_bytes == 4 * stage.params == plain_run[1]
    assert planned(["--ref-offload"]).reference_bytes == plain_run[1]
    assert planned(["--ref-offload"], on_cuda=True).reference_bytes == 0
    assert planned([], on_cuda=True).reference_bytes == plain_run[1]
    assert planned(LOSSES["simpo"]).reference_bytes == 0


def test_bad_post_training_settings_exit_2_with_one_line(pref, capsys):
    """Dropout, an odd micro-batch, --mock-data and --sft with dpo each end with exit 2 and one
    line naming the setting and the fix."""
    from megazero.config import config_from_argv

    base = pref["argv"] + ["--train-iters", "1"]
    cases = {
        "--hidden-dropout 0.1": (["--hidden-dropout", "0.1"], "--post-train-allow-dropout"),
        "--micro-batch-size 3": (["--micro-batch-size", "3", "--global-batch-size", "6"], "--micro-batch-size 4"),
        "--mock-data": (["--mock-data"], "data.preference"),
        "--sft": (["--sft"], "drop --sft"),
    }
    for what, (extra, fix) in cases.items():
        with pytest.raises(SystemExit) as e:
            config_from_argv(base + extra, 1)
        msg = capsys.readouterr().err.strip()
        assert e.value.code == 2 and what.split()[0] in msg and fix in msg and "\n" not in msg, (what, msg)
    cfg = config_from_argv(base + ["--hidden-dropout", "0.1", "--post-train-allow-dropout"], 1)
    assert cfg.model.hidden_dropout == 0.1


def test_a_reference_of_another_model_or_none_is_refused_before_start(pref, tmp_path):
    """--ref-load of a checkpoint with another hidden size, or of a folder without one: exit 2
    before any rank starts, one line naming --ref-load and the fix."""
    import subprocess
    import sys

    from tests.support.paths import REPO

    other = str(tmp_path / "other")
    argv = pref["argv"] + ["--train-iters", "1", "--save", other]
    run_distributed(train_runs, 1, [(argv[:] + ["--hidden-size", "16"], 1)], timeout_s=300)
    for ref, want in ((other, "the checkpoint has hidden_size = 16, this model 32"), (str(tmp_path), "no checkpoint")):
        res = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *pref["argv"], "--train-iters", "1", "--ref-load", ref,
             "--run-dir", str(tmp_path / "run")],
            capture_output=True, text=True, timeout=300, cwd=str(REPO),
        )  # fmt: skip
        lines = [x for x in res.stderr.splitlines() if x.startswith("megazero:")]
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert f"--ref-load {ref}" in lines[0] and want in lines[0], lines
