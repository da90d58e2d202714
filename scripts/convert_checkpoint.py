"""Export a megazero checkpoint (saved under any layout) as a Hugging Face model folder, or
consolidate its shards into full tensors.

    python scripts/convert_checkpoint.py --load CKPT_DIR --to-hf OUT \\
        [--tokenizer-model PATH --tokenizer-type {SentencePieceTokenizer,HuggingFaceTokenizer}]
    python scripts/convert_checkpoint.py --load CKPT_DIR --consolidate OUT

``--consolidate`` writes ``OUT/iter_<N>/`` (and ``OUT/latest``): the same checkpoint with every
key ``"<name>/<state>"`` stored as ONE full tensor (the format megazero saved before sharded
checkpoints; ``megazero.checkpoint.load`` reads it under any layout, like the sharded one),
``meta.pt`` with the new files' sizes and CRC-32, and the ``rng_<rank>.pt`` files. It runs in
this one process and holds every full tensor (offline use; the CRC-32 of the input is checked
first).

writes ``OUT/config.json`` and ``OUT/model.safetensors`` of a ``GPT2LMHeadModel`` (GPT-2
block) or ``LlamaForCausalLM`` (LLaMA-style block; with experts ``MixtralForCausalLM``, or
``Qwen2MoeForCausalLM`` with a shared expert) that computes what the checkpoint's model computes (``model/hf.py`` and
``model/hf_moe.py`` hold the name map and the differences they refuse), plus the run's tokenizer, so that
``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)``
work. The checkpoint is read in this one process (full fp32 master weights; no process
group). The tokenizer is the one the checkpoint recorded unless ``--tokenizer-model`` is
given; its sha256 must equal the recorded one. A Hugging Face ``tokenizer.json`` is written
as is; a sentencepiece model is converted (``data.tokenizer.sentencepiece_to_hf``) and
exported only when it encodes a check set (unicode, whitespace, a literal "▁", standard
library files) exactly as megazero does, else refused. The folder appears only when
complete (temporary name, then rename).
Errors: one line ``convert_checkpoint: error: ...`` and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.checkpoint import (CheckpointError, file_checksum, iteration_dir, peek, publish,  # noqa: E402
                                 read_full_tensors, read_full_weights, rng_files)
from megazero.runtime.extras import MissingExtra, require  # noqa: E402
from data.indexed_dataset import DataError  # noqa: E402
from model.hf import HFConversionError, config_from_record, hf_config, to_hf_tensors  # noqa: E402


class ConvertError(RuntimeError):
    """A conversion that cannot be done; the message names the input and the fix."""


def resolve_tokenizer(meta: dict, model: str | None, kind: str | None):
    """The checkpoint's tokenizer (a ``data.tokenizer`` object) or None for a mock-data run.

    Raises ConvertError when the given or recorded tokenizer is missing or is not the one
    the checkpoint was trained with (sha256)."""
    from data.tokenizer import load_tokenizer

    recorded = meta["extra"].get("tokenizer") or {}
    model = model or recorded.get("model")
    if model is None:
        return None
    try:
        tok = load_tokenizer(model, kind or recorded.get("type", "SentencePieceTokenizer"))
    except DataError as e:
        raise ConvertError(f"tokenizer: {e}") from None
    want = recorded.get("sha256") or (meta["extra"].get("data") or {}).get("tokenizer")
    if want and tok.sha256 != want:
        raise ConvertError(f"tokenizer {model} (sha256 {tok.sha256[:12]}) is not the one the checkpoint was "
                           f"trained with (sha256 {want[:12]}); fix: --tokenizer-model of that run")
    return tok


CHECK_TEXTS = ("def f(x):\n    return x ** 2  # square\n", "Ünïcödé ☃ 日本語 — emoji 😀\ttab\r\nCRLF",
               "  leading and trailing spaces  ", "a literal \u2581 and \u2581\u2581", "x\n\n\t \n")


def check_texts(count: int = 40) -> list[str]:
    """Texts an exported sentencepiece tokenizer must encode exactly as megazero does: a few
    hand-made ones (unicode, whitespace, "▁") and the first ``count`` standard-library files."""
    from data.corpus import list_files, stdlib_root

    root, texts = stdlib_root(), list(CHECK_TEXTS)
    for rel in list_files(root)[:count]:
        try:
            texts.append(open(os.path.join(root, rel), encoding="utf-8", newline="").read())
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def hf_tokenizer_of(tok):
    """A ``tokenizers.Tokenizer`` giving ``tok``'s ids: the run's own tokenizer.json, or the
    converted sentencepiece model after a check that it encodes ``check_texts`` identically."""
    from data.tokenizer import HFTokenizer, sentencepiece_to_hf

    if isinstance(tok, HFTokenizer):
        return tok.tok
    hf = sentencepiece_to_hf(tok)
    for text in check_texts():
        if hf.encode(text, add_special_tokens=False).ids != tok.encode(text):
            raise ConvertError(f"the sentencepiece tokenizer {tok.model_path} has no exact Hugging Face "
                               f"equivalent (the ids of {text[:40]!r} differ); fix: train with "
                               "--tokenizer-type HuggingFaceTokenizer, or pass one with --tokenizer-model")
    return hf


def write_tokenizer(tok, out: str, max_length: int) -> None:
    """Files for ``AutoTokenizer.from_pretrained(out)`` that encode as ``tok`` does.
    Raises ConvertError when no exact equivalent exists."""
    hf = hf_tokenizer_of(tok)
    hf.save(os.path.join(out, "tokenizer.json"))
    eod = hf.id_to_token(tok.eod)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eod, "eos_token": eod,
              "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)


def convert(load: str, out: str, tokenizer_model: str | None = None, tokenizer_type: str | None = None) -> dict:
    """Write the Hugging Face folder ``out`` from the latest checkpoint under ``load``.

    Returns the written ``config.json`` as a dict. Raises ConvertError, CheckpointError,
    HFConversionError or DataError (message names the difference) before anything is written;
    MissingExtra (megazero.runtime.extras) without the optional extra ``hf``, before reading.
    """
    save_file = require("safetensors.torch", "--to-hf").save_file
    require("tokenizers", "--to-hf")  # the tokenizer's export (data.tokenizer)
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise ConvertError(f"--to-hf {out} exists and is not empty (or not a folder); fix: choose a new folder")
    meta, full = read_full_weights(load)
    record = meta["extra"].get("gpt_config")
    if record is None:
        raise ConvertError(f"--load {load}: the checkpoint does not record its model settings (saved by an "
                           "older megazero); fix: resume it for one iteration with this version and save")
    gcfg = config_from_record(record, hidden_dropout=0.0, attention_dropout=0.0)
    tensors = to_hf_tensors(full, gcfg)
    tok = resolve_tokenizer(meta, tokenizer_model, tokenizer_type)
    if tok is not None and tok.vocab_size != gcfg.vocab_size:
        raise ConvertError(f"tokenizer vocabulary {tok.vocab_size} != the model's {gcfg.vocab_size}")
    config = hf_config(gcfg, eod=None if tok is None else tok.eod)
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)
        if tok is not None:
            write_tokenizer(tok, tmp, gcfg.max_position_embeddings)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # the output is unwritable: not a directory, no permission, disk full
            raise ConvertError(f"--to-hf {out}: cannot write {e.filename or tmp} ({e.strerror or e}); fix: "
                               "choose a writable folder with enough space") from None
        raise
    return config


def consolidate(load: str, out: str) -> str:
    """Write the latest checkpoint under ``load`` with full tensors under the new root ``out``
    (see the module docstring); returns the written iteration directory. Raises ConvertError
    when ``out`` is not empty, CheckpointError for a damaged input."""
    import torch.distributed.checkpoint as dcp

    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise ConvertError(f"--consolidate {out} exists and is not empty (or not a folder); fix: choose a new "
                           "folder")
    peek(load, verify=True)
    meta, src, full = read_full_tensors(load)
    tmp = iteration_dir(out, meta["iteration"]) + ".tmp"
    os.makedirs(tmp)
    with warnings.catch_warnings():  # DCP warns that it saves in one process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(full, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
    del full
    for name in rng_files(meta["layout"]):
        shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
    files = [n for n in os.listdir(tmp) if n.endswith(".distcp") or n.startswith("rng_") or n == ".metadata"]
    meta = dict(meta, files={n: file_checksum(os.path.join(tmp, n)) for n in sorted(files)})
    with open(os.path.join(tmp, "meta.pt"), "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())
    return publish(out, meta["iteration"], tmp)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/convert_checkpoint.py", description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (the run's --save)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--to-hf", metavar="OUT", help="Hugging Face folder to write")
    what.add_argument("--consolidate", metavar="OUT",
                      help="new checkpoint directory to write with full tensors (one chunk per key)")
    p.add_argument("--tokenizer-model", help="tokenizer to export (default: the one the checkpoint recorded)")
    p.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    args = p.parse_args(argv)
    try:
        if args.consolidate:
            print(f"wrote {consolidate(args.load, args.consolidate)} (full tensors)")
            return 0
        config = convert(args.load, args.to_hf, args.tokenizer_model, args.tokenizer_type)
    except (ConvertError, CheckpointError, HFConversionError, DataError, MissingExtra) as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.to_hf}: {config['architectures'][0]}, "
          f"{config.get('n_layer', config.get('num_hidden_layers'))} layers, "
          f"hidden {config.get('n_embd', config.get('hidden_size'))}, vocabulary {config['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
