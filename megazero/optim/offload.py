"""ZeRO-Offload: the optimizer state and the Adam step in host memory (Ren et al., ATC'21).

ZeRO-Offload (Ren et al. 2021, sec. 4.1-4.2) keeps the fp32 main params, both Adam moments
and an fp32 copy of the owned gradients in host (CPU) memory and runs the Adam update on the
CPU, while the device keeps what the ZeRO stage gives it: the model-dtype parameters (all of
them at stages 1/2, a shard at stage 3) and the gradients (full at stage 1, a shard at stage
2/3). :class:`HostOffloadOptimizer` is the same optimizer as
:class:`~megazero.optim.zero.DistributedOptimizer` (same phases, same owned runs, same
checkpoint format) with its state allocated on the host. One step:

1. the stage reduces the gradients on the device (``ddp.finish_grad_sync``); the overflow flag
   and the global gradient norm are computed there too, so every collective stays on the
   device (NCCL needs device tensors);
2. then every owned device gradient is copied into the host fp32 gradient buffer (cast from
   bf16/fp16 on the way; asynchronous into pinned memory, then one wait on the stream),
   unscaled and clipped there, and AdamW (``ops.adam.adam_step_lists``, torch's CPU kernel)
   updates the host main params and moments, one call per buffer and weight decay on the
   lists of views built once (``megazero/optim/step_lists.py``). The copy happens at the
   optimizer step, after ``finish_grad_sync``, not during backward (the paper overlaps it
   with backward; megazero does not yet);
3. the updated fp32 main params are copied back to the device: for an fp32 model into the
   owned runs of the parameter buffer (one list copy, asynchronous from pinned memory), for
   bf16/fp16 cast by the stage's ``gather_params``; stages 1/2 then all-gather as without
   offload.

Pinned memory: the four host tensors are the parts of one :class:`HostArena` of exactly 16
bytes per owned element, page-locked as a whole with ``cudaHostRegister`` (not through CUDA's
caching host allocator, which rounds each tensor up to a power of two); the registered range
is those bytes rounded up to whole pages, and ``pinned_bytes()`` reports it.

Without a GPU the same code runs with host and device the same memory; the accounting still
reports them apart (``HOST_PARTS``, ``bytes_by_place``). Because the model's parameters live
on the device, an fp32 model also gets a host main copy (4 bytes per owned element), so the
host holds 16 bytes per owned element: main 4 + moments 8 + gradient copy 4.
"""

from __future__ import annotations

from typing import Optional

import torch

from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.policy import sharding_policy
from megazero.data_parallel.sharding import ShardedBuffer
from megazero.offload.host_memory import HostArena, can_pin
from megazero.optim.step_lists import Piece
from megazero.optim.zero import DistributedOptimizer
from megazero.process_groups import ProcessGroups

HOST_BYTES_PER_ELEMENT = 16  # fp32 main params + exp_avg + exp_avg_sq + gradient copy


def offload_formula_bytes(
    num_params: int, dp_size: int, stage: int, param_bytes: int, grad_bytes: int
) -> dict[str, float]:
    """Model-state bytes per rank with the optimizer offloaded: ``{"device", "host"}``.

    ``num_params`` (Psi) counts this rank's chunk parameters (padded to N for an exact count),
    N = ``dp_size``. The device keeps the stage's parameters and gradients: stage 0
    ``(p + g) Psi``, stage 1 ``(p + g) Psi``, stage 2 ``p Psi + g Psi / N``, stage 3
    ``(p + g) Psi / N``; the host keeps 16 bytes per owned element: ``16 Psi / N`` (``16 Psi``
    at stage 0, where a rank owns everything). Raises ValueError for a stage without a
    strategy.
    """
    policy = sharding_policy(stage)
    owned = policy.owned_numel(num_params, dp_size)
    device = policy.formula_bytes(num_params, dp_size, param_bytes, grad_bytes, 0) - 8 * owned
    return {"device": device, "host": HOST_BYTES_PER_ELEMENT * owned}


