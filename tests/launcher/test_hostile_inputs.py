"""Hostile inputs stop before launch with one line and exit code 2, never a traceback
(docs/design.md, contract 3), from the launcher's preflight (``training.preflight``),
``python -m scripts.generate`` and ``python -m scripts.convert_checkpoint``:

- a --from-hf folder whose tensors contradict its config.json: another width, one tensor
  transposed, one missing, an integer tensor (every tensor's shape and dtype is checked
  against what the map converts, ``model.hf.hf_shapes``, reading headers only);
- damaged files, one per error class of the readers (``model/hf_folder.py`` lists them): a
  truncated, empty or garbage model.safetensors, a directory in its place, a config.json that
  is truncated, not UTF-8, nested too deep, not an object, or lacks / mistypes a size;
- a missing optional extra (safetensors, tokenizers, wandb hidden): ``<what> needs the
  optional extra hf (...); fix: pip install -e .[hf]``;
- generate.py --tp 2 outside torchrun checks its inputs before it starts torchrun, so a bad
  folder ends with the one line alone (no torchrun failure summary).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.extras import require
from tests.support.hf_tokenizer import corpus
from tests.support.paths import REPO

ROOT = REPO
MODEL = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
ARGV = [
    "--mock-data",
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
    "--train-iters",
    "2",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
]


def _gcfg(vocab, **kw):
    from model.config import GPTConfig

    return GPTConfig(vocab_size=vocab, **{**MODEL, **kw})


def _tensors(gcfg):
    from model.gpt import init_full_weights
    from model.hf import to_hf_tensors

    return to_hf_tensors(init_full_weights(gcfg, seed=1), gcfg)


def _write(d: Path, gcfg, tensors=None, config=None, tok_dir=None) -> Path:
    """A Hugging Face folder: ``gcfg``'s tensors (or ``tensors``), its config.json (or ``config``)."""
    from safetensors.torch import save_file

    from model.hf import hf_config

    d.mkdir(parents=True, exist_ok=True)
    save_file(_tensors(gcfg) if tensors is None else tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(hf_config(gcfg) if config is None else config))
    if tok_dir is not None:
        shutil.copy(tok_dir / "tokenizer.json", d / "tokenizer.json")
    return d


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """(folder of a tiny GPT-2 with a tokenizer.json, its vocabulary, the run's argv)."""
    require("safetensors")
    from data.tokenizer import load_tokenizer, train_hf_tokenizer

    d = tmp_path_factory.mktemp("hostile")
    tok = load_tokenizer(
        train_hf_tokenizer(corpus(200), 300, str(d / "tok" / "tokenizer.json")), "HuggingFaceTokenizer"
    )
    vocab = tok.vocab_size
    return _write(d / "good", _gcfg(vocab), tok_dir=d / "tok"), vocab, ARGV + ["--vocab-size", str(vocab)]


def _edit_config(**change):
    def edit(d, vocab):
        config = json.loads((d / "config.json").read_text())
        for k, v in change.items():
            config.pop(k) if v is _DROP else config.__setitem__(k, v)
        (d / "config.json").write_text(json.dumps(config))

    return edit


def _edit_tensors(fn):
    def edit(d, vocab):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        fn(tensors)
        save_file(tensors, str(d / "model.safetensors"))

    return edit


def _raw(name, data):
    def edit(d, vocab):
        (d / name).write_bytes(data(d / name) if callable(data) else data)

    return edit


def _as_directory(d, vocab):
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


