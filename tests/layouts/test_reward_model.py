"""Reward models (``--post-train rm``): the Bradley-Terry loss with Llama 2's margin and reward
centring under every layout equals one process's, step 1 equals an independent computation, the
scored token is each sequence's last response token, and the Hugging Face export scores alike.

Pairs are written by ``python -m data.preference`` from arithmetic records (some with a margin)
with a small Hugging Face tokenizer. One process runs the GPT-2 block and the LLaMA block; eight
gloo ranks run (tp, pp, dp) = (2, 2, 2), (cp, tp, dp) = (2, 2, 2) with the LLaMA block, and
(tp, pp, dp) = (2, 2, 2) at ZeRO-3 with sequence parallelism and the LLaMA block (its untied
output layer gets no gradient in rm), and zero-bubble ZB-V at (2, 2, 2); the loss, gradient
norm and rm metrics of every step agree.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.distributed import run_distributed
from tests.support.extras import require
from tests.support.preference import assert_same_as_plain, plain_cache, train_runs, write_pairs

STEPS, PAIRS = 3, 64
MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 16 --lr 2e-3 --seed 7 --eval-iters 0 --device cpu --split 1 "
    "--tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 8 --lr-warmup-iters 0 --adam-eps 1e-4 "
    "--post-train rm --rm-use-margin --rm-center-coef 0.05 --lr-decay-style constant --weight-decay 0 --clip-grad 0"
).split()  # eps 1e-4: Adam's first steps move a weight whose gradient is rounding noise by a whole lr, not by noise
LLAMA = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention "
    "--num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights --ffn-hidden-size 64"
).split()
KEYS = ("loss", "grad_norm", "rm_accuracy", "rm_chosen_score", "rm_rejected_score")


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
        if i % 3 == 0:
            rec["margin"] = 0.5 * (i % 5)
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def pref(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm")
    tok, prefix = write_pairs(d, records())
    return dict(dir=d, tok=tok, argv=MODEL + ["--data-path", prefix, "--tokenizer-model", tok])


SINGLE = {"gpt2": [], "llama": LLAMA}
LAYOUTS = {  # name: (layout flags, the model flags its plain reference runs with)
    "tp2-pp2-dp2 zero-1": ("--tp 2 --pp 2 --dp 2 --zero-stage 1", []),
    "cp2-tp2-dp2 zero-2 llama": ("--cp 2 --tp 2 --dp 2 --zero-stage 2", LLAMA),
    "tp2-pp2-dp2 zero-3 sp llama": ("--tp 2 --pp 2 --dp 2 --zero-stage 3 --sequence-parallel", LLAMA),
    "tp2-pp2-dp2 zb-v": ("--tp 2 --pp 2 --dp 2 --pipeline-schedule zb-v", []),
    "interleaved pp4 vp2 dp2": ("--pp 4 --virtual-pipeline-size 2 --dp 2", ["--num-layers", "8"]),
    "dp4-tp2 zero-3 cpu offload": ("--dp 4 --tp 2 --zero-stage 3 --offload-optimizer cpu", []),
    "dp2-tp4 accumulation 3": ("--dp 2 --tp 4 --gradient-accumulation-steps 3", ["--global-batch-size", "12"]),
}


@pytest.fixture(scope="module")
def runs(pref):
    """One process: GPT-2 and the LLaMA block for 3 steps, then each for 1 step saved for the
    export; eight ranks: each layout, saved after its last step. Two spawns."""
    base, d = pref["argv"], pref["dir"]
    n = ["--train-iters", str(STEPS)]
    single = [(base + extra + n, STEPS) for extra in SINGLE.values()]
    single += [(base + extra + ["--train-iters", "1", "--save", str(d / name)], 1) for name, extra in SINGLE.items()]
    eight = [
        (base + model + flags.split() + n + ["--save", str(d / f"layout{i}")], STEPS)
        for i, (flags, model) in enumerate(LAYOUTS.values())
    ]
    one = run_distributed(train_runs, 1, single, params=True, timeout_s=600)[0]
    return dict(zip(SINGLE, one)), dict(zip(LAYOUTS, run_distributed(train_runs, 8, eight, timeout_s=600)[0]))


@pytest.fixture(scope="module")
def plain(pref):
    """The plain PyTorch reward model of a model (flags) -> its steps and final parameters."""
    return plain_cache(pref["argv"], STEPS)


@pytest.mark.parametrize("name", list(SINGLE))
def test_one_process_equals_plain_pytorch(runs, plain, name):
    """GPT-2 and LLaMA blocks: 3 steps' losses, gradient norms and rm metrics and the parameters
    after (the head included) equal the Bradley-Terry model written in plain PyTorch within 1e-6;
    the loss falls."""
    single, _ = runs
    assert_same_as_plain(KEYS, single[name], plain(SINGLE[name]), name)
    losses = [s["loss"] for s in single[name]["steps"]]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_plain_pytorch(pref, runs, plain, name):
    """Each layout (ZeRO 0-3, offload; tp, sp, cp, pp 1F1B, ZB-V and interleaved; dp 2, 4;
    accumulation 3): the same 3 steps and saved parameters within 1e-6."""
    from megazero.checkpoint import read_full_weights

    _, eight = runs
    got = dict(eight[name], params=read_full_weights(str(pref["dir"] / f"layout{list(LAYOUTS).index(name)}"))[1])
    assert_same_as_plain(KEYS, got, plain(LAYOUTS[name][1]), name)


def _global_batch(pref, extra=()):
    """The first global batch: tokens, labels, loss mask [16, T] and the margins [8]."""
    from data.preference import split_margins
    from data.sft import sft_micro_batches
    from megazero import training
    from megazero.config import config_from_argv

    cfg = config_from_argv(pref["argv"] + list(extra) + ["--train-iters", "1"], 1)
    data = training.build_data(cfg)
    ((tokens, labels, mask),) = sft_micro_batches(data.train, 0, 16, 16, 0, 1)
    (margins,) = split_margins(data.train, 0, 16, 16, 0, 1)
    return cfg, data, tokens, labels, mask, margins


def _expected_first_step(pref, full, head, extra=()):
    """Step 1's loss, mean chosen and rejected scores and accuracy computed by the reference GPT
    with ``full`` (canonical tensors without the head) and ``head`` [1, H]: its final-norm hidden
    state at each sequence's last loss-mask-1 position times the head."""
    from model.build import build_gpt_config
    from tests.support.reference import ReferenceGPT, block_options

    cfg, data, tokens, _, mask, margins = _global_batch(pref, extra)
    gcfg = build_gpt_config(cfg, data.vocab_size)
    model = ReferenceGPT.from_full_weights(full, data.vocab_size, 4, **block_options(gcfg))
    with torch.no_grad():
        hidden = model(tokens, return_hidden=True).double()  # (16, T, H)
    last = torch.tensor([int(torch.nonzero(row).max()) for row in mask])  # (16,)
    scores = hidden[torch.arange(16), last] @ head.double().t()  # (16, 1)
    sw, sl = scores[0::2, 0], scores[1::2, 0]
    assert margins.abs().sum() > 0  # the margin term is exercised
    loss = float((-F.logsigmoid(sw - sl - margins.double()) + 0.05 * (sw + sl) ** 2).mean())
    return dict(
        loss=loss,
        rm_chosen_score=float(sw.mean()),
        rm_rejected_score=float(sl.mean()),
        rm_accuracy=float((sw > sl).double().mean()),
    )


