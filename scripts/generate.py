"""Generate text from a megazero checkpoint (any layout) or a Hugging Face GPT-2 / Llama folder.

    python scripts/generate.py (--load CKPT_DIR | --from-hf DIR) --prompt TEXT \\
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
    torchrun --nproc-per-node 2 scripts/generate.py ...         # tensor parallel over 2 ranks

Every process is one tensor-parallel rank of a whole model (tp = the number of processes,
pipeline size 1): it reads only its own partitions of the full weights (a checkpoint of any
layout, ``megazero.checkpoint.read_full_weights``; or ``model.safetensors`` through
``model/hf_folder.py``, which checks every tensor's shape first), then samples with a key/value cache (``model/sampling.py``; temperature 0
is greedy). The tokenizer is the checkpoint's recorded one (or ``--tokenizer-model``), or
the folder's ``tokenizer.json``. Rank 0 prints the text (and the ids with ``--print-ids``).
The same ``--seed`` gives the same text, under any tp. Errors: one line and exit code 2.
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

from megazero.checkpoint import CheckpointError, read_full_weights  # noqa: E402
from megazero.process_groups import ProcessGroups  # noqa: E402
from megazero.runtime.extras import MissingExtra  # noqa: E402
from megazero.topology import Topology  # noqa: E402
from model.gpt import GPTStage  # noqa: E402
from model.hf import HFConversionError, config_from_record  # noqa: E402
from model.hf_folder import folder_config, open_folder  # noqa: E402
from model.sampling import sample  # noqa: E402


def load_model(args, groups: ProcessGroups, device) -> tuple[GPTStage, object]:
    """(whole-model stage with this rank's TP partitions, tokenizer or None)."""
    from data.tokenizer import load_tokenizer

    off = dict(hidden_dropout=0.0, attention_dropout=0.0)
    if args.from_hf:
        gcfg = folder_config(args.from_hf, **off)
        full = open_folder(args.from_hf, gcfg, gcfg.padded_vocab(groups.tp_size))
        tok_path, tok_type = args.tokenizer_model or args.from_hf, args.tokenizer_type or "HuggingFaceTokenizer"
    else:
        meta, full = read_full_weights(args.load)
        if "gpt_config" not in meta["extra"]:
            raise CheckpointError(f"--load {args.load}: the checkpoint does not record its model settings "
                                  "(saved by an older megazero)")
        gcfg = config_from_record(meta["extra"]["gpt_config"], **off)
        recorded = meta["extra"].get("tokenizer") or {}
        tok_path = args.tokenizer_model or recorded.get("model")
        tok_type = args.tokenizer_type or recorded.get("type", "SentencePieceTokenizer")
    stage = GPTStage(gcfg, groups, range(gcfg.num_layers), True, True, seed=0, full_weights=full, device=device)
    return stage, (load_tokenizer(tok_path, tok_type) if tok_path else None)


def parse(argv):
    p = argparse.ArgumentParser(prog="scripts/generate.py", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="megazero checkpoint directory (a run's --save)")
    src.add_argument("--from-hf", help="Hugging Face GPT-2 or Llama folder (config.json + model.safetensors)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: smallest set with this mass; 1 = all")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tokenizer-model", help="default: the checkpoint's recorded tokenizer / the folder's")
    p.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--print-ids", action="store_true", help="also print the token ids as a JSON list")
    args = p.parse_args(argv)
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        p.error("need --max-new-tokens >= 0, --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=300))
    groups = ProcessGroups.build(Topology(tp=world, pp=1, dp=1))
    try:
        stage, tok = load_model(args, groups, device)
        if tok is None:
            raise CheckpointError("no tokenizer: the run used --mock-data; fix: give --tokenizer-model")
        ids = sample(stage, tok.encode(args.prompt), args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k, top_p=args.top_p, seed=args.seed, eod=tok.eod)
    except (CheckpointError, HFConversionError, MissingExtra, ValueError, OSError) as e:
        if rank == 0:
            print(f"generate: error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        print(tok.decode(ids))
        if args.print_ids:
            print(json.dumps(ids))
    return 0


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
