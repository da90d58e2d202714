"""Llama-3.x, Mistral, Qwen2, Qwen3 and Qwen3-MoE folders in and out (fp32), built by
transformers' own config and model classes at tiny sizes (no network): a Llama with ``llama3``
RoPE scaling (untied, no biases), a Mistral with ``head_dim`` 12 (hidden / heads = 8), no sliding
window of 8 positions on every layer (Mistral-7B-v0.1's kind; ``--window-size 7,0``) and untied
embeddings (exported back as Mistral), a Qwen2 with q/k/v biases, tied embeddings,
``use_sliding_window: true`` with ``max_window_layers`` 1 (layer 0 full, layer 1 a window of 8;
``--window-attn-skip-freq 0,1``) and ``linear`` RoPE scaling, a Qwen3 with ``head_dim``
12, QK-norm and ``yarn`` RoPE scaling (factor 4 over an original context of 64, YaRN's betas 32 / 1,
the ramp rounded outwards), a Qwen3-MoE with the same attention, 4 experts (top 2, not
renormalised), one dense layer and DeepSeek / gpt-oss style ``yarn`` (factor 8 over 32, beta_fast
16, ``mscale`` 1 over ``mscale_all_dim`` 0.5, ``truncate`` false), and a gpt-oss (q/k/v/o biases,
learned sinks, a window of 8 on layer 0, yarn, 4 experts with biases, a router bias and the
clamped quick GEGLU), and a DeepSeek-V3 (multi-head latent attention with a query latent and
DeepSeek's interleaved rope rows, layer 0 dense and layer 1 of 8 sigmoid-routed experts in 2
groups with a correction bias, a shared expert and a routed scaling factor, yarn with
``mscale_all_dim``).
``--from-hf`` gives transformers' logits within 1e-5 at tp 1 and tp 2 (+ SP), the first training
step's loss under tp 2 equals transformers' loss on the same batch within 1e-6,
the weights saved by that trainer export (``convert_checkpoint.py --to-hf``) to tensors
``torch.equal`` to the folder's, with the same config, and KV-cache greedy decoding gives
transformers' ``generate`` tokens for 32 tokens past the original context. Under pp 2 x tp 2
and cp 2 (ring, all-to-all) the first loss is transformers' too, and 3 steps trained at pp 2 x
tp 2 export to a folder whose transformers logits are megazero's (DeepSeek-V3's MLA included:
its keys and values of different head sizes ride the ring and the all-to-all). Every family but gpt-oss runs
with the model flags ``convert_checkpoint.py --print-flags`` prints for its folder."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.generate import generate_args
from tests.support.hf_convert import hf_trainer, train_steps
from tests.support.hf_families import FAMILIES

SCALED = ("llama3", "qwen2", "qwen3", "qwen3-moe", "gpt-oss", "deepseek-v3")  # the families whose RoPE is scaled
WINDOWED = ("mistral", "qwen2", "gpt-oss")  # the families with a sliding window shorter than the sequences
MOE_FAMILIES = ("qwen3-moe", "gpt-oss", "deepseek-v3")
# the folders (fixture ``folders``, tests/support/hf_families.py) and their run's flags: FAMILIES there


def _tp2_logits_and_first_loss(rank, world, hf_dir, ids, argv, save):
    """tp 2's gathered logits of ``ids`` read with the generate/evaluate loader, then a tp 2 + SP
    trainer from ``--from-hf`` saved before its first step and that step's loss."""
    from megazero.process_groups import ProcessGroups
    from megazero.tensor_parallel.mappings import gather_from_tp_region
    from megazero.topology import Topology
    from megazero.training.inference import load_model

    groups = ProcessGroups.build(Topology(tp=world, pp=1, dp=1))
    stage, _ = load_model(generate_args(hf_dir), groups, torch.device("cpu"), need_tokenizer=False)
    with torch.no_grad():
        logits = gather_from_tp_region(stage.eval()(ids), stage.tp)[..., : stage.cfg.vocab_size]  # (B, T, V)
    trainer = hf_trainer(argv + ["--from-hf", hf_dir, "--tp", "2", "--sequence-parallel"], world)
    trainer.save_checkpoint(save)
    return logits, train_steps(trainer, 1)[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_in_and_out(family, folders, tmp_path):
    from safetensors.torch import load_file

    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_model
    from model.hf import config_from_hf
    from scripts.convert_checkpoint import main

    folder, hf, argv = folders[family]
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits  # (B, T, V)
    stage, _ = load_model(generate_args(folder), ProcessGroups.single(), torch.device("cpu"), need_tokenizer=False)
    assert (stage.cfg.use_rope_scaling, stage.cfg.add_qkv_bias) == (family == "llama3", family == "qwen2")
    assert [stage.cfg.attention_window(i) for i in range(2)] == {
        "mistral": [8, 8],
        "qwen2": [None, 8],
        "gpt-oss": [8, None],
    }.get(family, [None, None])
    assert (stage.cfg.kv_channels, stage.cfg.qk_layernorm) == (
        (12, "qwen3" in family) if family in ("mistral", "gpt-oss") or "qwen3" in family else (None, False)
    )
    assert stage.cfg.hf_model_type == {"mistral": "mistral", "gpt-oss": "gpt_oss"}.get(family)
    assert (stage.cfg.yarn_rotary_scaling_factor, stage.cfg.yarn_correction_range_round_to_int) == (
        {"qwen3": (4.0, True), "qwen3-moe": (8.0, False), "gpt-oss": (4.0, False), "deepseek-v3": (4.0, True)}.get(
            family, (None, True)
        )
    )
    with torch.no_grad():
        tp1 = stage.eval()(ids)[..., :300]
    tp2, loss = run_distributed(_tp2_logits_and_first_loss, 2, folder, ids, argv, str(tmp_path / "ckpt"))[0]
    scale = theirs.abs().max().item()
    for ours in (tp1, tp2):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * scale)

    if family in WINDOWED:  # the same weights without the window: the window matters at 48 tokens
        full = dataclasses.replace(stage.cfg, window_size=None, window_attn_skip_freq=None)
        with torch.no_grad():
            unwindowed = type(stage)(
                full, stage.groups, range(2), True, True, seed=0, full_weights=dict(stage.named_parameters())
            )(ids)[..., :300]
        assert (unwindowed - theirs).abs().max() > 1e-2 * scale

    if family in SCALED:
        stage.cfg.use_rope_scaling, stage.cfg.rotary_seq_len_interpolation_factor = False, None  # RoPE unscaled
        stage.cfg.yarn_rotary_scaling_factor = None
        with torch.no_grad():
            unscaled = type(stage)(
                stage.cfg, stage.groups, range(2), True, True, seed=0, full_weights=dict(stage.named_parameters())
            )(ids)[..., :300]
        assert (unscaled - theirs).abs().max() > 1e-2 * scale  # the scaling matters here: the test can fail

    cfg = config_from_argv(argv, 1)
    tokens, labels = get_micro_batches(training.build_data(cfg).train, 0, 4, 4, 0, 1)[0]  # the first global batch
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(tokens).logits.flatten(0, 1), labels.flatten()).item()
    assert loss == pytest.approx(want, rel=1e-6)

    out = tmp_path / "out"
    assert main(["--load", str(tmp_path / "ckpt"), "--to-hf", str(out)]) == 0
    back, original = load_file(out / "model.safetensors"), load_file(f"{folder}/model.safetensors")
    assert sorted(back) == sorted(original) and ("lm_head.weight" in back) == (family != "qwen2")
    for name, t in original.items():
        assert torch.equal(back[name], t), name
    written = json.loads((out / "config.json").read_text())
    given = json.loads(open(f"{folder}/config.json").read())
    assert written["model_type"] == given["model_type"] and written["rope_parameters"] == given["rope_parameters"]
    assert written["architectures"] == given["architectures"] and written.get("head_dim") == given.get("head_dim")
    for key in ("sliding_window", "use_sliding_window", "layer_types"):  # what transformers reads of the window
        assert written.get(key) == given.get(key), key
    assert config_from_hf(written, seq_length=16) == config_from_hf(given, seq_length=16)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kv_cache_greedy_tokens_equal_transformers_past_the_original_context(family, folders):
    """32 greedy tokens after a 48-token prompt (positions up to 80, past llama3's and Qwen3's
    original 64 and Qwen3-MoE's 32): the KV-cache decoding of model/sampling.py (rotated keys
    cached with the scaled angles and YaRN's attention factor) gives transformers' ``generate`` tokens."""
    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_model
    from model.sampling import sample

    folder, hf, _ = folders[family]
    stage, _ = load_model(generate_args(folder), ProcessGroups.single(), torch.device("cpu"), need_tokenizer=False)
    prompt = torch.randint(1, 300, (48,), generator=torch.Generator().manual_seed(7)).tolist()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert len(want[0]) == 80
    assert sample(stage, prompt, 32, temperature=0.0) == want[0].tolist()


