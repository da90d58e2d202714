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
