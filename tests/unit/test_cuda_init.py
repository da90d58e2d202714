"""CUDA start-up order and launch settings, checked on CPU with spies on ``torch.cuda``.

Every CUDA call that names no device runs on the current device, GPU 0 until
``torch.cuda.set_device`` says otherwise: a rank that asks ``torch.cuda.mem_get_info()``
or starts NCCL before setting its device opens a context (hundreds of MiB) on GPU 0, and
NCCL then sees every rank on one GPU. The spies record each context-opening call; the
entry points must call ``set_device(LOCAL_RANK)`` before all of them. The second
half tests the CUDA_DEVICE_MAX_CONNECTIONS rule (megazero/runtime/launch.py).
"""

import os
import signal

import pytest
import torch

from megazero.config import config_from_argv
from megazero.runtime import launch as L

TINY = [
    "--mock-data",
    "--vocab-size",
    "64",
    "--num-layers",
    "2",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "8",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--train-iters",
    "1",
]
#: torch.cuda functions that open a context (or need one) on the current device
CONTEXT_CALLS = (
    "mem_get_info",
    "init",
    "synchronize",
    "current_device",
    "get_device_properties",
    "memory_allocated",
    "max_memory_allocated",
    "empty_cache",
    "Stream",
    "Event",
)


class Reached(Exception):
    """Raised by the spy that stands for the process group: start-up got that far."""