def _first_loss(rank, world, argv):
    return train_steps(hf_trainer(argv, world), 1)[0]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_first_loss_under_expert_parallelism_equals_transformers(family, folders):
    """The Qwen3-MoE, gpt-oss and DeepSeek-V3 folders under dp 2 x ep 2 (each rank holds half the
    experts and its tokens travel to them): the first step's loss equals transformers' on the same
    global batch (1e-6)."""
    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.config import config_from_argv

    folder, hf, argv = folders[family]
    argv = argv + ["--from-hf", folder, "--dp", "2", "--expert-model-parallel-size", "2"]
    loss = run_distributed(_first_loss, 2, argv)[0]
    tokens, labels = get_micro_batches(training.build_data(config_from_argv(argv, 2)).train, 0, 4, 4, 0, 1)[0]
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(tokens).logits.flatten(0, 1), labels.flatten()).item()
    assert loss == pytest.approx(want, rel=1e-6)


PP_CP = {
    "pp2-tp2": ["--pp", "2", "--tp", "2"],
    "cp2-tp2-ring": ["--cp", "2", "--tp", "2"],
    "cp2-dp2-a2a": ["--cp", "2", "--dp", "2", "--cp-comm-type", "a2a"],  # a2a: kv groups 2 over tp x cp
}


