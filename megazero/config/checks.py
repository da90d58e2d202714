"""The rules a megazero Config must satisfy; each raises one ConfigError naming the flag and the fix.

Pure functions of the settings and the world size, so every rank runs them before any
process group exists (docs/design.md, contract 3). Where each kind of rule lives:

- one setting's range and choices: its field's metadata (schema.py), applied by
  ``check_value`` here and by ``model.config.GPTConfig.validate`` to the model's fields;
- model shapes under tp (heads, widths, positions, sequence parallelism, query groups,
  RoPE): ``shape.py``, applied here and by ``GPTConfig.validate``;
- layers over pipeline stages and chunks: ``megazero.pipeline.partition.validate_partition``;
- a setting given that has no effect as configured: its field's ``applies`` (schema.py's
  ``Needs``), judged in one pass (``derive.unused_settings``): a warning from ``finalize``,
  or refused here where its Needs says ``refuse``;
- flag combinations (recomputation, restarts, world size = tp x cp x pp x dp, batch
  arithmetic, schedules, precision, ZeRO and offload, output directories, logging,
  profiling, ``--from-hf``, fill-in-the-middle rates and tokens): here;
- the training data: data/ owns the ``--data-path`` blend, the corpus files and the
  ``--split`` rules (``data.gpt_dataset``, applied by ``megazero.training.build_data`` before
  launch); here only that a corpus (or --mock-data) and its tokenizer are given.
  ``validate(..., needs_data=False)`` leaves these out for tools that read no data.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any, Optional

from megazero.config.derive import unused_message, unused_settings
from megazero.config.schema import Config, ConfigError, Setting, get_value, settings, show_flag
from megazero.config.shape import (
    check_block,
    check_context_parallel,
    check_mla,
    check_moe_layer_freq,
    check_moe_sizes,
    check_rope_scaling,
    check_sizes,
    check_window,
    check_yarn_of,
)
from megazero.data_parallel.policy import POLICIES, stages_where
from megazero.moe.router import check_groups
from megazero.pipeline.partition import PartitionError, validate_partition


def check_value(setting: Setting, value: Any, label: Optional[str] = None) -> None:
    """``value`` inside ``setting``'s documented range and among its choices (the field's
    metadata in schema.py); None passes. ``label`` names it in the message (default: its flag).

    Raises ConfigError, e.g. "--hidden-dropout 1.0 is out of range; fix: use a value < 1".
    """
    meta, label = setting.field.metadata, label or setting.flag
    if meta["choices"] and value is not None and value not in meta["choices"]:
        raise ConfigError(f"{label} {value!r} is not one of {', '.join(meta['choices'])}")
    if value is None or setting.base not in (int, float):
        return
    if not math.isfinite(value):
        raise ConfigError(f"{label} {value} is not a finite number; fix: give a number")
    for op, bound, ok in (
        ("ge", ">=", lambda v, b: v >= b),
        ("gt", ">", lambda v, b: v > b),
        ("lt", "<", lambda v, b: v < b),
    ):
        if meta[op] is not None and not ok(value, meta[op]):
            raise ConfigError(f"{label} {value} is out of range; fix: use a value {bound} {meta[op]}")


def _check_ranges(cfg: Config, world_size: int) -> None:
    """Every number inside its documented range, every choice among its choices."""
    for s in settings():
        check_value(s, get_value(cfg, s.name), show_flag(cfg, s.name))


def _check_world(cfg: Config, world_size: int) -> None:
    """world size = tp x cp x pp x dp."""
    p = cfg.parallel
    cp = f" x --cp {p.cp}" if p.cp > 1 else ""
    mp = p.tp * p.cp * p.pp
    if p.dp is None:
        raise ConfigError(
            f"world size {world_size} is not divisible by --tp {p.tp}{cp} x --pp {p.pp}; fix: "
            f"launch a multiple of {mp} processes or change --tp/--pp{'/--cp' if cp else ''}"
        )
    if mp * p.dp != world_size:
        raise ConfigError(
            f"world size {world_size} != --tp {p.tp}{cp} x --pp {p.pp} x --dp {p.dp} = "
            f"{mp * p.dp}; fix: launch {mp * p.dp} processes or "
            "change --tp/--pp/--dp (leave --dp out to derive it)"
        )


def _check_model_shape(cfg: Config, world_size: int) -> None:
    """The sizes split over tp (shape.py, the rules GPTConfig.validate applies too)."""
    m, p = cfg.model, cfg.parallel
    check_sizes(
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings,
        tp=p.tp,
        sequence_parallel=p.sequence_parallel,
        swiglu=m.swiglu or m.quick_geglu,
    )
    check_context_parallel(
        seq_length=m.seq_length,
        cp=p.cp,
        tp=p.tp,
        sequence_parallel=p.sequence_parallel,
        comm_type=p.cp_comm_type,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
    )


def _check_context_parallel(cfg: Config, world_size: int) -> None:
    """What the cp attention does not do (dropout inside the ring, --compile of its layers), and
    packed documents need an EOD token: mock data has no tokenizer."""
    p, m = cfg.parallel, cfg.model
    d = cfg.data
    packing = d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss
    if m.softmax_type != "vanilla" and m.attention_dropout > 0:
        raise ConfigError(
            f"--attention-dropout {m.attention_dropout} with --softmax-type {m.softmax_type}: the sink "
            "attention has no dropout; fix: --attention-dropout 0"
        )
    if (p.cp > 1 or packing) and m.attention_dropout > 0:
        why = f"--cp {p.cp}" if p.cp > 1 else "packed-document flags"
        raise ConfigError(
            f"--attention-dropout {m.attention_dropout} with {why}: the context-parallel and "
            "document-masked attention has no dropout; fix: --attention-dropout 0 (LLaMA and most "
            "long-context recipes use none)"
        )
    if p.cp > 1 and cfg.train.compile:
        raise ConfigError(
            f"--compile with --cp {p.cp} is not supported (the K/V ring runs eagerly); fix: drop "
            "--compile or use --cp 1"
        )
    packed = [
        f
        for f, on in (
            ("--reset-attention-mask", cfg.data.reset_attention_mask),
            ("--reset-position-ids", cfg.data.reset_position_ids),
            ("--eod-mask-loss", cfg.data.eod_mask_loss),
        )
        if on
    ]
    if packed and cfg.train.mock_data:
        raise ConfigError(
            f"{packed[0]} needs the tokenizer's end-of-document token, and --mock-data has no "
            "tokenizer; fix: train on --data-path with --tokenizer-model, or drop " + " ".join(packed)
        )


def _check_unused_options(cfg: Config, world_size: int) -> None:
    """A setting given that has no effect here and whose ``Needs`` says ``refuse`` (schema.py):
    ignoring it would run something other than what the flags describe, so it is refused
    (``derive.unused_settings``, the one pass; the others are warnings from ``finalize``):
    a model-shape option of a block feature that is off (Megatron-LM's rule: --num-query-groups,
    --rotary-base, --rotary-percent) and a checkpoint option without --save (--save-interval,
    --keep-latest-checkpoints, --async-save: no checkpoint would be written)."""
    for name, need in unused_settings(cfg):
        if need.refuse:
            raise ConfigError(unused_message(cfg, name, need))


def _check_restarts(cfg: Config, world_size: int) -> None:
    """--max-restarts K > 0: torchrun restarts the group, which resumes from --load's ``latest``;
    that must be this run's own checkpoint, written during training (docs/design.md, contract
    4), else every restart trains again from where the run began."""
    t = cfg.train
    if t.max_restarts == 0:
        return
    same = t.save is not None and t.load is not None and os.path.realpath(t.load) == os.path.realpath(t.save)
    if t.save is None:
        why = "nothing is saved (no --save), so a restarted group trains again from iteration 0"
    elif not same:
        why = (
            f"a restarted group resumes from --load ({t.load or 'not given'}), not from this run's "
            f"checkpoints under --save {t.save}"
        )
    elif t.save_interval is None:
        why = (
            "without --save-interval this run saves only at the end, so a restarted group trains "
            "again from where it began"
        )
    else:
        return
    raise ConfigError(
        f"{show_flag(cfg, 'train.max_restarts')} {t.max_restarts} cannot resume this run after "
        f"a rank fails: {why}; fix: add --save DIR --load DIR (the same directory) and "
        "--save-interval N, or drop --max-restarts"
    )


def _check_block(cfg: Config, world_size: int) -> None:
    """The LLaMA-style block's sizes (shape.py, the rules GPTConfig.validate applies too)."""
    m = cfg.model
    check_block(
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        tp=cfg.parallel.tp,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        rotary_percent=m.rotary_percent,
        rope=m.position_embedding_type == "rope",
        kv_channels=m.kv_channels,
    )
    check_rope_scaling(m.rope_scaling_low_freq_factor, m.rope_scaling_high_freq_factor)
    check_yarn_of(m)
    check_window(m.window_size, m.window_attn_skip_freq, m.num_layers)
    if m.multi_latent_attention:
        check_mla(
            rope=m.position_embedding_type == "rope",
            bias=m.add_bias_linear,
            softmax_type=m.softmax_type,
            window_size=m.window_size,
            qk_layernorm=m.qk_layernorm,
            num_query_groups=m.num_query_groups if m.group_query_attention else None,
            qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        )


