"""The model-shape rules, written once: which GPT sizes split over ``tp`` tensor-parallel ranks.

Two callers apply the same functions: ``megazero.config.checks`` to the flags (so
``config_from_argv`` refuses a bad shape on every rank before any process group exists,
docs/design.md, contract 3) and ``model.config.GPTConfig.validate`` to a GPTConfig built directly.
The rules live here, not in model/, because megazero imports neither model nor data while
model may import megazero (docs/design.md, "Dependency direction"). Every message names the
Megatron-LM flag and the fix; ConfigError is a ValueError.

The rules (Megatron-LM's): the heads divide the hidden size and ``tp`` divides the heads and
the FFN width (each rank holds whole heads and F/tp MLP units; SwiGLU's F/tp gate and F/tp up
units); the sequence fits the position table, and divides by ``tp`` under sequence
parallelism; grouped-query attention's G key/value heads divide the heads and divide by
``tp``; RoPE rotates an even number >= 2 of each head's dimensions, a fraction in (0, 1].
"""

from __future__ import annotations

from typing import Optional

from megazero.config.schema import ConfigError


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """``4 H``; with SwiGLU Megatron-LM's ``int(4 H * 2/3 / 64) * 64`` (same parameter count as a
    ``4 H`` GELU MLP, a multiple of 64). Example: ``(4096, True) -> 10880``; ``(32, True) -> 64``
    is the smallest width it gives, ``(16, True) -> 0`` (validation then asks for a width)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def check_sizes(
    *,
    hidden_size: int,
    num_attention_heads: int,
    ffn_hidden_size: int,
    seq_length: int,
    max_position_embeddings: int,
    tp: int,
    sequence_parallel: bool = False,
    swiglu: bool = False,
) -> None:
    """Heads divide H, tp divides the heads and the FFN width (so tp divides H too), the
    sequence fits the positions and, with sequence parallelism, divides by tp.

    Sizes in elements / heads / tokens, all >= 1. Raises ConfigError naming the flags.
    """
    if hidden_size % num_attention_heads:
        raise ConfigError(
            f"--hidden-size {hidden_size} is not divisible by --num-attention-heads "
            f"{num_attention_heads}; fix: choose a head count that divides the hidden size"
        )
    if num_attention_heads % tp:
        raise ConfigError(
            f"--num-attention-heads {num_attention_heads} is not divisible by --tp {tp}; "
            "fix: use a --tp that divides the head count"
        )
    if ffn_hidden_size % tp:
        glu = " (a gated MLP, --swiglu or --quick-geglu: each rank holds F/tp gate and F/tp up units)" if swiglu else ""
        raise ConfigError(
            f"--ffn-hidden-size {ffn_hidden_size} is not divisible by --tp {tp}{glu}; "
            "fix: use a multiple of the tensor-parallel size"
        )
    if seq_length > max_position_embeddings:
        raise ConfigError(
            f"--seq-length {seq_length} exceeds --max-position-embeddings "
            f"{max_position_embeddings}; fix: raise the positions or shorten the sequence"
        )
    if sequence_parallel and seq_length % tp:
        raise ConfigError(
            f"--sequence-parallel needs --seq-length {seq_length} divisible by --tp {tp}; "
            "fix: use a multiple of --tp or drop --sequence-parallel"
        )


def check_block(
    *,
    hidden_size: int,
    num_attention_heads: int,
    tp: int,
    num_query_groups: Optional[int] = None,
    rotary_percent: float = 1.0,
    rope: bool = False,
    kv_channels: Optional[int] = None,
) -> None:
    """The LLaMA-style block: G = ``num_query_groups`` (None = multi-head attention) divides
    the heads and divides by tp; ``rotary_percent`` in (0, 1], and with ``rope`` it rotates an
    even number >= 2 of each head's ``kv_channels`` (default ``H / heads``) dimensions.

    Call after ``check_sizes`` (the heads divide H). Raises ConfigError naming the flags.
    """
    G = num_query_groups
    if G is not None:
        if num_attention_heads % G:
            raise ConfigError(
                f"--num-query-groups {G} does not divide --num-attention-heads {num_attention_heads}; "
                "fix: a divisor of the head count (1 = multi-query, the head count = multi-head)"
            )
        if G % tp:
            raise ConfigError(
                f"--num-query-groups {G} is not divisible by --tp {tp}; fix: a --tp that divides "
                "the query groups (each rank holds whole groups with their queries)"
            )
    if not 0.0 < rotary_percent <= 1.0:
        raise ConfigError(f"--rotary-percent {rotary_percent} is outside (0, 1]; fix: e.g. 1.0 or 0.5")
    head_dim = hidden_size // num_attention_heads if kv_channels is None else kv_channels
    rot = int(head_dim * rotary_percent)
    if rope and (rot < 2 or rot % 2):
        raise ConfigError(
            f"--rotary-percent {rotary_percent} rotates {rot} dimensions of each "
            f"{head_dim}-dimensional head; RoPE needs an even number >= 2; fix: another "
            "--rotary-percent (or --kv-channels)"
        )


def check_rope_scaling(low_freq_factor: float, high_freq_factor: float) -> None:
    """Llama 3.1's RoPE rewrite interpolates between the two wavelength bounds (model/rope.py), so
    ``--rope-scaling-high-freq-factor`` must exceed ``--rope-scaling-low-freq-factor``. Raises
    ConfigError naming both flags."""
    if not high_freq_factor > low_freq_factor:
        raise ConfigError(
            f"--rope-scaling-high-freq-factor {high_freq_factor} is not above --rope-scaling-low-freq-factor "
            f"{low_freq_factor}; fix: e.g. Llama 3.1's 4.0 and 1.0"
        )


def check_yarn_of(settings) -> None:
    """``check_yarn`` of an object holding the settings under their names (``ModelConfig`` and
    ``GPTConfig`` share them: ``yarn_rotary_scaling_factor``, ``use_rope_scaling``,
    ``rotary_seq_len_interpolation_factor``, ``yarn_beta_fast``, ``yarn_beta_slow``,
    ``yarn_mscale``, ``yarn_mscale_all_dim``)."""
    s = settings
    check_yarn(
        yarn_factor=s.yarn_rotary_scaling_factor,
        use_rope_scaling=s.use_rope_scaling,
        linear_factor=s.rotary_seq_len_interpolation_factor,
        beta_fast=s.yarn_beta_fast,
        beta_slow=s.yarn_beta_slow,
        mscale=s.yarn_mscale,
        mscale_all_dim=s.yarn_mscale_all_dim,
    )


def check_yarn(
    *,
    yarn_factor: Optional[float],
    use_rope_scaling: bool,
    linear_factor: Optional[float],
    beta_fast: float,
    beta_slow: float,
    mscale: Optional[float],
    mscale_all_dim: Optional[float],
) -> None:
    """YaRN (model/rope.py) is one RoPE scaling of its own, with a ramp from ``beta_fast`` down to
    ``beta_slow`` rotations, and its ``mscale`` counts only beside ``mscale_all_dim`` (transformers'
    ``yarn`` rope type). Raises ConfigError naming the flags: YaRN with another scaling,
    ``beta_fast < beta_slow``, or an ``mscale`` other than 1 that would be ignored."""
    if yarn_factor is None:
        return
    linear = linear_factor is not None
    others = (use_rope_scaling, "--use-rope-scaling"), (linear, "--rotary-seq-len-interpolation-factor")
    for on, flag in others:
        if on:
            raise ConfigError(
                f"--yarn-rotary-scaling-factor with {flag}: one RoPE scaling at a time (a Hugging Face config has "
                "one rope type); fix: drop one of them"
            )
    if beta_fast < beta_slow:
        raise ConfigError(
            f"--yarn-beta-fast {beta_fast} is below --yarn-beta-slow {beta_slow}; fix: e.g. YaRN's 32 and 1"
        )
    if mscale is not None and mscale != 1.0 and not mscale_all_dim:
        raise ConfigError(
            f"--yarn-mscale {mscale} without --yarn-mscale-all-dim is ignored (the attention factor is then "
            "0.1 ln(factor) + 1); fix: give --yarn-mscale-all-dim or drop --yarn-mscale"
        )


def check_context_parallel(
    *,
    seq_length: int,
    cp: int,
    tp: int,
    sequence_parallel: bool,
    comm_type: str,
    num_attention_heads: int,
    num_query_groups: Optional[int] = None,
) -> None:
    """Context parallelism (megazero/context_parallel): the sequence cuts into ``2 cp`` equal
    chunks (causal load balancing), and with sequence parallelism each rank's ``T/cp`` tokens
    divide by tp again; ``a2a`` (DeepSpeed-Ulysses) hands each cp rank ``heads/tp/cp`` query
    heads and ``G/tp/cp`` key/value heads. Sizes in tokens / heads. Raises ConfigError naming
    the flags and the fix; nothing at ``cp == 1``.
    """
    if cp == 1:
        return
    if seq_length % (2 * cp):
        raise ConfigError(
            f"--seq-length {seq_length} is not divisible by 2 x --cp {cp} = {2 * cp} (each sequence "
            f"is cut into 2 x cp chunks); fix: a multiple of {2 * cp}"
        )
    if sequence_parallel and seq_length % (cp * tp):
        raise ConfigError(
            f"--sequence-parallel with --cp {cp} needs --seq-length {seq_length} divisible by "
            f"--cp x --tp = {cp * tp}; fix: a multiple of {cp * tp} (and of {2 * cp})"
        )
    if comm_type == "a2a":
        G = num_query_groups or num_attention_heads
        for flag, n in (("--num-attention-heads", num_attention_heads), ("--num-query-groups", G)):
            if n % (tp * cp):
                raise ConfigError(
                    f"--cp-comm-type a2a needs {flag} {n} divisible by --tp x --cp = {tp * cp} "
                    f"(each cp rank takes whole heads); fix: --cp-comm-type p2p or another --cp"
                )


def check_moe_sizes(moe_ffn_hidden_size: int, shared_size, tp: int) -> None:
    """Each expert's (and the shared expert's) inner width splits over tp like the dense MLP's.
    Raises ConfigError naming the flag."""
    for flag, size in (
        ("--moe-ffn-hidden-size", moe_ffn_hidden_size),
        ("--moe-shared-expert-intermediate-size", shared_size),
    ):
        if size is not None and size % tp:
            raise ConfigError(f"{flag} {size} is not divisible by --tp {tp}; fix: choose a multiple of {tp}")


def is_moe_layer_of(moe_layer_freq, layer: int) -> bool:
    """Whether 0-based ``layer`` is an MoE layer under ``--moe-layer-freq`` (Megatron-LM's
    ``moe_layer_freq``): an integer N makes layers 0, N, 2N, ... MoE layers; a list holds one 0/1 per
    layer (1 = MoE; DeepSeek-V3's ``first_k_dense_replace`` k is k zeros, then ones). Call
    ``check_moe_layer_freq`` first."""
    if isinstance(moe_layer_freq, list):
        return bool(moe_layer_freq[layer])
    return layer % moe_layer_freq == 0


def check_moe_layer_freq(moe_layer_freq, num_layers: int) -> None:
    """``--moe-layer-freq`` is an integer N >= 1 or exactly ``num_layers`` entries of 0 or 1.
    Raises ConfigError naming the flag and the fix."""
    freq = moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != num_layers or any(f not in (0, 1) for f in freq):
            raise ConfigError(
                f"--moe-layer-freq lists {len(freq)} entries {freq[:8]}; fix: one 0/1 per layer "
                f"({num_layers} for --num-layers {num_layers}; 1 = MoE layer, 0 = dense), or one integer N"
            )
    elif not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
        raise ConfigError(f"--moe-layer-freq {freq!r} is not an integer >= 1; fix: N >= 1 (every N-th layer MoE)")


def layer_window(window_size, window_attn_skip_freq, layer_number: int) -> Optional[int]:
    """The sliding window W of 1-based layer ``layer_number``, or None for full causal attention.

    Megatron-LM's ``--window-size L,R`` (``TransformerConfig.window_size``, FlashAttention's
    ``window_size=(left, right)``) lets query i see keys j with ``i - L <= j <= i + R``; megazero's
    attention is causal, so R = 0 and L = -1 means an unbounded window. Transformers'
    ``sliding_window`` W (Mistral, Qwen2/3, gpt-oss: key j visible from query i iff
    ``i - W < j <= i``) is therefore ``W = L + 1``: a query sees itself and the L keys before it.
    ``--window-attn-skip-freq`` (Megatron-LM's ``is_layer_window_attention``): None = every layer
    windowed; ``[N]`` (its integer form) = layer n full when ``n % N == 0`` (every N-th, 1-based:
    N = 2 makes layers 2, 4, ... full, gpt-oss's alternation); a list with one 0/1 per layer
    (its list form) = layer n windowed when entry n-1 is 1. Returns None when ``window_size`` is
    None or L is -1. Call ``check_window`` first.
    """
    if not window_size or window_size[0] < 0:
        return None
    freq = window_attn_skip_freq
    if freq is not None:
        windowed = layer_number % freq[0] != 0 if len(freq) == 1 else bool(freq[layer_number - 1])
        if not windowed:
            return None
    return window_size[0] + 1


def check_window(window_size, window_attn_skip_freq, num_layers: int) -> None:
    """``--window-size`` is two integers ``L,0`` with L >= -1 (megazero's attention is causal: no
    key after the query), and ``--window-attn-skip-freq`` one integer N >= 1 or exactly
    ``num_layers`` entries of 0 or 1 (given only with a window). Raises ConfigError naming the flag
    and the fix."""
    if window_size is not None:
        if len(window_size) != 2 or window_size[1] != 0 or window_size[0] < -1:
            raise ConfigError(
                f"--window-size {','.join(map(str, window_size))} is not L,0 with L >= -1; fix: e.g. "
                "--window-size 4095,0 (each query sees itself and the 4095 keys before it; causal: right = 0)"
            )
    freq = window_attn_skip_freq
    if freq is None:
        return
    if window_size is None:
        raise ConfigError("--window-attn-skip-freq without --window-size has no effect; fix: give --window-size L,0")
    if len(freq) == 1 and freq[0] < 1:
        raise ConfigError(f"--window-attn-skip-freq {freq[0]} is below 1; fix: N >= 1 (every N-th layer full)")
    if len(freq) > 1 and (len(freq) != num_layers or any(f not in (0, 1) for f in freq)):
        raise ConfigError(
            f"--window-attn-skip-freq lists {len(freq)} entries; fix: one integer N, or one 0/1 per layer "
            f"({num_layers} for --num-layers {num_layers}; 1 = windowed, 0 = full)"
        )


def check_mla(
    *,
    rope: bool,
    bias: bool,
    softmax_type: str,
    window_size,
    qk_layernorm: bool,
    num_query_groups: Optional[int],
    qk_pos_emb_head_dim: int,
) -> None:
    """What multi-head latent attention (``--multi-latent-attention``, model/mla.py) runs with: rotary
    positions, no linear biases, an even RoPE part, the plain softmax, full causal attention, no
    QK-norm and no grouped queries (any context parallelism: the ring and the all-to-all take keys
    and values of different head sizes). Raises ConfigError naming the flag."""
    refusals = [
        (not rope, "--position-embedding-type learned_absolute", "--position-embedding-type rope"),
        (bias, "linear biases", "--disable-bias-linear (DeepSeek's attention has none)"),
        (softmax_type != "vanilla", f"--softmax-type {softmax_type}", "--softmax-type vanilla"),
        (window_size is not None, "--window-size", "drop --window-size (full causal attention only)"),
        (qk_layernorm, "--qk-layernorm", "drop --qk-layernorm (MLA normalises its latents instead)"),
        (num_query_groups is not None, "--group-query-attention", "drop it (every MLA head has its own k and v)"),
        (qk_pos_emb_head_dim % 2, f"--qk-pos-emb-head-dim {qk_pos_emb_head_dim}", "an even number"),
    ]
    for refused, what, fix in refusals:
        if refused:
            raise ConfigError(f"--multi-latent-attention with {what} is not supported; fix: {fix}")
