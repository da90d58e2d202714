"""Supervised fine-tuning data (data/sft.py, ``--sft``): the loss on response tokens only.

Records in both forms (prompt/response and chat messages) are preprocessed with a small
Hugging Face tokenizer; the tokens in the loss are counted again from the raw JSON; the
first loss equals an independent masked cross-entropy of ``tests/support/reference.py``'s GPT;
(tp, pp, dp) = (2, 2, 2) and (cp, tp, dp) = (2, 2, 2) give the single process's losses,
packed and padded; a tiny Llama built by transformers fine-tunes from ``--from-hf`` with its
response loss falling; bad records exit 2 with one line naming file, line and field.
"""

import gzip
import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.extras import require
from tests.support.hf_tokenizer import corpus
from tests.support.paths import REPO

REPO = str(REPO)
T, STEPS = 64, 3


def records(n: int) -> list[dict]:
    """``n`` short records, alternately prompt/response and a chat (system, user, assistant,
    user, assistant), every one shorter than T + 1 tokens."""
    out = []
    for i in range(n):
        a, b = i % 7, i % 3 + 1
        if i % 2:
            out.append({"prompt": f"# {a} + {b}\n", "response": f"print({a + b})\n"})
        else:
            out.append(
                {
                    "messages": [
                        {"role": "system", "content": "short"},
                        {"role": "user", "content": f"{a}*{b}?"},
                        {"role": "assistant", "content": f"{a * b}"},
                        {"role": "user", "content": "ok"},
                        {"role": "assistant", "content": "yes"},
                    ]
                }
            )
    return out


def response_tokens(record: dict, tok) -> int:
    """Tokens in the loss, from the raw record: the response (or each assistant turn's content)
    and the closing EOD when the record ends with the response."""
    if "messages" in record:
        turns = record["messages"]
        return sum(len(tok.encode(t["content"])) for t in turns if t["role"] == "assistant") + (
            turns[-1]["role"] == "assistant"
        )
    return len(tok.encode(record["response"])) + 1


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """The tokenizer, the records, the JSONL file and its preprocessed prefix."""
    require("tokenizers")
    from data.sft import preprocess_sft
    from data.tokenizer import load_tokenizer, train_hf_tokenizer

    d = tmp_path_factory.mktemp("sft")
    tok_path = train_hf_tokenizer(corpus(200), 320, str(d / "tokenizer.json"))
    recs = records(64)
    jsonl = d / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    prefix = str(d / "sft")
    preprocess_sft([str(jsonl)], tok_path, prefix, tokenizer_type="HuggingFaceTokenizer")
    return dict(
        tok=load_tokenizer(tok_path, "HuggingFaceTokenizer"),
        tok_path=tok_path,
        records=recs,
        jsonl=str(jsonl),
        prefix=prefix,
        dir=d,
    )


def _sha(prefix):
    return [
        hashlib.sha256(open(prefix + ext, "rb").read()).hexdigest()
        for ext in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx")
    ]


def test_the_stored_mask_is_the_response_tokens_and_inputs_agree(sft):
    """Per record: mask ones = the response tokens counted from the raw JSON, and the masked
    tokens decode to the response; .jsonl.gz and a parquet file give byte-identical pairs."""
    from data.indexed_dataset import IndexedDataset
    from data.sft import loss_mask_prefix, preprocess_sft

    tok, recs = sft["tok"], sft["records"]
    tokens, masks = IndexedDataset(sft["prefix"]), IndexedDataset(loss_mask_prefix(sft["prefix"]))
    assert tokens.num_documents == masks.num_documents == len(recs)
    for i, r in enumerate(recs):
        ids, mask = tokens[i], masks[i]
        assert int(mask.sum()) == response_tokens(r, tok) and len(ids) <= T + 1 and ids[-1] == tok.eod
        if "response" in r:
            assert tok.decode(ids[mask > 0].tolist()) == r["response"]
            assert tok.decode(ids[mask == 0].tolist()) == r["prompt"]
    d = sft["dir"]
    with gzip.open(d / "train.jsonl.gz", "wt") as f:
        f.write(open(sft["jsonl"]).read())
    inputs = {"gz": [str(d / "train.jsonl.gz")]}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pa = None
    if pa is not None:  # records 0..29 as parquet rows (null fields of the other form), the rest JSONL
        rows = [{k: r.get(k) for k in ("prompt", "response", "messages")} for r in recs[:30]]
        pq.write_table(pa.Table.from_pylist(rows), d / "a.parquet")
        (d / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[30:]))
        inputs["parquet"] = [str(d / "a.parquet"), str(d / "b.jsonl")]
    for name, paths in inputs.items():
        preprocess_sft(paths, sft["tok_path"], str(d / name), tokenizer_type="HuggingFaceTokenizer")
        assert _sha(str(d / name)) == _sha(sft["prefix"]), name
    assert pa is not None or os.environ.get("CI") != "true"


