"""Monitor tests: FLOP formula against hand counts and torch's FLOP counter, peak table, MFU,
timers, memory units, unigram entropy, and the TensorBoard / metrics.jsonl / console output
read back with TensorBoard's own EventAccumulator."""

import json
import math
import os
import sys
import time

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from megazero.planning.flops import gpt_flops_per_iteration, mfu, peak_flops, peak_flops_for_name, throughput
from megazero.runtime.monitor import ITERATION_KEYS, Monitor, Timer, memory_stats, unigram_entropy
from tests.support.monitor import ITERATIONS
from tests.support.reference import ReferenceGPT

TINY = dict(
    num_layers=2,
    hidden_size=16,
    ffn_hidden_size=40,
    seq_length=8,
    padded_vocab_size=50,
    global_batch_size=3,
    num_heads=4,
)


def _hand_count(
    num_layers,
    hidden_size,
    ffn_hidden_size,
    seq_length,
    padded_vocab_size,
    global_batch_size,
    num_heads,
    layer_passes=3,
):
    """Sum 2*m*k*n over every matmul of the forward, by shape; backward = 2x forward."""
    B, s, h, f, V, n = (global_batch_size, seq_length, hidden_size, ffn_hidden_size, padded_vocab_size, num_heads)
    d = h // n
    mm = lambda m, k, nn: 2 * m * k * nn
    layer = (
        mm(B * s, h, 3 * h)  # x @ W_qkv^T
        + B * n * mm(s, d, s)  # q @ k^T per (batch, head)
        + B * n * mm(s, s, d)  # probs @ v per (batch, head)
        + mm(B * s, h, h)  # attention output projection
        + mm(B * s, h, f)  # fc1
        + mm(B * s, f, h)
    )  # fc2
    logits = mm(B * s, h, V)
    return layer_passes * num_layers * layer + 3 * logits


def test_flops_equal_hand_count_of_matmul_shapes():
    assert gpt_flops_per_iteration(**TINY) == _hand_count(**TINY)
    assert gpt_flops_per_iteration(**TINY, recompute=True) == _hand_count(**TINY, layer_passes=4)


def _measured_flops(recompute: bool) -> int:
    """FLOPs torch's FlopCounterMode sees in one forward+backward of the reference GPT."""
    torch.manual_seed(0)
    cfg = TINY
    model = ReferenceGPT(
        cfg["padded_vocab_size"],
        cfg["num_layers"],
        cfg["hidden_size"],
        cfg["num_heads"],
        cfg["ffn_hidden_size"],
        cfg["seq_length"],
    )
    tokens = torch.randint(0, cfg["padded_vocab_size"], (cfg["global_batch_size"], cfg["seq_length"]))
    counter = FlopCounterMode(display=False)
    # early stop would skip recomputing each block's last matmul (fc2), whose output no
    # backward needs; Megatron's count assumes the whole forward is recomputed
    with counter, set_checkpoint_early_stop(False):
        x = model.wte(tokens) + model.wpe(torch.arange(cfg["seq_length"]))  # (B, T, H)
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        logits = model.ln_f(x) @ model.wte.weight.t()  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("recompute", [False, True])
def test_flops_equal_torch_flop_counter_on_reference_gpt(recompute):
    assert gpt_flops_per_iteration(**TINY, recompute=recompute) == _measured_flops(recompute)


def test_flops_equal_narayanan_closed_form_for_ffn_4h():
    B, s, l, h, V = 512, 2048, 96, 12288, 51200  # GPT-3 175B (paper, Table 1 row)
    kw = dict(
        num_layers=l,
        hidden_size=h,
        ffn_hidden_size=4 * h,
        seq_length=s,
        padded_vocab_size=V,
        global_batch_size=B,
        num_heads=96,
    )
    no_recompute = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    with_recompute = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert gpt_flops_per_iteration(**kw) == pytest.approx(no_recompute, rel=1e-12)
    assert gpt_flops_per_iteration(**kw, recompute=True) == pytest.approx(with_recompute, rel=1e-12)


def test_flops_near_6_n_tokens_for_large_models():
    B, s, l, h, V = 512, 2048, 96, 12288, 51200
    f = 4 * h
    n_matmul_params = l * (4 * h * h + 2 * h * f) + V * h  # weights that multiply tokens
    tokens = B * s
    flops = gpt_flops_per_iteration(
        num_layers=l, hidden_size=h, ffn_hidden_size=f, seq_length=s, padded_vocab_size=V, global_batch_size=B
    )
    six_n = 6 * n_matmul_params * tokens
    attention = 3 * l * 4 * s * h * tokens  # the only term outside 6*N*tokens
    assert flops == six_n + attention
    assert 1.0 < flops / six_n < 1 + s / (6 * h)  # attention adds < s/(6h) = 2.8 %


