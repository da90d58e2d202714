"""Dtype policy, model casting, the inf/NaN check, and the fp16 loss scalers.

The expected loss-scale sequences are derived by hand, in the comments, from the rules
DeepSpeed documents for its ``fp16`` block (see ``DynamicLossScaler``'s docstring).
"""

import math

import pytest
import torch
from torch import nn

from megazero.precision import (
    DtypePolicy,
    DynamicLossScaler,
    LossScaleError,
    StaticLossScaler,
    cast_model_,
    has_inf_or_nan,
    model_dtype,
    non_finite_flag,
    unscale_and_check_,
)

O, C = True, False  # overflow, clean iteration


def test_model_dtype_and_policy():
    assert model_dtype(False, False) == torch.float32
    assert model_dtype(True, False) == torch.float16
    assert model_dtype(False, True) == torch.bfloat16
    with pytest.raises(ValueError, match="--fp16 and --bf16"):
        model_dtype(True, True)
    pol = DtypePolicy.from_flags(fp16=False, bf16=True, grads_in_fp32=False)
    assert (pol.model, pol.main, pol.grad_reduce) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert DtypePolicy.from_flags(True, False).needs_loss_scaling
    assert not pol.needs_loss_scaling


def test_cast_model_keeps_parameter_objects_and_tags():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    model.register_buffer("steps", torch.arange(3))
    weight = model[0].weight
    weight.tensor_model_parallel = True
    expected = weight.detach().to(torch.bfloat16)
    cast_model_(model, torch.bfloat16)
    assert model[0].weight is weight and weight.tensor_model_parallel
    assert torch.equal(weight.detach(), expected)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.steps.dtype == torch.int64


def test_inf_nan_check():
    finite = [torch.randn(5), torch.randn(2, 3).to(torch.bfloat16), torch.randn(4).half()]
    assert not has_inf_or_nan(finite)
    assert not has_inf_or_nan([])
    assert has_inf_or_nan(finite + [torch.tensor([1.0, float("inf")])])
    assert has_inf_or_nan(finite + [torch.tensor([float("nan")]).half()])
    assert has_inf_or_nan([torch.tensor([-float("inf")]).to(torch.bfloat16)])
    assert non_finite_flag(finite).dtype == torch.float32
    grads = [torch.tensor([2.0, -4.0]), torch.tensor([8.0])]
    flag = unscale_and_check_(grads, 0.25)
    assert flag.item() == 0.0
    assert grads[0].tolist() == [0.5, -1.0] and grads[1].tolist() == [2.0]


def refuse_bf16_like_cuda(monkeypatch) -> list:
    """Make ``torch._amp_foreach_non_finite_check_and_unscale_`` refuse bf16 as its CUDA build
    does (pytorch#127176: the kernel dispatches on float, double and half only); returns the
    list of the dtypes of each call it accepted."""
    real, accepted = torch._amp_foreach_non_finite_check_and_unscale_, []

    def kernel(tensors, found_inf, inv_scale):
        if any(t.dtype == torch.bfloat16 for t in tensors):
            raise RuntimeError("\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'")
        accepted.append(sorted({str(t.dtype) for t in tensors}))
        return real(tensors, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", kernel)
    return accepted


def test_bf16_overflow_check_without_the_cuda_amp_kernel(monkeypatch):
    """With the kernel refusing bf16 as on CUDA: bf16 tensors are checked and unscaled by torch
    ops (flags inf, -inf, NaN, inf with -inf in one tensor; no false alarm on the largest finite
    bf16 values), fp16 and fp32 still go through the fused kernel, one call per dtype."""
    accepted = refuse_bf16_like_cuda(monkeypatch)
    bf = [torch.tensor([2.0, -4.0]).bfloat16(), torch.tensor([[8.0]]).bfloat16()]
    others = [torch.tensor([2.0]).half(), torch.tensor([4.0])]
    assert unscale_and_check_(bf + others, 0.5).tolist() == [0.0]
    assert bf[0].tolist() == [1.0, -2.0] and bf[1].tolist() == [[4.0]]
    assert others[0].tolist() == [1.0] and others[1].tolist() == [2.0]
    assert accepted == [["torch.float16"], ["torch.float32"]]
    inf, nan = float("inf"), float("nan")
    for bad in ([1.0, inf], [-inf, 1.0], [nan, 2.0], [inf, -inf]):
        flag = non_finite_flag([torch.ones(3).bfloat16(), torch.tensor(bad).bfloat16()])
        assert flag.dtype == torch.float32 and flag.tolist() == [1.0], bad
    biggest = torch.finfo(torch.bfloat16).max
    assert not has_inf_or_nan([torch.full((4096,), biggest).bfloat16(), torch.full((7,), -biggest).bfloat16()])


def _bf16_steps(rank, world, argv, steps):
    from tests.support.layouts import train_layout

    return train_layout(rank, world, argv, steps)[:2]  # (losses, gradient norms)


def test_bf16_grads_in_model_dtype_train_with_the_cuda_kernel_refusal(monkeypatch):
    """``--bf16 --grads-in-model-dtype`` (bf16 gradient buffers) trains through the Trainer and
    ZeRO-1 at dp 2 while the AMP kernel refuses bf16 as on CUDA: no step is skipped (finite
    gradient norms) and the losses follow the fp32 reference to bf16's precision (on a GPU
    the first step used to fail)."""
    from tests.support.distributed import run_distributed
    from tests.support.layouts import BASE, reference_losses

    steps = 3
    reference = reference_losses(BASE, steps)
    refuse_bf16_like_cuda(monkeypatch)  # the forked ranks inherit the patched torch
    argv = BASE + ["--bf16", "--grads-in-model-dtype", "--dp", "2", "--zero-stage", "1"]
    for losses, norms in run_distributed(_bf16_steps, 2, argv, steps):
        assert all(math.isfinite(x) for x in norms), norms
        assert losses == pytest.approx(reference, rel=1e-2), (losses, reference)


def _run(scaler, events):
    """Apply ``events``; return (scale, hysteresis_left, skipped_steps, consecutive_skips) after each."""
    trace = []
    for overflow in events:
        scaler.update(overflow)
        trace.append((scaler.scale, scaler.hysteresis_left, scaler.skipped_steps, scaler.consecutive_skips))
    return trace


def test_dynamic_scaler_scripted_sequence():
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=1.0)
    assert (s.scale, s.hysteresis_left, s.skipped_steps, s.consecutive_skips) == (16.0, 2, 0, 0)
    events = [O, O, C, C, C, O, C, O, O, O, O, O, C]
    expected = [
        (16.0, 1, 1, 1),  # overflow, hysteresis 2 -> 1: scale kept (delayed shift)
        (8.0, 1, 2, 2),  # overflow with hysteresis_left 1: halve
        (8.0, 1, 2, 0),  # clean 1 of window 3
        (8.0, 1, 2, 0),  # clean 2
        (16.0, 2, 2, 0),  # clean 3 = window: double, refill hysteresis
        (16.0, 1, 3, 1),  # overflow: hysteresis 2 -> 1
        (16.0, 1, 3, 0),  # clean: no refill without consecutive_hysteresis
        (8.0, 1, 4, 1),  # overflow with hysteresis_left 1: halve
        (4.0, 1, 5, 2),
        (2.0, 1, 6, 3),
        (1.0, 1, 7, 4),  # reaches min_loss_scale
        (1.0, 1, 8, 5),  # max(1/2, min_loss_scale) = 1
        (1.0, 1, 8, 0),
    ]
    assert _run(s, events) == expected


