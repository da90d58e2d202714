"""A DeepSpeed-style JSON file as a source of megazero's one config (docs/design.md, contract 5).

Keys read (DeepSpeed's "Configuration JSON" page): ``zero_optimization`` (stage, bucket
sizes, overlap_comm, contiguous_gradients, reduce_scatter, allgather_partitions), ``fp16``
(loss_scale 0 = dynamic, initial_scale_power, loss_scale_window, hysteresis,
min_loss_scale), ``bf16.enabled``, ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``, ``gradient_clipping``, ``steps_per_print``,
``zero_optimization.offload_optimizer`` (``device`` cpu/nvme/none, ``pin_memory``, and for
nvme ``nvme_path``, ``buffer_count``), ``zero_optimization.sub_group_size`` (the unit of the
swapped optimizer step), ``aio.thread_count`` (threads of the swap I/O; the ``aio`` block's
other knobs are named in a warning), ``offload_param`` (``device`` cpu: ZeRO-3 parameter
shards in host memory, nvme: in swap files; for nvme ``nvme_path``, which must agree with
``offload_optimizer.nvme_path`` when both are given (one ``--offload-nvme-path``),
``buffer_count``, ``buffer_size``, ``max_in_cpu``; ``pin_memory`` is named in a warning:
the parameter slots are not page-locked), and ZeRO-3's
``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
``stage3_param_persistence_threshold`` and ``stage3_max_reuse_distance`` (elements).
The legacy ``cpu_offload*`` switches are refused; other ``stage3_*`` keys and any
other unknown key give a warning. A key read whose setting has no effect in the run (the
``stage3_*`` knobs below stage 3, say) is named with its file by ``derive.unused_settings``.

``mics_shard_size`` (MiCS) is ``--zero-shard-size`` (hybrid sharding; DeepSpeed's -1 = off).
ZeRO++'s ``zero_hpz_partition_size`` keeps a secondary copy of the parameters sharded over that
many ranks while gradients and optimizer states stay sharded over the whole group: the same as
hybrid sharding for the parameters only, so it is accepted where it changes nothing beyond
``mics_shard_size`` (1, its default, or equal to ``mics_shard_size``) and named in a warning
otherwise, as are the quantized ZeRO++ switches (``zero_quantized_weights``,
``zero_quantized_gradients``), which have no megazero equivalent.

``sequence_parallel_size`` (DeepSpeed-Ulysses' degree, which DeepSpeed's config reads for its
sequence-parallel groups) is context parallelism over heads: ``--cp N --cp-comm-type a2a``; a
``--cp N`` given beside it that agrees keeps the all-to-all (the file says which kind of context
parallelism it means), and a ``--cp-comm-type p2p`` beside it is a conflict naming both. A value
below 1 is refused naming the key.

``activation_checkpointing`` (DeepSpeed's activation checkpointing API, as Megatron-DeepSpeed
uses it with one checkpoint per transformer layer): the block turns on
``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`` unless
the command line chose recomputation itself. ``cpu_checkpointing`` (offloading the saved
inputs to the host) is refused; ``partition_activations`` is what ``--sequence-parallel``
does to the saved inputs (a warning says so when it is off); ``number_checkpoints``,
``contiguous_memory_optimization``, ``synchronize_checkpoint_boundary`` and ``profile``
(buffer layout and profiling) have no megazero equivalent and are named in a warning.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from megazero.config.schema import Config, ConfigError, get_value, set_value, setting_named

_DS_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "gradient_clipping": "optim.clip_grad",
    "steps_per_print": "log.log_interval",
    "sequence_parallel_size": "parallel.cp",
    "bf16.enabled": "precision.bf16",
    "fp16.enabled": "precision.fp16",
    **{
        f"fp16.{k}": f"precision.{k}"
        for k in ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale")
    },
    **{
        f"zero_optimization.{k}": f"zero.{k}"
        for k in (
            "stage",
            "allgather_partitions",
            "allgather_bucket_size",
            "overlap_comm",
            "reduce_scatter",
            "reduce_bucket_size",
            "contiguous_gradients",
        )
    },
    "zero_optimization.offload_optimizer.device": "zero.offload_optimizer",
    "zero_optimization.offload_optimizer.pin_memory": "zero.offload_optimizer_pin_memory",
    "zero_optimization.offload_optimizer.nvme_path": "zero.offload_nvme_path",
    "zero_optimization.offload_optimizer.buffer_count": "zero.offload_nvme_buffer_count",
    "zero_optimization.sub_group_size": "zero.sub_group_size",
    "aio.thread_count": "zero.offload_nvme_io_threads",
    "zero_optimization.offload_param.device": "zero.offload_param",
    "zero_optimization.offload_param.nvme_path": "zero.offload_nvme_path",
    **{
        f"zero_optimization.offload_param.{k}": f"zero.offload_param_{k}"
        for k in ("buffer_count", "buffer_size", "max_in_cpu")
    },
    "zero_optimization.mics_shard_size": "zero.zero_shard_size",
    **{
        f"zero_optimization.stage3_{k}": f"zero.zero3_{k}"
        for k in ("prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold", "max_reuse_distance")
    },
}
_DS_BLOCKS = ("zero_optimization", "fp16", "bf16", "activation_checkpointing", "aio")
_RECOMPUTE = {
    "model.recompute_granularity": "full",
    "model.recompute_method": "uniform",
    "model.recompute_num_layers": 1,
}
_OFFLOAD_KEYS = ("cpu_offload", "cpu_offload_params")  # DeepSpeed's legacy switches
_OFFLOAD_BLOCKS = ("zero_optimization.offload_optimizer", "zero_optimization.offload_param")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ConfigError(
            f"--deepspeed-config {path}: cannot read it ({e.strerror}); fix: give the path of a DeepSpeed JSON file"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"--deepspeed-config {path}: not UTF-8 text (byte {e.start}); fix: give a DeepSpeed JSON file"
        ) from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ConfigError(
            f"--deepspeed-config {path}: JSON nested too deeply; fix: give a DeepSpeed JSON file"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--deepspeed-config {path}: invalid JSON at line {e.lineno}, column {e.colno}: "
            f"{e.msg}; fix: correct the file (JSON: double quotes, true/false, "
            "no trailing commas)"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--deepspeed-config {path}: the top level must be a JSON object")
    return doc


def _ds_items(doc: dict, path: str):
    """(dotted key, value) pairs: the blocks' entries one by one, other top-level keys whole."""
    for key, value in doc.items():
        if key in _DS_BLOCKS:
            if not isinstance(value, dict):
                raise ConfigError(f"--deepspeed-config {path}: {key} must be a JSON object")
            for k, v in value.items():
                if f"{key}.{k}" in _OFFLOAD_BLOCKS and isinstance(v, dict):  # one level deeper
                    yield from ((f"{key}.{k}.{kk}", vv) for kk, vv in v.items())
                else:
                    yield f"{key}.{k}", v
        else:
            yield key, value


