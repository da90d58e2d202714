"""megazero's one configuration (DESIGN.md, contract 5).

Every setting is a dataclass field with a default; its documentation (meaning, unit, valid
range, choices, command-line flags) is the field's ``metadata`` and is rendered three ways
from that one place: ``--help``, ``flags_table()`` (the README's table) and ``describe()``.

Three sources fill a ``Config``, in this order:

1. defaults (the dataclasses below);
2. a DeepSpeed-style JSON file (``--deepspeed-config``; keys documented at DeepSpeed's
   "Configuration JSON" page): ``zero_optimization``, ``fp16``, ``bf16``,
   ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
   ``gradient_clipping``, ``steps_per_print``. It fills every setting not given on the
   command line. A setting given both on the command line and in the file must agree:
   otherwise ``ConfigError`` naming the flag and the key. ZeRO stage 3, offloading and
   ``stage3_*`` keys are refused; any other key megazero does not read gives a warning;
3. Megatron-style long flags (plus ``--tp/--pp/--dp``), generated from the fields.

``finalize`` then derives what was left open (data-parallel size, accumulation steps or
global batch, FFN width, ...) and ``validate`` checks every rule, raising one ``ConfigError``
that names the flag and the fix. All of it is pure: the world size is passed in, so it runs
on every rank before any process group exists (contract 3).

Note on size: one file by DESIGN.md's layout, so it runs past STYLE.md's ~400 lines (about 75
settings with their docs, the DeepSpeed reader and the checks next to the settings they judge).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from megazero.pipeline.partition import PartitionError, parse_layer_split, validate_partition

MOCK_VOCAB_SIZE = 1024  # vocabulary of --mock-data when --vocab-size is not given


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the setting (flag) and the fix."""


def _f(default: Any, help: str, unit: str = "", *, flags: tuple = (), choices: tuple = (),
       ge: Optional[float] = None, gt: Optional[float] = None, lt: Optional[float] = None,
       parse=None):
    """A setting: default, meaning, unit, flags (first = the name used in messages), range."""
    meta = dict(help=help, unit=unit, flags=flags, choices=choices, ge=ge, gt=gt, lt=lt, parse=parse)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _layer_split(text: str) -> list[int]:
    try:
        return parse_layer_split(text)
    except PartitionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def integer(text: str) -> int:
    """An integer flag value; accepts DeepSpeed-style ``5e8`` when it is a whole number."""
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise ValueError(text) from None
        return int(value)


@dataclass
class ModelConfig:
    """The GPT architecture (pre-LayerNorm transformer, learned positions)."""

    num_layers: int = _f(4, "transformer layers", "layers", ge=1)
    hidden_size: int = _f(256, "model width H", "features", ge=1)
    num_attention_heads: int = _f(4, "attention heads; head size = H / heads", "heads", ge=1)
    ffn_hidden_size: Optional[int] = _f(None, "MLP inner width; None = 4 x --hidden-size", "features", ge=1)
    seq_length: int = _f(256, "tokens per training sample", "tokens", ge=1)
    max_position_embeddings: Optional[int] = _f(
        None, "rows of the position-embedding table; None = --seq-length", "positions", ge=1)
    make_vocab_size_divisible_by: int = _f(
        128, "pad the vocabulary to a multiple of this x tp (padded logits are masked)", "tokens", ge=1)
    hidden_dropout: float = _f(0.0, "dropout on embeddings and block outputs", "probability", ge=0, lt=1)
    attention_dropout: float = _f(0.0, "dropout on attention probabilities", "probability", ge=0, lt=1)
    untie_embeddings_and_output_weights: bool = _f(
        False, "give the output layer its own weight instead of the word embedding's")
    layernorm_epsilon: float = _f(1e-5, "LayerNorm epsilon added to the variance", "", gt=0)
    init_method_std: float = _f(0.02, "standard deviation of the normal weight init", "", gt=0)
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy", "probability", ge=0, lt=1)