def _agree(got: dict, want: dict) -> None:
    for k, w in want.items():
        assert math.isclose(got[k], w, rel_tol=1e-5, abs_tol=1e-7), (k, got[k], w)


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_the_first_step_equals_the_reference_gpt_with_the_head(pref, runs, block):
    """Step 1's scores are the reference GPT's final-norm hidden state at each sequence's last
    response position (the last loss-mask 1) times the head's initial weight; the loss is the mean
    of -log sigmoid(s_w - s_l - m) + 0.05 (s_w + s_l)^2 over the pairs."""
    from megazero import training
    from megazero.config import config_from_argv
    from model.build import build_gpt_config
    from model.spec import init_full_weights

    extra = LLAMA if block == "llama" else []
    cfg = config_from_argv(pref["argv"] + extra + ["--train-iters", "1"], 1)
    full = init_full_weights(build_gpt_config(cfg, training.build_data(cfg).vocab_size), 7)
    head = full.pop("value_head.weight")  # [1, H]
    _agree(runs[0][block]["steps"][0], _expected_first_step(pref, full, head, extra))


def test_a_reward_model_starts_from_a_language_model(pref, tmp_path):
    """--load LM --finetune (a DPO checkpoint: no value head) and --from-hf of LM's export: the
    body has LM's weights, the head its seeded initial value; step 1 equals the reference GPT on
    those weights."""
    from megazero import training
    from megazero.checkpoint import read_full_weights
    from megazero.config import config_from_argv
    from model.build import build_gpt_config
    from model.spec import init_full_weights
    from scripts.convert_checkpoint import main

    lm, hf = str(tmp_path / "lm"), str(tmp_path / "lm_hf")
    dpo = [a for a in pref["argv"] if a not in ("--rm-use-margin", "--rm-center-coef", "0.05")]
    dpo[dpo.index("rm")] = "dpo"
    run_distributed(train_runs, 1, [(dpo + ["--train-iters", "1", "--save", lm], 1)], timeout_s=300)
    assert main(["--load", lm, "--to-hf", hf]) == 0
    one = ["--train-iters", "1"]
    finetuned, from_hf = run_distributed(
        train_runs,
        1,
        [(pref["argv"] + one + ["--load", lm, "--finetune"], 1), (pref["argv"] + one + ["--from-hf", hf], 1)],
    )[0]
    cfg = config_from_argv(pref["argv"] + one, 1)
    head = init_full_weights(build_gpt_config(cfg, training.build_data(cfg).vocab_size), 7)["value_head.weight"]
    body = read_full_weights(lm)[1]
    assert "value_head.weight" not in body
    want = _expected_first_step(pref, body, head)
    _agree(finetuned["steps"][0], want)
    _agree(from_hf["steps"][0], want)


