"""Hugging Face interchange of the LLaMA-style block (fp32): a tp2 pp2 checkpoint (RoPE with
base 1000, RMSNorm eps 1e-6, SwiGLU, grouped-query attention G=2 of 4 heads, no biases,
untied) exported as LlamaForCausalLM gives megazero's logits in transformers; --from-hf brings
it back with the same logits and the same 5 training losses; generate.py's greedy tokens
equal transformers' greedy generate at tp 1 and tp 2; a folder sharded by transformers'
save_pretrained imports under tp 2 with transformers' logits, and --to-hf --max-shard-size
writes shards and an index that transformers loads with megazero's logits (a write that fails
leaves nothing behind); what Llama cannot express is refused by name. The exact map of the
other layouts (multi-head QKV, biases, tied) is checked in one process."""

import dataclasses
import json
import os
import re

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.extras import require
from tests.support.generate import generate_args
from tests.support.hf_convert import (
    MODEL,
    TP2PP2,
    assert_same_logits_and_ids,
    export_tp2pp2,
    from_hf_and_from_checkpoint,
    logits_of,
    single_stage,
)
from tests.support.hf_llama import LLAMA, PROMPT, hf_llama_model, llama_gcfg


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_tp2pp2(tmp_path_factory.mktemp("hfllama"), MODEL + LLAMA)


def _checkpoint_model(ckpt):
    from megazero.checkpoint import read_full_weights
    from model.hf import config_from_record

    meta, full = read_full_weights(ckpt)
    return config_from_record(meta["extra"]["gpt_config"], hidden_dropout=0.0, attention_dropout=0.0), full


@pytest.mark.slow
def test_exported_llama_matches_megazero(exported):
    gcfg, full = _checkpoint_model(exported["ckpt"])
    assert gcfg.num_query_groups == 2 and full["output.weight"].shape[0] == 304  # untied, padded at tp 2
    ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    ours = logits_of(single_stage(gcfg, full), ids)
    hf = hf_llama_model(exported["hf"])
    c = hf.config
    assert type(hf).__name__ == "LlamaForCausalLM" and c.vocab_size == 300 and c.num_key_value_heads == 2
    assert (
        c.rms_norm_eps,
        c.rope_parameters["rope_theta"],
        c.tie_word_embeddings,
        c.attention_bias,
        c.intermediate_size,
    ) == (1e-6, 1000.0, False, False, 64)
    assert_same_logits_and_ids(hf, ids, ours, exported)


@pytest.mark.slow
def test_llama_round_trip_gives_the_same_logits_and_losses(exported):
    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.config import config_from_argv
    from model.build import from_hf_weights

    gcfg, full = _checkpoint_model(exported["ckpt"])
    cfg = config_from_argv(exported["argv"] + ["--from-hf", exported["hf"]], 1)
    back = single_stage(gcfg, from_hf_weights(cfg, gcfg, 1))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits_of(back, ids), logits_of(single_stage(gcfg, full), ids))  # bit for bit

    via_hf, native = run_distributed(
        from_hf_and_from_checkpoint, 4, exported["argv"] + TP2PP2, exported["hf"], exported["ckpt"]
    )[-1]  # the last rank holds the loss
    assert via_hf == native and len(via_hf) == 5
    ds = training.build_data(cfg).train
    tokens, labels = get_micro_batches(ds, 0, 4, 4, 0, 1)[0]  # the first global batch
    with torch.no_grad():
        logits = hf_llama_model(exported["hf"])(tokens).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert via_hf[0] == pytest.approx(hf_loss, rel=1e-5)


def _tp2_greedy(rank, world, hf_dir):
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training.inference import load_model
    from model.sampling import sample

    stage, tok = load_model(
        generate_args(hf_dir), ProcessGroups.build(Topology(tp=world, pp=1, dp=1)), torch.device("cpu")
    )
    return sample(stage, tok.encode(PROMPT), 12, temperature=0.0)


@pytest.mark.slow
def test_llama_generate_greedy_equals_transformers_at_tp1_and_tp2(exported, capsys):
    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_model
    from model.sampling import forward_cached
    from scripts.generate import main

    stage, tok = load_model(generate_args(exported["hf"]), ProcessGroups.single(), torch.device("cpu"))
    stage.eval()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    caches = [None] * len(stage.layers)
    steps = [forward_cached(stage, ids[:, :9], caches)] + [
        forward_cached(stage, ids[:, t : t + 1], caches) for t in range(9, 16)
    ]
    with torch.no_grad():
        full = stage(ids)[..., :300]  # (B, T, V)
    for got, t in zip(steps, range(8, 16)):  # the cache (rotated keys of G heads) == full forward
        torch.testing.assert_close(got, full[:, t], rtol=1e-5, atol=1e-5)

    prompt = tok.encode(PROMPT)
    model = hf_llama_model(exported["hf"])
    want = model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=model.config.eos_token_id
    )[0].tolist()
    assert (
        main(
            [
                "--load",
                exported["ckpt"],
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "12",
                "--temperature",
                "0",
                "--print-ids",
                "--device",
                "cpu",
            ]
        )
        == 0
    )  # tp 1, from the tp2 pp2 checkpoint
    tp1 = json.loads(capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1])
    tp2 = run_distributed(_tp2_greedy, 2, exported["hf"])[0]
    assert len(want) == len(prompt) + 12 and tp1 == want and tp2 == want


