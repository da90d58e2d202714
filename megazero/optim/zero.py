"""ZeRO distributed AdamW: each DP rank updates only the runs of the flat buffers it owns.

ZeRO (Rajbhandari et al., SC'20, sec. 5.1-5.2): the fp32 main params and both Adam moments
(12 bytes per element, 8 for an fp32 model whose parameters are the main params) are
partitioned over the N data-parallel ranks (P_os); ZeRO-2 also partitions the gradients
(P_os+g). What a rank owns, where its gradients are and how parameters come back after the
update is asked of the sharded-buffer interface (``megazero/data_parallel/sharding.py``),
never of the stage number: the moments are laid out in local coordinates
(``megazero/data_parallel/grad_buffer.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megazero import collectives as C
from megazero import tags
from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.grad_buffer import Range
from megazero.data_parallel.param_gather import ParamGatherOverlap
from megazero.data_parallel.policy import sharding_policy
from megazero.data_parallel.sharding import ShardedBuffer
from megazero.ops.adam import adam_step_lists
from megazero.optim.clip import clip_coefficient, norm_from_squares, reduce_squared_sum
from megazero.optim.step_lists import Piece, Window, build_windows, counted_views, merge_runs
from megazero.precision import LossScaleError, non_finite_flag
from megazero.process_groups import ProcessGroups

STATE_KEYS = ("main_param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step.

    ``skipped``: no update (inf/NaN gradients on some rank, or ``empty``). ``grad_norm``:
    global norm of the unscaled gradient before clipping (NaN when skipped for inf/NaN).
    ``loss_scale``: the scale the gradients of this step were computed with (1.0 without a
    loss scaler). ``empty``: the global batch had no loss token (``step(loss_tokens=0)``):
    nothing to learn, so no update, no Adam step and no loss-scale change.
    """

    skipped: bool
    grad_norm: float
    loss_scale: float
    empty: bool = False


def zero_formula_bytes(
    num_params: int, dp_size: int, stage: int, param_bytes: int, grad_bytes: int, main_param_bytes: Optional[int] = None
) -> float:
    """Model-state bytes per rank predicted by the ZeRO paper (Rajbhandari et al. 2020, sec. 5).

    ``num_params`` (Psi) counts this rank's model-chunk parameters, ``dp_size`` is N; the two
    fp32 Adam moments are 8 bytes per parameter and the fp32 main params ``main_param_bytes``
    (default: 0 for an fp32 model, whose parameters ARE its main params, else 4):
    stage 0: ``(p + g + m + 8) Psi``; stage 1: ``(p + g) Psi + (m + 8) Psi / N``; stage 2:
    ``p Psi + (g + m + 8) Psi / N``. With 2-byte params and grads this is the paper's 16 Psi,
    4 Psi + 12 Psi / N and 2 Psi + 14 Psi / N; fp32: 16 Psi, 8 Psi + 8 Psi / N, 4 Psi +
    12 Psi / N. Temporary buckets come on top (``DistributedOptimizer.bucket_bound_bytes``),
    and so does the padding of each buffer to a multiple of N. Raises ValueError for a stage
    without a strategy.
    """
    main = (0 if param_bytes == 4 else 4) if main_param_bytes is None else main_param_bytes
    return sharding_policy(stage).formula_bytes(num_params, dp_size, param_bytes, grad_bytes, main)


