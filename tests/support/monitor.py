"""The iteration records the monitor and W&B tests log (ITERATIONS)."""

import numpy as np
import torch

ITERATIONS = {
    10: dict(
        consumed_samples=80,
        lr=3e-4,
        loss=5.25,
        grad_norm=1.5,
        loss_scale=65536.0,
        skipped_iterations=0,
        iteration_time_s=0.125,
        tokens_per_s=9830.4,
        tflops_per_device=0.0123,
        mfu=0.375,
        model_state_bytes=12 * 2**20,
        peak_memory_bytes=210 * 2**20,
    ),
    20: dict(
        consumed_samples=160,
        lr=torch.tensor(2.5e-4),
        loss=torch.tensor(4.5),
        grad_norm=np.float32(0.75),
        loss_scale=32768.0,
        skipped_iterations=1,
        iteration_time_s=0.25,
        tokens_per_s=4915.2,
        tflops_per_device=0.00625,
        mfu=None,
        model_state_bytes=12 * 2**20,
        peak_memory_bytes=211 * 2**20,
    ),
}
