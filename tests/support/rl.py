"""Prompts for the reinforcement-learning tests: the demo's print tasks (``data.print_tasks``)
preprocessed by ``python -m data.prompts`` with a small Hugging Face tokenizer."""

from __future__ import annotations

import json

from tests.support.extras import require
from tests.support.hf_tokenizer import corpus


def write_prompts(folder, count: int = 64, seed: int = 0) -> tuple[str, str]:
    """(tokenizer path, prompts prefix) of ``count`` print-task records written under ``folder``
    (a ``pathlib.Path``) with a 320-token byte-level BPE trained on the test corpus and the
    records' own text."""
    require("tokenizers")
    from data.print_tasks import records
    from data.prompts import preprocess_prompts
    from data.tokenizer import train_hf_tokenizer

    recs = records(count, seed)
    texts = corpus(200) + [r["prompt"] + " " + r["answer"] for r in recs]
    tok = train_hf_tokenizer(texts, 320, str(folder / "tokenizer.json"))
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    preprocess_prompts([str(folder / "prompts.jsonl")], tok, str(folder / "rl"), tokenizer_type="HuggingFaceTokenizer")
    return tok, str(folder / "rl")


def plain_models(argv: list[str]):
    """``(cfg, data, gcfg, build, policy, reference)`` of a one-process command line: the
    reference GPT (``tests/support/reference.py``) twice at megazero's seeded initial weights,
    ``build`` its constructor's keywords."""
    from megazero import training
    from megazero.config import config_from_argv
    from model.build import build_gpt_config
    from model.spec import init_full_weights
    from tests.support.reference import ReferenceGPT, block_options

    cfg = config_from_argv(argv, 1)
    data = training.build_data(cfg)
    gcfg = build_gpt_config(cfg, data.vocab_size)
    full = dict(init_full_weights(gcfg, cfg.train.seed))
    build = dict(vocab_size=data.vocab_size, num_heads=cfg.model.num_attention_heads, **block_options(gcfg))
    return (
        cfg,
        data,
        gcfg,
        build,
        ReferenceGPT.from_full_weights(full, **build),
        ReferenceGPT.from_full_weights(full, **build),
    )