_DROP = object()
C_FC = "transformer.h.1.mlp.c_fc.weight"
# name -> (how the good folder is damaged, what the one line must say)
CASES = {
    "tensors_wider_than_config_json": (
        lambda d, vocab: _write(d, _gcfg(vocab), tensors=_tensors(_gcfg(vocab, hidden_size=64))),
        "model.safetensors: tensor 'transformer.wte.weight' has shape (VOCAB, 64), config.json's model needs "
        "(VOCAB, 32)",
    ),
    "one_tensor_transposed": (
        _edit_tensors(lambda t: t.__setitem__(C_FC, t[C_FC].t().contiguous())),
        f"tensor '{C_FC}' has shape (128, 32), config.json's model needs (32, 128)",
    ),
    "one_tensor_missing": (
        _edit_tensors(lambda t: t.pop("transformer.h.0.ln_2.bias")),
        "model.safetensors has no tensor 'transformer.h.0.ln_2.bias'",
    ),
    "integer_tensor": (
        _edit_tensors(lambda t: t.__setitem__("transformer.ln_f.weight", torch.ones(32, dtype=torch.int64))),
        "tensor 'transformer.ln_f.weight' has dtype I64",
    ),
    "truncated_safetensors": (
        _raw("model.safetensors", lambda p: p.read_bytes()[: p.stat().st_size // 2]),
        "model.safetensors: cannot be read (SafetensorError: Error while deserializing header",
    ),
    "empty_safetensors": (_raw("model.safetensors", b""), "model.safetensors: cannot be read (SafetensorError"),
    "garbage_safetensors": (_raw("model.safetensors", bytes(range(256)) * 4), "cannot be read (SafetensorError"),
    "truncated_config_json": (
        _raw("config.json", lambda p: p.read_bytes()[:40]),
        "config.json: cannot be read (JSONDecodeError",
    ),
    "config_json_not_utf8": (
        _raw("config.json", lambda p: b'{"x": "\xff", ' + p.read_bytes()[1:]),
        "config.json: cannot be read (UnicodeDecodeError",
    ),
    "config_json_nested_too_deep": (
        _raw("config.json", b"[" * 100000 + b"]" * 100000),
        "config.json: cannot be read (RecursionError",
    ),
    "config_json_a_list": (_raw("config.json", b"[1, 2]"), "config.json: holds a JSON list, not an object"),
    "config_json_lacks_a_size": (
        _edit_config(n_embd=_DROP),
        "config.json: 'n_embd' is missing; fix: a complete config.json",
    ),
    "config_json_size_is_text": (_edit_config(n_embd="32"), 'n_embd = "32" is not a whole number >= 1'),
    "config_json_epsilon_nan": (
        _edit_config(layer_norm_epsilon=float("nan")),
        "layer_norm_epsilon = NaN is not a finite number > 0",
    ),
}
# the launcher's config check already refuses a folder without a file named model.safetensors
LAUNCHER_ONLY = {"safetensors_is_a_directory": (_as_directory, "model.safetensors not found")}
GENERATE_ONLY = {"safetensors_is_a_directory": (_as_directory, "model.safetensors: cannot be read (OSError")}


def _damaged(good, tmp_path, case, table):
    folder, vocab, argv = good
    d = tmp_path / case
    shutil.copytree(folder, d)
    damage, expected = table[case]
    damage(d, vocab)
    return d, expected.replace("VOCAB", str(vocab)), argv


def one_line(err: str, prefix: str) -> str:
    assert err.startswith(prefix) and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def preflight_fails(argv, capsys) -> str:
    """training.preflight (what the launcher runs before torchrun) returns 2 (or, for a config
    rule, exits 2) with one 'megazero: ... error:' line on stderr; returns it."""
    from megazero import training

    try:
        code = training.preflight(argv, 1)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("megazero: ") and " error: " in err.split("\n")[0], err
    return one_line(err, "megazero: ")


def generate_fails(argv, capsys) -> str:
    from scripts.generate import main

    assert main(argv + ["--prompt", "def ", "--device", "cpu"]) == 2
    return one_line(capsys.readouterr().err, "generate: error: ")


@pytest.mark.parametrize("case", sorted({**CASES, **LAUNCHER_ONLY}))
def test_a_damaged_from_hf_folder_stops_the_preflight(good, tmp_path, case, capsys):
    d, expected, argv = _damaged(good, tmp_path, case, {**CASES, **LAUNCHER_ONLY})
    err = preflight_fails(argv + ["--from-hf", str(d)], capsys)
    assert expected in err and str(d) in err


@pytest.mark.parametrize("case", sorted({**CASES, **GENERATE_ONLY}))
def test_a_damaged_folder_stops_generate(good, tmp_path, case, capsys):
    d, expected, _ = _damaged(good, tmp_path, case, {**CASES, **GENERATE_ONLY})
    err = generate_fails(["--from-hf", str(d)], capsys)
    assert expected in err and str(d) in err


def test_the_good_folder_passes_both(good, capsys):
    from megazero import training
    from scripts.generate import main

    folder, _, argv = good
    assert training.preflight(argv + ["--from-hf", str(folder)], 1) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "--from-hf",
                str(folder),
                "--prompt",
                "def ",
                "--max-new-tokens",
                "3",
                "--temperature",
                "0",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("def ")


def test_a_llama_folder_whose_key_value_heads_contradict_config_json(good, tmp_path, capsys):
    _, vocab, _ = good
    llama = dict(
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False, ffn_hidden_size=64
    )
    gqa, mha = _gcfg(vocab, num_query_groups=2, **llama), _gcfg(vocab, **llama)
    from model.hf import hf_config

    d = _write(tmp_path / "llama", mha, tensors=_tensors(gqa), config=hf_config(mha), tok_dir=good[0])
    err = generate_fails(["--from-hf", str(d)], capsys)
    assert (
        "tensor 'model.layers.0.self_attn.k_proj.weight' has shape (16, 32), config.json's model needs (32, 32)" in err
    )


def test_generate_refuses_a_tokenizer_larger_than_the_model_and_a_prompt_too_long(good, tmp_path, capsys):
    folder, vocab, _ = good
    d = _write(tmp_path / "small", _gcfg(vocab - 10), tok_dir=folder)
    assert f"has {vocab} tokens, more than the model's vocabulary of {vocab - 10}" in generate_fails(
        ["--from-hf", str(d)], capsys
    )
    from scripts.generate import main

    assert main(["--from-hf", str(folder), "--prompt", "x = 1\n" * 20, "--device", "cpu"]) == 2
    assert "more than the model's 16 positions; fix: a shorter prompt" in one_line(
        capsys.readouterr().err, "generate: error: "
    )


def test_generate_refuses_a_load_without_a_checkpoint(tmp_path, capsys):
    err = generate_fails(["--load", str(tmp_path / "none")], capsys)
    assert "no checkpoint there (no 'latest' file)" in err


def test_hf_shapes_are_the_shapes_the_export_writes():
    require("safetensors")
    from model.hf import hf_shapes

    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=48)
    for kw in (
        dict(),
        dict(tie_embeddings=False),
        dict(llama),
        dict(llama, num_query_groups=2),
        dict(llama, num_query_groups=1, add_bias_linear=False, tie_embeddings=True),
    ):
        gcfg = _gcfg(50, **kw)
        assert hf_shapes(gcfg) == {k: tuple(t.shape) for k, t in _tensors(gcfg).items()}, kw


# ---- optional extras ------------------------------------------------------------------------


def _hiding(tmp_path, *modules) -> dict:
    """An environment whose Python cannot import ``modules`` (a sitecustomize.py on PYTHONPATH
    sets them to None in sys.modules: importing one raises ModuleNotFoundError)."""
    hide = tmp_path / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hide), str(ROOT)] + env.get("PYTHONPATH", "").split(os.pathsep))
    return env


