"""``--post-train grpo --reward rm:DIR``: the rollout's rewards are a reward model's scores.

A reward model is trained for two steps (``--post-train rm``) on preference pairs of the demo's
print tasks (chosen: the printed text, rejected: a wrong one) with the prompts' tokenizer; then
GRPO runs two iterations with ``--reward rm:DIR`` in one process and under tp2 x pp2 (four gloo
ranks; each rank holds a whole copy of the reward model at tp 2). Each row's score, and so the
logged ``rl_reward``, equals the reward model's score computed independently within 1e-6: the
plain reference GPT (``tests/support/reference.py``) with the checkpoint's weights, on the
sequence ``data.preference`` would write for the row (prompt + response + EOD), its value head
on the hidden state at the last position whose label is a response token (the EOD), as
``--post-train rm`` trains it. A missing checkpoint, a language model's checkpoint and a reward
model of another tokenizer are refused before start (exit 2, one line).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.preference import train_runs, write_pairs
from tests.support.rl import grpo_runs, write_prompts

MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 48 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 2e-3 --seed 7 --eval-iters 0 --device cpu --split 1 "
    "--tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 8 --lr-warmup-iters 0 "
    "--lr-decay-style constant --weight-decay 0 --clip-grad 0"
).split()
GRPO = "--grpo-prompts-per-step 4 --grpo-group-size 4 --max-new-tokens 8 --train-iters 8 --post-train grpo".split()
RM = "--post-train rm --train-iters 2".split()


def pair_records(count: int) -> list[dict]:
    """Preference pairs of print tasks: the printed text against a wrong one (``data.print_tasks``)."""
    from data.print_tasks import records, wrong

    rng = random.Random(1)
    return [
        {"prompt": r["prompt"], "chosen": " " + r["answer"], "rejected": " " + wrong(r["answer"], rng)}
        for r in records(count, seed=3)
    ]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The prompts, a reward model trained on pairs with their tokenizer (``rm``) and one trained
    with another tokenizer (``other/rm``), two steps each (one spawn)."""
    from data.preference import preprocess_preference

    d = tmp_path_factory.mktemp("grpo_rm")
    tok, prompts = write_prompts(d)
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pair_records(32)))
    preprocess_preference([str(d / "pairs.jsonl")], tok, str(d / "pref"), tokenizer_type="HuggingFaceTokenizer")
    (d / "other").mkdir()
    other_tok, other_pref = write_pairs(d / "other", pair_records(32))
    runs = [
        (MODEL + RM + ["--data-path", str(d / "pref"), "--tokenizer-model", tok, "--save", str(d / "rm")], 2),
        (MODEL + RM + ["--data-path", other_pref, "--tokenizer-model", other_tok, "--save", str(d / "other/rm")], 2),
    ]
    trained = run_distributed(train_runs, 1, runs, timeout_s=300)[0]
    assert all(len(r["steps"]) == 2 for r in trained)
    argv = MODEL + GRPO + ["--data-path", prompts, "--tokenizer-model", tok, "--reward", f"rm:{d / 'rm'}"]
    return dict(dir=d, argv=argv, rm=str(d / "rm"), other=str(d / "other/rm"))


@pytest.fixture(scope="module")
def runs(task):
    """Two GRPO iterations in one process (saved: a language model's checkpoint) and under tp2 x pp2."""
    one = run_distributed(grpo_runs, 1, [(task["argv"] + ["--save", str(task["dir"] / "lm")], [None] * 2)])[0][0]
    four = run_distributed(grpo_runs, 4, [(task["argv"] + ["--tp", "2", "--pp", "2"], [None] * 2)], timeout_s=300)
    return dict(one=one, tp2pp2=four)


