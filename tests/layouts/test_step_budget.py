"""Host-sync and launch budget of one training step, checked on CPU ranks.

A GPU step is fast only when the host queues work ahead of the device: every read of a device
value on the host (``aten._local_scalar_dense`` behind ``.item()``/``float()``/``bool()``,
``Tensor.tolist``, ``.cpu()``, ``.numpy()``), every operator whose output size depends on the
values (``nonzero``, ``bincount``, ``masked_select``, ``unique``, ``repeat_interleave`` without
``output_size``) and every ``torch.cuda.synchronize`` drains the queue. These tests count them
in ``Trainer.train_step`` under a ``TorchDispatchMode`` with those ``Tensor`` methods and
``torch.cuda.synchronize`` wrapped (gloo ranks; the same Python runs on CUDA): at most 2 host
syncs per step for a dense model (the optimizer's sum of squares, the loss / stop all-reduce;
one more in a step whose gradients overflowed), and for an MoE model one more per MoE layer
and micro-batch (the rows per expert) and one per step (the routing statistics), at expert
parallelism 1 and 2; no ``torch.tensor(values, device=...)`` (a blocking copy from pageable host
memory on CUDA) and no device-wide synchronize at all, the step timer included (CUDA events,
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
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "1e-2"]
MOE_LAYOUTS = {
    "moe-zero1": DP2 + ["--zero-stage", "1"] + MOE,
    "moe-ep2-alltoall": DP2 + ["--expert-model-parallel-size", "2"] + MOE,
    "moe-ep2-allgather": DP2 + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"] + MOE,
}
DENSE_SYNCS = 2
STEPS = 3
#: operators whose output size is a device value (a host sync on CUDA); repeat_interleave only
#: without ``output_size``
SIZED_BY_VALUES = ("aten.nonzero.", "aten.bincount.", "aten.masked_select.", "aten._unique", "aten.unique")


def _counting_run(rank, world, argvs):
    from torch.utils._python_dispatch import TorchDispatchMode

    from megazero.training import build_trainer

    counts = collections.Counter()

    class Spy(TorchDispatchMode):
        phase = "model"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            sized = name.startswith(SIZED_BY_VALUES) or (
                name == "aten.repeat_interleave.Tensor" and (kwargs or {}).get("output_size") is None
            )
            if name == "aten._local_scalar_dense.default" or sized:
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
    cpu, numpy = wrap(torch.Tensor, "cpu", "reads"), wrap(torch.Tensor, "numpy", "reads")
    make = torch.tensor

    def uploaded(*a, **k):  # torch.tensor(python values, device=...): a blocking copy on CUDA
        counts["uploads"] += k.get("device") is not None
        return make(*a, **k)

    torch.tensor = uploaded
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
                    values = trainer.train_step(batches).values
                per_step.append(dict(counts, loss=values["loss"], skipped=values["skipped_iterations"]))
            out[" ".join(argv[len(BASE) :])] = dict(
                steps=per_step,
                buffers=len(trainer.ddp.buffers),
                pieces=len(trainer.optimizer.pieces),
                windows=len(getattr(trainer.optimizer, "windows", ())),
                microbatches=trainer.num_microbatches,
                moe_layers=sum(
                    1 for c in trainer.chunks for b in c.layers.values() if type(b.mlp).__name__ == "MoEMLP"
                ),
            )
            trainer.close()
    finally:
        torch.Tensor.tolist, torch.cuda.synchronize = tolist, synchronize
        torch.Tensor.cpu, torch.Tensor.numpy, torch.tensor = cpu, numpy, make
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
            skipped = 0
            for i, c in enumerate(r["steps"]):
                overflowed, skipped = c["skipped"] > skipped, c["skipped"]
                assert c.get("reads", 0) <= DENSE_SYNCS + overflowed, f"{where} step {i + 1}: {c}"
                assert c.get("synchronize", 0) == 0 and c.get("uploads", 0) == 0, f"{where} step {i + 1}: {c}"
                if "fp16" in name and i == 0:
                    continue  # the first fp16 steps may skip on overflow: no update
                assert 1 <= c.get("adam", 0) <= calls, f"{where} step {i + 1}: {c}"
                assert c.get("norm", 0) <= r["buffers"], f"{where} step {i + 1}: {c}"
            assert r["windows"] == (r["pieces"] if model_dtype else r["buffers"]), where


def test_moe_step_syncs_once_per_layer_and_micro_batch():
    """MoE at ZeRO-1, and at expert parallelism 2 with either dispatcher: the dense step's syncs,
    one per MoE layer and micro-batch (the rows each expert receives: a bincount, a nonzero and
    a tolist each before) and one per step (the routing statistics)."""
    argvs = [BASE + flags for flags in MOE_LAYOUTS.values()]
    for rank, results in enumerate(run_distributed(_counting_run, 2, argvs, timeout_s=900)):
        for name, r in results.items():
            budget = DENSE_SYNCS + r["moe_layers"] * r["microbatches"] + 1
            assert r["moe_layers"] == 4 and r["microbatches"] == 2, (name, r)
            for i, c in enumerate(r["steps"]):
                assert c.get("reads", 0) <= budget, f"{name} rank {rank} step {i + 1}: {c}"
                assert c.get("synchronize", 0) == 0 and c.get("uploads", 0) == 0, (
                    f"{name} rank {rank} step {i + 1}: {c}"
                )


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
