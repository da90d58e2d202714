"""ZeRO-Offload (HostOffloadOptimizer) against the same ZeRO stage without offload.

fp32, dropout off, spawned gloo ranks. Offloading moves where the optimizer state lives and
where Adam runs, not the arithmetic: losses and main params equal the same stage without
offload (within 1e-6; in practice bit-identical), bytes on each side equal
``offload_formula_bytes`` and a checkpoint moves between offload and no offload.
"""

import numpy as np
import pytest
import torch

from megazero.optim.offload import HostOffloadOptimizer, offload_formula_bytes
from megazero.optim.zero import DistributedOptimizer
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from tests.support.distributed import run_distributed
from tests.support.zero import ADAM, CLIP, build, make_batches, reference, tiny_cfg, train

STEPS = 5


def build_offload(cfg, groups, stage, overlap, clip_grad=CLIP):
    """``tests.support.zero.build`` with the optimizer replaced by a HostOffloadOptimizer."""
    model, ddp, _ = build(cfg, groups, stage, overlap, clip_grad=clip_grad)
    opt = HostOffloadOptimizer(
        ddp,
        groups,
        pin_memory=True,
        lr=ADAM["lr"],
        beta1=ADAM["betas"][0],
        beta2=ADAM["betas"][1],
        eps=ADAM["eps"],
        weight_decay=ADAM["weight_decay"],
        clip_grad=clip_grad,
        allgather_bucket_size=1001,
    )
    return model, ddp, opt


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _stage_runs(groups, batches, stage):
    cfg, out = tiny_cfg(), {}
    model, ddp, opt = build(cfg, groups, stage, True, clip_grad=CLIP)
    out["plain"] = train(model, ddp, opt, groups, batches, 2, steps=STEPS)[0], opt.main_param.numpy()
    model, ddp, opt = build_offload(cfg, groups, stage, True)
    losses, _, state_bytes = train(model, ddp, opt, groups, batches, 2, steps=STEPS)
    padded = sum(b.layout.padded_numel for b in ddp.buffers)
    out["offload"] = losses, opt.main_param.numpy()
    out["bytes"] = state_bytes[-1], opt.bytes_by_place(), opt.bucket_bound_bytes()
    out["formula"] = offload_formula_bytes(padded, groups.dp_size, stage, 4, 4)
    out["host"] = {opt.exp_avg.device.type, opt._main.device.type, opt.host_grads.device.type}
    out["placeholders"] = stage == 3 and all(p.stride() == (0,) * p.dim() for p in model.parameters())
    return out


def _resume(groups, batches, stage, first_cls, second_cls):
    """3 steps with ``first_cls``, state_dict, 2 more with ``second_cls``: losses."""
    cfg = tiny_cfg()
    makers = {DistributedOptimizer: build, HostOffloadOptimizer: build_offload}
    model, ddp, opt = makers[first_cls](cfg, groups, stage, True, clip_grad=CLIP)
    first = train(model, ddp, opt, groups, batches[:3], 2, steps=3)[0]
    state = opt.state_dict()
    model, ddp, opt = makers[second_cls](cfg, groups, stage, True, clip_grad=CLIP)
    opt.load_state_dict(state)
    return first + train(model, ddp, opt, groups, batches[3:], 2, steps=2)[0], _params(model)


def run_checkpointed(rank, world, batches):
    groups = ProcessGroups.build(Topology(tp=1, pp=1, dp=world))
    out = {stage: _stage_runs(groups, batches, stage) for stage in (1, 2, 3)}
    out["resume"] = {
        (stage, a.__name__, b.__name__): _resume(groups, batches, stage, a, b)
        for stage in (1, 2)
        for a, b in ((HostOffloadOptimizer, DistributedOptimizer), (DistributedOptimizer, HostOffloadOptimizer))
    }
    return out


def test_offload_matches_same_stage_bytes_and_resume_dp2():
    cfg = tiny_cfg()
    batches = make_batches(cfg, STEPS)
    ref = reference(cfg, batches, steps=STEPS, clip_grad=CLIP)
    for out in run_distributed(run_checkpointed, 2, batches):
        for stage in (1, 2, 3):
            o = out[stage]
            plain_losses, plain_main = o["plain"]
            losses, main = o["offload"]
            assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-6), stage
            assert losses == pytest.approx(ref, rel=1e-5)
            np.testing.assert_allclose(main, plain_main, rtol=1e-6, atol=1e-7)
            got, place, bound = o["bytes"]
            formula = o["formula"]
            # host: fp32 main + 2 moments + fp32 gradient copy of the owned elements
            assert (
                place["host"]
                == formula["host"]
                == (got["main_params"] + got["exp_avg"] + got["exp_avg_sq"] + got["host_grads"])
            )
            assert got["main_params"] == got["exp_avg"] == got["host_grads"] > 0
            # device: the stage's params and grads, plus at most B bytes of buckets
            assert place["device"] - got["buckets"] == formula["device"]
            assert place["device"] == got["params"] + got["grads"] + got["buckets"]
            assert got["buckets"] <= bound
            assert place["device"] + place["host"] == got["total"]
            assert o["host"] == {"cpu"}
            assert o["placeholders"] == (stage == 3)
        assert out[1]["formula"]["device"] > out[2]["formula"]["device"] > out[3]["formula"]["device"]
        straight = out[1]["plain"][0]
        for (stage, a, b), (losses, _) in out["resume"].items():
            assert losses == pytest.approx(out[stage]["plain"][0], rel=1e-6), (stage, a, b)
        assert straight == pytest.approx(ref, rel=1e-5)