@dataclass
class ParallelConfig:
    """The 3D layout: world size = tp x pp x dp (ranks ordered tp-dp-pp, see topology.py)."""

    tp: int = _f(1, "tensor-parallel size", "ranks", flags=("--tp", "--tensor-model-parallel-size"), ge=1)
    pp: int = _f(1, "pipeline-parallel size (stages)", "ranks",
                 flags=("--pp", "--pipeline-model-parallel-size"), ge=1)
    dp: Optional[int] = _f(None, "data-parallel size; None = world size / (tp x pp)", "ranks",
                           flags=("--dp", "--data-parallel-size"), ge=1)
    virtual_pipeline_size: int = _f(
        1, "model chunks per pipeline stage; > 1 selects the interleaved schedule", "chunks", ge=1)
    pipeline_schedule: str = _f("1f1b", "pipeline schedule; interleaved when --virtual-pipeline-size > 1",
                                choices=("none", "gpipe", "1f1b", "interleaved"))
    pipeline_layer_split: Optional[list[int]] = _f(
        None, "layers per stage as a comma list, e.g. 3,5; None = equal blocks", "layers", parse=_layer_split)
    sequence_parallel: bool = _f(False, "partition LayerNorm/dropout activations along the sequence over tp")
    distributed_timeout_s: float = _f(300.0, "timeout of every collective", "seconds", gt=0)


@dataclass
class TrainingConfig:
    """Batch arithmetic, iterations, checkpoints: global = micro x accumulation x dp."""

    micro_batch_size: int = _f(16, "samples per micro-batch per data-parallel rank", "samples", ge=1)
    global_batch_size: Optional[int] = _f(
        None, "samples per optimizer step; None = micro x accumulation x dp", "samples", ge=1)
    gradient_accumulation_steps: Optional[int] = _f(
        None, "micro-batches per step per data-parallel rank; None = derived (1 without a global batch)",
        "micro-batches", ge=1)
    train_iters: int = _f(400, "optimizer steps to train", "iterations", ge=1)
    seed: int = _f(1234, "seed of weights, data order and dropout", "", ge=0)
    eval_interval: int = _f(100, "validate every this many steps (and at the end)", "iterations", ge=1)
    eval_iters: int = _f(10, "validation batches per evaluation; 0 = none", "iterations", ge=0)
    save: Optional[str] = _f(None, "checkpoint directory to write; None = no checkpoints", "path")
    load: Optional[str] = _f(None, "checkpoint directory to resume from", "path")
    save_interval: Optional[int] = _f(None, "checkpoint every this many steps; None = at the end only",
                                      "iterations", ge=1)
    device: str = _f("auto", "auto = CUDA when available, else CPU", choices=("auto", "cpu", "cuda"))
    mock_data: bool = _f(False, "train on random tokens; no --data-path needed")


@dataclass
class OptimizerConfig:
    """AdamW (decoupled weight decay), warm-up then decay of the learning rate, clipping."""

    lr: float = _f(2e-3, "peak learning rate", "", ge=0)
    min_lr: float = _f(2e-4, "learning rate at the end of the decay", "", ge=0)
    lr_warmup_iters: Optional[int] = _f(None, "linear warm-up from 0 to --lr; None = 10% of --train-iters",
                                        "iterations", ge=0)
    lr_decay_iters: Optional[int] = _f(None, "iterations of decay to --min-lr; None = --train-iters",
                                       "iterations", ge=1)
    lr_decay_style: str = _f("cosine", "shape of the decay", choices=("cosine", "linear", "constant"))
    weight_decay: float = _f(0.1, "decoupled weight decay on matrices", "", ge=0)
    adam_beta1: float = _f(0.9, "Adam first-moment decay", "", ge=0, lt=1)
    adam_beta2: float = _f(0.95, "Adam second-moment decay", "", ge=0, lt=1)
    adam_eps: float = _f(1e-8, "Adam denominator epsilon", "", gt=0)
    clip_grad: float = _f(1.0, "clip the global gradient L2 norm to this; 0 = off", "", ge=0)
    kernels: str = _f("auto", "LayerNorm/Adam kernels (auto = apex on CUDA when importable, else torch)",
                      choices=("auto", "apex", "torch", "reference"))


