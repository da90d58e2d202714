"""Activation recomputation (megazero/tensor_parallel/recompute.py, model/gpt.py).

Recomputation changes when activations are computed, never their values: with dropout on,
4 steps' losses and gradient norms are bit-identical to the same layout without it (the
replay draws the same masks from the RNG tracker's streams); with dropout off they equal the
single-process oracle (tests/support/reference.py) within 1e-5 relative. Each layout starts one set
of gloo ranks and trains every recomputation setting in it.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megazero.tensor_parallel.random import RNGTracker, dropout
from megazero.tensor_parallel.recompute import recompute
from tests.support.distributed import run_distributed
from tests.support.layouts import BASE, reference_losses, train_layout

STEPS = 4  # of BASE's 10-iteration schedule (warm-up 1-3, peak 3, decay 4): every setting's replay runs in every step
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
SETTINGS = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full-uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform"],
    "full-uniform-2": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "2",
    ],
    "full-block": ["--recompute-granularity", "full", "--recompute-method", "block"],
}


# -- the recomputed region in one process ---------------------------------------------------
def _region(calls, tracker, w):
    def fn(x):
        calls.append(1)
        h = dropout(torch.tanh(x @ w), 0.3, tracker.generator("replicated"))
        with tracker.fork("tp"):
            h = F.dropout(h, 0.5)  # draws from the default generator, swapped for the "tp" stream
        return h * x

    return fn


def _grads(kind):
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    tracker, calls = RNGTracker(11, tp_rank=1), []
    fn = _region(calls, tracker, w)
    if kind == "plain":
        y = fn(x)
    elif kind == "recompute":
        y = recompute(fn, tracker, x)
    else:  # torch's checkpoint restores only the default generator, not the tracker's streams
        y = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)
    other = tracker.generator("replicated").get_state()  # another micro-batch's forward draws here
    tracker.generator("replicated").manual_seed(99)
    y.sum().backward()
    tracker.generator("replicated").set_state(other)
    after = torch.rand(3, generator=tracker.generator("replicated"))  # the stream after the step
    return y.detach(), x.grad, w.grad, len(calls), after


def test_recompute_replays_the_tracker_streams():
    """Forward once without autograd, replay in backward: same output and gradients bit for bit
    as the plain region, the region runs twice, and the streams continue as without recompute.
    torch.utils.checkpoint, which does not know the tracker, gets other masks (the control)."""
    plain, again, torch_ckpt = _grads("plain"), _grads("recompute"), _grads("torch")
    assert plain[3] == 1 and again[3] == 2 and torch_ckpt[3] == 2
    for a, b in zip(plain[:3], again[:3]):
        assert torch.equal(a, b)
    assert torch.equal(plain[4], again[4])
    assert not torch.equal(plain[1], torch_ckpt[1])


def test_recompute_is_a_plain_call_without_autograd():
    tracker, calls = RNGTracker(3, tp_rank=0), []
    with torch.no_grad():
        recompute(_region(calls, tracker, torch.eye(8)), tracker, torch.ones(2, 8))
    assert calls == [1]


# -- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
        (["--recompute-method", "block"], "--recompute-method block applies to --recompute-granularity full"),
        (
            ["--recompute-granularity", "selective", "--recompute-method", "uniform"],
            "--recompute-method uniform applies to --recompute-granularity full",
        ),
        (
            ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
            "--recompute-num-layers 0 is out of range",
        ),
    ],
)
def test_bad_recompute_flags_exit_2(argv, message, capsys):
    from megazero.config import config_from_argv

    with pytest.raises(SystemExit) as e:
        config_from_argv(["--mock-data"] + argv, 1)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_deepspeed_activation_checkpointing_block(tmp_path, capsys):
    """The block maps onto full/uniform/1; CLI recompute flags win; what has no equivalent is
    named; cpu_checkpointing is refused with exit 2."""
    import json

    from megazero.config import config_from_argv

    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "activation_checkpointing": {
                    "partition_activations": True,
                    "number_checkpoints": 4,
                    "contiguous_memory_optimization": False,
                }
            }
        )
    )
    cfg = config_from_argv(["--mock-data", "--deepspeed-config", str(ds)], 1, print_warnings=False)
    m = cfg.model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 1)
    assert any("partition_activations" in w and "--sequence-parallel" in w for w in cfg.warnings)
    assert any(
        "number_checkpoints, contiguous_memory_optimization have no megazero equivalent" in w for w in cfg.warnings
    )
    cli = config_from_argv(
        ["--mock-data", "--deepspeed-config", str(ds), "--recompute-granularity", "selective"], 1, print_warnings=False
    ).model
    assert (cli.recompute_granularity, cli.recompute_method) == ("selective", None)
    ds.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": True}}))
    with pytest.raises(SystemExit) as e:
        config_from_argv(["--mock-data", "--deepspeed-config", str(ds)], 1)
    assert e.value.code == 2
    assert "activation_checkpointing.cpu_checkpointing (offloads the saved activations" in capsys.readouterr().err


# -- training under layouts ------------------------------------------------------------------
def _train_settings(rank, world, base, runs, steps):
    """Train each (name, flags) of ``runs`` in these ranks; {name: (losses, grad norms)}."""
    return {name: train_layout(rank, world, base + flags, steps)[:2] for name, flags in runs}


def _check_layout(world, extra, names, dtype_flags=()):
    base = BASE + list(extra) + list(dtype_flags)
    runs = [(f"drop-{n}", DROPOUT + SETTINGS[n]) for n in names]
    runs += [(f"nodrop-{n}", SETTINGS[n]) for n in names if n != "none" and not dtype_flags]
    results = run_distributed(_train_settings, world, base, runs, STEPS, timeout_s=900)
    for r in results:  # every rank logs the same global loss and norm
        assert r == results[0]
    got = results[0]
    for n in names[1:]:  # bit-identical to the same layout without recomputation
        assert got[f"drop-{n}"] == got["drop-none"], n
    assert all(math.isfinite(x) for x in got["drop-none"][0] + got["drop-none"][1])
    return got


@pytest.fixture(scope="module")
def reference():
    return reference_losses(BASE, STEPS)


def _equals_reference(got, reference, names):
    """Without dropout: the oracle's losses. With it: other losses (the masks really act)."""
    assert max(abs(a - b) / b for a, b in zip(got["drop-none"][0], reference)) > 1e-4
    for n in names:
        if n == "none":
            continue
        for step, (a, b) in enumerate(zip(got[f"nodrop-{n}"][0], reference)):
            assert math.isclose(a, b, rel_tol=1e-5), (n, step, a, b)


