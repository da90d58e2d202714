"""ZeRO-3 parameter shards on NVMe (``--offload-param nvme``, param_swap.ParamSwapper).

fp32, dropout off, 2 spawned gloo ranks (one spawn), swap files under pytest's tmp_path, one
gather unit per layer plus the embedding and the head. Checked: losses, main params and the
parameter shards (read back from the swap file) bit for bit those of ``--offload-param cpu``
and of no offload, with the optimizer on the host (cpu) and in swap files (nvme), with a pool of
one slot (every prefetch evicts) and with ``max_in_cpu`` keeping some shards resident; bytes
read and written per step equal ``M x 4 x S`` and ``4 x S`` (S swapped elements, M
micro-batches; the run's first step reads the layers' swapped shards once more); at most ``buffer_count`` shards hold
host memory at once and none between
steps; checkpoints (state_dict) move between nvme, cpu and none both ways; a truncated or
missing parameter swap file stops both ranks in the next step, the owner naming it in one line.
"""

import os

import pytest
import torch

from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.zero3_gather import Zero3Options
from megazero.offload.param_swap import ParamSwapOptions
from megazero.offload.swap import SwapError
from megazero.optim.nvme import NvmeOffloadOptimizer
from megazero.optim.offload import HostOffloadOptimizer
from megazero.optim.zero import DistributedOptimizer
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from model.build import zero3_units
from model.gpt import GPTStage
from tests.support.distributed import run_distributed
from tests.support.zero import ADAM, BUCKET, CLIP, SEED, make_batches, tiny_cfg, train

STEPS, MICRO = 4, 2
CFG = dict(num_layers=3)


def _build(groups, root, opt="cpu", param="nvme", buffer_count=2, max_in_cpu=0):
    """Model, ddp, optimizer: ``opt`` none/cpu/nvme, ``param`` none/cpu/nvme."""
    model = GPTStage(tiny_cfg(**CFG), groups, range(CFG["num_layers"]), True, True, SEED)
    swap = (
        ParamSwapOptions(
            os.path.join(root, "params"), buffer_count=buffer_count, buffer_size=10_000, max_in_cpu=max_in_cpu
        )
        if param == "nvme"
        else None
    )
    ddp = DataParallel(
        [model],
        groups,
        zero_stage=3,
        bucket_size=BUCKET,
        overlap_comm=True,
        units=[zero3_units(model)],
        zero3=Zero3Options(offload_param=param == "cpu", param_swap=swap),
    )
    kw = dict(
        lr=ADAM["lr"],
        beta1=ADAM["betas"][0],
        beta2=ADAM["betas"][1],
        eps=ADAM["eps"],
        weight_decay=ADAM["weight_decay"],
        clip_grad=CLIP,
        allgather_bucket_size=1001,
    )
    if opt == "nvme":
        o = NvmeOffloadOptimizer(
            ddp, groups, nvme_path=os.path.join(root, "opt"), buffer_count=2, sub_group_size=997, io_threads=2, **kw
        )
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
        losses += train(model, ddp, opt, groups, batches[i : i + 1], MICRO, steps=1)[0]
        if swap:
            io.append((swap.io.read - before[0], swap.io.written - before[1]))
            held.append(swap.held_bytes())
    got = opt.model_state_bytes()
    out = dict(
        losses=losses,
        main=opt.main_param.clone(),
        shards=_shards(ddp),
        io=io,
        held=held,
        states=got["total"] - got["buckets"],
        formula=opt.formula()["total"] if kw.get("opt") != "none" else 0,
    )
    if swap:
        out.update(
            swapped=sum(b.params_shard.numel() for b in swap.swapped),
            in_layers=sum(
                b.params_shard.numel() for u in ddp.zero3.units if u.module is not None for b in u.buffers if b.swapped
            ),
            sharded=sum(b.layout.shard_numel for b in ddp.buffers if b.strategy.stage == 3),
            resident=swap.resident_numel,
            peak=swap.peak_slots,
            pool=swap.pool_bytes(),
            largest=swap.largest,
            n_swapped=len(swap.swapped),
            file=os.path.getsize(swap.swap_path),
            host=ddp.host_param_bytes(),
        )
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
    cases = {
        "none": dict(opt="none", param="none"),
        "cpu": dict(opt="cpu", param="cpu"),
        "nvme": dict(opt="cpu", param="nvme", buffer_count=2),
        "nvme_one_slot": dict(opt="cpu", param="nvme", buffer_count=1),
        "nvme_resident": dict(opt="cpu", param="nvme", max_in_cpu=2000),
        "nvme_nvme": dict(opt="nvme", param="nvme", buffer_count=1),
    }
    out = {name: _run_case(groups, batches, root, **kw) for name, kw in cases.items()}
    out["ckpt"] = {
        f"{a}>{b}": _checkpoint(groups, batches, root, a, b)
        for a, b in (
            (("cpu", "nvme"), ("none", "none")),
            (("none", "none"), ("cpu", "nvme")),
            (("nvme", "nvme"), ("cpu", "cpu")),
        )
    }
    out["faults"] = {kind: _fault(groups, batches, root, rank, kind) for kind in (("truncate", 0), ("missing", 1))}
    return out