def _refusal(key: str, value: Any) -> Optional[str]:
    leaf = key.split(".")[-1]
    if key == "activation_checkpointing.cpu_checkpointing" and value:
        return f"{key} (offloads the saved activations to the host; remove it)"
    if key in _OFFLOAD_BLOCKS:
        return f'{key} must be a JSON object such as {{"device": "cpu"}}'
    if key == "zero_optimization.offload_optimizer.device" and value not in ("cpu", "nvme", "none"):
        return f"{key} {json.dumps(value)} (only cpu, nvme or none)"
    if key == "zero_optimization.offload_param.device" and value not in ("cpu", "nvme", "none"):
        return f"{key} {json.dumps(value)} (only cpu, nvme or none)"
    if key.startswith("zero_optimization.") and leaf in _OFFLOAD_KEYS and value:
        return f'{key} (DeepSpeed\'s legacy switch; use offload_optimizer: {{"device": "cpu"}})'
    return None


def _coerce(value: Any, base: type, where: str) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is bool and isinstance(value, bool):
        return value
    if base is int and number and float(value).is_integer():
        return int(value)
    if base is float and number and math.isfinite(value):
        return float(value)
    if base is str and isinstance(value, str):
        return value
    kind = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}[base]
    raise ConfigError(f"{where} must be {kind}, got {json.dumps(value)}; fix: correct the file")


