"""ZeRO-3 parameter shards on NVMe (``--offload-param nvme``, param_swap.ParamSwapper).

fp32, dropout off, 2 spawned gloo ranks (one spawn), swap files under pytest's tmp_path, one
gather unit per layer plus the embedding and the head. Checked: losses, main params and the
parameter shards (read back from the swap file) bit for bit those of ``--offload-param cpu``
and of no offload, with the optimizer on the host (cpu) and in swap files (nvme), with a pool of
one slot (every prefetch evicts) and with ``max_in_cpu`` keeping some shards resident; bytes
read and written per step equal ``M x 4 x S`` and ``4 x S`` (S swapped elements, M
micro-batches; the run's first step reads the layers' swapped shards once more); at most ``buffer_count`` shards hold host memory at once and none between
steps; checkpoints (state_dict) move between nvme, cpu and none both ways; a truncated or
missing parameter swap file stops both ranks in the next step, the owner naming it in one line.
"""
import os

import pytest
import torch

from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.param_swap import ParamSwapOptions
from megazero.data_parallel.zero3_gather import Zero3Options
from megazero.optim.nvme import NvmeOffloadOptimizer
from megazero.optim.offload import HostOffloadOptimizer
from megazero.optim.swap import SwapError
from megazero.optim.zero import DistributedOptimizer
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from model.build import zero3_units
from model.gpt import GPTStage
from tests.distributed import run_distributed
from tests.test_zero import ADAM, BUCKET, CLIP, SEED, make_batches, tiny_cfg, train

STEPS, MICRO = 4, 2
CFG = dict(num_layers=3)


def _build(groups, root, opt="cpu", param="nvme", buffer_count=2, max_in_cpu=0):
    """Model, ddp, optimizer: ``opt`` none/cpu/nvme, ``param`` none/cpu/nvme."""
    model = GPTStage(tiny_cfg(**CFG), groups, range(CFG["num_layers"]), True, True, SEED)
    swap = (ParamSwapOptions(os.path.join(root, "params"), buffer_count=buffer_count, buffer_size=10_000,
                             max_in_cpu=max_in_cpu) if param == "nvme" else None)
    ddp = DataParallel([model], groups, zero_stage=3, bucket_size=BUCKET, overlap_comm=True,
                       units=[zero3_units(model)],
                       zero3=Zero3Options(offload_param=param == "cpu", param_swap=swap))
    kw = dict(lr=ADAM["lr"], beta1=ADAM["betas"][0], beta2=ADAM["betas"][1], eps=ADAM["eps"],
              weight_decay=ADAM["weight_decay"], clip_grad=CLIP, allgather_bucket_size=1001)
    if opt == "nvme":
        o = NvmeOffloadOptimizer(ddp, groups, nvme_path=os.path.join(root, "opt"), buffer_count=2,
                                 sub_group_size=997, io_threads=2, **kw)
    elif opt == "cpu":
        o = HostOffloadOptimizer(ddp, groups, **kw)
    else:
        o = DistributedOptimizer(ddp, groups, **kw)
    return model, ddp, o


def _shards(ddp):
    """Every ZeRO-3 parameter shard's values (read from the swap file when swapped)."""
    out = []
    for b in ddp.buffers:
        if b.strategy.stage == 3:
            with b.strategy.shard_on_host(b):
                out.append(b.params_shard.clone())
    return out


def _run_case(groups, batches, root, **kw):
    model, ddp, opt = _build(groups, root, **kw)
    swap = ddp.param_swap
    losses, io, held = [], [], []
    for i in range(STEPS):
        before = (swap.io.read, swap.io.written) if swap else (0, 0)
        losses += train(model, ddp, opt, groups, batches[i:i + 1], MICRO, steps=1)[0]
        if swap:
            io.append((swap.io.read - before[0], swap.io.written - before[1]))
            held.append(swap.held_bytes())
    out = dict(losses=losses, main=opt.main_param.clone(), shards=_shards(ddp), io=io, held=held)
    if swap:
        out.update(swapped=sum(b.params_shard.numel() for b in swap.swapped),
                   in_layers=sum(b.params_shard.numel() for u in ddp.zero3.units if u.module is not None
                                 for b in u.buffers if b.swapped),
                   sharded=sum(b.layout.shard_numel for b in ddp.buffers if b.strategy.stage == 3),
                   resident=swap.resident_numel, peak=swap.peak_slots, pool=swap.pool_bytes(),
                   largest=swap.largest, n_swapped=len(swap.swapped),
                   file=os.path.getsize(swap.swap_path), host=ddp.host_param_bytes())
    ddp.close()
    if swap:
        out["removed"] = not os.path.exists(swap.swap_dir)
    if hasattr(opt, "close"):
        opt.close()
    return out


def _checkpoint(groups, batches, root, first, second):
    """3 steps with ``first`` (opt, param), save, 1 more with ``second`` after loading."""
    model, ddp, a = _build(groups, root, *first)
    head = train(model, ddp, a, groups, batches[:3], MICRO, steps=3)[0]
    saved = a.state_dict()
    ddp.close()
    model, ddp, b = _build(groups, root, *second)
    b.load_state_dict(saved)
    tail = train(model, ddp, b, groups, batches[3:], MICRO, steps=1)[0]
    ddp.close()
    return head + tail