def _check_swiglu_width(cfg: Config, world_size: int) -> None:
    """SwiGLU's derived width is not 0 (a small --hidden-size); before the range checks."""
    m = cfg.model
    if m.swiglu and m.ffn_hidden_size == 0 and "model.ffn_hidden_size" not in cfg.sources:
        raise ConfigError(
            f"--swiglu derives --ffn-hidden-size 0 from --hidden-size {m.hidden_size} "
            "(int(8 H / 3 / 64) x 64); fix: give --ffn-hidden-size"
        )


def _check_moe(cfg: Config, world_size: int) -> None:
    """Mixture of Experts: top-k <= E (Megatron-LM's
    rule), the expert bias with sigmoid scores only, group-limited routing's sizes
    (``megazero.moe.router.check_groups``: the rule route() enforces), expert parallelism
    (``_check_expert_parallel``, carved out of dp x cp).
    --from-hf reads Mixtral / Qwen2-MoE folders (model/hf_moe.py)."""
    m, p = cfg.model, cfg.parallel
    if m.num_experts is None:
        return
    E = m.num_experts
    check_moe_sizes(m.moe_ffn_hidden_size or m.ffn_hidden_size, m.moe_shared_expert_intermediate_size, p.tp)
    check_moe_layer_freq(m.moe_layer_freq, m.num_layers)
    if m.moe_router_topk > E:
        raise ConfigError(f"--moe-router-topk {m.moe_router_topk} exceeds --num-experts {E}; fix: choose k <= {E}")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
            f"(this run: {m.moe_router_score_function}); fix: add --moe-router-score-function sigmoid"
        )
    if m.moe_router_num_groups is not None or m.moe_router_group_topk is not None:
        try:
            check_groups(E, m.moe_router_topk, m.moe_router_num_groups, m.moe_router_group_topk)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _check_expert_parallel(cfg)


