"""Export a megazero checkpoint (saved under any layout) as a Hugging Face model folder, or
consolidate its shards into full tensors. Run from the repository root:

    python -m scripts.convert_checkpoint --load CKPT_DIR --to-hf OUT \\
        [--tokenizer-model PATH --tokenizer-type {SentencePieceTokenizer,HuggingFaceTokenizer}] \\
        [--max-shard-size 5GB]
    python -m scripts.convert_checkpoint --load CKPT_DIR --consolidate OUT
    python -m scripts.convert_checkpoint --print-flags HF_DIR

``--print-flags`` prints, on one line, the megazero model flags (Megatron-LM spelling) whose model is
the one in the Hugging Face folder ``HF_DIR`` (``model.hf_flags.folder_flags``: sizes, vocabulary,
norms, RoPE and its scaling, head size, QK-norm, biases, grouped-query attention, sliding window,
softmax, gated MLP, experts), so that a run starts from it with
``--from-hf HF_DIR $(python -m scripts.convert_checkpoint --print-flags HF_DIR)``; the folder's
config.json and every tensor's shape are checked first.

``--consolidate`` writes ``OUT/iter_<N>/`` (and ``OUT/latest``): the same checkpoint with every
key stored as ONE full tensor (``megazero.checkpoint.consolidate_checkpoint``).

``--to-hf`` writes ``OUT/config.json`` and ``OUT/model.safetensors`` of a ``GPT2LMHeadModel`` (GPT-2
block) or ``LlamaForCausalLM`` (LLaMA-style block, RoPE scaling and ``--kv-channels`` included;
``Qwen2ForCausalLM`` with ``--add-qkv-bias``, ``Qwen3ForCausalLM`` with ``--qk-layernorm``; with
experts ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` with ``--qk-layernorm``, or
``Qwen2MoeForCausalLM`` with a shared expert; ``GptOssForCausalLM``; ``DeepseekV3ForCausalLM`` with
``--multi-latent-attention``, the checkpoint's expert biases as its ``e_score_correction_bias``)
that computes what the checkpoint's model computes
(``model/hf.py``, ``model/hf_families.py`` and ``model/hf_moe.py`` hold the name map and the
differences they refuse); a reward model's checkpoint (``--post-train rm``) becomes
``GPT2ForSequenceClassification`` or ``LlamaForSequenceClassification`` (``score.weight`` [1, H], one
label, ``pad_token_id`` = EOD; ``model/hf_reward.py``), loaded with
``AutoModelForSequenceClassification``; plus the run's tokenizer, so that
``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)`` work. The checkpoint is read in this one process (full fp32
master weights; no process group). The tokenizer is the one the checkpoint recorded unless
``--tokenizer-model`` is given; its sha256 must equal the recorded one; it is exported exactly or
refused (``data.tokenizer_export.write_hf_tokenizer``). A model of more than ``--max-shard-size``
bytes (default 5GB; ``500MB``, ``2000000`` bytes: decimal units as ``save_pretrained``'s
``max_shard_size``) is written as ``model-0000i-of-0000N.safetensors`` shards plus
``model.safetensors.index.json`` instead of ``model.safetensors``, split as ``save_pretrained``
splits (``model.hf_folder.write_tensors``). The folder appears only when complete (temporary
name, then rename; on a failure the temporary folder is removed).

Errors: one line ``convert_checkpoint: error: ...`` and exit code 2.

API: ``main(argv)`` takes the command line as a list (without the program name) and returns the
exit status; nothing else here is meant to be imported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from data.indexed_dataset import DataError
from data.tokenizer_export import write_hf_tokenizer
from megazero.checkpoint import CheckpointError, consolidate_checkpoint, read_full_weights
from megazero.runtime.extras import MissingExtra, require
from model.hf import HFConversionError, config_from_record, hf_config, to_hf_tensors
from model.hf_flags import folder_flags
from model.hf_folder import DEFAULT_MAX_SHARD_SIZE, parse_shard_size, write_tensors
from model.hf_reward import reward_architecture, to_hf_reward


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
        raise ConvertError(
            f"tokenizer {model} (sha256 {tok.sha256[:12]}) is not the one the checkpoint was "
            f"trained with (sha256 {want[:12]}); fix: --tokenizer-model of that run"
        )
    return tok


def convert(
    load: str,
    out: str,
    tokenizer_model: str | None = None,
    tokenizer_type: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> dict:
    """Write the Hugging Face folder ``out`` from the latest checkpoint under ``load``; tensors
    above ``max_shard_size`` (bytes, or a size such as ``"5GB"``: ``parse_shard_size``) in all
    are written as shards plus ``model.safetensors.index.json``.

    Returns the written ``config.json`` as a dict. Raises ConvertError, CheckpointError,
    HFConversionError or DataError (message names the difference) before anything is written;
    MissingExtra (megazero.runtime.extras) without the optional extra ``hf``, before reading.
    """
    try:
        max_shard_size = parse_shard_size(max_shard_size)
    except ValueError as e:
        raise ConvertError(f"--max-shard-size {e}; fix: e.g. --max-shard-size 5GB") from None
    require("safetensors.torch", "--to-hf")
    require("tokenizers", "--to-hf")  # the tokenizer's export (data.tokenizer)
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise ConvertError(f"--to-hf {out} exists and is not empty (or not a folder); fix: choose a new folder")
    meta, full = read_full_weights(load)
    record = meta["extra"].get("gpt_config")
    if record is None:
        raise ConvertError(
            f"--load {load}: the checkpoint does not record its model settings (saved by an "
            "older megazero); fix: resume it for one iteration with this version and save"
        )
    gcfg = config_from_record(record, hidden_dropout=0.0, attention_dropout=0.0)
    if gcfg.value_head:
        reward_architecture(gcfg)  # refused before the tokenizer is read
    else:
        tensors = to_hf_tensors(full, gcfg, meta["extra"].get("moe_expert_bias"))
    tok = resolve_tokenizer(meta, tokenizer_model, tokenizer_type)
    if tok is not None and tok.vocab_size != gcfg.vocab_size:
        raise ConvertError(f"tokenizer vocabulary {tok.vocab_size} != the model's {gcfg.vocab_size}")
    eod = None if tok is None else tok.eod
    if gcfg.value_head:  # a reward model (--post-train rm): a sequence-classification folder
        tensors, config = to_hf_reward(full, gcfg, eod)
    else:
        config = hf_config(gcfg, eod=eod)
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        write_tensors(tensors, tmp, max_shard_size)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)
        if tok is not None:
            write_hf_tokenizer(tok, tmp, gcfg.max_position_embeddings)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # the output is unwritable: not a directory, no permission, disk full
            raise ConvertError(
                f"--to-hf {out}: cannot write {e.filename or tmp} ({e.strerror or e}); fix: "
                "choose a writable folder with enough space"
            ) from None
        raise
    return config


def main(argv=None) -> int:
    """Convert or consolidate as the command line ``argv`` (default ``sys.argv[1:]``) says;
    returns the exit status: 0, or 2 after the one-line error."""
    p = argparse.ArgumentParser(prog="python -m scripts.convert_checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--load", help="checkpoint directory (the run's --save); needed by --to-hf and --consolidate")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--to-hf", metavar="OUT", help="Hugging Face folder to write")
    what.add_argument(
        "--consolidate", metavar="OUT", help="new checkpoint directory to write with full tensors (one chunk per key)"
    )
    what.add_argument(
        "--print-flags",
        metavar="HF_DIR",
        help="print the megazero model flags of this Hugging Face folder on one line (for --from-hf HF_DIR)",
    )
    p.add_argument("--tokenizer-model", help="tokenizer to export (default: the one the checkpoint recorded)")
    p.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="--to-hf: the most bytes per safetensors file (2000000, 500MB, 5GB; decimal units); "
        "a larger model is written as shards plus model.safetensors.index.json (default: %(default)s)",
    )
    args = p.parse_args(argv)
    try:
        if args.print_flags is not None:
            if args.load is not None:
                raise ConvertError("--print-flags reads a Hugging Face folder, not --load; fix: leave --load out")
            print(" ".join(folder_flags(args.print_flags)))
            return 0
        if args.load is None:
            raise ConvertError("--to-hf and --consolidate read a checkpoint; fix: --load CKPT_DIR (the run's --save)")
        if args.consolidate:
            print(f"wrote {consolidate_checkpoint(args.load, args.consolidate)} (full tensors)")
            return 0
        config = convert(args.load, args.to_hf, args.tokenizer_model, args.tokenizer_type, args.max_shard_size)
    except (ConvertError, CheckpointError, HFConversionError, DataError, MissingExtra) as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.to_hf}: {config['architectures'][0]}, "
        f"{config.get('n_layer', config.get('num_hidden_layers'))} layers, "
        f"hidden {config.get('n_embd', config.get('hidden_size'))}, vocabulary {config['vocab_size']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
