"""Hugging Face interchange (fp32): a tp2 pp2 checkpoint exported as GPT2LMHeadModel gives
megazero's logits in transformers, its tokenizer gives megazero's ids, and --from-hf brings
it back: the same logits, the same first-step loss as transformers, and the same 5 training
losses as a run that started from the checkpoint's weights without leaving megazero."""

import json
import os

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.extras import require
from tests.support.hf_convert import (
    TEXTS,
    TP2PP2,
    assert_same_logits_and_ids,
    from_hf_and_from_checkpoint,
    logits_of,
    single_stage,
)
from tests.support.hf_tokenizer import corpus


@pytest.mark.slow
def test_exported_model_and_tokenizer_match_megazero(exported):
    from transformers import AutoModelForCausalLM

    from megazero.checkpoint import read_full_weights
    from model.hf import config_from_record

    meta, full = read_full_weights(exported["ckpt"])
    gcfg = config_from_record(meta["extra"]["gpt_config"], hidden_dropout=0.0, attention_dropout=0.0)
    assert gcfg.vocab_size == 300 and full["embedding.word_embeddings.weight"].shape[0] == 304  # padded at tp 2
    ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    ours = logits_of(single_stage(gcfg, full), ids)
    hf = AutoModelForCausalLM.from_pretrained(exported["hf"], dtype=torch.float32).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.vocab_size == 300
    hf_tok = assert_same_logits_and_ids(hf, ids, ours, exported)
    for text in TEXTS:
        assert hf_tok.decode(exported["tok"].encode(text)) == text
    assert hf_tok.eos_token_id == exported["tok"].eod