def _check_expert_parallel(cfg: Config) -> None:
    """Expert parallelism (Megatron-LM's rules): EP divides E (each rank holds E/EP whole experts)
    and the dp x cp replica ranks it is carved out of; the expert-tensor-parallel size divides tp
    (the experts are sliced over etp of the tp ranks, docs/moe.md), and with etp < tp the routed
    experts carry no linear biases (their fc2 bias term is added after the tp reduction, on every
    token, which the tp / etp folding does not split) and there is no hybrid sharding."""
    m, p = cfg.model, cfg.parallel
    ep, replicas = p.expert_model_parallel_size, p.dp * p.cp
    if m.num_experts % ep:
        raise ConfigError(
            f"--expert-model-parallel-size {ep} does not divide --num-experts {m.num_experts}; "
            f"fix: choose a divisor of {m.num_experts}"
        )
    if replicas % ep:
        raise ConfigError(
            f"--expert-model-parallel-size {ep} does not divide the data x context parallel size "
            f"{p.dp} x {p.cp} = {replicas}; fix: choose a divisor of {replicas}"
        )
    etp = p.expert_tensor_parallel_size
    if etp is None or etp == p.tp:
        return
    if p.tp % etp:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp} does not divide --tp {p.tp}; "
            f"fix: choose a divisor of {p.tp} (or drop it: experts sliced over all tp ranks)"
        )
    if m.add_bias_linear:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp} below --tp {p.tp} with linear biases on the experts is not "
            f"supported; fix: add --disable-bias-linear or set --expert-tensor-parallel-size {p.tp}"
        )
    if cfg.zero.zero_shard_size is not None and cfg.zero.zero_shard_size < replicas:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp} below --tp {p.tp} with --zero-shard-size "
            f"{cfg.zero.zero_shard_size} is not supported (the experts' folded expert-data-parallel "
            f"group has no hybrid shard groups); fix: drop one of them"
        )


def _check_recompute(cfg: Config, world_size: int) -> None:
    """Megatron-LM's rules: full needs a method; a method belongs to full only."""
    m = cfg.model
    if m.recompute_granularity == "full" and m.recompute_method is None:
        raise ConfigError(
            f"{show_flag(cfg, 'model.recompute_granularity')} full needs --recompute-method; "
            "fix: add --recompute-method uniform (or block)"
        )
    if m.recompute_method is not None and m.recompute_granularity != "full":
        raise ConfigError(
            f"{show_flag(cfg, 'model.recompute_method')} {m.recompute_method} applies to "
            "--recompute-granularity full only; fix: add --recompute-granularity full "
            "or drop --recompute-method"
        )


def _check_batch(cfg: Config, world_size: int) -> None:
    """global batch = micro x accumulation x dp (covers DeepSpeed's train_batch_size)."""
    t, dp = cfg.train, cfg.parallel.dp
    micro, accum, total = t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size
    if accum is None:
        raise ConfigError(
            f"{show_flag(cfg, 'train.global_batch_size')} {total} is not divisible by "
            f"--micro-batch-size {micro} x data-parallel size {dp} = {micro * dp}; fix: "
            f"use a multiple of {micro * dp} or change --micro-batch-size"
        )
    if total != micro * accum * dp:
        raise ConfigError(
            f"{show_flag(cfg, 'train.global_batch_size')} {total} != {show_flag(cfg, 'train.micro_batch_size')} "
            f"{micro} x {show_flag(cfg, 'train.gradient_accumulation_steps')} {accum} x data-parallel size {dp}"
            f" = {micro * accum * dp}; fix: make them agree, or give only two so the third is derived"
        )


def _check_pipeline(cfg: Config, world_size: int) -> None:
    """Schedule fits pp and vp; layers partition over the stages (megazero/pipeline/partition.py)."""
    p, m = cfg.parallel, cfg.model
    sched = p.pipeline_schedule
    if sched in ("zb-h1", "zb-v"):
        _check_zero_bubble(cfg)
    try:
        validate_partition(m.num_layers, p.pp, p.virtual_pipeline_size, p.pipeline_layer_split)
    except PartitionError as e:
        raise ConfigError(str(e)) from None
    if sched == "none" and p.pp > 1:
        raise ConfigError(f"--pipeline-schedule none cannot run --pp {p.pp}; fix: use 1f1b or gpipe")
    if p.virtual_pipeline_size > 1 and sched not in ("interleaved", "zb-v"):
        raise ConfigError(
            f"--virtual-pipeline-size {p.virtual_pipeline_size} needs --pipeline-schedule "
            f"interleaved, got {sched}; fix: drop --pipeline-schedule"
        )
    if sched == "interleaved":
        if p.pp < 2 or p.virtual_pipeline_size < 2:
            raise ConfigError(
                f"--pipeline-schedule interleaved needs --pp >= 2 and --virtual-pipeline-size"
                f" >= 2 (got --pp {p.pp}, --virtual-pipeline-size {p.virtual_pipeline_size}); "
                "fix: raise them or use --pipeline-schedule 1f1b"
            )
        if cfg.train.gradient_accumulation_steps % p.pp:
            raise ConfigError(
                f"--pipeline-schedule interleaved needs micro-batches per step "
                f"(--gradient-accumulation-steps {cfg.train.gradient_accumulation_steps}) "
                f"divisible by --pp {p.pp}; fix: adjust --global-batch-size or "
                "--gradient-accumulation-steps"
            )


