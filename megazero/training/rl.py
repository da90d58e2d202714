"""``--post-train grpo``: one iteration is one rollout and the optimizer steps on it.

1. ``sample``: the iteration's ``--grpo-prompts-per-step`` prompts (``data.prompts.PromptSplit``,
   read after the prompts already consumed) are each answered ``--grpo-group-size`` times by the
   policy (``megazero.post_training.rollout.rollout``: rows split over the data-parallel
   replicas, every row's generator keyed by (seed, iteration, global prompt number, sample), so
   the rollout is the same under every layout), in eval mode, after any parameter all-gather in
   flight was waited for (a rollout never reads the weights of the step before).
2. ``score``: global rank 0 decodes each response (its tokens up to the EOD) and calls the
   ``--reward`` function with the prompt's text and answer; the scores reach every rank in one
   all-reduce (a user's function runs once per response, so one that is not deterministic
   cannot make the ranks disagree). A reward model (``--reward rm:DIR``) instead runs on every
   rank: each tp group scores every row with its own whole copy (``reward_model_rows``).
3. ``update``: group advantages, then ``--grpo-iterations`` passes over the rollout, each one
   optimizer step per ``--global-batch-size`` sequences (a mini-batch), each step's per-token
   weights computed over its whole mini-batch (``grpo.token_weights``) before the rows are cut
   over data-parallel ranks and micro-batches (``megazero.post_training.rl_step``).

A rollout is a ``StoredRollout``, which the tests save and feed to ``update`` under other layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megazero import collectives
from megazero.context_parallel.sequence import Packing, shard_micro_batch
from megazero.context_parallel.zigzag import merge_from_ranks, split_for_rank
from megazero.pipeline.executor import make_forward_step
from megazero.post_training.grpo import group_advantages, kl_penalty, token_weights, zero_variance_groups
from megazero.post_training.ppo import gae, masked_moments, shaped_rewards, whiten
from megazero.post_training.rewards import (
    parse_reward,
    reward_model_dir,
    reward_model_inputs,
    reward_model_scores,
    score,
)
from megazero.post_training.rl_step import ADVANTAGE, COLUMNS, OLD, REF, RETURN, VALUE, WEIGHT
from megazero.post_training.rollout import RolloutSettings, rollout
from megazero.runtime import resilience
from megazero.training.inputs import dp_micro_batches, ptx_steps_per_iteration


@dataclass
class StoredRollout:
    """One iteration's rollout: ``prompts`` (P lists of ids), ``prompt_keys`` (their global
    numbers), ``answers`` (P reference answers), ``group_size`` G, and for the N = P G rows
    (prompt-major) ``tokens`` / ``mask`` / ``log_probs`` ``[N, max_new_tokens]`` as
    ``megazero.post_training.rollout.Rollout`` holds them and ``scores`` ``[N]`` float64."""

    prompts: list
    prompt_keys: list
    answers: list
    group_size: int
    tokens: torch.Tensor
    mask: torch.Tensor
    log_probs: torch.Tensor
    scores: torch.Tensor

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def rollout_settings(cfg, eod: Optional[int], greedy: bool = False) -> RolloutSettings:
    """The sampler's settings from ``--max-new-tokens``, ``--temperature``, ``--top-k``,
    ``--top-p`` and ``--seed`` (``greedy``: argmax, log-probabilities at ``--temperature``)."""
    p = cfg.post
    return RolloutSettings(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        greedy=greedy,
        eod=eod,
        seed=cfg.train.seed,
    )


def decoder_of(trainer):
    """The rollout decoder of ``trainer``'s chunks (``model.rollout``)."""
    from model.rollout import make_decoder

    return make_decoder(trainer.chunks, trainer.groups)


