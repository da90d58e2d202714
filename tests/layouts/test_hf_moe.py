"""Hugging Face interchange of the LLaMA-style block with Mixture-of-Experts MLPs (
fp32): a tp 2 checkpoint with 4 experts (top-2) exports as MixtralForCausalLM, and one with a
shared expert, a dense second layer and the pre-top-k softmax as Qwen2MoeForCausalLM; their
logits in transformers equal megazero's within 1e-5, scripts/generate.py's greedy ids (tp 1
and tp 2) equal transformers' generate, --from-hf's first training loss equals transformers'
loss on the same batch, and HF -> megazero -> HF gives identical tensors. What neither model
computes is refused by name, on export and on import. The map of more layouts is checked in
one process; the training, export and tp 2 runs of both models share one spawn of 2 ranks."""

import dataclasses
import json
import os
import re

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.extras import require
from tests.support.generate import generate_args
from tests.support.hf_convert import MODEL, hf_trainer, logits_of, single_stage, train_steps
from tests.support.hf_llama import LLAMA, PROMPT, hf_llama_model, llama_gcfg
from tests.support.hf_tokenizer import corpus

EXPERTS = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-aux-loss-coeff",
    "1e-2",
]
KINDS = {
    "mixtral": EXPERTS,  # every layer MoE, softmax over the top-k logits
    # layer 0 MoE with a shared expert, layer 1 dense; top-k of the full softmax (not renormalised)
    "qwen2_moe": EXPERTS
    + ["--moe-shared-expert-intermediate-size", "24", "--moe-layer-freq", "2", "--moe-router-pre-softmax"],
}
ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def _run_both(rank, world, runs):
    """Per kind: train 3 steps at tp 2 and save; rank 0 exports (convert_checkpoint --to-hf);
    then every rank loads the folder at tp 2 for greedy generation and trains one step from it
    (--from-hf). A kind without a folder (``hf`` None) trains one step and saves only.
    Returns {kind: (greedy ids, first loss from the folder)}."""
    import torch.distributed as dist

    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training.inference import load_model
    from model.sampling import sample
    from scripts.convert_checkpoint import main as convert

    out = {}
    for kind, (argv, ckpt, hf) in runs.items():
        trainer = hf_trainer(argv, world)
        train_steps(trainer, 3 if hf else 1)
        trainer.save_checkpoint(ckpt)
        trainer.close()
        if hf is None:
            continue
        if rank == 0:
            assert convert(["--load", ckpt, "--to-hf", hf]) == 0
        dist.barrier()
        stage, tok = load_model(
            generate_args(hf), ProcessGroups.build(Topology(tp=world, pp=1, dp=1)), torch.device("cpu")
        )
        greedy = sample(stage, tok.encode(PROMPT), 10, temperature=0.0)
        out[kind] = (greedy, train_steps(hf_trainer(argv + ["--from-hf", hf], world), 1)[0])
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    require("transformers")
    require("safetensors")
    from data.preprocess import preprocess
    from data.tokenizer import load_tokenizer, train_hf_tokenizer

    d = tmp_path_factory.mktemp("hfmoe")
    tok = load_tokenizer(
        train_hf_tokenizer(corpus(200), 300, str(d / "tok" / "tokenizer.json")), "HuggingFaceTokenizer"
    )
    (d / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(150)), encoding="utf-8")
    preprocess(
        str(d / "in.jsonl"),
        ["text"],
        tok.model_path,
        str(d / "c"),
        progress=False,
        tokenizer_type="HuggingFaceTokenizer",
    )
    data = [
        "--data-path",
        str(d / "c_text_document"),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        tok.model_path,
        "--train-iters",
        "8",
    ]
    runs = {
        kind: (MODEL + LLAMA + flags + data + ["--tp", "2"], str(d / kind / "ckpt"), str(d / kind / "hf"))
        for kind, flags in KINDS.items()
    }
    runs["sigmoid"] = (
        MODEL + LLAMA + EXPERTS + ["--moe-router-score-function", "sigmoid"] + data + ["--tp", "2"],
        str(d / "sigmoid" / "ckpt"),
        None,
    )
    results = run_distributed(_run_both, 2, runs, timeout_s=400)
    out = {
        kind: dict(
            argv=argv[:-2],
            ckpt=ckpt,
            hf=hf,
            greedy=results[0][kind][0],
            from_hf_loss=results[0][kind][1],
            tok=tok,
            dense=MODEL + LLAMA + data,
        )
        for kind, (argv, ckpt, hf) in runs.items()
        if hf
    }
    return dict(out, sigmoid=dict(ckpt=runs["sigmoid"][1], dir=d))


def _checkpoint_model(ckpt):
    from megazero.checkpoint import read_full_weights
    from model.hf import config_from_record

    meta, full = read_full_weights(ckpt)
    return config_from_record(meta["extra"]["gpt_config"], hidden_dropout=0.0, attention_dropout=0.0), full


