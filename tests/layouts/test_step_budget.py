"""Host-sync and launch budget of one training step, checked on CPU ranks.

A GPU step is fast only when the host queues work ahead of the device: every read of a device
value on the host (``aten._local_scalar_dense`` behind ``.item()``/``float()``/``bool()``,
``Tensor.tolist``) and every ``torch.cuda.synchronize`` drains the queue. These tests count
them in ``Trainer.train_step`` under a ``TorchDispatchMode`` with ``Tensor.tolist`` and
``torch.cuda.synchronize`` wrapped (gloo ranks; the same Python runs on CUDA): at most 3 host
reads per step and no device-wide synchronize at all, the step timer included (CUDA events,
read on log steps only: ``megazero.runtime.monitor.Timer``). In the optimizer step they count
the kernel calls that scaled with the number of buckets: fused AdamW at most twice per buffer
(one per weight-decay value), one multi-tensor norm call per step, whatever the number of
bucket pieces (the CUDA path of ``optim.clip.squared_sum``, forced here: on the CPU it sums
rows per piece). Gradients kept in the model dtype (``--grads-in-model-dtype``) are the
exception: AdamW reads them from an fp32 scratch of one piece (the memory bound allows no
more), so there it is at most 2 calls per piece (``DistributedOptimizer.windows``).
"""

import collections

import pytest
import torch

from tests.support.distributed import run_distributed

BASE = [
    "--mock-data",
    "--vocab-size",
    "1001",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "0.05",
    "--seed",
    "7",
    "--make-vocab-size-divisible-by",
    "8",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
    "--reduce-bucket-size",
    "2000",
    "--train-iters",
    "3",
]
DP2 = ["--dp", "2"]
LAYOUTS = {
    "zero1-overlap": DP2 + ["--zero-stage", "1", "--overlap-param-gather", "on"],
    "zero2-bf16": DP2 + ["--zero-stage", "2", "--bf16"],
    "zero2-bf16-model-dtype": DP2 + ["--zero-stage", "2", "--bf16", "--grads-in-model-dtype"],
    "zero2-fp16": DP2 + ["--zero-stage", "2", "--fp16"],
    "zero2-offload": DP2 + ["--zero-stage", "2", "--bf16", "--offload-optimizer", "cpu"],
    "zero3": DP2 + ["--zero-stage", "3"],
    "pp2": ["--pp", "2", "--zero-stage", "0"],
}
MAX_HOST_READS = 3
STEPS = 3


def _counting_run(rank, world, argvs):
    from torch.utils._python_dispatch import TorchDispatchMode

    from megazero.training import build_trainer

    counts = collections.Counter()

    class Spy(TorchDispatchMode):
        phase = "model"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name == "aten._local_scalar_dense.default":
                counts["reads"] += 1
            elif self.phase == "optimizer" and "fused_adam" in name:
                counts["adam"] += 1
            elif self.phase == "optimizer" and "norm" in name:
                counts["norm"] += 1
            return func(*args, **(kwargs or {}))

    def wrap(owner, name, key):
        original = getattr(owner, name)

        def counted(*a, **k):
            counts[key] += 1
            return original(*a, **k)

        setattr(owner, name, counted)
        return original

    from megazero.optim import clip

    clip.uses_rows = lambda device: False  # count the norm's launches on the path CUDA takes

    out = {}
    tolist = wrap(torch.Tensor, "tolist", "reads")
    synchronize = wrap(torch.cuda, "synchronize", "synchronize")
    try:
        for argv in argvs:
            trainer = build_trainer(argv, world)
            spy = Spy()
            step = trainer.optimizer.step

            def optimizer_step(*a, **k):
                spy.phase = "optimizer"
                try:
                    return step(*a, **k)
                finally:
                    spy.phase = "model"

            trainer.optimizer.step = optimizer_step
            per_step = []
            for _ in range(STEPS):
                batches = trainer.next_batches()
                counts.clear()
                with spy:
                    loss = trainer.train_step(batches).values["loss"]
                per_step.append(dict(counts, loss=loss))
            out[" ".join(argv[len(BASE) :])] = dict(
                steps=per_step,
                buffers=len(trainer.ddp.buffers),
                pieces=len(trainer.optimizer.pieces),
                windows=len(getattr(trainer.optimizer, "windows", ())),
            )
            trainer.close()
    finally:
        torch.Tensor.tolist, torch.cuda.synchronize = tolist, synchronize
    return out


def test_train_step_host_reads_and_launches_within_budget():
    argvs = [BASE + flags for flags in LAYOUTS.values()]
    for rank, results in enumerate(run_distributed(_counting_run, 2, argvs, timeout_s=900)):
        for name, r in results.items():
            where = f"{name} rank {rank}"
            # the budget would be met trivially with one bucket per buffer
            assert r["pieces"] > 2 * r["buffers"], where
            # model-dtype gradients go through an fp32 scratch of one piece: a window per piece;
            # fp32 gradients (and the offloaded host copy): a window per buffer
            model_dtype = "--grads-in-model-dtype" in name
            calls = 2 * (r["pieces"] if model_dtype else r["buffers"])
            for i, c in enumerate(r["steps"]):
                assert c.get("reads", 0) <= MAX_HOST_READS, f"{where} step {i + 1}: {c}"
                assert c.get("synchronize", 0) == 0, f"{where} step {i + 1}: {c}"
                if "fp16" in name and i == 0:
                    continue  # the first fp16 steps may skip on overflow: no update
                assert 1 <= c.get("adam", 0) <= calls, f"{where} step {i + 1}: {c}"
                assert c.get("norm", 0) <= r["buffers"], f"{where} step {i + 1}: {c}"
            assert r["windows"] == (r["pieces"] if model_dtype else r["buffers"]), where


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: ``record`` reads a clock advanced 5 ms per mark."""

    clock = 0.0
    synchronized = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        _FakeEvent.clock += 5.0
        self.t = _FakeEvent.clock

    def synchronize(self):
        _FakeEvent.synchronized += 1

    def elapsed_time(self, end):
        return end.t - self.t


def test_step_timer_never_synchronizes_the_device(monkeypatch):
    """The training loop's use of the timer (``training.run_loop``: ``with timer`` around every
    step, ``timer.reset()`` on log steps) on a CUDA device, with ``torch.cuda`` faked: no
    ``torch.cuda.synchronize``; the events are waited for once per log step."""
    from megazero.runtime.monitor import Timer

    device_syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: device_syncs.append(a))
    monkeypatch.setattr(_FakeEvent, "clock", 0.0)
    monkeypatch.setattr(_FakeEvent, "synchronized", 0)
    timer, logged = Timer(torch.device("cuda", 0)), []
    for it in range(1, 11):
        with timer:
            _FakeEvent.clock += 10.0  # the step's work: start -> stop is 15 ms of clock
        if it % 5 == 0:
            logged.append(timer.reset())
    assert device_syncs == []
    assert _FakeEvent.synchronized == 2
    assert logged == [pytest.approx(5 * 0.015), pytest.approx(5 * 0.015)]
    timer.start()
    assert timer.stop() == pytest.approx(0.005) and _FakeEvent.synchronized == 3
