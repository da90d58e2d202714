"""Derivation: the settings a run leaves open, filled from the others (pure, no process group).

``finalize`` fills a parsed Config in place (data-parallel size, batch arithmetic, FFN width,
positions, LR iterations, schedule); ``bucket_sizes`` and ``overlap_param_gather`` resolve
two ZeRO settings for the optimizer and the planner. None of them raises: ``checks.validate``
judges the result.

``unused_settings`` is the one pass over the settings that have no effect as configured:
every setting given (a flag or a DeepSpeed key, ``cfg.sources``) whose field's ``applies``
(``schema.Needs``) fails. ``finalize`` returns a warning for each; ``checks`` refuses those
whose Needs says ``refuse``. ``unused_message`` words both.
"""

from __future__ import annotations

from megazero.config.schema import MOCK_VOCAB_SIZE, Config, Needs, get_value, setting_named, settings, show_flag
from megazero.config.shape import default_ffn_hidden_size
from megazero.data_parallel.policy import stages_where
from megazero.topology import Topology

MIN_LR = 2e-4
"""--min-lr when not given and --lr is at least this (below it: --lr / 10)."""


def finalize(cfg: Config, world_size: int) -> list[str]:
    """Fill derived settings in place; returns warnings. Never raises: validate() judges.

    dp = world / (tp x cp x pp); FFN = 4 H (SwiGLU: int(8 H / 3 / 64) x 64); max positions = seq; decay iters = train
    iters; min lr = MIN_LR, or lr / 10 below it;
    mock vocab = MOCK_VOCAB_SIZE; interleaved schedule when vp > 1 and no schedule was given;
    sequence parallelism off at tp 1 (Megatron does the same, with a warning); ZeRO-3's prefetch
    bucket 0.9 H^2 and persistence threshold 10 H when unset or "auto" (the values the Hugging
    Face DeepSpeed integration documents for "auto", so a small model's knobs scale with it
    instead of DeepSpeed's absolute 5e7 and 1e5), and its reuse distance the prefetch bucket
    (DeepSpeed's absolute 1e9 keeps every layer of a smaller model gathered through the step). Batch (DeepSpeed's
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
    _derive_zero3_knobs(cfg)
    o.lr_decay_iters = t.train_iters if o.lr_decay_iters is None else o.lr_decay_iters
    if o.min_lr is None:  # 2e-4 unless --lr is below it (then a tenth of --lr)
        o.min_lr = MIN_LR if o.lr >= MIN_LR else o.lr / 10
    o.lr_warmup_iters = t.train_iters // 10 if o.lr_warmup_iters is None else o.lr_warmup_iters
    if cfg.post.mode == "sft":  # --post-train sft is --sft; --sft alone names the mode
        d.sft = True
    elif cfg.post.mode is None and d.sft:
        cfg.post.mode = "sft"
    if t.mock_data:
        d.vocab_size = MOCK_VOCAB_SIZE if d.vocab_size is None else d.vocab_size
        if d.data_path:
            warnings.append("--mock-data is set: --data-path is ignored")
    if p.virtual_pipeline_size > 1 and "parallel.pipeline_schedule" not in cfg.sources:
        p.pipeline_schedule = "interleaved"
    if p.pipeline_schedule == "zb-v" and "parallel.virtual_pipeline_size" not in cfg.sources:
        p.virtual_pipeline_size = 2  # ZB-V: two chunks per stage, in a V
    if p.sequence_parallel and p.tp == 1:
        p.sequence_parallel = False
        warnings.append("--sequence-parallel does nothing with --tp 1; turned off")
    for knob in ("contiguous_gradients", "reduce_scatter", "allgather_partitions"):
        if not getattr(cfg.zero, knob):
            warnings.append(
                f"{show_flag(cfg, 'zero.' + knob)} = false is ignored: megazero always uses "
                "contiguous gradient buffers, reduce-scatter and all-gather (same result)"
            )
    if p.dp is None and min(p.tp, p.pp, p.cp) >= 1 and world_size % (p.tp * p.cp * p.pp) == 0:
        p.dp = world_size // (p.tp * p.cp * p.pp)
    sizes = (p.dp, t.micro_batch_size, t.global_batch_size, t.gradient_accumulation_steps)
    if p.dp is not None and all(v is None or v >= 1 for v in sizes):
        _derive_batch(cfg)
    return warnings + [unused_message(cfg, name, need) for name, need in unused_settings(cfg) if not need.refuse]


def unused_settings(cfg: Config) -> list[tuple[str, Needs]]:
    """``(setting name, the first Needs that fails)`` for every setting given (``cfg.sources``)
    whose field's ``applies`` does not hold, in declaration order: settings that have no effect
    in this configuration (schema.py's ``Needs``)."""
    out = []
    for s in settings():
        needs = s.field.metadata.get("applies") or ()
        failed = next((n for n in needs if not n.holds(cfg)), None)
        if failed is not None and s.name in cfg.sources:
            out.append((s.name, failed))
    return out


def unused_message(cfg: Config, name: str, need: Needs) -> str:
    """One line naming the setting (its flag, or the JSON key and file), the condition it misses
    and, for a refusal, the fix: ``--zero3-max-live-parameters has no effect without --zero-stage
    3 (this run: --zero-stage 2); ignored`` / ``--save-interval has no effect without --save;
    fix: add --save DIR or drop it``."""
    chain, n = [], need
    while n is not None:
        chain.append(n)
        n = n.alt
    text = f"{show_flag(cfg, name)} has no effect " + " and ".join(_missed(cfg, n) for n in chain)
    if need.refuse:
        return f"{text}; fix: add {' or '.join(_condition(n) for n in chain)} or drop it"
    return f"{text}; ignored"


def _condition(n: Needs) -> str:
    """The condition ``n`` names: "--zero-stage 3", "--fp16", "--tp > 1", "--save DIR"."""
    s = setting_named(n.on)
    values = n.values or n.besides
    if n.wanted:
        return n.wanted
    if n.above is not None:
        return f"{s.flag} > {n.above:g}"
    if s.base is bool or values == (None,):
        return s.flag
    return f"{s.flag} {' or '.join(_text(v) for v in values)}"


def _text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _missed(cfg: Config, n: Needs) -> str:
    """How this run misses ``n``: "without --zero-stage 3 (this run: --zero-stage 2)",
    "with --mock-data", "at --tp 1", "with --lr-decay-style constant"."""
    s, value = setting_named(n.on), get_value(cfg, n.on)
    if n.above is not None:
        return f"at {s.flag} {value}"
    if s.base is bool:  # the flag sets the opposite of the default
        ok = set(n.values) if n.values else {True, False} - set(n.besides)
        return f"without {s.flag}" if (not s.default) in ok else f"with {s.flag}"
    if (n.values or n.besides) == (None,):
        return f"with {s.flag}" if n.values else f"without {s.flag}"
    if n.besides:
        return f"with {s.flag} {_text(value)}"
    src = cfg.sources.get(n.on, "")  # name the state only where it was given (or read from a file)
    where = "" if src.startswith("--") else f", {src}"
    state = f" (this run: {s.flag} {_text(value)}{where})" if src else ""
    return f"without {_condition(n)}{state}"


def _derive_batch(cfg: Config) -> None:
    t, dp = cfg.train, cfg.parallel.dp
    total, accum = t.global_batch_size, t.gradient_accumulation_steps
    if (
        total is not None
        and accum is not None
        and "train.micro_batch_size" not in cfg.sources
        and total % (accum * dp) == 0
    ):
        t.micro_batch_size = total // (accum * dp)
    if total is None:
        t.gradient_accumulation_steps = accum = accum or 1
        t.global_batch_size = t.micro_batch_size * accum * dp
    elif accum is None and total % (t.micro_batch_size * dp) == 0:
        t.gradient_accumulation_steps = total // (t.micro_batch_size * dp)


def _derive_zero3_knobs(cfg: Config) -> None:
    z, h = cfg.zero, cfg.model.hidden_size
    if z.zero3_prefetch_bucket_size is None:
        z.zero3_prefetch_bucket_size = int(0.9 * h * h)
    if z.zero3_param_persistence_threshold is None:
        z.zero3_param_persistence_threshold = 10 * h
    if z.zero3_max_reuse_distance is None:
        z.zero3_max_reuse_distance = z.zero3_prefetch_bucket_size


def bucket_sizes(cfg: Config) -> tuple[int, int]:
    """(reduce, all-gather) bucket elements: the flags, or hidden size squared when unset
    (DeepSpeed's "auto"; README, "Bucket sizes"). The optimizer and the planner both use it."""
    auto = cfg.model.hidden_size**2
    z = cfg.zero
    return int(z.reduce_bucket_size or auto), int(z.allgather_bucket_size or auto)


def overlap_param_gather(cfg: Config) -> bool:
    """--overlap-param-gather resolved: auto = on exactly where the ZeRO stage gathers the updated
    parameters after the step (stages 1 and 2: ``ShardingPolicy.gathers_after_step``)."""
    z = cfg.zero
    return z.overlap_param_gather == "on" or (
        z.overlap_param_gather == "auto" and z.stage in stages_where("gathers_after_step")
    )


def layout_topology(cfg: Config) -> Topology:
    """The rank layout of a finalized config: ``Topology(tp, pp, dp, cp)`` in the order
    tp-cp-dp-pp (megazero/topology.py) with the expert-parallel size carved out of dp x cp
    (an MoE model's ``--expert-model-parallel-size``) and the ZeRO shard size of hybrid sharding
    (``--zero-shard-size``) and the experts' tensor-parallel size (``--expert-tensor-parallel-size``,
    None = tp); one place, so no caller forgets a dimension."""
    p = cfg.parallel
    moe = cfg.model.num_experts is not None
    ep = p.expert_model_parallel_size if moe else 1
    etp = p.expert_tensor_parallel_size if moe else None
    return Topology(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=ep, zero_shard=cfg.zero.zero_shard_size, etp=etp)
