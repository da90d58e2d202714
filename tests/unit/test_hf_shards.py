"""Sharded Hugging Face folders in one process: ``--max-shard-size`` parses the sizes
``save_pretrained`` accepts and splits tensors as huggingface_hub does; a folder written by
transformers' ``save_pretrained`` with shards gives ``--from-hf`` (and scripts/generate.py) every
tensor bit for bit; a missing shard or a tensor missing from the index is one line naming the
file; a bad ``--max-shard-size`` is exit 2 before anything is written. The tensor-parallel
import and the export's logits in transformers are tests/layouts/test_hf_llama.py's."""

import json
import os
import re

import pytest
import torch

from tests.support.extras import require
from tests.support.hf_llama import llama_gcfg


def test_max_shard_size_reads_bytes_and_decimal_units():
    from model.hf_folder import parse_shard_size

    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("500MB") == 5 * 10**8
    assert parse_shard_size("2000000") == 2_000_000
    assert parse_shard_size("1.5kb") == 1500
    assert parse_shard_size(" 3 TB ") == 3 * 10**12
    for bad in ("5XB", "", "-1", "0", "5GiB", "1.5", "GB"):
        with pytest.raises(ValueError, match="is not a size: give bytes"):
            parse_shard_size(bad)


@pytest.mark.parametrize("limit", [1, 100, 250, 400, 10**6])
def test_shard_plan_splits_as_huggingface_hub(limit):
    require("huggingface_hub")
    from huggingface_hub import split_torch_state_dict_into_shards

    from model.hf_folder import shard_plan

    sizes = [10, 30, 5, 60, 20, 20, 1, 90, 3]  # fp32 elements: 40 .. 360 bytes
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
    theirs = split_torch_state_dict_into_shards(tensors, max_shard_size=limit)
    assert shard_plan(tensors, limit) == [list(names) for names in theirs.filename_to_tensors.values()]


@pytest.fixture
def sharded(tmp_path):
    """A tiny Llama saved by transformers' save_pretrained in 20 KB shards, its config and tensors."""
    require("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.gpt import init_full_weights
    from model.hf import llama_config, to_hf_tensors

    gcfg = llama_gcfg(vocab_size=300, seq_length=16, max_position_embeddings=32)
    full = init_full_weights(gcfg, seed=4, tp_size=1)
    hf = LlamaForCausalLM(LlamaConfig(**llama_config(gcfg)))
    hf.load_state_dict(to_hf_tensors(full, gcfg))
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    return tmp_path / "hf", gcfg, full


def test_a_save_pretrained_sharded_folder_reads_every_tensor(sharded):
    from model.hf_folder import check_folder, open_folder

    path, gcfg, full = sharded
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) >= 3 and "model.safetensors" not in shards and (path / "model.safetensors.index.json").exists()
    check_folder(str(path), gcfg)
    back = open_folder(str(path), gcfg, gcfg.padded_vocab(2))
    for name, t in full.items():
        rows = min(back[name].shape[0], t.shape[0])  # re-padded for tp 2
        assert torch.equal(back[name][:rows], t[:rows]), name


def test_generate_reads_a_sharded_folder_and_names_a_missing_shard(sharded, capsys):
    from scripts.generate import main

    path, _, _ = sharded
    argv = ["--from-hf", str(path), "--prompt-ids", "5,17,30", "--max-new-tokens", "3", "--device", "cpu"]
    assert main(argv) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])) == 6
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    os.rename(path / shard, path / "elsewhere")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{path / shard}: not found, though model.safetensors.index.json names it as a shard" in err


def test_a_tensor_missing_from_the_index_is_named_with_the_index(sharded):
    from model.hf import HFConversionError
    from model.hf_folder import check_folder

    path, gcfg, _ = sharded
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"].pop("model.norm.weight")
    index_file.write_text(json.dumps(index))
    with pytest.raises(HFConversionError, match=re.escape(f"{index_file} has no tensor 'model.norm.weight'")):
        check_folder(str(path), gcfg)
    index["weight_map"]["model.norm.weight"] = next(s for s in index["weight_map"].values() if s != shard)
    index_file.write_text(json.dumps(index))  # the index names a shard that does not hold it
    wrong = path / index["weight_map"]["model.norm.weight"]
    want = f"{wrong} has no tensor 'model.norm.weight', which model.safetensors.index.json puts there"
    with pytest.raises(HFConversionError, match=re.escape(want)):
        check_folder(str(path), gcfg)


def test_a_bad_max_shard_size_is_exit_2_before_anything_is_written(tmp_path, capsys):
    from scripts.convert_checkpoint import main

    out = tmp_path / "out"
    assert main(["--load", str(tmp_path / "no-checkpoint"), "--to-hf", str(out), "--max-shard-size", "5XB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "convert_checkpoint: error: --max-shard-size '5XB' is not a size: give bytes (2000000) or a number "
        "with KB, MB, GB or TB (500MB, 5GB); fix: e.g. --max-shard-size 5GB"
    )
    assert not out.exists() and os.listdir(tmp_path) == []