def test_dynamic_scaler_consecutive_hysteresis_and_hysteresis_one():
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2, consecutive_hysteresis=True)
    assert _run(s, [O, C, O, O, C, C]) == [
        (16.0, 1, 1, 1),  # hysteresis 2 -> 1
        (16.0, 2, 1, 0),  # clean: consecutive_hysteresis refills at once
        (16.0, 1, 2, 1),  # hysteresis 2 -> 1 again, scale kept
        (8.0, 1, 3, 2),  # halve
        (8.0, 2, 3, 0),  # refill
        (16.0, 2, 3, 0),  # 2 clean = window: double
    ]
    s1 = DynamicLossScaler(initial_scale_power=3, loss_scale_window=100, hysteresis=1)
    assert [t[0] for t in _run(s1, [O, O, C, O])] == [4.0, 2.0, 2.0, 1.0]  # every overflow halves


def test_dynamic_scaler_window_counts_from_last_overflow():
    s = DynamicLossScaler(initial_scale_power=0, loss_scale_window=4, hysteresis=1, min_loss_scale=0.25)
    scales = [t[0] for t in _run(s, [C] * 4 + [C] * 3 + [O] + [C] * 4)]
    # 4 clean -> 2; 3 clean (window not reached); overflow halves to 1 and restarts the count;
    # 4 more clean -> 2
    assert scales == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 2.0]


def test_loss_scale_error_after_consecutive_skips_at_min_scale():
    s = DynamicLossScaler(
        initial_scale_power=1, loss_scale_window=10, hysteresis=1, min_loss_scale=1.0, max_consecutive_skips=3
    )
    s.update(O)  # 2 -> 1, not yet at the minimum when it overflowed
    s.update(O)  # 1st overflow at the minimum
    s.update(C)  # a clean step resets the count
    s.update(O)
    s.update(O)
    with pytest.raises(LossScaleError, match=r"max_consecutive_skips=3.*") as err:
        s.update(O)  # 3rd consecutive overflow at scale 1
    message = str(err.value)
    assert "3 consecutive" in message and "min_loss_scale=1" in message
    assert "--bf16" in message and "--lr" in message
    assert isinstance(err.value, RuntimeError)


def test_static_scaler_never_changes():
    s = StaticLossScaler(128.0, max_consecutive_skips=2)
    events = [C, O, C, C, O, C]
    trace = _run(s, events)
    assert [t[0] for t in trace] == [128.0] * len(events)
    assert trace[-1][2] == 2  # two skipped steps
    assert s.scale_loss(torch.tensor(0.5)).item() == 64.0
    s.update(O)
    with pytest.raises(LossScaleError, match="max_consecutive_skips=2"):
        s.update(O)
    with pytest.raises(ValueError, match="0 means dynamic"):
        StaticLossScaler(0)


def test_scaler_state_dict_resumes_identically():
    events = [O, C, C, O, O, C, C, C, O, C, C, C, C]
    a = DynamicLossScaler(initial_scale_power=5, loss_scale_window=3, hysteresis=2)
    _run(a, events[:6])
    b = DynamicLossScaler(initial_scale_power=20, loss_scale_window=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert _run(a, events[6:]) == _run(b, events[6:])
    assert math.log2(a.scale) == int(math.log2(a.scale))


@pytest.mark.cuda
def test_inf_nan_check_cuda():
    dev = torch.device("cuda")
    finite = [torch.randn(5, device=dev), torch.randn(3, device=dev).half(), torch.randn(2)]
    assert not has_inf_or_nan(finite)
    assert has_inf_or_nan(finite + [torch.tensor([float("nan")], device=dev).to(torch.bfloat16)])
    grads = [torch.tensor([2.0, 4.0], device=dev)]
    assert unscale_and_check_(grads, 0.5).item() == 0.0 and grads[0].tolist() == [1.0, 2.0]