@dataclass
class PrecisionConfig:
    """Model dtype and the fp16 loss scaler (DeepSpeed's fp16 block, same meanings)."""

    fp16: bool = _f(False, "fp16 weights and activations, fp32 master weights, loss scaling")
    bf16: bool = _f(False, "bf16 weights and activations, fp32 master weights")
    loss_scale: float = _f(0.0, "static fp16 loss scale; 0 = dynamic", "", ge=0)
    initial_scale_power: int = _f(16, "dynamic loss scale starts at 2**power", "", ge=0, lt=128)
    loss_scale_window: int = _f(1000, "steps without overflow before the scale doubles", "iterations", ge=1)
    hysteresis: int = _f(2, "overflows tolerated before the scale halves", "overflows", ge=1)
    min_loss_scale: float = _f(1.0, "floor of the dynamic loss scale", "", gt=0)
    max_consecutive_skips: int = _f(50, "stop after this many skipped (overflowed) steps in a row",
                                    "iterations", ge=1)
    accumulate_allreduce_grads_in_fp32: bool = _f(
        True, "keep and reduce gradients in fp32, else in the model dtype (fp16/bf16)",
        flags=("--grads-in-model-dtype",))


@dataclass
class ZeroConfig:
    """ZeRO data parallelism (Rajbhandari et al. 2020): 0 = replicated, 1 = optimizer states
    sharded, 2 = optimizer states and gradients sharded. Stage 3 is not implemented."""

    stage: int = _f(0, "ZeRO stage: 0, 1 or 2", flags=("--zero-stage",))
    reduce_bucket_size: int = _f(500_000_000, "gradient reduction bucket", "elements", ge=1)
    allgather_bucket_size: int = _f(500_000_000, "parameter all-gather bucket", "elements", ge=1)
    overlap_comm: bool = _f(True, "overlap gradient reduction with the backward pass",
                            flags=("--no-overlap-comm",))
    contiguous_gradients: bool = _f(True, "copy gradients into one contiguous buffer",
                                    flags=("--no-contiguous-gradients",))
    reduce_scatter: bool = _f(True, "reduce gradients with reduce-scatter (else all-reduce)",
                              flags=("--no-reduce-scatter",))
    allgather_partitions: bool = _f(True, "all-gather updated shards (else broadcast per shard)",
                                    flags=("--no-allgather-partitions",))


@dataclass
class DataConfig:
    """The corpus: preprocessed .bin/.idx files and their sentencepiece tokenizer."""

    data_path: list[str] = _f([], "PREFIX of PREFIX.bin/.idx, or a blend: W1 PREFIX1 W2 PREFIX2 ...", "path")
    split: str = _f("969,30,1", "train,valid,test proportions of the documents", "parts")
    tokenizer_model: Optional[str] = _f(None, "sentencepiece .model file (needed with --data-path)", "path")
    vocab_size: Optional[int] = _f(
        None, f"vocabulary; None = the tokenizer's ({MOCK_VOCAB_SIZE} with --mock-data)", "tokens", ge=1)
    data_cache_dir: Optional[str] = _f(None, "where index files are cached; None = beside the data", "path")
    num_workers: int = _f(0, "data-loader worker processes", "processes", ge=0)


@dataclass
class LoggingConfig:
    """Console log, TensorBoard, metrics file, final sample."""

    log_interval: int = _f(10, "log every this many steps", "iterations",
                           flags=("--log-interval", "--steps-per-print"), ge=1)
    run_dir: Optional[str] = _f(None, "directory of this run; None = runs/TIMESTAMP (resolve_run_dir)",
                                "path")
    tensorboard_dir: Optional[str] = _f("tensorboard", "TensorBoard event directory, relative to --run-dir",
                                        "path")
    metrics_file: Optional[str] = _f("metrics.jsonl", "JSON-lines metrics, relative to --run-dir", "path")
    generate_tokens: int = _f(64, "length of the greedy sample printed at the end", "tokens", ge=0)
    prompt: str = _f("def ", "prompt of that sample")


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
    deepspeed_config: Optional[str] = _f(None, "DeepSpeed-style JSON file (see the module docstring)", "path",
                                         flags=("--deepspeed-config", "--deepspeed_config"))
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
        given = self.field.metadata["flags"]
        if given:
            return given
        leaf = self.name.split(".")[-1].replace("_", "-")
        return (f"--no-{leaf}",) if self.field.default is True else (f"--{leaf}",)

    @property
    def flag(self) -> str:
        return self.flags[0]


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
            out += [Setting(f"{top.name}.{f.name}", f, _base(sub_hints[f.name]))
                    for f in dataclasses.fields(sub)]
        elif "help" in top.metadata:
            out.append(Setting(top.name, top, _base(hints[top.name])))
    return tuple(out)


