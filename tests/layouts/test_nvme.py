"""NVMe offload of the optimizer state (NvmeOffloadOptimizer, ZeRO-Infinity) against cpu offload.

fp32, dropout off, 2 spawned gloo ranks, swap files under pytest's tmp_path. The swapped step
is cpu offload's arithmetic walked sub-group by sub-group, so losses and main params are bit
for bit those of ``--offload-optimizer cpu``; every step reads and writes each owned element's
12 bytes (main 4 + moments 8) once: 2 x 12 x owned bytes, counted; a checkpoint moves between
nvme and cpu offload both ways; a truncated swap file stops every rank, named on its own.
"""

import json
import os

import pytest
import torch

from megazero.offload.swap import SwapError
from megazero.optim.nvme import NvmeOffloadOptimizer
from megazero.optim.offload import HostOffloadOptimizer
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from tests.support.distributed import run_distributed
from tests.support.nvme import FIXTURE
from tests.support.zero import ADAM, CLIP, build, make_batches, tiny_cfg, train

STEPS, SUB_GROUP, BUFFERS = 5, 997, 2  # 997 elements: sub-groups cut parameters and pieces


def _build(cls, groups, stage, root):
    model, ddp, _ = build(tiny_cfg(), groups, stage, True, clip_grad=CLIP)
    kw = (
        dict(nvme_path=root, buffer_count=BUFFERS, sub_group_size=SUB_GROUP, io_threads=2)
        if cls is NvmeOffloadOptimizer
        else {}
    )
    opt = cls(
        ddp,
        groups,
        pin_memory=True,
        lr=ADAM["lr"],
        beta1=ADAM["betas"][0],
        beta2=ADAM["betas"][1],
        eps=ADAM["eps"],
        weight_decay=ADAM["weight_decay"],
        clip_grad=CLIP,
        allgather_bucket_size=1001,
        **kw,
    )
    return model, ddp, opt


def _steps(model, ddp, opt, groups, batches, steps):
    """Losses and, for nvme, (read, written) bytes of every step."""
    losses, io = [], []
    for i in range(steps):
        losses += train(model, ddp, opt, groups, batches[i : i + 1], 2, steps=1)[0]
        io.append(tuple(getattr(opt, "step_io", {"read": 0, "written": 0}).values()))
    return losses, io


