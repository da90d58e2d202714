"""The GPT's parameters declared once (``megazero.param_spec.ParamSpec`` entries).

``build_spec`` lists every canonical parameter of the GPT-2 block (Radford et al. 2019) or
of the LLaMA-style block (Touvron et al. 2023: RoPE, RMSNorm, SwiGLU, grouped-query
attention, no linear biases, untied output) with its full shape, tensor-parallel partition,
init rule, weight decay and tying. ``GPTStage`` takes its partition tags and checkpoint
names from it, ``init_full_weights`` its initial values, ``megazero.planning.memory`` and
``megazero.planning.flops`` their counts.

Canonical layouts (docs/design.md, "Interfaces" > Model), with ``d`` the head size:

- ``attn.qkv.weight`` of multi-head attention (no ``num_query_groups``): ``[q; k; v]``,
  ``[3A, H]`` with ``A = heads * d`` (``H`` unless ``kv_channels`` sets ``d``), partition
  stride 3 (each rank takes its heads of q, of k and of v); ``attn.proj.weight`` ``[H, A]``.
- with ``qk_layernorm``: ``attn.q_norm.weight`` and ``attn.k_norm.weight``, ``[d]`` each,
  replicated over tp (the norm acts on each head alone).
- with ``softmax_type`` ``"learnable"``: ``attn.sinks`` ``[heads]``, one logit per query head,
  partitioned over tp with the heads (group-major, so each rank's are contiguous), init N(0, std) as
  transformers' gpt-oss.
- with grouped-query attention (``G`` groups): ``G`` blocks of ``[q (heads/G * d rows);
  k (d); v (d)]``, ``[(heads + 2G) d, H]``, stride 1: each rank holds ``G/tp`` whole groups,
  their queries with their key and value heads (Megatron-LM's layout). Query head ``h``
  belongs to group ``h // (heads/G)``.
- with ``multi_latent_attention`` (model/mla.py; ``n``, ``r``, ``v`` = qk_head_dim, qk_pos_emb_head_dim,
  v_head_dim) instead of ``qkv``: ``attn.q_a.weight`` ``[q_lora_rank, H]``, ``attn.q_a_norm.weight``
  ``[q_lora_rank]`` and ``attn.q_b.weight`` ``[heads (n + r), q_lora_rank]`` (or ``attn.q.weight``
  ``[heads (n + r), H]`` without ``q_lora_rank``), ``attn.kv_a.weight`` ``[kv_lora_rank + r, H]``,
  ``attn.kv_a_norm.weight`` ``[kv_lora_rank]``, ``attn.kv_b.weight`` ``[heads (n + v), kv_lora_rank]``,
  ``attn.proj.weight`` ``[H, heads v]``; ``q_b`` / ``q`` / ``kv_b`` split over tp by whole heads, the
  ``a`` projections and their norms replicated; the rope rows in rotate-half order.
- ``mlp.fc1.weight`` of a gated MLP (SwiGLU, quick GEGLU): ``[gate; up]``, ``[2F, H]``, stride 2;
  ``fc2`` ``[H, F]``.
- an MoE layer (``cfg.is_moe_layer(i)``) has instead ``mlp.router.weight`` ``[E, H]``
  (replicated over tp; with ``moe_router_linear_bias`` also ``mlp.router.bias`` ``[E]``, zeros, no
  weight decay, gpt-oss's ``router.bias``),
  ``mlp.experts.{j}.fc1/fc2.*`` for every expert j (its global index,
  so expert parallelism can re-shard them), each laid out and partitioned as the dense MLP
  with ``moe_ffn_hidden_size``, and ``mlp.shared_experts.fc1/fc2.*`` for a shared expert.
- with ``mtp_num_layers`` D, the multi-token prediction modules ``mtp.{k}.*`` (``_mtp_spec``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

import torch

from megazero.param_spec import ParamSpec

if TYPE_CHECKING:  # model.config imports this module (GPTConfig.parameter_spec)
    from model.config import GPTConfig


def _layer_spec(cfg: GPTConfig, i: int) -> list[ParamSpec]:
    return [
        ParamSpec(
            f"layers.{i}.{name}",
            shape,
            "layer",
            i,
            dim,
            stride,
            init,
            weight_decay=len(shape) >= 2,
            matmul=mm,
            active=active,
        )
        for name, shape, dim, stride, init, mm, active in _block_rows(cfg, cfg.is_moe_layer(i))
    ]


def _block_rows(cfg: GPTConfig, moe: bool) -> list[tuple]:
    """One block's rows ``(name in the block, shape, partition dim, stride, init, matmul, active)``;
    an MoE MLP when ``moe``, else the dense one."""
    H, d, heads, G = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.kv_heads
    grouped = cfg.num_query_groups is not None
    A = cfg.attention_width  # heads * d: H unless --kv-channels
    qkv_rows, qkv_stride = ((heads + 2 * G) * d, 1) if grouped else (3 * A, 3)
    mlp_weights, mlp_biases, active = [], [], {}  # active: name -> fraction of tokens (an expert's: k / E)
    if not moe:
        mlp_weights, mlp_biases = _mlp_rows(cfg, "mlp", cfg.ffn_hidden_size)
    else:
        E = cfg.num_experts
        mlp_weights.append(("mlp.router.weight", (E, H), None, 1, "normal", True))
        if cfg.moe_router_linear_bias:  # a bias row even under --disable-bias-linear
            mlp_weights.append(("mlp.router.bias", (E,), None, 1, "zeros", False))
        for j in range(E):
            weights, biases = _mlp_rows(cfg, f"mlp.experts.{j}", cfg.moe_ffn_hidden_size)
            mlp_weights += weights
            mlp_biases += biases
            active.update({name: cfg.moe_router_topk / E for name, *_ in weights + biases})
        if cfg.moe_shared_expert_intermediate_size is not None:
            weights, biases = _mlp_rows(cfg, "mlp.shared_experts", cfg.moe_shared_expert_intermediate_size)
            mlp_weights += weights
            mlp_biases += biases
    attention = (
        _mla_rows(cfg)
        if cfg.multi_latent_attention
        else [
            ("attn.qkv.weight", (qkv_rows, H), 0, qkv_stride, "normal", True),
            ("attn.proj.weight", (H, A), 1, 1, "scaled_normal", True),
        ]
    )
    rows = [  # (name, shape, partition dim, stride, init, matmul)
        ("ln1.weight", (H,), None, 1, "ones", False),
        *attention,
        ("ln2.weight", (H,), None, 1, "ones", False),
    ] + mlp_weights
    if cfg.qk_layernorm:  # one weight per head dimension, shared by every head (each rank keeps a copy)
        rows += [(f"attn.{x}_norm.weight", (d,), None, 1, "ones", False) for x in "qk"]
    if cfg.softmax_type == "learnable":  # a sink logit per query head, split over tp with the heads
        rows += [("attn.sinks", (heads,), 0, 1, "normal", False)]
    if cfg.normalization == "LayerNorm":
        rows += [("ln1.bias", (H,), None, 1, "zeros", False), ("ln2.bias", (H,), None, 1, "zeros", False)]
    if cfg.qkv_bias:  # --add-qkv-bias keeps this one without the others
        rows += [("attn.qkv.bias", (qkv_rows,), 0, qkv_stride, "zeros", False)]
    if cfg.add_bias_linear:
        rows += [("attn.proj.bias", (H,), None, 1, "zeros", False)] + mlp_biases
    return [(*row, active.get(row[0], 1.0)) for row in rows]


def _mtp_spec(cfg: GPTConfig) -> list[ParamSpec]:
    """The multi-token prediction modules' parameters (model/mtp.py), on the last stage: per depth
    ``mtp.{k}`` (k = 0 .. D-1 predicts the token k+2 ahead) the norms of the embedding and of the
    hidden state (``enorm``, ``hnorm``, ``[H]``), the projection ``eh_proj`` ``[H, 2H]`` of
    ``[enorm(e); hnorm(h)]`` (replicated over tp), one dense block (``block.*``, laid out as a
    layer's) and its final norm (``final_ln``)."""
    H, layernorm = cfg.hidden_size, cfg.normalization == "LayerNorm"
    spec = []
    for k in range(cfg.mtp_num_layers):
        rows = [(f"{n}.weight", (H,), None, 1, "ones", False, 1.0) for n in ("enorm", "hnorm")]
        rows += [(f"{n}.bias", (H,), None, 1, "zeros", False, 1.0) for n in ("enorm", "hnorm") if layernorm]
        rows += [("eh_proj.weight", (H, 2 * H), None, 1, "normal", True, 1.0)]
        rows += [(f"block.{row[0]}", *row[1:]) for row in _block_rows(cfg, moe=False)]
        rows += [("final_ln.weight", (H,), None, 1, "ones", False, 1.0)]
        rows += [("final_ln.bias", (H,), None, 1, "zeros", False, 1.0)] if layernorm else []
        spec += [
            ParamSpec(
                f"mtp.{k}.{name}",
                shape,
                "head",
                partition_dim=dim,
                partition_stride=stride,
                init=init,
                weight_decay=len(shape) >= 2,
                matmul=mm,
            )
            for name, shape, dim, stride, init, mm, _ in rows
        ]
    return spec


def _mla_rows(cfg: GPTConfig) -> list:
    """Multi-head latent attention's rows (model/mla.py): per head ``[nope; rope]`` query rows and
    ``[k_nope; v]`` key/value rows, column-parallel by whole heads; ``kv_a`` rows ``[latent; k_pe]``."""
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    n, r, v = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    L, Q = cfg.kv_lora_rank, cfg.q_lora_rank
    if Q is None:
        rows = [("attn.q.weight", (heads * (n + r), H), 0, 1, "normal", True)]
    else:
        rows = [
            ("attn.q_a.weight", (Q, H), None, 1, "normal", True),
            ("attn.q_a_norm.weight", (Q,), None, 1, "ones", False),
            ("attn.q_b.weight", (heads * (n + r), Q), 0, 1, "normal", True),
        ]
    return rows + [
        ("attn.kv_a.weight", (L + r, H), None, 1, "normal", True),
        ("attn.kv_a_norm.weight", (L,), None, 1, "ones", False),
        ("attn.kv_b.weight", (heads * (n + v), L), 0, 1, "normal", True),
        ("attn.proj.weight", (H, heads * v), 1, 1, "scaled_normal", True),
    ]


def _mlp_rows(cfg: GPTConfig, prefix: str, ffn: int) -> tuple[list, list]:
    """The weight rows and the bias rows of one MLP of inner width ``ffn`` (the dense MLP, an
    expert or the shared expert): ``fc1`` column-parallel (gated: ``[gate; up]``, stride 2),
    ``fc2`` row-parallel; biases with ``add_bias_linear`` (``fc2``'s replicated)."""
    H = cfg.hidden_size
    fc1_rows, fc1_stride = (2 * ffn, 2) if cfg.gated_linear_unit else (ffn, 1)
    weights = [
        (f"{prefix}.fc1.weight", (fc1_rows, H), 0, fc1_stride, "normal", True),
        (f"{prefix}.fc2.weight", (H, ffn), 1, 1, "scaled_normal", True),
    ]
    biases = (
        [
            (f"{prefix}.fc1.bias", (fc1_rows,), 0, fc1_stride, "zeros", False),
            (f"{prefix}.fc2.bias", (H,), None, 1, "zeros", False),
        ]
        if cfg.add_bias_linear
        else []
    )
    return weights, biases


def build_spec(cfg: GPTConfig, padded_vocab: int) -> list[ParamSpec]:
    """Every canonical parameter of ``cfg``'s model with a ``padded_vocab``-row vocabulary.

    Weight decay on matrices only (Megatron-LM: none on biases and norm weights).
    """
    H, V = cfg.hidden_size, padded_vocab
    spec = [
        ParamSpec(
            "embedding.word_embeddings.weight",
            (V, H),
            "embedding",
            partition_dim=0,
            vocab=True,
            tied_output=cfg.tie_embeddings,
            head_copy=cfg.mtp_num_layers > 0,  # multi-token prediction reads it on the last stage
        )
    ]
    if cfg.position_embedding_type == "learned_absolute":
        spec.append(ParamSpec("embedding.position_embeddings.weight", (cfg.max_position_embeddings, H), "embedding"))
    for i in range(cfg.num_layers):
        spec += _layer_spec(cfg, i)
    spec.append(ParamSpec("final_ln.weight", (H,), "head", init="ones", weight_decay=False))
    if cfg.normalization == "LayerNorm":
        spec.append(ParamSpec("final_ln.bias", (H,), "head", init="zeros", weight_decay=False))
    if not cfg.tie_embeddings:
        spec.append(ParamSpec("output.weight", (V, H), "head", partition_dim=0, matmul=True, vocab=True))
    if cfg.value_head:  # a reward model's scalar head (model/value_head.py), replicated over tp
        spec.append(ParamSpec("value_head.weight", (1, H), "head"))
    return spec + _mtp_spec(cfg)


def spec_by_name(cfg: GPTConfig, padded_vocab: int) -> dict[str, ParamSpec]:
    return {e.name: e for e in build_spec(cfg, padded_vocab)}


def canonical_shapes(cfg: GPTConfig, padded_vocab: int) -> dict[str, tuple]:
    """Canonical name -> full shape (docs/design.md, "Interfaces" > Model)."""
    return {e.name: e.shape for e in build_spec(cfg, padded_vocab)}


def _generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from a stable hash of ``"{seed}:{name}"`` (not Python's hash)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class InitialWeights(Mapping):
    """The initial full (unpartitioned) fp32 tensors of the model, made one at a time.

    ``weights[name]`` makes canonical tensor ``name`` from (seed, name) alone and keeps no
    reference to it, so a caller that slices its partition and drops the full tensor holds
    at most one full tensor at a time (model/gpt.py, ``GPTStage``). Each tensor follows its
    spec entry's init rule: ``normal`` ~ N(0, init_method_std), ``scaled_normal`` divides the
    std by ``sqrt(2 * num_layers)`` (GPT-2), ``zeros``, ``ones``. Vocabulary tensors draw
    ``[vocab_size, H]`` and are zero-padded to ``cfg.padded_vocab(tp_size)`` rows, so the real
    rows do not depend on ``tp_size``. Raises KeyError for a name that is not canonical.
    """

    def __init__(self, cfg: GPTConfig, seed: int, tp_size: int = 1):
        self.cfg, self.seed = cfg, seed
        self.spec = spec_by_name(cfg, cfg.padded_vocab(tp_size))
        self.std = {"normal": cfg.init_method_std, "scaled_normal": cfg.init_method_std / math.sqrt(2 * cfg.num_layers)}

    def __getitem__(self, name: str) -> torch.Tensor:
        e = self.spec[name]
        if e.init in ("zeros", "ones"):
            return (torch.zeros if e.init == "zeros" else torch.ones)(e.shape, device="cpu")
        rows = self.cfg.vocab_size if e.vocab else e.shape[0]
        full = torch.zeros(e.shape, device="cpu")  # rows past the real vocabulary stay zero
        # normal_ on the real rows draws what torch.randn((rows, ...)) draws (randn is
        # empty().normal_()); in place, with the in-place product, one tensor in all
        full[:rows].normal_(0, 1, generator=_generator(self.seed, name)).mul_(self.std[e.init])
        return full

    def __iter__(self) -> Iterator[str]:
        return iter(self.spec)

    def __len__(self) -> int:
        return len(self.spec)


def init_full_weights(
    cfg: GPTConfig, seed: int, tp_size: int = 1, names: Optional[Iterable[str]] = None
) -> dict[str, torch.Tensor]:
    """Every full (unpartitioned) fp32 tensor of the model at once, from (seed, canonical name)
    alone (``InitialWeights``' rules); ``names`` restricts the result to those canonical names
    (e.g. one pipeline stage's). The oracle (tests/support/reference.py) and the Hugging Face export
    read it; a stage builds from ``InitialWeights`` so as not to hold them all. Raises KeyError
    for a name that is not canonical."""
    weights = InitialWeights(cfg, seed, tp_size)
    return {name: weights[name] for name in (weights if names is None else names)}