def _check_zero_bubble(cfg: Config) -> None:
    """zb-h1 / zb-v (Qi et al. 2024): pipelined (pp >= 2); zb-v's V of 2 x pp equal chunks."""
    p, m, sched = cfg.parallel, cfg.model, cfg.parallel.pipeline_schedule
    if p.pp < 2:
        raise ConfigError(
            f"--pipeline-schedule {sched} needs --pp >= 2 (got --pp {p.pp}); fix: raise --pp "
            "or use --pipeline-schedule 1f1b"
        )
    if sched == "zb-v":
        if p.virtual_pipeline_size != 2:
            raise ConfigError(
                f"--pipeline-schedule zb-v runs 2 model chunks per stage, got "
                f"--virtual-pipeline-size {p.virtual_pipeline_size}; fix: drop --virtual-pipeline-size"
            )
        if m.num_layers % (2 * p.pp):
            raise ConfigError(
                f"--pipeline-schedule zb-v needs --num-layers ({m.num_layers}) divisible by 2 x --pp "
                f"= {2 * p.pp} (two chunks per stage); fix: change --num-layers or --pp"
            )
        if p.pipeline_layer_split is not None:
            raise ConfigError(
                "--pipeline-layer-split cannot be combined with --pipeline-schedule zb-v; "
                "fix: drop --pipeline-layer-split"
            )


def _check_mtp(cfg: Config, world_size: int) -> None:
    """Multi-token prediction (model/mtp.py): fewer depths than tokens in a sequence; a language
    model's pretraining or SFT loss (no preference / RL mode); not under a zero-bubble schedule,
    whose split backward the MTP loss's gradient injection is not built for."""
    m, p, post = cfg.model, cfg.parallel, cfg.post
    D = m.mtp_num_layers
    if D == 0:
        return
    if D >= m.seq_length:
        raise ConfigError(
            f"--mtp-num-layers {D} with --seq-length {m.seq_length}: depth D predicts the token D+1 ahead, so "
            f"no position of the sequence would have a target; fix: --mtp-num-layers {max(1, m.seq_length - 1)} or less"
        )
    if post.mode in ("dpo", "rm", "grpo", "ppo"):
        raise ConfigError(
            f"--mtp-num-layers {D} with --post-train {post.mode}: multi-token prediction trains a language "
            "model's next tokens; fix: drop --mtp-num-layers"
        )
    if p.pipeline_schedule in ("zb-h1", "zb-v"):
        raise ConfigError(
            f"--mtp-num-layers {D} with --pipeline-schedule {p.pipeline_schedule}: the MTP loss is not built for "
            "the split backward of a zero-bubble schedule; fix: --pipeline-schedule 1f1b (or interleaved)"
        )


def _check_optim_precision(cfg: Config, world_size: int) -> None:
    """min lr <= lr; a WSD annealing phase that fits; one of fp16/bf16; ZeRO stage 0-2 (3 refused)."""
    o, pr, z = cfg.optim, cfg.precision, cfg.zero
    if o.min_lr > o.lr:
        raise ConfigError(
            f"{show_flag(cfg, 'optim.min_lr')} {o.min_lr} is above --lr {o.lr}; fix: set --min-lr <= --lr"
        )
    if o.lr_decay_style != "constant" and o.lr_decay_iters <= o.lr_warmup_iters:
        raise ConfigError(
            f"{show_flag(cfg, 'optim.lr_decay_iters')} {o.lr_decay_iters} must be larger than "
            f"{show_flag(cfg, 'optim.lr_warmup_iters')} {o.lr_warmup_iters} for "
            f"--lr-decay-style {o.lr_decay_style}; fix: raise --lr-decay-iters (or "
            "--train-iters, its default), lower --lr-warmup-iters, or use "
            "--lr-decay-style constant"
        )
    if o.lr_decay_style == "WSD" and not (
        o.lr_wsd_decay_iters is not None and o.lr_wsd_decay_iters <= o.lr_decay_iters - o.lr_warmup_iters
    ):
        raise ConfigError(
            f"--lr-decay-style WSD needs {show_flag(cfg, 'optim.lr_wsd_decay_iters')} between 1 and "
            f"--lr-decay-iters {o.lr_decay_iters} - --lr-warmup-iters {o.lr_warmup_iters}, got "
            f"{o.lr_wsd_decay_iters}; fix: give --lr-wsd-decay-iters in that range"
        )
    if pr.fp16 and pr.bf16:
        raise ConfigError(
            f"{show_flag(cfg, 'precision.fp16')} and {show_flag(cfg, 'precision.bf16')} are both on; fix: choose one"
        )
    if z.stage not in POLICIES:
        raise ConfigError(
            f"{show_flag(cfg, 'zero.stage')} {z.stage} is out of range; fix: use 0 "
            "(replicated), 1 (optimizer states sharded), 2 (and gradients) or 3 "
            "(and parameters)"
        )