def _tp_logits(rank, world, hf_dir, ids):
    from megazero.process_groups import ProcessGroups
    from megazero.tensor_parallel.mappings import gather_from_tp_region
    from megazero.topology import Topology
    from megazero.training.inference import load_model

    groups = ProcessGroups.build(Topology(tp=world, pp=1, dp=1))
    stage, _ = load_model(generate_args(hf_dir), groups, torch.device("cpu"), need_tokenizer=False)
    with torch.no_grad():
        local = stage.eval()(ids)  # (B, T, V_pad/tp)
    return gather_from_tp_region(local, stage.tp)[..., : stage.cfg.vocab_size]  # (B, T, V)


@pytest.mark.slow
def test_a_save_pretrained_sharded_llama_imports_under_tp2_with_transformers_logits(exported, tmp_path):
    from megazero import training

    hf = hf_llama_model(exported["hf"])
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")  # transformers' own sharding
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 4 and not (sharded / "model.safetensors").exists()
    assert training.preflight(exported["argv"] + TP2PP2 + ["--from-hf", str(sharded)], 4) == 0
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    ours = run_distributed(_tp_logits, 2, str(sharded), ids)
    with torch.no_grad():
        theirs = hf(ids).logits  # (B, T, V)
    for logits in ours:
        torch.testing.assert_close(logits, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


@pytest.mark.slow
def test_to_hf_with_max_shard_size_writes_shards_that_transformers_loads(exported, tmp_path):
    from model.build import from_hf_weights
    from model.hf import to_hf_tensors
    from scripts.convert_checkpoint import main

    out = tmp_path / "out"
    assert main(["--load", exported["ckpt"], "--to-hf", str(out), "--max-shard-size", "30KB"]) == 0
    gcfg, full = _checkpoint_model(exported["ckpt"])
    tensors = to_hf_tensors(full, gcfg)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) >= 4 and shards == sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert index["metadata"]["total_size"] == sum(4 * t.numel() for t in tensors.values())
    assert sorted(index["weight_map"]) == sorted(tensors) and not any(f.endswith(".tmp") for f in os.listdir(out))
    assert all(os.path.getsize(out / f) < 30_000 + 38_400 for f in shards)  # the limit, or one larger tensor
    ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(5))
    ours = logits_of(single_stage(gcfg, full), ids)
    assert_same_logits_and_ids(hf_llama_model(str(out)), ids, ours, dict(exported, hf=str(out)))
    from megazero.config import config_from_argv

    back = from_hf_weights(config_from_argv(exported["argv"] + ["--from-hf", str(out)], 1), gcfg, 2)
    for name, t in full.items():
        assert torch.equal(back[name], t), name  # bit for bit, padded for tp 2 as the checkpoint