# -- training: counted tokens, the first loss, layouts, --from-hf --------------------------------
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    str(T),
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "30",
    "--lr",
    "3e-3",
    "--seed",
    "7",
    "--make-vocab-size-divisible-by",
    "8",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
    "--split",
    "1",
    "--tokenizer-type",
    "HuggingFaceTokenizer",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
RESETS = ["--reset-attention-mask", "--reset-position-ids"]
LLAMA = [
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--ffn-hidden-size",
    "64",
    "--max-position-embeddings",
    "128",
]


def _argv(sft, packing, *extra):
    return (
        MODEL
        + ["--sft", "--sft-packing", packing, "--data-path", sft["prefix"], "--tokenizer-model", sft["tok_path"]]
        + (RESETS if packing == "pack" else [])
        + list(extra)
    )


def _train_sft(rank, world, runs):
    """For each (argv, steps): the losses, the targets each step's loss divides by (all dp
    ranks), and the records of each step's global batch."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    out = []
    for argv, steps in runs:
        cfg = config_from_argv(argv, world)
        trainer = build_trainer(cfg, data=training.prepare_run(cfg))  # eod: the tokenizer's
        run, groups = trainer.data, trainer.groups
        gbs, got = cfg.train.global_batch_size, dict(losses=[], counted=[], records=[])
        for _ in range(steps):
            done = trainer.state.consumed_samples
            batches = training.dp_micro_batches(run.train, done, cfg, groups, "cpu")
            got["counted"].append(float(trainer.local_batches(batches)[2]))
            got["records"].append([int(r) for i in range(done, done + gbs) for r in run.train.records(i)])
            got["losses"].append(trainer.train_step(batches).values["loss"])
        trainer.close()
        out.append(got)
    return out


@pytest.fixture(scope="module")
def hf_llama(sft):
    """A tiny LlamaForCausalLM (random, seeded) saved by transformers with the tokenizer."""
    require("transformers")
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    d = sft["dir"] / "hf"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(str(d), safe_serialization=True)
    shutil.copy(sft["tok_path"], d / "tokenizer.json")
    return str(d)


@pytest.fixture(scope="module")
def runs(sft, hf_llama):
    """Single process: pack, pad and the --from-hf fine-tuning; 8 ranks: pack and pad under
    (tp, pp, dp) = (2, 2, 2), pack under (cp, tp, dp) = (2, 2, 2). Two spawns."""
    single = [
        (_argv(sft, "pack"), STEPS),
        (_argv(sft, "pad"), STEPS),
        (_argv(sft, "pack", *LLAMA, "--from-hf", hf_llama, "--lr", "1e-2", "--lr-warmup-iters", "3"), 30),
    ]
    eight = [
        (_argv(sft, "pack", "--tp", "2", "--pp", "2", "--dp", "2"), STEPS),
        (_argv(sft, "pad", "--tp", "2", "--pp", "2", "--dp", "2"), STEPS),
        (_argv(sft, "pack", "--cp", "2", "--tp", "2", "--dp", "2"), STEPS),
    ]
    return (
        run_distributed(_train_sft, 1, single, timeout_s=600)[0],
        run_distributed(_train_sft, 8, eight, timeout_s=600)[0],
    )


def test_the_loss_counts_exactly_the_response_tokens(sft, runs):
    """Each step divides by the response tokens of its global batch's records, counted from the
    raw JSON (every record fits a sample: nothing is truncated); packing puts several records
    in a sample, padding one."""
    single, eight = runs
    for run, per_sample in ((single[0], None), (single[1], 1), (eight[0], None)):
        for counted, recs in zip(run["counted"], run["records"]):
            assert counted == sum(response_tokens(sft["records"][r], sft["tok"]) for r in recs) > 0
            assert len(recs) == 8 if per_sample == 1 else len(recs) > 8
    assert single[0]["records"] == eight[0]["records"]


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_first_loss_is_the_reference_masked_cross_entropy(sft, runs, packing):
    """Step 1's loss = the reference GPT's cross-entropy summed over the response labels of the
    first global batch (documents masked and positions restarted when packed) over their
    count; it differs from the mean over every label."""
    import torch.nn.functional as F

    from data.sft import sft_micro_batches
    from megazero import training
    from megazero.config import config_from_argv
    from model.build import build_gpt_config
    from model.gpt import init_full_weights
    from tests.support.reference import ReferenceGPT

    cfg = config_from_argv(_argv(sft, packing), 1)
    run = training.build_data(cfg)
    ((tokens, labels, mask),) = sft_micro_batches(run.train, 0, 8, 8, 0, 1)
    model = ReferenceGPT.from_full_weights(
        init_full_weights(build_gpt_config(cfg, run.vocab_size), 7), run.vocab_size, 4
    )
    flags = dict(reset_attention_mask=True, reset_position_ids=True) if packing == "pack" else {}
    with torch.no_grad():
        logits = model(tokens, run.tokenizer.eod, **flags)
        each = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    want = float((each * mask.reshape(-1)).sum() / mask.sum())
    got = runs[0][0 if packing == "pack" else 1]["losses"][0]
    assert math.isclose(got, want, rel_tol=1e-5) and not math.isclose(got, float(each.mean()), rel_tol=1e-3)


@pytest.mark.parametrize("index,layout", [(0, "tp2-pp2-dp2 pack"), (1, "tp2-pp2-dp2 pad"), (2, "cp2-tp2-dp2 pack")])
def test_layouts_give_the_single_process_losses(runs, index, layout):
    single, eight = runs
    want = single[0 if index != 1 else 1]["losses"]
    for step, (got, w) in enumerate(zip(eight[index]["losses"], want)):
        assert math.isclose(got, w, rel_tol=1e-5), (layout, step, got, w)


def test_from_hf_fine_tuning_lowers_the_response_loss(runs):
    """30 steps of a tiny transformers Llama (--from-hf) on the packed records: the response
    loss of the last 5 steps is below 60 % of that of the first 5."""
    losses = runs[0][2]["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, losses


def test_packing_keeps_records_whole_and_a_longer_run_the_same_samples():
    """next-fit: every sample within capacity, each record once per epoch, a record that does
    not fit starts the next sample; the first samples do not depend on the count asked for."""
    import numpy as np

    from data.sft import build_sft_index, next_fit

    assert next_fit(np.array([3, 4, 2, 6, 1, 9]), 7).tolist() == [0, 0, 1, 2, 2, 3]
    lengths = np.random.default_rng(0).integers(1, 30, 200)
    for packing in ("pack", "pad"):
        records, starts = build_sft_index(lengths, 32, 400, 5, packing)
        fill = [int(np.minimum(lengths, 32)[records[a:b]].sum()) for a, b in zip(starts[:-1], starts[1:])]
        assert max(fill) <= 32 and (packing == "pack" or starts.tolist() == list(range(401)))
        clipped = np.minimum(lengths, 32)
        for i in range(len(fill) - 1):  # the next record did not fit (unless a new epoch began)
            nxt = starts[i + 1]
            assert packing == "pad" or nxt % 200 == 0 or fill[i] + clipped[records[nxt]] > 32
        assert sorted(records[:200].tolist()) == list(range(200))  # epoch 0: each record once
        shorter = build_sft_index(lengths, 32, 150, 5, packing)
        assert np.array_equal(shorter[1], starts[:151]) and np.array_equal(shorter[0], records[: starts[150]])


# -- bad input ----------------------------------------------------------------------------------
def _sft_cli(sft, tmp_path, lines):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "data.sft",
            "--input",
            str(bad),
            "--tokenizer-model",
            sft["tok_path"],
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--output-prefix",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p, bad, sorted(os.listdir(tmp_path))


@pytest.mark.parametrize("case", ["role", "field"])
def test_bad_records_exit_2_with_one_line_and_leave_nothing(sft, tmp_path, case):
    good = records(2)
    if case == "role":
        lines = good + [{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]}]
        want = ["bad.jsonl:3:", "turn 1", "unknown role 'tool'", "system, user, assistant"]
    else:
        lines = [good[1], {"prompt": "x"}] + good
        want = ["bad.jsonl:2:", "missing field 'response'", "--sft-response-key"]
    p, bad, left = _sft_cli(sft, tmp_path, lines)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert all(w in p.stderr for w in want), p.stderr
    assert left == ["bad.jsonl"]


def test_record_errors_name_the_field_and_sft_needs_real_data(sft, capsys):
    from data.indexed_dataset import DataError
    from data.sft import SFTKeys, record_pieces
    from megazero import training
    from megazero.config import config_from_argv

    keys = SFTKeys("question", "answer", "turns")
    assert record_pieces({"question": "q", "answer": "a"}, "f:1", keys) == [("q", False), ("a", True)]
    for obj, want in (
        ({"question": "q"}, "f:1: missing field 'answer' (--sft-response-key)"),
        ({"turns": [{"role": "user", "content": "hi"}]}, "f:1: no assistant turn"),
        ({"turns": [{"role": "user"}]}, "f:1: turn 0 of 'turns' needs fields 'role' and 'content'"),
        ({"question": 3, "answer": "a"}, "f:1: field 'question' is int, not a string"),
        ([1], "f:1: a record must be a JSON object"),
    ):
        with pytest.raises(DataError) as e:
            record_pieces(obj, "f:1", keys)
        assert str(e.value).startswith(want), str(e.value)
    with pytest.raises(SystemExit) as e:
        config_from_argv(["--mock-data", "--sft"], 1)
    assert e.value.code == 2 and "--sft has no effect with --mock-data" in capsys.readouterr().err
    plain = str(sft["dir"] / "plain")  # a token pair without its loss-mask pair
    for ext in (".bin", ".idx"):
        if not os.path.exists(plain + ext):
            os.link(sft["prefix"] + ext, plain + ext)
    argv = [plain if a == sft["prefix"] else a for a in _argv(sft, "pad")]
    with pytest.raises(DataError, match="plain_loss_mask.bin/.idx not found .*python -m data.sft"):
        training.build_data(config_from_argv(argv, 1))


def _empty_steps(rank, world, argv):
    """Two trainers from one seed: A takes [empty, S, E_r, S], B takes [S, E_r, S] where every
    rank's micro-batches of the empty step have an all-zero loss mask and E_r is empty on dp
    rank 0 only (the whole global batch at dp 1). Returns what the test compares (every rank)."""
    from megazero.training import build_trainer

    a, b = build_trainer(argv), build_trainer(argv)
    rank_dp = a.groups.dp_rank
    real = a.next_batches()
    full = [(t, l, torch.ones_like(t)) for t, l in real]
    empty = [(t, l, torch.zeros_like(t)) for t, l in real]
    half = empty if rank_dp == 0 else full  # one dp rank empty: the global batch still counts

    def params(tr):
        tr.optimizer.wait_param_gather()  # the overlapped all-gather of the last update
        return [p.detach().clone() for c in tr.chunks for p in c.parameters()]

    before = params(a)
    first = a.train_step(empty)
    after_empty = params(a)
    a_rest = [a.train_step(x) for x in (full, half, full)]
    b_all = [b.train_step(x) for x in (full, half, full)]
    out = dict(
        empty=getattr(first, "empty", False),
        bad=first.bad_step,
        values=first.values,
        unchanged=all(torch.equal(x, y) for x, y in zip(before, after_empty)),
        a_losses=[o.values["loss"] for o in a_rest],
        b_losses=[o.values["loss"] for o in b_all],
        a_skipped=a_rest[-1].values["skipped_iterations"],
        half_empty=a_rest[1].empty,
        dp=a.groups.dp_size,
        same=all(torch.equal(x, y) for x, y in zip(params(a), params(b))),
    )
    a.close(), b.close()
    return out


@pytest.mark.parametrize("layout", [["--dp", "2", "--zero-stage", "2"], ["--pp", "2", "--zero-stage", "1"]])
def test_a_global_batch_without_a_loss_token_skips_the_optimizer_step(layout):
    """A step whose global batch has no loss token (every mask zero on every dp rank) takes no
    optimizer step: the weights are bitwise unchanged, the step counts as skipped, it is not a
    bad step, and every later step equals a run that never saw it (so Adam's moments, step count
    and weight decay did not move either). A batch empty on one dp rank only still trains.
    Under ZeRO-2 at dp 2 and at pp 2."""
    from tests.support.layouts import BASE

    # the same lr at every iteration: A's steps 2-4 meet B's 1-3
    argv = BASE + ["--lr-decay-style", "constant", "--lr-warmup-iters", "0", *layout]
    for got in run_distributed(_empty_steps, 2, argv):
        assert got["empty"] and not got["bad"] and got["unchanged"], got
        assert got["values"]["loss"] is None and got["values"]["skipped_iterations"] == 1
        # with dp 1 (pp 2) "empty on dp rank 0" is the whole global batch
        assert got["half_empty"] == (got["dp"] == 1) and got["a_skipped"] == 1 + got["half_empty"]
        assert got["a_losses"] == got["b_losses"] and got["same"], got


@pytest.fixture(scope="module")
def prompts_fill_the_sequence(sft):
    """SFT data whose every prompt is longer than the sequence: no response token survives."""
    from data.sft import preprocess_sft

    d = sft["dir"]
    long = " ".join(f"word{i}" for i in range(3 * T))
    jsonl = d / "long.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": long, "response": "ok"}) + "\n" for _ in range(16)))
    prefix = str(d / "long")
    preprocess_sft([str(jsonl)], sft["tok_path"], prefix, tokenizer_type="HuggingFaceTokenizer")
    return prefix


def test_a_run_whose_every_step_is_empty_exits_2_naming_the_data(sft, prompts_fill_the_sequence, tmp_path):
    """SFT prompts that fill --seq-length: every step is skipped with a warning naming it and its
    samples, and the run ends with exit 2 and one error line naming --data-path (no training on
    nothing, no 'unigram baseline: nan')."""
    prefix = prompts_fill_the_sequence
    argv = _argv(sft, "pad") + ["--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt")]
    argv[argv.index(sft["prefix"])] = prefix
    argv[argv.index("--train-iters") + 1] = "3"
    out = subprocess.run([sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    warnings = [l for l in out.stderr.splitlines() if "has no loss token" in l]
    assert len(warnings) == 3 and warnings[0].startswith("megazero: warning: iteration 1 skipped"), out.stderr
    assert f"(samples 0..7 of --data-path {prefix})" in warnings[0], warnings[0]
    errors = [l for l in out.stderr.splitlines() if l.startswith("megazero: data error:")]
    assert len(errors) == 1 and "none of the 3 steps of this run had a loss token" in errors[0], out.stderr
    assert f"--data-path {prefix}" in errors[0] and "Traceback" not in out.stderr
    assert "skipped iterations: 3" in out.stdout and "nan" not in out.stdout
    assert "loss: n/a" in out.stdout and not (tmp_path / "ckpt").exists()  # nothing learned, nothing saved