def _check_fp8(cfg: Config, world_size: int) -> None:
    """FP8 GEMMs (megazero/ops/fp8.py) where their scales are computed over the logical tensor:
    not under context parallelism (the weight gradient's token contraction would be split over cp,
    zigzag-ordered), nor with the zero-bubble schedules (their split backward runs the plain GEMMs),
    nor for experts under tp > 1 (the shared expert sliced over tp, the routed ones over
    --expert-tensor-parallel-size ranks or on a share of the tokens: their amax groups are not
    wired). Expert parallelism is allowed: the dispatchers run an FP8 expert once per source
    micro-batch (megazero/moe/dispatch.py, ``run_by_source``), as at EP 1."""
    pr, p, m = cfg.precision, cfg.parallel, cfg.model
    if pr.fp8_format is None:
        return
    fmt = show_flag(cfg, "precision.fp8_format")
    if p.cp > 1:
        raise ConfigError(f"{fmt} {pr.fp8_format} with --cp {p.cp} is not supported; fix: use --cp 1 or drop {fmt}")
    if p.pipeline_schedule in ("zb-h1", "zb-v"):
        raise ConfigError(
            f"{fmt} with --pipeline-schedule {p.pipeline_schedule} is not supported (its split "
            f"backward runs plain GEMMs); fix: use 1f1b, gpipe or interleaved"
        )
    if m.num_experts is not None and p.tp > 1:
        etp = p.tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
        raise ConfigError(
            f"{fmt} with experts under --tp {p.tp} (--expert-tensor-parallel-size {etp}) is not supported; "
            "fix: use --tp 1 with FP8 experts (expert parallelism, --expert-model-parallel-size, is supported)"
        )
    if pr.fp8_recipe not in ("blockwise", "mxfp8"):
        return
    tile = pr.fp8_block if pr.fp8_recipe == "blockwise" else 32  # megazero.ops.fp8.MX_BLOCK
    for name, size in (("--hidden-size", m.hidden_size), ("--ffn-hidden-size", m.ffn_hidden_size)):
        if size % (tile * p.tp):
            raise ConfigError(
                f"--fp8-recipe {pr.fp8_recipe}: {name} {size} / --tp {p.tp} is not a multiple of the {tile}-element "
                f"FP8 block; fix: choose sizes that are multiples of {tile * p.tp}"
                + (" or a smaller --fp8-block" if pr.fp8_recipe == "blockwise" else " or --fp8-recipe blockwise")
            )


def _check_fp8_param_gather(cfg: Config, world_size: int) -> None:
    """--fp8-param-gather (megazero/data_parallel/zero3_fp8.py) needs FP8 GEMMs with the tensorwise
    recipe (one scale per weight, the only one wired) and ZeRO-3's parameter shards in device memory."""
    pr, z = cfg.precision, cfg.zero
    if not pr.fp8_param_gather:
        return
    flag = show_flag(cfg, "precision.fp8_param_gather")
    if pr.fp8_format is None:
        raise ConfigError(f"{flag} needs FP8 GEMMs; fix: add --fp8-format e4m3|hybrid or drop {flag}")
    if pr.fp8_recipe != "tensorwise":
        raise ConfigError(
            f"{flag} with --fp8-recipe {pr.fp8_recipe} is not supported (tensorwise scales only); "
            f"fix: use --fp8-recipe tensorwise or drop {flag}"
        )
    if z.stage not in stages_where("shards_params"):
        raise ConfigError(
            f"{flag} needs ZeRO-3 parameter shards (got {show_flag(cfg, 'zero.stage')} {z.stage}); "
            f"fix: add --zero-stage 3 or drop {flag}"
        )
    if z.offload_param != "none":
        raise ConfigError(
            f"{flag} with {show_flag(cfg, 'zero.offload_param')} {z.offload_param} is not supported; "
            f"fix: drop one of them"
        )


def _check_offload(cfg: Config, world_size: int) -> None:
    """--offload-optimizer cpu/nvme needs a sharded stage (1-3, as DeepSpeed), CPU Adam kernels
    and --optimizer adam (nvme also --offload-nvme-path);
    --offload-param cpu/nvme needs ZeRO-3 parameter shards (refused at stages 0-2) and the
    optimizer offloaded too (cpu or nvme: the host shards are updated where they live); nvme
    also --offload-nvme-path."""
    z = cfg.zero
    off = z.offload_optimizer
    if off != "none" and z.stage not in stages_where("shards_optimizer"):
        raise ConfigError(
            f"{show_flag(cfg, 'zero.offload_optimizer')} {off} needs a ZeRO stage of 1 or more "
            f"(got {show_flag(cfg, 'zero.stage')} 0); fix: add --zero-stage 1 or 2"
        )
    if off != "none" and cfg.optim.optimizer == "muon":
        raise ConfigError(
            f"{show_flag(cfg, 'optim.optimizer')} muon runs on the device (Newton-Schulz on whole "
            f"matrices); {show_flag(cfg, 'zero.offload_optimizer')} {off} runs Adam on the host; "
            "fix: drop --offload-optimizer or use --optimizer adam"
        )
    if off != "none" and cfg.optim.kernels == "apex":
        raise ConfigError(
            f"{show_flag(cfg, 'optim.kernels')} apex needs CUDA but "
            f"{show_flag(cfg, 'zero.offload_optimizer')} {off} runs Adam on the host; fix: use "
            "--kernels auto or torch"
        )
    if off == "nvme" and not z.offload_nvme_path:
        raise ConfigError(
            f"{show_flag(cfg, 'zero.offload_optimizer')} nvme needs a directory for the swap "
            "files; fix: add --offload-nvme-path DIR (DeepSpeed: offload_optimizer.nvme_path)"
        )
    if z.overlap_param_gather == "on" and z.stage not in stages_where("gathers_after_step"):
        raise ConfigError(
            f"{show_flag(cfg, 'zero.overlap_param_gather')} on needs --zero-stage 1 or 2 (got "
            f"{z.stage}: stage 0 updates the parameters in place, stage 3 gathers them "
            "before each forward); fix: use --zero-stage 1 or 2, or --overlap-param-gather auto"
        )
    par = z.offload_param
    where = "host memory" if par == "cpu" else "NVMe swap files"
    if par != "none" and z.stage not in stages_where("shards_params"):
        raise ConfigError(
            f"{show_flag(cfg, 'zero.offload_param')} {par} keeps ZeRO-3 parameter shards in {where} "
            f"and needs {show_flag(cfg, 'zero.stage')} 3 (got {z.stage}); fix: add "
            "--zero-stage 3, or remove it (--offload-optimizer cpu offloads the optimizer states)"
        )
    if par != "none" and z.offload_optimizer == "none":
        raise ConfigError(
            f"{show_flag(cfg, 'zero.offload_param')} {par} needs the optimizer on the host too "
            "(it updates the offloaded shards where they live); fix: add --offload-optimizer cpu"
        )
    if par == "nvme" and not z.offload_nvme_path:
        raise ConfigError(
            f"{show_flag(cfg, 'zero.offload_param')} nvme needs a directory for the swap files; "
            "fix: add --offload-nvme-path DIR (DeepSpeed: offload_param.nvme_path)"
        )