def _stage_scores(gcfg, full, tokens, mask, packing=None):
    """megazero's scores [B] of a whole-model stage in one process (the trainer's path:
    last_token_mask, then the sequence info of the loss mask; ``packing`` a
    ``megazero.context_parallel.sequence.Packing``, default none)."""
    from megazero.context_parallel.sequence import Packing, shard_micro_batch
    from megazero.post_training.reward import last_token_mask
    from megazero.process_groups import ProcessGroups
    from model.gpt import GPTStage

    stage = GPTStage(gcfg, ProcessGroups.single(), range(gcfg.num_layers), True, True, 7, full_weights=full).eval()
    tokens, labels, seq = shard_micro_batch(
        tokens, tokens, cp=1, cp_rank=0, packing=packing or Packing(), loss_mask=last_token_mask(mask)
    )
    with torch.no_grad():
        return stage(tokens, seq=seq)


def test_the_scored_token_is_the_last_response_token(pref):
    """A sequence scored alone equals the same sequence right-padded in a batch beside longer
    ones; an EOD inside the prompt and EOD padding with mask 0 leave the last mask-1 position."""
    from dataclasses import replace

    from data.tokenizer import load_tokenizer
    from megazero.post_training.reward import last_token_mask
    from model.build import build_gpt_config
    from model.spec import init_full_weights

    cfg, data, tokens, _, mask, _ = _global_batch(pref)
    gcfg = replace(build_gpt_config(cfg, data.vocab_size), hidden_dropout=0.0, attention_dropout=0.0)
    full = init_full_weights(gcfg, 7)
    eod = load_tokenizer(pref["tok"], "HuggingFaceTokenizer").eod

    m = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1.0], [0, 0, 0, 0, 0, 0.0]])
    want = torch.tensor([[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0, 0.0]])
    assert torch.equal(last_token_mask(m), want)

    n = int(torch.nonzero(mask[0]).max()) + 1  # row 0 up to its last response position
    alone = _stage_scores(gcfg, full, tokens[:1, :n], mask[:1, :n])
    padded = tokens.clone()
    padded[0, n:] = eod  # right padding with EOD, mask 0
    in_batch = _stage_scores(gcfg, full, padded, mask)
    assert torch.allclose(alone[0], in_batch[0], rtol=1e-5, atol=1e-6), (alone, in_batch[0])

    with_eod = tokens[:1].clone()
    with_eod[0, 1] = eod  # an EOD inside the prompt (mask 0 there)
    assert mask[0, 1] == 0
    got = _stage_scores(gcfg, full, with_eod, mask[:1])
    from tests.support.reference import ReferenceGPT, block_options

    ref_full = dict(full)
    head = ref_full.pop("value_head.weight")
    model = ReferenceGPT.from_full_weights(ref_full, data.vocab_size, 4, **block_options(gcfg))
    with torch.no_grad():
        hidden = model(with_eod, return_hidden=True)[0, n - 1]  # (H,)
    assert torch.allclose(got[0], hidden @ head[0], rtol=1e-5, atol=1e-6), (got, hidden @ head[0])


