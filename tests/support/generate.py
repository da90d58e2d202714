"""Arguments for scripts/generate.py runs (generate_args) and the Hugging Face folder they read."""

import json
from types import SimpleNamespace

import pytest

from tests.support.extras import require
from tests.support.hf_tokenizer import corpus


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face GPT-2 folder written from megazero tensors (init_method_std 0.2: peaked
    logits, so a greedy choice is never a near tie) with a trained tokenizer.json."""
    require("transformers")
    from safetensors.torch import save_file

    from data.tokenizer import load_tokenizer, train_hf_tokenizer
    from data.tokenizer_export import write_hf_tokenizer
    from model.config import GPTConfig
    from model.gpt import init_full_weights
    from model.hf import gpt2_config, to_hf_tensors

    d = tmp_path_factory.mktemp("gen")
    tok = load_tokenizer(train_hf_tokenizer(corpus(200), 300, str(d / "t" / "tokenizer.json")), "HuggingFaceTokenizer")
    gcfg = GPTConfig(
        vocab_size=tok.vocab_size,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        make_vocab_size_divisible_by=8,
    )
    full = init_full_weights(gcfg, seed=5, tp_size=1)
    out = d / "hf"
    out.mkdir()
    save_file(to_hf_tensors(full, gcfg), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(gpt2_config(gcfg, eod=tok.eod)))
    write_hf_tokenizer(tok, str(out), gcfg.max_position_embeddings)
    return str(out)


def generate_args(hf_dir, **kw):
    kw.setdefault("prompt_ids", None)
    return SimpleNamespace(from_hf=hf_dir, load=None, tokenizer_model=None, tokenizer_type=None, **kw)