def _run(rank, world, batches, root):
    groups = ProcessGroups.build(Topology(tp=1, pp=1, dp=world))
    root = os.path.join(root, f"r{rank}")
    out = {}
    for stage in (1, 2, 3):
        m, d, cpu = _build(HostOffloadOptimizer, groups, stage, root)
        cpu_losses, _ = _steps(m, d, cpu, groups, batches, STEPS)
        m, d, nv = _build(NvmeOffloadOptimizer, groups, stage, root)
        losses, io = _steps(m, d, nv, groups, batches, STEPS)
        owned = sum(b.layout.padded_numel // b.layout.dp_size for b in d.buffers)
        state = nv.model_state_bytes()
        out[stage] = dict(
            cpu=cpu_losses,
            nvme=losses,
            io=io,
            owned=owned,
            numel=nv.numel,
            sub_groups=len(nv.sub_groups),
            longest=max(b - a for a, b in nv.sub_groups),
            equal_main=torch.equal(cpu.main_param, nv.main_param),
            pool=state["swap_buffers"],
            state=(state["main_params"], state["exp_avg"]),
            file=os.path.getsize(nv.swap_path),
            swap_dir=nv.swap_dir,
        )
        nv.close()
        out[stage]["removed"] = not os.path.exists(out[stage]["swap_dir"])
        if stage != 2:
            continue
        # checkpoint interchange (state_dict, whole-state swap-in): 3 steps, save, 3 more in the other
        for first, second in (
            (NvmeOffloadOptimizer, HostOffloadOptimizer),
            (HostOffloadOptimizer, NvmeOffloadOptimizer),
        ):
            m, d, a = _build(first, groups, stage, root)
            head = _steps(m, d, a, groups, batches, 3)[0]
            saved = a.state_dict()
            m, d, b = _build(second, groups, stage, root)
            b.load_state_dict(saved)
            out[stage, first.__name__] = head + _steps(m, d, b, groups, batches[3:], STEPS - 3)[0]
    # a truncated swap file (rank 0's) stops both ranks in the next step, no hang
    m, d, nv = _build(NvmeOffloadOptimizer, groups, 2, root)
    _steps(m, d, nv, groups, batches, 1)
    if rank == 0:
        os.truncate(nv.swap_path, os.path.getsize(nv.swap_path) - 12)
    try:
        _steps(m, d, nv, groups, batches[1:], 1)
        out["error"] = None
    except SwapError as e:
        out["error"] = (str(e), e.local, nv.swap_path)
    nv.close()
    return out


def test_nvme_equals_cpu_offload_io_bytes_checkpoints_and_truncation(tmp_path):
    batches = make_batches(tiny_cfg(), STEPS)
    outs = run_distributed(_run, 2, batches, str(tmp_path))
    for rank, out in enumerate(outs):
        for stage in (1, 2, 3):
            o = out[stage]
            assert o["nvme"] == o["cpu"], stage  # bit for bit
            assert o["equal_main"], stage
            assert o["numel"] == o["owned"] and o["sub_groups"] >= -(-o["owned"] // SUB_GROUP) > 2
            assert o["io"] == [(12 * o["owned"], 12 * o["owned"])] * STEPS, stage
            assert o["pool"] == BUFFERS * 12 * o["longest"] and o["longest"] <= SUB_GROUP and o["state"] == (0, 0)
            assert o["file"] == 4096 + 12 * o["owned"] and o["removed"]
        for name in ("NvmeOffloadOptimizer", "HostOffloadOptimizer"):  # ZeRO-2, saved by name
            assert out[2, name] == out[2]["cpu"], name
        msg, local, path = out["error"]
        assert len(msg.splitlines()) == 1 and local == (rank == 0)
        assert (path in msg and "truncated" in msg) if rank == 0 else ("another rank" in msg)


def _trainer_runs(rank, world, jobs):
    from tests.support.checkpoint import run_checkpointed as run

    return [run(rank, world, argv, steps, save=save, load=load) for argv, steps, save, load in jobs]


def test_seed_style_stage3_nvme_config_and_checkpoints_through_the_trainer(tmp_path):
    """The fixture (seed004_stage3_offload.json with offload_optimizer.device nvme and an aio
    block) trains through megazero.training.Trainer; its losses equal the cpu-offload seed's exactly, and a
    checkpoint (megazero/checkpoint/, DCP) saved with nvme resumes with cpu offload and back."""
    from tests.support.checkpoint import ARGS
    from tests.support.layouts import seed_case

    with open(FIXTURE) as f:
        doc = json.load(f)
    doc["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "swap")
    nvme_json = tmp_path / "stage3_nvme.json"
    nvme_json.write_text(json.dumps(doc))
    base = ARGS + ["--dp", "2"]
    nvme = base + ["--deepspeed-config", str(nvme_json)]
    cpu = base + ["--deepspeed-config", seed_case("seed004_stage3_offload.json")]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    jobs = [(cpu, 6, None, None), (nvme, 3, a, None), (cpu, 3, b, None), (cpu, 3, None, a), (nvme, 3, None, b)]
    whole_cpu, first_nvme, first_cpu, resumed_cpu, resumed_nvme = run_distributed(_trainer_runs, 2, jobs)[0]
    assert first_nvme[0] == first_cpu[0] == whole_cpu[0][:3]
    for resumed in (resumed_cpu, resumed_nvme):
        assert resumed[1] == 3 and resumed[0] == pytest.approx(whole_cpu[0][3:], rel=1e-6)
    assert not os.listdir(tmp_path / "swap")  # every run's swap directory removed at close


def test_swap_file_check_names_a_missing_truncated_or_foreign_file(tmp_path):
    """SwapFile.check: each failure is one line naming the file and what is wrong with it."""
    from megazero.offload.swap import IoCounter, SwapFile

    path = str(tmp_path / "state.swp")
    f = SwapFile(path, 10, "run-a", IoCounter())
    f.write(0, torch.arange(30, dtype=torch.float32))
    out = torch.empty(30)
    f.read(0, out)
    assert torch.equal(out, torch.arange(30, dtype=torch.float32)) and (f.counter.read, f.counter.written) == (120, 120)
    f.check()
    for bad, word in (
        (lambda: os.truncate(path, 4096 + 12 * 10 - 1), "truncated"),
        (lambda: os.remove(path), "missing"),
        (lambda: SwapFile(path, 7, "run-b", IoCounter()).fd, "another run"),
    ):
        bad()
        with pytest.raises(SwapError) as exc:
            f.check()
        msg = str(exc.value)
        assert path in msg and word in msg and len(msg.splitlines()) == 1, msg
    with pytest.raises(SwapError, match="short read"):
        SwapFile(str(tmp_path / "b.swp"), 2, "run-c", IoCounter()).read(5, out)


@pytest.mark.slow
def test_truncated_swap_file_through_the_launcher_exits_1_naming_it(tmp_path):
    """scripts/pretrain_gpt.sh (torchrun, dp 2, ZeRO-2, --offload-optimizer nvme) with rank 1's
    swap file cut short at iteration 3 (test hook): status 1, one line naming rank 1's file, no
    traceback from the ranks (torchrun's own ChildFailedError summary follows, as for every
    training error that exits 1), no hang (both ranks stop in the step's flag all-reduce)."""
    from tests.support.preemption import BASE, launch_env

    args = [a if a != "12" else "5" for a in BASE] + [
        "--dp",
        "2",
        "--zero-stage",
        "2",
        "--offload-optimizer",
        "nvme",
        "--offload-nvme-path",
        str(tmp_path / "swap"),
    ]
    out = launch_env(args, tmp_path / "run", dict(os.environ, MEGAZERO_TEST_FAULT="swaptrunc:3:1"), timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if "swap file" in x]
    assert len(lines) == 1 and "rank1/optimizer_state.swp is truncated" in lines[0], out.stderr[-3000:]
    assert "SwapError" not in out.stdout + out.stderr and 'train.py", line' not in out.stderr, out.stderr[-3000:]
    assert not os.listdir(tmp_path / "swap")  # both ranks' swap directories removed on the way out