class DistributedOptimizer:
    """AdamW over the owned runs of a :class:`DataParallel`'s sharded buffers (any ZeRO stage).

    ``step(lr)`` runs, in order (N = DP size, Psi = elements of this rank's chunks):

    1. finish the gradient sync (``ddp.finish_grad_sync``): stage 0 all-reduce (2 Psi
       elements on the wire per step), stage 1 reduce-scatter (Psi per step), stage 2
       reduce-scatter (Psi per micro-batch, mostly already done during backward); then the
       finalize step (sequence-parallel sums over TP, tied embeddings over their group).
    2. overflow check, from the sum of squares of step 4: an inf/NaN anywhere in the counted
       gradients makes it inf/NaN on every rank (every gradient a rank does not count is a
       bitwise copy of one another rank counts: TP-replicated, tied or DP-replicated). Only
       then is the inf/NaN flag of this rank's reduced gradients taken and MAX all-reduced
       over the whole world (``_has_non_finite``); in the common step no pass over the
       gradients and no collective is spent on it (PyTorch's ``clip_grad_norm_`` with
       ``error_if_nonfinite`` reads its norm the same way). On overflow every rank skips, the
       loss scaler is updated and the skip counted (``LossScaleError`` after
       ``max_consecutive_skips`` consecutive skips at the minimum scale).
    3. unscale by the loss scale used in backward, exactly once.
    4. global gradient norm (``clip.reduce_squared_sum``: one SUM all-reduce over the world
       when the owned gradients are sharded over DP, else over the model-parallel group),
       then clip by it when ``clip_grad > 0``. The sum of squares is read on the host after
       its all-reduce: the step's one host synchronisation.
    5. AdamW (``ops.adam.adam_step_lists``) on the owned fp32 main params; weight decay only
       on parameters whose ``tags.decays`` is True (the model's parameter spec; by default
       ``ndim >= 2``: biases and norm weights are not decayed, as in Megatron-LM): one
       multi-tensor call per buffer and weight-decay value.
    6. bring the updated parameters to every DP rank (``ShardedBuffer.gather_params``:
       stages 1/2 all-gather in pieces of ``allgather_bucket_size`` elements, Psi per step;
       with ``overlap_param_gather`` one asynchronous in-place all-gather per bucket instead,
       each waited for just before the next forward uses it:
       ``megazero/data_parallel/param_gather.py``).

    An fp32 model's main params are its parameters (views of the flat parameter buffer); a
    bf16/fp16 model gets an fp32 copy of its owned runs. Steps 2-5 run multi-tensor kernels on
    lists of views built once here (``megazero/optim/step_lists.py``): fp32 gradients are
    unscaled and clipped in place, a whole buffer per call; gradients in the model dtype go
    through one fp32 scratch of one piece (bucket shard), a piece per call, allocated for the
    step only.

    Args: ``ddp``; ``groups``; AdamW ``lr`` (default for ``step``), ``beta1``, ``beta2``,
    ``eps``, ``weight_decay``; ``clip_grad`` (0 = off); ``loss_scaler`` (a
    ``precision.DynamicLossScaler``/``StaticLossScaler``, None for fp32/bf16);
    ``allgather_bucket_size`` (elements per all-gather); ``adam_backend``;
    ``max_consecutive_skips``; ``overlap_param_gather`` (ZeRO-1/2 only: leave the step-6
    all-gathers in flight; call ``wait_param_gather`` before reading the parameters other than
    through the model's forward); ``exact_norm`` (every square in fp64 on the CPU too,
    ``clip.squared_sum``: FP8 training's clip coefficient). Raises ValueError for ``allgather_bucket_size < 1``,
    ``max_consecutive_skips < 1`` or ``overlap_param_gather`` at ZeRO stage 0 or 3.
    """

    def __init__(
        self,
        ddp: DataParallel,
        groups: ProcessGroups,
        *,
        lr: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_grad: float = 0.0,
        loss_scaler=None,
        allgather_bucket_size: int = 500_000_000,
        adam_backend: str = "auto",
        max_consecutive_skips: int = 50,
        overlap_param_gather: bool = False,
        exact_norm: bool = False,
    ):
        if allgather_bucket_size < 1 or max_consecutive_skips < 1:
            raise ValueError(
                f"allgather_bucket_size ({allgather_bucket_size}) and "
                f"max_consecutive_skips ({max_consecutive_skips}) must be >= 1"
            )
        self.ddp, self.groups = ddp, groups
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.weight_decay, self.clip_grad, self.loss_scaler = weight_decay, clip_grad, loss_scaler
        self.allgather_bucket_size, self.adam_backend = allgather_bucket_size, adam_backend
        self.max_consecutive_skips, self.exact_norm = max_consecutive_skips, exact_norm
        self.step_count = self.skipped_steps = self.consecutive_min_skips = 0
        self.offsets, self.main_offsets, total, separate = [], [], 0, 0
        for buf in ddp.buffers:
            own = self._separate_main(buf)
            self.offsets.append(total)
            self.main_offsets.append(separate if own else None)
            total += buf.owned_numel()
            separate += buf.owned_numel() if own else 0
        self.device = ddp.params[0].device  # where the model and the collectives live
        self._main, self.exp_avg, self.exp_avg_sq = self._allocate_state(separate, total)
        self.pieces = [p for i, buf in enumerate(ddp.buffers) for p in self._pieces(i, buf)]
        self.peak_step_bytes = 0
        self._build_step_lists()
        self._init_main_params()
        self.param_gather = ParamGatherOverlap(ddp.chunks, ddp.buffers, groups.dp) if overlap_param_gather else None

    def _separate_main(self, buf: ShardedBuffer) -> bool:
        """Whether ``buf``'s owned runs get an fp32 main copy (else the params are the main)."""
        return not buf.main_is_param

    def _allocate_state(self, main_numel: int, numel: int) -> tuple[torch.Tensor, ...]:
        """Zeroed fp32 ``(main params, exp_avg, exp_avg_sq)`` of ``main_numel``, ``numel`` and
        ``numel`` elements (local coordinates, on the model's device)."""
        return tuple(torch.zeros(n, dtype=torch.float32, device=self.device) for n in (main_numel, numel, numel))

    def _build_step_lists(self) -> None:
        """The views every step works on, taken once (``megazero/optim/step_lists.py``): the
        overflow check's gradients, the norm's counted runs, the update windows."""
        self._flag_grads = [pc.grad for pc in self.pieces]
        # every element once: ZeRO shards are disjoint over the world; unsharded (stage 0) buffers
        # are summed over the model-parallel group, or, with expert parallelism (expert buffers
        # differ across the ep ranks, and the etp partitions across the tp ranks), over the world
        # from the first replica of each buffer: an expert partition's tp / etp copies are in its
        # edp group, so it counts once (Megatron-LM PR #5916 counted them per tp rank)
        apart = self.groups.experts_apart
        self._sharded_norm = self.ddp.strategy.shards_optimizer or apart
        # hybrid sharding: the shards are disjoint over the shard group and replicated over the
        # replica group, so only the first replica's copy counts
        counted = [
            pc
            for pc in self.pieces
            if (self.ddp.strategy.shards_optimizer or not apart or pc.buffer.layout.dp_rank == 0)
            and pc.buffer.replica_rank == 0
        ]
        self._counted = counted_views(counted)
        self._scratch_numel = self._scratch_size()
        self._scratch = (
            torch.empty(self._scratch_numel, dtype=torch.float32, device=self.device) if self._scratch_numel else None
        )
        self.windows: list[Window] = []
        for buf in self.ddp.buffers:
            pieces = [pc for pc in self.pieces if pc.buffer is buf]
            self.windows += build_windows(pieces, self._work_of, self.exp_avg, self.exp_avg_sq, self._window_limit(buf))
        self._hold_scratch(False)  # the views stay; the memory exists during a step only

    def _scratch_size(self) -> int:
        """Elements of the fp32 scratch for gradients kept in the model dtype: the largest
        piece (0 when the gradients are fp32). A window is then one piece: a scratch of a whole
        buffer would add 4 bytes per owned element to the step's high-water mark."""
        return max((pc.grad.numel() for pc in self.pieces if pc.grad.dtype != torch.float32), default=0)

    def _window_limit(self, buf: ShardedBuffer) -> Optional[int]:
        """Most elements per update window of ``buf`` (None: the whole buffer)."""
        return None if buf.grads.dtype == torch.float32 else self._scratch_numel

    def _work_of(self, pc: Piece, position: int) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """``(gradient to copy, fp32 tensor AdamW reads)`` of ``pc`` at ``position`` in its
        window: fp32 gradients in place, others through the scratch."""
        if pc.grad.dtype == torch.float32:
            return None, pc.grad
        return pc.grad, self._scratch[position : position + pc.grad.numel()]

    def _hold_scratch(self, hold: bool) -> None:
        """Give the scratch its memory for a step, or take it away (storage resized to 0
        bytes; the views taken once stay valid, as ZeRO-3's released buffers do)."""
        if self._scratch is None:
            return
        storage = self._scratch.untyped_storage()
        storage.resize_(self._scratch_numel * 4 if hold else 0)
        if hold:
            self.peak_step_bytes = max(self.peak_step_bytes, self._scratch_numel * 4)

    def _uses_adam(self, p: torch.Tensor) -> bool:
        """Whether AdamW updates ``p`` (all of them here; ``optim.muon`` keeps the hidden
        matrices for itself)."""
        return True

    def _pieces(self, i: int, buf: ShardedBuffer) -> list[Piece]:
        tp_rank, out, mbase = self.groups.tp_rank, [], self.main_offsets[i]
        for own in buf.owned():
            adam, counted = [], []
            for p, _, wr in buf.layout.param_pieces(own.world):
                rel = wr.shift(-own.world.start)
                if self._uses_adam(p):
                    adam.append((rel, tags.decays(p)))
                if tags.counts_in_norm(p, tp_rank):
                    counted.append((rel, True))
            main = (
                buf.owned_param_values(own)
                if mbase is None
                else self._main[mbase + own.local.start : mbase + own.local.end]
            )
            out.append(
                Piece(
                    buf,
                    own.world,
                    self.offsets[i] + own.local.start,
                    own.grad,
                    main,
                    merge_runs(adam),
                    [r for r, _ in merge_runs(counted)],
                )
            )
        return out

    @torch.no_grad()
    def _init_main_params(self) -> None:
        for buf, mbase in zip(self.ddp.buffers, self.main_offsets):
            if mbase is not None:
                with buf.strategy.shard_on_host(buf):  # ZeRO-3 on NVMe: read from the swap file
                    for own in buf.owned():
                        self._main[mbase + own.local.start : mbase + own.local.end].copy_(buf.owned_param_values(own))

    @property
    def main_param(self) -> torch.Tensor:
        """This rank's fp32 main params in local order (a copy; 1-D)."""
        return torch.cat([pc.main for pc in self.pieces])

    # -- public API ----------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` before backward (identity without a loss scaler)."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def zero_grad(self) -> None:
        """Start a step (``ddp.zero_grad``)."""
        self.ddp.zero_grad()

    @torch.no_grad()
    def step(self, lr: Optional[float] = None, loss_tokens: Optional[torch.Tensor] = None) -> StepResult:
        """One optimizer step (phases 1-6 of the class docstring); ``lr`` defaults to the
        constructor's. Reads the device once (the sum of squares; twice when it is not finite).
        ``loss_tokens``: the global batch's count of loss tokens (0-d, the same on every rank,
        e.g. ``Trainer.local_batches``' count), read in the same host sync; when it is 0 the
        step is skipped without an update (``StepResult.empty``): Adam's moments and weight
        decay would otherwise move the weights on a batch that carries no signal.
        Raises LossScaleError (a RuntimeError) when stuck skipping."""
        lr = self.lr if lr is None else lr
        self.peak_step_bytes = 0
        self.wait_param_gather()  # normally done: the forward waited for every bucket
        self.ddp.finish_grad_sync()  # 1
        scale = 1.0 if self.loss_scaler is None else float(self.loss_scaler.scale)
        sq = reduce_squared_sum(
            self._counted,
            self.groups,
            device=self.device,  # 2 and 4
            sharded_over_dp=self._sharded_norm,
            exact=self.exact_norm,
        )
        if loss_tokens is None:
            squares = sq.item()  # the step's host sync
        else:  # the count rides on the same sync
            both = torch.cat([sq.reshape(1).double(), loss_tokens.reshape(1).to(sq.device, torch.float64)])
            squares, tokens = both.tolist()
            if tokens == 0:
                return StepResult(True, norm_from_squares(squares, 1.0 / scale), scale, empty=True)
        if not math.isfinite(squares) and self._has_non_finite():
            self._skip(scale)
            return StepResult(True, float("nan"), scale)
        if self.loss_scaler is not None:
            self.loss_scaler.update(False)
        self.consecutive_min_skips = 0
        norm = norm_from_squares(squares, 1.0 / scale)
        coef = clip_coefficient(norm, self.clip_grad)
        self.step_count += 1
        self._update(scale, coef, lr)  # 3-5
        self._update_model_params()  # 6
        return StepResult(False, norm, scale)

    def _has_non_finite(self) -> bool:
        """Whether any rank's reduced gradients hold an inf/NaN: the flag over this rank's pieces,
        one MAX all-reduce over the world, read on the host. Asked only when the global sum of
        squares is not finite (it is the same number on every rank, so every rank asks): an
        inf/NaN gradient, or finite gradients whose squares overflow the fp32 rows of the CPU
        norm (``optim.clip``), which are no overflow and keep today's inf norm."""
        flag = non_finite_flag(self._flag_grads).to(self.device)
        C.all_reduce_max(flag, self.groups.world)
        return bool(flag.item() > 0)

    def _update(self, scale: float, coef: float, lr: float) -> None:
        """Phases 3-5 window by window: gradients into the scratch when not fp32, unscale,
        clip, AdamW; the scratch's memory is held for this loop only."""
        self._hold_scratch(True)
        for win in self.windows:
            if win.sources:
                torch._foreach_copy_(win.work, win.sources)
            self._update_window(win, scale, coef, lr)
        self._hold_scratch(False)

    def _update_window(self, win: Window, scale: float, coef: float, lr: float) -> None:
        """Unscale and clip ``win.work`` in place, then one AdamW call per weight decay."""
        if scale != 1.0:
            torch._foreach_mul_(win.work, 1.0 / scale)
        if coef < 1.0:
            torch._foreach_mul_(win.work, coef)
        for a in win.adam:
            adam_step_lists(
                a.params,
                a.grads,
                a.exp_avgs,
                a.exp_avg_sqs,
                step=self.step_count,
                lr=lr,
                beta1=self.beta1,
                beta2=self.beta2,
                eps=self.eps,
                weight_decay=self.weight_decay if a.decays else 0.0,
                backend=self.adam_backend,
            )

    def _skip(self, scale: float) -> None:
        self.skipped_steps += 1
        at_min = self.loss_scaler is None or scale <= self.loss_scaler.min_loss_scale
        self.consecutive_min_skips = self.consecutive_min_skips + 1 if at_min else 0
        if self.loss_scaler is not None:
            self.loss_scaler.update(True)
        if self.consecutive_min_skips >= self.max_consecutive_skips:
            where = "without loss scaling" if self.loss_scaler is None else f"at the minimum loss scale {scale:g}"
            fix = "lower --lr" + ("" if self.clip_grad else ", enable --clip-grad")
            fix += "" if self.loss_scaler is None else ", or use --bf16 instead of --fp16"
            raise LossScaleError(
                f"gradients were inf/NaN in {self.consecutive_min_skips} consecutive steps "
                f"{where} (--max-consecutive-skips {self.max_consecutive_skips}); the run "
                f"diverged: {fix}"
            )

    def wait_param_gather(self) -> None:
        """Wait for the all-gathers ``overlap_param_gather`` left in flight (no-op without)."""
        if self.param_gather is not None:
            self.param_gather.wait_all()

    @torch.no_grad()
    def _update_model_params(self) -> None:
        if self.param_gather is not None:
            self.param_gather.start(
                {
                    id(buf): None if buf.main_is_param else self._shard_filler(buf, m)
                    for buf, m in zip(self.ddp.buffers, self.main_offsets)
                }
            )
            return
        for buf, mbase in zip(self.ddp.buffers, self.main_offsets):
            used = buf.gather_params(
                self._shard_filler(buf, mbase), max(1, self.allgather_bucket_size // buf.layout.dp_size)
            )
            self.peak_step_bytes = max(self.peak_step_bytes, used)

    def _shard_filler(self, buf: ShardedBuffer, mbase: Optional[int]):
        """``fill(a, b, out)``: this rank's updated values of ``buf``'s local ``[a, b)`` into
        ``out`` (model dtype)."""
        rank = buf.layout.dp_rank

        def fill(a: int, b: int, out: torch.Tensor) -> None:
            if mbase is not None:
                out.copy_(self._main[mbase + a : mbase + b])
                return
            for world, local in buf.layout.local_to_world(Range(a, b), rank):
                out[local.start - a : local.end - a].copy_(buf.param_values(world))

        return fill

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state allocated on this rank.

        ``params`` the flat model-parameter buffers; ``grads`` persistent gradient storage
        (full buffers at stages 0/1, a shard at stage 2); ``host_params`` (only with ZeRO-3
        ``offload_param``) the parameter shards in host memory; ``main_params`` the fp32 copy of the
        owned runs (0 for an fp32 model: its parameters are the main params); ``exp_avg``,
        ``exp_avg_sq`` fp32 moments of the owned runs; ``buckets`` the high-water mark of
        temporaries during the last step (ZeRO-2 staging and the finalize step's packed
        buffer during backward, the fp32 scratch or the all-gather buffers in the optimizer
        step; at most ``bucket_bound_bytes()``); ``total`` their sum.
        """
        size = lambda t: t.numel() * t.element_size()
        host = self.ddp.host_param_bytes()  # ZeRO-3 offload_param: shards in host memory
        out = {
            "params": self.ddp.param_bytes() - host,
            "grads": self.ddp.grad_bytes(),
            "main_params": size(self._main),
            "exp_avg": size(self.exp_avg),
            "exp_avg_sq": size(self.exp_avg_sq),
            "buckets": max(self.ddp.peak_temp_bytes, self.peak_step_bytes),
        }
        if host:
            out["host_params"] = host
        out["total"] = sum(out.values())
        return out

    HOST_PARTS: tuple = ("host_params",)  # model_state_bytes() keys kept in host memory

    def formula(self) -> dict:
        """The ZeRO paper's prediction of ``model_state_bytes()`` for this optimizer (sec. 5).

        Psi is the padded element count of this rank's buffers (parameters plus the padding
        of each buffer to a multiple of N), N the data-parallel size, p / g the parameter and
        gradient bytes. Returns ``{"total": bytes, "main_bytes": m, "note": str}``: the total
        of :func:`zero_formula_bytes` for this stage, the fp32 main-param bytes per parameter
        (0 for an fp32 model, whose parameters are its main params) and what the table adds
        to the formula's description (empty here; offload names its host part).
        """
        p, g = self._model_bytes(), self.ddp.grad_dtype.itemsize
        total = sum(zero_formula_bytes(psi, n, self.ddp.strategy.stage, p, g) for psi, n in self.formula_terms())
        return dict(total=total, main_bytes=0 if p == 4 else 4, note="")

    def formula_terms(self) -> list[tuple[int, int]]:
        """``(Psi, N)`` per kind of buffer: the padded elements of the buffers sharded over the
        dp x cp replicas with N their count (S under hybrid sharding), and (expert parallelism)
        those of the expert buffers with N the expert-data-parallel size (S / EP under hybrid
        sharding: the expert shard group, megazero/data_parallel/ddp.py)."""
        by_n: dict[int, int] = {}
        for b in self.ddp.buffers:
            by_n[b.layout.dp_size] = by_n.get(b.layout.dp_size, 0) + b.layout.padded_numel
        return [(psi, n) for n, psi in sorted(by_n.items(), reverse=True)]

    def _model_bytes(self) -> int:
        """Bytes per element of the model's parameters (their dtype)."""
        return self.ddp.buffers[0].layout.params[0].dtype.itemsize

    def bytes_by_place(self) -> dict[str, int]:
        """``{"device": bytes, "host": bytes}``: ``model_state_bytes()["total"]`` split by where
        each part lives (the keys in ``HOST_PARTS`` are in host memory, the rest on the model's
        device; on a CPU-only machine both are the same memory, still reported apart)."""
        got = self.model_state_bytes()
        host = sum(got.get(k, 0) for k in self.HOST_PARTS)
        return {"device": got["total"] - host, "host": host}

    def pinned_bytes(self) -> int:
        """Bytes of host memory page-locked for the model state (ZeRO-3 ``offload_param``
        shards; the offloaded optimizer adds its arena)."""
        return self.ddp.pinned_bytes()

    def bucket_bound_bytes(self) -> int:
        """B: the most temporary bytes one step holds at a time (the formula's "+ at most B
        bytes of buckets"): the largest of the backward staging bound
        (``DataParallel.staging_bound_bytes``), the finalize step's packed buffer (at most one
        bucket, ``DataParallel.finalize_bound_bytes``), the fp32 scratch (one piece, when
        gradients are not fp32) and the
        all-gather buffers (``allgather_bucket_size / N`` elements per rank, N + 1 of them),
        plus at ZeRO-3 the gathered parameters (``DataParallel.gathered_bound_bytes``).
        """
        ddp = self.ddp
        scratch = 4 * self._scratch_numel
        return (
            max(ddp.staging_bound_bytes(), ddp.finalize_bound_bytes(), scratch, self._gather_bound_bytes())
            + ddp.gathered_bound_bytes()
        )

    def _gather_bound_bytes(self) -> int:
        """The most temporary bytes of the step's parameter all-gather (phase 6)."""
        return max(
            buf.strategy.gather_bound_bytes(
                buf, max(1, self.allgather_bucket_size // buf.layout.dp_size), buf.layout.dp_size
            )
            for buf in self.ddp.buffers
        )

    # -- checkpoint state ----------------------------------------------------------------
    def owned_state(self):
        """``(name, param, param Range, main view, exp_avg view, exp_avg_sq view)`` of every
        owned element run: ``param Range`` in the parameter's flattened (TP-local) coordinates,
        the views 1-D fp32 of ``param Range.size`` elements of this optimizer's own state
        (writing them sets the state; call ``refresh_model_params`` after writing main)."""
        names = {id(p): n for chunk in self.ddp.chunks for n, p in chunk.named_parameters()}
        for pc in self.pieces:
            for p, pr, wr in pc.buffer.layout.param_pieces(pc.world):
                rel = wr.start - pc.world.start
                s, e = pc.offset + rel, pc.offset + rel + pr.size
                yield (names[id(p)], p, pr, pc.main[rel : rel + pr.size], self.exp_avg[s:e], self.exp_avg_sq[s:e])

    def _owned_param_pieces(self):
        return ((name, pr, *views) for name, _, pr, *views in self.owned_state())

    def state_dict(self) -> dict:
        """This rank's fp32 shard and moments, keyed by parameter name and param Range.

        ``shards`` is a list of ``dict(name, start, end, main_param, exp_avg, exp_avg_sq)``
        (``start``/``end`` in the parameter's flattened coordinates), so the union of every
        rank's list can be loaded under another layout of the same TP partitions.
        """
        shards = []
        for name, pr, *views in self._owned_param_pieces():
            shards.append(
                dict(name=name, start=pr.start, end=pr.end, **{k: v.clone() for k, v in zip(STATE_KEYS, views)})
            )
        return dict(self.counters(), shards=shards)

    def counters(self) -> dict:
        """The step counters and loss-scaler state of ``state_dict()`` without its ``shards``."""
        return dict(
            step_count=self.step_count,
            skipped_steps=self.skipped_steps,
            consecutive_min_skips=self.consecutive_min_skips,
            loss_scaler=None if self.loss_scaler is None else self.loss_scaler.state_dict(),
        )

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load ``state_dict()`` output (one rank's, or several ranks' ``shards`` joined).

        Copies every saved run that overlaps an owned one, then writes the main params into
        the model params (an all-gather at stages 1/2). Raises ValueError naming a parameter
        whose owned elements are not all covered.
        """
        self.wait_param_gather()  # an all-gather landing after the copies would undo them
        by_name: dict[str, list] = {}
        for entry in state["shards"]:
            by_name.setdefault(entry["name"], []).append(entry)
        for name, pr, *views in self._owned_param_pieces():
            covered = 0
            for entry in by_name.get(name, []):
                part = pr.intersect(Range(entry["start"], entry["end"]))
                if part is None:
                    continue
                src, dst = part.start - entry["start"], part.start - pr.start
                for key, view in zip(STATE_KEYS, views):
                    view[dst : dst + part.size].copy_(entry[key][src : src + part.size])
                covered += part.size
            if covered != pr.size:
                raise ValueError(
                    f"optimizer state lacks elements [{pr.start}, {pr.end}) of "
                    f"{name!r} (covered {covered}); pass every rank's shards"
                )
        self.load_counters(state)
        self.refresh_model_params()

    def load_counters(self, state: dict) -> None:
        """The step counters and loss-scaler state of a ``state_dict()`` (its ``shards`` are
        not read)."""
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_min_skips = int(state["consecutive_min_skips"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    @torch.no_grad()
    def refresh_model_params(self) -> None:
        """Write the main params into the model params after they were set in place (a
        checkpoint load); collective at stages 1/2 (the all-gather): every rank calls it."""
        self.wait_param_gather()
        self._update_model_params()
        self.wait_param_gather()