class HostOffloadOptimizer(DistributedOptimizer):
    """:class:`DistributedOptimizer` whose fp32 state and Adam step live in host memory.

    Args: those of :class:`DistributedOptimizer`, plus ``pin_memory`` (page-lock the host
    state when the model is on CUDA, DeepSpeed's ``offload_optimizer.pin_memory``; ignored
    on a machine without CUDA, where nothing can be pinned) and ``registrar`` (what pins the
    arena: ``host_memory.CudaRegistrar`` by default; tests pass a recorder, which also pins on
    a CPU-only machine). ``adam_backend`` resolves on the CPU (``"auto"`` gives torch's
    kernel; ``"apex"`` raises ValueError, it needs CUDA).

    State (host, fp32, local coordinates as in the base class), the parts of one arena
    (``arena``): ``_main`` (every owned element, also for an fp32 model), ``exp_avg``,
    ``exp_avg_sq`` and ``host_grads``. Checkpoints (``state_dict``) are the base class's
    format: a run saved with offload resumes without it and the other way round.
    """

    HOST_PARTS = ("host_params", "main_params", "exp_avg", "exp_avg_sq", "host_grads")

    def __init__(self, ddp: DataParallel, groups: ProcessGroups, *, pin_memory: bool = True, registrar=None, **kwargs):
        self.registrar = registrar
        self.pin_memory = pin_memory and (registrar is not None or can_pin(ddp.params[0].device))
        super().__init__(ddp, groups, **kwargs)
        # fp32 models: the device owned runs <- the host main params, one list copy (phase 3)
        self._to_device = ([], [])
        for buf, mbase in zip(ddp.buffers, self.main_offsets):
            if buf.main_is_param and not getattr(buf, "swapped", False):  # NVMe: gather_params
                for own in buf.owned():
                    self._to_device[0].append(buf.owned_param_values(own))
                    self._to_device[1].append(self._main[mbase + own.local.start : mbase + own.local.end])

    def _separate_main(self, buf: ShardedBuffer) -> bool:
        return True  # the model params stay on the device; the main copy is on the host

    def _allocate_state(self, main_numel: int, numel: int) -> tuple[torch.Tensor, ...]:
        """One host arena of ``main_numel + 3 numel`` fp32 elements: main params, moments and
        the gradient copy (``host_grads``), pinned as a whole when ``pin_memory``."""
        self.arena = HostArena(
            [main_numel, numel, numel, numel], torch.float32, pin=self.pin_memory, registrar=self.registrar
        )
        *state, self.host_grads = self.arena.parts
        return tuple(state)

    def _scratch_size(self) -> int:
        return 0  # the host gradient copy is the fp32 tensor AdamW reads

    def _window_limit(self, buf: ShardedBuffer) -> Optional[int]:
        return None  # ... and it is persistent: one window per buffer

    def _work_of(self, pc: Piece, position: int):
        return pc.grad, self.host_grads[pc.offset : pc.offset + pc.grad.numel()]

    def _update(self, scale: float, coef: float, lr: float) -> None:
        """Every reduced device gradient to the host first (one wait), then unscale, clip and
        AdamW there, window by window."""
        for win in self.windows:
            torch._foreach_copy_(win.work, win.sources, non_blocking=self.pin_memory)
        if self.pin_memory and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host reads them next
        for win in self.windows:
            self._update_window(win, scale, coef, lr)

    def pinned_bytes(self) -> int:
        """Bytes of host memory page-locked for this optimizer: its arena (16 bytes per owned
        element rounded up to whole pages when pinned, else 0) plus the ZeRO-3
        ``offload_param`` shards' arenas (each rounded up to whole pages)."""
        return self.arena.pinned_bytes + self.ddp.pinned_bytes()

    @torch.no_grad()
    def _update_model_params(self) -> None:
        """Copy the host main params back into the device parameters (fp32 models: the owned
        runs; bf16/fp16: cast by the stage's ``gather_params``), then the stage's gather.

        From pinned memory the copy is asynchronous: the host writes ``_main`` again only in
        the next step's phase 5, after the next ``_update`` waited for the stream that runs it."""
        if self._to_device[0]:
            torch._foreach_copy_(*self._to_device, non_blocking=self.pin_memory)
        super()._update_model_params()

    def _shard_filler(self, buf: ShardedBuffer, mbase):
        # fp32 models: the device params already hold the update (copied above); a ZeRO-3
        # shard on NVMe is rebuilt from the host main params (zero3.Stage3.gather_params)
        swapped = getattr(buf, "swapped", False)
        return super()._shard_filler(buf, None if buf.main_is_param and not swapped else mbase)

    def formula(self) -> dict:
        """As the base class, with the optimizer's fp32 state on the host
        (:func:`offload_formula_bytes`): the total is device + host, main params 4 bytes per
        owned element (kept on the host even for an fp32 model), and the note gives both sides.
        ZeRO-3 shards on NVMe (``ddp.param_swap``): the swapped shards' bytes are replaced by the
        slots' bound (``ParamSwapper.pool_bytes``)."""
        split = {"device": 0.0, "host": 0.0}
        for psi, n in self.formula_terms():
            part = offload_formula_bytes(
                psi, n, self.ddp.strategy.stage, self._model_bytes(), self.ddp.grad_dtype.itemsize
            )
            split = {k: split[k] + part[k] for k in split}
        swap, note = self.ddp.param_swap, ""
        if swap is not None:  # ZeRO-3 shards on NVMe: the swapped ones are in the file, the slots on the host
            swapped = sum(b.params_shard.numel() * b.params_shard.element_size() for b in swap.swapped)
            split["device"] -= swapped - swap.pool_bytes()
            note = f"; parameter shards on NVMe: {swapped} bytes swapped, {swap.pool_bytes()} bytes of slots"
        return dict(
            total=split["device"] + split["host"],
            main_bytes=4,
            note=(
                f"; optimizer offloaded: device formula {split['device']:.0f} bytes + buckets, "
                f"host formula {split['host']:.0f} bytes (main, moments, gradient copy)" + note
            ),
        )

    def model_state_bytes(self) -> dict[str, int]:
        """The base class's parts plus ``host_grads`` (the host fp32 gradient copy); the parts
        in ``HOST_PARTS`` are host memory, ``bytes_by_place`` sums each side."""
        out = super().model_state_bytes()
        del out["total"]
        out["host_grads"] = self.host_grads.numel() * self.host_grads.element_size()
        out["total"] = sum(out.values())
        return out
