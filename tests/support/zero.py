"""ZeRO on a hand-built GPT stage: tiny_cfg, build (model + DataParallel + DistributedOptimizer over
given groups), make_batches, train, pipeline_steps, and the single-process reference they are
compared with."""

import torch

from megazero import collectives as C
from megazero.data_parallel.ddp import DataParallel
from megazero.optim.zero import DistributedOptimizer
from megazero.pipeline.executor import run_schedule
from megazero.pipeline.schedules import build_schedule
from megazero.precision import cast_model_
from model.config import GPTConfig
from model.gpt import GPTStage, init_full_weights
from tests.support.reference import random_batches, train_reference

GLOBAL_BATCH, STEPS, BUCKET = 16, 10, 301  # 301 elements: parameters straddle buckets


SEED = 99


ADAM = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


CLIP = 0.05


def tiny_cfg(**kw) -> GPTConfig:
    base = dict(
        vocab_size=50,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        make_vocab_size_divisible_by=8,
    )
    base.update(kw)
    return GPTConfig(**base)


def make_batches(cfg: GPTConfig, n: int, batch: int = GLOBAL_BATCH, seed: int = 5):
    return random_batches(cfg.vocab_size, cfg.seq_length, n, batch, seed)


def reference(cfg: GPTConfig, batches, steps=STEPS, clip_grad=0.0):
    return train_reference(
        init_full_weights(cfg, SEED),
        batches,
        vocab_size=cfg.vocab_size,
        num_heads=cfg.num_attention_heads,
        steps=steps,
        clip_grad=clip_grad,
        **ADAM,
    )


def build(cfg, groups, stage, overlap, bucket=BUCKET, clip_grad=0.0, scaler=None, **ddp_kw):
    model = GPTStage(cfg, groups, range(cfg.num_layers), True, True, SEED)
    if cfg.params_dtype != torch.float32:
        cast_model_(model, cfg.params_dtype)
    ddp = DataParallel([model], groups, zero_stage=stage, bucket_size=bucket, overlap_comm=overlap, **ddp_kw)
    opt = DistributedOptimizer(
        ddp,
        groups,
        lr=ADAM["lr"],
        beta1=ADAM["betas"][0],
        beta2=ADAM["betas"][1],
        eps=ADAM["eps"],
        weight_decay=ADAM["weight_decay"],
        clip_grad=clip_grad,
        loss_scaler=scaler,
        allgather_bucket_size=1001,
    )
    return model, ddp, opt


def tokens_per_rank(batches, groups):
    return batches[0][0].shape[0] // groups.dp_size


def train(model, ddp, opt, groups, batches, num_micro, steps=STEPS, on_backward=None):
    """Train; each DP rank takes its rows of the global batch, cut into ``num_micro``
    micro-batches. Returns (global-batch losses, step results, model_state_bytes per step)."""
    assert tokens_per_rank(batches, groups) % num_micro == 0
    dp, r = groups.dp_size, groups.dp_rank
    losses, results, state_bytes = [], [], []
    for step in range(steps):
        tokens, labels = batches[step % len(batches)]
        rows = tokens.shape[0] // dp
        tokens, labels = tokens[r * rows : (r + 1) * rows], labels[r * rows : (r + 1) * rows]
        rank_tokens = labels.numel()  # this DP rank's tokens in the global batch
        opt.zero_grad()
        total = torch.zeros(1)
        for m, (t, l) in enumerate(zip(tokens.chunk(num_micro), labels.chunk(num_micro))):
            loss = model(t, l).float().sum() / rank_tokens
            ddp.before_backward(0, m == num_micro - 1)
            if on_backward is not None:
                on_backward(step, m)
            opt.scale_loss(loss).backward()
            total += loss.detach()
        C.all_reduce_sum(total, groups.dp)
        losses.append(total.item() / dp)
        results.append(opt.step())
        state_bytes.append(opt.model_state_bytes())
    return losses, results, state_bytes


def pipeline_steps(groups, chunks, ddp, opt, batches, kind, vp, num_micro, cfg):
    rows = tokens_per_rank(batches, groups)
    r, mb = groups.dp_rank, rows // num_micro
    actions = build_schedule(kind, num_micro, 2, groups.pp_rank, vp)
    losses = []
    for step in range(len(batches)):
        tokens, labels = (t[r * rows : (r + 1) * rows] for t in batches[step])
        micro = list(zip(tokens.chunk(num_micro), labels.chunk(num_micro)))

        def forward_step(batch, chunk, input_tensor):
            x = batch[0] if input_tensor is None else input_tensor
            if chunk.post_process:
                return chunk(x, batch[1]), lambda out: out.sum() / labels.numel()
            return chunk(x), None

        opt.zero_grad()
        loss = run_schedule(
            actions,
            chunks,
            forward_step,
            micro,
            groups,
            tensor_shape=(mb, cfg.seq_length, cfg.hidden_size),
            dtype=torch.float32,
            num_microbatches=num_micro,
            vp_size=vp,
            before_backward=ddp.before_backward,
            scale_loss=opt.scale_loss,
        )
        C.all_reduce_sum(loss, groups.dp)
        losses.append(loss.item() / 2)
        opt.step()
    shared = [p for c in chunks for p in c.parameters() if getattr(p, "shared_embedding", 0)]
    return dict(losses=losses, shared=[p.detach().numpy().copy() for p in shared])
