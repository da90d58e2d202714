"""The schema of megazero's one configuration (docs/design.md, contract 5): every setting a field.

Each setting is a dataclass field with a default; its documentation (meaning, unit, valid
range, choices, command-line flags) is the field's ``metadata``, written once here and read
by the command line (``cli.py``: ``--help``, ``flags_table()``), the rules (``checks.py``:
ranges and choices) and the rendering (``render.py``: ``describe()``).

``settings()`` lists the fields as ``Setting`` rows named ``section.field``
("model.num_layers"); ``get_value`` / ``set_value`` / ``show_flag`` address a ``Config`` by
that name. Imports nothing of megazero but ``pipeline.partition`` (the layer-split parser).

A setting that belongs to one stage or feature says so in its metadata: ``applies`` is the
``Needs`` under which it has an effect (e.g. ZeRO-3's knobs: ``Needs("zero.stage", (3,))``).
One pass over the given settings (``derive.unused_settings``) names every one whose
condition fails: a warning, or a ConfigError where ``refuse`` says running on would mislead.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from megazero.data_parallel.policy import stages_where
from megazero.pipeline.partition import parse_layer_split

MOCK_VOCAB_SIZE = 1024  # vocabulary of --mock-data when --vocab-size is not given


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the setting (flag) and the fix."""


@dataclass(frozen=True)
class Needs:
    """When a setting has an effect: setting ``on`` ("zero.stage") has one of ``values``, none
    of ``besides``, or a number above ``above``; or ``alt`` holds (one alternative).

    ``refuse``: given while this fails, the setting is a ConfigError, not a warning: where
    ignoring it would run something other than what the flags describe (another model, no
    checkpoint). ``wanted``: how the fix names the condition (default: ``on``'s flag and values).
    """

    on: str
    values: tuple = ()
    besides: tuple = ()
    above: Optional[float] = None
    alt: Optional["Needs"] = None
    refuse: bool = False
    wanted: str = ""

    def holds(self, cfg: "Config") -> bool:
        v = get_value(cfg, self.on)
        if self.above is not None:
            ok = v is not None and v > self.above
        else:
            ok = v not in self.besides if self.besides else v in self.values
        return ok or (self.alt is not None and self.alt.holds(cfg))


_ZERO3 = Needs("zero.stage", stages_where("shards_params"))  # the stage that gathers parameters
_PARAM_NVME = Needs("zero.offload_param", ("nvme",))
_NVME = Needs("zero.offload_optimizer", ("nvme",))
_ANY_NVME = Needs("zero.offload_optimizer", ("nvme",), alt=_PARAM_NVME)
_FP16 = Needs("precision.fp16", (True,))
_MUON = Needs("optim.optimizer", ("muon",))
_QK_CLIP = Needs("optim.qk_clip", (True,), wanted="--qk-clip")
_MLA = Needs("model.multi_latent_attention", (True,), refuse=True)
_DYNAMIC_SCALE = (_FP16, Needs("precision.loss_scale", (0.0,)))
_REAL_DATA = Needs("train.mock_data", (False,))
_PROFILE = Needs("log.profile", (True,))
_FP8 = Needs("precision.fp8_format", besides=(None,), wanted="--fp8-format e4m3|hybrid")
_WANDB = Needs("log.wandb_project", besides=(None,))
_DECAY = Needs("optim.lr_decay_style", besides=("constant",))
_SAVE = Needs("train.save", besides=(None,), refuse=True, wanted="--save DIR")
_ROPE = Needs("model.position_embedding_type", ("rope",), refuse=True)
_ROPE_SCALING = Needs("model.use_rope_scaling", (True,), refuse=True)
_YARN = Needs("model.yarn_rotary_scaling_factor", besides=(None,), refuse=True, wanted="--yarn-rotary-scaling-factor F")
_WSD = Needs("optim.lr_decay_style", ("WSD",))
_FIM = Needs("data.fim_rate", above=0)
_HARNESS = Needs("train.eval_harness_tasks", besides=(None,))
_GATED = Needs(
    "model.swiglu",
    (True,),
    alt=Needs("model.quick_geglu", (True,)),
    refuse=True,
    wanted="a gated MLP (--swiglu or --quick-geglu)",
)
_MOE = Needs("model.num_experts", besides=(None,), refuse=True, wanted="--num-experts E")


def _f(
    default: Any,
    help: str,
    unit: str = "",
    *,
    flags: tuple = (),
    choices: tuple = (),
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    lt: Optional[float] = None,
    parse=None,
    applies=None,
):
    """A setting: default, meaning, unit, flags (first = the name used in messages), range.

    ``parse``: the command-line parser of its value (text -> value; ValueError when invalid).
    ``applies``: the ``Needs`` (or a tuple of them, all needed) under which it has an effect;
    None = always.
    """
    meta = dict(
        help=help,
        unit=unit,
        flags=flags,
        choices=choices,
        ge=ge,
        gt=gt,
        lt=lt,
        parse=parse,
        applies=applies if applies is None or isinstance(applies, tuple) else (applies,),
    )
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def parse_window_list(text: str) -> list[int]:
    """``--window-size`` / ``--window-attn-skip-freq`` text ("4095,0", "2", "1,1,0,1") as a list of
    integers. Raises ValueError (the message names the flags) on a non-integer entry."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"{text!r} is not a comma list of integers; fix: e.g. --window-size 4095,0 --window-attn-skip-freq 2"
        ) from None


def parse_moe_layer_freq(text: str):
    """``--moe-layer-freq`` text as Megatron-LM reads it: an integer N (every N-th layer an MoE layer,
    from layer 0), or a pattern with one 0/1 per layer (1 = MoE, 0 = dense MLP), written as a comma
    list ("0,1,1,1") or in Megatron-LM's Python-list spelling ("([0]*1+[1]*3)", "[1,0]*2"): lists
    of 0/1, ``+`` to join, ``* N`` to repeat, parentheses. Megatron-LM ``eval``s that text; megazero
    parses just this grammar. Returns an int or a list of ints; raises ValueError naming the flag."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    if re.fullmatch(r"\d+(\s*,\s*\d+)+", text):
        return [int(x) for x in text.split(",")]
    tokens = re.findall(r"\d+|[][()+*,]|\S", text)
    try:
        out, rest = _pattern_sum(tokens)
        if rest or not out:
            raise ValueError
    except (ValueError, IndexError):
        raise ValueError(
            f"--moe-layer-freq {text!r} is not an integer, a comma list or a pattern like ([0]*1+[1]*3); "
            "fix: e.g. --moe-layer-freq 2, or 0,1,1,1 (1 = MoE layer)"
        ) from None
    return out


def _pattern_sum(tokens: list) -> tuple[list, list]:
    """``term ('+' term)*`` of parse_moe_layer_freq's grammar: (the list, the tokens left)."""
    out, tokens = _pattern_term(tokens)
    while tokens and tokens[0] == "+":
        more, tokens = _pattern_term(tokens[1:])
        out = out + more
    return out, tokens


def _pattern_term(tokens: list) -> tuple[list, list]:
    """``atom ('*' N)*`` with atom a ``[i, j, ...]`` list or a parenthesised sum."""
    if tokens[0] == "(":
        out, tokens = _pattern_sum(tokens[1:])
        if tokens[0] != ")":
            raise ValueError
        tokens = tokens[1:]
    elif tokens[0] == "[":
        out, tokens = [], tokens[1:]
        while tokens[0] != "]":
            out.append(int(tokens[0]))
            tokens = tokens[2:] if tokens[1] == "," else tokens[1:]
        tokens = tokens[1:]
    else:
        raise ValueError
    while tokens and tokens[0] == "*":
        out, tokens = out * int(tokens[1]), tokens[2:]
    return out, tokens


