"""scripts/evaluate.py and model/evaluation.py: megazero's lm-evaluation-harness adapter gives,
for a checkpoint saved under tp 2 and loaded at tp 1 and tp 2, the per-request log-likelihoods
(context/continuation and rolling) of the harness's own Hugging Face backend (HFLM) on the
``--to-hf`` export within 1e-5, the same greedy flags and generations, and the same task
accuracy, also for requests whose context or continuation fills the whole window, while a
continuation longer than the window is refused as HFLM refuses it; train.py
--eval-harness-tasks logs the same scores as evaluating the saved
checkpoint; an unknown task name is one line and exit code 2. Every Hugging Face family folder
read with ``--from-hf`` scores transformers' per-request log-likelihoods within 1e-5."""

import json
import os
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from model.evaluation import HarnessError
from tests.support.distributed import run_distributed
from tests.support.extras import require
from tests.support.hf_tokenizer import corpus
from tests.support.paths import REPO

TASKS = os.path.join(str(REPO), "data", "tasks", "megazero_stdlib")
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--make-vocab-size-divisible-by",
    "8",
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "1",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
    "--split",
    "1",
    "--seed",
    "11",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--train-iters",
    "4",
    "--tokenizer-type",
    "HuggingFaceTokenizer",
]
HARNESS = ["--eval-harness-tasks", "megazero_stdlib", "--eval-harness-interval", "2", "--eval-harness-limit", "6"]


