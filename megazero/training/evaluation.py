"""Evaluation during training: validation loss with its unigram baseline, the
lm-evaluation-harness tasks of ``--eval-harness-tasks``, and greedy generation under any layout."""

from __future__ import annotations

import numpy as np
import torch

from megazero import collectives
from megazero.config import Config
from megazero.pipeline.partition import chunk_layout
from megazero.training.inputs import dp_micro_batches
from megazero.training.trainer import Trainer
from model.evaluation import HarnessError
from model.generation import pipeline_generate_greedy
from model.gpt import generate_greedy
from model.sampling import choose


def evaluate(trainer: Trainer, valid, cfg: Config, eval_round: int) -> tuple[float, np.ndarray]:
    """Mean validation loss over ``--eval-iters`` global batches and their label token counts
    (int64 ``[vocab_size]``, summed over data-parallel ranks: the unigram baseline is of exactly
    these tokens). The counts stay on the trainer's device until the one copy at the end: the
    dp all-reduce runs on the group's backend device (NCCL has no CPU tensors)."""
    gbs, vocab = cfg.train.global_batch_size, trainer.gpt_config.vocab_size
    losses, counts = [], torch.zeros(vocab, dtype=torch.int64, device=trainer.device)
    for i in range(cfg.train.eval_iters):
        consumed = ((eval_round * cfg.train.eval_iters + i) * gbs) % max(len(valid) - gbs + 1, 1)
        batches = dp_micro_batches(valid, consumed, cfg, trainer.groups, trainer.device)
        losses.append(trainer.eval_loss(batches))
        for batch in batches:  # with SFT data, the labels in the loss only
            labels = batch[1] if len(batch) < 3 else batch[1][batch[2] > 0]
            counts += torch.bincount(labels.flatten(), minlength=vocab)[:vocab]
    # each DP rank counted its slice of the global batches: the baseline needs them all
    collectives.all_reduce_sum(counts, trainer.groups.dp)
    return float(np.mean(losses)), counts.cpu().numpy()


def check_harness(cfg: Config) -> None:
    """``--eval-harness-tasks``: every name a task of data/tasks, lm_eval installed, a whole-model
    stage (--pp 1) and a tokenizer. Raises HarnessError or MissingExtra (one line)."""
    from model.evaluation import check_tasks, split_names

    flag = "--eval-harness-tasks"
    if cfg.parallel.pp > 1:
        raise HarnessError(
            f"{flag} needs --pp 1 (the harness scores with the whole model in one stage; this run: "
            f"--pp {cfg.parallel.pp}); fix: score a saved checkpoint with python -m scripts.evaluate"
        )
    if cfg.train.mock_data:
        raise HarnessError(
            f"{flag} needs a tokenizer, which --mock-data has none of; fix: --data-path with --tokenizer-model"
        )
    check_tasks(split_names(cfg.train.eval_harness_tasks), what=flag, flag=flag)


def harness_due(cfg: Config, it: int) -> bool:
    """Whether iteration ``it`` scores the ``--eval-harness-tasks`` (each interval, and the last)."""
    t = cfg.train
    return bool(t.eval_harness_tasks) and (
        it == t.train_iters or bool(t.eval_harness_interval and it % t.eval_harness_interval == 0)
    )


def harness_scores(trainer: Trainer, tokenizer, cfg: Config) -> dict:
    """``{task: {metric: value}}`` of the live model on ``--eval-harness-tasks`` (model/evaluation.py;
    pp 1, collective over the model's tp group: every rank scores the same requests)."""
    from model.evaluation import make_lm, run_tasks, split_names

    flag = "--eval-harness-tasks"
    trainer.optimizer.wait_param_gather()
    lm = make_lm(trainer.chunks[0], tokenizer, what=flag)
    return run_tasks(
        lm,
        split_names(cfg.train.eval_harness_tasks),
        limit=cfg.train.eval_harness_limit,
        what=flag,
        flag=flag,
        quiet=True,
    )


def generate_ids(
    trainer: Trainer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """Continuation under any layout (collective over the model-parallel ranks): a whole-model
    stage decodes directly, a pipeline runs one forward-only pass per token. The
    context-parallel ranks decode the whole context each, the same tokens (no cp attention).
    Greedy at ``temperature`` 0; otherwise each token is drawn from ``softmax(logits /
    temperature)`` over the ``top_k`` most likely tokens (0 = all) with a CPU generator seeded
    by ``seed`` (``model.sampling.choose``): every rank that draws sees the same gathered
    logits and the same generator state, so every rank gets the same ids, and a rerun too."""
    generator = torch.Generator().manual_seed(seed)
    pick = None if temperature == 0 else (lambda logits: choose(logits, temperature, top_k, 1.0, generator))
    if trainer.cfg.parallel.pp == 1:
        ids = torch.tensor([prompt_ids], device=trainer.device)
        return generate_greedy(trainer.chunks[0], ids, max_new_tokens, pick)[0].tolist()
    B, _, H = trainer.tensor_shape
    p = trainer.cfg.parallel
    shape = (B, trainer.cfg.model.seq_length // (p.tp if p.sequence_parallel else 1), H)
    return pipeline_generate_greedy(
        trainer.chunks,
        trainer.groups,
        prompt_ids,
        max_new_tokens,
        seq_length=trainer.cfg.model.seq_length,
        tensor_shape=shape,
        dtype=trainer.dtype,
        vocab_size=trainer.gpt_config.vocab_size,
        layout=chunk_layout(p.pipeline_schedule),
        pick=pick,
    )


def final_sample(trainer: Trainer, tokenizer, cfg: Config) -> str:
    """A short continuation of ``--prompt`` (needs a tokenizer, i.e. real data), drawn at
    ``--sample-temperature`` from the ``--sample-top-k`` most likely tokens with ``--seed``
    (greedy at temperature 0): a small model's greedy continuation repeats one token. A reward
    model (``--post-train rm``) has no output layer in use and generates nothing."""
    if trainer.gpt_config.value_head:
        return "(a reward model scores sequences and generates no text)"
    prompt = tokenizer.encode(cfg.log.prompt) if tokenizer is not None else []
    if not prompt:
        return "(sample generation needs a tokenizer and a non-empty --prompt)"
    g = cfg.log
    ids = generate_ids(
        trainer, prompt, g.generate_tokens, temperature=g.sample_temperature, top_k=g.sample_top_k, seed=cfg.train.seed
    )
    return tokenizer.decode(ids)