def test_flops_errors_name_the_setting():
    with pytest.raises(ValueError, match="num_heads=5"):
        gpt_flops_per_iteration(**{**TINY, "num_heads": 5})
    with pytest.raises(ValueError, match="seq_length"):
        gpt_flops_per_iteration(**{**TINY, "seq_length": 0})


def test_peak_table_mfu_and_throughput():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", bf16) == 312e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", fp32) == 19.5e12
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", bf16) == 989e12
    assert peak_flops_for_name("NVIDIA H100 PCIe", bf16) == 756e12
    assert peak_flops_for_name("NVIDIA H200", torch.float16) == 989e12
    assert peak_flops_for_name("Tesla V100-SXM2-32GB", torch.float16) == 125e12
    assert peak_flops_for_name("Tesla V100-SXM2-32GB", bf16) is None
    assert peak_flops_for_name("NVIDIA GeForce GTX 1080", bf16) is None
    assert peak_flops("cpu", bf16) is None
    # --tf32: fp32 matmuls run on TF32 tensor cores, so MFU is against the TF32 peak (not ~7x FP32's)
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", fp32, tf32=True) == 494.5e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", fp32, tf32=True) == 156e12
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", bf16, tf32=True) == 989e12  # bf16 matmuls: unchanged
    assert peak_flops_for_name("Tesla V100-SXM2-32GB", fp32, tf32=True) == 15.7e12  # no TF32 there
    assert mfu(156e12, 312e12) == 0.5
    assert mfu(156e12, None) is None
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 0.0)
    perf = throughput(
        flops_per_iteration=8e12,
        tokens_per_iteration=4096,
        iteration_time_s=2.0,
        world_size=4,
        peak_flops_per_device=4e12,
    )
    assert perf == {"tokens_per_s": 2048.0, "tflops_per_device": 1.0, "mfu": 0.25}


def _trainer_flops(rank, world, argv):
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology

    cfg = config_from_argv(argv, world)
    p = cfg.parallel
    groups = ProcessGroups.build(Topology(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp))
    return training.build_trainer(cfg, groups=groups).flops_per_iteration


def test_trainer_counts_the_windowed_layers_keys():
    """The trainer's FLOPs read each layer's window: ``--window-size 3,0 --window-attn-skip-freq 2``
    on BASE's 4 layers (s 16, width 32, 16 sequences) windows layers 1 and 3 to W = 4 keys, so
    two layers lose ``3 * 16*16 * 2*2*(16 - 4)*32`` each."""
    from tests.support.distributed import run_distributed
    from tests.support.layouts import BASE

    full = run_distributed(_trainer_flops, 1, BASE)[0]
    windowed = run_distributed(_trainer_flops, 1, BASE + ["--window-size", "3,0", "--window-attn-skip-freq", "2"])[0]
    assert full - windowed == 2 * 3 * 16 * 16 * 2 * 2 * (16 - 4) * 32


def test_model_flops_per_iteration_do_not_change_with_cp():
    """Context parallelism splits each sequence, not the batch: the trainer's FLOPs per iteration
    (the same tokens, the attention counted over the whole sequence) at cp 2 equal dp 2's."""
    from tests.support.distributed import run_distributed
    from tests.support.layouts import BASE

    flops = {flag: run_distributed(_trainer_flops, 2, BASE + [flag, "2"]) for flag in ("--cp", "--dp")}
    assert flops["--cp"] == flops["--dp"] and flops["--cp"][0] > 0