def _folder_tensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_exported_moe_logits_and_first_loss_match_transformers(exported, kind):
    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.config import config_from_argv

    run = exported[kind]
    gcfg, full = _checkpoint_model(run["ckpt"])
    hf = hf_llama_model(run["hf"])
    c = hf.config
    assert type(hf).__name__ == ARCH[kind] and c.num_experts_per_tok == 2 and c.vocab_size == 300
    tensors = _folder_tensors(run["hf"])
    if kind == "mixtral":
        assert (c.num_local_experts, c.intermediate_size, c.router_jitter_noise) == (4, 16, 0.0)
        assert torch.equal(
            tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"], full["layers.1.mlp.experts.3.fc2.weight"]
        )
    else:
        assert (
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
            c.mlp_only_layers,
            c.norm_topk_prob,
            c.intermediate_size,
        ) == (4, 16, 24, [1], False, 64)
        assert torch.equal(tensors["model.layers.0.mlp.shared_expert_gate.weight"], torch.zeros(1, 32))
        assert torch.equal(
            tensors["model.layers.0.mlp.shared_expert.down_proj.weight"],
            2 * full["layers.0.mlp.shared_experts.fc2.weight"],
        )  # the gate is exactly 1/2
    ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    ours = logits_of(single_stage(gcfg, full), ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())

    cfg = config_from_argv(run["argv"] + ["--from-hf", run["hf"]], 1)
    tokens, labels = get_micro_batches(training.build_data(cfg).train, 0, 4, 4, 0, 1)[0]  # the first global batch
    with torch.no_grad():
        logits = hf(tokens).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert run["from_hf_loss"] == pytest.approx(hf_loss, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_moe_generate_greedy_equals_transformers_at_tp1_and_tp2(exported, kind, capsys):
    from scripts.generate import main

    run = exported[kind]
    prompt = run["tok"].encode(PROMPT)
    model = hf_llama_model(run["hf"])
    want = model.generate(
        torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=model.config.eos_token_id
    )[0].tolist()
    assert (
        main(
            [
                "--from-hf",
                run["hf"],
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "10",
                "--temperature",
                "0",
                "--print-ids",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    tp1 = json.loads(capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1])
    assert len(want) == len(prompt) + 10 and tp1 == want and run["greedy"] == want


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_moe_round_trip_hf_megazero_hf_is_identical(exported, kind, tmp_path, capsys):
    from megazero import training
    from megazero.config import config_from_argv
    from model.build import from_hf_weights
    from model.hf import to_hf_tensors
    from model.hf_folder import folder_config, open_folder

    run = exported[kind]
    gcfg, full = _checkpoint_model(run["ckpt"])
    cfg = config_from_argv(run["argv"] + ["--from-hf", run["hf"]], 1)
    view = from_hf_weights(cfg, gcfg, 2)  # --from-hf's reader, re-padded for tp 2
    assert all(torch.equal(view[name], full[name]) for name in full)  # the checkpoint's tensors, bit for bit
    saved = tmp_path / "saved"
    hf_llama_model(run["hf"]).save_pretrained(saved)  # written by transformers itself
    theirs = _folder_tensors(saved)
    back_cfg = folder_config(str(saved), hidden_dropout=0.0, attention_dropout=0.0)
    back = to_hf_tensors(open_folder(str(saved), back_cfg, back_cfg.padded_vocab(1)), back_cfg)
    assert sorted(back) == sorted(theirs) and all(torch.equal(back[k], theirs[k]) for k in theirs)

    flag, value = ("--moe-router-topk", "1") if kind == "mixtral" else ("--moe-shared-expert-intermediate-size", "8")
    assert training.preflight(run["argv"] + [flag, value, "--from-hf", run["hf"]], 1) == 2
    assert f"fix: set {flag} to match" in capsys.readouterr().err
    assert training.preflight(run["dense"] + ["--from-hf", run["hf"]], 1) == 2
    assert "num_experts = 4, this run None; fix: set --num-experts to match" in capsys.readouterr().err


def _moe(**kw):
    return llama_gcfg(
        **{**dict(num_layers=3, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, init_method_std=0.2), **kw}
    )


def _write(path, tensors, config):
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(num_query_groups=None, tie_embeddings=True, moe_router_topk=1),
        dict(moe_shared_expert_intermediate_size=24),
        dict(moe_shared_expert_intermediate_size=24, moe_layer_freq=2, moe_router_pre_softmax=True, num_query_groups=4),
    ],
)
def test_moe_map_is_exact_for_every_layout(kw, tmp_path):
    require("transformers")
    from model.gpt import init_full_weights
    from model.hf import config_from_hf, hf_config, to_hf_tensors
    from model.hf_folder import open_folder

    gcfg = _moe(**kw)
    full = init_full_weights(gcfg, seed=3)
    for name in full:  # non-trivial norms
        if "ln" in name:
            full[name] = full[name] + 0.1 * torch.randn(full[name].shape, generator=torch.Generator().manual_seed(7))
    path = _write(tmp_path / "hf", to_hf_tensors(full, gcfg), hf_config(gcfg))
    hf = hf_llama_model(path)
    assert type(hf).__name__ == ARCH["qwen2_moe" if kw.get("moe_shared_expert_intermediate_size") else "mixtral"]
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = logits_of(single_stage(gcfg, full), ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())
    back = open_folder(path, gcfg, gcfg.padded_vocab(1))
    assert all(torch.equal(back[name], full[name]) for name in full)
    again = config_from_hf(
        hf_config(gcfg),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        seq_length=12,
        make_vocab_size_divisible_by=16,
        init_method_std=0.2,
    )
    if gcfg.moe_shared_expert_intermediate_size is None:  # Mixtral: intermediate_size is the experts' width
        again = dataclasses.replace(again, ffn_hidden_size=gcfg.ffn_hidden_size)
    assert again == dataclasses.replace(gcfg, num_query_groups=None if gcfg.kv_heads == 4 else gcfg.num_query_groups)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            dict(
                position_embedding_type="learned_absolute",
                normalization="LayerNorm",
                swiglu=False,
                ffn_hidden_size=64,
                add_bias_linear=True,
            ),
            "--num-experts with the GPT-2 block",
        ),
        (dict(add_bias_linear=True), "--num-experts with linear biases"),
        (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
        (
            dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
            "--moe-router-enable-expert-bias",
        ),
        (dict(moe_router_num_groups=2, moe_router_group_topk=1), "--moe-router-num-groups 2"),
        (dict(moe_router_topk_scaling_factor=2.5), "--moe-router-topk-scaling-factor 2.5"),
        (dict(moe_expert_capacity_factor=1.25), "--moe-expert-capacity-factor 1.25"),
        (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax without a shared expert"),
        (dict(moe_layer_freq=2), "--moe-layer-freq 2 without a shared expert"),
        (dict(moe_layer_freq=2, moe_shared_expert_intermediate_size=24, rotary_percent=0.5), "--rotary-percent 0.5"),
    ],
)
def test_moe_export_refuses_what_neither_model_computes(change, message):
    from model.gpt import init_full_weights
    from model.hf import HFConversionError, hf_config, to_hf_tensors

    gcfg = _moe(**change)
    with pytest.raises(HFConversionError, match=re.escape(message)):
        hf_config(gcfg)
    with pytest.raises(HFConversionError, match=re.escape(message)):
        to_hf_tensors(init_full_weights(gcfg, seed=0), gcfg)