def _script(name, args, env=None, timeout=120):
    """``python -m scripts.<name> args`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", f"scripts.{name}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_pyproject_extras_are_the_ones_require_knows():
    import re

    import tomllib

    from megazero.runtime.extras import EXTRA_OF

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {
        re.split(r"[<>=!~\[ ]", req)[0]: extra for extra, reqs in extras.items() if extra != "dev" for req in reqs
    }
    assert declared == EXTRA_OF


def test_require_and_data_word_a_missing_extra_alike(monkeypatch):
    from data.indexed_dataset import DataError
    from data.tokenizer import hf_tokenizers
    from megazero.runtime.extras import MissingExtra, missing_extra_message
    from megazero.runtime.extras import require as require_extra

    for name in ("tokenizers", "wandb", "safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtra) as e:
        require_extra("safetensors.torch", "--to-hf")
    assert str(e.value) == (
        "--to-hf needs the optional extra hf (safetensors.torch is not installed); fix: pip install -e .[hf]"
    )
    with pytest.raises(DataError) as d:
        hf_tokenizers("--tokenizer-type HuggingFaceTokenizer")
    assert str(d.value) == missing_extra_message("tokenizers", "--tokenizer-type HuggingFaceTokenizer")
    from megazero.runtime.monitor import WandbLogger

    with pytest.raises(
        MissingExtra,
        match=r"--wandb-project needs the optional extra wandb \(wandb is not "
        r"installed\); fix: pip install -e .\[wandb\]",
    ):
        WandbLogger("p", None, "/nonexistent", {})


def test_preflight_without_safetensors_names_the_extra(good, monkeypatch, capsys):
    folder, _, argv = good
    monkeypatch.setitem(sys.modules, "safetensors", None)
    err = preflight_fails(argv + ["--from-hf", str(folder)], capsys)
    assert err == (
        "megazero: config error: --from-hf needs the optional extra hf (safetensors is not installed); "
        "fix: pip install -e .[hf]\n"
    )


def test_the_launcher_without_safetensors_stops_with_one_line(good, tmp_path):
    folder, _, argv = good
    env = _hiding(tmp_path, "safetensors")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # scripts/env.sh takes it
    env.pop("MEGAZERO_VENV", None)
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "pretrain_gpt.sh"),
            *argv,
            "--from-hf",
            str(folder),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr == (
        "megazero: config error: --from-hf needs the optional extra hf (safetensors is not "
        "installed); fix: pip install -e .[hf]\n"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "hidden,line",
    [
        (
            "safetensors",
            "generate: error: --from-hf needs the optional extra hf (safetensors is not installed); "
            "fix: pip install -e .[hf]\n",
        ),
        (
            "tokenizers",
            "generate: error: --tokenizer-type HuggingFaceTokenizer needs the optional extra hf "
            "(tokenizers is not installed); fix: pip install -e .[hf]\n",
        ),
    ],
)
def test_generate_without_the_hf_extra_prints_one_line(good, tmp_path, hidden, line):
    out = _script(
        "generate", ["--from-hf", str(good[0]), "--prompt", "def ", "--device", "cpu"], _hiding(tmp_path, hidden)
    )
    assert (out.returncode, out.stderr, out.stdout) == (2, line, "")


def test_convert_without_the_hf_extra_prints_one_line(tmp_path):
    for hidden in ("safetensors", "tokenizers"):
        out = _script(
            "convert_checkpoint",
            ["--load", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")],
            _hiding(tmp_path, hidden),
        )
        assert (out.returncode, out.stderr) == (
            2,
            f"convert_checkpoint: error: --to-hf needs the optional extra hf "
            f"({hidden.replace('safetensors', 'safetensors.torch')} is not "
            "installed); fix: pip install -e .[hf]\n",
        )
    (tmp_path / "file").write_text("x")
    out = _script("convert_checkpoint", ["--load", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "file")])
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "not a folder" in out.stderr, out.stderr


# ---- generate.py under torchrun -------------------------------------------------------------


def test_generate_tp2_checks_before_torchrun_starts(good, tmp_path):
    d, expected, _ = _damaged(good, tmp_path, "one_tensor_transposed", CASES)
    out = _script("generate", ["--tp", "2", "--from-hf", str(d), "--prompt", "def ", "--device", "cpu"])
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert one_line(out.stderr, "generate: error: ") and expected in out.stderr  # no ChildFailedError summary


def test_generate_tp2_through_torchrun_gives_the_tp1_text(good):
    args = [
        "--from-hf",
        str(good[0]),
        "--prompt",
        "def ",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
        "--print-ids",
        "--device",
        "cpu",
    ]
    one, two = _script("generate", args), _script("generate", ["--tp", "2"] + args, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert one.stdout == two.stdout and one.stdout.startswith("def ")