@pytest.fixture
def cuda_spies(monkeypatch):
    """A two-GPU machine as ``torch.cuda`` shows it, recording the calls in order; the
    process group's creation (the next context-opening step) records and stops the run."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda d: calls.append(f"set_device({d if isinstance(d, torch.device) else torch.device('cuda', d)})"),
    )
    from types import SimpleNamespace

    gpu = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 << 30)
    for name in CONTEXT_CALLS:  # free/total bytes for mem_get_info; an H100 for get_device_properties
        value = gpu if name == "get_device_properties" else (80 << 30, 80 << 30)
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, _v=value, **k: calls.append(_n) or _v)

    def init_process_group(*a, **k):
        calls.append(f"init_process_group({k.get('device_id')})")
        raise Reached

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    for k, v in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    for k in ("TORCHELASTIC_RUN_ID", "MEGAZERO_PREFLIGHT_DONE", L.MAX_CONNECTIONS):
        monkeypatch.delenv(k, raising=False)
    before = set(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield calls
    for k in set(os.environ) - before:  # the flight recorder's variables train.py set
        del os.environ[k]
    for s, h in handlers.items():
        signal.signal(s, h)


def test_train_sets_its_device_before_any_cuda_context(cuda_spies, tmp_path, capsys):
    """training.main on rank 1 of 2 (--tp 2) with --device cuda: set_device(1) comes before the
    memory check's mem_get_info and before NCCL (bound to cuda:1); on the way the flight
    recorder is enabled into the run directory and the missing CUDA_DEVICE_MAX_CONNECTIONS=1
    is named."""
    from megazero import training

    with pytest.raises(Reached):
        training.main(TINY + ["--device", "cuda", "--tp", "2", "--run-dir", str(tmp_path)])
    assert cuda_spies[0] == "set_device(cuda:1)", cuda_spies
    assert "mem_get_info" in cuda_spies and cuda_spies[-1] == "init_process_group(cuda:1)", cuda_spies
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace" / "rank_")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and (tmp_path / "nccl_trace").is_dir()
    assert capsys.readouterr().err == ""  # rank 1 prints no warning; rank 0 would name the variable


def test_inference_ranks_set_their_device_before_any_cuda_context(cuda_spies):
    """A rank of ``python -m scripts.generate`` / ``scripts.evaluate`` (rank 1 of 2, --device cuda)
    joins through ``megazero.training.inference.join_tp_ranks``: set_device(1), then NCCL."""
    from megazero.training.inference import join_tp_ranks

    with pytest.raises(Reached):
        join_tp_ranks("cuda", 2, timeout_s=300)
    assert cuda_spies == ["set_device(cuda:1)", "init_process_group(cuda:1)"], cuda_spies


def _cfg(*flags, world=None):
    a = list(flags)
    size = 1
    for f in ("--tp", "--cp", "--dp"):
        size *= int(a[a.index(f) + 1]) if f in a else 1
    return config_from_argv(TINY + a, world or size)


@pytest.mark.parametrize(
    "flags,value,reason",
    [
        ((), None, "no tensor- or context-parallel overlap"),
        (("--dp", "2", "--zero-stage", "3"), None, "no tensor- or context-parallel overlap"),
        (("--tp", "2"), "1", "async tensor-parallel input-gradient reduction (--tp 2)"),
        (("--tp", "2", "--sequence-parallel"), "1", "(--tp 2, --sequence-parallel)"),
        (("--tp", "2", "--no-async-tensor-model-parallel-allreduce"), None, "no tensor- or context-parallel"),
        (("--cp", "2"), "1", "ring attention's K/V exchange (--cp 2)"),
        (("--cp", "2", "--cp-comm-type", "a2a"), None, "no tensor- or context-parallel overlap"),
        (("--tp", "2", "--dp", "2", "--zero-stage", "3"), None, "ZeRO-3's prefetch all-gathers want several"),
    ],
)
def test_max_connections_rule(flags, value, reason):
    """1 where tp or cp overlap communication with compute, CUDA's default for data
    parallelism and ZeRO-3 (Megatron-LM's rule, with FSDP standing for ZeRO-3)."""
    got, why = L.max_connections_rule(_cfg(*flags))
    assert got == value and reason in why, why


def test_launch_exports_and_the_warning_keep_a_users_value():
    cfg = _cfg("--tp", "2")
    assert [x[:2] for x in L.launch_exports(cfg, {})] == [("CUDA_DEVICE_MAX_CONNECTIONS", "1")]
    assert L.launch_exports(cfg, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == []
    assert "CUDA_DEVICE_MAX_CONNECTIONS is '8'" in L.max_connections_warning(cfg, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert "is unset" in L.max_connections_warning(cfg, {})
    assert L.max_connections_warning(cfg, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) is None
    zero3 = _cfg("--tp", "2", "--dp", "2", "--zero-stage", "3")
    assert L.launch_exports(zero3, {}) == [] and L.max_connections_warning(zero3, {}) is None
    assert "serialises ZeRO-3's prefetch" in L.max_connections_warning(zero3, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert L.launch_exports(_cfg(), {}) == [] and L.max_connections_warning(_cfg(), {}) is None


def test_the_launcher_exports_expandable_segments_on_cuda_and_keeps_a_users_value():
    """On CUDA the caching allocator gets expandable segments (variable block sizes fragment
    fixed ones); a value the user set under either name is kept; nothing on a CPU run."""
    cfg = _cfg("--tp", "2")
    names = [x[:2] for x in L.launch_exports(cfg, {}, cuda=True)]
    assert names == [("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")]
    assert [x[:2] for x in L.launch_exports(_cfg(), {}, cuda=True)] == [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    ]
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        assert L.launch_exports(_cfg(), {name: "max_split_size_mb:128"}, cuda=True) == []
    assert L.launch_exports(_cfg(), {}, cuda=False) == []
    assert L.launch_exports(_cfg("--device", "cpu"), {}) == []


def test_preflight_writes_the_launchers_exports(tmp_path):
    from megazero import training

    out = tmp_path / "exports"
    assert training.preflight(TINY + ["--tp", "2", "--device", "cpu", "--run-dir", str(tmp_path)], 2, str(out)) == 0
    lines = out.read_text().splitlines()
    assert lines[1] == "export CUDA_DEVICE_MAX_CONNECTIONS=1" and lines[0].startswith("# the async tensor-parallel")
    assert training.preflight(TINY + ["--device", "cpu", "--run-dir", str(tmp_path)], 1, str(out)) == 0
    assert out.read_text() == ""


def test_cuda_batches_are_copied_from_pinned_memory_without_blocking(monkeypatch):
    """training.dp_micro_batches on a CUDA device pins each host tensor and copies it with
    non_blocking=True (on CPU: plain .to); spies stand for the CUDA copies."""
    from megazero import training
    from megazero.process_groups import ProcessGroups

    cfg = config_from_argv(TINY, 1)
    data = training.build_data(cfg).train
    copies = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: copies.append("pin") or self)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and str(args[0]).startswith("cuda"):
            copies.append(("to", str(args[0]), kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    batches = training.dp_micro_batches(data, 0, cfg, ProcessGroups.single(), torch.device("cuda", 0))
    assert len(batches) == 2
    assert copies == ["pin", ("to", "cuda:0", True)] * 4
    copies.clear()
    training.dp_micro_batches(data, 0, cfg, ProcessGroups.single(), torch.device("cpu"))
    assert copies == []