def _fault(groups, batches, root, rank, kind):
    """One good step, then rank ``kind[1]``'s parameter swap file truncated or deleted."""
    model, ddp, opt = _build(groups, root)
    train(model, ddp, opt, groups, batches[:1], MICRO, steps=1)
    path = ddp.param_swap.swap_path
    if rank == kind[1]:
        if kind[0] == "truncate":
            os.truncate(path, os.path.getsize(path) - 8)
        else:
            os.remove(path)
    try:
        train(model, ddp, opt, groups, batches[1:2], MICRO, steps=1)
        got = None
    except SwapError as e:
        got = (str(e), e.local, path)
    ddp.close()
    return got


def _run(rank, world, batches, root):
    groups = ProcessGroups.build(Topology(tp=1, pp=1, dp=world))
    root = os.path.join(root, f"r{rank}")
    cases = {"none": dict(opt="none", param="none"), "cpu": dict(opt="cpu", param="cpu"),
             "nvme": dict(opt="cpu", param="nvme", buffer_count=2),
             "nvme_one_slot": dict(opt="cpu", param="nvme", buffer_count=1),
             "nvme_resident": dict(opt="cpu", param="nvme", max_in_cpu=2000),
             "nvme_nvme": dict(opt="nvme", param="nvme", buffer_count=1)}
    out = {name: _run_case(groups, batches, root, **kw) for name, kw in cases.items()}
    out["ckpt"] = {f"{a}>{b}": _checkpoint(groups, batches, root, a, b)
                   for a, b in ((("cpu", "nvme"), ("none", "none")), (("none", "none"), ("cpu", "nvme")),
                                (("nvme", "nvme"), ("cpu", "cpu")))}
    out["faults"] = {kind: _fault(groups, batches, root, rank, kind) for kind in (("truncate", 0), ("missing", 1))}
    return out


def test_param_nvme_equals_cpu_and_none_io_bytes_checkpoints_and_faults(tmp_path):
    batches = make_batches(tiny_cfg(**CFG), STEPS)
    outs = run_distributed(_run, 2, batches, str(tmp_path))
    if os.environ.get("MEGAZERO_SHOW"):
        print({k: {x: v for x, v in o.items() if x not in ("shards", "main", "losses")}
               for k, o in outs[0].items() if k.startswith("nvme")})
    for rank, out in enumerate(outs):
        ref = out["cpu"]
        for name in ("none", "nvme", "nvme_one_slot", "nvme_resident", "nvme_nvme"):
            o = out[name]
            assert o["losses"] == ref["losses"], name                      # bit for bit
            assert torch.equal(o["main"], ref["main"]), name
            assert all(torch.equal(x, y) for x, y in zip(o["shards"], ref["shards"])), name
        for name in ("nvme", "nvme_one_slot", "nvme_resident", "nvme_nvme"):
            o, s = out[name], out[name]["swapped"]
            assert s == o["sharded"] - o["resident"] > 0, name
            # the first micro-batch of the run gathers each unit with a module twice (its forward
            # trace is not known yet, so it is released after the forward): 4 x in_layers more
            first = (MICRO * 4 * s + 4 * o["in_layers"], 4 * s)
            assert o["io"] == [first] + [(MICRO * 4 * s, 4 * s)] * (STEPS - 1), (name, o["io"], s)
            slots = 2 if name in ("nvme", "nvme_resident") else 1       # buffer_count
            assert o["held"] == [0] * STEPS and o["peak"] == slots, (name, o["peak"])   # prefetch fills them
            assert o["pool"] == min(slots, o["n_swapped"]) * 4 * o["largest"]
            assert o["host"] == o["pool"] + 4 * o["resident"]
            assert o["file"] == 4096 + 4 * s and o["removed"], name
        assert out["nvme_resident"]["resident"] > 0
        for key, losses in out["ckpt"].items():
            assert losses == ref["losses"], key
        msg, local, path = out["faults"][("truncate", 0)]
        assert len(msg.splitlines()) == 1 and local == (rank == 0)
        assert (path in msg and "truncated" in msg) if rank == 0 else "another rank" in msg
        msg, local, path = out["faults"][("missing", 1)]
        assert len(msg.splitlines()) == 1 and local == (rank == 1)
        assert (path in msg and "missing" in msg) if rank == 1 else "another rank" in msg


def test_buffer_size_below_a_shard_names_the_setting(tmp_path):
    groups = ProcessGroups.single()
    model = GPTStage(tiny_cfg(**CFG), groups, range(CFG["num_layers"]), True, True, SEED)
    swap = ParamSwapOptions(str(tmp_path), buffer_size=10, max_in_cpu=0)
    with pytest.raises(ValueError, match="offload_param buffer_size 10 .*--offload-param-buffer-size"):
        DataParallel([model], groups, zero_stage=3, bucket_size=BUCKET, overlap_comm=False,
                     units=[zero3_units(model)], zero3=Zero3Options(param_swap=swap))
