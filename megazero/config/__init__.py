"""megazero's one configuration (docs/design.md, contract 5).

Every setting is a dataclass field with a default; its documentation (meaning, unit, valid
range, choices, command-line flags) is the field's ``metadata`` and is rendered three ways
from that one place: ``--help``, ``flags_table()`` (the README's table) and ``describe()``.

Three sources fill a ``Config``, in this order:

1. defaults (the dataclasses of ``schema.py``);
2. a DeepSpeed-style JSON file (``--deepspeed-config``; keys documented at DeepSpeed's
   "Configuration JSON" page): ``zero_optimization``, ``fp16``, ``bf16``,
   ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
   ``gradient_clipping``, ``steps_per_print``. It fills every setting not given on the
   command line. A setting given both on the command line and in the file must agree:
   otherwise ``ConfigError`` naming the flag and the key. NVMe offload and parameter offload
   are refused; ``stage3_*`` keys and any other key megazero does not read give a warning;
3. Megatron-style long flags (plus ``--tp/--pp/--dp``), generated from the fields.

``finalize`` then derives what was left open (data-parallel size, accumulation steps or
global batch, FFN width, ...) and ``validate`` checks every rule, raising one ``ConfigError``
that names the flag and the fix. All of it is pure: the world size is passed in, so it runs
on every rank before any process group exists (contract 3).

The package imports downwards only (no file imports one listed after it):

- ``schema.py``: the dataclasses, ``ConfigError``, ``Setting`` / ``settings()`` and the
  get / set / show helpers;
- ``shape.py``: the model-shape rules (heads, widths, positions, query groups, RoPE under
  tp), written once for the flags here and for ``model.config.GPTConfig.validate``;
- ``cli.py``: the generated parser, ``parse_args``, ``flags_table``;
- ``derive.py``: ``finalize`` (batch arithmetic, defaults), ``bucket_sizes``,
  ``overlap_param_gather``, ``layout_topology``;
- ``checks.py``: ``validate``, every rule;
- ``deepspeed.py``: the DeepSpeed JSON source;
- ``render.py``: ``describe``, ``to_dict``;
- ``load.py``: ``config_from_argv`` (parse -> DeepSpeed -> derive -> check), ``resolve_run_dir``,
  ``parallel_sizes`` / ``world_size_of`` (the sizes and ranks the layout flags and a DeepSpeed
  file ask for).
"""

from megazero.config.checks import check_value, validate
from megazero.config.cli import build_parser, flags_table, integer, parse_args
from megazero.config.deepspeed import load_deepspeed_config
from megazero.config.derive import bucket_sizes, finalize, layout_topology, overlap_param_gather
from megazero.config.load import config_from_argv, parallel_sizes, resolve_run_dir, world_size_of
from megazero.config.render import describe, to_dict
from megazero.config.schema import (
    MOCK_VOCAB_SIZE,
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    Setting,
    TrainingConfig,
    ZeroConfig,
    get_value,
    set_value,
    setting_named,
    settings,
    show_flag,
)
from megazero.config.shape import check_block, check_sizes, default_ffn_hidden_size

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "MOCK_VOCAB_SIZE",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "Setting",
    "TrainingConfig",
    "ZeroConfig",
    "bucket_sizes",
    "build_parser",
    "check_block",
    "check_sizes",
    "check_value",
    "config_from_argv",
    "default_ffn_hidden_size",
    "describe",
    "finalize",
    "flags_table",
    "get_value",
    "integer",
    "layout_topology",
    "load_deepspeed_config",
    "overlap_param_gather",
    "parse_args",
    "resolve_run_dir",
    "set_value",
    "setting_named",
    "settings",
    "show_flag",
    "to_dict",
    "validate",
    "parallel_sizes",
    "world_size_of",
]