def test_offload_formula_per_stage():
    """The device/host split of the ZeRO-Offload paper (sec. 4) for Psi = 1200, N = 4, bf16."""
    psi, n = 1200, 4
    assert offload_formula_bytes(psi, n, 1, 2, 2) == {"device": 4 * psi, "host": 16 * psi / n}
    assert offload_formula_bytes(psi, n, 2, 2, 2) == {"device": 2 * psi + 2 * psi / n, "host": 16 * psi / n}
    assert offload_formula_bytes(psi, n, 3, 2, 2) == {"device": 4 * psi / n, "host": 16 * psi / n}
    assert offload_formula_bytes(psi, n, 0, 2, 2) == {"device": 4 * psi, "host": 16 * psi}


def _checkpoint_runs(rank, world, jobs):
    from tests.support.checkpoint import run_checkpointed

    return [run_checkpointed(rank, world, argv, steps, save=save, load=load) for argv, steps, save, load in jobs]


def test_checkpoint_with_offload_resumes_without_and_back(tmp_path):
    """Through the Trainer and megazero/checkpoint/ (dp 2, ZeRO-2): a checkpoint saved with
    --offload-optimizer cpu resumes without it, and one saved without resumes with it; both
    continue the uninterrupted run within 1e-6 (same arithmetic, same state format)."""
    from tests.support.checkpoint import ARGS

    plain, off = ARGS + ["--dp", "2", "--zero-stage", "2"], ["--offload-optimizer", "cpu"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    jobs = [
        (plain, 6, None, None),
        (plain + off, 3, a, None),
        (plain, 3, None, a),
        (plain, 3, b, None),
        (plain + off, 3, None, b),
    ]
    whole, first_off, resumed_plain, first_plain, resumed_off = run_distributed(_checkpoint_runs, 2, jobs)[0]
    assert first_off[0] == pytest.approx(whole[0][:3], rel=1e-6)
    for resumed in (resumed_plain, resumed_off):
        assert resumed[1] == 3
        assert resumed[0] == pytest.approx(whole[0][3:], rel=1e-6)


def test_planner_counts_only_device_states_when_offloaded_to_a_gpu_host():
    """On CUDA the memory planner counts the device part of the offload formula (params and
    grads), so a run that fits only with offload is not refused; on CPU the ZeRO formula."""
    from megazero.config import config_from_argv
    from megazero.optim.zero import zero_formula_bytes
    from megazero.planning.plan import plan_memory
    from model.build import build_gpt_config

    def plan(argv, on_cuda=False):
        cfg = config_from_argv(argv, 2)
        return plan_memory(cfg, build_gpt_config(cfg, 1001), on_cuda=on_cuda)

    argv = ["--mock-data", "--zero-stage", "2", "--dp", "2", "--device", "cpu"]
    plain = plan(argv)
    cpu = plan(argv + ["--offload-optimizer", "cpu"])
    assert cpu.model_state_bytes == plain.model_state_bytes == zero_formula_bytes(plain.params, 2, 2, 4, 4)
    gpu = plan(argv + ["--offload-optimizer", "cpu"], on_cuda=True)
    assert (
        gpu.model_state_bytes
        == offload_formula_bytes(plain.params, 2, 2, 4, 4)["device"]
        == 4 * plain.params + 4 * plain.params / 2
    )
    # ZeRO-3 with the parameter shards offloaded too (cpu or nvme): only the gradient shard
    # stays on the GPU, g Psi / N; the gathered parameters are temporaries, the same either way
    z3 = ["--mock-data", "--zero-stage", "3", "--dp", "2", "--device", "cpu", "--offload-optimizer", "cpu"]
    opt_only = plan(z3, on_cuda=True)
    assert opt_only.model_state_bytes == (4 + 4) * opt_only.params / 2
    for where in ("cpu", "nvme"):
        both = plan(z3 + ["--offload-param", where, "--offload-nvme-path", "/tmp/unused"], on_cuda=True)
        assert both.model_state_bytes == 4 * both.params / 2, where
        assert both.temporary_bytes == opt_only.temporary_bytes, where
    assert plan(z3 + ["--offload-param", "cpu"]).model_state_bytes == plan(z3).model_state_bytes  # CPU run


def test_offload_param_through_the_trainer_equals_no_parameter_offload():
    """--offload-param cpu at ZeRO-3 (train.py, dp 2): losses equal the same run without it
    within 1e-6; the parameter shards (4 bytes x Psi/N, fp32) move from the device bytes to
    the host bytes of bytes_by_place."""
    from tests.support.layouts import BASE, offload_runs

    z3 = BASE + [
        "--dp",
        "2",
        "--zero-stage",
        "3",
        "--zero3-param-persistence-threshold",
        "0",
        "--offload-optimizer",
        "cpu",
    ]
    (plain, _, plain_place), (off, cls, place) = run_distributed(
        offload_runs, 2, [z3, z3 + ["--offload-param", "cpu"]], 3
    )[0]
    assert cls == "HostOffloadOptimizer" and off == pytest.approx(plain, rel=1e-6)
    moved = place["host"] - plain_place["host"]
    assert moved > 0 and plain_place["device"] - place["device"] == moved
