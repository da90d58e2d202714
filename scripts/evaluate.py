"""Score a megazero checkpoint (any layout) or a Hugging Face folder of any family megazero reads on
lm-evaluation-harness tasks. Run from the repository root:

    python -m scripts.evaluate (--load CKPT_DIR | --from-hf DIR) --tasks T1,T2 \\
        [--num-fewshot N] [--limit N] [--batch-size B] [--include-path DIR ...]
    python -m scripts.evaluate --tp 2 ...                       # tensor parallel over 2 ranks
    torchrun --nproc-per-node 2 -m scripts.evaluate ...         # the same, under your own torchrun

The model and tokenizer load as in ``python -m scripts.generate`` (``megazero.training.inference``:
every process one tensor-parallel rank of the whole model, reading only its partitions; pp 1),
and ``model.evaluation.MegazeroLM`` (an ``lm_eval.api.model.LM`` over megazero's own forward and
KV-cache decoding) answers the harness's requests; every rank runs the same requests, rank 0 prints one line per task
with each metric
and its standard error, e.g. ``megazero_stdlib: acc 0.3247 (± 0.0337), acc_norm 0.3763 (± 0.0349)``.

Tasks: the YAML files under data/tasks (``megazero_stdlib``, ``megazero_stdlib_ppl``; no
network) and under each ``--include-path`` folder (the harness's own tasks: its installed
``lm_eval/tasks`` folder, whose datasets come from the Hugging Face hub or its cache).

Errors: one line ``evaluate: error: ...`` and exit code 2 (a missing lm_eval names
``pip install -e .[eval]``): the model, tokenizer and task names are checked before any
process group exists, and with ``--tp N`` outside torchrun before torchrun starts.

API: ``main(argv)`` takes the command line as a list (without the program name) and returns the
exit status; nothing else here is meant to be imported.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from megazero.training.inference import INPUT_ERRORS, check_model, join_tp_ranks, load_model, start_torchrun
from model.evaluation import HarnessError, check_tasks, format_scores, make_lm, run_tasks, split_names

ERRORS = INPUT_ERRORS + (HarnessError,)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m scripts.evaluate", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="megazero checkpoint directory (a run's --save), any layout")
    src.add_argument(
        "--from-hf",
        help="Hugging Face GPT-2, Llama (2, 3.x), Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE or "
        "gpt-oss folder (config.json + model.safetensors or its shards)",
    )
    p.add_argument("--tasks", required=True, nargs="+", help="task names, comma- or space-separated")
    p.add_argument("--num-fewshot", type=int, help="examples before each question (default: the task's)")
    p.add_argument("--limit", type=float, help="documents per task (below 1: a fraction); default all")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward")
    p.add_argument("--include-path", nargs="+", default=[], help="more folders of task YAML files")
    p.add_argument("--tokenizer-model", help="default: the checkpoint's recorded tokenizer / the folder's")
    p.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=1234, help="generator of sampled generate_until requests")
    p.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel ranks; N > 1 outside torchrun checks the inputs here, "
        "then starts torchrun with N processes (default: torchrun's WORLD_SIZE, else 1)",
    )
    args = p.parse_args(argv)
    if args.tp is not None and args.tp < 1:
        p.error("need --tp >= 1")
    if (
        args.batch_size < 1
        or (args.num_fewshot is not None and args.num_fewshot < 0)
        or (args.limit is not None and args.limit <= 0)
    ):
        p.error("need --batch-size >= 1, --num-fewshot >= 0 and --limit > 0")
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)
    args.tasks = split_names(args.tasks)
    return args


def main(argv=None) -> int:
    """Check the inputs, then evaluate (or, with ``--tp N > 1`` outside torchrun, start
    torchrun) as the command line ``argv`` (default ``sys.argv[1:]``) says; returns the exit
    status: 0, or 2 after the one-line error."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    is_rank = world > 1 or "TORCHELASTIC_RUN_ID" in os.environ
    tp = args.tp or world
    try:
        if is_rank and tp != world:
            raise ValueError(
                f"--tp {tp}, but the launcher started {world} processes; fix: the same number for "
                "both (or leave --tp out)"
            )
        tm = check_tasks(args.tasks, args.include_path)  # before any weight or process group
        check_model(args, tp)
    except ERRORS as e:
        if rank == 0:
            print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    if tp > 1 and not is_rank:
        start_torchrun(tp, "scripts.evaluate", argv)
    device, groups = join_tp_ranks(args.device, world, timeout_s=600)
    try:
        stage, tok = load_model(args, groups, device)
        lm = make_lm(stage, tok, batch_size=args.batch_size, seed=args.seed)
        scores = run_tasks(
            lm, args.tasks, tm=tm, num_fewshot=args.num_fewshot, limit=args.limit, quiet=rank != 0
        )  # rank 0 shows the harness's progress bars
    except ERRORS as e:  # a file that changed since the check
        if rank == 0:
            print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        for line in format_scores(scores):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
