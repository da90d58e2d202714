"""The oracle of multi-token prediction (DeepSeek-V3 sec. 2.2; model/mtp.py): ``ReferenceMTPGPT``, the
plain single-process GPT of tests/support/reference.py with D MTP modules, and ``explicit_mtp_targets``,
the shifted inputs and targets by explicit indexing.

Nothing is rolled or padded here: depth k runs on the first ``T - k`` positions only (the positions
that have a target ``t_{i+k+1}`` inside the sequence), its input embeddings are ``wte(tokens[:, k:])``
and its hidden states depth k-1's first ``T - k`` rows; attention is causal, so the positions past
them cannot change these rows."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tests.support.packed import EOD, PACKING, packed_batches
from tests.support.reference import ReferenceGPT, reference_block, reference_norm


def explicit_mtp_targets(
    tokens: torch.Tensor, labels: torch.Tensor, depth: int, eod: Optional[int], eod_mask_loss: bool, packed: bool
) -> list:
    """Per depth k = 1..D, per sequence b and position i: ``(input token, label, counted)`` written out
    position by position: input ``tokens[b, i+k]``, label ``labels[b, i+k]`` for ``i + k < T`` (else
    ``(None, None, False)``); counted unless the label is EOD under ``eod_mask_loss`` or (``packed``)
    an EOD sits among ``tokens[b, i .. i+k]``. Returns ``[D][B][T]`` tuples."""
    B, T = tokens.shape
    out = []
    for k in range(1, depth + 1):
        rows = []
        for b in range(B):
            row = []
            for i in range(T):
                if i + k >= T:
                    row.append((None, None, False))
                    continue
                label = int(labels[b, i + k])
                counted = not (eod_mask_loss and label == eod)
                if packed and any(int(tokens[b, j]) == eod for j in range(i, i + k + 1)):
                    counted = False
                row.append((int(tokens[b, i + k]), label, counted))
            rows.append(row)
        out.append(rows)
    return out


def _documents(tokens: torch.Tensor, eod: Optional[int], reset_attention_mask=False, reset_position_ids=False):
    """(positions ``[B, T]``, hidden ``[B, T, T]`` bool or None) as ``ReferenceGPT.forward`` forms them."""
    B, T = tokens.shape
    positions, hidden = torch.arange(T).repeat(B, 1), None
    if eod is None:
        return positions, hidden
    doc = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        start = 0
        for t in range(1, T):
            if tokens[b, t - 1] == eod:
                start, doc[b, t] = t, doc[b, t - 1] + 1
            else:
                doc[b, t] = doc[b, t - 1]
            if reset_position_ids:
                positions[b, t] = t - start
    if reset_attention_mask:
        hidden = doc[:, :, None] != doc[:, None, :]  # (B, T, T)
    return positions, hidden


class ReferenceMTPGPT(ReferenceGPT):
    """``ReferenceGPT`` plus ``mtp = (D, lambda)``: per depth ``enorm``, ``hnorm``, ``eh_proj`` ``[H, 2H]``,
    one dense block of the model's options (no window) and ``final_ln``, sharing ``wte`` and the output
    layer; ``loss`` adds ``lambda / D * sum_k CE_k`` (each the mean over depth k's counted targets) and
    keeps it in ``mtp_loss``."""

    def __init__(self, vocab_size, num_layers, hidden_size, num_heads, ffn_hidden_size, max_positions, **kw):
        depth, self_scale = kw.pop("mtp")
        super().__init__(vocab_size, num_layers, hidden_size, num_heads, ffn_hidden_size, max_positions, **kw)
        eps = kw.get("eps", 1e-5)
        block = {k: v for k, v in kw.items() if k not in ("tie_embeddings", "eps", "moe", "windows")}
        rms = bool(block.get("rmsnorm"))
        self.mtp_scale = self_scale
        self.mtp = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    enorm=reference_norm(hidden_size, eps, rms),
                    hnorm=reference_norm(hidden_size, eps, rms),
                    eh_proj=nn.Linear(2 * hidden_size, hidden_size, bias=False),
                    block=reference_block(hidden_size, num_heads, ffn_hidden_size, eps, **block),
                    final_ln=reference_norm(hidden_size, eps, rms),
                )
            )
            for _ in range(depth)
        )

    def canonical_parameters(self) -> dict:
        out = super().canonical_parameters()
        blocks = [m["block"] for m in self.mtp]
        proxy = SimpleNamespace(blocks=blocks, ln_f=self.ln_f, wte=self.wte, wpe=None, lm_head=None)
        as_layers = ReferenceGPT.canonical_parameters(proxy)  # the blocks' names, as layers.{k}.*
        for name, p in as_layers.items():
            if name.startswith("layers."):
                k, rest = name[len("layers.") :].split(".", 1)
                out[f"mtp.{k}.block.{rest}"] = p
        for k, m in enumerate(self.mtp):
            for norm in ("enorm", "hnorm", "final_ln"):
                out[f"mtp.{k}.{norm}.weight"] = m[norm].weight
                if m[norm].bias is not None:
                    out[f"mtp.{k}.{norm}.bias"] = m[norm].bias
            out[f"mtp.{k}.eh_proj.weight"] = m["eh_proj"].weight
        return out

    def forward(self, tokens, eod=None, reset_attention_mask=False, reset_position_ids=False, return_hidden=False):
        x = super().forward(tokens, eod, reset_attention_mask, reset_position_ids, return_hidden=True)
        self.final_hidden = x  # (B, T, H) after the final norm: depth 0 of the MTP chain
        if return_hidden:
            return x
        return x @ self.output_weight().t()

    def output_weight(self) -> torch.Tensor:
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def loss(self, tokens, labels, eod=None, eod_mask_loss=False, **packing):
        main = super().loss(tokens, labels, eod, eod_mask_loss, **packing)
        B, T = tokens.shape
        packed = eod is not None and (eod_mask_loss or any(packing.values()))
        targets = explicit_mtp_targets(tokens, labels, len(self.mtp), eod, eod_mask_loss, packed)
        positions, hidden = _documents(tokens, eod, **packing)
        h, total = self.final_hidden, torch.zeros(())
        for k, m in enumerate(self.mtp, start=1):
            n = T - k  # positions 0 .. T-k-1 have a target
            emb = self.wte(tokens[:, k:])  # (B, n, H): token i+k at position i
            x = m["eh_proj"](torch.cat([m["enorm"](emb), m["hnorm"](h[:, :n])], dim=-1))
            x = m["final_ln"](m["block"](x, positions[:, :n], None if hidden is None else hidden[:, :n, :n]))
            logits = (x @ self.output_weight().t()).float()  # (B, n, V)
            rows = targets[k - 1]
            label = torch.tensor([[rows[b][i][1] for i in range(n)] for b in range(B)])
            counted = torch.tensor([[rows[b][i][2] for i in range(n)] for b in range(B)], dtype=torch.float32)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1), reduction="none")
            total = total + (ce * counted.reshape(-1)).sum() / counted.sum().clamp_min(1.0)
            h = x
        self.mtp_loss = (self.mtp_scale / len(self.mtp)) * total
        return main + self.mtp_loss


def mtp_reference(argv: list, steps: int, packed: bool = False) -> tuple:
    """The oracle's run of ``argv`` (a model with ``--mtp-num-layers``, on its data; with ``packed`` on
    tests/support/packed.py's batches with its document flags) over ``steps`` steps: ``(losses,
    stats)``, the main cross-entropy per step and ``train_reference``'s stats with ``mtp_losses`` and
    ``grad_norms``; computed once per pytest process, on one thread."""
    return _mtp_reference_once(tuple(argv), steps, packed)


@functools.lru_cache(maxsize=None)
def _mtp_reference_once(argv: tuple, steps: int, packed: bool) -> tuple:
    from data.samplers import get_micro_batches
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.optim.lr_schedule import LRSchedule
    from model.build import build_gpt_config
    from model.spec import init_full_weights
    from tests.support.reference import block_options, train_reference

    cfg = config_from_argv(list(argv), 1)
    run = training.build_data(cfg)
    gcfg = build_gpt_config(cfg, run.vocab_size)
    gbs = cfg.train.global_batch_size
    batches = [get_micro_batches(run.train, s * gbs, gbs, gbs, 0, 1)[0] for s in range(steps)]
    packing = None
    if packed:
        batches = packed_batches(run.vocab_size, cfg.model.seq_length, gbs, steps)
        packing = dict(eod=EOD, **PACKING)
    o = cfg.optim
    sched = LRSchedule(o.lr, o.min_lr, o.lr_warmup_iters, cfg.train.train_iters, o.lr_decay_style)
    block = block_options(gcfg)
    block["mtp"] = (gcfg.mtp_num_layers, gcfg.mtp_loss_scaling_factor)
    if "moe" in block:
        block["moe"]["group_rows"] = cfg.train.micro_batch_size  # route per micro-batch, as the trainer
    stats, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = train_reference(
            init_full_weights(gcfg, cfg.train.seed),
            batches,
            vocab_size=run.vocab_size,
            num_heads=gcfg.num_attention_heads,
            lr=lambda s: sched(s + 1),
            steps=steps,
            betas=(o.adam_beta1, o.adam_beta2),
            weight_decay=o.weight_decay,
            eps=o.adam_eps,
            clip_grad=o.clip_grad,
            layernorm_eps=gcfg.layernorm_epsilon,
            block=block,
            stats=stats,
            packing=packing,
            model_class=ReferenceMTPGPT,
        )
    finally:
        torch.set_num_threads(threads)
    return losses, stats
