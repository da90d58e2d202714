"""ZeRO-1/2 distributed AdamW: each DP rank updates only its shard of the flat buffers.

ZeRO (Rajbhandari et al., SC'20, sec. 5.1-5.2): the fp32 main params and both Adam moments
(12 bytes per element) are partitioned over the N data-parallel ranks (P_os); ZeRO-2 also
partitions the gradients (P_os+g, see ``data_parallel/ddp.py``). The shards are the
``GradBuffer`` shards of every bucket, in local coordinates (see ``grad_buffer.py``);
stage 0 (plain DP) owns every bucket whole on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megazero import collectives as C
from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.grad_buffer import Range
from megazero.ops.adam import adam_step
from megazero.optim.clip import clip_coefficient, global_grad_norm
from megazero.precision import LossScaleError, non_finite_flag
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel import tags


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step.

    ``skipped``: inf/NaN gradients on some rank, no update. ``grad_norm``: global norm of
    the unscaled gradient before clipping (NaN when skipped). ``loss_scale``: the scale the
    gradients of this step were computed with (1.0 without a loss scaler).
    """

    skipped: bool
    grad_norm: float
    loss_scale: float


@dataclass
class _Piece:
    """One owned bucket (or bucket shard): gradient view plus optimizer-local offsets."""

    storage: object
    world: Range                     # world range in the storage's buffer
    offset: int                      # optimizer-local start of this piece
    grad: torch.Tensor               # 1-D view of the reduced gradient
    adam: list                       # [(piece-relative Range, decays: bool)]
    counted: list                    # piece-relative Ranges that count in the norm


def _merge(segments: list[tuple[Range, bool]]) -> list[tuple[Range, bool]]:
    out: list[tuple[Range, bool]] = []
    for r, flag in segments:
        if out and out[-1][1] == flag and out[-1][0].end == r.start:
            out[-1] = (Range(out[-1][0].start, r.end), flag)
        else:
            out.append((r, flag))
    return out


def zero_formula_bytes(num_params: int, dp_size: int, stage: int, param_bytes: int,
                       grad_bytes: int) -> float:
    """Model-state bytes per rank predicted by the ZeRO paper (Rajbhandari et al. 2020, sec. 5).

    ``num_params`` (Psi) counts this rank's model-chunk parameters, ``dp_size`` is N; the fp32
    main params and the two Adam moments are 12 bytes per parameter:
    stage 0: ``(p + g + 12) Psi``; stage 1: ``(p + g) Psi + 12 Psi / N``; stage 2:
    ``p Psi + (g + 12) Psi / N``. With 2-byte params and grads this is the paper's 16 Psi,
    4 Psi + 12 Psi / N and 2 Psi + 14 Psi / N. Buckets in flight and the padding of each
    bucket to a multiple of N come on top (``DistributedOptimizer.model_state_bytes``).
    """
    if stage not in (0, 1, 2):
        raise ValueError(f"--zero-stage {stage}: the formula covers stages 0, 1 and 2")
    psi, n = num_params, dp_size
    grads = grad_bytes * psi / (n if stage == 2 else 1)
    return param_bytes * psi + grads + 12 * psi / (1 if stage == 0 else n)


