"""A plain single-process GPT: the test oracle for every layout-equivalence test (STYLE.md, 13).

Written independently of ``model/`` and ``megazero/`` (it imports only torch and math), in
the style of nanoGPT (Karpathy) and GPT-2 (Radford et al. 2019): learned position
embeddings, pre-LayerNorm blocks, causal self-attention computed with an explicit mask and
softmax, an exact (erf) GELU MLP, a final LayerNorm and an output layer that is tied to the
word embedding by default. There is no dropout: the oracle is only compared with runs that
have dropout off.

It loads the canonical full tensors of docs/design.md ("Interfaces" > Model); only the first
``vocab_size`` rows of the (padded) word embedding and output weight are used, and the loss
is ``F.cross_entropy`` over the real vocabulary, averaged over every token of the batch.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F


class _LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads = heads
        self.ln1 = _LayerNorm(hidden, eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = _LayerNorm(hidden, eps)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def attention(self, x):
        B, T, H = x.shape
        q, k, v = self.qkv(x).split(H, dim=-1)  # each (B, T, H)
        # (B, T, H) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.heads, H // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(H // self.heads)  # (B, heads, T, T)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = (probs @ v).transpose(1, 2).reshape(B, T, H)  # (B, heads, T, hd) -> (B, T, H)
        return self.proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ReferenceGPT(nn.Module):
    """GPT-2-style decoder in one process.

    Args: real ``vocab_size`` V, ``num_layers``, ``hidden_size`` H, ``num_heads``,
    ``ffn_hidden_size`` F, ``max_positions``; ``tie_embeddings`` shares the word embedding
    with the output layer; ``eps`` is the LayerNorm epsilon.
    """

    def __init__(self, vocab_size: int, num_layers: int, hidden_size: int, num_heads: int,
                 ffn_hidden_size: int, max_positions: int, tie_embeddings: bool = True,
                 eps: float = 1e-5):
        super().__init__()
        self.vocab_size, self.num_layers = vocab_size, num_layers
        self.tie_embeddings = tie_embeddings
        self.wte = nn.Embedding(vocab_size, hidden_size)
        self.wpe = nn.Embedding(max_positions, hidden_size)
        self.blocks = nn.ModuleList(_Block(hidden_size, num_heads, ffn_hidden_size, eps)
                                    for _ in range(num_layers))
        self.ln_f = _LayerNorm(hidden_size, eps)
        self.lm_head = None if tie_embeddings else nn.Linear(hidden_size, vocab_size, bias=False)

    def canonical_parameters(self) -> dict[str, nn.Parameter]:
        """Canonical name -> parameter (the word embedding holds the real rows only)."""
        out = {"embedding.word_embeddings.weight": self.wte.weight,
               "embedding.position_embeddings.weight": self.wpe.weight,
               "final_ln.weight": self.ln_f.weight, "final_ln.bias": self.ln_f.bias}
        for i, b in enumerate(self.blocks):
            for canon, mod in (("ln1", b.ln1), ("attn.qkv", b.qkv), ("attn.proj", b.proj),
                               ("ln2", b.ln2), ("mlp.fc1", b.fc1), ("mlp.fc2", b.fc2)):
                out[f"layers.{i}.{canon}.weight"] = mod.weight
                out[f"layers.{i}.{canon}.bias"] = mod.bias
        if self.lm_head is not None:
            out["output.weight"] = self.lm_head.weight
        return out

    @torch.no_grad()
    def load_full_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Copy the canonical full tensors in; vocabulary rows past ``vocab_size`` are dropped.

        Raises KeyError naming a missing canonical tensor.
        """
        for name, p in self.canonical_parameters().items():
            if name not in full:
                raise KeyError(f"full weights lack {name!r}")
            src = full[name]
            if name in ("embedding.word_embeddings.weight", "output.weight"):
                src = src[: self.vocab_size]
            p.copy_(src)

    @classmethod
    def from_full_weights(cls, full: dict[str, torch.Tensor], vocab_size: int, num_heads: int,
                          eps: float = 1e-5) -> "ReferenceGPT":
        """Build a model whose sizes are read off the canonical tensors, then load them."""
        num_layers = len({k.split(".")[1] for k in full if k.startswith("layers.")})
        max_positions, hidden = full["embedding.position_embeddings.weight"].shape
        ffn = full["layers.0.mlp.fc1.weight"].shape[0]
        model = cls(vocab_size, num_layers, hidden, num_heads, ffn, max_positions,
                    tie_embeddings="output.weight" not in full, eps=eps)
        model.load_full_weights(full)
        return model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, T]`` int64 -> logits ``[B, T, V]`` over the real vocabulary."""
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(T, device=tokens.device))  # (B, T, H)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return x @ (self.wte.weight if self.lm_head is None else self.lm_head.weight).t()

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all ``B*T`` tokens (a scalar)."""
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def train_reference(full_weights: dict[str, torch.Tensor],
                    batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, vocab_size: int,
                    num_heads: int, lr: Union[float, Callable[[int], float]], steps: int,
                    betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                    eps: float = 1e-8, clip_grad: float = 0.0, layernorm_eps: float = 1e-5,
                    optimizer: str = "adamw", return_model: bool = False):
    """Train the reference model; returns the loss before each of ``steps`` updates.

    Step ``s`` uses ``batches[s % len(batches)]`` = (tokens ``[B, T]``, labels ``[B, T]``)
    as the whole global batch (loss = mean over its tokens). ``lr`` is a constant or a
    function of the step index. ``optimizer`` is ``"adamw"`` (torch.optim.AdamW; weight
    decay on weights of 2 or more dimensions only, none on biases and LayerNorm, as in
    Megatron-LM) or ``"sgd"`` (plain torch.optim.SGD, no momentum). ``clip_grad > 0``
    clips the global gradient norm with ``torch.nn.utils.clip_grad_norm_``.
    Returns ``list[float]``, or ``(losses, model)`` when ``return_model``.
    """
    model = ReferenceGPT.from_full_weights(full_weights, vocab_size, num_heads, layernorm_eps)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    lr0 = lr(0) if callable(lr) else lr
    if optimizer == "adamw":
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr0, betas=betas, eps=eps)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr0)
    else:
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr(step) if callable(lr) else lr
        tokens, labels = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = model.loss(tokens, labels)
        loss.backward()
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, clip_grad)
        opt.step()
        losses.append(loss.item())
    return (losses, model) if return_model else losses


def random_batches(vocab_size: int, seq_length: int, n: int, batch: int, seed: int):
    """``n`` global batches of uniform random tokens: (tokens ``[batch, T]``, labels ``[batch, T]``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(0, vocab_size, (batch, seq_length + 1), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out
