"""Hugging Face interchange helpers: the exported tiny model (MODEL, fixtures exported /
export_tp2pp2), hf_trainer, train_steps, logits_of, single_stage and the logits / greedy-ids
assertion."""

import json

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.extras import require
from tests.support.hf_tokenizer import corpus

TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé ☃ 日本語 — emoji 😀\ttab",
    "for i in range(3):\n\tprint(f'{i}')\r\n",
    "  leading spaces and trailing  ",
]


MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--make-vocab-size-divisible-by",
    "8",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
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
]


TP2PP2 = ["--tp", "2", "--pp", "2"]


def hf_trainer(argv, world):
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    cfg = config_from_argv(argv, world)
    return build_trainer(cfg, data=training.prepare_run(cfg))


def train_steps(trainer, n):
    return [trainer.train_step(trainer.next_batches()).values["loss"] for _ in range(n)]


def _train_and_save(rank, world, argv, save):
    trainer = hf_trainer(argv, world)
    losses = train_steps(trainer, 3)
    trainer.save_checkpoint(save)
    return losses


def from_hf_and_from_checkpoint(rank, world, argv, hf_dir, ckpt):
    """5 losses starting from --from-hf, then 5 starting from the checkpoint's weights (fresh optimizer)."""
    from megazero.checkpoint import read_full_weights

    via_hf = train_steps(hf_trainer(argv + ["--from-hf", hf_dir], world), 5)
    full = read_full_weights(ckpt)[1]
    import model.build

    model.build.from_hf_weights = lambda cfg, gcfg, tp_size: full  # the hook, fed megazero's own tensors
    native = train_steps(hf_trainer(argv, world), 5)
    return via_hf, native


def logits_of(stage, ids):
    with torch.no_grad():
        return stage(ids)[..., : stage.cfg.vocab_size]  # (B, T, V): padded columns dropped


def single_stage(gcfg, full):
    from megazero.process_groups import ProcessGroups
    from model.gpt import GPTStage

    return GPTStage(gcfg, ProcessGroups.single(), range(gcfg.num_layers), True, True, seed=0, full_weights=full).eval()


def export_tp2pp2(d, model_argv: list) -> dict:
    """Train ``model_argv`` 8 steps under tp 2 pp 2 on a 300-token Hugging Face tokenizer's
    corpus, save, and export with ``convert_checkpoint.py --to-hf``; the paths, tokenizer and argv."""
    require("transformers")
    require("safetensors")
    from data.preprocess import preprocess
    from data.tokenizer import load_tokenizer, train_hf_tokenizer

    tok = load_tokenizer(
        train_hf_tokenizer(corpus(200), 300, str(d / "tok" / "tokenizer.json")), "HuggingFaceTokenizer"
    )
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(150)), encoding="utf-8")
    preprocess(str(src), ["text"], tok.model_path, str(d / "c"), progress=False, tokenizer_type="HuggingFaceTokenizer")
    argv = model_argv + [
        "--data-path",
        str(d / "c_text_document"),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        tok.model_path,
        "--train-iters",
        "8",
    ]
    run_distributed(_train_and_save, 4, argv + TP2PP2, str(d / "ckpt"))
    from scripts.convert_checkpoint import main

    assert main(["--load", str(d / "ckpt"), "--to-hf", str(d / "hf")]) == 0
    return dict(dir=d, tok=tok, argv=argv, ckpt=str(d / "ckpt"), hf=str(d / "hf"))


def assert_same_logits_and_ids(hf, ids, ours, exported):
    """transformers' logits on ``ids`` equal megazero's ``ours`` within 1e-5 (relative to the
    largest), and the exported tokenizer encodes TEXTS into megazero's ids; returns it."""
    from transformers import AutoTokenizer

    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())
    hf_tok = AutoTokenizer.from_pretrained(exported["hf"])
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == exported["tok"].encode(text), text
    return hf_tok


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_tp2pp2(tmp_path_factory.mktemp("hfconv"), MODEL)