def _check_qk_clip(cfg: Config, world_size: int) -> None:
    """--qk-clip scales the query and key rows of a QKV weight from the max logits of the
    plain attention (model/qk_clip.py): not under context parallelism (each cp rank sees a
    part of the logits), QK-norm (q and k renormalised: scaling their weights changes no
    logit) or latent attention (its rows are not per-head q and k)."""
    if not cfg.optim.qk_clip:
        return
    m, flag = cfg.model, show_flag(cfg, "optim.qk_clip")
    for on, name, fix in (
        (cfg.parallel.cp > 1, "parallel.cp", "--context-parallel-size 1"),
        (m.qk_layernorm, "model.qk_layernorm", "drop --qk-layernorm"),
        (m.multi_latent_attention, "model.multi_latent_attention", "drop --multi-latent-attention"),
    ):
        if on:
            raise ConfigError(f"{flag} does not run with {show_flag(cfg, name)}; fix: {fix} or drop --qk-clip")


def _check_hybrid_shard(cfg: Config, world_size: int) -> None:
    """--zero-shard-size S (hybrid sharding): S divides dp x cp, needs a sharded stage (1-3), and
    with expert parallelism is a multiple of EP (expert state shards over the S / EP
    expert-data-parallel ranks inside each shard group, megazero/topology.py)."""
    z, p = cfg.zero, cfg.parallel
    s = z.zero_shard_size
    if s is None:
        return
    flag, replicas = show_flag(cfg, "zero.zero_shard_size"), p.dp * p.cp
    if replicas % s:
        raise ConfigError(
            f"{flag} {s} does not divide the data x context parallel size {p.dp} x {p.cp} = "
            f"{replicas}; fix: choose a divisor of {replicas}"
        )
    if z.stage not in stages_where("shards_optimizer"):
        raise ConfigError(
            f"{flag} {s} needs a ZeRO stage of 1 or more (got {show_flag(cfg, 'zero.stage')} 0: "
            "nothing is sharded); fix: add --zero-stage 1, 2 or 3, or drop it"
        )
    ep = p.expert_model_parallel_size if cfg.model.num_experts is not None else 1
    if s % ep:
        fits = [d for d in range(ep, replicas + 1, ep) if replicas % d == 0]
        raise ConfigError(
            f"{flag} {s} is not a multiple of --expert-model-parallel-size {ep} (expert state shards "
            f"over the S / EP expert-data-parallel ranks of each shard group); fix: choose one of "
            f"{', '.join(map(str, fits))} (a multiple of {ep} dividing {replicas})"
        )


def _check_outputs(cfg: Config, world_size: int) -> None:
    """Output directories are directories (or can become one); --load names an existing one."""
    t = cfg.train
    for flag, path in (("--save", t.save), ("--run-dir", cfg.log.run_dir)):
        if path is None:
            continue
        probe = path
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe.rstrip("/"))
        if probe and not os.path.isdir(probe):
            raise ConfigError(f"{flag} {path}: {probe} is a file, not a directory; fix: choose another path")
    if t.load is not None and not os.path.isdir(t.load) and t.load != t.save:
        raise ConfigError(
            f"--load {t.load}: no such directory; fix: correct the path (with --save DIR "
            "--load DIR the same new directory starts a fresh, restartable run)"
        )
    same = t.load is not None and t.save is not None and os.path.realpath(t.load) == os.path.realpath(t.save)
    taken = (
        t.save is not None
        and os.path.isdir(t.save)
        and any(n == "latest" or (n.startswith("iter_") and n[5:12].isdigit()) for n in os.listdir(t.save))
    )
    if taken and not same:
        # A fresh run would count iterations from 0 again and replace that run's checkpoints.
        raise ConfigError(
            f"--save {t.save} already holds the checkpoints of another run; fix: add --load "
            f"{t.save} to continue it, or choose an empty --save directory"
        )


def _check_data(cfg: Config, world_size: int) -> None:
    """A training corpus is given (--data-path, unless --mock-data) with its tokenizer file.
    The blend, the split and the corpus files are data/'s rules (``data.gpt_dataset``), checked
    by ``megazero.training.build_data`` before launch."""
    d = cfg.data
    if cfg.train.mock_data:
        return
    if not d.data_path:
        raise ConfigError(
            "no training data: --data-path is missing; fix: give --data-path PREFIX "
            "(PREFIX.bin/.idx written by data/preprocess.py) or --mock-data"
        )
    if d.tokenizer_model is None:
        raise ConfigError(
            "--tokenizer-model is missing; --data-path needs the sentencepiece model the "
            "data was tokenized with; fix: give --tokenizer-model PATH"
        )
    hf_folder = d.tokenizer_type == "HuggingFaceTokenizer" and os.path.isfile(
        os.path.join(d.tokenizer_model, "tokenizer.json")
    )
    if not (os.path.isfile(d.tokenizer_model) or hf_folder):
        raise ConfigError(f"--tokenizer-model {d.tokenizer_model} not found; fix: correct the path")


