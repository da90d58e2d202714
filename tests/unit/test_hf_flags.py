"""``python -m scripts.convert_checkpoint --print-flags FOLDER`` (model/hf_flags.py): for every family
folder (Llama-3.x, Mistral, Qwen2, Qwen3, Qwen3-MoE and gpt-oss of tests/support/hf_families.py;
GPT-2, Llama-2, Mixtral and Qwen2-MoE written here) the printed flags, with a run's data flags and
``--from-hf FOLDER``, give a config that ``model.build.check_from_hf`` accepts and whose GPTConfig
equals ``model.hf.config_from_hf`` of the folder on every model field; gpt-oss's hand-written flags
give the same GPTConfig as its printed ones; a field no flag expresses is refused by name; a folder
that is not a model folder is one line and exit code 2. One process, no spawns."""

import dataclasses
import json

import pytest
import torch

from tests.support.extras import require
from tests.support.hf_convert import MODEL
from tests.support.hf_families import FAMILIES, HAND


def _model_fields(gcfg):
    from model.hf_flags import RUN_FIELDS

    return {f.name: getattr(gcfg, f.name) for f in dataclasses.fields(gcfg) if f.name not in RUN_FIELDS}


def _run_config(argv, vocab):
    """The run's (Config, GPTConfig) of ``argv``, after ``check_from_hf`` accepted it."""
    from megazero.config import config_from_argv
    from model.build import build_gpt_config, check_from_hf

    cfg = config_from_argv(argv, 1, print_warnings=False)
    check_from_hf(cfg, vocab)
    return cfg, build_gpt_config(cfg, vocab)


def _check_folder_flags(folder, data, vocab, capsys):
    """The printed line of ``folder``, and the GPTConfig of a run given it: equal to the folder's on
    every model field; returns that GPTConfig."""
    from model.hf import config_from_hf
    from model.hf_flags import folder_flags
    from model.hf_folder import read_config
    from scripts.convert_checkpoint import main

    flags = folder_flags(folder)
    assert main(["--print-flags", folder]) == 0
    assert capsys.readouterr().out == " ".join(flags) + "\n"
    cfg, ours = _run_config(MODEL + data + flags + ["--from-hf", folder], vocab)
    want = config_from_hf(read_config(folder), seq_length=cfg.model.seq_length)
    assert _model_fields(ours) == _model_fields(want)
    return ours


def test_printed_flags_give_the_folders_model(folders, capsys):
    from model.hf_flags import folder_flags

    for family, (folder, _, argv) in folders.items():
        flags = FAMILIES[family][2] or folder_flags(folder)
        data = argv[len(MODEL) + len(flags) :]
        ours = _check_folder_flags(folder, data, 300, capsys)
        assert ours.hf_model_type == {"mistral": "mistral", "gpt-oss": "gpt_oss"}.get(family)  # --from-hf gives it
        if family == HAND:  # the hand-written flags: another spelling ("4" for 4.0), the same model
            hand = FAMILIES[HAND][2]
            assert hand != folder_flags(folder)
            assert _run_config(MODEL + data + hand + ["--from-hf", folder], 300)[1] == ours
    line = folder_flags(folders["qwen3-moe"][0])
    for flags in (["--kv-channels", "12"], ["--qk-layernorm"], ["--moe-router-pre-softmax"], ["--yarn-mscale", "1.0"]):
        assert " ".join(flags) in " ".join(line)


def _write(folder, cls_name, **options):
    import transformers

    config = getattr(transformers, cls_name)(
        vocab_size=96, num_hidden_layers=2, hidden_size=32, num_attention_heads=4, **options
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("shared_expert_gate.weight"):
                p.zero_()  # megazero's ungated shared expert (model/hf_moe.py)
    model.save_pretrained(folder)


OTHER = {  # families the family fixture lacks: transformers class, options, a flag the line must hold
    "gpt2": ("GPT2Config", {}, "--openai-gelu"),
    "llama2": ("LlamaConfig", dict(intermediate_size=64, max_position_embeddings=128), "--rotary-base 10000"),
    "mixtral": (
        "MixtralConfig",
        dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2),
        "--num-experts 4 --moe-ffn-hidden-size 48",
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            shared_expert_intermediate_size=24,
            qkv_bias=False,
            num_key_value_heads=2,
        ),
        "--moe-shared-expert-intermediate-size 24",
    ),
}


@pytest.mark.parametrize("family", list(OTHER))
def test_printed_flags_of_gpt2_llama2_mixtral_and_qwen2_moe(family, tmp_path, capsys):
    require("transformers")
    from model.hf_flags import folder_flags

    cls_name, options, expected = OTHER[family]
    if family == "gpt2":
        options = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)
        import transformers

        transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=96, **options)).save_pretrained(tmp_path)
    else:
        _write(tmp_path, cls_name, **options)
    ours = _check_folder_flags(str(tmp_path), ["--mock-data"], 96, capsys)
    assert expected in " ".join(folder_flags(str(tmp_path))) and ours.vocab_size == 96


def test_fields_no_flag_expresses_are_refused_by_name():
    from megazero.config import config_from_argv
    from model.config import GPTConfig
    from model.hf_config import HFConversionError
    from model.hf_flags import model_flags

    base = dict(vocab_size=64, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    with pytest.raises(HFConversionError, match="^value_head: a reward model"):
        model_flags(GPTConfig(**base, value_head=True))
    with pytest.raises(HFConversionError, match=r"^--rotary-base takes a whole number; the model has 10000\.5"):
        model_flags(GPTConfig(**base, position_embedding_type="rope", rotary_base=10000.5))
    wider = dataclasses.make_dataclass("Wider", [("new_knob", int, dataclasses.field(default=3))], bases=(GPTConfig,))
    with pytest.raises(HFConversionError, match="^GPTConfig field new_knob = 3 has no megazero flag"):
        model_flags(wider(**base))
    # an unbounded window (L = -1) is written with "=", which argparse does not take for a flag
    flags = model_flags(GPTConfig(**base, position_embedding_type="rope", window_size=[-1, 0]))
    assert "--window-size=-1,0" in flags and "--rotary-base" in flags
    cfg = config_from_argv(["--mock-data", "--seq-length", "16"] + flags, 1, print_warnings=False)
    assert cfg.model.window_size == [-1, 0] and cfg.data.vocab_size == 64
    assert model_flags(GPTConfig(**base)) == [
        "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--ffn-hidden-size", "128", "--max-position-embeddings", "16", "--layernorm-epsilon", "1e-05",
    ]  # fmt: skip


def test_not_a_model_folder_is_one_line_and_exit_2(tmp_path, capsys):
    from scripts.convert_checkpoint import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    for path, starts in (
        (tmp_path / "nothing", f"{tmp_path / 'nothing'} is not a folder"),
        (tmp_path / "empty", f"{tmp_path / 'empty'} holds no config.json"),
        (tmp_path / "bert", f"{tmp_path / 'bert' / 'config.json'}: model_type 'bert'"),
    ):
        assert main(["--print-flags", str(path)]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert captured.out == "" and len(err) == 1 and err[0].startswith(f"convert_checkpoint: error: {starts}")
    assert main(["--to-hf", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        "convert_checkpoint: error: --to-hf and --consolidate read a checkpoint; fix: --load CKPT_DIR "
        "(the run's --save)\n"
    )