def test_param_nvme_equals_cpu_and_none_io_bytes_checkpoints_and_faults(tmp_path):
    batches = make_batches(tiny_cfg(**CFG), STEPS)
    outs = run_distributed(_run, 2, batches, str(tmp_path))
    if os.environ.get("MEGAZERO_SHOW"):
        print(
            {
                k: {x: v for x, v in o.items() if x not in ("shards", "main", "losses")}
                for k, o in outs[0].items()
                if k.startswith("nvme")
            }
        )
    for rank, out in enumerate(outs):
        ref = out["cpu"]
        for name in ("none", "nvme", "nvme_one_slot", "nvme_resident", "nvme_nvme"):
            o = out[name]
            assert o["losses"] == ref["losses"], name  # bit for bit
            assert torch.equal(o["main"], ref["main"]), name
            assert all(torch.equal(x, y) for x, y in zip(o["shards"], ref["shards"])), name
        for name in ("nvme", "nvme_one_slot", "nvme_resident", "nvme_nvme"):
            o, s = out[name], out[name]["swapped"]
            assert s == o["sharded"] - o["resident"] > 0, name
            # the first micro-batch of the run gathers each unit with a module twice (its forward
            # trace is not known yet, so it is released after the forward): 4 x in_layers more
            first = (MICRO * 4 * s + 4 * o["in_layers"], 4 * s)
            assert o["io"] == [first] + [(MICRO * 4 * s, 4 * s)] * (STEPS - 1), (name, o["io"], s)
            slots = 2 if name in ("nvme", "nvme_resident") else 1  # buffer_count
            assert o["held"] == [0] * STEPS and o["peak"] == slots, (name, o["peak"])  # prefetch fills them
            assert o["pool"] == min(slots, o["n_swapped"]) * 4 * o["largest"]
            assert o["host"] == o["pool"] + 4 * o["resident"]
            assert o["file"] == 4096 + 4 * s and o["removed"], name
        assert out["nvme_resident"]["resident"] > 0
        for name in ("nvme", "nvme_one_slot", "nvme_resident"):  # cpu optimizer: only the shards differ
            o = out[name]
            saved = 4 * o["swapped"] - o["pool"]  # the swapped shards' bytes are replaced by the slots
            assert ref["states"] - o["states"] == saved > 0 and ref["formula"] - o["formula"] == saved, name
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
        DataParallel(
            [model],
            groups,
            zero_stage=3,
            bucket_size=BUCKET,
            overlap_comm=False,
            units=[zero3_units(model)],
            zero3=Zero3Options(param_swap=swap),
        )