def _check_fim(cfg: Config, world_size: int) -> None:
    """Fill-in-the-middle: rates are probabilities (at most 1); --fim-tokens names four distinct
    tokens, none of them --fim-split-sample; not with --sft. That the tokens exist is data/'s rule
    (``data.tokenizer.add_fim_sentinels``, applied by ``megazero.training.build_data`` before launch)."""
    d = cfg.data
    for name in ("data.fim_rate", "data.fim_spm_rate", "data.fim_fragment_rate"):
        value = get_value(cfg, name)
        if value is not None and value > 1:
            raise ConfigError(f"{show_flag(cfg, name)} {value} is out of range; fix: use a probability in [0, 1]")
    if d.fim_tokens is not None and (len(d.fim_tokens) != 4 or len(set(d.fim_tokens)) != 4):
        raise ConfigError(
            f"--fim-tokens {' '.join(d.fim_tokens)}: need four distinct tokens (prefix middle suffix "
            "pad); fix: e.g. --fim-tokens '<fim_prefix>' '<fim_middle>' '<fim_suffix>' '<fim_pad>'"
        )
    if d.fim_tokens is not None and d.fim_split_sample in d.fim_tokens:
        raise ConfigError(
            f"--fim-split-sample {d.fim_split_sample!r} is also one of --fim-tokens; fix: split at another token"
        )
    if d.fim_rate > 0 and d.sft:  # FIM rewrites plain token samples; an SFT sample's mask would not follow
        raise ConfigError(
            f"--fim-rate {d.fim_rate} with --sft: fill-in-the-middle rewrites pre-training samples, "
            "not supervised fine-tuning records; fix: drop one of them"
        )


def _check_post_train(cfg: Config, world_size: int) -> None:
    """Post-training: no dropout unless --post-train-allow-dropout (reference and policy
    log-probabilities must differ by the update alone; TRL #2042 and DeepSpeed-Chat's PPO met
    it); --post-train dpo and rm read preference pairs (python -m data.preference: not --sft, --mock-data,
    fill-in-the-middle or --eod-mask-loss) with both sequences of a pair in one micro-batch (even
    --micro-batch-size)."""
    post, d, t = cfg.post, cfg.data, cfg.train
    if post.mode is None:
        return
    mode = f"--post-train {post.mode}" if "post.mode" in cfg.sources else "--sft"
    dropout = [(n, get_value(cfg, n)) for n in ("model.hidden_dropout", "model.attention_dropout")]
    on = [f"{show_flag(cfg, n)} {v}" for n, v in dropout if v > 0]
    if on and not post.allow_dropout:
        raise ConfigError(
            f"{' and '.join(on)} with {mode}: dropout makes the policy's log-probabilities differ from the "
            "reference's by noise; fix: set them to 0, or add --post-train-allow-dropout"
        )
    if post.mode in ("grpo", "ppo"):
        _check_rl(cfg, world_size)
        return
    if post.mode not in ("dpo", "rm"):
        return
    if d.sft and "data.sft" in cfg.sources:
        raise ConfigError(f"--sft with {mode}: choose one mode; fix: drop --sft")
    if t.mock_data:
        raise ConfigError(
            f"{mode} with --mock-data: preference training needs pairs; fix: give --data-path "
            "PREFIX of python -m data.preference (PREFIX_pairs.npz) and its --tokenizer-model"
        )
    if d.fim_rate > 0 or d.eod_mask_loss:
        flag = "--fim-rate" if d.fim_rate > 0 else "--eod-mask-loss"
        raise ConfigError(f"{flag} with {mode}: a pair's loss mask marks its response; fix: drop {flag}")
    if post.mode == "rm" and t.eval_harness_tasks:
        raise ConfigError(
            "--eval-harness-tasks with --post-train rm: a reward model has no language-model head in use; "
            "fix: drop --eval-harness-tasks"
        )
    mbs = t.micro_batch_size
    if mbs is not None and mbs % 2:
        raise ConfigError(
            f"--micro-batch-size {mbs} with {mode}: a pair's chosen and rejected sequences share a "
            f"micro-batch, so it must be even; fix: --micro-batch-size {mbs + 1}"
        )