def oracle_scores(rm: str, rollout: dict, eod: int) -> torch.Tensor:
    """``[N]`` float64: the reward model under ``rm`` (plain reference GPT, its saved weights) on
    each row laid out as ``data.preference`` lays out a pair's sequence, ``prompt + response +
    [EOD]`` (the response's own EOD, or one appended when ``--max-new-tokens`` cut it), the score
    at the last position whose label is a response token."""
    from megazero.checkpoint import read_full_weights
    from model.hf import config_from_record
    from tests.support.reference import ReferenceGPT, block_options

    meta, full = read_full_weights(rm)
    gcfg = config_from_record(meta["extra"]["gpt_config"], hidden_dropout=0.0, attention_dropout=0.0)
    full = dict(full)
    head = full.pop("value_head.weight")  # [1, H]
    model = ReferenceGPT.from_full_weights(
        full, vocab_size=gcfg.vocab_size, num_heads=gcfg.num_attention_heads, **block_options(gcfg)
    )
    G, out = rollout["group_size"], []
    for n in range(rollout["tokens"].shape[0]):
        response = rollout["tokens"][n][rollout["mask"][n]].tolist()
        if not response or response[-1] != eod:
            response.append(eod)
        prompt = list(rollout["prompts"][n // G])
        seq = torch.tensor(prompt + response)
        label_mask = torch.tensor([0] * len(prompt) + [1] * len(response))[1:]  # label t is token t + 1
        last = int(torch.nonzero(label_mask).max())
        with torch.no_grad():
            hidden = model(seq[None, :-1], return_hidden=True)[0, last]  # (H,)
        out.append(float(hidden.double() @ head[0].double()))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("layout", ["one", "tp2pp2"])
def test_rewards_are_the_reward_models_scores(task, runs, layout):
    """Every row's reward (on every rank) and each iteration's rl_reward equal the independently
    computed reward-model scores within 1e-6; the scores tell the rows apart."""
    from data.tokenizer import load_tokenizer

    eod = load_tokenizer(task["argv"][task["argv"].index("--tokenizer-model") + 1], "HuggingFaceTokenizer").eod
    per_rank = [runs[layout]] if layout == "one" else [r[0] for r in runs[layout]]
    ends = {bool(r["tokens"][n][r["mask"][n]][-1] == eod) for r in per_rank[0]["rollouts"] for n in range(16)}
    assert ends == {True, False}  # rows that end with an EOD and rows --max-new-tokens cut
    for got in per_rank:
        assert len(got["rollouts"]) == 2
        for step, rollout in zip(got["steps"], got["rollouts"]):
            want = oracle_scores(task["rm"], rollout, eod)
            got_scores = rollout["scores"].double()
            assert torch.allclose(got_scores, want, rtol=0, atol=1e-6), (layout, got_scores, want)
            assert abs(step["rl_reward"] - float(want.mean())) < 1e-6, (layout, step["rl_reward"], want.mean())
            assert float(want.max() - want.min()) > 1e-4, want
    if layout == "tp2pp2":  # the first rollout, sampled with the same weights, is the one process's
        assert torch.equal(runs["one"]["rollouts"][0]["tokens"], runs["tp2pp2"][0][0]["rollouts"][0]["tokens"])


def test_bad_reward_models_exit_2_with_one_line(task, runs, capsys):
    """Before any rank starts (the launcher's preflight): a directory without a checkpoint, a
    language model's checkpoint (no value head), a reward model trained with another tokenizer,
    ``rm:`` without a directory: exit 2, one line naming --reward rm: and the fix."""
    from megazero.training.startup import preflight

    base = [a for a in task["argv"] if not a.startswith("rm:")]
    base = base[: base.index("--reward")] + base[base.index("--reward") + 1 :]
    cases = {
        f"rm:{task['dir'] / 'nothing'}": "no checkpoint there",
        f"rm:{task['dir'] / 'lm'}": "no value head",
        f"rm:{task['other']}": "this run's --tokenizer-model",
        "rm:": "--reward rm:DIR",
    }
    for spec, fix in cases.items():
        code = preflight(base + ["--reward", spec], 1)
        msg = capsys.readouterr().err.strip()
        assert code == 2 and f"--reward {spec}" in msg and fix in msg and "\n" not in msg, (spec, msg)