def test_left_padded_and_packed_rows_score_as_alone(pref):
    """With the packing flags (EOD ends a document; attention and positions reset at each), a
    sequence scores as alone (1e-6) when left-padded with EOD beside longer ones, and when packed
    with three others in one row (the head selects one token per row, so the packed row is
    scored once per sequence). Without the flags, left padding moves the score."""
    from dataclasses import replace

    from data.tokenizer import load_tokenizer
    from megazero.context_parallel.sequence import Packing
    from model.build import build_gpt_config
    from model.spec import init_full_weights

    cfg, data, tokens, _, mask, _ = _global_batch(pref)
    gcfg = build_gpt_config(cfg, data.vocab_size)  # 128 positions: room for the packed row
    gcfg = replace(gcfg, hidden_dropout=0.0, attention_dropout=0.0, seq_length=128, max_position_embeddings=128)
    full = init_full_weights(gcfg, 7)
    eod = load_tokenizer(pref["tok"], "HuggingFaceTokenizer").eod
    packing = Packing(eod=eod, reset_attention_mask=True, reset_position_ids=True)
    rows = range(4)
    n = [int(torch.nonzero(mask[r]).max()) + 1 for r in rows]  # up to the last response token
    assert len(set(n)) > 1 and all(eod not in tokens[r, : n[r]] for r in rows)
    alone = torch.cat([_stage_scores(gcfg, full, tokens[r : r + 1, : n[r]], mask[r : r + 1, : n[r]]) for r in rows])

    width = max(n)
    left = torch.full((4, width), eod, dtype=tokens.dtype)
    left_mask = torch.zeros(4, width)
    for r in rows:
        left[r, width - n[r] :], left_mask[r, width - n[r] :] = tokens[r, : n[r]], mask[r, : n[r]]
    got = _stage_scores(gcfg, full, left, left_mask, packing)
    assert torch.allclose(got, alone, rtol=0, atol=1e-6), (got, alone)
    unpacked = _stage_scores(gcfg, full, left, left_mask)
    shifted = [r for r in rows if n[r] < width]
    assert (unpacked[shifted] - alone[shifted]).abs().min() > 1e-4, (unpacked, alone)

    packed = torch.cat([torch.cat([tokens[r, : n[r]], tokens.new_tensor([eod])]) for r in rows])
    masks, start = [], 0
    for r in rows:  # copy r selects sequence r's last response token
        m = torch.zeros(len(packed))
        m[start : start + n[r]] = mask[r, : n[r]]
        masks.append(m)
        start += n[r] + 1
    got = _stage_scores(gcfg, full, packed.expand(4, -1).clone(), torch.stack(masks), packing)
    assert torch.allclose(got, alone, rtol=0, atol=1e-6), (got, alone)


def _checkpoint_scores(rank, world, load, sequences, lengths, pad):
    """``--reward rm:DIR``'s scores of ``sequences`` at tp ``world``."""
    from megazero.post_training.rewards import reward_model_scores
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training.inference import load_reward_model

    groups = ProcessGroups.build(Topology(tp=world, pp=1, dp=1)) if world > 1 else ProcessGroups.single()
    return reward_model_scores(load_reward_model(load, groups, torch.device("cpu")), sequences, lengths, pad)