@dataclass
class ModelConfig:
    """The GPT architecture: GPT-2's block by default (pre-LayerNorm, learned positions, GELU MLP,
    biases, multi-head attention), or LLaMA-style with the RoPE / RMSNorm / SwiGLU /
    grouped-query / bias-free flags (Megatron-LM's names and meanings)."""

    num_layers: int = _f(4, "transformer layers", "layers", ge=1)
    hidden_size: int = _f(256, "model width H", "features", ge=1)
    num_attention_heads: int = _f(4, "attention heads; head size = H / heads", "heads", ge=1)
    ffn_hidden_size: Optional[int] = _f(
        None,
        "MLP inner width; None = 4 x --hidden-size (--swiglu: int(8 H / 3 / 64) x 64, as Megatron)",
        "features",
        ge=1,
    )
    seq_length: int = _f(256, "tokens per training sample", "tokens", ge=1)
    max_position_embeddings: Optional[int] = _f(
        None, "rows of the position-embedding table; None = --seq-length", "positions", ge=1
    )
    make_vocab_size_divisible_by: int = _f(
        128, "pad the vocabulary to a multiple of this x tp (padded logits are masked)", "tokens", ge=1
    )
    hidden_dropout: float = _f(0.0, "dropout on embeddings and block outputs", "probability", ge=0, lt=1)
    attention_dropout: float = _f(0.0, "dropout on attention probabilities", "probability", ge=0, lt=1)
    untie_embeddings_and_output_weights: bool = _f(
        False, "give the output layer its own weight instead of the word embedding's"
    )
    position_embedding_type: str = _f(
        "learned_absolute",
        "positions: a learned table (GPT-2) or rotary (RoPE) in attention",
        choices=("learned_absolute", "rope"),
    )
    rotary_base: int = _f(10000, "RoPE frequency base", "", ge=1, applies=_ROPE)
    use_rope_scaling: bool = _f(
        False,
        "Llama 3.1's RoPE frequency rewrite (low frequencies --rope-scaling-factor times slower, high kept, "
        "the band between interpolated)",
        applies=_ROPE,
    )
    rope_scaling_factor: float = _f(
        8.0, "--use-rope-scaling: slow-down of the low frequencies", "", gt=0, applies=_ROPE_SCALING
    )
    rope_scaling_low_freq_factor: float = _f(
        1.0, "--use-rope-scaling: wavelengths above original / this are slowed fully", "", gt=0, applies=_ROPE_SCALING
    )
    rope_scaling_high_freq_factor: float = _f(
        4.0, "--use-rope-scaling: wavelengths below original / this are kept", "", gt=0, applies=_ROPE_SCALING
    )
    rope_scaling_original_max_position_embeddings: int = _f(
        8192,
        "--use-rope-scaling: the pretraining context the wavelengths are measured against",
        "tokens",
        ge=1,
        applies=_ROPE_SCALING,
    )
    rotary_seq_len_interpolation_factor: Optional[float] = _f(
        None, "linear RoPE scaling: positions divided by this factor; None = off", "", gt=0, applies=_ROPE
    )
    rotary_percent: float = _f(
        1.0, "fraction of each head's dimensions RoPE rotates, in (0, 1]", "fraction", applies=_ROPE
    )
    yarn_rotary_scaling_factor: Optional[float] = _f(
        None,
        "YaRN RoPE scaling (Peng et al. 2023; transformers' rope type yarn): the context extension factor; "
        "slow frequencies are divided by it, fast ones kept, and cos/sin scaled by the attention factor; "
        "None = off",
        "",
        ge=1,
        applies=_ROPE,
    )
    yarn_original_max_position_embeddings: int = _f(
        4096, "YaRN: the pretraining context the rotations are counted over", "tokens", ge=1, applies=_YARN
    )
    yarn_beta_fast: float = _f(
        32.0,
        "YaRN: pairs turning more than this over the original context keep their frequency",
        "rotations",
        gt=0,
        applies=_YARN,
    )
    yarn_beta_slow: float = _f(
        1.0,
        "YaRN: pairs turning less than this over the original context are fully interpolated",
        "rotations",
        gt=0,
        applies=_YARN,
    )
    yarn_mscale: Optional[float] = _f(
        None,
        "YaRN: the attention factor's numerator coefficient (with --yarn-mscale-all-dim; DeepSeek's mscale)",
        "",
        ge=0,
        applies=_YARN,
    )
    yarn_mscale_all_dim: Optional[float] = _f(
        None,
        "YaRN: the attention factor's denominator coefficient (DeepSeek's mscale_all_dim)",
        "",
        ge=0,
        applies=_YARN,
    )
    yarn_attention_factor: Optional[float] = _f(
        None,
        "YaRN: the factor on cos and sin, given outright; None = 0.1 ln(factor) + 1 or the mscale ratio",
        "",
        gt=0,
        applies=_YARN,
    )
    yarn_correction_range_round_to_int: bool = _f(
        True,
        "YaRN: round the ramp's correction dimensions outwards to integers (transformers' truncate)",
        applies=_YARN,
    )
    normalization: str = _f("LayerNorm", "norm of every block and the final norm", choices=("LayerNorm", "RMSNorm"))
    swiglu: bool = _f(False, "gated SiLU MLP (SwiGLU); --ffn-hidden-size defaults to int(8H/3/64)*64")
    quick_geglu: bool = _f(
        False,
        "gated MLP (fc1 = [gate; up]) with the gate's activation quick GELU x * sigmoid(1.702 x) "
        "instead of SiLU (Megatron-LM's; gpt-oss); a gated MLP by itself, so not with --swiglu; "
        "--ffn-hidden-size defaults to 4 x --hidden-size",
        applies=Needs("model.swiglu", (False,), refuse=True, wanted="no --swiglu (--quick-geglu is already gated)"),
    )
    glu_linear_offset: float = _f(
        0.0,
        "the gated MLP's act(gate) * (up + offset) (gpt-oss: 1.0)",
        "",
        applies=_GATED,
    )
    activation_func_clamp_value: Optional[float] = _f(
        None,
        "before the gated MLP's activation, clamp the gate to at most L and up to [-L, L] (gpt-oss: 7.0); "
        "None = no clamp",
        "",
        gt=0,
        applies=_GATED,
    )
    openai_gelu: bool = _f(
        False,
        "the MLP's GELU with the tanh approximation (GPT-2's gelu_new, as the public "
        "GPT-2 checkpoints) instead of the exact erf GELU",
        applies=(
            Needs("model.swiglu", (False,), refuse=True, wanted="a GELU MLP (no --swiglu)"),
            Needs("model.quick_geglu", (False,), refuse=True, wanted="a GELU MLP (no --quick-geglu)"),
        ),
    )
    group_query_attention: bool = _f(False, "grouped-query attention with --num-query-groups key/value heads")
    num_query_groups: int = _f(
        1,
        "key/value heads of --group-query-attention (1 = multi-query)",
        "groups",
        ge=1,
        applies=Needs("model.group_query_attention", (True,), refuse=True),
    )
    kv_channels: Optional[int] = _f(
        None,
        "size of each attention head (q/k/v projections heads * this wide, the output projection back to "
        "--hidden-size); None = hidden / heads",
        "dimensions",
        ge=1,
    )
    qk_layernorm: bool = _f(
        False,
        "RMSNorm over each head's dimensions of q and k after the projection, before RoPE (Qwen3)",
        applies=Needs("model.normalization", ("RMSNorm",), refuse=True),
    )
    multi_latent_attention: bool = _f(
        False,
        "multi-head latent attention (DeepSeek-V2 sec. 2.1, as DeepSeek-V3): q and k/v through low-rank "
        "latents, a decoupled RoPE part with one key head shared by all heads (model/mla.py); needs "
        "--position-embedding-type rope and --disable-bias-linear",
    )
    q_lora_rank: Optional[int] = _f(
        None,
        "MLA: width of the query latent (q_a, its RMSNorm, q_b); None = one plain query projection",
        "dimensions",
        ge=1,
        applies=_MLA,
    )
    kv_lora_rank: int = _f(512, "MLA: width of the compressed key/value latent", "dimensions", ge=1, applies=_MLA)
    qk_head_dim: int = _f(128, "MLA: each head's query/key dimensions without RoPE", "dimensions", ge=1, applies=_MLA)
    qk_pos_emb_head_dim: int = _f(
        64,
        "MLA: each head's rotated query/key dimensions (the key's shared by all heads); even",
        "dimensions",
        ge=2,
        applies=_MLA,
    )
    v_head_dim: int = _f(128, "MLA: each head's value dimensions", "dimensions", ge=1, applies=_MLA)
    softmax_type: str = _f(
        "vanilla",
        "the attention softmax: vanilla, off-by-one (one more exp(0) in each row's denominator) or "
        "learnable (a learned sink logit per head in it, gpt-oss)",
        choices=("vanilla", "off-by-one", "learnable"),
    )
    window_size: Optional[list[int]] = _f(
        None,
        "sliding-window attention as Megatron-LM's L,R: query i sees keys i-L .. i (R must be 0; "
        "transformers' sliding_window W = L + 1; L = -1 unbounded); None = full causal attention",
        "tokens",
        parse=parse_window_list,
    )
    window_attn_skip_freq: Optional[list[int]] = _f(
        None,
        "which layers keep full attention under --window-size: N = every N-th layer (1-based, N, 2N, ...), or "
        "one 0/1 per layer (1 = windowed); None = every layer windowed",
        "layers",
        parse=parse_window_list,
        applies=Needs("model.window_size", besides=(None,), refuse=True, wanted="--window-size"),
    )
    add_bias_linear: bool = _f(
        True, "biases in the QKV, attention output and MLP linears", flags=("--disable-bias-linear",)
    )
    add_qkv_bias: bool = _f(
        False,
        "a bias on the QKV projection alone when --disable-bias-linear removes the others (Qwen2)",
        applies=Needs("model.add_bias_linear", (False,), refuse=True, wanted="--disable-bias-linear"),
    )
    layernorm_epsilon: float = _f(1e-5, "LayerNorm epsilon added to the variance", "", gt=0)
    init_method_std: float = _f(
        0.02, "standard deviation of the normal weight init", "", gt=0, applies=Needs("train.from_hf", (None,))
    )
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy", "probability", ge=0, lt=1)
    mtp_num_layers: int = _f(
        0,
        "multi-token prediction depth D (DeepSeek-V3 sec. 2.2; Megatron-LM's flag): D sequential modules on the "
        "last stage, each one block, predict the tokens 2..D+1 ahead with the shared embedding and output head; "
        "0 = none",
        "modules",
        ge=0,
    )
    mtp_loss_scaling_factor: float = _f(
        0.1,
        "lambda of the multi-token prediction loss: the training loss adds lambda / D times the sum of the D "
        "depths' mean cross-entropies (logged apart as mtp_loss)",
        "",
        ge=0,
        applies=Needs("model.mtp_num_layers", above=0, wanted="--mtp-num-layers D"),
    )
    num_experts: Optional[int] = _f(
        None, "Mixture of Experts: experts per MoE layer (Megatron-LM's flag); None = dense MLPs", "experts", ge=1
    )
    moe_ffn_hidden_size: Optional[int] = _f(
        None, "inner width of each expert's MLP; None = --ffn-hidden-size", "features", ge=1, applies=_MOE
    )
    moe_router_topk: int = _f(2, "experts each token is routed to (k)", "experts", ge=1, applies=_MOE)
    moe_layer_freq: typing.Union[list[int], int] = _f(
        1,
        "which layers are MoE layers (Megatron-LM's forms): N = every N-th from layer 0 (1 = all), or one 0/1 per "
        "layer (1 = MoE, 0 = dense with --ffn-hidden-size) as 0,1,1,1 or ([0]*1+[1]*3) (DeepSeek's first_k_dense)",
        "layers",
        parse=parse_moe_layer_freq,
        applies=_MOE,
    )
    moe_shared_expert_intermediate_size: Optional[int] = _f(
        None,
        "inner width of a shared expert every token passes through (DeepSeek/Qwen); None = none",
        "features",
        ge=1,
        applies=_MOE,
    )
    moe_router_score_function: str = _f(
        "softmax",
        "router scores: softmax, or sigmoid (DeepSeek-V3; the chosen k renormalised)",
        choices=("softmax", "sigmoid"),
        applies=_MOE,
    )
    moe_router_num_groups: Optional[int] = _f(
        None,
        "group-limited routing (DeepSeek-V3's node-limited routing): the experts in G groups of E/G "
        "consecutive experts, each token's k experts chosen within its --moe-router-group-topk best groups "
        "(a group's score: the sum of its two highest choice scores); None = no groups",
        "groups",
        ge=1,
        applies=_MOE,
    )
    moe_router_group_topk: Optional[int] = _f(
        None,
        "groups each token's experts are chosen from under --moe-router-num-groups",
        "groups",
        ge=1,
        applies=(
            _MOE,
            Needs("model.moe_router_num_groups", besides=(None,), refuse=True, wanted="--moe-router-num-groups G"),
        ),
    )
    moe_router_topk_scaling_factor: Optional[float] = _f(
        None,
        "the combine weights of the routed experts times this factor (DeepSeek-V3's routed_scaling_factor, "
        "2.5); None = unscaled",
        "",
        gt=0,
        applies=_MOE,
    )
    moe_router_dtype: str = _f(
        "fp32",
        "precision of the router GEMM and its logits: fp32 (as Megatron-LM's --moe-router-dtype fp32: a "
        "bf16/fp16 GEMM rounds near-ties into exact ties, which the top-k gives to the lower-numbered "
        "expert), or model (the model dtype)",
        choices=("fp32", "model"),
        applies=_MOE,
    )
    moe_router_pre_softmax: bool = _f(
        False,
        "softmax over all experts before the top-k (weights not "
        "renormalised) instead of a softmax over the k chosen logits",
        applies=_MOE,
    )
    moe_router_load_balancing_type: str = _f(
        "aux_loss",
        "load-balancing loss: aux_loss (Switch/GShard, per micro-batch), seq_aux_loss "
        "(DeepSeek-V3, per sequence) or none",
        choices=("aux_loss", "seq_aux_loss", "none"),
        applies=_MOE,
    )
    moe_aux_loss_coeff: float = _f(0.0, "weight of the load-balancing loss (0 = off)", "", ge=0, applies=_MOE)
    moe_z_loss_coeff: Optional[float] = _f(
        None, "weight of the router z-loss (ST-MoE); None = off", "", ge=0, applies=_MOE
    )
    moe_expert_capacity_factor: Optional[float] = _f(
        None,
        "slots per expert = ceil(tokens x k / E x factor), the rest dropped; None = dropless",
        "",
        gt=0,
        applies=_MOE,
    )
    moe_token_drop_policy: str = _f(
        "probs",
        "over capacity drop the lowest-probability (probs) or the latest (position) assignments",
        choices=("probs", "position"),
        applies=(
            _MOE,
            Needs("model.moe_expert_capacity_factor", besides=(None,), wanted="--moe-expert-capacity-factor F"),
        ),
    )
    moe_pad_expert_input_to_capacity: bool = _f(
        False,
        "each expert computes on exactly its capacity of rows (its kept tokens, then zero rows) "
        "under a capacity factor: static shapes, the same numbers",
        applies=(
            _MOE,
            Needs(
                "model.moe_expert_capacity_factor",
                besides=(None,),
                refuse=True,
                wanted="--moe-expert-capacity-factor F",
            ),
        ),
    )
    moe_router_linear_bias: bool = _f(
        False,
        "a learnable bias [E] on the router's logits (gpt-oss's router.bias; Megatron-LM adds it under "
        "--add-bias-linear, megazero only with this flag, so MoE models with linear biases keep their parameters)",
        applies=_MOE,
    )
    moe_router_enable_expert_bias: bool = _f(
        False,
        "aux-loss-free balancing (DeepSeek-V3): a per-expert bias steers the top-k, updated once per "
        "step from the global token counts; needs --moe-router-score-function sigmoid",
        applies=_MOE,
    )
    moe_router_bias_update_rate: float = _f(
        1e-3,
        "step of the expert-bias update",
        "",
        gt=0,
        applies=(_MOE, Needs("model.moe_router_enable_expert_bias", (True,), wanted="--moe-router-enable-expert-bias")),
    )
    moe_token_dispatcher_type: str = _f(
        "alltoall",
        "how tokens reach their experts' ranks under --expert-model-parallel-size > 1: alltoall = "
        "each (token, expert) sent to the expert's rank and back, allgather = every rank sees the ep group's "
        "tokens and the outputs are reduce-scattered",
        choices=("alltoall", "allgather"),
        applies=_MOE,
    )
    recompute_granularity: Optional[str] = _f(
        None,
        "activation recomputation: selective = the attention core, full = whole layers "
        "(Korthikanti et al. 2022); None = keep every activation",
        choices=("selective", "full"),
    )
    recompute_method: Optional[str] = _f(
        None,
        "with full: uniform = each group of --recompute-num-layers layers of a chunk is one "
        "recomputed region; block = recompute the first --recompute-num-layers layers of each chunk",
        choices=("uniform", "block"),
    )
    recompute_num_layers: int = _f(
        1,
        "layers per uniform group, or layers recomputed per chunk with block",
        "layers",
        ge=1,
        applies=Needs("model.recompute_granularity", ("full",)),
    )