def test_recompute_single_rank(reference):
    """(tp, pp, dp) = (1, 1, 1): every setting, including uniform groups of 2 and block."""
    names = list(SETTINGS)
    _equals_reference(_check_layout(1, [], names), reference, names)


@pytest.mark.slow
def test_recompute_tp2_pp2_dp2_sequence_parallel(reference):
    """(2, 2, 2) with --sequence-parallel, 1F1B, ZeRO-1: the saved layer inputs are the
    [B, T/tp, H] chunks and the "tp" stream is replayed per rank. Micro-batch 4: 2 per
    pipeline and step (1F1B's warm-up, steady state and cool-down; a step's CPU time on gloo
    ranks is one set of collectives per micro-batch)."""
    names = ["none", "selective", "full-uniform"]
    extra = [
        "--tp",
        "2",
        "--pp",
        "2",
        "--dp",
        "2",
        "--sequence-parallel",
        "--zero-stage",
        "1",
        "--micro-batch-size",
        "4",
    ]
    _equals_reference(_check_layout(8, extra, names), reference, names)


def test_recompute_pp2_interleaved(reference):
    """pp 2 with 2 model chunks per stage (interleaved): chunks share one tracker, and the
    forwards of other micro-batches run between a region's forward and its replay (4
    micro-batches per step, a multiple of pp)."""
    names = ["none", "selective", "full-block"]
    extra = ["--pp", "2", "--virtual-pipeline-size", "2", "--micro-batch-size", "4"]
    _equals_reference(_check_layout(2, extra, names), reference, names)


@pytest.mark.parametrize("dtype", ["--bf16", "--fp16"])
def test_recompute_half_precision(dtype):
    """bf16 / fp16 weights and activations, pp 2 with GPipe (4 micro-batches per step):
    recomputation changes nothing."""
    _check_layout(
        2,
        ["--pp", "2", "--pipeline-schedule", "gpipe", "--micro-batch-size", "4"],
        ["none", "selective", "full-uniform"],
        dtype_flags=[dtype],
    )