def _losses_then_save(rank, world, runs):
    """Per (argv, steps, save or None): the losses of ``steps`` steps, then a checkpoint."""
    out = []
    for argv, steps, save in runs:
        trainer = hf_trainer(argv, world)
        out.append(train_steps(trainer, steps))
        if save:
            trainer.save_checkpoint(save, wait=True)
        trainer.close()
    return out


def test_families_under_pp_and_cp_and_exported_after_three_steps_at_tp2_pp2(folders, tmp_path):
    """Each family from ``--from-hf`` under pp 2 x tp 2, cp 2 x tp 2 (ring) and cp 2 x dp 2
    (all-to-all: its 2 KV groups split over tp x cp; the MoE families too, their routing over
    the whole micro-batch on every cp rank; DeepSeek-V3's MLA too),
    in one spawn of 4 ranks: the first loss
    equals transformers' on the same batch within 1e-6. The pp 2 x tp 2 run trains 3 steps and
    saves; ``convert_checkpoint.py --to-hf`` of that checkpoint is a folder transformers loads
    whose logits equal megazero's (the checkpoint's weights in one process) within 1e-5, and
    whose weights moved from the input's (the checkpoint's expert biases loaded into megazero's
    model and written as DeepSeek-V3's ``e_score_correction_bias``)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.checkpoint import read_full_weights
    from megazero.config import config_from_argv
    from megazero.process_groups import ProcessGroups
    from model.gpt import GPTStage
    from model.hf import config_from_record
    from model.moe_state import load_expert_bias
    from scripts.convert_checkpoint import main

    runs, names = [], []
    for family, (folder, _, argv) in folders.items():
        for name, flags in PP_CP.items():
            trained = name == "pp2-tp2"
            save = str(tmp_path / family) if trained else None
            runs.append((argv + ["--from-hf", folder, "--train-iters", "3"] + flags, 3 if trained else 1, save))
            names.append((family, name))
    got = dict(zip(names, run_distributed(_losses_then_save, 4, runs, timeout_s=900)[0]))

    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    for family, (folder, hf, argv) in folders.items():
        cfg = config_from_argv(argv + ["--tp", "2", "--pp", "2"], 4)
        tokens, labels = get_micro_batches(training.build_data(cfg).train, 0, 4, 4, 0, 1)[0]
        with torch.no_grad():
            want = torch.nn.functional.cross_entropy(hf(tokens).logits.flatten(0, 1), labels.flatten()).item()
        for name in PP_CP:
            assert got[family, name][0] == pytest.approx(want, rel=1e-6), (family, name)

        out = tmp_path / f"{family}_hf"
        assert main(["--load", str(tmp_path / family), "--to-hf", str(out)]) == 0
        meta, full = read_full_weights(str(tmp_path / family))
        gcfg = config_from_record(meta["extra"]["gpt_config"], hidden_dropout=0.0, attention_dropout=0.0)
        ours = GPTStage(gcfg, ProcessGroups.single(), range(gcfg.num_layers), True, True, 0, full_weights=full)
        load_expert_bias([ours], meta["extra"].get("moe_expert_bias", {}))
        theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        with torch.no_grad():
            a, b = ours.eval()(ids)[..., :300], theirs(ids).logits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        before, after = load_file(f"{folder}/model.safetensors"), load_file(out / "model.safetensors")
        assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4, family  # trained


@pytest.mark.slow
def test_deepseek_v3_trained_at_tp2_pp2_ep2_exports_to_transformers(folders, tmp_path):
    """The DeepSeek-V3 folder on 8 ranks, tp 2 x pp 2 x dp 2 with expert parallelism 2 (each rank 4
    of the 8 experts): the first loss equals transformers' on the same batch (1e-6); 3 steps trained
    (weights and the expert biases move), saved, exported (``convert_checkpoint.py --to-hf``) and
    loaded by transformers give the logits of megazero's model of that checkpoint within 1e-5, which
    the generate / evaluate loader (``--load``) gives too, the expert biases read from ``meta.pt``."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.checkpoint import read_full_weights
    from megazero.config import config_from_argv
    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_model
    from model.gpt import GPTStage
    from model.hf import config_from_record
    from model.moe_state import load_expert_bias
    from scripts.convert_checkpoint import main

    folder, hf, argv = folders["deepseek-v3"]
    layout = ["--tp", "2", "--pp", "2", "--dp", "2", "--expert-model-parallel-size", "2"]
    argv = argv + ["--from-hf", folder, "--train-iters", "3"] + layout
    save = str(tmp_path / "ckpt")
    losses = run_distributed(_losses_then_save, 8, [(argv, 3, save)], timeout_s=900)[0][0]
    tokens, labels = get_micro_batches(training.build_data(config_from_argv(argv, 8)).train, 0, 4, 4, 0, 1)[0]
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(tokens).logits.flatten(0, 1), labels.flatten()).item()
    assert losses[0] == pytest.approx(want, rel=1e-6)

    out = tmp_path / "hf"
    assert main(["--load", save, "--to-hf", str(out)]) == 0
    meta, full = read_full_weights(save)
    gcfg = config_from_record(meta["extra"]["gpt_config"], hidden_dropout=0.0, attention_dropout=0.0)
    ours = GPTStage(gcfg, ProcessGroups.single(), range(gcfg.num_layers), True, True, 0, full_weights=full)
    load_expert_bias([ours], meta["extra"]["moe_expert_bias"])
    source = SimpleNamespace(load=save, from_hf=None, tokenizer_model=None, tokenizer_type=None)
    loaded, _ = load_model(source, ProcessGroups.single(), torch.device("cpu"), need_tokenizer=False)
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours.eval()(ids)[..., :300], theirs(ids).logits
        generated = loaded.eval()(ids)[..., :300]  # the generate / evaluate loader: the biases from meta.pt too
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    torch.testing.assert_close(generated, a, rtol=0, atol=0)
    before, after = load_file(f"{folder}/model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert (
        after["model.layers.1.mlp.experts.5.down_proj.weight"] - before["model.layers.1.mlp.experts.5.down_proj.weight"]
    ).abs().max() > 1e-4
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(after[bias], before[bias])  # the aux-loss-free bias was updated and exported