def test_windowed_layers_count_the_keys_in_their_window():
    """A sliding window W charges its layer's attention ``min(W, s)`` keys per query: W >= s
    is the full layer's count, W = 1 the diagonal only, and a window on one layer of two
    removes ``3 * B*s * 2*2*(s - W)*a`` (forward + backward, the two attention matmuls, width
    a). Per query that is the exact causal count ``sum_i min(i + 1, W)`` plus the masked
    ``W (W - 1) / 2`` corner, as the full count adds the masked triangle."""
    from megazero.planning.flops import attention_keys, spec_flops_per_iteration
    from model.config import GPTConfig

    B, s, a = 3, 8, 16
    spec = GPTConfig(vocab_size=50, num_layers=2, hidden_size=a, num_attention_heads=4, seq_length=s).parameter_spec(1)
    kw = dict(seq_length=s, attention_width=a, global_batch_size=B)
    full = spec_flops_per_iteration(spec, **kw)
    assert (
        spec_flops_per_iteration(spec, **kw, windows=[s, 10 * s])
        == spec_flops_per_iteration(spec, **kw, windows=[None, None])
        == full
    )
    assert full - spec_flops_per_iteration(spec, **kw, windows=[1, 1]) == 3 * B * s * 2 * (2 * 2 * (s - 1) * a)
    assert full - spec_flops_per_iteration(spec, **kw, windows=[3, None]) == 3 * B * s * 2 * 2 * (s - 3) * a
    for W in range(1, 2 * s):
        w = min(W, s)
        assert s * attention_keys(s, W) == sum(min(i + 1, W) for i in range(s)) + w * (w - 1) // 2
    with pytest.raises(ValueError, match="3 layers' windows"):
        spec_flops_per_iteration(spec, **kw, windows=[1, 2, 3])
    with pytest.raises(ValueError, match="--window-size"):
        attention_keys(s, 0)


@pytest.mark.cuda
def test_cuda_peak_timer_and_memory():
    dev = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(dev)
    assert peak_flops(dev, torch.bfloat16) == peak_flops_for_name(name, torch.bfloat16)
    torch.cuda.reset_peak_memory_stats(dev)
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)
    assert memory_stats(dev)["peak_bytes"] >= x.numel()
    with Timer(dev) as t:
        torch.cuda._sleep(10_000_000)  # a kernel that spins; sync makes the timer wait
    assert t.elapsed > 0.0


def test_timer_measures_seconds_and_guards_misuse():
    t = Timer("cpu")
    with t:
        time.sleep(0.05)
    first = t.elapsed
    assert 0.05 <= first < 1.0
    t.start()
    time.sleep(0.02)
    assert 0.02 <= t.stop() < 1.0
    assert t.elapsed > first
    assert t.reset() > first and t.elapsed == 0.0
    with pytest.raises(RuntimeError, match="not running"):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError, match="running"):
        t.start()


def test_cpu_memory_is_peak_rss_in_bytes():
    with open("/proc/self/statm") as f:
        resident_bytes = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    stats = memory_stats("cpu")
    assert stats["source"] == "ru_maxrss"
    # peak >= current resident set (up to the kernel's lazily synced per-CPU RSS counters);
    # a KiB value left unconverted would be ~1000x smaller
    assert 0.9 * resident_bytes <= stats["peak_bytes"] < 64 * resident_bytes


def test_unigram_entropy():
    for k in (1, 2, 7, 1001):
        assert unigram_entropy(np.full(k, 13)) == pytest.approx(math.log(k), abs=1e-12)
    one_hot = np.zeros(50, dtype=np.int64)
    one_hot[3] = 40
    assert unigram_entropy(one_hot) == 0.0
    p = np.array([0.25, 0.75])
    assert unigram_entropy(np.array([1, 3, 0])) == pytest.approx(-(p * np.log(p)).sum())
    with pytest.raises(ValueError):
        unigram_entropy(np.array([1, -1]))
    with pytest.raises(ValueError):
        unigram_entropy(np.zeros(4))


TAGS = {
    "train/loss": "loss",
    "train/lr": "lr",
    "train/grad_norm": "grad_norm",
    "train/loss_scale": "loss_scale",
    "train/skipped_iterations": "skipped_iterations",
    "train/consumed_samples": "consumed_samples",
    "perf/iteration_time_s": "iteration_time_s",
    "perf/tokens_per_s": "tokens_per_s",
    "perf/tflops_per_device": "tflops_per_device",
    "perf/mfu": "mfu",
    "memory/model_state_bytes": "model_state_bytes",
    "memory/peak_bytes": "peak_memory_bytes",
}


def _as_float(v):
    return None if v is None else float(v.item() if hasattr(v, "item") else v)


def _run_logging(tmp_path, capsys):
    config = "tp: 2\npp: 1\nhidden_size: 64"
    with Monitor(
        str(tmp_path / "run"),
        tensorboard_dir="tb",
        metrics_file="metrics.jsonl",
        rank=3,
        is_logging_rank=True,
        config_text=config,
        train_iters=100,
    ) as mon:
        mon.log_memory_breakdown({"params": 2**20, "grads": 2**20, "optimizer": 6 * 2**20})
        for it, values in ITERATIONS.items():
            mon.log_iteration(it, values)
        mon.log_iteration(30, {"loss": 4.0})
        mon.log_validation(20, 4.75)
        mon.summary(4.0, math.log(50), "once upon a time")
    return config, capsys.readouterr().out.splitlines()