@dataclass
class ParallelConfig:
    """The layout: world size = tp x cp x pp x dp (ranks ordered tp-cp-dp-pp, see topology.py)."""

    tp: int = _f(1, "tensor-parallel size", "ranks", flags=("--tp", "--tensor-model-parallel-size"), ge=1)
    cp: int = _f(
        1,
        "context-parallel size: each sequence is cut into 2 x cp chunks, cp rank r holds chunks r "
        "and 2cp-1-r (causal load balancing)",
        "ranks",
        flags=("--cp", "--context-parallel-size"),
        ge=1,
    )
    cp_comm_type: str = _f(
        "p2p",
        "attention across the cp ranks: p2p = a ring of K/V blocks (ring attention), "
        "a2a = all-to-all over heads (DeepSpeed-Ulysses)",
        choices=("p2p", "a2a"),
        applies=Needs("parallel.cp", above=1),
    )
    cp_ring_kernel: str = _f(
        "auto",
        "kernel of each ring block (--cp-comm-type p2p): auto = PyTorch's fused attention kernel "
        "where the device and dtype have one (CUDA: memory-efficient; CPU: flash), else einsum; "
        "einsum = fp32 einsums in row tiles of at most 16 MiB of scores",
        choices=("auto", "einsum"),
        applies=Needs("parallel.cp", above=1),
    )
    pp: int = _f(1, "pipeline-parallel size (stages)", "ranks", flags=("--pp", "--pipeline-model-parallel-size"), ge=1)
    dp: Optional[int] = _f(
        None,
        "data-parallel size; None = world size / (tp x cp x pp)",
        "ranks",
        flags=("--dp", "--data-parallel-size"),
        ge=1,
    )
    virtual_pipeline_size: int = _f(
        1, "model chunks per pipeline stage; > 1 selects the interleaved schedule", "chunks", ge=1
    )
    pipeline_schedule: str = _f(
        "1f1b",
        "pipeline schedule; interleaved when --virtual-pipeline-size > 1; "
        "zb-h1 / zb-v: zero bubble (backward split into B and W; zb-v: 2 chunks per "
        "stage in a V)",
        choices=("none", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"),
    )
    pipeline_layer_split: Optional[list[int]] = _f(
        None,
        "layers per stage as a comma list, e.g. 3,5; None = equal blocks",
        "layers",
        parse=parse_layer_split,
        applies=Needs("parallel.pp", above=1),
    )
    expert_model_parallel_size: int = _f(
        1,
        "expert-parallel size EP, carved out of the dp x cp ranks: each rank holds E/EP experts of every MoE "
        "layer; expert parameters reduce over the dp x cp / EP expert-data-parallel ranks",
        "ranks",
        ge=1,
        applies=_MOE,
    )
    expert_tensor_parallel_size: Optional[int] = _f(
        None,
        "tensor-parallel size etp of the routed experts, a divisor of --tp (None = --tp): each expert is sliced over "
        "etp ranks and its tp / etp replicas join the expert-data-parallel reduction (docs/moe.md)",
        "ranks",
        ge=1,
        applies=_MOE,
    )
    sequence_parallel: bool = _f(False, "partition LayerNorm/dropout activations along the sequence over tp")
    async_tensor_model_parallel_allreduce: bool = _f(
        True,
        "overlap the column-parallel layers' input-gradient all-reduce with their weight-gradient "
        "matmul (bit-identical; off under --compile)",
        flags=("--no-async-tensor-model-parallel-allreduce",),
        applies=(Needs("parallel.tp", above=1), Needs("train.compile", (False,))),
    )
    distributed_timeout_s: float = _f(
        300.0, "timeout of every collective and of the rendezvous", "seconds", gt=0, lt=1_000_000
    )


@dataclass
class TrainingConfig:
    """Batch arithmetic, iterations, checkpoints: global = micro x accumulation x dp."""

    micro_batch_size: int = _f(16, "samples per micro-batch per data-parallel rank", "samples", ge=1)
    global_batch_size: Optional[int] = _f(
        None, "samples per optimizer step; None = micro x accumulation x dp", "samples", ge=1
    )
    gradient_accumulation_steps: Optional[int] = _f(
        None,
        "micro-batches per step per data-parallel rank; None = derived (1 without a global batch)",
        "micro-batches",
        ge=1,
    )
    train_iters: int = _f(400, "optimizer steps to train", "iterations", ge=1)
    seed: int = _f(1234, "seed of weights, data order and dropout", "", ge=0)
    eval_interval: int = _f(
        100,
        "validate every this many steps (and at the end)",
        "iterations",
        ge=1,
        applies=Needs("train.eval_iters", above=0),
    )
    eval_iters: int = _f(10, "validation batches per evaluation; 0 = none", "iterations", ge=0)
    eval_harness_tasks: Optional[list[str]] = _f(
        None,
        "lm-evaluation-harness tasks to score during training, comma-separated (data/tasks: megazero_stdlib, "
        "megazero_stdlib_ppl; needs the eval extra, --pp 1 and a tokenizer); scores go to the console, "
        "TensorBoard/W&B (harness/TASK/METRIC) and the metrics file; None = none",
        "tasks",
    )
    eval_harness_interval: Optional[int] = _f(
        None,
        "score those tasks every this many steps (and at the end); None = at the end only",
        "iterations",
        ge=1,
        applies=_HARNESS,
    )
    eval_harness_limit: Optional[int] = _f(
        None, "documents per harness task; None = all", "documents", ge=1, applies=_HARNESS
    )
    save: Optional[str] = _f(None, "checkpoint directory to write; None = no checkpoints", "path")
    load: Optional[str] = _f(None, "checkpoint directory to resume from", "path")
    finetune: bool = _f(
        False,
        "start from --load's weights only: iteration 0, a fresh optimizer, the data from its start "
        "and the dropout streams from --seed (Megatron-LM's --finetune: the next stage of post-training)",
        applies=Needs("train.load", besides=(None,), refuse=True, wanted="--load DIR"),
    )
    save_interval: Optional[int] = _f(
        None, "checkpoint every this many steps; None = at the end only", "iterations", ge=1, applies=_SAVE
    )
    keep_latest_checkpoints: int = _f(
        0,
        "after each save, delete all but this many newest checkpoints under --save; 0 = keep all",
        "checkpoints",
        ge=0,
        applies=_SAVE,
    )
    from_hf: Optional[str] = _f(
        None,
        "Hugging Face GPT-2, Llama (2, 3.x), Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE folder "
        "(config.json + model.safetensors, or its shards and model.safetensors.index.json) to start from: "
        "weights sliced for this layout, fresh optimizer; a checkpoint under --load still takes precedence",
        "path",
    )
    device: str = _f("auto", "auto = CUDA when available, else CPU", choices=("auto", "cpu", "cuda"))
    mock_data: bool = _f(False, "train on random tokens; no --data-path needed")
    # stopping on request, on time or on bad values, and restarting (megazero/runtime/resilience.py)
    exit_duration_in_mins: Optional[float] = _f(
        None, "stop (and save with --save) after this much wall time; None = no limit", "minutes", gt=0
    )
    exit_interval: Optional[int] = _f(
        None, "stop (and save with --save) after an iteration divisible by this; None = never", "iterations", ge=1
    )
    skip_bad_batches: int = _f(
        0,
        "skip a step whose loss or gradient is non-finite (fp32/bf16), at most this many times; 0 = stop at the first",
        "steps",
        ge=0,
        applies=Needs("precision.fp16", (False,)),
    )
    async_save: bool = _f(
        False,
        "write checkpoint files in the background (DCP async_save); 'latest' moves "
        "once every rank's files are on disk, at the next save or the end",
        applies=_SAVE,
    )
    max_restarts: int = _f(
        0,
        "torchrun restarts the whole group this many times after a rank fails; needs --save D --load D "
        "--save-interval N (the group resumes from D's latest checkpoint); read by scripts/pretrain_gpt.sh",
        "restarts",
        ge=0,
    )
    compile: bool = _f(
        False,
        "torch.compile each transformer layer (pipeline, ZeRO and the collectives "
        "between layers stay eager); the first steps pay the compilation",
    )


@dataclass
class OptimizerConfig:
    """AdamW (decoupled weight decay) or Muon with AdamW beside it, warm-up then decay of the
    learning rate, clipping."""

    optimizer: str = _f(
        "adam",
        "adam = AdamW on every parameter; muon = Muon (Jordan 2024; torch.optim.Muon's update) on "
        "the 2-D hidden matrices, AdamW on embeddings, output head, norms and biases",
        choices=("adam", "muon"),
    )
    muon_momentum: float = _f(0.95, "Muon momentum mu (B = mu B + (1 - mu) G)", "", ge=0, lt=1, applies=_MUON)
    muon_nesterov: bool = _f(
        True, "Muon's Nesterov step: orthogonalise G + mu (B - G)", flags=("--no-muon-nesterov",), applies=_MUON
    )
    muon_ns_steps: int = _f(5, "Muon's Newton-Schulz iterations", "iterations", ge=1, lt=100, applies=_MUON)
    muon_ns_dtype: str = _f(
        "bf16",
        "dtype of Muon's Newton-Schulz matmuls: bf16 as torch.optim.Muon; fp32 makes every layout "
        "give the one-process update to summation-order rounding (bf16 amplifies that rounding)",
        choices=("bf16", "fp32"),
        applies=_MUON,
    )
    muon_adjust_lr: str = _f(
        "original",
        "Muon's per-matrix learning-rate scale for an A x B matrix: original = sqrt(max(1, A / B)) "
        "(Jordan), match_rms_adamw = 0.2 sqrt(max(A, B)) (Moonshot, arXiv 2502.16982)",
        choices=("original", "match_rms_adamw"),
        applies=_MUON,
    )
    qk_clip: bool = _f(
        False,
        "QK-Clip (Kimi K2's MuonClip, arXiv 2507.20534 sec. 2.1; Megatron-LM's --qk-clip): after each "
        "step, a head whose largest pre-softmax logit q.k / sqrt(d) over the step's batch exceeds "
        "--qk-clip-threshold tau has its query rows scaled by gamma^alpha and key rows by "
        "gamma^(1 - alpha), gamma = tau / max logit (grouped-query heads: the query rows by gamma, the "
        "shared key rows untouched)",
        applies=Needs("optim.optimizer", ("muon",), refuse=True),
    )
    qk_clip_threshold: float = _f(
        100.0, "QK-Clip's threshold tau on the max logit (Kimi K2: 100)", "logit", gt=0, applies=_QK_CLIP
    )
    qk_clip_alpha: float = _f(
        0.5,
        "QK-Clip's share alpha of the scale put on the query rows (1 - alpha on the keys)",
        "",
        gt=0,
        lt=1,
        applies=_QK_CLIP,
    )

    lr: float = _f(2e-3, "peak learning rate", "", ge=0)
    min_lr: Optional[float] = _f(
        None,
        "learning rate at the end of the decay; None = 2e-4, or --lr / 10 when --lr is below 2e-4 "
        "(a fine-tuning --lr then needs no --min-lr of its own)",
        "",
        ge=0,
        applies=_DECAY,
    )
    lr_warmup_iters: Optional[int] = _f(
        None, "linear warm-up from 0 to --lr; None = 10% of --train-iters", "iterations", ge=0
    )
    lr_decay_iters: Optional[int] = _f(
        None, "iterations of decay to --min-lr; None = --train-iters", "iterations", ge=1, applies=_DECAY
    )
    lr_decay_style: str = _f(
        "cosine",
        "shape of the decay (WSD: warmup-stable-decay, Megatron's)",
        choices=("cosine", "linear", "constant", "WSD"),
    )
    lr_wsd_decay_iters: Optional[int] = _f(
        None,
        "WSD: iterations of the final annealing phase, ending at --lr-decay-iters",
        "iterations",
        ge=1,
        applies=_WSD,
    )
    lr_wsd_decay_style: str = _f(
        "exponential",
        "WSD: shape of the annealing phase",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
        applies=_WSD,
    )
    weight_decay: float = _f(0.1, "decoupled weight decay on matrices", "", ge=0)
    adam_beta1: float = _f(0.9, "Adam first-moment decay", "", ge=0, lt=1)
    adam_beta2: float = _f(0.95, "Adam second-moment decay", "", ge=0, lt=1)
    adam_eps: float = _f(1e-8, "Adam denominator epsilon", "", gt=0)
    clip_grad: float = _f(1.0, "clip the global gradient L2 norm to this; 0 = off", "", ge=0)
    kernels: str = _f(
        "auto",
        "LayerNorm/Adam kernels (auto = apex on CUDA when importable, else torch)",
        choices=("auto", "apex", "torch", "reference"),
    )


@dataclass
class PrecisionConfig:
    """Model dtype and the fp16 loss scaler (DeepSpeed's fp16 block, same meanings)."""

    fp16: bool = _f(False, "fp16 weights and activations, fp32 master weights, loss scaling")
    bf16: bool = _f(False, "bf16 weights and activations, fp32 master weights")
    tf32: bool = _f(
        False,
        "CUDA only: fp32 matmuls and convolutions on TF32 tensor cores "
        "(10-bit mantissa inputs, fp32 accumulation); ignored on the CPU",
    )
    loss_scale: float = _f(0.0, "static fp16 loss scale; 0 = dynamic", "", ge=0, applies=_FP16)
    initial_scale_power: int = _f(16, "dynamic loss scale starts at 2**power", "", ge=0, lt=128, applies=_DYNAMIC_SCALE)
    loss_scale_window: int = _f(
        1000, "steps without overflow before the scale doubles", "iterations", ge=1, applies=_DYNAMIC_SCALE
    )
    hysteresis: int = _f(2, "overflows tolerated before the scale halves", "overflows", ge=1, applies=_DYNAMIC_SCALE)
    min_loss_scale: float = _f(1.0, "floor of the dynamic loss scale", "", gt=0, applies=_DYNAMIC_SCALE)
    max_consecutive_skips: int = _f(50, "stop after this many skipped (overflowed) steps in a row", "iterations", ge=1)
    fp8_format: Optional[str] = _f(
        None,
        "FP8 GEMMs in the linear layers and experts (megazero/ops/fp8.py, docs/precision.md): e4m3 "
        "for every operand, or hybrid = e4m3 forward and e5m2 output gradients; master weights stay "
        "in the model dtype; None = no FP8",
        choices=("e4m3", "hybrid"),
    )
    fp8_recipe: str = _f(
        "tensorwise",
        "FP8 scaling granularity (current scaling, power-of-two scales): tensorwise = one scale per "
        "tensor, rowwise = per row along the contraction, blockwise = DeepSeek-V3 1 x b activation "
        "and b x b weight tiles, mxfp8 = 1 x 32 blocks with e8m0 scales",
        choices=("tensorwise", "rowwise", "blockwise", "mxfp8"),
        applies=_FP8,
    )
    fp8_block: int = _f(
        128,
        "tile width b of the blockwise FP8 recipe (DeepSeek-V3: 128); hidden and ffn sizes per "
        "tensor-parallel rank and the tokens per micro-batch must be multiples of it",
        "elements",
        ge=1,
        applies=Needs("precision.fp8_recipe", ("blockwise",)),
    )
    fp8_param_gather: bool = _f(
        False,
        "ZeRO-3 all-gathers the FP8 GEMMs' weights as e4m3 bytes (1 per element, not the working dtype's "
        "2 or 4), each shard quantised with the scale of the whole weight (amax MAX-reduced over the ZeRO "
        "shard group and tp); the GEMMs use them without quantising again (Megatron-LM's flag; "
        "needs --zero-stage 3 and --fp8-recipe tensorwise)",
    )
    accumulate_allreduce_grads_in_fp32: bool = _f(
        True,
        "keep and reduce gradients in fp32, else in the model dtype (fp16/bf16)",
        flags=("--grads-in-model-dtype",),
        applies=Needs("precision.fp16", (True,), alt=Needs("precision.bf16", (True,))),
    )


@dataclass
class ZeroConfig:
    """ZeRO data parallelism (Rajbhandari et al. 2020): 0 = replicated, 1 = optimizer states
    sharded, 2 = optimizer states and gradients sharded, 3 = parameters sharded too (gathered
    per layer around its forward and backward, prefetched ahead:
    ``megazero.data_parallel.zero3_gather``)."""

    stage: int = _f(0, "ZeRO stage: 0, 1, 2 or 3", flags=("--zero-stage",))
    zero_shard_size: Optional[int] = _f(
        None,
        "hybrid sharding (HSDP / MiCS): shard the ZeRO state (optimizer states, gradients, stage-3 "
        "parameters) over S consecutive data-parallel ranks and replicate it over the dp x cp / S groups of "
        "them; gradients reduce-scattered inside the group, then all-reduced across the groups; S divides "
        "dp x cp; with --expert-model-parallel-size EP, S is a multiple of EP and expert state shards over "
        "S / EP ranks; None = dp x cp (flat ZeRO); DeepSpeed's mics_shard_size",
        "ranks",
        ge=1,
        flags=("--zero-shard-size",),
    )
    reduce_bucket_size: Optional[int] = _f(
        None, "gradient reduction bucket; None = hidden size squared (DeepSpeed's 'auto')", "elements", ge=1
    )
    allgather_bucket_size: Optional[int] = _f(
        None,
        "parameter all-gather bucket; None = hidden size squared",
        "elements",
        ge=1,
        # the all-gather after the step: ZeRO-1/2 without the overlap (which gathers per reduce
        # bucket), and ZeRO-3's persistent parameters
        applies=Needs("zero.stage", stages_where("shards_params"), alt=Needs("zero.overlap_param_gather", ("off",))),
    )
    overlap_comm: bool = _f(True, "overlap gradient reduction with the backward pass", flags=("--no-overlap-comm",))
    overlap_param_gather: str = _f(
        "auto",
        "ZeRO-1/2: leave the all-gather of the updated parameters in flight after the "
        "optimizer step, bucket by bucket, each waited for just before the next forward uses it "
        "(Megatron-core's overlap_param_gather; bit-identical to off); auto = on at --zero-stage 1 "
        "and 2, off at 0 (nothing to gather) and 3 (gathered before each forward anyway); on at "
        "stage 0 or 3 is refused",
        choices=("auto", "on", "off"),
        applies=Needs("zero.stage", stages_where("gathers_after_step")),
    )
    zero3_reshard_after_forward: str = _f(
        "auto",
        "ZeRO-3: drop a layer's gathered parameters after its forward and gather them again "
        "for its backward (on: less memory, one more all-gather per micro-batch), or keep them "
        "gathered across the step's micro-batches (off); auto = off under --pp > 1, else on",
        choices=("auto", "on", "off"),
        applies=_ZERO3,
    )
    # DeepSpeed's zero_optimization.stage3_* knobs, in elements as DeepSpeed counts them.
    zero3_prefetch_bucket_size: Optional[int] = _f(
        None,
        "ZeRO-3: parameters all-gathered ahead of the computing layer (DeepSpeed's "
        "stage3_prefetch_bucket_size); 0 = no prefetch; None = 0.9 x hidden size squared (the "
        "Hugging Face DeepSpeed integration's 'auto')",
        "elements",
        ge=0,
        applies=_ZERO3,
    )
    zero3_max_live_parameters: int = _f(
        1_000_000_000,
        "ZeRO-3: bound on gathered parameters at any time (DeepSpeed's "
        "stage3_max_live_parameters): no prefetch past it, idle layers released first",
        "elements",
        ge=1,
        applies=_ZERO3,
    )
    zero3_param_persistence_threshold: Optional[int] = _f(
        None,
        "ZeRO-3: parameters with fewer elements stay whole on every rank (gradients and "
        "optimizer state still sharded; DeepSpeed's stage3_param_persistence_threshold); None = 10 x "
        "hidden size (the Hugging Face DeepSpeed integration's 'auto')",
        "elements",
        ge=0,
        applies=_ZERO3,
    )
    zero3_max_reuse_distance: Optional[int] = _f(
        None,
        "ZeRO-3: a layer used again (its backward) within this many gathered elements "
        "stays gathered after its forward (DeepSpeed's stage3_max_reuse_distance); None = the "
        "prefetch bucket, so only the layers whose backward follows their forward within about "
        "one bucket (the last) stay gathered",
        "elements",
        ge=0,
        applies=_ZERO3,
    )
    # DeepSpeed knobs whose alternative megazero does not implement: it always keeps gradients
    # in contiguous buffers, reduce-scatters them (stages 1/2) and all-gathers updated shards.
    # Turning one off is accepted (DeepSpeed files set them) and ignored with a warning.
    contiguous_gradients: bool = _f(
        True,
        "DeepSpeed's contiguous_gradients; megazero always copies "
        "gradients into contiguous buffers (off: warning, ignored)",
        flags=("--no-contiguous-gradients",),
    )
    reduce_scatter: bool = _f(
        True,
        "DeepSpeed's reduce_scatter; megazero always reduce-scatters at stages 1/2 (off: warning, ignored)",
        flags=("--no-reduce-scatter",),
    )
    allgather_partitions: bool = _f(
        True,
        "DeepSpeed's allgather_partitions; megazero always all-gathers updated shards (off: warning, ignored)",
        flags=("--no-allgather-partitions",),
    )
    # ZeRO-Offload (Ren et al. 2021): DeepSpeed's zero_optimization.offload_optimizer/offload_param.
    offload_optimizer: str = _f(
        "none",
        "where the fp32 main params and Adam moments live and Adam runs: "
        "none (the device), cpu (host memory, ZeRO-Offload; stage >= 1) or nvme "
        "(swap files under --offload-nvme-path, Adam on the host; ZeRO-Infinity)",
        choices=("none", "cpu", "nvme"),
        flags=("--offload-optimizer",),
    )
    offload_optimizer_pin_memory: bool = _f(
        True,
        "page-lock the offloaded host state on CUDA (DeepSpeed's offload_optimizer.pin_memory)",
        flags=("--no-offload-pin-memory",),
        applies=Needs("zero.offload_optimizer", ("cpu", "nvme")),
    )
    # ZeRO-Infinity (Rajbhandari et al. 2021): DeepSpeed's offload_optimizer.{nvme_path, buffer_count},
    # zero_optimization.sub_group_size and aio.thread_count
    offload_nvme_path: Optional[str] = _f(
        None,
        "directory of the NVMe swap files (one fresh directory per rank and run under it, "
        "removed at exit; a killed rank's is swept by the launcher or the next run; checked to be "
        "a writable directory with room for the swap files before any rank starts; DeepSpeed's nvme_path)",
        "path",
        applies=_ANY_NVME,
    )
    offload_nvme_buffer_count: int = _f(
        4,
        "host buffers the swapped optimizer step cycles sub-groups "
        "through (DeepSpeed's offload_optimizer.buffer_count)",
        "buffers",
        ge=1,
        applies=_NVME,
    )
    sub_group_size: int = _f(
        1_000_000_000,
        "elements of optimizer state swapped and updated at a time "
        "with --offload-optimizer nvme (DeepSpeed's sub_group_size)",
        "elements",
        ge=1,
        applies=_NVME,
    )
    offload_nvme_io_threads: int = _f(
        1, "threads doing the swap-file reads and writes (DeepSpeed's aio.thread_count)", "threads", ge=1, applies=_NVME
    )
    offload_param: str = _f(
        "none",
        "where ZeRO-3 parameter shards live between uses: none, cpu "
        "(host memory, copied to the device for each all-gather) or nvme (swap files "
        "under --offload-nvme-path, read for each all-gather; ZeRO-Infinity); needs stage 3",
        choices=("none", "cpu", "nvme"),
        flags=("--offload-param",),
    )
    # DeepSpeed's offload_param.{buffer_count, buffer_size, max_in_cpu} (device nvme)
    offload_param_buffer_count: int = _f(
        5,
        "parameter shards in host memory at once with --offload-param nvme (DeepSpeed's offload_param.buffer_count)",
        "buffers",
        ge=1,
        applies=_PARAM_NVME,
    )
    offload_param_buffer_size: int = _f(
        100_000_000,
        "most elements of one swapped parameter shard with "
        "--offload-param nvme (DeepSpeed's offload_param.buffer_size)",
        "elements",
        ge=1,
        applies=_PARAM_NVME,
    )
    offload_param_max_in_cpu: int = _f(
        1_000_000_000,
        "elements of parameter shards kept in host memory, never "
        "swapped, with --offload-param nvme (DeepSpeed's offload_param.max_in_cpu)",
        "elements",
        ge=0,
        applies=_PARAM_NVME,
    )


@dataclass
class DataConfig:
    """The corpus: preprocessed .bin/.idx files and their sentencepiece tokenizer."""

    data_path: list[str] = _f([], "PREFIX of PREFIX.bin/.idx, or a blend: W1 PREFIX1 W2 PREFIX2 ...", "path")
    split: str = _f("969,30,1", "train,valid,test proportions of the documents", "parts")
    tokenizer_model: Optional[str] = _f(
        None,
        "sentencepiece .model file, or a tokenizer.json (or a folder "
        "holding one) with HuggingFaceTokenizer; needed with --data-path",
        "path",
    )
    tokenizer_type: str = _f(
        "SentencePieceTokenizer",
        "how --tokenizer-model is read (Megatron's names)",
        choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"),
        applies=_REAL_DATA,
    )
    vocab_size: Optional[int] = _f(
        None, f"vocabulary; None = the tokenizer's ({MOCK_VOCAB_SIZE} with --mock-data)", "tokens", ge=1
    )
    data_cache_dir: Optional[str] = _f(
        None,
        "where sample indices are cached (atomic, shared by ranks); None = built in memory on every rank",
        "path",
        applies=_REAL_DATA,
    )
    # packed documents (Megatron's flags): a sample is documents joined by the tokenizer's EOD id
    reset_attention_mask: bool = _f(
        False,
        "a token attends only to its own document: attention restarts after "
        "each EOD token (the EOD belongs to the document it ends)",
    )
    reset_position_ids: bool = _f(False, "position ids restart at 0 after each EOD token")
    eod_mask_loss: bool = _f(
        False,
        "leave targets that are the EOD token out of the loss (the mean is over the other targets of the global batch)",
    )
    # supervised fine-tuning data (python -m data.sft): records with a per-token loss mask
    sft: bool = _f(
        False,
        "--data-path holds supervised fine-tuning data (python -m data.sft): samples of whole "
        "records, the loss on response tokens only (the mean is over those of the global batch)",
        applies=Needs("train.mock_data", (False,), refuse=True, wanted="--data-path (not --mock-data)"),
    )
    sft_packing: str = _f(
        "pack",
        "pack: records filled greedily into each sample (add --reset-attention-mask "
        "--reset-position-ids to keep them apart); pad: one record per sample, padded",
        choices=("pack", "pad"),
        applies=Needs("data.sft", (True,)),
    )
    # fill-in-the-middle (Bavarian et al. 2022; Megatron-LM's flags): data/fim.py, applied as samples are read
    fim_rate: float = _f(
        0.0,
        "probability that a document piece of a sample (split at EOD) is rewritten in "
        "fill-in-the-middle form, cut at token boundaries; in [0, 1]; 0 = off; adds 4 sentinel "
        "tokens to the tokenizer (--fim-tokens)",
        "probability",
        ge=0,
        applies=Needs(
            "train.mock_data", (False,), refuse=True, wanted="--data-path with --tokenizer-model (no --mock-data)"
        ),
    )
    fim_spm_rate: float = _f(
        0.5,
        "probability that a FIM unit uses the SPM order (suffix, prefix, middle) instead of PSM; in [0, 1]",
        "probability",
        ge=0,
        applies=_FIM,
    )
    fim_split_sample: Optional[str] = _f(
        None,
        "text of a token (e.g. a file separator) at which a document "
        "piece is split into fragments, each FIMed with --fim-fragment-rate",
        applies=_FIM,
    )
    fim_fragment_rate: Optional[float] = _f(
        None,
        "probability of FIM per fragment of --fim-split-sample, in [0, 1]; None = --fim-rate",
        "probability",
        ge=0,
        applies=Needs("data.fim_split_sample", besides=(None,), refuse=True),
    )
    fim_no_prefix: Optional[str] = _f(
        None, "leave a FIM unit whose decoded text starts with this string as it is", applies=_FIM
    )
    fim_tokens: Optional[list[str]] = _f(
        None,
        "the tokenizer's own prefix, middle, suffix and pad tokens (four "
        "texts); None = its <fim_prefix> <fim_middle> <fim_suffix> <fim_pad> (or "
        "Qwen's fim_ tokens) when it has them, else 4 ids appended after its "
        "vocabulary",
        applies=_FIM,
    )


_DPO = Needs("post.mode", ("dpo",))
_RM = Needs("post.mode", ("rm",))
_GRPO = Needs("post.mode", ("grpo",))
_PPO = Needs("post.mode", ("ppo",))
_RL = Needs("post.mode", ("grpo", "ppo"), wanted="--post-train grpo or ppo")  # rollouts of the policy
_GRPO_KL = (_GRPO, Needs("post.grpo_kl_beta", above=0))
# a frozen reference: DPO's losses but SimPO's, GRPO's KL penalty, PPO's KL-shaped rewards
_REFERENCE = (
    Needs(
        "post.mode",
        ("dpo", "ppo"),
        alt=Needs("post.grpo_kl_beta", above=0),
        wanted="--post-train dpo or ppo, or --grpo-kl-beta > 0",
    ),
    Needs("post.dpo_loss", besides=("simpo",)),
)


@dataclass
class PostTrainConfig:
    """Post-training modes of the one trainer (docs/post-training.md): supervised fine-tuning,
    reward models and preference optimisation against a frozen reference model."""

    mode: Optional[str] = _f(
        None,
        "sft: supervised fine-tuning (the same as --sft); rm: a reward model (a scalar value head, "
        "Bradley-Terry loss) on python -m data.preference pairs; dpo: preference optimisation on "
        "those pairs (--dpo-loss picks DPO, IPO, SimPO or hinge); grpo: reinforcement learning "
        "on python -m data.prompts prompts with rollouts sampled by the policy and a --reward "
        "(GRPO, Shao et al. 2024); ppo: the same rollouts with a critic (a value model trained "
        "beside the policy) and KL-shaped rewards (InstructGPT's RLHF, DeepSpeed-Chat's step 3); "
        "None = pre-training",
        flags=("--post-train",),
        choices=("sft", "rm", "dpo", "grpo", "ppo"),
    )
    rm_use_margin: bool = _f(
        False,
        "subtract each pair's margin (python -m data.preference's margin field) inside the "
        "Bradley-Terry loss: -log sigmoid(s_w - s_l - m) (Llama 2's margin loss, Touvron et al. "
        "2023, sec. 3.2.2)",
        applies=_RM,
    )
    rm_center_coef: float = _f(
        0.0,
        "weight c of the reward-centring term c x (s_w + s_l)^2 added to each pair's loss "
        "(Eisenstein et al. 2023); 0 = off",
        ge=0,
        applies=_RM,
    )
    dpo_beta: float = _f(
        0.1,
        "beta: the inverse temperature of the implicit reward beta x log(pi / pi_ref) "
        "(Rafailov et al. 2023, eq. 7); SimPO's reward scale",
        gt=0,
        applies=_DPO,
    )
    dpo_loss: str = _f(
        "sigmoid",
        "sigmoid: DPO (-log sigmoid of the reward margin); ipo: IPO's squared loss on length-averaged "
        "log-ratios (Azar et al. 2023); simpo: reference-free, length-normalised with margin "
        "--simpo-gamma (Meng et al. 2024); hinge: max(0, 1 - margin) (SLiC, Zhao et al. 2023)",
        choices=("sigmoid", "ipo", "simpo", "hinge"),
        applies=_DPO,
    )
    dpo_label_smoothing: float = _f(
        0.0,
        "the probability that a pair's preference is flipped (conservative DPO, cDPO); in [0, 0.5)",
        "probability",
        ge=0,
        lt=0.5,
        applies=_DPO,
    )
    dpo_sft_weight: float = _f(
        0.0,
        "weight of the chosen response's mean token negative log-likelihood added to each pair's "
        "loss (RPO, Pang et al. 2024); 0 = off",
        ge=0,
        applies=_DPO,
    )
    simpo_gamma: float = _f(
        0.5,
        "SimPO's target reward margin gamma (in reward units, subtracted inside the sigmoid)",
        ge=0,
        applies=(_DPO, Needs("post.dpo_loss", ("simpo",))),
    )
    ref_load: Optional[str] = _f(
        None,
        "checkpoint directory of the frozen reference model (its latest checkpoint, any layout); "
        "None = the policy's starting point: --load's checkpoint, --from-hf's weights, or the "
        "seeded initialisation; a resumed run keeps the reference its checkpoint records",
        "path",
        applies=_REFERENCE,
    )
    ref_offload: bool = _f(
        False,
        "keep the reference model's weights in host memory (pinned on CUDA) between uses and copy "
        "them to the device only for its forward pass (OpenRLHF's --ref_reward_offload): the "
        "reference then costs no GPU memory outside that pass, for one host-to-device copy of its "
        "weights per step",
        applies=_REFERENCE,
    )
    reward: str = _f(
        "exact",
        "the reward of a response: exact (1 when it equals the prompt's answer after stripping "
        "white space, else 0), python:MODULE:FUNCTION (FUNCTION(prompt, response, answer) -> "
        "a number) or rm:DIR (the score of prompt + response by the reward model of the latest "
        "--post-train rm checkpoint under DIR, with this run's tokenizer; every rank holds a "
        "whole copy at the run's tp; megazero.post_training.rewards)",
        applies=_RL,
    )
    grpo_prompts_per_step: int = _f(
        8,
        "prompts of one rollout (one iteration); each is sampled --grpo-group-size times and the "
        "rollout's P x G responses are cut into optimizer steps of --global-batch-size sequences",
        "prompts",
        ge=1,
        applies=_RL,
    )
    grpo_group_size: int = _f(
        4, "responses sampled per prompt (G; at least 2 for grpo's group baseline)", "sequences", ge=1, applies=_RL
    )
    grpo_iterations: int = _f(
        1,
        "passes over each rollout (each pass one optimizer step per --global-batch-size "
        "sequences; GRPO's mu, Shao et al. 2024, alg. 1)",
        ge=1,
        applies=_RL,
    )
    grpo_advantage: str = _f(
        "grpo",
        "grpo: (r - group mean) / (group std + 1e-6); dr_grpo: r - group mean (Liu et al. 2025); "
        "rloo: r - mean of the other samples (Ahmadian et al. 2024)",
        choices=("grpo", "dr_grpo", "rloo"),
        applies=_GRPO,
    )
    grpo_clamp_eps_lower: float = _f(
        0.2, "the ratio's lower clip 1 - eps (PPO's epsilon, Schulman et al. 2017)", ge=0, applies=_RL
    )
    grpo_clamp_eps_upper: float = _f(
        0.2, "the ratio's upper clip 1 + eps (DAPO's clip-higher uses 0.28, Yu et al. 2025)", ge=0, applies=_RL
    )
    grpo_kl_beta: float = _f(
        0.0,
        "weight of the per-token KL(policy || reference) estimate added to the loss; 0 = no KL "
        "term and no reference model",
        ge=0,
        applies=_GRPO,
    )
    grpo_kl_estimator: str = _f(
        "k3",
        "k1: log ratio; k2: half its square; k3: exp(-d) + d - 1, unbiased and non-negative "
        "(Schulman 2020, DeepSeekMath's choice)",
        choices=("k1", "k2", "k3"),
        applies=_GRPO_KL,
    )
    grpo_loss_agg: str = _f(
        "token-mean",
        "how token losses make the step's loss: token-mean (each response token of the step "
        "weighs the same, DAPO); seq-mean-token-mean (each response's token mean, then the "
        "mean over responses: the original GRPO); seq-mean-token-sum-norm (token sums over "
        "responses x --max-new-tokens: Dr. GRPO)",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        applies=_RL,
    )
    grpo_kl_in_reward: bool = _f(
        False,
        "put the KL penalty in the rewards instead of the loss: each response's reward minus "
        "--grpo-kl-beta x its summed per-token KL estimate (at the rollout's log-probabilities) "
        "before the group advantages, as PPO's shaped rewards do (--grpo-filter-groups-with-same-"
        "reward still reads the --reward scores)",
        applies=_GRPO_KL,
    )
    grpo_filter_groups_with_same_reward: bool = _f(
        False,
        "leave groups whose rewards are all equal (advantage 0) out of the loss and of its "
        "denominators (DAPO's dynamic sampling without the resampling, Yu et al. 2025)",
        applies=_GRPO,
    )
    max_new_tokens: int = _f(32, "bound on each rollout response", "tokens", ge=1, applies=_RL)
    temperature: float = _f(
        1.0,
        "rollout sampling temperature; the policy's log-probabilities are taken at the same one",
        gt=0,
        applies=_RL,
    )
    top_k: int = _f(0, "sample from the k most likely tokens; 0 = all", "tokens", ge=0, applies=_RL)
    top_p: float = _f(
        1.0,
        "sample from the smallest set of tokens whose probability reaches p (nucleus), in (0, 1]",
        gt=0,
        applies=_RL,
    )
    critic_load: Optional[str] = _f(
        None,
        "checkpoint directory the PPO critic starts from (its latest checkpoint, e.g. a --post-train "
        "rm run's: DeepSpeed-Chat starts the critic from the reward model); None = the policy's "
        "starting weights with a seeded value head",
        "path",
        applies=_PPO,
    )
    critic_lr: Optional[float] = _f(
        None, "the critic's learning rate (on --lr's schedule); None = --lr", gt=0, applies=_PPO
    )
    gamma: float = _f(1.0, "discount of the per-token rewards in GAE (Schulman et al. 2016)", ge=0, applies=_PPO)
    lam: float = _f(0.95, "GAE's lambda: 0 = one-step TD, 1 = Monte Carlo returns", ge=0, applies=_PPO)
    cliprange_value: Optional[float] = _f(
        0.2,
        "clip the critic's new values to old +- this in its loss (PPO2's value clipping); None = no clipping",
        gt=0,
        applies=_PPO,
    )
    init_kl_coef: float = _f(
        0.02,
        "weight of the per-token KL(policy || reference) penalty in the rewards (InstructGPT, Ouyang "
        "et al. 2022, eq. 2); the adaptive controller's starting value with --kl-target",
        ge=0,
        applies=_PPO,
    )
    kl_target: Optional[float] = _f(
        None,
        "adapt the KL coefficient toward this KL per response (Ziegler et al. 2019, sec. 2.2); None = fixed",
        "nats",
        gt=0,
        applies=_PPO,
    )
    kl_horizon: float = _f(
        10000,
        "the adaptive KL controller's horizon",
        "responses",
        gt=0,
        applies=(_PPO, Needs("post.kl_target", besides=(None,))),
    )
    ptx_coef: float = _f(
        0.0,
        "weight of a pretraining language-model loss kept during PPO (InstructGPT's PPO-ptx, Ouyang "
        "et al. 2022, eq. 2): after each policy step, a step on --global-batch-size sequences of "
        "--ptx-data-path whose loss is this times their token-mean loss (DeepSpeed-Chat's "
        "unsupervised step); 0 = off",
        ge=0,
        applies=_PPO,
    )
    ptx_data_path: list[str] = _f(
        [],
        "the ptx term's pretraining data: PREFIX of python -m data.preprocess's PREFIX.bin/.idx, or a "
        "blend W1 PREFIX1 W2 PREFIX2 ..., tokenized with this run's tokenizer",
        "path",
        applies=(_PPO, Needs("post.ptx_coef", above=0)),
    )
    clip_reward_value: Optional[float] = _f(
        None,
        "clip each response's score to +- this before it enters the rewards (DeepSpeed-Chat); None = off",
        gt=0,
        applies=_PPO,
    )
    allow_dropout: bool = _f(
        False,
        "let post-training run with dropout on (the policy's log-probabilities then differ from "
        "the reference's by the dropout noise alone)",
        flags=("--post-train-allow-dropout",),
        applies=Needs("post.mode", besides=(None,)),
    )


@dataclass
class LoggingConfig:
    """Console log, TensorBoard, Weights & Biases, metrics file, MFU peak, final sample."""

    log_interval: int = _f(
        10, "log every this many steps", "iterations", flags=("--log-interval", "--steps-per-print"), ge=1
    )
    run_dir: Optional[str] = _f(None, "directory of this run; None = runs/TIMESTAMP (resolve_run_dir)", "path")
    tensorboard_dir: Optional[str] = _f("tensorboard", "TensorBoard event directory, relative to --run-dir", "path")
    metrics_file: Optional[str] = _f("metrics.jsonl", "JSON-lines metrics, relative to --run-dir", "path")
    generate_tokens: int = _f(
        64, "length of the sample printed at the end", "tokens", ge=0, applies=_REAL_DATA
    )  # the sample needs a tokenizer
    prompt: str = _f("def ", "prompt of that sample", applies=_REAL_DATA)
    sample_temperature: float = _f(
        0.8,
        "temperature of that sample, drawn with a generator seeded by --seed (reproducible); 0 = greedy",
        "",
        ge=0,
        applies=_REAL_DATA,
    )
    sample_top_k: int = _f(
        40,
        "draw that sample from the k most likely tokens; 0 = all",
        "tokens",
        ge=0,
        applies=(_REAL_DATA, Needs("log.sample_temperature", besides=(0.0,))),
    )
    wandb_project: Optional[str] = _f(
        None,
        "Weights & Biases project: log TensorBoard's scalars there too "
        "(needs the wandb extra; WANDB_MODE=offline works without a network); "
        "None = off",
    )
    wandb_exp_name: Optional[str] = _f(None, "W&B run name; None = the --run-dir folder name", applies=_WANDB)
    wandb_save_dir: Optional[str] = _f(None, "W&B files directory; None = RUN_DIR/wandb", "path", applies=_WANDB)
    peak_tflops: Optional[float] = _f(
        None,
        "dense peak matmul TFLOP/s of one device, the MFU denominator; "
        "None = megazero's table of known GPUs (else MFU n/a)",
        "TFLOP/s",
        gt=0,
    )
    profile: bool = _f(
        False,
        "torch.profiler trace of steps --profile-step-start to --profile-step-end - 1 on "
        "each rank of --profile-ranks, written to RUN_DIR/profile/rankR.*.pt.trace.json (TensorBoard, Perfetto)",
    )
    profile_step_start: int = _f(
        10, "first profiled step (Megatron's --profile-step-start)", "iterations", ge=1, applies=_PROFILE
    )
    profile_step_end: int = _f(12, "profiling stops before this step", "iterations", ge=2, applies=_PROFILE)
    profile_ranks: list[str] = _f(["0"], "global ranks that write a trace", "ranks", applies=_PROFILE)


@dataclass
class Config:
    """Every setting of a run (sections as attributes) plus where each given value came from.

    ``sources`` maps a setting ("train.micro_batch_size") to where it was given ("--micro-batch-size"
    or "train_micro_batch_size_per_gpu in ds.json"); ``warnings`` collects config warnings.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LoggingConfig = field(default_factory=LoggingConfig)
    post: PostTrainConfig = field(default_factory=PostTrainConfig)
    deepspeed_config: Optional[str] = _f(
        None,
        "DeepSpeed-style JSON file (keys read: README, section DeepSpeed configuration files; "
        "megazero/config/deepspeed.py)",
        "path",
        flags=("--deepspeed-config", "--deepspeed_config"),
    )
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


# -- the settings as a flat list ------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One setting: ``name`` ("model.num_layers"), its field, its type without Optional."""

    name: str
    field: dataclasses.Field
    base: type

    @property
    def flags(self) -> tuple[str, ...]:
        """Its command-line flags: the field's, else ``--leaf-name`` (``--no-leaf-name`` for a
        switch that is on by default)."""
        given = self.field.metadata["flags"]
        if given:
            return given
        leaf = self.name.split(".")[-1].replace("_", "-")
        return (f"--no-{leaf}",) if self.field.default is True else (f"--{leaf}",)

    @property
    def flag(self) -> str:
        """The flag that names this setting in messages (the first one)."""
        return self.flags[0]

    @property
    def default(self) -> Any:
        """The default value (a fresh list for list settings)."""
        f = self.field
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _base(hint) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list or hint is list:
        return list
    return _base(args[0]) if args else hint


@functools.lru_cache(maxsize=None)
def settings() -> tuple[Setting, ...]:
    """Every setting in declaration order (the sections' fields, then ``deepspeed_config``)."""
    out, hints = [], typing.get_type_hints(Config)
    for top in dataclasses.fields(Config):
        sub = hints[top.name]
        if dataclasses.is_dataclass(sub):
            sub_hints = typing.get_type_hints(sub)
            out += [Setting(f"{top.name}.{f.name}", f, _base(sub_hints[f.name])) for f in dataclasses.fields(sub)]
        elif "help" in top.metadata:
            out.append(Setting(top.name, top, _base(hints[top.name])))
    return tuple(out)


def setting_named(name: str) -> Setting:
    """The Setting called ``name`` ("model.num_layers"); StopIteration when there is none."""
    return next(s for s in settings() if s.name == name)


def get_value(cfg: Config, name: str) -> Any:
    """The value of setting ``name`` ("train.micro_batch_size") in ``cfg``."""
    obj = cfg
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def set_value(cfg: Config, name: str, value: Any) -> None:
    """Set setting ``name`` ("train.micro_batch_size") of ``cfg`` to ``value`` (unchecked)."""
    *path, leaf = name.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, leaf, value)


def show_flag(cfg: Config, name: str) -> str:
    """The flag of a setting, plus the JSON key when the value came from the DeepSpeed file:
    ``--micro-batch-size`` or ``--micro-batch-size (train_micro_batch_size_per_gpu in ds.json)``."""
    flag, src = setting_named(name).flag, cfg.sources.get(name, "")
    return f"{flag} ({src})" if src and not src.startswith("--") else flag