def plain_rows(r: dict, S: int, eod: int):
    """A stored rollout (``grpo_runs``' dict) as plain training rows: ``tokens``, ``labels``
    ``[N, S]`` (prompt, response, then ``eod``; labels the next token), the response-label mask
    ``m`` and the rollout's log-probabilities ``old`` at those labels (``[N, S]`` float64)."""
    import torch

    G, N = r["group_size"], r["tokens"].shape[0]
    seqs = torch.full((N, S + 1), eod, dtype=torch.long)
    m = torch.zeros(N, S, dtype=torch.float64)
    old = torch.zeros(N, S, dtype=torch.float64)
    for n in range(N):
        prompt, k = r["prompts"][n // G], int(r["mask"][n].sum())
        L = len(prompt)
        seqs[n, :L] = torch.tensor(prompt)
        seqs[n, L : L + k] = r["tokens"][n, :k]
        m[n, L - 1 : L - 1 + k] = 1
        old[n, L - 1 : L - 1 + k] = r["log_probs"][n, :k].double()
    return seqs[:, :-1], seqs[:, 1:], m, old


def prompt_task(tmp_path_factory, name: str, argv: list[str], mode: str) -> dict:
    """A module's RL task: print-task prompts written under a fresh folder ``name`` and
    ``argv`` completed with their data flags and ``--post-train mode``: ``{"dir", "argv",
    "ptx"}``, ``ptx`` the flags of a pretraining corpus (the test corpus, ``python -m
    data.preprocess`` with the same tokenizer) for PPO's ``--ptx-coef`` term."""
    import json

    from data.preprocess import preprocess

    d = tmp_path_factory.mktemp(name)
    tok, prefix = write_prompts(d)
    src = d / "ptx.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(120)), encoding="utf-8")
    preprocess(str(src), ["text"], tok, str(d / "ptx"), progress=False, tokenizer_type="HuggingFaceTokenizer")
    return dict(
        dir=d,
        argv=argv + ["--data-path", prefix, "--tokenizer-model", tok, "--post-train", mode],
        ptx=["--ptx-data-path", str(d / "ptx_text_document")],
    )


def text_reward(prompt: str, response: str, answer: str) -> float:
    """A test reward with many values for an untrained model's responses: the stripped
    response's length modulo 5, over 4 (``--reward python:tests.support.rl:text_reward``)."""
    return (len(response.strip()) % 5) / 4


def grpo_runs(rank, world, runs, params=False):
    """A ``run_distributed`` target: for each ``(argv, rollouts)`` of ``runs``, build the trainer
    and run one iteration per rollout: a stored rollout (a ``StoredRollout.to_dict()``), or None
    to sample the next one. Saves to ``--save`` if given. Returns per run ``{"steps": each
    iteration's logged values, "rollouts": each iteration's rollout as a dict}``, plus
    ``"params"`` (canonical name -> tensor; one process at ZeRO-0 only; and ``"critic"``, the PPO
    critic's) with ``params``."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer
    from megazero.training.rl import StoredRollout

    out = []
    for argv, rollouts in runs:
        cfg = config_from_argv(argv, world)
        trainer = build_trainer(cfg, data=training.prepare_run(cfg))
        if cfg.train.load:
            trainer.load_checkpoint(cfg.train.load)
        got = dict(steps=[], rollouts=[])
        for stored in rollouts:
            r = trainer.next_batches() if stored is None else StoredRollout(**stored)
            got["rollouts"].append({k: v.cpu() if hasattr(v, "cpu") else v for k, v in r.to_dict().items()})
            got["steps"].append(trainer.train_step(r).values)
        if cfg.train.save:
            trainer.save_checkpoint(cfg.train.save, wait=True)
        if params:
            got["params"] = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
            if trainer.critic is not None:  # --post-train ppo
                got["critic"] = {n: p.detach().clone() for c in trainer.critic.chunks for n, p in c.named_parameters()}
        trainer.close()
        out.append(got)
    return out


def plain_grpo(argv: list[str], rollouts: list[dict]) -> dict:
    """GRPO written from the papers on ``tests/support/reference.py``'s GPT with
    ``torch.optim.Adam``, without megazero's model, losses or optimizer: one iteration per stored
    rollout (dicts as ``grpo_runs`` returns them). ``argv``: a one-process megazero command line
    with a constant learning rate and no weight decay or clipping; the initial weights are
    megazero's seeded ones and the reference model stays at them. Returns ``{"steps": per
    iteration the mean loss over its optimizer steps and the last step's gradient norm,
    "params": canonical name -> tensor after the last iteration}``.

    Per rollout of P prompts x G responses: rewards r, advantages ``(r - mean) / (std + 1e-6)``
    over each group (DeepSeekMath, sec. 4.1.2; std with Bessel's correction), ``r - mean``
    (Dr. GRPO) or ``G / (G - 1) (r - mean)`` (RLOO); then ``--grpo-iterations`` passes of one
    Adam step per ``--global-batch-size`` rows: the ratio ``exp(logp - old)`` of the response
    tokens' log-probabilities of ``softmax(logits / temperature)``, the clipped surrogate
    ``-min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)`` (Schulman et al. 2017, eq. 7)
    plus ``beta`` times the k1 / k2 / k3 KL estimate, averaged over the step's response tokens
    (token-mean), over each response then the responses (seq-mean-token-mean), or summed over
    responses x --max-new-tokens (seq-mean-token-sum-norm); with the filter, groups whose
    rewards are all equal leave the loss and its counts. With ``--grpo-kl-in-reward`` the KL leaves
    the loss for the rewards: each response's reward minus ``beta`` times its summed KL estimate
    (the rollout's log-probabilities against the reference's) before the advantages; the filter
    still reads the scores."""
    import torch

    cfg, data, gcfg, build, policy, reference = plain_models(argv)
    params = dict(policy.canonical_parameters())
    o, p, S = cfg.optim, cfg.post, cfg.model.seq_length
    adam = torch.optim.Adam(params.values(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    eod = data.tokenizer.eod

    def logps(model, tokens, labels):
        logits = model(tokens).double() / p.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None])[..., 0]  # (B, S)

    out = []
    for r in rollouts:
        G = r["group_size"]
        N = r["tokens"].shape[0]
        tokens, labels, m, old = plain_rows(r, S, eod)
        s = r["scores"].double().reshape(-1, G)
        kept = torch.ones(N, dtype=torch.float64)
        if p.grpo_filter_groups_with_same_reward:  # by the verifier's scores
            kept = (s.max(dim=1).values != s.min(dim=1).values).double().repeat_interleave(G)
        if p.grpo_kl_in_reward:  # each response's summed KL estimate at the rollout's log-probabilities
            with torch.no_grad():
                d = logps(reference, tokens, labels) - old
            kl = {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - d - 1}[p.grpo_kl_estimator]
            s = s - p.grpo_kl_beta * (kl * m).sum(dim=1).reshape(-1, G)
        centred = s - s.mean(dim=1, keepdim=True)
        if p.grpo_advantage == "grpo":
            adv = centred / (s.std(dim=1, keepdim=True) + 1e-6)
        elif p.grpo_advantage == "dr_grpo":
            adv = centred
        else:
            adv = centred * G / (G - 1)
        adv = adv.reshape(-1, 1)
        losses, norm = [], None
        for _ in range(p.grpo_iterations):
            for a in range(0, N, cfg.train.global_batch_size):
                rows = slice(a, a + cfg.train.global_batch_size)
                logp = logps(policy, tokens[rows], labels[rows])
                ratio = torch.exp(logp - old[rows])
                clipped = ratio.clamp(1 - p.grpo_clamp_eps_lower, 1 + p.grpo_clamp_eps_upper)
                each = -torch.minimum(ratio * adv[rows], clipped * adv[rows])
                if p.grpo_kl_beta > 0 and not p.grpo_kl_in_reward:
                    with torch.no_grad():
                        ref = logps(reference, tokens[rows], labels[rows])
                    d = ref - logp
                    kl = {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - d - 1}[p.grpo_kl_estimator]
                    each = each + p.grpo_kl_beta * kl
                mk = m[rows] * kept[rows, None]
                n_rows = float((mk.sum(dim=1) > 0).sum())
                if p.grpo_loss_agg == "token-mean":
                    loss = (each * mk).sum() / mk.sum()
                elif p.grpo_loss_agg == "seq-mean-token-mean":
                    per_row = (each * mk).sum(dim=1) / mk.sum(dim=1).clamp_min(1)
                    loss = per_row.sum() / n_rows
                else:
                    loss = (each * mk).sum() / (n_rows * p.max_new_tokens)
                adam.zero_grad()
                loss.backward()
                norm = torch.linalg.vector_norm(torch.stack([q.grad.double().norm() for q in params.values()]))
                adam.step()
                losses.append(loss.item())
        out.append(dict(loss=sum(losses) / len(losses), grad_norm=norm.item()))
    return dict(steps=out, params={k: v.detach().clone() for k, v in params.items()})


def plain_ppo(argv: list[str], rollouts: list[dict]) -> dict:
    """PPO with a critic written from the papers on ``tests/support/reference.py``'s GPT with two
    ``torch.optim.Adam`` (policy at ``--lr``, critic at ``--critic-lr``), without megazero's model,
    losses or optimizer: one iteration per stored rollout. The critic is the seeded GPT whose
    final-norm hidden state meets a seeded ``[1, H]`` head at every position (megazero's seeded
    critic); the reference stays at the policy's initial weights.

    Per rollout: each response token's reward is ``-c (log pi_old - log pi_ref)`` plus, on the
    row's last response token, its score (InstructGPT, Ouyang et al. 2022, eq. 2; ``c`` the KL
    coefficient, fixed or Ziegler et al. 2019's controller ``c *= 1 + clip(KL / target - 1,
    +-0.2) n / horizon`` after the rollout); advantages by GAE over the row's response tokens
    (Schulman et al. 2016, eq. 16, value 0 after the last), returns = advantages + values, the
    advantages whitened over the whole rollout's response tokens (population variance, eps
    1e-8); then ``--grpo-iterations`` passes of one policy step (clipped surrogate, token mean)
    and one critic step (``0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2)``, token mean) per
    ``--global-batch-size`` rows; with ``--ptx-coef c``, after each policy step another on ``c``
    times the token-mean language-model loss of the next ``--global-batch-size`` sequences of
    ``--ptx-data-path`` (DeepSpeed-Chat's unsupervised step). Returns ``{"steps": per iteration
    the mean policy loss, the last policy step's gradient norm, the mean critic loss and the mean
    ptx loss, "params", "critic"}``."""
    import torch

    cfg, data, gcfg, build, policy, reference = plain_models(argv)
    from dataclasses import replace

    from model.spec import init_full_weights
    from tests.support.reference import ReferenceGPT

    cfull = dict(init_full_weights(replace(gcfg, value_head=True), cfg.train.seed))
    head = torch.nn.Parameter(cfull.pop("value_head.weight").clone())
    critic = ReferenceGPT.from_full_weights(cfull, **build)
    params, cparams = dict(policy.canonical_parameters()), dict(critic.canonical_parameters())
    cparams["value_head.weight"] = head
    o, p, S = cfg.optim, cfg.post, cfg.model.seq_length
    betas = (o.adam_beta1, o.adam_beta2)
    adam = torch.optim.Adam(params.values(), lr=o.lr, betas=betas, eps=o.adam_eps)
    cadam = torch.optim.Adam(cparams.values(), lr=p.critic_lr or o.lr, betas=betas, eps=o.adam_eps)
    eod, coef, ptx_step = data.tokenizer.eod, p.init_kl_coef, 0
    import torch.nn.functional as F

    from data.samplers import get_micro_batches

    def logps(model, tokens, labels):
        logits = model(tokens).double() / p.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None])[..., 0]  # (B, S)

    def values(tokens):
        return (critic(tokens, return_hidden=True).float() @ head.t()).squeeze(-1).double()  # (B, S)

    out = []
    for r in rollouts:
        N = r["tokens"].shape[0]
        tokens, labels, m, old = plain_rows(r, S, eod)
        with torch.no_grad():
            ref = logps(reference, tokens, labels)
            v_old = values(tokens)
        adv = torch.zeros(N, S, dtype=torch.float64)
        for n in range(N):
            pos = [t for t in range(S) if m[n, t] > 0]
            reward = {t: -coef * float(old[n, t] - ref[n, t]) for t in pos}
            score = float(r["scores"][n])
            if p.clip_reward_value is not None:
                score = min(max(score, -p.clip_reward_value), p.clip_reward_value)
            reward[pos[-1]] += score
            a_next, v_next = 0.0, 0.0
            for t in reversed(pos):
                delta = reward[t] + p.gamma * v_next - float(v_old[n, t])
                a_next = delta + p.gamma * p.lam * a_next
                adv[n, t], v_next = a_next, float(v_old[n, t])
        ret = (adv + v_old) * m
        on = m > 0
        mean, var = adv[on].mean(), adv[on].var(unbiased=False)
        white = torch.where(on, (adv - mean) / torch.sqrt(var + 1e-8), 0.0)
        kl_per_response = float(((old - ref) * m).sum()) / N
        if p.kl_target is not None:
            coef *= 1 + min(max(kl_per_response / p.kl_target - 1, -0.2), 0.2) * N / p.kl_horizon
        losses, closses, ptx, norm = [], [], [], None
        for _ in range(p.grpo_iterations):
            for a in range(0, N, cfg.train.global_batch_size):
                rows = slice(a, a + cfg.train.global_batch_size)
                mk = m[rows]
                ratio = torch.exp(logps(policy, tokens[rows], labels[rows]) - old[rows])
                clipped = ratio.clamp(1 - p.grpo_clamp_eps_lower, 1 + p.grpo_clamp_eps_upper)
                each = -torch.minimum(ratio * white[rows], clipped * white[rows])
                loss = (each * mk).sum() / mk.sum()
                adam.zero_grad()
                loss.backward()
                norm = torch.linalg.vector_norm(torch.stack([q.grad.double().norm() for q in params.values()]))
                adam.step()
                losses.append(loss.item())
                if p.ptx_coef > 0:  # DeepSpeed-Chat's unsupervised step: coef x the token-mean LM loss
                    gbs = cfg.train.global_batch_size
                    ((pt, pl),) = get_micro_batches(data.ptx, ptx_step * gbs, gbs, gbs, 0, 1)
                    logits = policy(pt)
                    lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), pl.reshape(-1))
                    adam.zero_grad()
                    (p.ptx_coef * lm).backward()
                    adam.step()
                    ptx.append(lm.item())
                    ptx_step += 1
                v = values(tokens[rows])
                vo = v_old[rows]
                vc = torch.maximum(torch.minimum(v, vo + p.cliprange_value), vo - p.cliprange_value)
                closs = (0.5 * torch.maximum((v - ret[rows]) ** 2, (vc - ret[rows]) ** 2) * mk).sum() / mk.sum()
                cadam.zero_grad()
                closs.backward()
                cadam.step()
                closses.append(closs.item())
        out.append(
            dict(
                loss=sum(losses) / len(losses),
                grad_norm=norm.item(),
                rl_critic_loss=sum(closses) / len(closses),
                rl_ptx_loss=sum(ptx) / len(ptx) if ptx else None,
            )
        )
    return dict(
        steps=out,
        params={k: q.detach().clone() for k, q in params.items()},
        critic={k: q.detach().clone() for k, q in cparams.items()},
    )