def _setting(name: str) -> Setting:
    return next(s for s in settings() if s.name == name)


def _get(cfg: Config, name: str) -> Any:
    obj = cfg
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _set(cfg: Config, name: str, value: Any) -> None:
    *path, leaf = name.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, leaf, value)


def _show(cfg: Config, name: str) -> str:
    """The flag of a setting, plus the JSON key when the value came from the DeepSpeed file."""
    flag, src = _setting(name).flag, cfg.sources.get(name, "")
    return f"{flag} ({src})" if src and not src.startswith("--") else flag


# -- command line ---------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message}; fix: see `python train.py --help` for the flags")


def _help(s: Setting) -> str:
    m = s.field.metadata
    unit = f" [{m['unit']}]" if m["unit"] else ""
    if s.base is bool:
        return m["help"] + unit + (" (on by default; this flag turns it off)" if s.field.default else "")
    default = s.field.default if s.field.default is not dataclasses.MISSING else s.field.default_factory()
    return f"{m['help']}{unit} (default: {default})"


@functools.lru_cache(maxsize=None)
def build_parser() -> argparse.ArgumentParser:
    """The argparse parser, one option per setting; absent flags leave no attribute."""
    parser = _Parser(prog="train.py", allow_abbrev=False, argument_default=argparse.SUPPRESS,
                     description="megazero: 3D-parallel GPT pretraining (see README.md).")
    groups: dict[str, Any] = {}
    for s in settings():
        section = s.name.split(".")[0] if "." in s.name else "files"
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        kw: dict[str, Any] = dict(dest=s.name, help=_help(s).replace("%", "%%"))
        meta = s.field.metadata
        if s.base is not bool and not meta["choices"]:
            kw["metavar"] = s.name.split(".")[-1].upper()
        if s.base is bool:
            kw["action"] = "store_false" if s.field.default else "store_true"
        elif meta["parse"] is not None:
            kw["type"] = meta["parse"]
        elif s.base is list:
            kw.update(nargs="+", type=str)
        else:
            kw["type"] = {int: integer, float: float, str: str}[s.base]
            if meta["choices"]:
                kw["choices"] = meta["choices"]
        groups[section].add_argument(*s.flags, **kw)
    return parser


def parse_args(argv: list[str]) -> Config:
    """Defaults overridden by the flags in ``argv``; records each given flag in ``cfg.sources``.

    Raises ConfigError on an unknown flag or a value of the wrong type (message names the flag).
    """
    cfg = Config()
    for name, value in vars(build_parser().parse_args(list(argv))).items():
        _set(cfg, name, value)
        cfg.sources[name] = _setting(name).flag
    return cfg


# -- DeepSpeed JSON -------------------------------------------------------------------------
_DS_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "gradient_clipping": "optim.clip_grad",
    "steps_per_print": "log.log_interval",
    "bf16.enabled": "precision.bf16",
    "fp16.enabled": "precision.fp16",
    **{f"fp16.{k}": f"precision.{k}" for k in
       ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale")},
    **{f"zero_optimization.{k}": f"zero.{k}" for k in
       ("stage", "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
        "reduce_bucket_size", "contiguous_gradients")},
}
_DS_BLOCKS = ("zero_optimization", "fp16", "bf16")
_OFFLOAD_KEYS = ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ConfigError(f"--deepspeed-config {path}: cannot read it ({e.strerror}); "
                          "fix: give the path of a DeepSpeed JSON file") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed-config {path}: invalid JSON at line {e.lineno}, column {e.colno}: "
                          f"{e.msg}; fix: correct the file (JSON: double quotes, true/false, "
                          "no trailing commas)") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--deepspeed-config {path}: the top level must be a JSON object")
    return doc