def _trainer_run(rank, world, argv, steps, save=None, load=None):
    """tests/layouts/test_checkpoint.py's ``_run``, closing the Trainer at the end (what train.py does),
    which removes the parameter swap directory."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    cfg = config_from_argv(argv + (["--load", load] if load else []), world)
    trainer = build_trainer(cfg, data=training.prepare_run(cfg))
    start = trainer.load_checkpoint(load) if load else None
    losses = []
    for _ in range(steps):
        batches = trainer.next_batches()
        losses.append(trainer.train_step(batches).values["loss"])
    if save:
        trainer.save_checkpoint(save)
    trainer.close()
    return losses, start


def _trainer_runs(rank, world, jobs):
    return [_trainer_run(rank, world, argv, steps, save=save, load=load) for argv, steps, save, load in jobs]


def test_seed_style_stage3_all_nvme_config_through_the_trainer_and_checkpoints(tmp_path):
    """The stage-3 ZeRO-Infinity fixture with ``offload_param: {device: nvme, nvme_path,
    buffer_count, buffer_size, max_in_cpu}`` too (both on NVMe, persistence threshold 0 so that
    every layer is swapped) trains through training.Trainer: losses bit for bit the cpu-offload
    run's; a checkpoint saved with nvme resumes with cpu offload, one saved with cpu resumes
    with nvme, both bit for bit; every swap directory is removed at close."""
    import json

    from tests.support.checkpoint import ARGS
    from tests.support.nvme import FIXTURE

    with open(FIXTURE) as f:
        doc = json.load(f)
    z, swap = doc["zero_optimization"], str(tmp_path / "swap")
    z.update(stage3_param_persistence_threshold=0)
    z["offload_optimizer"]["nvme_path"] = swap
    cpu_doc = json.loads(json.dumps(doc))
    cpu_doc["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    z["offload_param"] = {
        "device": "nvme",
        "nvme_path": swap,
        "buffer_count": 2,
        "buffer_size": 1e6,
        "max_in_cpu": 0,
        "pin_memory": True,
    }
    paths = {}
    for name, d in (("nvme", doc), ("cpu", cpu_doc)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(d))
    nvme, cpu = (ARGS + ["--dp", "2", "--deepspeed-config", str(paths[k])] for k in ("nvme", "cpu"))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    jobs = [(cpu, 4, None, None), (nvme, 2, a, None), (cpu, 2, b, None), (cpu, 2, None, a), (nvme, 2, None, b)]
    whole, first_nvme, first_cpu, resumed_cpu, resumed_nvme = run_distributed(_trainer_runs, 2, jobs)[0]
    assert first_nvme[0] == first_cpu[0] == whole[0][:2]
    for resumed in (resumed_cpu, resumed_nvme):
        assert resumed[1] == 2 and resumed[0] == whole[0][2:]
    assert not os.listdir(swap)


@pytest.mark.slow
def test_truncated_param_swap_file_through_the_launcher_exits_1_naming_it(tmp_path):
    """scripts/pretrain_gpt.sh (torchrun, dp 2, ZeRO-3, --offload-param nvme) with rank 0's
    parameter swap file cut short at iteration 3 (test hook ``paramtrunc``): status 1, one line
    naming rank 0's file, no traceback, no hang (both ranks stop in the step's check), both
    ranks' swap directories removed on the way out."""
    from tests.support.preemption import BASE, launch_env

    args = [a if a != "12" else "5" for a in BASE] + [
        "--dp",
        "2",
        "--zero-stage",
        "3",
        "--offload-optimizer",
        "cpu",
        "--offload-param",
        "nvme",
        "--offload-nvme-path",
        str(tmp_path / "swap"),
        "--offload-param-max-in-cpu",
        "0",
        "--zero3-param-persistence-threshold",
        "0",
    ]
    out = launch_env(args, tmp_path / "run", dict(os.environ, MEGAZERO_TEST_FAULT="paramtrunc:3:0"), timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if "swap file" in x]
    assert len(lines) == 1 and "rank0-params/params.swp is truncated" in lines[0], out.stderr[-3000:]
    assert "SwapError" not in out.stdout + out.stderr and 'train.py", line' not in out.stderr, out.stderr[-3000:]
    assert not os.listdir(tmp_path / "swap")


def test_bf16_shards_on_nvme_equal_cpu_with_either_optimizer_offload(tmp_path):
    """bf16 model, one rank: ZeRO-3 shards on NVMe with cpu or nvme optimizer offload give the
    losses of ``--offload-param cpu`` bit for bit (the nvme optimizer at ZeRO-3 with a bf16
    model also ran into the released full buffer before: its shard is now left as written)."""
    from tests.support.zero import cast_model_

    groups = ProcessGroups.single()
    cfg = tiny_cfg(**CFG)
    batches = make_batches(cfg, 2)

    def run(param, opt):
        model = GPTStage(cfg, groups, range(CFG["num_layers"]), True, True, SEED)
        cast_model_(model, torch.bfloat16)
        swap = ParamSwapOptions(str(tmp_path / "p"), buffer_count=1, max_in_cpu=0) if param == "nvme" else None
        ddp = DataParallel(
            [model],
            groups,
            zero_stage=3,
            bucket_size=BUCKET,
            overlap_comm=True,
            units=[zero3_units(model)],
            zero3=Zero3Options(offload_param=param == "cpu", param_swap=swap),
        )
        kw = dict(lr=ADAM["lr"], weight_decay=ADAM["weight_decay"])
        o = (
            NvmeOffloadOptimizer(ddp, groups, nvme_path=str(tmp_path / "o"), sub_group_size=500, **kw)
            if opt == "nvme"
            else HostOffloadOptimizer(ddp, groups, **kw)
        )
        losses = train(model, ddp, o, groups, batches, 1, steps=2)[0]
        ddp.close()
        return losses

    ref = run("cpu", "cpu")
    assert len(set(ref)) == 2
    for param, opt in (("nvme", "cpu"), ("cpu", "nvme"), ("nvme", "nvme")):
        assert run(param, opt) == ref, (param, opt)