@pytest.mark.slow
def test_a_failed_sharded_export_leaves_nothing_behind(exported, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    from scripts.convert_checkpoint import main

    written = []

    def full_disk_after_two(tensors, filename, metadata=None):
        if len(written) == 2:
            raise OSError(28, "No space left on device", filename)
        written.append(filename)
        real(tensors, filename, metadata=metadata)

    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_after_two)
    out = tmp_path / "out"
    assert main(["--load", exported["ckpt"], "--to-hf", str(out), "--max-shard-size", "30KB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(written) == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"convert_checkpoint: error: --to-hf {out}: cannot write ") and "No space left" in err
    assert os.listdir(tmp_path) == []  # no folder, no temporary folder, no shard


@pytest.mark.slow
def test_llama_from_hf_mismatch_stops_before_launch(exported, tmp_path, capsys):
    from megazero import training

    bad = tmp_path / "bad"
    bad.mkdir()
    os.link(os.path.join(exported["hf"], "model.safetensors"), bad / "model.safetensors")
    config = json.load(open(os.path.join(exported["hf"], "config.json")))
    for change, message in (
        (dict(num_key_value_heads=4), "fix: set --group-query-attention --num-query-groups"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}),
            "yarn_rotary_scaling_factor = 2.0, this run None; fix: set --yarn-rotary-scaling-factor",
        ),
        (
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
            "rotary_seq_len_interpolation_factor = 2.0, this run None; fix: set --rotary-seq-len-interpolation-factor",
        ),
    ):
        (bad / "config.json").write_text(json.dumps(dict(config, **change)))
        assert training.preflight(exported["argv"] + ["--from-hf", str(bad)], 1) == 2
        assert message in capsys.readouterr().err
    gpt2_run = MODEL + exported["argv"][len(MODEL) + len(LLAMA) :]  # the same sizes, GPT-2 block
    assert training.preflight(gpt2_run + ["--from-hf", exported["hf"]], 1) == 2
    assert (
        "position_embedding_type = rope, this run learned_absolute; fix: set --position-embedding-type"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("groups,bias,tied", [(2, False, False), (None, True, True), (4, True, False)])
def test_llama_map_is_exact_for_every_layout(groups, bias, tied):
    require("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.gpt import init_full_weights
    from model.hf import CanonicalView, llama_config, llama_config_from_hf, to_hf_tensors

    gcfg = llama_gcfg(num_query_groups=groups, add_bias_linear=bias, tie_embeddings=tied)
    full = init_full_weights(gcfg, seed=3, tp_size=1)
    for name in full:  # non-trivial biases and norms, so a wrong map cannot pass
        if name.endswith("bias") or "ln" in name:
            full[name] = full[name] + 0.1 * torch.randn(
                full[name].shape, generator=torch.Generator().manual_seed(len(name))
            )
    tensors = to_hf_tensors(full, gcfg)
    assert ("lm_head.weight" in tensors) == (not tied) and tensors["model.embed_tokens.weight"].shape == (50, 32)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (gcfg.kv_heads * 8, 32)
    hf = LlamaForCausalLM(LlamaConfig(**llama_config(gcfg))).eval()
    result = hf.load_state_dict(tensors, strict=False)
    assert result.missing_keys == (["lm_head.weight"] if tied else []) and not result.unexpected_keys
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = logits_of(single_stage(gcfg, full), ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())
    back = CanonicalView(tensors, gcfg, gcfg.padded_vocab(2))  # re-padded for tp 2: 50 -> 64 rows
    for name in full:
        rows = min(back[name].shape[0], full[name].shape[0])
        assert torch.equal(back[name][:rows], full[name][:rows]), name
    assert back["embedding.word_embeddings.weight"].shape == (64, 32)
    again = llama_config_from_hf(
        llama_config(gcfg), hidden_dropout=0.0, attention_dropout=0.0, seq_length=12, make_vocab_size_divisible_by=16
    )
    # G = heads reads back as multi-head attention (the [q; k; v] layout), the same computation
    assert again == dataclasses.replace(gcfg, num_query_groups=None if groups == 4 else groups)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            dict(normalization="LayerNorm", add_bias_linear=True),
            "--normalization LayerNorm: LlamaForCausalLM has RMSNorm only",
        ),
        (dict(swiglu=False, ffn_hidden_size=64), "a GELU MLP (no --swiglu)"),
        (dict(rotary_percent=0.5), "--rotary-percent 0.5: LlamaForCausalLM rotates the whole head"),
        (
            dict(position_embedding_type="learned_absolute", rotary_base=10000),
            "normalization = 'RMSNorm' has no GPT-2 equivalent",
        ),
        (dict(mtp_num_layers=1), "mtp_num_layers = 1 has no LlamaForCausalLM equivalent"),
    ],
)
def test_export_refuses_a_block_llama_cannot_express(change, message):
    from model.gpt import init_full_weights
    from model.hf import HFConversionError, hf_config, to_hf_tensors

    gcfg = llama_gcfg(**change)
    with pytest.raises(HFConversionError, match=re.escape(message)):
        hf_config(gcfg)
    with pytest.raises(HFConversionError, match=re.escape(message)):
        to_hf_tensors(init_full_weights(gcfg, seed=0), gcfg)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(attention_bias=True, mlp_bias=False), "attention_bias != mlp_bias"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
            "partial_rotary_factor",
        ),
        (dict(model_type="gemma"), "only GPT-2 (model_type 'gpt2') and LLaMA"),
    ],
)
def test_import_refuses_a_llama_config_megazero_computes_differently(change, message):
    from model.hf import HFConversionError, config_from_hf, llama_config

    with pytest.raises(HFConversionError, match=re.escape(message)):
        config_from_hf({**llama_config(llama_gcfg()), **change})


def test_a_head_dim_other_than_hidden_over_heads_is_kv_channels_both_ways():
    """A Llama ``head_dim`` of 16 with hidden 32 and 4 heads (once refused) reads as ``--kv-channels 16``
    and is written back; the default head size keeps ``kv_channels`` None."""
    from model.hf import config_from_hf, llama_config

    config = {**llama_config(llama_gcfg()), "head_dim": 16}
    gcfg = config_from_hf(config)
    assert (gcfg.kv_channels, gcfg.head_dim, gcfg.attention_width) == (16, 16, 64)
    assert llama_config(gcfg)["head_dim"] == 16 and config_from_hf(llama_config(gcfg)) == gcfg
    assert config_from_hf(llama_config(llama_gcfg())).kv_channels is None