@pytest.mark.slow
def test_from_hf_round_trip_gives_the_same_logits_and_losses(exported):
    from transformers import AutoModelForCausalLM

    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.checkpoint import read_full_weights
    from megazero.config import config_from_argv
    from model.build import from_hf_weights
    from model.hf import config_from_record

    meta, full = read_full_weights(exported["ckpt"])
    gcfg = config_from_record(meta["extra"]["gpt_config"], hidden_dropout=0.0, attention_dropout=0.0)
    cfg = config_from_argv(exported["argv"] + ["--from-hf", exported["hf"]], 1)
    back = single_stage(gcfg, from_hf_weights(cfg, gcfg, 1))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits_of(back, ids), logits_of(single_stage(gcfg, full), ids))  # bit for bit

    argv = exported["argv"] + TP2PP2
    via_hf, native = run_distributed(from_hf_and_from_checkpoint, 4, argv, exported["hf"], exported["ckpt"])[
        -1
    ]  # the last rank holds the loss
    assert via_hf == native  # same layout, same weights: the same 5 losses, bit for bit
    ds = training.build_data(cfg).train
    tokens, labels = get_micro_batches(ds, 0, 4, 4, 0, 1)[0]  # the first global batch
    hf = AutoModelForCausalLM.from_pretrained(exported["hf"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(tokens).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert via_hf[0] == pytest.approx(hf_loss, rel=1e-5)


@pytest.mark.slow
def test_bad_from_hf_folders_stop_before_launch(exported, tmp_path, capsys):
    from megazero import training

    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(SystemExit) as e:  # no config.json / model.safetensors: a config error
        training.preflight(exported["argv"] + ["--from-hf", str(bad)], 1)
    assert e.value.code == 2 and "config.json not found" in capsys.readouterr().err
    os.link(os.path.join(exported["hf"], "model.safetensors"), bad / "model.safetensors")
    config = json.load(open(os.path.join(exported["hf"], "config.json")))
    for change, message in (
        (dict(activation_function="gelu_new"), "openai_gelu = True, this run False; fix: set --openai-gelu"),
        (dict(activation_function="relu"), "activation_function 'relu'"),
        (dict(n_layer=3), "num_layers = 3, this run 2; fix: set --num-layers"),
        (dict(vocab_size=512), "vocab_size = 512, this run 300"),
        (dict(model_type="bert"), "only GPT-2"),
    ):
        (bad / "config.json").write_text(json.dumps(dict(config, **change)))
        assert training.preflight(exported["argv"] + ["--from-hf", str(bad)], 1) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_export_refuses_what_it_cannot_map_exactly(exported, tmp_path, capsys):
    from scripts.convert_checkpoint import main

    assert main(["--load", exported["ckpt"], "--to-hf", exported["hf"]]) == 2  # not empty
    assert "exists and is not empty" in capsys.readouterr().err
    other = exported["dir"] / "tok" / "tokenizer.json"  # the run's own: accepted
    assert main(["--load", exported["ckpt"], "--to-hf", str(tmp_path / "a"), "--tokenizer-model", str(other)]) == 0
    from data.tokenizer import train_hf_tokenizer

    wrong = train_hf_tokenizer(corpus(30)[::-1], 300, str(tmp_path / "w" / "tokenizer.json"))
    assert main(["--load", exported["ckpt"], "--to-hf", str(tmp_path / "b"), "--tokenizer-model", wrong]) == 2
    assert "is not the one the checkpoint was trained with" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_untied_model_maps_exactly_in_one_process(tmp_path):
    require("transformers")
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from model.config import GPTConfig
    from model.gpt import init_full_weights
    from model.hf import CanonicalView, gpt2_config, to_hf_tensors

    gcfg = GPTConfig(
        vocab_size=50,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=24,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_embeddings=False,
        layernorm_epsilon=1e-6,
        make_vocab_size_divisible_by=16,
    )
    full = init_full_weights(gcfg, seed=3, tp_size=1)
    for name in full:  # non-trivial biases and LayerNorms, so a wrong map cannot pass
        if name.endswith("bias") or "ln" in name:
            full[name] = full[name] + 0.1 * torch.randn(
                full[name].shape, generator=torch.Generator().manual_seed(len(name))
            )
    tensors = to_hf_tensors(full, gcfg)
    assert "lm_head.weight" in tensors and tensors["transformer.wte.weight"].shape == (50, 16)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    hf = GPT2LMHeadModel(GPT2Config(**gpt2_config(gcfg))).eval()
    missing = hf.load_state_dict(tensors, strict=False)
    assert not [k for k in missing.missing_keys if not k.endswith("attn.bias")] and not missing.unexpected_keys
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    ours = logits_of(single_stage(gcfg, full), ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())
    back = CanonicalView(tensors, gcfg, gcfg.padded_vocab(2))  # re-padded for tp 2: 50 -> 64 rows
    assert back["output.weight"].shape == (64, 16) and torch.equal(
        back["output.weight"][:50], full["output.weight"][:50]
    )
    assert torch.equal(back["layers.1.attn.qkv.weight"], full["layers.1.attn.qkv.weight"])


def test_settings_that_do_not_change_the_math_export():
    """A checkpoint trained with --compile or --no-async-tensor-model-parallel-allreduce records
    tp_overlap_grad_reduce = False (bit-identical either way): it exports like the default."""
    from model.config import GPTConfig
    from model.hf import config_from_record, config_record, hf_config

    for block in (dict(), dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)):
        gcfg = GPTConfig(vocab_size=50, num_layers=2, hidden_size=16, num_attention_heads=2, **block)
        record = dict(config_record(gcfg), tp_overlap_grad_reduce=False, recompute_granularity="selective")
        assert hf_config(config_from_record(record)) == hf_config(gcfg)


@pytest.mark.slow
def test_generate_from_the_tp2_pp2_checkpoint_equals_transformers_greedy(exported, capsys):
    from transformers import AutoModelForCausalLM

    from scripts.generate import main

    prompt = "x = 1\n"
    assert (
        main(
            [
                "--load",
                exported["ckpt"],
                "--prompt",
                prompt,
                "--max-new-tokens",
                "8",
                "--temperature",
                "0",
                "--print-ids",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    ids = json.loads(capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1])
    model = AutoModelForCausalLM.from_pretrained(exported["hf"], dtype=torch.float32).eval()
    start = torch.tensor([exported["tok"].encode(prompt)])
    want = model.generate(start, max_new_tokens=8, do_sample=False, pad_token_id=model.config.eos_token_id)
    want, eos = want[0].tolist(), model.config.eos_token_id
    # generate.py stops after EOD; transformers pads the rest of its rows with it
    assert (
        ids == want[: len(ids)] and all(t == eos for t in want[len(ids) - 1 :]) if len(ids) < len(want) else ids == want
    )


def test_sentencepiece_tokenizer_exports_exactly(tmp_path):
    require("transformers")
    from transformers import AutoTokenizer

    from data.tokenizer import load_tokenizer, train_tokenizer
    from data.tokenizer_export import write_hf_tokenizer
    from tests.support.data import TRICKY

    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(60) + [TRICKY]))
    tok = load_tokenizer(train_tokenizer(str(tmp_path / "t.jsonl"), 400, str(tmp_path / "sp"), num_threads=1))
    out = tmp_path / "hf"
    out.mkdir()
    write_hf_tokenizer(tok, str(out), 64)  # checks the standard-library sample itself
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS + [TRICKY.replace("<|eod|>", ""), "a literal \u2581 here"]:
        assert hf_tok(text)["input_ids"] == tok.encode(text), text
        assert hf_tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert hf_tok.eos_token_id == tok.eod == 1