def sample(
    trainer,
    split,
    first: int,
    count: int,
    group_size: int,
    step: int,
    greedy: bool = False,
) -> StoredRollout:
    """Responses to prompts ``first .. first + count - 1`` of ``split`` (a ``PromptSplit``, in
    its epoch order), ``group_size`` each, keyed by iteration ``step`` (collective over every
    rank; the same result everywhere). Every prompt leaves room for ``--max-new-tokens`` in
    ``--seq-length`` (``megazero.training.startup.check_prompt_room`` refused the run otherwise)."""
    cfg = trainer.cfg
    keys = [first + k for k in range(count)]
    ids = [split.index(k) for k in keys]
    prompts = [split.tokens(i) for i in ids]
    trainer.optimizer.wait_param_gather()  # the rollout reads this step's weights, never the last one's
    for c in trainer.chunks:
        c.eval()
    r = rollout(
        decoder_of(trainer),
        prompts,
        rollout_settings(cfg, trainer.eod, greedy),
        step=step,
        samples_per_prompt=group_size,
        prompt_keys=keys,
        dp_group=trainer.groups.dp,
        zero3=trainer.ddp.zero3,
        device=trainer.device,
    )
    answers = [split.answer(i) for i in ids]
    scores = score_rows(trainer, prompts, answers, group_size, r.tokens, r.mask)
    return StoredRollout(prompts, keys, answers, group_size, r.tokens, r.mask, r.log_probs, scores)


def score_rows(trainer, prompts, answers, group_size: int, tokens, mask) -> torch.Tensor:
    """``[N]`` float64 rewards of the rows (``--reward``): a function's computed on global rank
    0 and summed to every rank; a reward model's (``rm:DIR``) computed by every tp group alike
    (``reward_model_rows``)."""
    cfg, tok = trainer.cfg, trainer.data.tokenizer
    if reward_model_dir(cfg.post.reward) is not None:
        return reward_model_rows(trainer, prompts, group_size, tokens, mask)
    N = tokens.shape[0]
    out = torch.zeros(N, dtype=torch.float64, device=trainer.device)
    if trainer.groups.rank == 0:
        fn = parse_reward(cfg.post.reward)
        texts = [tok.decode(p) for p in prompts]
        for n in range(N):
            ids = tokens[n][mask[n]].tolist()
            if ids and trainer.eod is not None and ids[-1] == trainer.eod:
                ids = ids[:-1]
            j = n // group_size
            out[n] = score(fn, cfg.post.reward, texts[j], tok.decode(ids), answers[j])
    collectives.all_reduce_sum(out, trainer.groups.world)
    return out


def reward_model_rows(trainer, prompts, group_size: int, tokens, mask) -> torch.Tensor:
    """``[N]`` float64: ``--reward rm:DIR``'s score of each row's prompt and response
    (``reward_model_inputs``), ``--micro-batch-size`` rows per forward pass. Every rank holds a
    whole copy of the reward model at the run's tp (``ProcessGroups.tensor_parallel_only``,
    loaded at the first call and kept on ``trainer.reward_model``) and every tp group scores
    every row, so every rank has the same scores without communicating outside its tp group."""
    if trainer.reward_model is None:
        from megazero.training.inference import load_reward_model

        where = reward_model_dir(trainer.cfg.post.reward)
        trainer.reward_model = load_reward_model(where, trainer.groups.tensor_parallel_only(), trainer.device)
    pad = trainer.eod if trainer.eod is not None else 0
    sequences, lengths = reward_model_inputs(prompts, group_size, tokens.cpu(), mask.cpu(), trainer.eod)
    mbs = trainer.cfg.train.micro_batch_size
    parts = [
        reward_model_scores(trainer.reward_model, sequences[a : a + mbs], lengths[a : a + mbs], pad)
        for a in range(0, len(sequences), mbs)
    ]
    return torch.cat(parts).to(device=trainer.device, dtype=torch.float64)


