"""Generate text from a megazero checkpoint (any layout) or a Hugging Face GPT-2 / Llama folder.
Run from the repository root:

    python -m scripts.generate (--load CKPT_DIR | --from-hf DIR) (--prompt TEXT | --prompt-ids 5,17,300) \\
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
    python -m scripts.generate --tp 2 ...                       # tensor parallel over 2 ranks
    torchrun --nproc-per-node 2 -m scripts.generate ...         # the same, under your own torchrun

Every process is one tensor-parallel rank of a whole model (tp = the number of processes,
pipeline size 1): it reads only its own partitions of the full weights (a checkpoint of any
layout, or ``model.safetensors`` or the shards of ``model.safetensors.index.json``:
``megazero.training.inference``), then samples with a key/value
cache (``model/sampling.py``; temperature 0 is greedy). The tokenizer is the checkpoint's recorded one (or
``--tokenizer-model``), or
the folder's ``tokenizer.json``. Rank 0 prints the text (and the ids with ``--print-ids``).
``--prompt-ids`` gives the prompt as token ids instead, so a folder or checkpoint without a
tokenizer generates too: then only the ids are printed (a JSON list), and generation stops at
``--max-new-tokens`` (no end-of-document id is known).
The same ``--seed`` gives the same text, under any tp.

Errors: one line ``generate: error: ...`` and exit code 2. Every input (the model's settings
and sizes under tp, every tensor's shape and dtype or the checkpoint's files, the tokenizer,
the prompt) is checked before any process group exists and before a weight is loaded
(``check_inputs``, with ``megazero.training.inference.check_model``). ``--tp N`` (N > 1)
outside torchrun runs that check once in this process and only then replaces this process by
torchrun (``python -m torch.distributed.run --standalone --nproc-per-node N -m scripts.generate``,
as scripts/pretrain_gpt.sh starts torchrun after its preflight),
so a bad input ends with the one line alone. Under a torchrun you start yourself each rank
prints the line and exits 2, and torchrun then adds its own failure summary: torchrun reports
every non-zero exit, and exiting 0 would hide the error from whoever called it.

API: ``main(argv)`` takes the command line as a list (without the program name) and returns the
exit status; nothing else here is meant to be imported (the loading is in
``megazero.training.inference``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from megazero.training.inference import (
    INPUT_ERRORS,
    check_model,
    join_tp_ranks,
    load_model,
    model_settings,
    start_torchrun,
)
from model.sampling import check_prompt, sample


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
        raise ValueError(
            f"--prompt-ids {bad[0]} is not a token id of the model's vocabulary of "
            f"{gcfg.vocab_size}; fix: ids in [0, {gcfg.vocab_size})"
        )
    check_prompt(args.prompt_ids, gcfg.max_position_embeddings)
    return check_model(args, tp, need_tokenizer=False)


def _ids(text: str) -> list[int]:
    """``"5,17,300"`` -> ``[5, 17, 300]``; argparse turns the ValueError into its usage error."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated whole numbers, e.g. 5,17,300") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: token ids are >= 0")
    return ids


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m scripts.generate", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="megazero checkpoint directory (a run's --save)")
    src.add_argument(
        "--from-hf",
        help="Hugging Face GPT-2, Llama (2, 3.x), Qwen2, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE folder "
        "(config.json + model.safetensors or its shards)",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument(
        "--prompt-ids", type=_ids, help="the prompt as comma-separated token ids, e.g. 5,17,300 (no tokenizer needed)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: smallest set with this mass; 1 = all")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tokenizer-model", help="default: the checkpoint's recorded tokenizer / the folder's")
    p.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--print-ids", action="store_true", help="also print the token ids as a JSON list")
    p.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel ranks; N > 1 outside torchrun checks the inputs here, "
        "then starts torchrun with N processes (default: torchrun's WORLD_SIZE, else 1)",
    )
    args = p.parse_args(argv)
    if args.tp is not None and args.tp < 1:
        p.error("need --tp >= 1")
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        p.error("need --max-new-tokens >= 0, --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    return args


def main(argv=None) -> int:
    """Check the inputs, then generate (or, with ``--tp N > 1`` outside torchrun, start torchrun)
    as the command line ``argv`` (default ``sys.argv[1:]``) says; returns the exit status: 0, or 2
    after the one-line error."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    is_rank = world > 1 or "TORCHELASTIC_RUN_ID" in os.environ  # started by torchrun (or another launcher)
    tp = args.tp or world
    try:
        if is_rank and tp != world:
            raise ValueError(
                f"--tp {tp}, but the launcher started {world} processes; fix: the same number for "
                "both (or leave --tp out)"
            )
        tok = check_inputs(args, tp)  # before any process group: every rank refuses the same inputs
    except INPUT_ERRORS as e:
        if rank == 0:
            print(f"generate: error: {e}", file=sys.stderr)
        return 2
    if tp > 1 and not is_rank:
        start_torchrun(tp, "scripts.generate", argv)
    device, groups = join_tp_ranks(args.device, world, timeout_s=300)
    try:
        stage, tok = load_model(args, groups, device, need_tokenizer=args.prompt_ids is None)
        prompt = args.prompt_ids if args.prompt_ids is not None else tok.encode(args.prompt)
        ids = sample(
            stage,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            eod=None if tok is None else tok.eod,
        )
        made, limit = len(ids) - len(prompt), stage.cfg.max_position_embeddings
        if rank == 0 and made < args.max_new_tokens and len(ids) == limit and (tok is None or ids[-1] != tok.eod):
            print(
                f"generate: note: stopped after {made} new tokens at the model's {limit} positions "
                f"(--max-new-tokens {args.max_new_tokens} after a prompt of {len(prompt)})",
                file=sys.stderr,
            )
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
