"""megazero/config/ (the config package): flags, DeepSpeed JSON files (the seed documents'), derivation, validation.

Pure and fast: no process groups; one subprocess shows the exit code end to end.
"""

import json
import subprocess
import sys

import pytest

from data.gpt_dataset import parse_data_path
from data.gpt_dataset import parse_split as split_fractions
from megazero.config import (
    Config,
    ConfigError,
    build_parser,
    config_from_argv,
    describe,
    finalize,
    flags_table,
    integer,
    load_deepspeed_config,
    parse_args,
    settings,
    to_dict,
    validate,
)
from tests.support.config import fails
from tests.support.paths import REPO, SHARED

REPO = REPO
SEEDS = SHARED / "cases/deepspeed"


@pytest.fixture
def files(tmp_path):
    """A corpus prefix with .bin/.idx, one with only .bin, a tokenizer file, a JSON writer."""
    for name in ("A.bin", "A.idx", "B.bin", "B.idx", "half.bin", "tok.model"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("100\n")  # another run's checkpoints
    (tmp_path / "ckpt2" / "iter_0000100").mkdir(parents=True)  # ... and some without 'latest'

    def write_json(obj, name="ds.json"):
        path = tmp_path / name
        path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
        return str(path)

    return dict(
        A=str(tmp_path / "A"),
        B=str(tmp_path / "B"),
        HALF=str(tmp_path / "half"),
        TOK=str(tmp_path / "tok.model"),
        DIR=str(tmp_path),
        json=write_json,
    )


M = ["--mock-data"]
M4 = M + ["--micro-batch-size", "4"]  # for cases whose batch arithmetic assumes micro-batch 4
BAD = {  # case: (argv with {A}/{B}/{HALF}/{TOK}/{DIR}, world size, strings the message must contain)
    "heads_not_dividing_hidden": (M + ["--hidden-size", "250"], 1, ["--hidden-size", "--num-attention-heads"]),
    "qk_layernorm_without_rmsnorm": (M + ["--qk-layernorm"], 1, ["--qk-layernorm", "--normalization RMSNorm"]),
    "window_not_causal": (M + ["--window-size", "4,2"], 1, ["--window-size 4,2", "right = 0"]),
    "mtp_depth_not_below_seq_length": (
        M + ["--seq-length", "64", "--mtp-num-layers", "64"],
        1,
        ["--mtp-num-layers 64", "--seq-length 64", "--mtp-num-layers 63"],
    ),
    "mtp_negative": (M + ["--mtp-num-layers", "-1"], 1, ["--mtp-num-layers"]),
    "mtp_with_zero_bubble": (
        M + ["--mtp-num-layers", "1", "--pp", "2", "--pipeline-schedule", "zb-h1"],
        2,
        ["--mtp-num-layers 1", "--pipeline-schedule zb-h1"],
    ),
    "window_skip_pattern_length": (
        M + ["--window-size", "4,0", "--window-attn-skip-freq", "1,0,1"],
        1,
        ["--window-attn-skip-freq lists 3 entries", "--num-layers 4"],
    ),
    "window_skip_without_window": (
        M + ["--window-attn-skip-freq", "2"],
        1,
        ["--window-attn-skip-freq", "--window-size"],
    ),
    "window_size_not_integers": (M + ["--window-size", "4,x"], 1, ["--window-size", "comma list of integers"]),
    "kv_channels_odd_under_rope": (
        M + ["--position-embedding-type", "rope", "--kv-channels", "5"],
        1,
        ["5-dimensional head", "--kv-channels"],
    ),
    "heads_not_divisible_by_tp": (M + ["--tp", "3", "--hidden-size", "240"], 3, ["--num-attention-heads", "--tp 3"]),
    "ffn_not_divisible_by_tp": (M + ["--tp", "2", "--ffn-hidden-size", "1023"], 2, ["--ffn-hidden-size", "--tp 2"]),
    "layers_not_divisible_by_pp": (M + ["--pp", "3"], 3, ["--num-layers 4", "--pp 3"]),
    "layers_not_divisible_by_pp_vp": (
        M + ["--pp", "2", "--virtual-pipeline-size", "4"],
        2,
        ["--num-layers 4", "--virtual-pipeline-size 4"],
    ),
    "layer_split_wrong_sum": (M + ["--pp", "2", "--pipeline-layer-split", "1,2"], 2, ["--pipeline-layer-split"]),
    "layer_split_wrong_length": (M + ["--pp", "2", "--pipeline-layer-split", "4"], 2, ["--pipeline-layer-split"]),
    "layer_split_zero_stage": (M + ["--pp", "2", "--pipeline-layer-split", "0,4"], 2, ["--pipeline-layer-split"]),
    "layer_split_not_integers": (M + ["--pp", "2", "--pipeline-layer-split", "2,x"], 2, ["--pipeline-layer-split"]),
    "global_not_divisible_by_micro_dp": (
        M4 + ["--global-batch-size", "10"],
        2,
        ["--global-batch-size 10", "--micro-batch-size 4"],
    ),
    "global_disagrees_with_three": (
        M + ["--global-batch-size", "16", "--gradient-accumulation-steps", "3"],
        1,
        ["--global-batch-size", "--gradient-accumulation-steps"],
    ),
    "fp16_with_bf16": (M + ["--fp16", "--bf16"], 1, ["--fp16", "--bf16"]),
    "world_not_tp_pp_dp": (M + ["--tp", "2", "--dp", "2"], 2, ["world size 2", "--dp 2"]),
    "world_not_divisible_by_tp_pp": (M + ["--tp", "2"], 3, ["world size 3", "--tp 2"]),
    "seq_above_positions": (
        M + ["--seq-length", "512", "--max-position-embeddings", "256"],
        1,
        ["--seq-length 512", "--max-position-embeddings 256"],
    ),
    "zero_stage_out_of_range": (M + ["--zero-stage", "5"], 1, ["--zero-stage 5", "out of range", "3 (and parameters)"]),
    "offload_stage0": (M + ["--offload-optimizer", "cpu"], 1, ["--offload-optimizer cpu", "--zero-stage 0"]),
    "offload_apex": (
        M + ["--offload-optimizer", "cpu", "--zero-stage", "1", "--kernels", "apex"],
        1,
        ["--kernels apex", "--offload-optimizer cpu", "--kernels auto or torch"],
    ),
    "offload_param": (
        M + ["--offload-param", "cpu", "--zero-stage", "2"],
        1,
        ["--offload-param cpu", "--zero-stage 3", "got 2"],
    ),
    "offload_param_alone": (
        M + ["--offload-param", "cpu", "--zero-stage", "3"],
        1,
        ["--offload-param cpu", "--offload-optimizer cpu"],
    ),
    "offload_nvme_stage0": (
        M + ["--offload-optimizer", "nvme", "--offload-nvme-path", "/tmp"],
        1,
        ["--offload-optimizer nvme", "--zero-stage 0"],
    ),
    "offload_param_nvme": (
        M + ["--offload-param", "nvme", "--zero-stage", "3"],
        1,
        ["--offload-param nvme", "--offload-optimizer cpu"],
    ),
    "offload_param_nvme_stage2": (
        M
        + ["--offload-param", "nvme", "--offload-optimizer", "cpu", "--zero-stage", "2", "--offload-nvme-path", "/tmp"],
        1,
        ["--offload-param nvme", "--zero-stage 3", "got 2"],
    ),
    "offload_param_nvme_no_path": (
        M + ["--offload-param", "nvme", "--offload-optimizer", "cpu", "--zero-stage", "3"],
        1,
        ["--offload-param nvme", "--offload-nvme-path DIR"],
    ),
    "no_data": ([], 1, ["--data-path", "--mock-data"]),
    "tokenizer_missing": (["--data-path", "{A}"], 1, ["--tokenizer-model"]),
    "tokenizer_file_absent": (
        ["--data-path", "{A}", "--tokenizer-model", "{DIR}/no.model"],
        1,
        ["--tokenizer-model", "no.model not found"],
    ),
    "interleaved_with_pp1": (M + ["--pipeline-schedule", "interleaved"], 1, ["--pipeline-schedule", "--pp 1"]),
    "layers_vp_with_pp1": (M + ["--virtual-pipeline-size", "2"], 1, ["--virtual-pipeline-size 2", "--pp 1"]),
    "interleaved_microbatches_vs_pp": (
        M + ["--pp", "2", "--virtual-pipeline-size", "2", "--gradient-accumulation-steps", "3"],
        2,
        ["--gradient-accumulation-steps 3", "--pp 2"],
    ),
    "vp_without_interleaved": (
        M + ["--pp", "2", "--virtual-pipeline-size", "2", "--pipeline-schedule", "1f1b"],
        2,
        ["--virtual-pipeline-size 2", "--pipeline-schedule"],
    ),
    "schedule_none_with_pp": (M + ["--pp", "2", "--pipeline-schedule", "none"], 2, ["--pipeline-schedule none"]),
    "train_iters_zero": (M + ["--train-iters", "0"], 1, ["--train-iters 0", ">= 1"]),
    "lr_negative": (M + ["--lr", "-1"], 1, ["--lr -1"]),
    "min_lr_above_lr": (M + ["--lr", "1e-4", "--min-lr", "1e-3"], 1, ["--min-lr", "--lr"]),
    "hidden_dropout_one": (M + ["--hidden-dropout", "1.0"], 1, ["--hidden-dropout 1.0", "< 1"]),
    "attention_dropout_negative": (M + ["--attention-dropout", "-0.1"], 1, ["--attention-dropout"]),
    "micro_batch_zero": (M + ["--micro-batch-size", "0"], 1, ["--micro-batch-size 0"]),
    "reduce_bucket_zero": (M + ["--reduce-bucket-size", "0"], 1, ["--reduce-bucket-size 0"]),
    "allgather_bucket_zero": (M + ["--allgather-bucket-size", "0"], 1, ["--allgather-bucket-size 0"]),
    "unknown_flag": (M + ["--hiden-size", "64"], 1, ["--hiden-size"]),
    "wrong_type": (M + ["--hidden-size", "abc"], 1, ["--hidden-size", "abc"]),
    "bad_choice": (M + ["--device", "tpu"], 1, ["--device", "tpu"]),
    "dp_zero": (M + ["--dp", "0"], 1, ["--dp 0"]),
    "save_over_another_run": (M + ["--save", "{DIR}/ckpt"], 1, ["--save", "ckpt", "--load", "empty"]),
    "save_over_iterations_without_latest": (M + ["--save", "{DIR}/ckpt2"], 1, ["--save", "ckpt2", "another run"]),
    "save_over_another_run_loading_elsewhere": (
        M + ["--save", "{DIR}/ckpt", "--load", "{DIR}"],
        1,
        ["--save", "ckpt", "another run"],
    ),
    "sequence_parallel_seq_vs_tp": (
        M + ["--tp", "4", "--sequence-parallel", "--seq-length", "30", "--hidden-size", "64"],
        4,
        ["--sequence-parallel", "--seq-length 30"],
    ),
    # a restart resumes from --load's latest: this run must write it
    "max_restarts_without_save": (
        M + ["--max-restarts", "1"],
        1,
        ["--max-restarts 1", "iteration 0", "--save DIR --load DIR", "--save-interval N"],
    ),
    "max_restarts_save_without_load": (
        M + ["--max-restarts", "2", "--save", "{DIR}/new"],
        1,
        ["--max-restarts 2", "resumes from --load (not given)", "--save DIR --load DIR"],
    ),
    "max_restarts_load_elsewhere": (
        M + ["--max-restarts", "1", "--save", "{DIR}/new", "--load", "{DIR}"],
        1,
        ["--max-restarts 1", "not from this run's checkpoints"],
    ),
    "max_restarts_without_save_interval": (
        M + ["--max-restarts", "1", "--save", "{DIR}/new", "--load", "{DIR}/new"],
        1,
        ["--max-restarts 1", "saves only at the end", "--save-interval N"],
    ),
    # a checkpoint option without --save: the run would write no checkpoint
    "save_interval_without_save": (
        M + ["--save-interval", "5"],
        1,
        ["--save-interval has no effect without --save", "add --save DIR or drop it"],
    ),
    "keep_latest_without_save": (
        M + ["--keep-latest-checkpoints", "2"],
        1,
        ["--keep-latest-checkpoints", "--save DIR"],
    ),
    "async_save_without_save": (M + ["--async-save"], 1, ["--async-save has no effect without --save"]),
    # context parallelism and packed documents
    "seq_not_divisible_by_2cp": (M + ["--cp", "3", "--seq-length", "256"], 3, ["--seq-length 256", "2 x --cp 3 = 6"]),
    "sp_seq_not_divisible_by_cp_tp": (
        M + ["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-length", "36", "--hidden-size", "64"],
        8,
        ["--sequence-parallel", "--cp x --tp = 8"],
    ),
    "a2a_heads_not_divisible": (
        M + ["--cp", "2", "--cp-comm-type", "a2a", "--num-attention-heads", "2", "--tp", "2"],
        4,
        ["--cp-comm-type a2a", "--num-attention-heads 2", "--tp x --cp = 4"],
    ),
    "a2a_query_groups_not_divisible": (
        M + ["--cp", "2", "--cp-comm-type", "a2a", "--group-query-attention", "--num-query-groups", "1"],
        2,
        ["--num-query-groups 1", "--tp x --cp = 2"],
    ),
    "world_not_tp_cp_pp_dp": (M + ["--cp", "2", "--dp", "2"], 2, ["--cp 2", "= 4", "launch 4 processes"]),
    "world_not_divisible_by_cp": (M + ["--cp", "2", "--tp", "2"], 6, ["--tp 2 x --cp 2", "multiple of 4"]),
    "reset_attention_mask_without_tokenizer": (
        M + ["--reset-attention-mask"],
        1,
        ["--reset-attention-mask", "end-of-document token", "--mock-data has no tokenizer"],
    ),
    "eod_mask_loss_without_tokenizer": (M + ["--eod-mask-loss"], 1, ["--eod-mask-loss", "--tokenizer-model"]),
    "cp_with_attention_dropout": (
        M + ["--cp", "2", "--attention-dropout", "0.1"],
        2,
        ["--attention-dropout 0.1", "--cp 2", "--attention-dropout 0"],
    ),
    "sinks_with_attention_dropout": (
        M + ["--softmax-type", "learnable", "--attention-dropout", "0.1"],
        1,
        ["--attention-dropout 0.1", "--softmax-type learnable", "--attention-dropout 0"],
    ),
}


# data/ owns these rules (data.gpt_dataset: the blend, the corpus files, the split); the
# launcher's preflight applies them before any rank starts, like the config's own rules
DATA_BAD = {  # case: (argv as in BAD, world size, strings the message must contain)
    "data_files_missing": (["--data-path", "{DIR}/nope", "--tokenizer-model", "{TOK}"], 1, ["--data-path", "nope.bin"]),
    "data_idx_missing": (["--data-path", "{HALF}", "--tokenizer-model", "{TOK}"], 1, ["--data-path", "half.idx"]),
    "data_prefix_with_suffix": (
        ["--data-path", "{A}.bin", "--tokenizer-model", "{TOK}"],
        1,
        ["--data-path", "without .bin/.idx"],
    ),
    "blend_odd_count": (
        ["--data-path", "0.5", "{A}", "0.5", "--tokenizer-model", "{TOK}"],
        1,
        ["--data-path", "weight-prefix pairs"],
    ),
    "blend_negative_weight": (
        ["--data-path", "-0.5", "{A}", "1.5", "{B}", "--tokenizer-model", "{TOK}"],
        1,
        ["--data-path", "negative"],
    ),
    "blend_weight_not_number": (
        ["--data-path", "{A}", "{B}", "--tokenizer-model", "{TOK}"],
        1,
        ["--data-path", "weight"],
    ),
    "split_not_numbers": (M + ["--split", "a,b"], 1, ["--split"]),
}


def fails_before_launch(argv, world, capsys):
    """training.preflight (what the launcher runs before torchrun) must return 2 with one
    'megazero: data error:' line; returns it."""
    from megazero import training

    assert training.preflight(argv, world) == 2
    err = capsys.readouterr().err
    assert err.startswith("megazero: data error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("where,case", [("config", c) for c in sorted(BAD)] + [("data", c) for c in sorted(DATA_BAD)])
def test_bad_setting_exits_2_naming_the_flag(where, case, files, capsys):
    """A config rule refuses in config_from_argv; a data rule in the launcher's preflight."""
    argv, world, expected = (BAD if where == "config" else DATA_BAD)[case]
    check = fails if where == "config" else fails_before_launch
    err = check([a.format(**files) for a in argv], world, capsys)
    for text in expected:
        assert text in err, (case, err)
    assert "fix" in err or case.startswith("layer"), err  # megazero/pipeline/partition.py words its fixes itself


def test_exit_code_2_end_to_end_in_a_subprocess():
    code = (
        "from megazero.config import config_from_argv\n"
        "config_from_argv(['--mock-data', '--hidden-size', '250'], world_size=1)\n"
        "print('not reached')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith(
        "megazero: config error: --hidden-size 250 is not divisible by --num-attention-heads 4"
    )


def test_default_config_validates_and_derives():
    cfg = config_from_argv(["--mock-data"], 1)
    assert (cfg.parallel.dp, cfg.train.gradient_accumulation_steps, cfg.train.global_batch_size) == (1, 1, 16)
    assert (cfg.model.ffn_hidden_size, cfg.model.max_position_embeddings) == (1024, 256)
    assert (cfg.optim.lr_decay_iters, cfg.optim.lr_warmup_iters) == (400, 40)
    assert (cfg.data.vocab_size, cfg.warnings) == (1024, [])
    assert cfg.parallel.pipeline_schedule == "1f1b" and cfg.zero.stage == 0


def test_real_data_with_blend_validates(files):
    argv = ["--data-path", "0.75", files["A"], "0.25", files["B"], "--tokenizer-model", files["TOK"]]
    cfg = config_from_argv(argv, 1)
    assert parse_data_path(cfg.data.data_path) == [(0.75, files["A"]), (0.25, files["B"])]
    assert parse_data_path([files["A"]]) == [(1.0, files["A"])]
    assert split_fractions("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert split_fractions("8/2") == pytest.approx((0.8, 0.2, 0.0))


DATA_REFUSALS = [  # (--data-path, --split): each refused by data/, their one home, before launch
    (["0.5", "A", "0.5"], "969,30,1"),
    (["x", "A", "1", "B"], "969,30,1"),
    (["-0.5", "A", "1.5", "B"], "969,30,1"),
    (["inf", "A", "1", "B"], "969,30,1"),
    (["0", "A", "0", "B"], "969,30,1"),
    (["A"], "a,b"),
    (["A"], "1,2,3,4"),
    (["A"], "-1,2,3"),
    (["A"], "0,0,0"),
    (["A"], ""),
    (["A"], "nan,1"),
    (["A"], "96/x/4"),
]


@pytest.mark.parametrize("data_path,split", DATA_REFUSALS, ids=[" ".join(p) + " | " + s for p, s in DATA_REFUSALS])
def test_data_path_and_split_refusals_come_from_data_alone(data_path, split, files, capsys):
    """data/gpt_dataset.py owns the --data-path blend and --split rules: the config accepts
    these flags as given, and the launcher's preflight prints data's own message."""
    from data.indexed_dataset import DataError

    with pytest.raises(DataError) as e:
        parse_data_path(data_path)
        split_fractions(split)
    argv = ["--data-path", *data_path, f"--split={split}", "--tokenizer-model", files["TOK"]]
    assert config_from_argv(argv, 1).data.split == split
    assert fails_before_launch(argv, 1, capsys) == f"megazero: data error: {e.value}\n"


def test_batch_arithmetic_and_3d_layout():
    cfg = config_from_argv(M4 + ["--tp", "2", "--pp", "2", "--global-batch-size", "32"], 8)
    assert (cfg.parallel.dp, cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps) == (2, 4, 4)
    cfg = config_from_argv(M4 + ["--gradient-accumulation-steps", "3", "--micro-batch-size", "2"], 2)
    assert cfg.train.global_batch_size == 2 * 3 * 2
    cfg = config_from_argv(M4 + ["--pp", "2", "--virtual-pipeline-size", "2", "--global-batch-size", "16"], 2)
    assert cfg.parallel.pipeline_schedule == "interleaved" and cfg.train.gradient_accumulation_steps == 4
    cfg = config_from_argv(M4 + ["--pp", "2", "--num-layers", "5", "--pipeline-layer-split", "2,3"], 2)
    assert cfg.parallel.pipeline_layer_split == [2, 3]


def test_sequence_parallel_with_tp1_is_a_warning_and_turned_off(capsys):
    cfg = config_from_argv(M + ["--sequence-parallel"], 1)
    assert cfg.parallel.sequence_parallel is False
    assert any("--sequence-parallel" in w for w in cfg.warnings)
    assert "megazero: config warning: --sequence-parallel" in capsys.readouterr().err
    assert config_from_argv(M + ["--sequence-parallel", "--tp", "2"], 2).parallel.sequence_parallel is True


UNUSED = [  # (flags, world size, the warning, flags under which the setting applies: no warning)
    *[
        (
            ["--zero-stage", "2", flag, value],
            1,
            f"{flag} has no effect without --zero-stage 3 (this run: --zero-stage 2); ignored",
            ["--zero-stage", "3", flag, value],
        )
        for flag, value in (
            ("--zero3-prefetch-bucket-size", "0"),
            ("--zero3-max-live-parameters", "10"),
            ("--zero3-param-persistence-threshold", "0"),
            ("--zero3-max-reuse-distance", "0"),
            ("--zero3-reshard-after-forward", "on"),
        )
    ],
    (
        ["--zero3-max-live-parameters", "10"],
        1,
        "--zero3-max-live-parameters has no effect without --zero-stage 3; ignored",
        ["--zero3-max-live-parameters", "10", "--zero-stage", "3"],
    ),
    (
        ["--zero-stage", "1", "--allgather-bucket-size", "1000"],
        1,
        "--allgather-bucket-size has no effect without "
        "--zero-stage 3 (this run: --zero-stage 1) and without --overlap-param-gather off; ignored",
        ["--zero-stage", "1", "--allgather-bucket-size", "1000", "--overlap-param-gather", "off"],
    ),
    (
        ["--overlap-param-gather", "off"],
        1,
        "--overlap-param-gather has no effect without --zero-stage 1 or 2; ignored",
        ["--overlap-param-gather", "off", "--zero-stage", "2"],
    ),
    (
        ["--zero-stage", "1", "--no-offload-pin-memory"],
        1,
        "--no-offload-pin-memory has no effect without --offload-optimizer cpu or nvme; ignored",
        ["--zero-stage", "1", "--no-offload-pin-memory", "--offload-optimizer", "cpu"],
    ),
    (
        [
            "--zero-stage",
            "3",
            "--offload-optimizer",
            "cpu",
            "--offload-param",
            "cpu",
            "--offload-param-max-in-cpu",
            "0",
        ],
        1,
        "--offload-param-max-in-cpu has no effect without --offload-param nvme (this run: --offload-param cpu); "
        "ignored",
        [
            "--zero-stage",
            "3",
            "--offload-optimizer",
            "cpu",
            "--offload-param",
            "nvme",
            "--offload-param-max-in-cpu",
            "0",
            "--offload-nvme-path",
            "/tmp",
        ],
    ),
    (
        ["--recompute-num-layers", "2"],
        1,
        "--recompute-num-layers has no effect without --recompute-granularity full; ignored",
        ["--recompute-num-layers", "2", "--recompute-granularity", "full", "--recompute-method", "block"],
    ),
    (
        ["--bf16", "--loss-scale", "1024"],
        1,
        "--loss-scale has no effect without --fp16; ignored",
        ["--fp16", "--loss-scale", "1024"],
    ),
    (
        ["--fp16", "--loss-scale", "1024", "--hysteresis", "4"],
        1,
        "--hysteresis has no effect without --loss-scale 0 (this run: --loss-scale 1024); ignored",
        ["--fp16", "--hysteresis", "4"],
    ),
    (
        ["--grads-in-model-dtype"],
        1,
        "--grads-in-model-dtype has no effect without --fp16 and without --bf16; ignored",
        ["--grads-in-model-dtype", "--bf16"],
    ),
    (
        ["--fp16", "--skip-bad-batches", "3"],
        1,
        "--skip-bad-batches has no effect with --fp16; ignored",
        ["--bf16", "--skip-bad-batches", "3"],
    ),
    (
        ["--no-async-tensor-model-parallel-allreduce"],
        2,
        "--no-async-tensor-model-parallel-allreduce has no effect at --tp 1; ignored",
        ["--no-async-tensor-model-parallel-allreduce", "--tp", "2"],
    ),
    (
        ["--tp", "2", "--compile", "--no-async-tensor-model-parallel-allreduce"],
        2,
        "--no-async-tensor-model-parallel-allreduce has no effect with --compile; ignored",
        ["--tp", "2", "--no-async-tensor-model-parallel-allreduce"],
    ),
    (
        ["--pipeline-layer-split", "4"],
        2,
        "--pipeline-layer-split has no effect at --pp 1; ignored",
        ["--pipeline-layer-split", "1,3", "--pp", "2"],
    ),
    (
        ["--eval-iters", "0", "--eval-interval", "5"],
        1,
        "--eval-interval has no effect at --eval-iters 0; ignored",
        ["--eval-interval", "5"],
    ),
    (
        ["--lr-decay-style", "constant", "--min-lr", "0"],
        1,
        "--min-lr has no effect with --lr-decay-style constant; ignored",
        ["--min-lr", "0"],
    ),
    (
        ["--lr-decay-iters", "300", "--lr-decay-style", "constant"],
        1,
        "--lr-decay-iters has no effect with --lr-decay-style constant; ignored",
        ["--lr-decay-iters", "300"],
    ),
    (
        ["--lr-wsd-decay-style", "cosine"],
        1,
        "--lr-wsd-decay-style has no effect without --lr-decay-style WSD; ignored",
        ["--lr-wsd-decay-style", "cosine", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10"],
    ),
    (
        ["--profile-step-start", "3"],
        1,
        "--profile-step-start has no effect without --profile; ignored",
        ["--profile-step-start", "3", "--profile"],
    ),
    (
        ["--profile-ranks", "0", "1"],
        2,
        "--profile-ranks has no effect without --profile; ignored",
        ["--profile-ranks", "0", "1", "--profile"],
    ),
    (["--wandb-exp-name", "x"], 1, "--wandb-exp-name has no effect without --wandb-project; ignored", None),
    (["--prompt", "Once"], 1, "--prompt has no effect with --mock-data; ignored", None),
    (["--data-cache-dir", "/tmp/cache"], 1, "--data-cache-dir has no effect with --mock-data; ignored", None),
]


@pytest.mark.parametrize("argv,world,warning,applies", UNUSED, ids=[" ".join(u[0]) for u in UNUSED])
def test_a_setting_without_effect_is_a_warning_naming_it(argv, world, warning, applies, capsys):
    """A setting given that cannot take effect in this configuration (its field's ``applies``)
    is one warning naming its flag, kept in cfg.warnings; where it applies there is none."""
    cfg = config_from_argv(M4 + argv, world)
    assert warning in cfg.warnings, cfg.warnings
    assert f"megazero: config warning: {warning}\n" in capsys.readouterr().err
    if applies is not None:
        flag = warning.split()[0]
        assert not [w for w in config_from_argv(M4 + applies, world).warnings if w.startswith(flag)]


def test_deepspeed_stage3_keys_in_a_stage2_file_are_named_with_the_file(files, capsys):
    """A stage-2 DeepSpeed file with ZeRO-3's stage3_* knobs: each is read, and named in a warning
    with its key and file (they take effect at stage 3 only); an unread stage3_* key is named as
    not honoured, as at stage 3."""
    knobs = {
        "stage3_prefetch_bucket_size": "--zero3-prefetch-bucket-size",
        "stage3_max_live_parameters": "--zero3-max-live-parameters",
        "stage3_param_persistence_threshold": "--zero3-param-persistence-threshold",
        "stage3_max_reuse_distance": "--zero3-max-reuse-distance",
    }
    path = files["json"](
        {
            "zero_optimization": {
                "stage": 2,
                **{k: 1e6 for k in knobs},
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        }
    )
    cfg = config_from_argv(M + ["--deepspeed-config", path], 1)
    assert cfg.zero.stage == 2 and cfg.zero.zero3_max_live_parameters == 1_000_000
    assert "'zero_optimization.stage3_gather_16bit_weights_on_model_save' is not honoured" in cfg.warnings[0]
    for key, flag in knobs.items():
        assert (
            f"{flag} (zero_optimization.{key} in {path}) has no effect without --zero-stage 3 (this run: "
            f"--zero-stage 2, zero_optimization.stage in {path}); ignored"
        ) in cfg.warnings
    assert len(cfg.warnings) == 5
    assert capsys.readouterr().err.count("megazero: config warning: ") == 5
    stage3 = files["json"]({"zero_optimization": {"stage": 3, **{k: 1e6 for k in knobs}}}, "ds3.json")
    assert config_from_argv(M + ["--deepspeed-config", stage3], 1).warnings == []


def test_max_live_parameters_below_the_smallest_gather_unit_is_a_warning_before_launch(capsys):
    """At ZeRO-3 a --zero3-max-live-parameters below the smallest gather unit can never hold
    (zero3_gather gathers a unit anyway): the launcher's preflight warns, naming the flag, the
    unit's elements and the bound that holds; the memory plan counts what is gathered at once."""
    from megazero import training
    from megazero.planning import memory
    from megazero.planning.plan import plan_memory, zero3_live_warning, zero3_units
    from model.build import build_gpt_config

    # DeepSpeed's absolute threshold (1e5) rather than the default 10 x hidden, so the small
    # tensors below stay whole and the units are the three big matrices of each layer
    argv = M4 + [
        "--zero-stage",
        "3",
        "--dp",
        "2",
        "--zero3-param-persistence-threshold",
        "100000",
        "--zero3-max-live-parameters",
        "10",
    ]
    assert training.preflight(argv, 2) == 0
    err = capsys.readouterr().err
    cfg = config_from_argv(argv, 2)
    gpt = build_gpt_config(cfg, cfg.data.vocab_size)
    [[units]] = zero3_units(cfg, gpt)  # one stage, one chunk
    # hidden 256, 4 layers: a layer's QKV, fc1 and fc2 weights (3 + 4 + 4) x 65,536; the tied word
    # embedding (1024 x 256) is the chunk's own unit; tensors under 100,000 elements (the
    # persistence threshold: norms, biases, attention projection, position table) stay whole
    assert units == {**{f"layers.{i}": 11 * 65_536 for i in range(4)}, "chunk": 262_144}
    need = memory.zero3_gathered_at_once([units])
    assert need == 262_144 + 2 * 11 * 65_536
    warning = zero3_live_warning(cfg, gpt)
    assert warning.startswith(
        "--zero3-max-live-parameters 10 is below the smallest ZeRO-3 gather unit (the "
        "chunk's own parameters, 262,144 elements per rank), so the bound can never hold"
    )
    assert f"fix: give at least {need:,}" in warning
    assert f"megazero: config warning: {warning}\n" in err
    for bound in (262_144, 10**9):  # a bound that a unit fits is left alone
        assert zero3_live_warning(config_from_argv(argv[:-1] + [str(bound)], 2), gpt) is None
    low, honest = (plan_memory(config_from_argv(argv[:-1] + [str(b)], 2), gpt) for b in (10, need))
    assert low.backward_temporary_bytes == honest.backward_temporary_bytes


def test_every_flag_of_the_interface_exists_and_aliases_agree():
    flags = (
        "--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --seq-length "
        "--max-position-embeddings --micro-batch-size --global-batch-size --train-iters --lr --min-lr "
        "--lr-warmup-iters --lr-decay-iters --lr-decay-style --weight-decay --adam-beta1 --adam-beta2 "
        "--adam-eps --clip-grad --seed --data-path --split --tokenizer-model --vocab-size --save --load "
        "--save-interval --eval-interval --eval-iters --log-interval --tensorboard-dir --metrics-file "
        "--run-dir --fp16 --bf16 --loss-scale --initial-scale-power --loss-scale-window --hysteresis "
        "--min-loss-scale --zero-stage --hidden-dropout --attention-dropout --make-vocab-size-divisible-by "
        "--untie-embeddings-and-output-weights --sequence-parallel --virtual-pipeline-size "
        "--pipeline-schedule --pipeline-layer-split --mock-data --device --kernels --deepspeed-config "
        "--reduce-bucket-size --allgather-bucket-size --no-overlap-comm --distributed-timeout-s "
        "--gradient-accumulation-steps --tp --pp --dp --tensor-model-parallel-size "
        "--pipeline-model-parallel-size --data-parallel-size --grads-in-model-dtype --steps-per-print"
    ).split()
    known = build_parser()._option_string_actions
    assert [f for f in flags if f not in known] == []
    long = parse_args(
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "3",
            "--data-parallel-size",
            "4",
            "--steps-per-print",
            "7",
            "--no-overlap-comm",
            "--grads-in-model-dtype",
            "--reduce-bucket-size",
            "5e8",
        ]
    )
    assert (long.parallel.tp, long.parallel.pp, long.parallel.dp, long.log.log_interval) == (2, 3, 4, 7)
    assert long.zero.overlap_comm is False and long.precision.accumulate_allreduce_grads_in_fp32 is False
    assert long.zero.reduce_bucket_size == 500_000_000 and integer("2e8") == 200_000_000
    assert long.sources["parallel.tp"] == "--tp" and "model.num_layers" not in long.sources


def test_flags_table_has_one_row_per_setting_with_unit():
    table = flags_table().splitlines()
    assert table[0] == "| flag | default | unit | meaning |"
    assert len(table) == 2 + len(settings())
    row = next(r for r in table if r.startswith("| `--reduce-bucket-size`"))
    assert row == (
        "| `--reduce-bucket-size` | `None` | elements | gradient reduction bucket; None = hidden "
        "size squared (DeepSpeed's 'auto') |"
    )
    assert any(r.startswith("| `--tp`, `--tensor-model-parallel-size` | `1` | ranks |") for r in table)
    assert all(s.field.metadata["help"] for s in settings())


def test_to_dict_and_describe():
    cfg = config_from_argv(M4 + ["--tp", "2", "--hidden-size", "64"], 2)
    d = json.loads(json.dumps(to_dict(cfg)))
    assert d["parallel"]["tp"] == 2 and d["model"]["hidden_size"] == 64 and d["train"]["global_batch_size"] == 4
    assert set(d) == {
        "model",
        "parallel",
        "train",
        "optim",
        "precision",
        "zero",
        "data",
        "log",
        "post",
        "deepspeed_config",
    }
    text = describe(cfg)
    assert "parallel.tp" in text and "[--tp]" in text and len(text.splitlines()) == len(settings())


def test_validate_is_callable_on_a_built_config():
    cfg = Config()
    cfg.train.mock_data = True
    finalize(cfg, 4)
    validate(cfg, 4)
    assert cfg.parallel.dp == 4
    cfg.model.num_attention_heads = 3
    with pytest.raises(ConfigError, match="--num-attention-heads 3"):
        validate(cfg, 4)


# -- DeepSpeed JSON -------------------------------------------------------------------------
def seed(name):
    path = SEEDS / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    return str(path)


def assert_dynamic_fp16(cfg):
    p = cfg.precision
    assert (
        p.fp16,
        p.bf16,
        p.loss_scale,
        p.loss_scale_window,
        p.hysteresis,
        p.initial_scale_power,
        p.min_loss_scale,
    ) == (True, False, 0.0, 1000, 2, 16, 1.0)


@pytest.mark.parametrize("name,stage", [("seed000_stage1.json", 1), ("seed000_stage2.json", 2)])
def test_seed000_micro_batch_follows_from_train_batch_size(name, stage):
    cfg = config_from_argv(M + ["--deepspeed-config", seed(name)], 8)
    assert cfg.zero.stage == stage
    assert_dynamic_fp16(cfg)
    assert (cfg.train.global_batch_size, cfg.train.gradient_accumulation_steps, cfg.train.micro_batch_size) == (
        32,
        1,
        32 // 8,
    )
    cfg = config_from_argv(M + ["--deepspeed-config", seed(name), "--tp", "2"], 8)
    assert (cfg.parallel.dp, cfg.train.micro_batch_size) == (4, 8)


def test_seed000_train_batch_size_disagreeing_with_flags(capsys):
    err = fails(M + ["--deepspeed-config", seed("seed000_stage1.json"), "--micro-batch-size", "4"], 4, capsys)
    assert "train_batch_size" in err and "--micro-batch-size 4" in err and "= 16" in err


def test_seed004_full():
    path = seed("seed004_full.json")
    cfg = config_from_argv(M + ["--deepspeed-config", path], 1)
    t, z = cfg.train, cfg.zero
    assert (t.global_batch_size, t.micro_batch_size, t.gradient_accumulation_steps) == (32, 4, 8)
    assert_dynamic_fp16(cfg)
    assert (z.stage, z.allgather_bucket_size, z.reduce_bucket_size) == (2, 200_000_000, 200_000_000)
    assert z.overlap_comm and z.reduce_scatter and z.contiguous_gradients and z.allgather_partitions
    assert (cfg.optim.clip_grad, cfg.log.log_interval) == (1.0, 100)
    assert cfg.sources["zero.reduce_bucket_size"] == f"zero_optimization.reduce_bucket_size in {path}"
    assert config_from_argv(M + ["--deepspeed-config", path, "--tp", "2", "--pp", "2"], 4).parallel.dp == 1


def test_seed004_full_on_two_data_parallel_ranks_fails(capsys):
    err = fails(M + ["--deepspeed-config", seed("seed004_full.json")], 2, capsys)
    assert "train_batch_size" in err and "train_micro_batch_size_per_gpu" in err and "= 64" in err


def test_seed004_partial_files_combine_with_flags(capsys):
    cfg = config_from_argv(
        M + ["--deepspeed-config", seed("seed004_fp16.json"), "--micro-batch-size", "2", "--global-batch-size", "16"], 2
    )
    assert_dynamic_fp16(cfg)
    assert cfg.train.gradient_accumulation_steps == 4 and cfg.sources["train.micro_batch_size"] == "--micro-batch-size"
    cfg = config_from_argv(M + ["--deepspeed-config", seed("seed004_bf16.json")], 1)
    assert (cfg.precision.bf16, cfg.precision.fp16) == (True, False)
    err = fails(M + ["--deepspeed-config", seed("seed004_bf16.json"), "--fp16"], 1, capsys)
    assert "--fp16" in err and "--bf16 (bf16.enabled in" in err
    assert config_from_argv(M + ["--deepspeed-config", seed("seed004_fp16.json"), "--fp16"], 1).precision.fp16


def test_seed004_stage_blocks():
    cfg = config_from_argv(M + ["--deepspeed-config", seed("seed004_stage1.json")], 2)
    assert (cfg.zero.stage, cfg.zero.allgather_bucket_size, cfg.zero.allgather_partitions) == (1, 500_000_000, True)
    assert "zero.allgather_bucket_size" in cfg.sources and cfg.precision.fp16 is False
    cfg = config_from_argv(M + ["--deepspeed-config", seed("seed004_stage2.json"), "--reduce-bucket-size", "5e8"], 2)
    z = cfg.zero
    assert (z.stage, z.overlap_comm, z.contiguous_gradients, z.reduce_bucket_size, z.allgather_bucket_size) == (
        2,
        True,
        True,
        500_000_000,
        500_000_000,
    )


def test_flag_conflicting_with_json_names_both(capsys):
    err = fails(M + ["--deepspeed-config", seed("seed004_stage2.json"), "--reduce-bucket-size", "1000"], 1, capsys)
    assert "--reduce-bucket-size 1000" in err and "zero_optimization.reduce_bucket_size" in err
    err = fails(M + ["--deepspeed-config", seed("seed004_stage2.json"), "--no-overlap-comm"], 1, capsys)
    assert "--no-overlap-comm on the command line conflicts with zero_optimization.overlap_comm" in err


def test_stage3_offload_seed_fills_the_stage3_knobs_and_parameter_offload():
    """seed004_stage3_offload.json: offload_param and the four stage3_* knobs (elements) read."""
    cfg = config_from_argv(M + ["--deepspeed-config", seed("seed004_stage3_offload.json")], 1)
    z = cfg.zero
    assert (z.stage, z.offload_param, z.offload_optimizer) == (3, "cpu", "cpu")
    assert (
        z.zero3_prefetch_bucket_size,
        z.zero3_max_live_parameters,
        z.zero3_param_persistence_threshold,
        z.zero3_max_reuse_distance,
    ) == (500_000_000, 1_000_000_000, 1_000_000, 1_000_000_000)
    assert cfg.sources["zero.zero3_max_reuse_distance"].startswith("zero_optimization.stage3_max_reuse_distance in")


def test_stage3_is_read_and_unread_stage3_keys_named_in_a_warning(files):
    cfg = config_from_argv(M4 + ["--deepspeed-config", seed("seed000_stage3.json"), "--micro-batch-size", "16"], 2)
    assert (cfg.zero.stage, cfg.precision.fp16, cfg.train.global_batch_size) == (3, True, 32)
    path = files["json"](
        {
            "zero_optimization": {
                "stage": 3,
                "stage3_max_live_parameters": 2e6,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        }
    )
    cfg = config_from_argv(M4 + ["--deepspeed-config", path, "--zero3-prefetch-bucket-size", "0"], 2)
    assert (cfg.zero.stage, cfg.zero.zero3_max_live_parameters, cfg.zero.zero3_prefetch_bucket_size) == (
        3,
        2_000_000,
        0,
    )
    assert len(cfg.warnings) == 1
    assert "'zero_optimization.stage3_gather_16bit_weights_on_model_save' is not honoured" in cfg.warnings[0]


def test_unknown_keys_warn_and_auto_is_derived(files, capsys):
    path = files["json"](
        {
            "zero_optimization": {"stage": 1, "round_robin_gradients": True, "offload_optimizer": {"device": "none"}},
            "wall_clock_breakdown": False,
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": "auto",
        }
    )
    cfg = config_from_argv(M4 + ["--deepspeed-config", path], 2)
    assert len(cfg.warnings) == 2
    assert "'zero_optimization.round_robin_gradients'" in cfg.warnings[0]
    assert "'wall_clock_breakdown'" in cfg.warnings[1]
    assert capsys.readouterr().err.count("megazero: config warning: --deepspeed-config") == 2
    assert (cfg.zero.stage, cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps) == (1, 4, 2)


def test_json_errors_name_file_line_and_key(files, capsys):
    path = files["json"]('{\n  "fp16": {"enabled": True}\n}', "bad.json")
    err = fails(M + ["--deepspeed-config", path], 1, capsys)
    assert path in err and "line 2" in err
    path = files["json"]({"zero_optimization": {"overlap_comm": "yes"}})
    err = fails(M + ["--deepspeed-config", path], 1, capsys)
    assert "zero_optimization.overlap_comm" in err and "true or false" in err
    err = fails(M + ["--deepspeed-config", files["DIR"] + "/absent.json"], 1, capsys)
    assert "--deepspeed-config" in err and "absent.json" in err


def test_save_into_a_used_directory_is_fine_when_resuming_it(files):
    ckpt = files["DIR"] + "/ckpt"
    cfg = config_from_argv(M + ["--save", ckpt, "--load", ckpt + "/"], 1)  # same directory, other spelling
    assert cfg.train.save == ckpt and cfg.train.load == ckpt + "/"


def test_offload_keys_are_read_from_deepspeed_json(files, capsys):
    """offload_optimizer.{device, pin_memory} fill --offload-optimizer / its pin switch (the seed
    file); NVMe parameter offload, an unknown device and the legacy cpu_offload switch are
    refused naming the key."""
    cfg = config_from_argv(M + ["--dp", "2", "--deepspeed-config", seed("seed004_stage2_offload_optimizer.json")], 2)
    z = cfg.zero
    assert (z.stage, z.offload_optimizer, z.offload_optimizer_pin_memory, z.offload_param) == (2, "cpu", True, "none")
    assert cfg.sources["zero.offload_optimizer"].startswith("zero_optimization.offload_optimizer.device in")
    path = files["json"](
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    )
    z = config_from_argv(M + ["--deepspeed-config", path], 1).zero
    assert (z.offload_optimizer, z.offload_optimizer_pin_memory) == ("cpu", False)
    for bad, key in (
        ({"offload_param": {"device": "disk"}}, "zero_optimization.offload_param.device"),
        ({"offload_optimizer": {"device": "disk"}}, "zero_optimization.offload_optimizer.device"),
        ({"cpu_offload": True}, "zero_optimization.cpu_offload"),
    ):
        path = files["json"]({"zero_optimization": {"stage": 2, **bad}})
        with pytest.raises(ConfigError, match="not supported by megazero") as exc:
            load_deepspeed_config(path, parse_args(M))
        assert key in str(exc.value)
    path = files["json"]({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    err = fails(M + ["--deepspeed-config", path], 1, capsys)
    assert "zero_optimization.offload_param.device" in err and "--zero-stage 3" in err


def test_nvme_offload_keys_are_read_from_deepspeed_json(files, capsys):
    """offload_optimizer.{device nvme, nvme_path, buffer_count}, sub_group_size and
    aio.thread_count fill their settings; the aio block's other knobs are named in a warning;
    nvme without a path stops naming --offload-nvme-path."""
    path = files["json"](
        {
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": 5e3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "buffer_count": 3, "pin_memory": True},
            },
            "aio": {"thread_count": 2, "block_size": 1048576},
        }
    )
    z = config_from_argv(M + ["--dp", "2", "--deepspeed-config", path], 2).zero
    assert (
        z.offload_optimizer,
        z.offload_nvme_path,
        z.offload_nvme_buffer_count,
        z.sub_group_size,
        z.offload_nvme_io_threads,
    ) == ("nvme", "/tmp/x", 3, 5000, 2)
    assert "'aio.block_size' is not honoured" in capsys.readouterr().err
    err = fails(M + ["--zero-stage", "2", "--offload-optimizer", "nvme"], 1, capsys)
    assert "--offload-optimizer nvme" in err and "--offload-nvme-path DIR" in err


def test_offload_param_nvme_keys_are_read_from_deepspeed_json(files, capsys):
    """offload_param.{device nvme, nvme_path, buffer_count, buffer_size, max_in_cpu} fill
    --offload-param nvme and its knobs (the path is --offload-nvme-path, shared with the
    optimizer's); pin_memory is named in the warning; two paths that disagree are refused naming
    both keys; nvme at stage 2 exits 2 naming --zero-stage 3."""
    block = {
        "device": "nvme",
        "nvme_path": "/tmp/p",
        "buffer_count": 3,
        "buffer_size": 2e4,
        "max_in_cpu": 1e3,
        "pin_memory": True,
    }
    doc = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": block}}
    z = config_from_argv(M + ["--dp", "2", "--deepspeed-config", files["json"](doc)], 2).zero
    assert (
        z.offload_param,
        z.offload_nvme_path,
        z.offload_param_buffer_count,
        z.offload_param_buffer_size,
        z.offload_param_max_in_cpu,
    ) == ("nvme", "/tmp/p", 3, 20_000, 1_000)
    assert "'zero_optimization.offload_param.pin_memory' is not honoured" in capsys.readouterr().err
    doc["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/tmp/o"}
    err = fails(M + ["--dp", "2", "--deepspeed-config", files["json"](doc, "two.json")], 2, capsys)
    assert "zero_optimization.offload_optimizer.nvme_path" in err and "zero_optimization.offload_param.nvme_path" in err
    doc["zero_optimization"].update(stage=2, offload_optimizer={"device": "cpu"})
    err = fails(M + ["--dp", "2", "--deepspeed-config", files["json"](doc, "s2.json")], 2, capsys)
    assert "zero_optimization.offload_param.device" in err and "--zero-stage 3" in err


def test_cp_comm_type_at_cp_1_is_a_warning(capsys):
    cfg = config_from_argv(M + ["--cp-comm-type", "a2a"], 1)
    assert cfg.parallel.cp == 1
    assert "--cp-comm-type has no effect at --cp 1" in capsys.readouterr().err


def test_deepspeed_sequence_parallel_size_is_ulysses_context_parallelism(files, capsys):
    """DeepSpeed-Ulysses' ``sequence_parallel_size`` N is --cp N over heads (a2a); a
    --cp-comm-type p2p or a disagreeing --cp on the command line is refused naming both; a value
    below 1 is refused naming the key."""
    path = files["json"]({"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 2})
    p = config_from_argv(M + ["--deepspeed-config", path], 2).parallel
    assert (p.cp, p.cp_comm_type, p.dp) == (2, "a2a", 1)
    err = fails(M + ["--cp-comm-type", "p2p", "--deepspeed-config", path], 2, capsys)
    assert "--cp-comm-type p2p on the command line conflicts with sequence_parallel_size = 2" in err
    p = config_from_argv(M + ["--cp-comm-type", "a2a", "--deepspeed-config", path], 2).parallel
    assert (p.cp, p.cp_comm_type) == (2, "a2a")
    err = fails(M + ["--cp", "4", "--deepspeed-config", path], 4, capsys)
    assert "--cp 4 on the command line conflicts with sequence_parallel_size = 2" in err
    # a --cp that agrees with the file keeps the file's meaning: Ulysses' all-to-all, not the ring
    p = config_from_argv(M + ["--cp", "2", "--deepspeed-config", path], 2).parallel
    assert (p.cp, p.cp_comm_type) == (2, "a2a")
    for bad in (0, -1):
        err = fails(M + ["--deepspeed-config", files["json"]({"sequence_parallel_size": bad})], 1, capsys)
        assert f"sequence_parallel_size = {bad} in" in err and "must be at least 1" in err


def test_parallel_sizes_read_the_deepspeed_file_for_a_size_not_given(files):
    """The launcher starts tp x cp x pp x dp ranks before any rank reads the config: a --cp left
    out comes from sequence_parallel_size; a size given nowhere is 1; a file that does not load
    gives 1s (its error comes from config_from_argv)."""
    from megazero.config import parallel_sizes, world_size_of

    path = files["json"]({"sequence_parallel_size": 2})
    assert parallel_sizes(["--tp", "2", "--deepspeed-config", path]) == (2, 2, 1, 1)
    assert world_size_of(["--dp", "3", "--deepspeed-config", path]) == 6
    assert parallel_sizes(["--pipeline-model-parallel-size", "2"]) == (1, 1, 2, 1)
    assert parallel_sizes(["--deepspeed-config", path + ".missing"]) == (1, 1, 1, 1)


def test_zero3_knobs_scale_with_the_hidden_size_and_auto_means_the_same(files):
    """ZeRO-3's prefetch bucket and persistence threshold default to 0.9 H^2 and 10 H (the
    Hugging Face DeepSpeed integration's "auto"); "auto" in a JSON file gives the same, and a
    number (flag or JSON) is kept."""
    z3 = M + ["--zero-stage", "3", "--dp", "2", "--hidden-size", "512", "--num-attention-heads", "8"]
    auto = {
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        }
    }
    for argv in (z3, z3 + ["--deepspeed-config", files["json"](auto)]):
        z = config_from_argv(argv, 2).zero
        assert (z.zero3_prefetch_bucket_size, z.zero3_param_persistence_threshold) == (235_929, 5_120)
    given = {
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5}
    }
    z = config_from_argv(z3 + ["--deepspeed-config", files["json"](given, "given.json")], 2).zero
    assert (z.zero3_prefetch_bucket_size, z.zero3_param_persistence_threshold) == (50_000_000, 100_000)
    z = config_from_argv(z3 + ["--zero3-prefetch-bucket-size", "0"], 2).zero
    assert (z.zero3_prefetch_bucket_size, z.zero3_param_persistence_threshold) == (0, 5_120)


def test_min_lr_defaults_to_2e_4_or_a_tenth_of_a_smaller_lr():
    """Without --min-lr: 2e-4 (the pretraining default, --lr 2e-3), a tenth of a fine-tuning --lr
    below 2e-4 (5e-7 -> 5e-8) instead of a refusal; a given --min-lr is kept, one above --lr refused."""
    from megazero.config import config_from_argv

    def min_lr(*extra):
        return config_from_argv(["--mock-data", *extra], 1).optim.min_lr

    assert min_lr() == 2e-4 and min_lr("--lr", "2e-4") == 2e-4
    assert min_lr("--lr", "5e-7") == pytest.approx(5e-8, rel=1e-12)
    assert min_lr("--lr", "5e-7", "--min-lr", "0") == 0.0
    with pytest.raises(SystemExit):
        config_from_argv(["--mock-data", "--lr", "5e-7", "--min-lr", "1e-6"], 1)


def test_window_layers_follow_megatron_is_layer_window_attention():
    """--window-size L,0 gives transformers' window W = L + 1 on the windowed layers; the integer
    --window-attn-skip-freq N makes the 1-based layers N, 2N, ... full, the 0/1 list picks them."""
    from megazero.config.shape import layer_window

    def windows(size, freq):
        return [layer_window(size, freq, n) for n in range(1, 5)]

    assert windows([5, 0], None) == [6, 6, 6, 6]
    assert windows([5, 0], [2]) == [6, None, 6, None]  # gpt-oss: even layers (0-based) windowed
    assert windows([5, 0], [3]) == [6, 6, None, 6]
    assert windows([5, 0], [1, 1, 0, 1]) == [6, 6, None, 6]
    assert windows([-1, 0], [2]) == [None] * 4  # L = -1: unbounded
    assert windows(None, None) == [None] * 4