def _ds_items(doc: dict, path: str):
    """(dotted key, value) pairs: the blocks' entries one by one, other top-level keys whole."""
    for key, value in doc.items():
        if key in _DS_BLOCKS:
            if not isinstance(value, dict):
                raise ConfigError(f"--deepspeed-config {path}: {key} must be a JSON object")
            yield from ((f"{key}.{k}", v) for k, v in value.items())
        else:
            yield key, value


def _refusal(key: str, value: Any) -> Optional[str]:
    leaf = key.split(".")[-1]
    if key == "zero_optimization.stage" and value == 3:
        return f"{key} 3 (ZeRO-3 parameter sharding; use stage 1 or 2)"
    if key.startswith("zero_optimization.stage3_"):
        return f"{key} (a ZeRO-3 setting; remove it and use stage 1 or 2)"
    offloads = (value.get("device", "cpu") not in ("none", None)) if isinstance(value, dict) else bool(value)
    if key.startswith("zero_optimization.") and leaf in _OFFLOAD_KEYS and offloads:
        return f"{key} (CPU/NVMe offload; remove it: states stay on the device)"
    return None


def _coerce(value: Any, base: type, where: str) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is bool and isinstance(value, bool):
        return value
    if base is int and number and float(value).is_integer():
        return int(value)
    if base is float and number and math.isfinite(value):
        return float(value)
    kind = {bool: "true or false", int: "a whole number", float: "a number"}[base]
    raise ConfigError(f"{where} must be {kind}, got {json.dumps(value)}; fix: correct the file")


def load_deepspeed_config(path: str, cfg: Config) -> list[str]:
    """Fill ``cfg`` from a DeepSpeed-style JSON file; returns warnings for unused keys.

    Values fill every setting not given on the command line (recorded in ``cfg.sources``);
    ``"auto"`` (Hugging Face's convention) leaves a setting to be derived.
    Raises ConfigError: unreadable file or invalid JSON (file, line, column); ZeRO stage 3,
    offload or ``stage3_*`` keys (all named in one message); a value of the wrong type; a key
    whose value disagrees with a flag given on the command line (names both).
    """
    doc = _read_json(path)
    items = list(_ds_items(doc, path))
    refused = [r for r in (_refusal(k, v) for k, v in items) if r]
    if refused:
        raise ConfigError(f"--deepspeed-config {path}: not supported by megazero: " + "; ".join(refused))
    warnings = []
    for key, raw in items:
        name = _DS_KEYS.get(key)
        if name is None:
            if not key.startswith("zero_optimization.") or key.split(".")[-1] not in _OFFLOAD_KEYS:
                warnings.append(f"--deepspeed-config {path}: key {key!r} is not used by megazero; ignored")
            continue
        if raw == "auto":
            continue
        value = _coerce(raw, _setting(name).base, f"{key} in {path}")
        src = cfg.sources.get(name, "")
        if src.startswith("--"):
            if _get(cfg, name) != value:
                raise ConfigError(f"{src} {_get(cfg, name)} on the command line conflicts with {key} = "
                                  f"{json.dumps(raw)} in {path}; fix: make them agree or drop one")
            continue
        _set(cfg, name, value)
        cfg.sources[name] = f"{key} in {path}"
    return warnings


# -- derive and validate --------------------------------------------------------------------
def finalize(cfg: Config, world_size: int) -> list[str]:
    """Fill derived settings in place; returns warnings. Never raises: validate() judges.

    dp = world / (tp x pp); FFN = 4 H; max positions = seq; decay iters = train iters;
    mock vocab = MOCK_VOCAB_SIZE; interleaved schedule when vp > 1 and no schedule was given;
    sequence parallelism off at tp 1 (Megatron does the same, with a warning). Batch (DeepSpeed's
    rule when global and accumulation are given and micro is not, else Megatron's):
    micro = global / (accumulation x dp), or accumulation = global / (micro x dp), or
    global = micro x accumulation x dp with accumulation 1 by default.
    """
    m, p, t, o, d = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.data
    warnings = []
    m.ffn_hidden_size = 4 * m.hidden_size if m.ffn_hidden_size is None else m.ffn_hidden_size
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