def test_a_reward_model_checkpoint_scores_ragged_sequences_as_training_does(pref, runs, tmp_path):
    """The scorer of ``--reward rm:DIR`` (``load_reward_model``, ``reward_model_scores``): four
    sequences of different lengths in one batch score as the trainer's path scores each alone
    (1e-6), at tp 1 and tp 2; a language model's checkpoint is refused naming --reward rm:DIR."""
    from data.tokenizer import load_tokenizer
    from megazero.checkpoint import CheckpointError, read_full_weights
    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_reward_model
    from model.hf import config_from_record

    load = str(pref["dir"] / "gpt2")
    _, _, tokens, _, mask, _ = _global_batch(pref)
    n = [int(torch.nonzero(mask[r]).max()) + 1 for r in range(4)]
    sequences = [tokens[r, : n[r]].tolist() for r in range(4)]
    lengths = [int(mask[r, : n[r]].sum()) for r in range(4)]
    meta, full = read_full_weights(load)
    gcfg = config_from_record(meta["extra"]["gpt_config"], hidden_dropout=0.0, attention_dropout=0.0)
    alone = torch.cat([_stage_scores(gcfg, full, tokens[r : r + 1, : n[r]], mask[r : r + 1, : n[r]]) for r in range(4)])
    pad = load_tokenizer(pref["tok"], "HuggingFaceTokenizer").eod
    assert len(set(n)) > 1
    for world in (1, 2):
        got = run_distributed(_checkpoint_scores, world, load, sequences, lengths, pad)
        for scores in got:  # every tp rank
            assert torch.allclose(scores, alone, rtol=0, atol=1e-6), (world, scores, alone)

    dpo = [a for a in pref["argv"] if a not in ("--rm-use-margin", "--rm-center-coef", "0.05")]
    dpo[dpo.index("rm")] = "dpo"
    lm = str(tmp_path / "lm")
    run_distributed(train_runs, 1, [(dpo + ["--train-iters", "1", "--save", lm], 1)], timeout_s=300)
    with pytest.raises(CheckpointError, match="no value head") as e:
        load_reward_model(lm, ProcessGroups.single(), torch.device("cpu"))
    assert str(e.value).startswith(f"--reward rm:{lm}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "block,arch", [("gpt2", "GPT2ForSequenceClassification"), ("llama", "LlamaForSequenceClassification")]
)
def test_the_hugging_face_export_scores_alike(pref, runs, tmp_path, block, arch):
    """--to-hf of an rm checkpoint: a sequence-classification folder (score.weight [1, H],
    num_labels 1, pad_token_id = EOD) that transformers loads and whose score of right-padded
    sequences equals megazero's within 1e-5."""
    require("transformers")
    require("safetensors")
    from transformers import AutoModelForSequenceClassification

    from megazero.checkpoint import read_full_weights
    from model.hf import config_from_record
    from scripts.convert_checkpoint import main

    out = str(tmp_path / "hf")
    assert main(["--load", str(pref["dir"] / block), "--to-hf", out]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [arch] and config["num_labels"] == 1 and config["pad_token_id"] is not None
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert tuple(model.score.weight.shape) == (1, 32)

    meta, full = read_full_weights(str(pref["dir"] / block))
    gcfg = config_from_record(meta["extra"]["gpt_config"], hidden_dropout=0.0, attention_dropout=0.0)
    _, _, tokens, _, mask, _ = _global_batch(pref, LLAMA if block == "llama" else [])
    tokens, mask = tokens[:4], mask[:4]
    last = [int(torch.nonzero(row).max()) for row in mask]
    padded = tokens.clone()
    for r, t in enumerate(last):
        padded[r, t + 1 :] = config["pad_token_id"]  # HF scores the last token that is not padding
    want = _stage_scores(gcfg, full, tokens, mask)
    with torch.no_grad():
        got = model(input_ids=padded).logits[:, 0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got, want)


def test_bad_reward_model_settings_exit_2_with_one_line(pref, capsys):
    """An odd micro-batch, --mock-data and --eval-harness-tasks with rm each end with exit 2 and
    one line naming the setting and the fix."""
    from megazero.config import config_from_argv

    base = pref["argv"] + ["--train-iters", "1"]
    cases = {
        "--micro-batch-size 3": (["--micro-batch-size", "3", "--global-batch-size", "6"], "--micro-batch-size 4"),
        "--mock-data": (["--mock-data"], "data.preference"),
        "--eval-harness-tasks": (["--eval-harness-tasks", "arc_easy"], "drop --eval-harness-tasks"),
    }
    for what, (extra, fix) in cases.items():
        with pytest.raises(SystemExit) as e:
            config_from_argv(base + extra, 1)
        msg = capsys.readouterr().err.strip()
        assert e.value.code == 2 and what.split()[0] in msg and fix in msg and "\n" not in msg, (what, msg)
        assert "--post-train rm" in msg, msg