def load_deepspeed_config(path: str, cfg: Config) -> list[str]:
    """Fill ``cfg`` from a DeepSpeed-style JSON file; returns warnings for unused keys.

    Values fill every setting not given on the command line (recorded in ``cfg.sources``);
    ``"auto"`` (Hugging Face's convention) leaves a setting to be derived.
    Raises ConfigError: unreadable file or invalid JSON (file, line, column); offload keys
    (all named in one message); a value of the wrong type; a key
    whose value disagrees with a flag given on the command line (names both).
    """
    doc = _read_json(path)
    items = list(_ds_items(doc, path))
    refused = [r for r in (_refusal(k, v) for k, v in items) if r]
    if refused:
        raise ConfigError(f"--deepspeed-config {path}: not supported by megazero: " + "; ".join(refused))
    ulysses = dict(items).get("sequence_parallel_size")
    if isinstance(ulysses, (int, float)) and not isinstance(ulysses, bool) and ulysses < 1:
        raise ConfigError(
            f"sequence_parallel_size = {json.dumps(ulysses)} in {path} must be at least 1 (the context-parallel "
            "size); fix: correct the file"
        )
    warnings = _activation_checkpointing(doc, path, cfg)
    warnings += _hierarchical_partition(doc.get("zero_optimization"), path)
    for key, raw in items:
        name = _DS_KEYS.get(key)
        if key.startswith("activation_checkpointing.") or key == _HPZ:
            continue
        if key == "zero_optimization.mics_shard_size" and isinstance(raw, int) and raw <= 0:
            continue  # DeepSpeed's -1: MiCS off
        if name is None and key.startswith("aio."):
            warnings.append(
                f"--deepspeed-config {path}: key {key!r} is not honoured: megazero's NVMe swap "
                "I/O is pread/pwrite on a pool of aio.thread_count threads (no libaio queue, "
                "blocks or events); ignored"
            )
            continue
        if key == "zero_optimization.offload_param.pin_memory":
            warnings.append(
                f"--deepspeed-config {path}: key {key!r} is not honoured: megazero page-locks "
                "the shards of offload_param.device cpu on CUDA always and never the host slots of "
                "device nvme; ignored"
            )
            continue
        if name is None and key.startswith("zero_optimization.stage3_"):
            warnings.append(
                f"--deepspeed-config {path}: key {key!r} is not honoured: megazero's ZeRO-3 "
                "reads stage3_prefetch_bucket_size, stage3_max_live_parameters, "
                "stage3_param_persistence_threshold and stage3_max_reuse_distance only; "
                "ignored"
            )
            continue
        if name is None:
            if not key.startswith("zero_optimization.") or key.split(".")[-1] not in _OFFLOAD_KEYS:
                warnings.append(f"--deepspeed-config {path}: key {key!r} is not used by megazero; ignored")
            continue
        if raw == "auto":
            continue
        value = _coerce(raw, setting_named(name).base, f"{key} in {path}")
        src = cfg.sources.get(name, "")
        if src.endswith(f" in {path}") and get_value(cfg, name) != value:  # two keys, one setting
            raise ConfigError(
                f"{src.split(' in ')[0]} = {json.dumps(get_value(cfg, name))} and {key} = "
                f"{json.dumps(raw)} in {path} disagree (megazero has one {setting_named(name).flag}); "
                "fix: make them agree or drop one"
            )
        if src.startswith("--"):
            current = get_value(cfg, name)
            if current != value:
                shown = src if isinstance(current, bool) else f"{src} {current}"  # a switch: the flag alone
                raise ConfigError(
                    f"{shown} on the command line conflicts with {key} = "
                    f"{json.dumps(raw)} in {path}; fix: make them agree or drop one"
                )
            continue
        set_value(cfg, name, value)
        cfg.sources[name] = f"{key} in {path}"
    chosen = cfg.sources.get("parallel.cp_comm_type", "")
    if isinstance(ulysses, int) and ulysses > 1 and chosen.startswith("--") and cfg.parallel.cp_comm_type != "a2a":
        raise ConfigError(
            f"{chosen} {cfg.parallel.cp_comm_type} on the command line conflicts with sequence_parallel_size = "
            f"{ulysses} in {path} (DeepSpeed-Ulysses: the all-to-all over heads, --cp-comm-type a2a); "
            "fix: drop one (--cp N alone for ring attention)"
        )
    if (
        isinstance(ulysses, int)
        and ulysses > 1
        and cfg.parallel.cp == ulysses  # from the file, or a --cp that agrees with it
        and "parallel.cp_comm_type" not in cfg.sources
    ):  # Ulysses is the all-to-all over heads
        cfg.parallel.cp_comm_type = "a2a"
        cfg.sources["parallel.cp_comm_type"] = f"sequence_parallel_size in {path}"
    return warnings


_HPZ = "zero_optimization.zero_hpz_partition_size"


def _hierarchical_partition(zero: Any, path: str) -> list[str]:
    """ZeRO++'s ``zero_hpz_partition_size`` (module docstring): no warning at 1 (off) or when it
    equals ``mics_shard_size`` (hybrid sharding already keeps the parameters over those ranks)."""
    if not isinstance(zero, dict) or _HPZ.split(".")[1] not in zero:
        return []
    hpz, mics = zero["zero_hpz_partition_size"], zero.get("mics_shard_size")
    if hpz == 1 or (hpz == mics and isinstance(hpz, int) and hpz > 1):
        return []
    return [
        f"--deepspeed-config {path}: key {_HPZ!r} = {json.dumps(hpz)} is not honoured: ZeRO++'s secondary "
        "parameter partition alone has no megazero equivalent (--zero-shard-size / mics_shard_size shards "
        "the parameters, gradients and optimizer states together); set mics_shard_size to the same value "
        "for hybrid sharding; ignored"
    ]


def _activation_checkpointing(doc: dict, path: str, cfg: Config) -> list[str]:
    """Map the ``activation_checkpointing`` block onto the recompute flags; returns warnings."""
    block = doc.get("activation_checkpointing")
    if block is None:
        return []
    if not any(name in cfg.sources for name in _RECOMPUTE):
        for name, value in _RECOMPUTE.items():
            set_value(cfg, name, value)
            cfg.sources[name] = f"activation_checkpointing in {path}"
    warnings = []
    if block.get("partition_activations") and not cfg.parallel.sequence_parallel:
        warnings.append(
            f"--deepspeed-config {path}: activation_checkpointing.partition_activations: "
            "megazero shards the saved layer inputs over tp only with --sequence-parallel"
        )
    unused = [k for k in block if k not in ("partition_activations", "cpu_checkpointing")]
    if unused:
        warnings.append(
            f"--deepspeed-config {path}: activation_checkpointing keys {', '.join(unused)} "
            "have no megazero equivalent; ignored"
        )
    return warnings
