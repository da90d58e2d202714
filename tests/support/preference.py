"""Preference pairs for the post-training tests: a small Hugging Face tokenizer and
``python -m data.preference``'s files, written into one folder."""

from __future__ import annotations

import json

from tests.support.extras import require
from tests.support.hf_tokenizer import corpus


def write_pairs(folder, records: list[dict]) -> tuple[str, str]:
    """(tokenizer path, data prefix) of ``records`` (``data.preference``'s record forms)
    preprocessed under ``folder`` (a ``pathlib.Path``) with a 320-token byte-level BPE."""
    require("tokenizers")
    from data.preference import preprocess_preference
    from data.tokenizer import train_hf_tokenizer

    tok = train_hf_tokenizer(corpus(200), 320, str(folder / "tokenizer.json"))
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess_preference(
        [str(folder / "pairs.jsonl")], tok, str(folder / "pref"), tokenizer_type="HuggingFaceTokenizer"
    )
    return tok, str(folder / "pref")


def _dpo_losses(post, pw, pl, rw_ref, rl_ref, nw, nl):
    """Per-pair losses [P] and implicit rewards of ``--post-train dpo`` written from the papers:
    DPO with conservative label smoothing e (Rafailov et al. 2023, eq. 7; Mitchell 2023), IPO on
    token-averaged log-ratios (Azar et al. 2023, eq. 17), the SLiC hinge (Zhao et al. 2023),
    SimPO (Meng et al. 2024, eq. 6), plus RPO's chosen NLL per token (Pang et al. 2024)."""
    import torch.nn.functional as F

    beta, e = post.dpo_beta, post.dpo_label_smoothing
    if post.dpo_loss == "simpo":
        rw, rl = beta * pw / nw, beta * pl / nl
        u = rw - rl - post.simpo_gamma
        loss = -(1 - e) * F.logsigmoid(u) - e * F.logsigmoid(-u)
    else:
        hw, hl = pw - rw_ref, pl - rl_ref
        rw, rl = beta * hw, beta * hl
        if post.dpo_loss == "ipo":
            loss = (hw / nw - hl / nl - 1 / (2 * beta)) ** 2
        elif post.dpo_loss == "hinge":
            loss = (1 - beta * (hw - hl)).clamp_min(0)
        else:
            loss = -(1 - e) * F.logsigmoid(beta * (hw - hl)) - e * F.logsigmoid(-beta * (hw - hl))
    if post.dpo_sft_weight > 0:
        loss = loss + post.dpo_sft_weight * (-pw / nw)
    return loss, rw, rl