def test_tensorboard_events_hold_the_logged_values(tmp_path, capsys):
    config, _ = _run_logging(tmp_path, capsys)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for tag, key in TAGS.items():
        got = {e.step: e.value for e in acc.Scalars(tag)}
        want = {it: np.float32(_as_float(v[key])) for it, v in ITERATIONS.items() if v[key] is not None}
        if key == "loss":
            want[30] = np.float32(4.0)
        assert got == want, tag
    assert [(e.step, e.value) for e in acc.Scalars("valid/loss")] == [(20, np.float32(4.75))]
    assert acc.Scalars("valid/ppl")[0].value == np.float32(math.exp(4.75))
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    for line in config.splitlines():
        assert "    " + line in text


def test_metrics_jsonl_has_one_record_per_call(tmp_path, capsys):
    _run_logging(tmp_path, capsys)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["kind"] for r in records] == ["memory", "train", "train", "train", "valid", "summary"]
    train = records[1:4]
    for r in train:
        assert set(r) == {"kind", "wall_time", *ITERATION_KEYS}
    assert [r["iteration"] for r in train] == [10, 20, 30]
    for r, (it, values) in zip(train, ITERATIONS.items()):
        for key, v in values.items():
            assert r[key] == pytest.approx(_as_float(v), rel=1e-7) if v is not None else r[key] is None, key
    assert train[2]["loss"] == 4.0 and train[2]["lr"] is None
    assert records[0]["bytes"] == {"params": 2**20, "grads": 2**20, "optimizer": 6 * 2**20}
    assert records[4]["loss"] == 4.75 and records[4]["ppl"] == pytest.approx(math.exp(4.75))
    assert records[5]["loss_to_unigram"] == pytest.approx(4.0 / math.log(50))


def test_console_lines_contain_every_field(tmp_path, capsys):
    _, lines = _run_logging(tmp_path, capsys)
    assert lines[0] == ("[rank 3] model state: params 1.00 MiB | grads 1.00 MiB | optimizer 6.00 MiB | total 8.00 MiB")
    first, second, missing = lines[1:4]
    for expected in (
        "iteration 10/100",
        "consumed samples: 80",
        "elapsed time per iteration (ms): 125.0",
        "tokens/s: 9830.4",
        "TFLOP/s/device: 0.012",
        "MFU: 37.50%",
        "learning rate: 3.000E-04",
        "loss: 5.250000E+00",
        "grad norm: 1.500",
        "loss scale: 65536",
        "skipped iterations: 0",
        "model state: 12.00 MiB",
        "peak memory: 210.00 MiB",
    ):
        assert expected in first, expected
    assert "MFU: n/a" in second and "skipped iterations: 1" in second
    assert missing.startswith("iteration 30/100 | consumed samples: n/a")
    assert missing.count("n/a") == len(ITERATION_KEYS) - 2  # all but iteration and loss
    assert lines[4] == "validation at iteration 20 | loss: 4.750000E+00 | perplexity: 115.6"
    assert lines[5].startswith("final validation loss: 4.0000 nats/token (perplexity 54.60)")
    assert "unigram baseline: 3.9120 nats/token (perplexity 50.00)" in lines[5]
    assert lines[5].endswith(f"loss / baseline: {4.0 / math.log(50):.3f}")
    assert lines[6] == "sample: once upon a time"


def test_non_logging_rank_writes_nothing_but_its_memory_line(tmp_path, capsys):
    mon = Monitor(
        str(tmp_path / "run"),
        tensorboard_dir="tb",
        metrics_file="metrics.jsonl",
        rank=1,
        is_logging_rank=False,
        config_text="x",
    )
    mon.log_iteration(1, {"loss": 1.0})
    mon.log_validation(1, 1.0)
    mon.log_memory_breakdown({"params": 3 * 2**19})
    mon.summary(1.0, 2.0, "s")
    mon.close()
    assert capsys.readouterr().out == "[rank 1] model state: params 1.50 MiB | total 1.50 MiB\n"
    assert not (tmp_path / "run").exists()


def test_unknown_iteration_key_is_an_error(tmp_path):
    with Monitor(
        str(tmp_path), tensorboard_dir=None, metrics_file=None, rank=0, is_logging_rank=True, config_text=""
    ) as mon:
        with pytest.raises(ValueError, match="gradnorm"):
            mon.log_iteration(1, {"gradnorm": 1.0})
        with pytest.raises(ValueError, match="differs"):
            mon.log_iteration(2, {"iteration": 3})


