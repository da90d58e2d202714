"""Generate text from a megazero checkpoint (any layout) or a Hugging Face GPT-2 / Llama folder.

    python scripts/generate.py (--load CKPT_DIR | --from-hf DIR) (--prompt TEXT | --prompt-ids 5,17,300) \\
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
    python scripts/generate.py --tp 2 ...                       # tensor parallel over 2 ranks
    torchrun --nproc-per-node 2 scripts/generate.py ...         # the same, under your own torchrun

Every process is one tensor-parallel rank of a whole model (tp = the number of processes,
pipeline size 1): it reads only its own partitions of the full weights (a checkpoint of any
layout, ``megazero.checkpoint.read_full_weights``; or ``model.safetensors`` through
``model/hf_folder.py``), then samples with a key/value cache (``model/sampling.py``; temperature 0
is greedy). The tokenizer is the checkpoint's recorded one (or ``--tokenizer-model``), or
the folder's ``tokenizer.json``. Rank 0 prints the text (and the ids with ``--print-ids``).
``--prompt-ids`` gives the prompt as token ids instead, so a folder or checkpoint without a
tokenizer generates too: then only the ids are printed (a JSON list), and generation stops at
``--max-new-tokens`` (no end-of-document id is known).
The same ``--seed`` gives the same text, under any tp.

Errors: one line ``generate: error: ...`` and exit code 2. Every input (the model's settings
and sizes under tp, every tensor's shape and dtype or the checkpoint's files, the tokenizer,
the prompt) is checked before any process group exists and before a weight is loaded
(``check_inputs``). ``--tp N`` (N > 1) outside torchrun runs that check once in this process
and only then replaces this process by torchrun (``python -m torch.distributed.run
--standalone --nproc-per-node N``, as scripts/pretrain_gpt.sh starts it after its preflight),
so a bad input ends with the one line alone. Under a torchrun you start yourself each rank
prints the line and exits 2, and torchrun then adds its own failure summary: torchrun reports
every non-zero exit, and exiting 0 would hide the error from whoever called it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megazero.checkpoint import CheckpointError, peek, read_full_weights  # noqa: E402
from megazero.process_groups import ProcessGroups  # noqa: E402
from megazero.runtime.extras import MissingExtra  # noqa: E402
from megazero.topology import Topology  # noqa: E402
from data.indexed_dataset import DataError  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.gpt import GPTStage  # noqa: E402
from model.hf import HFConversionError, config_from_record  # noqa: E402
from model.hf_folder import folder_config, open_folder  # noqa: E402
from model.sampling import check_prompt, sample  # noqa: E402

# what a bad input raises (ConfigError and the sampling settings' errors are ValueErrors)
INPUT_ERRORS = (CheckpointError, HFConversionError, DataError, MissingExtra, ValueError, OSError)


def model_settings(args) -> tuple[GPTConfig, str | None, str]:
    """(the model's GPTConfig with dropout off, tokenizer path or None, tokenizer type), read
    without loading a weight: --from-hf's config.json, or the meta.pt of the latest checkpoint
    under --load (``peek`` also checks its files' sizes). Raises HFConversionError or
    CheckpointError naming the file."""
    off = dict(hidden_dropout=0.0, attention_dropout=0.0)
    if args.from_hf:
        gcfg = folder_config(args.from_hf, **off)
        return gcfg, args.tokenizer_model or args.from_hf, args.tokenizer_type or "HuggingFaceTokenizer"
    meta = peek(args.load)
    if meta is None:
        raise CheckpointError(f"--load {args.load}: no checkpoint there (no 'latest' file); fix: give the --save "
                              "directory of a run")
    if "gpt_config" not in meta["extra"]:
        raise CheckpointError(f"--load {args.load}: the checkpoint does not record its model settings "
                              "(saved by an older megazero)")
    recorded = meta["extra"].get("tokenizer") or {}
    return (config_from_record(meta["extra"]["gpt_config"], **off), args.tokenizer_model or recorded.get("model"),
            args.tokenizer_type or recorded.get("type", "SentencePieceTokenizer"))


def check_inputs(args, tp: int):
    """Every input, before any process group exists and without loading a weight: the model and
    its tokenizer (``check_model``) and the prompt (``model.sampling.check_prompt``; with
    ``--prompt-ids`` every id inside the vocabulary, and no tokenizer needed). Returns the
    tokenizer (None for ids without one). Raises one of ``INPUT_ERRORS``, whose message is the
    one line to print."""
    gcfg = model_settings(args)[0]
    if args.prompt_ids is None:
        tok = check_model(args, tp)
        check_prompt(tok.encode(args.prompt), gcfg.max_position_embeddings)
        return tok
    bad = [i for i in args.prompt_ids if not 0 <= i < gcfg.vocab_size]
    if bad:
        raise ValueError(f"--prompt-ids {bad[0]} is not a token id of the model's vocabulary of "
                         f"{gcfg.vocab_size}; fix: ids in [0, {gcfg.vocab_size})")
    check_prompt(args.prompt_ids, gcfg.max_position_embeddings)
    return check_model(args, tp, need_tokenizer=False)


def check_model(args, tp: int, need_tokenizer: bool = True):
    """The model's settings and their sizes under ``tp`` ranks (``GPTConfig.validate``), every
    tensor's name, shape and dtype (--from-hf, ``model.hf_folder.open_folder``) or the
    checkpoint's files (--load), and the tokenizer (its vocabulary within the model's), without
    loading a weight (also scripts/evaluate.py's check). Returns the tokenizer, or None when
    there is none and ``need_tokenizer`` is False. Raises one of ``INPUT_ERRORS``."""
    from data.tokenizer import load_tokenizer

    gcfg, tok_path, tok_type = model_settings(args)
    source = os.path.join(args.from_hf, "config.json") if args.from_hf else f"--load {args.load}"
    try:
        gcfg.validate(tp)
    except ValueError as e:  # ConfigError, naming the setting
        raise ValueError(f"{source}: the model does not run under --tp {tp}: {e}") from None
    if args.from_hf:
        open_folder(args.from_hf, gcfg, gcfg.padded_vocab(tp))  # checks every tensor, loads none
    if not need_tokenizer and not _has_tokenizer(tok_path):
        return None
    if tok_path is None:
        raise CheckpointError("no tokenizer: the run used --mock-data; fix: give --tokenizer-model, "
                              "or the prompt as --prompt-ids")
    tok = load_tokenizer(tok_path, tok_type)
    if tok.vocab_size > gcfg.vocab_size:  # its ids past the embedding's rows would not index it
        raise DataError(f"tokenizer {tok_path} has {tok.vocab_size} tokens, more than the model's vocabulary of "
                        f"{gcfg.vocab_size}; fix: --tokenizer-model of this model")
    return tok


def load_model(args, groups: ProcessGroups, device) -> tuple[GPTStage, object]:
    """(whole-model stage with this rank's TP partitions, tokenizer or None). Raises one of
    ``INPUT_ERRORS``."""
    from data.tokenizer import load_tokenizer

    gcfg, tok_path, tok_type = model_settings(args)
    if getattr(args, "prompt_ids", None) is not None and not _has_tokenizer(tok_path):
        tok_path = None   # ids need no tokenizer (check_inputs)
    if args.from_hf:
        full = open_folder(args.from_hf, gcfg, gcfg.padded_vocab(groups.tp_size))
    else:
        full = read_full_weights(args.load)[1]
    stage = GPTStage(gcfg, groups, range(gcfg.num_layers), True, True, seed=0, full_weights=full, device=device)
    return stage, (load_tokenizer(tok_path, tok_type) if tok_path else None)


def start_torchrun(tp: int, argv: list[str], script: str = __file__) -> None:
    """Replace this process by torchrun running ``script`` (default: this one) on ``tp`` ranks
    of this machine (after its input check passed here); its exit status becomes this
    command's. The ranks share the cores (``OMP_NUM_THREADS``, unless set)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp)))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(tp), os.path.abspath(script), *argv], env)


def _has_tokenizer(path) -> bool:
    """Whether ``path`` (a tokenizer file, or a Hugging Face folder) holds a tokenizer to load."""
    if path is None:
        return False
    return os.path.isfile(os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else os.path.exists(path)


def _ids(text: str) -> list[int]:
    """``"5,17,300"`` -> ``[5, 17, 300]``; argparse turns the ValueError into its usage error."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated whole numbers, e.g. 5,17,300") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: token ids are >= 0")
    return ids


def join_tp_ranks(device_type: str, world: int, timeout_s: float) -> tuple[torch.device, ProcessGroups]:
    """This process as one of ``world`` tensor-parallel ranks (pipeline and data-parallel size
    1): its device (``cuda:LOCAL_RANK``, made current before the process group or any tensor
    opens a context on GPU 0, or the CPU), the process group (NCCL on CUDA, else gloo, with
    ``timeout_s`` seconds for a collective) and the groups. Used by this script and
    scripts/evaluate.py."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return device, ProcessGroups.build(Topology(tp=world, pp=1, dp=1))


def parse(argv):
    p = argparse.ArgumentParser(prog="scripts/generate.py", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="megazero checkpoint directory (a run's --save)")
    src.add_argument("--from-hf", help="Hugging Face GPT-2, Llama, Mixtral or Qwen2-MoE folder (config.json + model.safetensors)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument("--prompt-ids", type=_ids, help="the prompt as comma-separated token ids, e.g. 5,17,300 "
                        "(no tokenizer needed)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: smallest set with this mass; 1 = all")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tokenizer-model", help="default: the checkpoint's recorded tokenizer / the folder's")
    p.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--print-ids", action="store_true", help="also print the token ids as a JSON list")
    p.add_argument("--tp", type=int, help="tensor-parallel ranks; N > 1 outside torchrun checks the inputs here, "
                   "then starts torchrun with N processes (default: torchrun's WORLD_SIZE, else 1)")
    args = p.parse_args(argv)
    if args.tp is not None and args.tp < 1:
        p.error("need --tp >= 1")
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        p.error("need --max-new-tokens >= 0, --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    return args


def main(argv=None) -> int:
    """Check the inputs, then generate (or, with ``--tp N > 1`` outside torchrun, start torchrun);
    returns the exit status: 0, or 2 after the one-line error."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    is_rank = world > 1 or "TORCHELASTIC_RUN_ID" in os.environ  # started by torchrun (or another launcher)
    tp = args.tp or world
    try:
        if is_rank and tp != world:
            raise ValueError(f"--tp {tp}, but the launcher started {world} processes; fix: the same number for "
                             "both (or leave --tp out)")
        tok = check_inputs(args, tp)  # before any process group: every rank refuses the same inputs
    except INPUT_ERRORS as e:
        if rank == 0:
            print(f"generate: error: {e}", file=sys.stderr)
        return 2
    if tp > 1 and not is_rank:
        start_torchrun(tp, argv)
    device, groups = join_tp_ranks(args.device, world, timeout_s=300)
    try:
        stage, tok = load_model(args, groups, device)
        prompt = args.prompt_ids if args.prompt_ids is not None else tok.encode(args.prompt)
        ids = sample(stage, prompt, args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k, top_p=args.top_p, seed=args.seed, eod=None if tok is None else tok.eod)
    except INPUT_ERRORS as e:  # a file that changed since check_inputs
        if rank == 0:
            print(f"generate: error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        if tok is not None:
            print(tok.decode(ids))
        if args.print_ids or tok is None:
            print(json.dumps(ids))
    return 0


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