def _check_ranges(cfg: Config, world_size: int) -> None:
    """Every number inside its documented range, every choice among its choices."""
    for s in settings():
        value, meta = _get(cfg, s.name), s.field.metadata
        if meta["choices"] and value not in meta["choices"]:
            raise ConfigError(f"{_show(cfg, s.name)} {value!r} is not one of {', '.join(meta['choices'])}")
        if value is None or s.base not in (int, float):
            continue
        for op, bound, ok in (("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
                              ("lt", "<", lambda v, b: v < b)):
            if meta[op] is not None and not ok(value, meta[op]):
                raise ConfigError(f"{_show(cfg, s.name)} {value} is out of range; fix: "
                                  f"use a value {bound} {meta[op]}")


def _check_world(cfg: Config, world_size: int) -> None:
    """world size = tp x pp x dp."""
    p = cfg.parallel
    if p.dp is None:
        raise ConfigError(f"world size {world_size} is not divisible by --tp {p.tp} x --pp {p.pp}; fix: "
                          f"launch a multiple of {p.tp * p.pp} processes or change --tp/--pp")
    if p.tp * p.pp * p.dp != world_size:
        raise ConfigError(f"world size {world_size} != --tp {p.tp} x --pp {p.pp} x --dp {p.dp} = "
                          f"{p.tp * p.pp * p.dp}; fix: launch {p.tp * p.pp * p.dp} processes or "
                          "change --tp/--pp/--dp (leave --dp out to derive it)")


def _check_model_shape(cfg: Config, world_size: int) -> None:
    """Heads divide H and tp divides heads (so tp divides H too) and the FFN; seq fits positions."""
    m, tp = cfg.model, cfg.parallel.tp
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                          f"{m.num_attention_heads}; fix: choose a head count that divides the hidden size")
    if m.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by --tp {tp}; "
                          "fix: use a --tp that divides the head count")
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tp {tp}; "
                          "fix: use a multiple of the tensor-parallel size")
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                          f"{m.max_position_embeddings}; fix: raise the positions or shorten the sequence")
    if cfg.parallel.sequence_parallel and m.seq_length % tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length {m.seq_length} divisible by --tp {tp}; "
                          "fix: use a multiple of --tp or drop --sequence-parallel")


def _check_batch(cfg: Config, world_size: int) -> None:
    """global batch = micro x accumulation x dp (covers DeepSpeed's train_batch_size)."""
    t, dp = cfg.train, cfg.parallel.dp
    micro, accum, total = t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size
    if accum is None:
        raise ConfigError(f"{_show(cfg, 'train.global_batch_size')} {total} is not divisible by "
                          f"--micro-batch-size {micro} x data-parallel size {dp} = {micro * dp}; fix: "
                          f"use a multiple of {micro * dp} or change --micro-batch-size")
    if total != micro * accum * dp:
        raise ConfigError(
            f"{_show(cfg, 'train.global_batch_size')} {total} != {_show(cfg, 'train.micro_batch_size')} "
            f"{micro} x {_show(cfg, 'train.gradient_accumulation_steps')} {accum} x data-parallel size {dp}"
            f" = {micro * accum * dp}; fix: make them agree, or give only two so the third is derived")


def _check_pipeline(cfg: Config, world_size: int) -> None:
    """Schedule fits pp and vp; layers partition over the stages (pipeline/partition.py)."""
    p, m = cfg.parallel, cfg.model
    sched = p.pipeline_schedule
    try:
        validate_partition(m.num_layers, p.pp, p.virtual_pipeline_size, p.pipeline_layer_split)
    except PartitionError as e:
        raise ConfigError(str(e)) from None
    if sched == "none" and p.pp > 1:
        raise ConfigError(f"--pipeline-schedule none cannot run --pp {p.pp}; fix: use 1f1b or gpipe")
    if p.virtual_pipeline_size > 1 and sched != "interleaved":
        raise ConfigError(f"--virtual-pipeline-size {p.virtual_pipeline_size} needs --pipeline-schedule "
                          f"interleaved, got {sched}; fix: drop --pipeline-schedule")
    if sched == "interleaved":
        if p.pp < 2 or p.virtual_pipeline_size < 2:
            raise ConfigError(f"--pipeline-schedule interleaved needs --pp >= 2 and --virtual-pipeline-size"
                              f" >= 2 (got --pp {p.pp}, --virtual-pipeline-size {p.virtual_pipeline_size}); "
                              "fix: raise them or use --pipeline-schedule 1f1b")
        if cfg.train.gradient_accumulation_steps % p.pp:
            raise ConfigError(f"--pipeline-schedule interleaved needs micro-batches per step "
                              f"(--gradient-accumulation-steps {cfg.train.gradient_accumulation_steps}) "
                              f"divisible by --pp {p.pp}; fix: adjust --global-batch-size or "
                              "--gradient-accumulation-steps")