@pytest.mark.parametrize(
    "shared,change,message",
    [
        (24, dict(qkv_bias=True), "qkv_bias true"),
        (24, dict(use_sliding_window=True), "use_sliding_window true"),
        (24, dict(mlp_only_layers=[0]), "MoE layers [1, 2] (decoder_sparse_step 1, mlp_only_layers [0])"),
        (24, dict(decoder_sparse_step=2, mlp_only_layers=[]), "MoE layers [1]"),
        (24, dict(num_experts_per_tok=5), "num_experts_per_tok 5 exceeds the 4 experts"),
        (None, dict(sliding_window=8), "sliding_window 8 < max_position_embeddings 12"),
    ],
)
def test_moe_import_refuses_a_config_megazero_computes_differently(shared, change, message):
    from model.hf import HFConversionError, config_from_hf, hf_config

    with pytest.raises(HFConversionError, match=re.escape(message)):
        config_from_hf({**hf_config(_moe(moe_shared_expert_intermediate_size=shared)), **change})


def test_moe_import_refuses_a_gated_shared_expert(tmp_path):
    require("safetensors")
    from model.gpt import init_full_weights
    from model.hf import HFConversionError, hf_config, to_hf_tensors
    from model.hf_folder import check_folder

    gcfg = _moe(moe_shared_expert_intermediate_size=24)
    tensors = to_hf_tensors(init_full_weights(gcfg, seed=0), gcfg)
    check_folder(_write(tmp_path / "ok", tensors, hf_config(gcfg)), gcfg)  # the zero gate passes
    tensors["model.layers.2.mlp.shared_expert_gate.weight"][0, 5] = 0.25
    with pytest.raises(
        HFConversionError,
        match=re.escape(
            "model.layers.2.mlp.shared_expert_gate.weight is not zero: its shared expert is weighted by sigmoid(gate x)"
        ),
    ):
        check_folder(_write(tmp_path / "gated", tensors, hf_config(gcfg)), gcfg)


@pytest.mark.slow
def test_convert_refuses_a_sigmoid_router_in_one_line(exported, capsys):
    from scripts.convert_checkpoint import main

    out = exported["sigmoid"]["dir"] / "sigmoid" / "hf"
    assert main(["--load", exported["sigmoid"]["ckpt"], "--to-hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "convert_checkpoint: error: --moe-router-score-function sigmoid: MixtralForCausalLM, "
        "Qwen2MoeForCausalLM and Qwen3MoeForCausalLM score the experts with a softmax (no exact "
        "MixtralForCausalLM equivalent)\n"
    )
    assert not out.exists()