def policy_rows(stored: StoredRollout, seq_length: int, pad: int):
    """The rollout as training rows: ``tokens``, ``labels`` ``[N, T]`` int64 (prompt, response,
    then ``pad``; labels the next token), ``mask`` ``[N, T]`` float32 (1 where the label is a
    response token) and ``extra`` ``[N, T, 4]`` float64 with the rollout's log-probability of
    each response label in column ``OLD`` (the other columns 0)."""
    N = stored.tokens.shape[0]
    G = stored.group_size
    device = stored.tokens.device
    tokens = torch.full((N, seq_length + 1), pad, dtype=torch.long, device=device)
    mask = torch.zeros(N, seq_length, dtype=torch.float32, device=device)
    extra = torch.zeros(N, seq_length, COLUMNS, dtype=torch.float64, device=device)
    for n in range(N):
        prompt = stored.prompts[n // G]
        L = len(prompt)
        k = int(stored.mask[n].sum())
        tokens[n, :L] = torch.as_tensor(prompt, dtype=torch.long, device=device)
        tokens[n, L : L + k] = stored.tokens[n, :k]
        mask[n, L - 1 : L - 1 + k] = 1.0  # the label at position t is token t + 1
        extra[n, L - 1 : L - 1 + k, OLD] = stored.log_probs[n, :k].double()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask, extra


def reference_log_probs_step(store):
    """Forward step (``megazero.pipeline.executor`` contract) of the frozen reference: its last
    stage hands ``store(batch, log_probs [B, T/cp] float64)`` and returns a zero loss."""

    def forward_step(batch, chunk, input_tensor):
        tokens, labels, seq = batch[:3]
        x = tokens if input_tensor is None else input_tensor
        out = chunk(x, labels=labels if chunk.post_process else None, seq=seq)

        def loss_fn(per_token_loss):
            store(batch, -per_token_loss.detach().double())
            return per_token_loss.new_zeros((), dtype=torch.float64)

        return out, loss_fn

    return forward_step


def local_batches(trainer, tokens, labels, mask, extra, rows: range) -> tuple[list, list]:
    """This rank's micro-batches ``(tokens, labels, seq, extra)`` of mini-batch ``rows``: the
    dp rank's contiguous share, cut into ``--micro-batch-size`` rows, each sharded over cp; and
    the global rows of each (slices)."""
    g, mbs = trainer.groups, trainer.cfg.train.micro_batch_size
    per = len(rows) // g.dp_size
    mine = range(rows.start + g.dp_rank * per, rows.start + (g.dp_rank + 1) * per)
    out, where = [], []
    for a in range(mine.start, mine.stop, mbs):
        sl = slice(a, a + mbs)
        t, lab, seq = shard_micro_batch(
            tokens[sl], labels[sl], cp=g.cp_size, cp_rank=g.cp_rank, packing=Packing(), loss_mask=mask[sl]
        )
        ex = extra[sl] if g.cp_size == 1 else split_for_rank(extra[sl], 1, g.cp_rank, g.cp_size)
        out.append((t, lab, seq, ex.contiguous()))
        where.append(sl)
    return out, where


def local_part(x: torch.Tensor, groups) -> torch.Tensor:
    """This cp rank's zigzag share ``[B, T/cp, ...]`` of whole rows ``x`` ``[B, T, ...]``."""
    return x if groups.cp_size == 1 else split_for_rank(x, 1, groups.cp_rank, groups.cp_size)


def whole_rows(x: torch.Tensor, groups) -> torch.Tensor:
    """The whole rows ``[B, T, ...]`` of every cp rank's share ``x`` ``[B, T/cp, ...]`` (one
    all-gather over cp)."""
    if groups.cp_size == 1:
        return x
    return merge_from_ranks(collectives.all_gather_list(x.contiguous(), groups.cp), 1, groups.cp_size)


def update(trainer, stored: StoredRollout, lr: float) -> dict:
    """``--grpo-iterations`` passes of optimizer steps over ``stored`` (module docstring, item 3;
    with ``--post-train ppo`` the critic steps beside the policy, ``ppo_advantages``) at
    learning rate ``lr``. Returns the iteration's values: ``loss`` (mean over its steps),
    ``grad_norm`` and ``loss_scale`` of its last step, ``skipped`` (any step skipped), ``stop``
    (a stop every rank agreed on), ``steps`` and the ``RL_KEYS`` statistics."""
    cfg, post, ppo = trainer.cfg, trainer.cfg.post, trainer.post.mode == "ppo"
    policy, critic = trainer.post.policy, trainer.critic
    device = trainer.device
    G, N = stored.group_size, stored.tokens.shape[0]
    pad = trainer.eod if trainer.eod is not None else 0
    tokens, labels, mask, extra = (x.to(device) for x in policy_rows(stored, cfg.model.seq_length, pad))
    scores = stored.scores.to(device=device, dtype=torch.float64)
    flat = zero_variance_groups(scores, G) if G > 1 else torch.zeros(N, dtype=torch.bool, device=device)
    keep = None
    if not ppo:
        keep = ~flat if post.grpo_filter_groups_with_same_reward else None
        extra[..., ADVANTAGE] = group_advantages(scores, G, post.grpo_advantage)[:, None] * mask.double()
    gbs = cfg.train.global_batch_size
    minis = [range(a, a + gbs) for a in range(0, N, gbs)]
    counts = []
    for rows in minis:
        w = token_weights(
            mask[rows.start : rows.stop],
            post.grpo_loss_agg,
            keep=None if keep is None else keep[rows.start : rows.stop],
            constant=float(post.max_new_tokens),
        )
        extra[rows.start : rows.stop, :, WEIGHT] = w
        counts.append(float((w > 0).sum()))
    cut = [local_batches(trainer, tokens, labels, mask, extra, rows) for rows in minis]
    batches = [b for b, _ in cut]
    for c in trainer.chunks:
        c.logit_temperature = post.temperature
    if trainer.post.uses_reference:
        for mb in batches:  # one forward-only schedule per mini-batch (the schedules' micro-batch count)
            reference_into(trainer, mb)
    sequence_kl = None
    if not ppo and post.grpo_kl_in_reward and trainer.post.uses_reference:
        sequence_kl = kl_in_rewards(trainer, scores, mask, extra, cut)  # the filter still reads the scores
    shaped = None
    if ppo:
        shaped = ppo_advantages(trainer, stored, mask, extra, cut)
    forward_step = make_forward_step(1.0, None, policy.loss)
    critic_step = None if critic is None else make_forward_step(1.0, None, trainer.post.value.loss)
    critic_lr = None if critic is None else critic.lr_schedule(trainer.state.iteration + 1)
    losses, stats, critic_losses, ptx_losses, result, skipped = [], [], [], [], None, False
    ptx_step = trainer.state.iteration * ptx_steps_per_iteration(cfg)  # the run's ptx steps so far
    for _ in range(post.grpo_iterations):
        for mb, count in zip(batches, counts):
            tokens_counted = torch.tensor(count, dtype=torch.float64, device=device)
            for c in trainer.chunks:
                c.train()
            trainer.ddp.zero_grad()
            loss = trainer.run_training_schedule(forward_step, mb)
            result = trainer.optimizer.step(lr, loss_tokens=tokens_counted)
            skipped = skipped or (result.skipped and not result.empty)
            losses.append(loss)
            stats.append(policy.metrics(device))
            if ppo and post.ptx_coef > 0:
                ptx_losses.append(ptx_update(trainer, ptx_step, lr))
                ptx_step += 1
            if critic is not None:
                for c in critic.chunks:
                    c.train()
                critic.ddp.zero_grad()
                critic.run_training_schedule(critic_step, mb)
                critic.optimizer.step(critic_lr, loss_tokens=tokens_counted)
                critic_losses.append(trainer.post.value.metrics(device)["critic_loss"])
    if critic is not None:
        critic.state.advance(len(stored.prompts), False)
    loss, stop = resilience.agree(torch.stack(losses).mean(), trainer.stop_flags(), trainer.replicas)
    lengths = stored.mask.sum(dim=1).double()
    values = dict(
        loss=loss,
        grad_norm=result.grad_norm,
        loss_scale=result.loss_scale,
        rl_reward=float(stored.scores.mean()),
        rl_response_length=float(lengths.mean()),
        rl_zero_variance_fraction=None if ppo else float(flat.double().mean()),
        rl_clip_fraction=sum(s["rl_clip_fraction"] for s in stats) / len(stats),
        rl_first_clip_fraction=stats[0]["rl_clip_fraction"],
        rl_first_ratio_deviation=stats[0]["rl_ratio_deviation"],
        rl_kl=sum(s["rl_kl"] for s in stats) / len(stats) if policy.settings.uses_reference else None,
    )
    if sequence_kl is not None:  # per response token, as in the loss
        values["rl_kl"] = float(sequence_kl.sum()) / max(float(mask.sum()), 1.0)
    if ppo:
        values.update(
            rl_kl=shaped["kl"],
            rl_kl_coef=shaped["kl_coef"],
            rl_critic_loss=sum(critic_losses) / len(critic_losses),
            rl_ptx_loss=ptx_mean(trainer, ptx_losses) if ptx_losses else None,
        )
    return dict(values=values, skipped=skipped, stop=stop, steps=len(stats), empty=all(c == 0 for c in counts))


def sequence_kl_sums(trainer, mask, extra, cut, kind: str) -> torch.Tensor:
    """``[N]`` float64 on every rank: each row's summed per-token KL estimate ``kind`` between
    the rollout's log-probabilities and the reference's (written on the stage holding the head,
    gathered whole over cp; one all-reduce over the world)."""
    g = trainer.groups
    out = torch.zeros(mask.shape[0], dtype=torch.float64, device=trainer.device)
    counted = any(c.post_process for c in trainer.chunks) and g.tp_rank == 0 and g.cp_rank == 0
    for mb, where in cut:
        for b, rows in zip(mb, where):
            ref = whole_rows(b[3][..., REF], g)  # (B, T)
            kl = kl_penalty(extra[rows, :, OLD], ref, kind) * mask[rows].double()
            if counted:
                out[rows] = kl.sum(dim=1)
    collectives.all_reduce_sum(out, g.world)
    return out


def kl_in_rewards(trainer, scores, mask, extra, cut) -> torch.Tensor:
    """--grpo-kl-in-reward: the advantages of ``scores - --grpo-kl-beta x`` each response's summed
    KL estimate (``sequence_kl_sums``), written into every local micro-batch's ``ADVANTAGE``
    column; returns the summed KL ``[N]``."""
    post, g = trainer.cfg.post, trainer.groups
    kl = sequence_kl_sums(trainer, mask, extra, cut, post.grpo_kl_estimator)
    adv = group_advantages(scores - post.grpo_kl_beta * kl, post.grpo_group_size, post.grpo_advantage)
    full = adv[:, None] * mask.double()
    for mb, where in cut:
        for b, rows in zip(mb, where):
            b[3][..., ADVANTAGE] = local_part(full[rows], g)
    return kl


def ppo_advantages(trainer, stored: StoredRollout, mask, extra, cut) -> dict:
    """PPO's advantages and returns (``megazero.post_training.ppo``) into each local micro-batch's
    ``ADVANTAGE``, ``RETURN`` and ``VALUE`` columns: the critic's values of the rollout
    (forward-only schedule, per mini-batch); on each micro-batch's whole rows (gathered over cp)
    the KL-shaped rewards with the controller's coefficient (the rollout's log-probabilities
    against the reference's, k1, the score on the last response token), then GAE (``--gamma``,
    ``--lam``); the advantages whitened with the whole rollout's statistics (summed over the
    world from the last stage's tp 0 / cp 0 ranks). Then the controller takes the rollout's mean
    KL per response (summed likewise). Returns ``{"kl": mean KL per response token, "kl_coef": the coefficient
    used}``. Collective."""
    post, g = trainer.cfg.post, trainer.groups
    device = trainer.device
    for mb, _ in cut:
        values_into(trainer.critic, mb)
    coef = trainer.post.kl.value
    scores = stored.scores.to(device=device, dtype=torch.float64)
    if post.clip_reward_value is not None:
        scores = scores.clamp(-post.clip_reward_value, post.clip_reward_value)
    # the ranks that hold the head (the last stage; stage 0 under ZB-V), once per row
    counted = any(c.post_process for c in trainer.chunks) and g.tp_rank == 0 and g.cp_rank == 0
    totals = torch.zeros(5, dtype=torch.float64, device=device)  # adv moments (3), kl sum, tokens
    for mb, where in cut:
        for b, rows in zip(mb, where):
            ex = b[3]
            both = whole_rows(ex[..., [REF, VALUE]], g)  # (B, T, 2)
            m, old = mask[rows], extra[rows, :, OLD]
            ref = both[..., 0] if trainer.post.uses_reference else old
            rewards = shaped_rewards(scores[rows], old, ref, m, coef, "k1")
            adv, ret = gae(rewards, both[..., 1], m, post.gamma, post.lam)
            ex[..., ADVANTAGE] = local_part(adv, g)
            ex[..., RETURN] = local_part(ret, g)
            if counted:
                on = m.double()
                kl = ((old - ref) * on).sum()
                totals += torch.cat([masked_moments(adv, m), torch.stack([kl, on.sum()])])
    collectives.all_reduce_sum(totals, g.world)
    n, s1, s2, kl, tokens = totals.tolist()
    mean = s1 / max(n, 1.0)
    var = max(s2 / max(n, 1.0) - mean * mean, 0.0)
    for mb, _ in cut:
        for b in mb:
            ex = b[3]
            ex[..., ADVANTAGE] = whiten(ex[..., ADVANTAGE], b[2].loss_mask, mean=mean, var=var)
    rows = stored.tokens.shape[0]
    trainer.post.kl.update(kl / rows, rows)
    return dict(kl=kl / max(tokens, 1.0), kl_coef=coef)


def ptx_update(trainer, step: int, lr: float) -> torch.Tensor:
    """One ptx step of ``--post-train ppo --ptx-coef`` (DeepSpeed-Chat's unsupervised step after
    each actor step; InstructGPT's PPO-ptx objective, Ouyang et al. 2022, eq. 2): the policy's
    token-mean language-model loss on the run's ``step``-th global batch of ``--ptx-data-path``
    sequences, times ``--ptx-coef``, at temperature 1, then an optimizer step at ``lr``. Returns
    this replica's loss share (fp64 0-d, the last stage's; ``ptx_mean`` reduces it)."""
    cfg = trainer.cfg
    batches = dp_micro_batches(
        trainer.data.ptx, step * cfg.train.global_batch_size, cfg, trainer.groups, trainer.device
    )
    for c in trainer.chunks:
        c.logit_temperature = 1.0
        c.train()
    trainer.ddp.zero_grad()
    local, divisor, counted = trainer.local_batches(batches)
    loss = trainer.run_training_schedule(make_forward_step(divisor / cfg.post.ptx_coef), local)
    trainer.optimizer.step(lr, loss_tokens=counted)
    for c in trainer.chunks:
        c.logit_temperature = cfg.post.temperature
    return loss


def ptx_mean(trainer, losses: list) -> float:
    """The mean ptx language-model loss (nats/token, without the coefficient) of an iteration's
    ptx steps from each replica's shares (one all-reduce over the world, as the loss's)."""
    g = trainer.groups
    v = torch.zeros(1, dtype=torch.float64, device=trainer.device)
    if g.is_last_stage and g.tp_rank == 0:
        v.copy_(torch.stack(losses).mean().reshape(1))
    collectives.all_reduce_sum(v, g.world)
    return float(v[0]) / trainer.replicas.dp_size / trainer.cfg.post.ptx_coef


@torch.no_grad()
def values_into(critic, batches: list) -> None:
    """The critic's value of each label position before the update, written into column
    ``VALUE`` of each of ``batches``' ``extra`` on the last stage (forward-only schedule)."""

    def forward_step(batch, chunk, input_tensor):
        tokens, labels, seq = batch[:3]
        x = tokens if input_tensor is None else input_tensor
        out = chunk(x, labels=labels if chunk.post_process else None, seq=seq)

        def loss_fn(values):
            batch[3][..., VALUE] = values.detach().double()
            return values.new_zeros((), dtype=torch.float64)

        return out, loss_fn

    for c in critic.chunks:
        c.eval()
    critic.run_forward_only(critic.chunks, forward_step, batches)


@torch.no_grad()
def reference_into(trainer, batches: list) -> None:
    """The frozen reference's log-probability of each label, written into column ``REF`` of
    each of ``batches``' ``extra`` on the last stage (forward-only schedule, in the training
    layout; the reference at the rollout's temperature)."""
    post = trainer.post
    chunks = post.reference_chunks()
    for c in chunks:
        c.logit_temperature = trainer.cfg.post.temperature

    def store(batch, log_probs):
        batch[3][..., REF] = log_probs

    from contextlib import nullcontext

    with post.resident.on_device() if post.resident is not None else nullcontext():
        trainer.run_forward_only(chunks, reference_log_probs_step(store), batches)


def held_out_prompts(cfg) -> int:
    """The held-out prompts of one validation: ``--eval-iters`` x ``--grpo-prompts-per-step``."""
    return cfg.train.eval_iters * cfg.post.grpo_prompts_per_step


def evaluate(trainer, split, step: int, count: int) -> dict:
    """Held-out rollouts of the first ``count`` prompts of ``split`` (its first epoch's order),
    one sampled and one greedy response each (collective): ``sampled_reward`` and
    ``greedy_reward`` (mean ``--reward``; with ``exact``, the accuracy) and
    ``sampled_length`` (mean response tokens)."""
    count = min(count, len(split))
    s = sample(trainer, split, 0, count, 1, step)
    gr = sample(trainer, split, 0, count, 1, step, greedy=True)
    return dict(
        sampled_reward=float(s.scores.mean()),
        greedy_reward=float(gr.scores.mean()),
        sampled_length=float(s.mask.sum(dim=1).double().mean()),
    )
