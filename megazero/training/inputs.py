"""The run's data as the trainer reads it: datasets and tokenizer (``build_data``), each
data-parallel rank's micro-batches of a global batch (``dp_micro_batches``), and the records
of the sample stream and tokenizer that checkpoints keep (``data_signature``, ``tokenizer_record``)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from data.indexed_dataset import DataError
from data.run_data import RunData
from megazero.config import Config
from megazero.process_groups import ProcessGroups


def build_data(cfg: Config, resume: Optional[dict] = None) -> RunData:
    """The tokenizer (None with mock data), the train / valid / test datasets and the vocabulary
    size of this run, as a ``RunData`` (its ``resume`` is the ``resume`` given).

    Every rank builds the same indices (identical everywhere, cached atomically on disk with
    --data-cache-dir); each data-parallel rank later reads only its slice of every global
    batch. ``resume`` (a checkpoint's meta) sizes the train split from the samples already
    consumed, which differ from iterations x global batch after a change of batch size.
    Raises DataError for an unusable corpus, tokenizer or split.
    """
    from data.gpt_dataset import (
        MockGPTDataset,
        build_train_valid_test_datasets,
        parse_data_path,
        parse_split,
        require_files,
    )

    t = cfg.train
    gbs = t.global_batch_size
    evals = (t.train_iters // max(cfg.train.eval_interval, 1) + 1) * cfg.train.eval_iters
    train_samples = t.train_iters * gbs
    if resume is not None:
        done = resume["extra"]["consumed_samples"]
        train_samples = max(train_samples, done + max(t.train_iters - resume["iteration"], 0) * gbs)
    num_samples = (train_samples, max(evals, 1) * gbs, cfg.train.eval_iters * gbs)
    seq = cfg.model.seq_length
    parse_split(cfg.data.split)  # a bad --split is refused also where mock data reads none
    if cfg.train.mock_data:
        vocab = cfg.data.vocab_size
        sets = tuple(MockGPTDataset(vocab, seq, n, t.seed + i) for i, n in enumerate(num_samples))
        return RunData(None, *sets, vocab_size=vocab, resume=resume)
    from data.indexed_dataset import check_same_tokenizer
    from data.tokenizer import load_tokenizer

    blend = parse_data_path(cfg.data.data_path)
    if cfg.post.mode not in ("grpo", "ppo"):  # prompts are one npz (PromptSet names it when missing)
        require_files(blend)
    tok = load_tokenizer(cfg.data.tokenizer_model, cfg.data.tokenizer_type)
    if cfg.data.vocab_size is not None and cfg.data.vocab_size != tok.vocab_size:
        raise DataError(
            f"--vocab-size {cfg.data.vocab_size} differs from the {tok.vocab_size} tokens of "
            f"--tokenizer-model {cfg.data.tokenizer_model}; fix: drop --vocab-size (the "
            "tokenizer sets it) or use the matching tokenizer"
        )
    if cfg.post.mode in ("grpo", "ppo"):  # prompts with answers (python -m data.prompts): one prefix
        from data.prompts import prompt_splits

        if len(blend) != 1:
            raise DataError(
                f"--data-path {' '.join(cfg.data.data_path)}: --post-train {cfg.post.mode} reads one prefix of "
                "python -m data.prompts; fix: give one PREFIX (merge the inputs when preprocessing)"
            )
        check_same_tokenizer([blend[0][1]], tok.sha256, f"--tokenizer-model {cfg.data.tokenizer_model}")
        ptx = ptx_dataset(cfg, tok) if cfg.post.mode == "ppo" and cfg.post.ptx_coef > 0 else None
        splits = prompt_splits(blend[0][1], cfg.data.split, t.seed)
        return RunData(tok, *splits, vocab_size=tok.vocab_size, resume=resume, ptx=ptx)
    if cfg.post.mode in ("dpo", "rm"):  # preference pairs (python -m data.preference): one prefix
        from data.preference import preference_splits

        if len(blend) != 1:
            raise DataError(
                f"--data-path {' '.join(cfg.data.data_path)}: --post-train {cfg.post.mode} reads one prefix of "
                "python -m data.preference; fix: give one PREFIX (merge the inputs when preprocessing)"
            )
        check_same_tokenizer([blend[0][1]], tok.sha256, f"--tokenizer-model {cfg.data.tokenizer_model}")
        sets = preference_splits(blend[0][1], cfg.data.split, num_samples, seq, t.seed, tok.eod)
        return RunData(tok, *sets, vocab_size=tok.vocab_size, resume=resume)
    check_same_tokenizer([prefix for _, prefix in blend], tok.sha256, f"--tokenizer-model {cfg.data.tokenizer_model}")
    sft = (cfg.data.sft_packing, tok.eod) if cfg.data.sft else None  # (packing, pad id)
    own_vocab, fim = tok.vocab_size, fim_settings(cfg, tok)  # FIM sentinels may grow tok.vocab_size
    sets = build_train_valid_test_datasets(
        cfg.data.data_path,
        cfg.data.split,
        seq,
        t.seed,
        num_samples,
        cfg.data.data_cache_dir,
        vocab_size=own_vocab,
        sft=sft,
        fim=fim,
    )
    if sets[0] is None:
        raise DataError(
            f"--split {cfg.data.split} leaves no documents for training; fix: give the "
            "train part a positive share, e.g. --split 969,30,1"
        )
    return RunData(tok, *sets, vocab_size=tok.vocab_size, resume=resume)


def ptx_dataset(cfg: Config, tok):
    """--post-train ppo --ptx-coef: the pretraining dataset of ``--ptx-data-path`` (sequences of
    ``--seq-length``, shuffled by ``--seed``), sized for every ptx step of the run: one per policy
    optimizer step, ``--global-batch-size`` sequences each. Raises DataError for missing files or
    another tokenizer."""
    from data.gpt_dataset import build_train_valid_test_datasets, parse_data_path, require_files
    from data.indexed_dataset import check_same_tokenizer

    p, t = cfg.post, cfg.train
    blend = parse_data_path(p.ptx_data_path)
    require_files(blend, "--ptx-data-path")
    check_same_tokenizer([prefix for _, prefix in blend], tok.sha256, f"--tokenizer-model {cfg.data.tokenizer_model}")
    sequences = ptx_steps_per_iteration(cfg) * t.train_iters * t.global_batch_size
    train, _, _ = build_train_valid_test_datasets(
        p.ptx_data_path,
        "1,0,0",
        cfg.model.seq_length,
        t.seed,
        (sequences, 0, 0),
        cfg.data.data_cache_dir,
        vocab_size=tok.vocab_size,
    )
    return train


def ptx_steps_per_iteration(cfg: Config) -> int:
    """Policy optimizer steps (each followed by a ptx step) of one RL iteration:
    ``--grpo-iterations`` x the rollout's rows / ``--global-batch-size``."""
    p = cfg.post
    return p.grpo_iterations * p.grpo_prompts_per_step * p.grpo_group_size // cfg.train.global_batch_size


def fim_settings(cfg: Config, tok):
    """``data.fim.FIMSettings`` of --fim-rate > 0 (adding the tokenizer's sentinels), else None.
    Raises DataError naming --fim-tokens / --fim-split-sample."""
    from data.fim import build_fim
    from data.tokenizer import add_fim_sentinels

    d = cfg.data
    if d.fim_rate <= 0:
        return None
    return build_fim(
        tok,
        add_fim_sentinels(tok, d.fim_tokens),
        rate=d.fim_rate,
        spm_rate=d.fim_spm_rate,
        split_sample=d.fim_split_sample,
        fragment_rate=d.fim_fragment_rate,
        no_prefix=d.fim_no_prefix,
    )


def dp_micro_batches(dataset, consumed: int, cfg: Config, groups: ProcessGroups, device):
    """This dp rank's micro-batches of the global batch after ``consumed`` samples, as
    ``(tokens, labels)`` ``[micro, T]`` int64 on ``device``; with ``--sft`` ``(tokens, labels,
    loss_mask)``, the mask float32 and 1 on response labels (data/sft.py); with ``--post-train rm``
    ``(tokens, labels, loss_mask, margin)``, the margin float32 ``[micro/2]`` of each pair
    (``data.preference.split_margins``). The cp ranks of one
    dp rank read the same ones. On CUDA each tensor is copied from pinned host memory without
    blocking the host (the copies queue on the current stream, ahead of the forward that reads them)."""
    from data.samplers import get_micro_batches

    read = get_micro_batches
    if cfg.data.sft or cfg.post.mode in ("dpo", "rm"):  # (tokens, labels, loss_mask): the loss on responses only
        from data.sft import sft_micro_batches as read
    where = (consumed, cfg.train.global_batch_size, cfg.train.micro_batch_size, groups.dp_rank, groups.dp_size)
    mbs = read(dataset, *where)
    if cfg.post.mode == "rm":  # the pairs' margins ride with their micro-batch
        from data.preference import split_margins

        mbs = [(*mb, margin) for mb, margin in zip(mbs, split_margins(dataset, *where))]
    if torch.device(device).type != "cuda":
        return [tuple(x.to(device) for x in mb) for mb in mbs]
    return [tuple(x.pin_memory().to(device, non_blocking=True) for x in mb) for mb in mbs]


def data_signature(cfg: Config) -> dict:
    """The settings that fix the sample stream (stored in checkpoints, compared on resume)."""
    d = cfg.data
    paths = [os.path.realpath(x) if os.path.exists(x + ".idx") else x for x in d.data_path or []]
    return dict(
        seed=cfg.train.seed,
        data_path=paths,
        split=d.split,
        mock_data=cfg.train.mock_data,
        seq_length=cfg.model.seq_length,
        tokenizer=tokenizer_digest(d.tokenizer_model),
        sft=d.sft_packing if d.sft else None,
        fim=[d.fim_rate, d.fim_spm_rate, d.fim_split_sample, d.fim_fragment_rate, d.fim_no_prefix],
    )


def tokenizer_record(cfg: Config) -> Optional[dict]:
    """Where the run's tokenizer is (for scripts/convert_checkpoint.py and generate.py)."""
    d = cfg.data
    if d.tokenizer_model is None or cfg.train.mock_data:
        return None
    from data.tokenizer import fim_record

    return dict(
        model=os.path.abspath(d.tokenizer_model),
        type=d.tokenizer_type,
        sha256=tokenizer_digest(d.tokenizer_model),
        fim=fim_record(d.tokenizer_model, d.tokenizer_type, tuple(d.fim_tokens or ()) or None)
        if d.fim_rate > 0
        else None,
    )


def tokenizer_digest(path: Optional[str]) -> Optional[str]:
    """sha256 of the tokenizer model file (None without one), as in PREFIX.tokenizer.json."""
    from data.tokenizer import model_sha256

    return model_sha256(path) if path and os.path.exists(path) else None