def _check_rl(cfg: Config, world_size: int) -> None:
    """--post-train grpo / ppo: prompts of python -m data.prompts (not --mock-data, --sft, FIM,
    --eod-mask-loss or label smoothing: the per-token log-probabilities are the sampler's), a
    rollout that cuts into whole optimizer steps (P x G a multiple of --global-batch-size), a
    sequence long enough for a response, top-p in (0, 1], a dense block (no MoE); grpo: groups of
    at least 2; ppo: no sequence parallelism (the critic's per-token values), gamma and lambda
    in [0, 1]."""
    post, d, t, m = cfg.post, cfg.data, cfg.train, cfg.model
    mode = f"--post-train {post.mode}"
    if post.mode == "grpo" and post.grpo_group_size < 2:
        raise ConfigError(
            f"--grpo-group-size {post.grpo_group_size} with --post-train grpo: the advantage compares a response "
            "with its group; fix: --grpo-group-size 2 or more"
        )
    if post.mode == "ppo":
        if cfg.parallel.sequence_parallel:
            raise ConfigError(
                "--sequence-parallel with --post-train ppo: the critic's per-token values under sequence "
                "parallelism are not built; fix: drop --sequence-parallel"
            )
        if post.ptx_coef > 0 and not post.ptx_data_path:
            raise ConfigError(
                f"--ptx-coef {post.ptx_coef} without --ptx-data-path: the pretraining loss needs its data; fix: "
                "give --ptx-data-path PREFIX (python -m data.preprocess) or drop --ptx-coef"
            )
        for flag, v in (("--gamma", post.gamma), ("--lam", post.lam)):
            if v > 1:
                raise ConfigError(f"{flag} {v}: must be in [0, 1]; fix: {flag} 1")
    if t.mock_data:
        raise ConfigError(
            f"{mode} with --mock-data: reinforcement learning samples responses to prompts; fix: give "
            "--data-path PREFIX of python -m data.prompts (PREFIX_prompts.npz) and its --tokenizer-model"
        )
    for flag, on in (
        ("--sft", d.sft and "data.sft" in cfg.sources),
        ("--fim-rate", d.fim_rate > 0),
        ("--eod-mask-loss", d.eod_mask_loss),
        ("--label-smoothing", m.label_smoothing > 0),
    ):
        if on:
            raise ConfigError(
                f"{flag} with {mode}: the loss is on the sampled responses' own log-probabilities; fix: drop {flag}"
            )
    if m.num_experts is not None:
        raise ConfigError(
            f"--num-experts with {mode}: the rollout decoder runs dense blocks only; fix: drop "
            "--num-experts (MoE rollouts are not built yet)"
        )
    if not post.top_p <= 1:
        raise ConfigError(f"--top-p {post.top_p}: must be in (0, 1]; fix: --top-p 1 keeps every token")

    rows = post.grpo_prompts_per_step * post.grpo_group_size
    gbs = t.global_batch_size
    if gbs is not None and rows % gbs:
        raise ConfigError(
            f"--grpo-prompts-per-step {post.grpo_prompts_per_step} x --grpo-group-size {post.grpo_group_size} = "
            f"{rows} responses per rollout is not a multiple of --global-batch-size {gbs} (sequences per "
            f"optimizer step); fix: --global-batch-size {rows}"
        )
    if m.seq_length is not None and post.max_new_tokens >= m.seq_length:
        raise ConfigError(
            f"--max-new-tokens {post.max_new_tokens} leaves no room for a prompt in --seq-length "
            f"{m.seq_length}; fix: --seq-length {post.max_new_tokens + 64} or a smaller --max-new-tokens"
        )


def _check_logging(cfg: Config, world_size: int) -> None:
    """--wandb-project needs the optional wandb package (pyproject extra ``wandb``)."""
    if cfg.log.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"--wandb-project {cfg.log.wandb_project} needs the wandb package, which is not "
            "installed; fix: pip install wandb (or pip install -e .[wandb]), or drop --wandb-project"
        )


def _check_profile(cfg: Config, world_size: int) -> None:
    """--profile: a non-empty step window and ranks that exist."""
    g = cfg.log
    if not g.profile:
        return
    if g.profile_step_end <= g.profile_step_start:
        raise ConfigError(
            f"--profile-step-end {g.profile_step_end} must be above --profile-step-start "
            f"{g.profile_step_start}; fix: profile at least one step"
        )
    for r in g.profile_ranks:
        if not r.isdigit() or int(r) >= world_size:
            raise ConfigError(
                f"--profile-ranks {r} is not a rank of this run (0 to {world_size - 1}); "
                "fix: give global ranks below the world size"
            )


def _check_from_hf(cfg: Config, world_size: int) -> None:
    """--from-hf names a folder with config.json and model.safetensors, or the sharded
    model.safetensors.index.json (whose shards model/hf_folder.py checks)."""
    path = cfg.train.from_hf
    if path is None:
        return
    fix = (
        "fix: give a folder written by python -m scripts.convert_checkpoint --to-hf "
        "(or save_pretrained with safetensors)"
    )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--from-hf {path}: config.json not found; {fix}")
    if not any(os.path.isfile(os.path.join(path, n)) for n in ("model.safetensors", "model.safetensors.index.json")):
        raise ConfigError(f"--from-hf {path}: model.safetensors not found (nor model.safetensors.index.json); {fix}")


_CHECKS = (
    _check_outputs,
    _check_fp8,
    _check_fp8_param_gather,
    _check_logging,
    _check_profile,
    _check_from_hf,
    _check_swiglu_width,
    _check_ranges,
    _check_fim,
    _check_world,
    _check_model_shape,
    _check_context_parallel,
    _check_unused_options,
    _check_restarts,
    _check_block,
    _check_recompute,
    _check_moe,
    _check_batch,
    _check_pipeline,
    _check_optim_precision,
    _check_offload,
    _check_qk_clip,
    _check_hybrid_shard,
    _check_post_train,
    _check_mtp,
)


def validate(cfg: Config, world_size: int, *, needs_data: bool = True) -> None:
    """Run every check (after finalize); raises ConfigError naming the flag and the fix.

    ``needs_data=False`` leaves out the training data's checks (``--data-path``, ``--split``,
    ``--tokenizer-model``): for tools that read no data, such as scripts/plan.py.
    """
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1 (WORLD_SIZE of the launcher)")
    for check in _CHECKS + ((_check_data,) if needs_data else ()):
        check(cfg, world_size)