def _rows(name, n):
    with open(os.path.join(TASKS, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f][:n]


def _requests():
    """The harness's Instances for 5 multiple-choice items (20 context/continuation requests,
    contexts past the 64-token window included), 2 rolling documents cut to 600 characters
    (several windows each), and 2 greedy generations."""
    from lm_eval.api.instance import Instance

    ll = [
        Instance("loglikelihood", d, (d["context"], c), i)
        for d in _rows("mc.jsonl", 5)
        for i, c in enumerate(d["choices"])
    ]
    ll.append(Instance("loglikelihood", {}, ("", "def f(x):\n    return x\n"), 0))  # empty context: the prefix
    rolling = [Instance("loglikelihood_rolling", d, (d["text"][:600],), 0) for d in _rows("ppl.jsonl", 2)]
    gen = [
        Instance("generate_until", {}, (t, {"until": ["\n\n"], "max_gen_toks": 12}), 0)
        for t in ("def add(a, b):\n", "for i in range(3):\n")
    ]
    return ll, rolling, gen


def _answers(lm):
    ll, rolling, gen = _requests()
    return lm.loglikelihood(ll), lm.loglikelihood_rolling(rolling), lm.generate_until(gen)


def _train(rank, world, argv):
    from megazero import training
    from megazero.config import config_from_argv, layout_topology
    from megazero.process_groups import ProcessGroups

    cfg = config_from_argv(argv, world)
    data = training.prepare_run(cfg)
    return training.train(cfg, ProcessGroups.build(layout_topology(cfg)), torch.device("cpu"), data)


def _ours(rank, world, ckpt, limit, answers=True):
    from types import SimpleNamespace

    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training.inference import load_model
    from model.evaluation import make_lm, run_tasks

    args = SimpleNamespace(load=ckpt, from_hf=None, tokenizer_model=None, tokenizer_type=None)
    stage, tok = load_model(args, ProcessGroups.build(Topology(tp=world, pp=1, dp=1)), torch.device("cpu"))
    lm = make_lm(stage, tok, batch_size=3)
    return _answers(lm) if answers else None, run_tasks(lm, ["megazero_stdlib"], limit=limit)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tp 2 run of 4 steps that scores megazero_stdlib (6 items) at steps 2 and 4 and saves,
    on a 300-token tokenizer; its checkpoint exported with convert_checkpoint.py --to-hf."""
    require("lm_eval")
    require("transformers")
    from data.preprocess import preprocess
    from data.tokenizer import train_hf_tokenizer
    from scripts.convert_checkpoint import main as convert

    d = tmp_path_factory.mktemp("eval")
    tok = train_hf_tokenizer(
        corpus(200) + [r["text"] for r in _rows("ppl.jsonl", 20)], 300, str(d / "tok" / "tokenizer.json")
    )
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(150)), encoding="utf-8")
    preprocess(str(src), ["text"], tok, str(d / "c"), progress=False, tokenizer_type="HuggingFaceTokenizer")
    argv = (
        MODEL
        + HARNESS
        + [
            "--data-path",
            str(d / "c_text_document"),
            "--tokenizer-model",
            tok,
            "--save",
            str(d / "ckpt"),
            "--run-dir",
            str(d / "run"),
            "--tp",
            "2",
        ]
    )
    run_distributed(_train, 2, argv)
    assert convert(["--load", str(d / "ckpt"), "--to-hf", str(d / "hf")]) == 0
    return dict(ckpt=str(d / "ckpt"), hf=str(d / "hf"), run=d / "run", argv=argv)


@pytest.mark.slow
def test_log_likelihoods_and_accuracy_equal_the_harness_hf_backend_at_tp1_and_tp2(run):
    require("accelerate")  # HFLM needs it
    from lm_eval.models.huggingface import HFLM

    from model.evaluation import run_tasks

    hf = HFLM(pretrained=run["hf"], device="cpu", batch_size=4, dtype="float32")
    theirs = _answers(hf), run_tasks(hf, ["megazero_stdlib"], limit=12)
    one = _ours(0, 1, run["ckpt"], 12)
    two = run_distributed(_ours, 2, run["ckpt"], 12)
    assert two[0] == two[1]  # every tp rank has the same answers
    (ll, rolling, gen), scores = theirs
    assert len(ll) == 21 and max(len(hf.tok_encode(r.args[0])) for r in _requests()[0]) > 64  # some are cut
    for (our_ll, our_rolling, our_gen), our_scores in (one, two[0]):
        torch.testing.assert_close(
            torch.tensor([v for v, _ in our_ll], dtype=torch.float64),
            torch.tensor([v for v, _ in ll], dtype=torch.float64),
            rtol=1e-5,
            atol=1e-5,
        )
        assert [g for _, g in our_ll] == [g for _, g in ll]
        torch.testing.assert_close(
            torch.tensor(our_rolling, dtype=torch.float64),
            torch.tensor(rolling, dtype=torch.float64),
            rtol=1e-5,
            atol=1e-5,
        )
        assert our_gen == gen and all(g for g in gen)
        for metric in ("acc", "acc_norm"):
            assert our_scores["megazero_stdlib"][metric] == scores["megazero_stdlib"][metric]
    assert min(rolling) < -100  # several 64-token windows per document


@pytest.mark.slow
def test_requests_past_the_window_match_the_harness_and_a_longer_continuation_is_refused_as_it_is(run):
    """Context cut from the left, continuations of up to the whole 64-token window scored whole:
    the harness's HFLM numbers and greedy flags, with only the continuation rows log-softmaxed. A
    continuation past the window: HFLM asserts, megazero names the window and the fix, before any
    forward."""
    require("accelerate")
    from lm_eval.models.huggingface import HFLM

    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_model
    from model.evaluation import make_lm

    hf = HFLM(pretrained=run["hf"], device="cpu", batch_size=4, dtype="float32")
    args = SimpleNamespace(load=run["ckpt"], from_hf=None, tokenizer_model=None, tokenizer_type=None)
    stage, tok = load_model(args, ProcessGroups.single(), torch.device("cpu"))
    lm = make_lm(stage, tok, batch_size=3)
    doc = tok.encode(" ".join(r["text"] for r in _rows("ppl.jsonl", 3)))
    assert lm.max_length == hf.max_length == 64 and len(doc) > 420
    cuts = [(200, 64), (1, 64), (300, 40), (10, 63), (65, 1), (330, 64), (5, 58)]
    pairs = [(doc[:c], doc[c : c + n]) for c, n in cuts]
    theirs = hf._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in pairs])
    seen, log_softmax = [], torch.nn.functional.log_softmax
    with mock.patch.object(
        torch.nn.functional, "log_softmax", lambda x, dim: seen.append(x.shape) or log_softmax(x, dim)
    ):
        ours = lm.score_tokens(pairs)
    # only the continuation rows are log-softmaxed (n x V fp32, not B x T x V)
    assert [len(s) for s in seen] == [2] * 3 and sum(s[0] for s in seen) == sum(n for _, n in cuts), seen
    torch.testing.assert_close(
        torch.tensor([v for v, _ in ours], dtype=torch.float64),
        torch.tensor([v for v, _ in theirs], dtype=torch.float64),
        rtol=1e-5,
        atol=1e-5,
    )
    assert [g for _, g in ours] == [g for _, g in theirs] and min(v for v, _ in ours) < -50
    long = (doc[:330], doc[330:403])  # 73 continuation tokens, 64 positions
    with pytest.raises(AssertionError):
        hf._loglikelihood_tokens([(None, *long)])
    with pytest.raises(HarnessError) as e:
        lm.score_tokens(pairs[:2] + [long])
    assert str(e.value) == (
        "request 2: its continuation is 73 tokens (after 330 context tokens), longer than the model's "
        "64-token window; only the context is cut to fit, and lm-evaluation-harness's Hugging Face "
        "backend refuses such a request too (it scores a continuation whole or not at all); fix: a task "
        "whose continuations fit in 64 tokens, or a model with more positions (--max-position-embeddings)"
    )


@pytest.mark.slow
def test_training_logs_the_scores_of_the_saved_checkpoint(run):
    records = [json.loads(line) for line in (run["run"] / "metrics.jsonl").read_text().splitlines()]
    harness = [r for r in records if r["kind"] == "harness"]
    assert [r["iteration"] for r in harness] == [2, 4]
    _, scores = _ours(0, 1, run["ckpt"], 6, answers=False)  # the checkpoint of step 4, at tp 1
    assert harness[-1]["scores"]["megazero_stdlib"] == pytest.approx(scores["megazero_stdlib"], abs=1e-12)
    assert 0 <= scores["megazero_stdlib"]["acc"] <= 1 and "acc_norm_stderr" in scores["megazero_stdlib"]


@pytest.mark.slow
def test_cli_prints_one_line_per_task_and_refuses_an_unknown_task(run, capsys):
    from scripts.evaluate import main

    assert (
        main(
            ["--load", run["ckpt"], "--tasks", "megazero_stdlib,megazero_stdlib_ppl", "--limit", "2", "--device", "cpu"]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["megazero_stdlib", "megazero_stdlib_ppl"]
    assert "acc " in lines[0] and "bits_per_byte " in lines[1]
    assert main(["--load", run["ckpt"], "--tasks", "megazero_stdlib,hellaswag_typo", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evaluate: error: --tasks: unknown task 'hellaswag_typo'")


@pytest.mark.slow
def test_family_folders_log_likelihoods_equal_transformers(folders, capsys):
    """Each family folder of tests/support/hf_families.py (Llama-3.x, Mistral, Qwen2, Qwen3,
    Qwen3-MoE, gpt-oss, DeepSeek-V3) read with ``--from-hf``: megazero's per-request log-likelihoods and greedy
    flags (``MegazeroLM.loglikelihood``) are transformers' (the sum of the log-softmax of the
    continuation's tokens after the last 256 + 1 tokens, the last dropped) within 1e-5, contexts past
    the 256-position window included; ``scripts/evaluate.py --from-hf`` scores the gpt-oss and Qwen3
    folders. One process."""
    require("lm_eval")
    from lm_eval.api.instance import Instance

    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_model
    from model.evaluation import make_lm
    from scripts.evaluate import main
    from tests.support.generate import generate_args

    rows = _rows("mc.jsonl", 4)
    requests = [Instance("loglikelihood", d, (d["context"], c), i) for d in rows for i, c in enumerate(d["choices"])]
    requests.append(Instance("loglikelihood", {}, (" ".join(d["context"] for d in rows), rows[0]["choices"][0]), 0))
    for family, (folder, hf, _) in folders.items():
        stage, tok = load_model(generate_args(folder), ProcessGroups.single(), torch.device("cpu"))
        lm = make_lm(stage, tok, batch_size=5)
        ours = lm.loglikelihood(requests)
        theirs, cut = [], 0
        for r in requests:
            ctx, cont = lm.encode_pair(*r.args)
            ids = (ctx + cont)[-257:][:-1]
            cut += len(ctx) + len(cont) > 257
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -len(cont) :].double(), -1)  # (n, V)
            theirs.append(
                (logp[range(len(cont)), cont].sum().item(), bool((logp.argmax(-1) == torch.tensor(cont)).all()))
            )
        assert cut >= 1, family  # the window cut at least one context
        torch.testing.assert_close(
            torch.tensor([v for v, _ in ours], dtype=torch.float64),
            torch.tensor([v for v, _ in theirs], dtype=torch.float64),
            rtol=1e-5,
            atol=1e-5,
        )
        assert [g for _, g in ours] == [g for _, g in theirs], family
    for family in ("gpt-oss", "qwen3"):
        argv = ["--from-hf", folders[family][0], "--tasks", "megazero_stdlib", "--limit", "2", "--device", "cpu"]
        assert main(argv) == 0
        assert capsys.readouterr().out.startswith("megazero_stdlib: acc "), family


def test_train_refuses_an_unknown_harness_task_before_start(tmp_path, capsys):
    require("lm_eval")
    from megazero import training

    argv = [
        "--mock-data",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "8",
        "--device",
        "cpu",
        "--eval-harness-tasks",
        "megazero_stdlib,nope",
    ]
    assert training.preflight(argv, 1) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "error" in line] == err[-1:]
    assert err[-1].startswith("megazero: config error: --eval-harness-tasks needs a tokenizer")
    from megazero.config import config_from_argv

    cfg = config_from_argv(argv, 1, print_warnings=False)
    cfg.train.mock_data = False  # as with --data-path: the task names next
    with pytest.raises(HarnessError, match=r"^--eval-harness-tasks: unknown task 'nope'"):
        training.check_harness(cfg)


def test_rolling_windows_predict_every_token_once_with_the_fullest_context():
    from model.evaluation import rolling_windows

    assert rolling_windows(list(range(10)), -1, 4) == [([-1], [0, 1, 2, 3]), ([3], [4, 5, 6, 7]), ([5, 6, 7], [8, 9])]
    assert rolling_windows([7, 8], -1, 4) == [([-1], [7, 8])] and rolling_windows([], -1, 4) == []
    for n, L in ((1, 1), (9, 3), (50, 7)):
        ws = rolling_windows(list(range(n)), -1, L)
        assert [t for _, c in ws for t in c] == list(range(n))  # each token once, in order
        assert all(len(x) + len(c) - 1 <= L for x, c in ws)  # the scored input fits
        assert all(len(x) + len(c) - 1 == L for x, c in ws[1:])  # and later windows are full


def test_a_missing_lm_eval_is_one_line_naming_the_extra(monkeypatch, capsys):
    import model.evaluation as ev
    from scripts.evaluate import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)
    monkeypatch.setattr(ev, "_CLASS", None)
    assert main(["--from-hf", "/nonexistent", "--tasks", "megazero_stdlib"]) == 2
    assert capsys.readouterr().err.strip() == (
        "evaluate: error: scripts/evaluate.py needs the optional extra eval "
        "(lm_eval is not installed); fix: pip install -e .[eval]"
    )