class DistributedOptimizer:
    """AdamW over the shards of a :class:`DataParallel`'s buffers (ZeRO stage 0, 1 or 2).

    ``step(lr)`` runs, in order (N = DP size, Psi = elements of this rank's chunks):

    1. finish the gradient sync (``ddp.finish_grad_sync``): stage 0 all-reduce (2 Psi
       elements on the wire per step), stage 1 reduce-scatter (Psi per step), stage 2
       reduce-scatter (Psi per micro-batch, mostly already done during backward); then the
       tied-embedding all-reduce over the embedding group.
    2. overflow check on this rank's reduced gradients, then one MAX all-reduce of the flag
       over the whole world; on overflow every rank skips, the loss scaler is updated and
       the skip counted (``LossScaleError`` after ``max_consecutive_skips`` consecutive
       skips at the minimum scale).
    3. unscale by the loss scale used in backward, exactly once.
    4. global gradient norm (``clip.global_grad_norm``: one SUM all-reduce over the world,
       or the model-parallel group at stage 0), then clip by it when ``clip_grad > 0``.
    5. AdamW (``ops.adam.adam_step``) on the fp32 shard; weight decay only on elements of
       parameters with ``ndim >= 2`` (biases and norm weights are not decayed, as in
       Megatron-LM), done by calling the kernel per run of equal decay.
    6. copy the updated shard into the model params (model dtype); stages 1/2 all-gather it
       over DP in buckets of ``allgather_bucket_size`` elements (Psi per step). Stage 0
       owns everything and copies locally.

    Steps 3-5 run bucket by bucket, so their fp32 temporaries are one bucket (shard) big.

    Args: ``ddp``; ``groups``; AdamW ``lr`` (default for ``step``), ``beta1``, ``beta2``,
    ``eps``, ``weight_decay``; ``clip_grad`` (0 = off); ``loss_scaler`` (a
    ``precision.DynamicLossScaler``/``StaticLossScaler``, None for fp32/bf16);
    ``allgather_bucket_size`` (elements per all-gather); ``adam_backend``;
    ``max_consecutive_skips``. Raises ValueError for ``allgather_bucket_size < 1`` or
    ``max_consecutive_skips < 1``.
    """

    def __init__(self, ddp: DataParallel, groups: ProcessGroups, *, lr: float = 1e-3,
                 beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.0, clip_grad: float = 0.0, loss_scaler=None,
                 allgather_bucket_size: int = 500_000_000, adam_backend: str = "auto",
                 max_consecutive_skips: int = 50):
        if allgather_bucket_size < 1 or max_consecutive_skips < 1:
            raise ValueError(f"allgather_bucket_size ({allgather_bucket_size}) and "
                             f"max_consecutive_skips ({max_consecutive_skips}) must be >= 1")
        self.ddp, self.groups = ddp, groups
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.weight_decay, self.clip_grad, self.loss_scaler = weight_decay, clip_grad, loss_scaler
        self.allgather_bucket_size, self.adam_backend = allgather_bucket_size, adam_backend
        self.max_consecutive_skips = max_consecutive_skips
        self.step_count = self.skipped_steps = self.consecutive_min_skips = 0
        self.offsets, total = [], 0
        for st in ddp.storages:
            self.offsets.append(total)
            total += st.layout.owned_numel(ddp.stage)
        device = ddp.params[0].device
        self.main_param = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros_like(self.main_param)
        self.exp_avg_sq = torch.zeros_like(self.main_param)
        self.pieces = [p for i, st in enumerate(ddp.storages) for p in self._pieces(i, st)]
        self.peak_step_bytes = 0
        self._init_main_params()

    def _pieces(self, i: int, st) -> list[_Piece]:
        tp_rank, out = self.groups.tp_rank, []
        for world, local, grad in self.ddp.owned_grads(st):
            adam, counted = [], []
            for p, _, wr in st.layout.param_pieces(world):
                rel = wr.shift(-world.start)
                adam.append((rel, p.dim() >= 2))
                if tags.counts_in_norm(p, tp_rank):
                    counted.append((rel, True))
            out.append(_Piece(st, world, self.offsets[i] + local.start, grad, _merge(adam),
                              [r for r, _ in _merge(counted)]))
        return out

    @torch.no_grad()
    def _init_main_params(self) -> None:
        for pc in self.pieces:
            for p, pr, wr in pc.storage.layout.param_pieces(pc.world):
                s = pc.offset + wr.start - pc.world.start
                self.main_param[s:s + pr.size].copy_(p.detach().view(-1)[pr.start:pr.end])

    # -- public API ----------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` before backward (identity without a loss scaler)."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def zero_grad(self) -> None:
        """Start a step (``ddp.zero_grad``)."""
        self.ddp.zero_grad()

    @torch.no_grad()
    def step(self, lr: Optional[float] = None) -> StepResult:
        """One optimizer step (phases 1-6 of the class docstring); ``lr`` defaults to the
        constructor's. Raises LossScaleError (a RuntimeError) when stuck skipping."""
        lr = self.lr if lr is None else lr
        self.peak_step_bytes = 0
        self.ddp.finish_grad_sync()                                           # 1
        scale = 1.0 if self.loss_scaler is None else float(self.loss_scaler.scale)
        device = self.main_param.device
        flag = non_finite_flag([pc.grad for pc in self.pieces]).to(device)    # 2
        C.all_reduce_max(flag, self.groups.world)
        if flag.item() > 0:
            self._skip(scale)
            return StepResult(True, float("nan"), scale)
        if self.loss_scaler is not None:
            self.loss_scaler.update(False)
        self.consecutive_min_skips = 0
        counted = [pc.grad[r.start:r.end] for pc in self.pieces for r in pc.counted]
        norm = global_grad_norm(counted, self.groups, sharded_over_dp=self.ddp.stage > 0,
                                inv_scale=1.0 / scale, device=device)         # 4
        coef = clip_coefficient(norm, self.clip_grad)
        self.step_count += 1
        for pc in self.pieces:                                                # 3-5
            self._update_piece(pc, scale, coef, lr)
        self._update_model_params()                                           # 6
        return StepResult(False, norm, scale)

    def _skip(self, scale: float) -> None:
        self.skipped_steps += 1
        at_min = self.loss_scaler is None or scale <= self.loss_scaler.min_loss_scale
        self.consecutive_min_skips = self.consecutive_min_skips + 1 if at_min else 0
        if self.loss_scaler is not None:
            self.loss_scaler.update(True)
        if self.consecutive_min_skips >= self.max_consecutive_skips:
            where = ("without loss scaling" if self.loss_scaler is None
                     else f"at the minimum loss scale {scale:g}")
            fix = "lower --lr" + ("" if self.clip_grad else ", enable --clip-grad")
            fix += "" if self.loss_scaler is None else ", or use --bf16 instead of --fp16"
            raise LossScaleError(
                f"gradients were inf/NaN in {self.consecutive_min_skips} consecutive steps "
                f"{where} (--max-consecutive-skips {self.max_consecutive_skips}); the run "
                f"diverged: {fix}")

    def _update_piece(self, pc: _Piece, scale: float, coef: float, lr: float) -> None:
        g = pc.grad.to(torch.float32, copy=True)                              # (piece,)
        self.peak_step_bytes = max(self.peak_step_bytes, g.numel() * 4)
        if scale != 1.0:
            g.mul_(1.0 / scale)
        if coef < 1.0:
            g.mul_(coef)
        for r, decays in pc.adam:
            s, e = pc.offset + r.start, pc.offset + r.end
            adam_step(self.main_param[s:e], g[r.start:r.end], self.exp_avg[s:e],
                      self.exp_avg_sq[s:e], step=self.step_count, lr=lr, beta1=self.beta1,
                      beta2=self.beta2, eps=self.eps,
                      weight_decay=self.weight_decay if decays else 0.0,
                      backend=self.adam_backend)

    def _update_model_params(self) -> None:
        if self.ddp.stage == 0:
            for pc in self.pieces:
                self._copy_to_params(pc.storage, pc.world,
                                     self.main_param[pc.offset:pc.offset + pc.world.size])
            return
        dp, group = self.ddp.dp_size, self.groups.dp
        per_rank = max(1, self.allgather_bucket_size // dp)
        for st, base in zip(self.ddp.storages, self.offsets):
            dtype, n = st.layout.params[0].dtype, st.layout.shard_numel
            for a in range(0, n, per_rank):
                b = min(a + per_rank, n)
                shard = self.main_param[base + a:base + b].to(dtype)
                out = torch.empty((b - a) * dp, dtype=dtype, device=shard.device)
                self.peak_step_bytes = max(self.peak_step_bytes,
                                           (out.numel() + shard.numel()) * out.element_size())
                C.all_gather_into(out, shard, group)   # out: (dp, b - a) rank-major
                for rank in range(dp):
                    for world, local in st.layout.local_to_world(Range(a, b), rank):
                        src = rank * (b - a) + local.start - a
                        self._copy_to_params(st, world, out[src:src + world.size])

    @staticmethod
    def _copy_to_params(st, world: Range, values: torch.Tensor) -> None:
        """Write ``values`` (the world range ``world`` of ``st``) into the model params."""
        for p, pr, wr in st.layout.param_pieces(world):
            s = wr.start - world.start
            p.data.view(-1)[pr.start:pr.end].copy_(values[s:s + pr.size])

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state allocated on this rank.

        ``params`` model params; ``grads`` persistent gradient storage (full buffers at
        stages 0/1, a shard at stage 2); ``main_params``, ``exp_avg``, ``exp_avg_sq`` fp32
        shards (whole at stage 0); ``buckets`` the high-water mark of temporary bucket
        memory (ZeRO-2 staging during the last backward, or one piece of fp32 gradient /
        one all-gather bucket during the last step); ``total`` their sum.
        """
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        out = {"params": sum(size(p) for p in self.ddp.params),
               "grads": self.ddp.grad_bytes(),
               "main_params": size(self.main_param), "exp_avg": size(self.exp_avg),
               "exp_avg_sq": size(self.exp_avg_sq),
               "buckets": max(self.ddp.peak_staging_bytes, self.peak_step_bytes)}
        out["total"] = sum(out.values())
        return out

    # -- checkpoint state ----------------------------------------------------------------
    def _owned_param_pieces(self):
        """``(name, param, param Range, optimizer-local start)`` of every owned element run."""
        names = {id(p): n for chunk in self.ddp.chunks for n, p in chunk.named_parameters()}
        for pc in self.pieces:
            for p, pr, wr in pc.storage.layout.param_pieces(pc.world):
                yield names[id(p)], p, pr, pc.offset + wr.start - pc.world.start

    def state_dict(self) -> dict:
        """This rank's fp32 shard and moments, keyed by parameter name and param Range.

        ``shards`` is a list of ``dict(name, start, end, main_param, exp_avg, exp_avg_sq)``
        (``start``/``end`` in the parameter's flattened coordinates), so the union of every
        rank's list can be loaded under another layout of the same TP partitions.
        """
        shards = []
        for name, _, pr, s in self._owned_param_pieces():
            e = s + pr.size
            shards.append(dict(name=name, start=pr.start, end=pr.end,
                               main_param=self.main_param[s:e].clone(),
                               exp_avg=self.exp_avg[s:e].clone(),
                               exp_avg_sq=self.exp_avg_sq[s:e].clone()))
        return dict(step_count=self.step_count, skipped_steps=self.skipped_steps,
                    consecutive_min_skips=self.consecutive_min_skips, shards=shards,
                    loss_scaler=None if self.loss_scaler is None
                    else self.loss_scaler.state_dict())

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load ``state_dict()`` output (one rank's, or several ranks' ``shards`` joined).

        Copies every saved run that overlaps an owned one, then writes the main params into
        the model params (an all-gather at stages 1/2). Raises ValueError naming a parameter whose owned elements are not
        all covered.
        """
        by_name: dict[str, list] = {}
        for entry in state["shards"]:
            by_name.setdefault(entry["name"], []).append(entry)
        for name, _, pr, s in self._owned_param_pieces():
            covered = 0
            for entry in by_name.get(name, []):
                part = pr.intersect(Range(entry["start"], entry["end"]))
                if part is None:
                    continue
                src, dst = part.start - entry["start"], s + part.start - pr.start
                for key, buf in (("main_param", self.main_param), ("exp_avg", self.exp_avg),
                                 ("exp_avg_sq", self.exp_avg_sq)):
                    buf[dst:dst + part.size].copy_(entry[key][src:src + part.size])
                covered += part.size
            if covered != pr.size:
                raise ValueError(f"optimizer state lacks elements [{pr.start}, {pr.end}) of "
                                 f"{name!r} (covered {covered}); pass every rank's shards")
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_min_skips = int(state["consecutive_min_skips"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self._update_model_params()   # collective at stages 1/2: every rank loads
