"""GPTConfig: the model's sizes and regularisation, and the padded vocabulary size.

The vocabulary is padded so that the word embedding and output layer split evenly over the
tensor-parallel ranks and keep matmul-friendly shapes (Megatron-LM's
``--make-vocab-size-divisible-by``). Padded rows are zero, masked out of the softmax and
never trained (docs/design.md, contract 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of ``divisible_by * tp_size`` that is >= ``vocab_size``.

    Example: ``padded_vocab_size(1001, 128, 2) == 1024``; ``(50257, 128, 1) == 50304``.
    Raises ValueError when any argument is below 1.
    """
    if vocab_size < 1 or divisible_by < 1 or tp_size < 1:
        raise ValueError(f"vocab_size ({vocab_size}), --make-vocab-size-divisible-by "
                         f"({divisible_by}) and tp ({tp_size}) must all be >= 1")
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """``4 H``; with SwiGLU Megatron-LM's ``int(4 H * 2/3 / 64) * 64`` (same parameter count as a
    ``4 H`` GELU MLP, a multiple of 64). Example: ``(4096, True) -> 10880``; ``(32, True) -> 64``
    is the smallest width it gives, ``(16, True) -> 0`` (validation then asks for a width)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


_SPECS: dict = {}  # (repr(GPTConfig), padded vocab) -> its parameter spec (GPTConfig.parameter_spec)


@dataclass
class GPTConfig:
    """Sizes of a GPT-2-style decoder (Radford et al. 2019) and its regularisation."""

    vocab_size: int
    """Real vocabulary size (tokens the tokenizer can produce), before padding."""
    num_layers: int
    """Number of transformer blocks."""
    hidden_size: int
    """Model width H (elements)."""
    num_attention_heads: int
    """Attention heads; H must divide by it, and it by the tensor-parallel size."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width F (elements); ``None`` means ``4 * hidden_size``."""
    seq_length: int = 1024
    """Tokens per training sample T."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position embedding; ``None`` means ``seq_length``."""
    hidden_dropout: float = 0.1
    """Dropout probability after the embedding and on each residual branch."""
    attention_dropout: float = 0.1
    """Dropout probability on the attention probabilities."""
    tie_embeddings: bool = True
    """Share the word embedding with the output layer (GPT-2); False adds ``output.weight``."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights (GPT-2)."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times the tensor-parallel size."""
    sequence_parallel: bool = False
    """Partition LayerNorm/dropout activations along the sequence over TP ranks
    (Korthikanti et al. 2022); needs ``seq_length`` divisible by the TP size."""
    tp_overlap_grad_reduce: bool = True
    """Column-parallel layers overlap their input-gradient all-reduce (reduce-scatter with
    sequence parallelism) with the weight-gradient matmul; bit-identical either way."""
    params_dtype: torch.dtype = torch.float32
    """dtype of the model parameters (the fp32 master copy lives in the optimizer)."""
    label_smoothing: float = 0.0
    """Label smoothing of the cross-entropy loss (0 = none)."""
    norm_backend: str = "auto"
    """LayerNorm kernels: ``auto``, ``apex``, ``torch`` or ``reference`` (megazero.ops.norm)."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (GPT-2's position table) or ``rope`` (rotary, Su et al. 2021)."""
    rotary_base: int = 10000
    """Base of the rotary frequencies ``base^(-2j/d_rot)`` (RoPE only)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates, in (0, 1] (GPT-NeoX's partial rotary)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only, Zhang & Sennrich 2019)."""
    swiglu: bool = False
    """Gated SiLU MLP ``fc2(silu(gate) * up)`` (Shazeer 2020); ``fc1`` holds ``[gate; up]``."""
    num_query_groups: Optional[int] = None
    """Key/value heads G of grouped-query attention (Ainslie et al. 2023); ``None`` = GPT-2's
    multi-head attention with the ``[q; k; v]`` QKV layout."""
    add_bias_linear: bool = True
    """Biases in the QKV, attention output and MLP linears (False = Megatron's
    ``--disable-bias-linear``)."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation (Korthikanti et al. 2022): ``None``, ``"selective"`` (the
    attention core) or ``"full"`` (whole layers, chosen by ``recompute_method``)."""
    recompute_method: Optional[str] = None
    """With ``"full"``: ``"uniform"`` (groups of ``recompute_num_layers`` consecutive layers of a
    chunk, each group one region) or ``"block"`` (the first ``recompute_num_layers`` layers of
    each chunk, one region each); Megatron-LM's meanings."""
    recompute_num_layers: int = 1
    """Layers per uniform group, or layers recomputed per chunk with ``"block"``."""

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.swiglu)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: G with grouped-query attention, else one per query head."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (``int(head_dim * rotary_percent)``)."""
        return int(self.head_dim * self.rotary_percent)

    def parameter_spec(self, tp_size: int):
        """Every parameter of this model for ``tp_size`` TP ranks (``model.spec.build_spec``).

        Remembered per (settings, padded vocabulary): the planner asks for it once per stage
        of every layout it tries (a 96-layer model: 2,000 times, 6 s). A new list each call;
        its ParamSpecs are frozen."""
        from model.spec import build_spec

        padded = self.padded_vocab(tp_size)
        key = (repr(self), padded)
        spec = _SPECS.get(key)
        if spec is None:
            if len(_SPECS) >= 64:
                _SPECS.clear()
            spec = _SPECS[key] = tuple(build_spec(self, padded))
        return list(spec)

    def padded_vocab(self, tp_size: int) -> int:
        """Padded vocabulary size for ``tp_size`` tensor-parallel ranks (see padded_vocab_size)."""
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp_size)

    def validate(self, tp_size: int) -> None:
        """Check the sizes against ``tp_size`` before any collective.

        Raises ValueError with one message naming the setting and the fix.
        """
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        for name in ("vocab_size", "num_layers", "hidden_size", "num_attention_heads",
                     "ffn_hidden_size", "seq_length", "max_position_embeddings"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, "
                                           f"got {getattr(self, name)}")
        need(self.hidden_size % self.num_attention_heads == 0,
             f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
             f"{self.num_attention_heads}; choose sizes with hidden = heads * head_dim")
        need(self.num_attention_heads % tp_size == 0,
             f"--num-attention-heads {self.num_attention_heads} is not divisible by --tp "
             f"{tp_size}; use a tensor-parallel size that divides the head count")
        need(self.ffn_hidden_size % tp_size == 0,
             f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by --tp {tp_size}"
             + (" (--swiglu: each rank holds F/tp gate and F/tp up units)" if self.swiglu else ""))
        self._validate_block(tp_size, need)
        need(self.seq_length <= self.max_position_embeddings,
             f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
             f"{self.max_position_embeddings}; raise the latter")
        need(not self.sequence_parallel or self.seq_length % tp_size == 0,
             f"--sequence-parallel needs --seq-length {self.seq_length} divisible by --tp "
             f"{tp_size}")
        for name in ("hidden_dropout", "attention_dropout", "label_smoothing"):
            need(0.0 <= getattr(self, name) < 1.0,
                 f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")

    def _validate_block(self, tp_size: int, need) -> None:
        """The LLaMA-style options: choices, grouped-query sizes, rotary fraction and base."""
        need(self.position_embedding_type in ("learned_absolute", "rope"),
             f"--position-embedding-type {self.position_embedding_type!r} is not learned_absolute or rope")
        need(self.normalization in ("LayerNorm", "RMSNorm"),
             f"--normalization {self.normalization!r} is not LayerNorm or RMSNorm")
        G, heads = self.kv_heads, self.num_attention_heads
        need(G >= 1 and heads % G == 0,
             f"--num-query-groups {G} does not divide --num-attention-heads {heads}; fix: a "
             "divisor of the head count (1 = multi-query, heads = multi-head)")
        need(G % tp_size == 0,
             f"--num-query-groups {G} is not divisible by --tp {tp_size}; fix: a --tp that divides "
             "the query groups (each rank holds whole groups with their queries)")
        need(0.0 < self.rotary_percent <= 1.0,
             f"--rotary-percent {self.rotary_percent} is outside (0, 1]; fix: e.g. 1.0 or 0.5")
        need(self.position_embedding_type != "rope" or (self.rotary_dim >= 2 and self.rotary_dim % 2 == 0),
             f"--rotary-percent {self.rotary_percent} rotates {self.rotary_dim} of the {self.head_dim} "
             "dimensions of a head; RoPE needs an even number >= 2; fix: another --rotary-percent")
        need(self.rotary_base >= 1, f"--rotary-base must be >= 1, got {self.rotary_base}")
