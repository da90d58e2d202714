"""Derivation: the settings a run leaves open, filled from the others (pure, no process group).

``finalize`` fills a parsed Config in place (data-parallel size, batch arithmetic, FFN width,
positions, LR iterations, schedule); ``bucket_sizes`` and ``overlap_param_gather`` resolve
two ZeRO settings for the optimizer and the planner. None of them raises: ``checks.validate``
judges the result.
"""
from __future__ import annotations

from megazero.config.schema import MOCK_VOCAB_SIZE, Config, show_flag
from megazero.config.shape import default_ffn_hidden_size


def finalize(cfg: Config, world_size: int) -> list[str]:
    """Fill derived settings in place; returns warnings. Never raises: validate() judges.

    dp = world / (tp x pp); FFN = 4 H (SwiGLU: int(8 H / 3 / 64) x 64); max positions = seq; decay iters = train iters;
    mock vocab = MOCK_VOCAB_SIZE; interleaved schedule when vp > 1 and no schedule was given;
    sequence parallelism off at tp 1 (Megatron does the same, with a warning). Batch (DeepSpeed's
    rule when global and accumulation are given and micro is not, else Megatron's):
    micro = global / (accumulation x dp), or accumulation = global / (micro x dp), or
    global = micro x accumulation x dp with accumulation 1 by default.
    """
    m, p, t, o, d = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.data
    warnings = []
    if m.ffn_hidden_size is None:  # Megatron-LM's rule: SwiGLU keeps the 4H MLP's parameter count
        m.ffn_hidden_size = default_ffn_hidden_size(m.hidden_size, m.swiglu)
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    o.lr_decay_iters = t.train_iters if o.lr_decay_iters is None else o.lr_decay_iters
    o.lr_warmup_iters = t.train_iters // 10 if o.lr_warmup_iters is None else o.lr_warmup_iters
    if t.mock_data:
        d.vocab_size = MOCK_VOCAB_SIZE if d.vocab_size is None else d.vocab_size
        if d.data_path:
            warnings.append("--mock-data is set: --data-path is ignored")
    if p.virtual_pipeline_size > 1 and "parallel.pipeline_schedule" not in cfg.sources:
        p.pipeline_schedule = "interleaved"
    if p.sequence_parallel and p.tp == 1:
        p.sequence_parallel = False
        warnings.append("--sequence-parallel does nothing with --tp 1; turned off")
    for knob in ("contiguous_gradients", "reduce_scatter", "allgather_partitions"):
        if not getattr(cfg.zero, knob):
            warnings.append(f"{show_flag(cfg, 'zero.' + knob)} = false is ignored: megazero always uses "
                            "contiguous gradient buffers, reduce-scatter and all-gather (same result)")
    if p.dp is None and p.tp >= 1 and p.pp >= 1 and world_size % (p.tp * p.pp) == 0:
        p.dp = world_size // (p.tp * p.pp)
    sizes = (p.dp, t.micro_batch_size, t.global_batch_size, t.gradient_accumulation_steps)
    if p.dp is not None and all(v is None or v >= 1 for v in sizes):
        _derive_batch(cfg)
    return warnings


def _derive_batch(cfg: Config) -> None:
    t, dp = cfg.train, cfg.parallel.dp
    total, accum = t.global_batch_size, t.gradient_accumulation_steps
    if total is not None and accum is not None and "train.micro_batch_size" not in cfg.sources \
            and total % (accum * dp) == 0:
        t.micro_batch_size = total // (accum * dp)
    if total is None:
        t.gradient_accumulation_steps = accum = accum or 1
        t.global_batch_size = t.micro_batch_size * accum * dp
    elif accum is None and total % (t.micro_batch_size * dp) == 0:
        t.gradient_accumulation_steps = total // (t.micro_batch_size * dp)


def bucket_sizes(cfg: Config) -> tuple[int, int]:
    """(reduce, all-gather) bucket elements: the flags, or hidden size squared when unset
    (DeepSpeed's "auto"; README, "Bucket sizes"). The optimizer and the planner both use it."""
    auto = cfg.model.hidden_size ** 2
    z = cfg.zero
    return int(z.reduce_bucket_size or auto), int(z.allgather_bucket_size or auto)


def overlap_param_gather(cfg: Config) -> bool:
    """--overlap-param-gather resolved: auto = on exactly at ZeRO stages 1 and 2."""
    z = cfg.zero
    return z.overlap_param_gather == "on" or (z.overlap_param_gather == "auto" and z.stage in (1, 2))