def _check_optim_precision(cfg: Config, world_size: int) -> None:
    """min lr <= lr; one of fp16/bf16; ZeRO stage 0-2 (3 refused)."""
    o, pr, z = cfg.optim, cfg.precision, cfg.zero
    if o.min_lr > o.lr:
        raise ConfigError(f"{_show(cfg, 'optim.min_lr')} {o.min_lr} is above --lr {o.lr}; fix: set "
                          "--min-lr <= --lr")
    if o.lr_decay_style != "constant" and o.lr_decay_iters <= o.lr_warmup_iters:
        raise ConfigError(f"{_show(cfg, 'optim.lr_decay_iters')} {o.lr_decay_iters} must be larger than "
                          f"{_show(cfg, 'optim.lr_warmup_iters')} {o.lr_warmup_iters} for "
                          f"--lr-decay-style {o.lr_decay_style}; fix: raise --lr-decay-iters (or "
                          "--train-iters, its default), lower --lr-warmup-iters, or use "
                          "--lr-decay-style constant")
    if pr.fp16 and pr.bf16:
        raise ConfigError(f"{_show(cfg, 'precision.fp16')} and {_show(cfg, 'precision.bf16')} are both on; "
                          "fix: choose one")
    if z.stage == 3:
        raise ConfigError(f"{_show(cfg, 'zero.stage')} 3 (parameter sharding) is not supported by "
                          "megazero; fix: use --zero-stage 1 or 2")
    if z.stage not in (0, 1, 2):
        raise ConfigError(f"{_show(cfg, 'zero.stage')} {z.stage} is out of range; fix: use 0 "
                          "(replicated), 1 (optimizer states sharded) or 2 (and gradients)")


def _check_data(cfg: Config, world_size: int) -> None:
    """A split of 1-3 proportions; a corpus whose .bin/.idx files exist and a tokenizer file."""
    d = cfg.data
    split_fractions(d.split)
    if cfg.train.mock_data:
        return
    if not d.data_path:
        raise ConfigError("no training data: --data-path is missing; fix: give --data-path PREFIX "
                          "(PREFIX.bin/.idx written by data/preprocess.py) or --mock-data")
    for _, prefix in parse_data_path(d.data_path):
        for path in (prefix + ".bin", prefix + ".idx"):
            if not os.path.isfile(path):
                hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
                raise ConfigError(f"--data-path {prefix}: {path} not found{hint}; fix: correct the path or "
                                  "create it with data/preprocess.py")
    if d.tokenizer_model is None:
        raise ConfigError("--tokenizer-model is missing; --data-path needs the sentencepiece model the "
                          "data was tokenized with; fix: give --tokenizer-model PATH")
    if not os.path.isfile(d.tokenizer_model):
        raise ConfigError(f"--tokenizer-model {d.tokenizer_model} not found; fix: correct the path")


_CHECKS = (_check_ranges, _check_world, _check_model_shape, _check_batch, _check_pipeline,
           _check_optim_precision, _check_data)


def validate(cfg: Config, world_size: int) -> None:
    """Run every check (after finalize); raises ConfigError naming the flag and the fix."""
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1 (WORLD_SIZE of the launcher)")
    for check in _CHECKS:
        check(cfg, world_size)


