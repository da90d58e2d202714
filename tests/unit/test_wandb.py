"""Weights & Biases logging (offline) gets exactly TensorBoard's scalars; --peak-tflops sets the
MFU denominator; a missing wandb package is a config error before launch."""

import glob
import json
import math
import struct

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.extras import require
from tests.support.monitor import ITERATIONS


def _records(raw: bytes):
    """Records of wandb's LevelDB-style log: a 7-byte ``:W&B`` header, then 32 KiB blocks of
    chunks with a 7-byte header (crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    assert raw[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer padding
            pos += left
            continue
        buf, pos = buf + raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            yield buf
            buf = b""


def wandb_history(save_dir: str) -> tuple[dict, dict]:
    """(tag -> {step: value}, summary key -> value) of the offline run under ``save_dir``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{save_dir}/wandb/offline-run-*/run-*.wandb")
    history, summary = {}, {}
    for data in _records(open(path, "rb").read()):
        record = pb.Record.FromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for tag, value in items.items():
                if not tag.startswith("_"):
                    history.setdefault(tag, {})[items["_step"]] = value
        elif kind == "summary":
            for i in record.summary.update:
                summary[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return history, summary


@pytest.fixture
def offline(monkeypatch, tmp_path):
    require("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # wandb's own cache/config stay in the test dir
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))


def test_offline_run_holds_exactly_the_tensorboard_scalars(tmp_path, offline, capsys):
    from megazero.runtime.monitor import Monitor

    wb = dict(project="megazero-test", name="unit", save_dir=str(tmp_path / "wb"), config={"tp": 2})
    with Monitor(
        str(tmp_path / "run"),
        tensorboard_dir="tb",
        metrics_file=None,
        rank=0,
        is_logging_rank=True,
        config_text="tp: 2",
        train_iters=100,
        wandb=wb,
    ) as mon:
        for it, values in ITERATIONS.items():
            mon.log_iteration(it, values)
        mon.log_validation(20, 4.75)
        mon.summary(4.0, math.log(50), "once upon a time")
    history, summary = wandb_history(str(tmp_path / "wb"))
    acc = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tb_tags = acc.Tags()["scalars"]
    assert sorted(history) == sorted(tb_tags)  # the same tags, the same steps, the same values
    for tag in tb_tags:
        tb = {e.step: e.value for e in acc.Scalars(tag)}
        assert {s: np.float32(v) for s, v in history[tag].items()} == tb, tag
    assert history["train/loss"] == {10: 5.25, 20: 4.5} and history["perf/mfu"] == {10: 0.375}
    assert summary["final_valid_loss"] == 4.0 and summary["sample_text"] == "once upon a time"


def test_missing_wandb_is_a_config_error(monkeypatch, capsys):
    import importlib.util

    from megazero.config import config_from_argv

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        config_from_argv(["--mock-data", "--wandb-project", "p"], 1)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--wandb-project p needs the wandb package" in err and "pip install" in err


def test_training_run_sends_its_scalars_to_wandb_with_peak_tflops_mfu(tmp_path, offline, capsys):
    from megazero import training

    run = tmp_path / "run"
    argv = [
        "--mock-data",
        "--vocab-size",
        "64",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "8",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "3",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--device",
        "cpu",
        "--make-vocab-size-divisible-by",
        "8",
        "--run-dir",
        str(run),
        "--wandb-project",
        "megazero-test",
        "--wandb-exp-name",
        "tiny",
        "--peak-tflops",
        "0.5",
    ]
    assert training.main(argv) == 0
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    logged = [r for r in records if r["kind"] == "train"]
    assert [r["iteration"] for r in logged] == [1, 2, 3]
    for r in logged:  # MFU = achieved TFLOP/s per device / --peak-tflops
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5, rel=1e-12)
    history, _ = wandb_history(str(run / "wandb"))
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("mfu", "perf/mfu")):
        assert history[tag] == {r["iteration"]: r[key] for r in logged}, tag