def test_metrics_jsonl_is_strict_json_with_null_for_nan(tmp_path, capsys):
    with Monitor(
        str(tmp_path / "run"),
        tensorboard_dir=None,
        metrics_file="metrics.jsonl",
        rank=0,
        is_logging_rank=True,
        config_text="",
        train_iters=2,
    ) as mon:
        mon.log_iteration(1, {"loss": float("nan"), "grad_norm": float("inf")})
        mon.summary(None, float("nan"), "")

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line, parse_constant=refuse) for line in f]
    assert records[0]["loss"] is None and records[0]["grad_norm"] is None
    assert all(v is None or not isinstance(v, float) or math.isfinite(v) for r in records for v in r.values())


def test_model_state_table_is_one_write_by_the_logging_rank(tmp_path, monkeypatch):
    """Every rank's model-state row (gathered by the caller) is printed by the logging rank as
    one table in a single write, so ranks sharing a console cannot interleave inside it."""
    import io

    rows = [
        dict(rank=1, psi=1000, bytes={"params": 2**20, "buckets": 2**10}, formula=2**20),
        dict(rank=0, psi=2000, bytes={"params": 2**21, "buckets": 0}, formula=2**21),
    ]

    class Out(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    for logging, expect_writes in ((False, 0), (True, 1)):
        writes = []
        monkeypatch.setattr(sys, "stdout", Out())
        with Monitor(
            str(tmp_path / str(logging)),
            tensorboard_dir=None,
            metrics_file="m.jsonl",
            rank=0,
            is_logging_rank=logging,
            config_text="",
        ) as mon:
            mon.log_model_state_table(rows, note="ZeRO-0")
        monkeypatch.undo()
        assert len(writes) == expect_writes
    lines = writes[0].splitlines()
    assert lines[0] == "model state per rank: ZeRO-0"
    assert lines[1].split() == ["rank", "Psi", "params", "buckets", "total", "w/o", "buckets", "ZeRO", "formula"]
    assert lines[2].split() == ["0", "2000"] + ["2.00", "MiB", "0.00", "MiB"] + ["2.00", "MiB"] * 3
    assert lines[3].split()[:2] == ["1", "1000"] and lines[3].split()[-2:] == ["1.00", "MiB"]
    records = [json.loads(x) for x in (tmp_path / "True" / "m.jsonl").read_text().splitlines()]
    assert [r["rank"] for r in records if r["kind"] == "memory"] == [0, 1]


def test_a_run_without_validation_prints_its_baseline_as_not_available(tmp_path, capsys):
    """No validation ran (or it counted no token): the summary says n/a, not nan."""
    mon = Monitor(
        str(tmp_path / "run"),
        tensorboard_dir=None,
        metrics_file="metrics.jsonl",
        rank=0,
        is_logging_rank=True,
        config_text="",
    )
    mon.summary(None, None, "hello")
    mon.close()
    line = capsys.readouterr().out.splitlines()[0]
    assert line == (
        "final validation loss: n/a nats/token (perplexity n/a) | unigram baseline: n/a nats/token "
        "(perplexity n/a) | loss / baseline: n/a"
    )


def test_the_trainer_asks_for_the_peak_of_the_precision_its_matmuls_run_in(monkeypatch):
    """perf_values passes --tf32 to the peak lookup (an fp32 run with --tf32 on an H100 has a
    494.5 TFLOP/s denominator, not FP32's 67)."""
    from types import SimpleNamespace

    from megazero.training import loop

    asked = []
    monkeypatch.setattr(loop, "peak_flops", lambda device, dtype, tf32=False: asked.append(tf32) or 494.5e12)
    for tf32 in (True, False):
        cfg = SimpleNamespace(
            train=SimpleNamespace(global_batch_size=8),
            model=SimpleNamespace(seq_length=16),
            log=SimpleNamespace(peak_tflops=None),
            precision=SimpleNamespace(tf32=tf32),
        )
        trainer = SimpleNamespace(
            flops_per_iteration=1e12,
            groups=SimpleNamespace(world_size=1),
            device=torch.device("cpu"),
            dtype=torch.float32,
            optimizer=SimpleNamespace(model_state_bytes=lambda: {"total": 0}),
        )
        assert loop.perf_values(trainer, cfg, 1.0)["mfu"] == pytest.approx(1e12 / 494.5e12)
    assert asked == [True, False]