def parse_data_path(items: list[str]) -> list[tuple[float, str]]:
    """``--data-path`` as (weight, prefix) pairs, weights normalised to sum 1.

    One entry is a single prefix (weight 1); more are Megatron's ``W1 P1 W2 P2 ...`` blend.
    Raises ConfigError: an odd count, a weight that is not a number, negative, or all zero.
    """
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) % 2:
        raise ConfigError(f"--data-path has {len(items)} entries; a blend is weight-prefix pairs; fix: "
                          "e.g. --data-path 0.7 PREFIX_A 0.3 PREFIX_B")
    pairs = []
    for weight, prefix in zip(items[::2], items[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"--data-path: {weight!r} should be the weight before {prefix!r}; fix: "
                              "give weight-prefix pairs, e.g. --data-path 0.7 A 0.3 B") from None
        if not (math.isfinite(w) and w >= 0):
            raise ConfigError(f"--data-path weight {weight} of {prefix} is negative; fix: use weights >= 0")
        pairs.append((w, prefix))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ConfigError("--data-path weights sum to 0; fix: give at least one positive weight")
    return [(w / total, prefix) for w, prefix in pairs]


def split_fractions(split: str) -> tuple[float, float, float]:
    """``--split`` "969,30,1" (or "/"-separated, 1-3 parts) as train/valid/test fractions summing to 1."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or min(parts) < 0 or sum(parts) <= 0:
        raise ConfigError(f"--split {split!r} must be 1-3 non-negative proportions with a positive sum; "
                          "fix: e.g. --split 969,30,1")
    parts += [0.0] * (3 - len(parts))
    return tuple(x / sum(parts) for x in parts)


def config_from_argv(argv: list[str], world_size: int, *, print_warnings: bool = True) -> Config:
    """parse -> DeepSpeed file -> finalize -> validate. Pure: needs no process group.

    On ConfigError prints ``megazero: config error: <message>`` to stderr and exits with code 2.
    Warnings go to ``cfg.warnings`` and, when ``print_warnings``, to stderr.
    """
    try:
        cfg = parse_args(argv)
        warnings = load_deepspeed_config(cfg.deepspeed_config, cfg) if cfg.deepspeed_config else []
        warnings += finalize(cfg, world_size)
        validate(cfg, world_size)
    except ConfigError as e:
        print(f"megazero: config error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    cfg.warnings = warnings
    for w in warnings if print_warnings else ():
        print(f"megazero: config warning: {w}", file=sys.stderr, flush=True)
    return cfg


def resolve_run_dir(cfg: Config, stamp: str) -> str:
    """Set ``--run-dir`` to ``runs/<stamp>`` when not given; every rank must pass the same stamp."""
    if cfg.log.run_dir is None:
        cfg.log.run_dir = os.path.join("runs", stamp)
    return cfg.log.run_dir


# -- rendering ------------------------------------------------------------------------------
def to_dict(cfg: Config) -> dict[str, Any]:
    """The settings as nested plain data (JSON-serialisable), without sources and warnings."""
    out = {f.name: dataclasses.asdict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
           if dataclasses.is_dataclass(getattr(cfg, f.name))}
    out["deepspeed_config"] = cfg.deepspeed_config
    return out


def describe(cfg: Config) -> str:
    """One line per setting, ``section.name = value  [source]``, then the warnings."""
    lines = []
    for s in settings():
        src = cfg.sources.get(s.name)
        lines.append(f"{s.name:<46} = {_get(cfg, s.name)!r}" + (f"   [{src}]" if src else ""))
    lines += [f"warning: {w}" for w in cfg.warnings]
    return "\n".join(lines)


def flags_table() -> str:
    """A Markdown table of every flag: flags, default, unit, meaning (for the README)."""
    rows = ["| flag | default | unit | meaning |", "|---|---|---|---|"]
    for s in settings():
        meta = s.field.metadata
        default = s.field.default if s.field.default is not dataclasses.MISSING else s.field.default_factory()
        shown = "off" if s.base is bool else f"`{default}`"
        meaning = meta["help"] + (f" ({' / '.join(meta['choices'])})" if meta["choices"] else "")
        if s.base is bool and s.field.default:
            meaning += " (on by default; the flag turns it off)"
        flags = ", ".join(f"`{f}`" for f in s.flags)
        rows.append(f"| {flags} | {shown} | {meta['unit']} | {meaning.replace('|', '/')} |")
    return "\n".join(rows)