def plain_post_training(argv: list[str], steps: int) -> dict:
    """``--post-train dpo`` or ``rm`` written on ``tests/support/reference.py``'s GPT with
    ``torch.optim.Adam``, in one process and without megazero's model, losses or optimizer:
    ``{"steps": [per step: loss, grad_norm and the mode's metrics], "params": canonical name ->
    tensor after ``steps`` steps}``. ``argv`` is a one-process megazero command line with a
    constant learning rate and no weight decay or clipping (Adam's update then has no other
    term); the initial weights are megazero's seeded ones, the reference model (dpo) stays at them.

    Each step takes the next global batch of pairs (rows 2j chosen, 2j + 1 rejected) and
    minimises the mean pair loss: DPO's (``_dpo_losses``) on the summed log-probabilities of the
    response tokens, or the reward model's Bradley-Terry loss -log sigmoid(s_w - s_l - m) +
    c (s_w + s_l)^2 (Ouyang et al. 2022, eq. 1; Touvron et al. 2023, sec. 3.2.2) on the score
    head [1, H] times the final-norm hidden state at each sequence's last response position."""
    import torch
    import torch.nn.functional as F

    from data.preference import split_margins
    from data.sft import sft_micro_batches
    from megazero import training
    from megazero.config import config_from_argv
    from model.build import build_gpt_config
    from model.spec import init_full_weights
    from tests.support.reference import ReferenceGPT, block_options

    cfg = config_from_argv(argv, 1)
    data = training.build_data(cfg)
    gcfg = build_gpt_config(cfg, data.vocab_size)
    full = dict(init_full_weights(gcfg, cfg.train.seed))
    head = full.pop("value_head.weight", None)
    build = dict(vocab_size=data.vocab_size, num_heads=cfg.model.num_attention_heads, **block_options(gcfg))
    policy, reference = ReferenceGPT.from_full_weights(full, **build), ReferenceGPT.from_full_weights(full, **build)
    params = dict(policy.canonical_parameters())
    if head is not None:
        params["value_head.weight"] = torch.nn.Parameter(head.clone())
    o, post, gbs = cfg.optim, cfg.post, cfg.train.global_batch_size
    adam = torch.optim.Adam(params.values(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)

    def logps(model, tokens, labels, mask):
        logits = model(tokens)
        each = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return (each.reshape(labels.shape).double() * mask.double()).sum(dim=1)  # (2P,)

    out = []
    for step in range(steps):
        ((tokens, labels, mask),) = sft_micro_batches(data.train, gbs * step, gbs, gbs, 0, 1)
        if post.mode == "rm":
            (margins,) = split_margins(data.train, gbs * step, gbs, gbs, 0, 1)
            last = torch.tensor([int(torch.nonzero(row).max()) for row in mask])  # (2P,)
            hidden = policy(tokens, return_hidden=True)  # (2P, T, H)
            s = (hidden[torch.arange(len(last)), last] @ params["value_head.weight"].t()).squeeze(-1).double()
            sw, sl = s[0::2], s[1::2]
            x = sw - sl - (margins.double() if post.rm_use_margin else 0.0)
            loss = (-F.logsigmoid(x) + post.rm_center_coef * (sw + sl) ** 2).mean()
            values = dict(rm_accuracy=(sw > sl).double().mean(), rm_chosen_score=sw.mean(), rm_rejected_score=sl.mean())
        else:
            with torch.no_grad():
                ref = logps(reference, tokens, labels, mask)
            n = mask.double().sum(dim=1)
            p = logps(policy, tokens, labels, mask)
            pair, rw, rl = _dpo_losses(post, p[0::2], p[1::2], ref[0::2], ref[1::2], n[0::2], n[1::2])
            loss = pair.mean()
            values = dict(
                rewards_chosen=rw.mean(),
                rewards_rejected=rl.mean(),
                reward_accuracy=(rw > rl).double().mean(),
                reward_margin=(rw - rl).mean(),
            )
        adam.zero_grad()
        loss.backward()
        norm = torch.linalg.vector_norm(
            torch.stack([q.grad.double().norm() for q in params.values() if q.grad is not None])
        )
        adam.step()
        out.append(dict(loss=loss.item(), grad_norm=norm.item(), **{k: v.item() for k, v in values.items()}))
    return dict(steps=out, params={k: v.detach().clone() for k, v in params.items()})


def train_runs(rank, world, runs, params=False):
    """A ``run_distributed`` target: for each ``(argv, steps)`` of ``runs``, build the trainer
    (loading ``--load``, weights only with ``--finetune``), run ``steps`` steps and save to
    ``--save`` if given. Returns per run ``{"start": the loaded iteration or None, "iteration":
    the trainer's first, "steps": each step's logged values (loss, grad_norm, the mode's
    metrics)}``, plus ``"params"`` (canonical name -> tensor after the steps) with ``params``,
    valid in one process at ZeRO-0 only."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    out = []
    for argv, steps in runs:
        cfg = config_from_argv(argv, world)
        trainer = build_trainer(cfg, data=training.prepare_run(cfg))
        start = trainer.load_checkpoint(cfg.train.load, weights_only=cfg.train.finetune) if cfg.train.load else None
        got = dict(start=start, iteration=trainer.state.iteration, steps=[])
        for _ in range(steps):
            got["steps"].append(trainer.train_step(trainer.next_batches()).values)
        if cfg.train.save:
            trainer.save_checkpoint(cfg.train.save, wait=True)
        if params:
            got["params"] = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
        trainer.close()
        out.append(got)
    return out


def assert_same_as_plain(keys, got: dict, want: dict, what: str, tol: float = 1e-6) -> None:
    """Each step's values named in ``keys`` (loss, gradient norm, the mode's metrics) within
    ``tol`` (relative, or absolute near zero), then every parameter of ``want`` within ``tol``
    (absolute; the padded vocabulary rows of ``got`` left out). ``got`` and ``want`` as
    ``train_runs`` and ``plain_post_training`` return them; ``what`` names the run."""
    import math

    import torch

    for step, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
        for k in keys:
            assert math.isclose(g[k], w[k], rel_tol=tol, abs_tol=tol), (what, step, k, g[k], w[k])
    assert set(got["params"]) == set(want["params"]), (what, set(got["params"]) ^ set(want["params"]))
    for name, q in want["params"].items():
        p = got["params"][name][: q.shape[0]]
        assert torch.allclose(p, q, rtol=0, atol=tol), (what, name, float((p - q).abs().max()))


def plain_cache(argv: list[str], steps: int):
    """``get(extra)``: ``plain_post_training(argv + extra + ["--train-iters", steps], steps)``,
    computed once per ``extra`` (a list of flags: the model or loss a run compares with)."""
    cache: dict = {}

    def get(extra: list[str]) -> dict:
        key = tuple(extra)
        if key not in cache:
            cache[key] = plain_post_training(argv + list(extra) + ["--train-iters", str(steps)], steps)
        return cache[key]

    return get
