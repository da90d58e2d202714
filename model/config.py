"""GPTConfig: the model's sizes and regularisation, and the padded vocabulary size.

The vocabulary is padded so that the word embedding and output layer split evenly over the
tensor-parallel ranks and keep matmul-friendly shapes (Megatron-LM's
``--make-vocab-size-divisible-by``). Padded rows are zero, masked out of the softmax and
never trained (docs/design.md, contract 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from megazero.config.checks import check_value
from megazero.config.schema import ConfigError, setting_named
from megazero.config.shape import (
    check_block,
    check_mla,
    check_moe_layer_freq,
    check_moe_sizes,
    check_rope_scaling,
    check_sizes,
    check_window,
    check_yarn_of,
    default_ffn_hidden_size,
    is_moe_layer_of,
    layer_window,
)
from megazero.ops.fp8 import Fp8Settings


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of ``divisible_by * tp_size`` that is >= ``vocab_size``.

    Example: ``padded_vocab_size(1001, 128, 2) == 1024``; ``(50257, 128, 1) == 50304``.
    Raises ValueError when any argument is below 1.
    """
    if vocab_size < 1 or divisible_by < 1 or tp_size < 1:
        raise ValueError(
            f"vocab_size ({vocab_size}), --make-vocab-size-divisible-by "
            f"({divisible_by}) and tp ({tp_size}) must all be >= 1"
        )
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


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
    fp8_format: Optional[str] = None
    """FP8 GEMMs in the blocks' linear layers and the experts (megazero/ops/fp8.py): ``e4m3`` or
    ``hybrid`` (e5m2 output gradients); None = the GEMMs run in ``params_dtype``."""
    fp8_recipe: str = "tensorwise"
    """FP8 scaling granularity: tensorwise, rowwise, blockwise or mxfp8 (current scaling)."""
    fp8_block: int = 128
    """Tile width of the blockwise recipe (1 x b activations, b x b weights)."""
    label_smoothing: float = 0.0
    """Label smoothing of the cross-entropy loss (0 = none)."""
    value_head: bool = False
    """A reward model (``--post-train rm``): the last stage ends in ``value_head.weight``
    ``[1, H]`` (model/value_head.py) and returns one score per sequence; the output layer is
    kept (its gradient is zero) but not computed."""
    norm_backend: str = "auto"
    """LayerNorm kernels: ``auto``, ``apex``, ``torch`` or ``reference`` (megazero.ops.norm)."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (GPT-2's position table) or ``rope`` (rotary, Su et al. 2021)."""
    rotary_base: int = 10000
    """Base of the rotary frequencies ``base^(-2j/d_rot)`` (RoPE only)."""
    use_rope_scaling: bool = False
    """Llama 3.1's RoPE frequency rewrite (model/rope.py, ``RopeScaling``; Megatron-LM's
    ``--use-rope-scaling``) with the four ``rope_scaling_*`` values below."""
    rope_scaling_factor: float = 8.0
    """How many times slower the low-frequency pairs turn under ``use_rope_scaling``."""
    rope_scaling_low_freq_factor: float = 1.0
    """Pairs with wavelength above ``original / low_freq_factor`` positions are slowed fully."""
    rope_scaling_high_freq_factor: float = 4.0
    """Pairs with wavelength below ``original / high_freq_factor`` positions are kept."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """The pretraining context (tokens) the ``use_rope_scaling`` wavelengths are measured against."""
    rotary_seq_len_interpolation_factor: Optional[float] = None
    """Linear RoPE scaling: positions divided by this factor (Chen et al. 2023); ``None`` = off."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates, in (0, 1] (GPT-NeoX's partial rotary)."""
    yarn_rotary_scaling_factor: Optional[float] = None
    """YaRN's context extension factor (model/rope.py, ``RopeScaling``; Peng et al. 2023; the name of
    Megatron-core's TransformerConfig field); ``None`` = off. The ``yarn_*`` fields below are its."""
    yarn_original_max_position_embeddings: int = 4096
    """The pretraining context (tokens) over which YaRN counts each pair's rotations."""
    yarn_beta_fast: float = 32.0
    """Pairs turning more than this many times over the original context keep their frequency."""
    yarn_beta_slow: float = 1.0
    """Pairs turning fewer times than this over the original context are divided by the factor."""
    yarn_mscale: Optional[float] = None
    """Numerator coefficient of the attention factor, used with ``yarn_mscale_all_dim`` (DeepSeek)."""
    yarn_mscale_all_dim: Optional[float] = None
    """Denominator coefficient of the attention factor (DeepSeek's ``mscale_all_dim``)."""
    yarn_attention_factor: Optional[float] = None
    """The factor on cos and sin given outright; ``None`` = derived (``RopeScaling.cos_sin_factor``)."""
    yarn_correction_range_round_to_int: bool = True
    """Round the ramp's bounds outwards to integers (transformers' ``truncate``; gpt-oss: false)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only, Zhang & Sennrich 2019)."""
    swiglu: bool = False
    """Gated SiLU MLP ``fc2(silu(gate) * up)`` (Shazeer 2020); ``fc1`` holds ``[gate; up]``."""
    quick_geglu: bool = False
    """Gated MLP whose gate is quick GELU ``x * sigmoid(1.702 x)`` (Megatron-LM's ``--quick-geglu``,
    gpt-oss's): ``fc1`` holds ``[gate; up]`` as with ``swiglu`` (megazero.ops.activation)."""
    glu_linear_offset: float = 0.0
    """The gated MLP's ``act(gate) * (up + offset)`` (Megatron-LM's ``--glu-linear-offset``; gpt-oss 1.0)."""
    activation_func_clamp_value: Optional[float] = None
    """Before the gated MLP's activation, the gate clamped to at most this and up to ``[-it, it]``
    (Megatron-LM's ``--activation-func-clamp-value``; gpt-oss 7.0); ``None`` = no clamp."""
    openai_gelu: bool = False
    """The GELU MLP with the tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
    (Hendrycks & Gimpel 2016, section 2; GPT-2's ``gelu_new``, Megatron-LM's ``--openai-gelu``)
    instead of the exact erf GELU; GPT-2 block only (no ``swiglu``)."""
    num_query_groups: Optional[int] = None
    """Key/value heads G of grouped-query attention (Ainslie et al. 2023); ``None`` = GPT-2's
    multi-head attention with the ``[q; k; v]`` QKV layout."""
    add_bias_linear: bool = True
    """Biases in the QKV, attention output and MLP linears (False = Megatron's
    ``--disable-bias-linear``)."""
    add_qkv_bias: bool = False
    """A bias on the QKV projection even when ``add_bias_linear`` is off (Megatron-LM's
    ``--add-qkv-bias``; Qwen2's attention); no effect when ``add_bias_linear`` is on."""
    kv_channels: Optional[int] = None
    """Size of each attention head (Megatron-LM's ``--kv-channels``): q, k and v are ``heads *
    kv_channels`` wide and the output projection maps that back to ``hidden_size``; ``None`` =
    ``hidden_size / num_attention_heads``."""
    qk_layernorm: bool = False
    """RMSNorm (weight ``[head_dim]``, ``layernorm_epsilon``) over each head of q and of k, after the
    projection and before RoPE (Megatron-LM's ``--qk-layernorm``; Qwen3's ``q_norm`` / ``k_norm``)."""
    multi_latent_attention: bool = False
    """Multi-head latent attention (DeepSeek-V2, sec. 2.1; model/mla.py) instead of the QKV
    attention: needs ``position_embedding_type == "rope"`` and no linear biases."""
    q_lora_rank: Optional[int] = None
    """MLA: width of the query latent (``q_a``, its RMSNorm, ``q_b``); None = one query projection ``q``."""
    kv_lora_rank: int = 512
    """MLA: width of the compressed key/value latent (dimensions)."""
    qk_head_dim: int = 128
    """MLA: each head's query/key dimensions without RoPE (transformers' ``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: int = 64
    """MLA: each head's rotated query/key dimensions, the key's shared by all heads (``qk_rope_head_dim``)."""
    v_head_dim: int = 128
    """MLA: each head's value dimensions."""
    softmax_type: str = "vanilla"
    """The attention softmax (Megatron-LM's ``--softmax-type``): ``"vanilla"``; ``"off-by-one"``,
    one more ``exp(0)`` in every row's denominator (Miller 2023); ``"learnable"``, a learned sink
    logit per head there instead (gpt-oss's ``sinks``, parameter ``attn.sinks [heads]``,
    megazero/context_parallel/attention.py)."""
    window_size: Optional[list] = None
    """Sliding-window attention, Megatron-LM's ``--window-size L,R`` as ``[L, 0]``: query i sees
    keys ``i - L .. i`` (transformers' ``sliding_window`` W = L + 1); ``None`` (or L = -1) = full
    causal attention (``megazero.config.shape.layer_window``)."""
    window_attn_skip_freq: Optional[list] = None
    """Which layers stay full under ``window_size`` (Megatron-LM's ``--window-attn-skip-freq``):
    ``[N]`` every N-th layer (1-based), or one 0/1 per layer (1 = windowed); ``None`` = all windowed."""
    hf_model_type: Optional[str] = None
    """The Hugging Face family an export writes where two compute the same model: ``"mistral"``
    (MistralForCausalLM, which computes Llama's block) for a model read from a ``mistral`` folder
    (``--from-hf``, ``model.hf.config_from_hf``); ``None``: the family the block implies (Llama,
    Qwen2, Qwen3 or an MoE one, ``model.hf.llama_config``). Changes nothing megazero computes."""
    cp_comm_type: str = "p2p"
    """Attention across context-parallel ranks: ``p2p`` (ring) or ``a2a`` (all-to-all over heads)."""
    cp_ring_kernel: str = "auto"
    """Kernel of each ring block: ``auto`` (a fused kernel where one exists) or ``einsum``
    (``context_parallel.fused_blocks.block_path``)."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation (Korthikanti et al. 2022): ``None``, ``"selective"`` (the
    attention core) or ``"full"`` (whole layers, chosen by ``recompute_method``)."""
    recompute_method: Optional[str] = None
    """With ``"full"``: ``"uniform"`` (groups of ``recompute_num_layers`` consecutive layers of a
    chunk, each group one region) or ``"block"`` (the first ``recompute_num_layers`` layers of
    each chunk, one region each); Megatron-LM's meanings."""
    recompute_num_layers: int = 1
    """Layers per uniform group, or layers recomputed per chunk with ``"block"``."""

    num_experts: Optional[int] = None
    """Mixture of Experts: experts E of each MoE layer; ``None`` = dense MLPs."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of each expert's MLP; ``None`` = ``ffn_hidden_size``."""
    moe_router_topk: int = 2
    """Experts k each token is routed to."""
    moe_layer_freq: Union[int, list] = 1
    """Which layers are MoE layers (Megatron-LM's ``--moe-layer-freq``): an integer N, layer ``i`` when
    ``i % N == 0``; or one 0/1 per layer, 1 = MoE (DeepSeek-V3's ``first_k_dense_replace`` k: k zeros,
    then ones). The other layers are dense MLPs of ``ffn_hidden_size``
    (``megazero.config.shape.is_moe_layer_of``)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Inner width of the shared expert every token passes through; ``None`` = none."""
    moe_router_score_function: str = "softmax"
    """``softmax`` or ``sigmoid`` (megazero.moe.router.route)."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: experts in G groups (megazero.moe.router.route); ``None`` = none."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token's experts are chosen from (with ``moe_router_num_groups``)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """The routed experts' combine weights times this factor; ``None`` = unscaled."""
    moe_router_dtype: str = "fp32"
    """Precision of the router GEMM: ``fp32`` or ``model`` (megazero.moe.router.router_logits)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (weights not renormalised)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``aux_loss``, ``seq_aux_loss`` or ``none``."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (per micro-batch, as Megatron-LM)."""
    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss; ``None`` or 0 = off."""
    moe_expert_capacity_factor: Optional[float] = None
    """Capacity factor F (``router.expert_capacity``); ``None`` = dropless."""
    moe_token_drop_policy: str = "probs"
    """``probs`` or ``position`` (``router.capacity_keep``)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Each expert runs on exactly its capacity of rows (needs a capacity factor)."""
    moe_router_linear_bias: bool = False
    """A learnable bias ``[E]`` on the router's logits (``mlp.router.bias``; gpt-oss's ``router.bias``)."""
    moe_router_enable_expert_bias: bool = False
    """DeepSeek-V3's aux-loss-free bias (sigmoid scores), updated once per step."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias sign update."""
    moe_token_dispatcher_type: str = "alltoall"
    """How tokens reach their experts' ranks under expert parallelism: ``alltoall`` or
    ``allgather`` (megazero.moe.dispatch)."""
    mtp_num_layers: int = 0
    """Multi-token prediction depth D (DeepSeek-V3 sec. 2.2, model/mtp.py): D sequential modules on
    the last stage predict the tokens 2..D+1 ahead; 0 = none (the plain next-token model)."""
    mtp_loss_scaling_factor: float = 0.1
    """lambda: the training loss adds ``lambda / D`` times the sum of the D depths' mean cross-entropies."""

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.swiglu)
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    @property
    def fp8(self) -> Optional[Fp8Settings]:
        """The FP8 settings of the linear layers, or None without ``fp8_format``."""
        if self.fp8_format is None:
            return None
        return Fp8Settings(self.fp8_format, self.fp8_recipe, self.fp8_block)

    def attention_window(self, i: int) -> Optional[int]:
        """Sliding window W of global layer ``i`` (0-based): its query at position p sees keys at
        positions ``p - W + 1 .. p`` (transformers' ``sliding_window``); None = full causal
        attention (``megazero.config.shape.layer_window``, Megatron-LM's per-layer rule)."""
        return layer_window(self.window_size, self.window_attn_skip_freq, i + 1)

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` holds an MoE MLP (``num_experts`` set and ``moe_layer_freq`` marks it)."""
        return self.num_experts is not None and is_moe_layer_of(self.moe_layer_freq, i)

    @property
    def head_dim(self) -> int:
        """Dimensions of each attention head: ``kv_channels``, else ``hidden_size / heads``."""
        return self.hidden_size // self.num_attention_heads if self.kv_channels is None else self.kv_channels

    @property
    def attention_width(self) -> int:
        """Width of all query heads together, ``heads * head_dim`` (``hidden_size`` unless ``kv_channels``)."""
        return self.num_attention_heads * self.head_dim

    @property
    def attention_flops_width(self) -> float:
        """The width ``a`` of the FLOPs' attention term ``2*2*s*a`` per layer and token
        (``megazero.planning.flops``): ``attention_width``; under MLA the scores read ``heads * (n + r)``
        dimensions and the values ``heads * v``, so the mean of the two."""
        if self.multi_latent_attention:
            return self.num_attention_heads * (self.qk_head_dim + self.qk_pos_emb_head_dim + self.v_head_dim) / 2
        return self.attention_width

    @property
    def kv_heads(self) -> int:
        """Key/value heads: G with grouped-query attention, else one per query head."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def gated_linear_unit(self) -> bool:
        """Whether the MLP is gated, ``fc1 = [gate; up]`` (``swiglu`` or ``quick_geglu``)."""
        return self.swiglu or self.quick_geglu

    @property
    def glu_options(self) -> dict:
        """The gated unit's keyword arguments for ``megazero.ops.activation.glu``."""
        return dict(
            quick_geglu=self.quick_geglu,
            linear_offset=self.glu_linear_offset,
            clamp_value=self.activation_func_clamp_value,
        )

    @property
    def qkv_bias(self) -> bool:
        """Whether the QKV projection has a bias (``add_bias_linear`` or ``add_qkv_bias``)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (``int(head_dim * rotary_percent)``; MLA's
        ``qk_pos_emb_head_dim``)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
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

        The rules are megazero's, written once for the flags and for this class: each field's
        range and choices are its flag's (``megazero.config.schema`` metadata), the shapes
        those of ``megazero.config.shape``. Raises ConfigError (a ValueError) with one message
        naming the flag and the fix.
        """
        for name, where in _SETTING_OF.items():
            check_value(setting_named(where), getattr(self, name))
        check_sizes(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            seq_length=self.seq_length,
            max_position_embeddings=self.max_position_embeddings,
            tp=tp_size,
            sequence_parallel=self.sequence_parallel,
            swiglu=self.gated_linear_unit,
        )
        check_block(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            tp=tp_size,
            num_query_groups=self.num_query_groups,
            rotary_percent=self.rotary_percent,
            rope=self.position_embedding_type == "rope",
            kv_channels=self.kv_channels,
        )
        if self.qk_layernorm and self.normalization != "RMSNorm":
            raise ConfigError(
                f"--qk-layernorm with --normalization {self.normalization}: megazero's QK norm is RMSNorm; "
                "fix: --normalization RMSNorm"
            )
        check_rope_scaling(self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor)
        check_yarn_of(self)
        check_window(self.window_size, self.window_attn_skip_freq, self.num_layers)
        if self.multi_latent_attention:
            check_mla(
                rope=self.position_embedding_type == "rope",
                bias=self.add_bias_linear or self.add_qkv_bias,
                softmax_type=self.softmax_type,
                window_size=self.window_size,
                qk_layernorm=self.qk_layernorm,
                num_query_groups=self.num_query_groups,
                qk_pos_emb_head_dim=self.qk_pos_emb_head_dim,
            )
        if self.num_experts is not None:
            check_moe_layer_freq(self.moe_layer_freq, self.num_layers)
            check_moe_sizes(self.moe_ffn_hidden_size, self.moe_shared_expert_intermediate_size, tp_size)


# GPTConfig field -> the setting (flag) whose documented range and choices it must satisfy
# YaRN's settings (model/rope.py), shared by GPTConfig and ModelConfig
YARN_FIELDS = (
    "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
    "yarn_attention_factor",
    "yarn_correction_range_round_to_int",
)
# the gated MLP's variants (megazero.ops.activation), the same names in GPTConfig and ModelConfig
GLU_FIELDS = ("quick_geglu", "glu_linear_offset", "activation_func_clamp_value")
# multi-head latent attention's settings (model/mla.py), the same names in GPTConfig and ModelConfig
MLA_FIELDS = (
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
)
# the RoPE scaling settings GPTConfig shares with ModelConfig (same names)
ROPE_SCALING_FIELDS = (
    "use_rope_scaling",
    "rope_scaling_factor",
    "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
    "rotary_seq_len_interpolation_factor",
    *YARN_FIELDS,
)


_SETTING_OF = {
    "vocab_size": "data.vocab_size",
    **{
        name: f"model.{name}"
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "seq_length",
            "max_position_embeddings",
            "hidden_dropout",
            "attention_dropout",
            "label_smoothing",
            "position_embedding_type",
            "normalization",
            "rotary_base",
            "rope_scaling_factor",
            "rope_scaling_low_freq_factor",
            "rope_scaling_high_freq_factor",
            "rope_scaling_original_max_position_embeddings",
            "rotary_seq_len_interpolation_factor",
            *YARN_FIELDS,
            "activation_func_clamp_value",
            "kv_channels",
            "num_query_groups",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
            "num_experts",
            "moe_router_topk",
            "moe_router_score_function",
            "moe_router_load_balancing_type",
            "moe_expert_capacity_factor",
            "moe_token_drop_policy",
            "mtp_num_layers",
            "mtp_loss_scaling_factor",
        )
    },
}
