"""Muon on the hidden matrices, ZeRO AdamW on the rest, over the same sharded flat buffers.

Muon (K. Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024; Liu et al.,
"Muon is Scalable for LLM Training", arXiv 2502.16982) replaces a 2-D hidden weight's Adam
update by the orthogonalised momentum. Per matrix W (A x B), with gradient G, momentum mu
and the update of ``torch.optim.Muon`` (torch 2.13, ``torch/optim/_muon.py``), matched
operation for operation:

    B  <- B + (1 - mu) (G - B)                    (``lerp``: an EMA of the gradient)
    U  <- G + mu (B - G) if nesterov else B
    O  <- NewtonSchulz5(U)                        (bf16; quintic a, b, c = 3.4445, -4.7750, 2.0315)
    W  <- W (1 - lr wd) - lr s(A, B) O            (s = sqrt(max(1, A / B)), or 0.2 sqrt(max(A, B)))

Newton-Schulz needs the WHOLE logical matrix; megazero holds pieces of it. The scheme
(simplest correct one, every rank computing the same whole result):

1. each rank forms U on its owned elements (its ZeRO shard of the flat buffer; the whole
   buffer at stage 0), elementwise, as AdamW would, and keeps B there (the ``exp_avg`` slot,
   so checkpoints and resharding treat it as Adam's first moment);
2. U of every hidden matrix of a buffer is written into one zeroed pack (TP-local shapes) and
   SUM all-reduced over the buffer's data-parallel group when its optimizer state is sharded:
   the shards are disjoint, so the sum adds only zeros and is exact, even for a matrix that a
   shard boundary cuts;
3. the packs are all-gathered over the tensor-parallel group and each TP-partitioned matrix
   is put back together along its partition dim (with its stride: a fused QKV weight is
   rebuilt in the one-process order, ``tags.partition_tensor``'s inverse);
4. Newton-Schulz on the whole matrix, the same on every rank; each rank takes its TP
   partition and applies the update to its owned elements of the fp32 main params.

The cost is one all-reduce of the hidden matrices over DP (stages 1-3) and one all-gather over
TP per buffer and step, plus the redundant Newton-Schulz on every rank (Moonshot's
distributed Muon instead gathers per matrix on one owner; this is its simple form).
"""

from __future__ import annotations

import math
from bisect import bisect_right

import torch

from megazero import collectives as C
from megazero import tags
from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.grad_buffer import Range
from megazero.optim.zero import DistributedOptimizer
from megazero.process_groups import ProcessGroups

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Jordan's) quintic
NS_EPS = 1e-7
ADJUST_LR = ("original", "match_rms_adamw")


def newton_schulz(
    x: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS, dtype=torch.bfloat16
) -> torch.Tensor:
    """Approximate orthogonalisation U S' V^T of ``x`` ``[A, B]`` (SVD U S V^T, S' near 1):
    ``steps`` quintic Newton-Schulz iterations X <- a X + (b X X^T + c (X X^T)^2) X in ``dtype``
    after scaling by the Frobenius norm (clamped at ``eps``), on the wide orientation (the
    transpose when A > B), as torch.optim.Muon computes it (in bf16). Returns ``[A, B]`` in
    ``dtype``. Raises ValueError when ``x`` is not 2-D."""
    if x.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(x.shape)}")
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    y = x.to(dtype)
    y = y.T if tall else y
    y = y / y.norm().clamp(min=eps)
    for _ in range(steps):
        gram = y @ y.T  # [min(A, B), min(A, B)]
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.addmm(y, poly, y, beta=a)
    return y.T if tall else y


def lr_scale(shape: tuple[int, int], mode: str) -> float:
    """Muon's learning-rate factor for an ``A x B`` matrix: ``original`` sqrt(max(1, A / B))
    (Jordan) or ``match_rms_adamw`` 0.2 sqrt(max(A, B)) (Moonshot, sec. 2.2: the update's RMS
    matches AdamW's). Raises ValueError for another ``mode``."""
    a, b = shape
    if mode == "original":
        return math.sqrt(max(1.0, a / b))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"muon adjust_lr must be one of {ADJUST_LR}, got {mode!r}")


def join_partitions(pieces: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor from its TP partitions in rank order (inverse of
    ``tags.partition_tensor``): with ``stride`` s each piece is s blocks along ``dim``, and
    block j of the full tensor is block j of every piece in turn. Shapes: ``size`` pieces
    ``[..., D/size, ...]`` -> ``[..., D, ...]``."""
    blocks = [p.chunk(stride, dim) for p in pieces]
    return torch.cat([blk[j] for j in range(stride) for blk in blocks], dim)


class AdamOnlyMoments:
    """Adam's second moment over the optimizer's local coordinates, stored only outside the
    ``skipped`` runs (the hidden matrices, which keep one moment): ``moments[s:e]`` is a view
    of the compact fp32 storage for a run outside them, a fresh zero tensor for a run inside
    one (what a checkpoint saves for it; writing it changes nothing). ``numel`` counts the
    whole local coordinates; the storage holds ``numel - sum(skipped sizes)`` elements.
    Raises ValueError for a slice that straddles a skipped run."""

    def __init__(self, numel: int, skipped: list[Range], device):
        self.skipped = sorted(skipped, key=lambda r: r.start)
        self.starts = [r.start for r in self.skipped]
        self.before = [0]
        for r in self.skipped:
            self.before.append(self.before[-1] + r.size)
        self.storage = torch.zeros(numel - self.before[-1], dtype=torch.float32, device=device)

    def __getitem__(self, key: slice) -> torch.Tensor:
        s, e = key.start, key.stop
        i = bisect_right(self.starts, s) - 1
        if i >= 0 and s < self.skipped[i].end:
            if e > self.skipped[i].end:
                raise ValueError(f"moment slice [{s}, {e}) straddles a Muon run {self.skipped[i]}")
            return torch.zeros(e - s, dtype=torch.float32, device=self.storage.device)
        if i + 1 < len(self.starts) and self.starts[i + 1] < e:
            raise ValueError(f"moment slice [{s}, {e}) straddles a Muon run {self.skipped[i + 1]}")
        shift = self.before[i + 1]
        return self.storage[s - shift : e - shift]

    def numel(self) -> int:
        return self.storage.numel()

    def element_size(self) -> int:
        return self.storage.element_size()


class MuonOptimizer(DistributedOptimizer):
    """:class:`DistributedOptimizer` whose AdamW skips the hidden matrices
    (``tags.is_hidden_matrix``), which Muon updates instead (module docstring, phases 1-4).

    The step is the parent's (gradient sync, overflow check, norm and clipping, parameter
    all-gather); between the clipping and AdamW, Muon takes each hidden matrix's owned
    gradient, unscaled and clipped as AdamW's would be. Args: those of the parent plus
    ``momentum`` (mu), ``nesterov``, ``ns_steps``, ``adjust_lr`` (``lr_scale``'s mode) and
    ``ns_dtype`` (``newton_schulz``'s dtype; bf16 as torch.optim.Muon) and ``qk_clip``: None, or
    QK-Clip's step (model/qk_clip.py ``QKClip``: ``factors()`` -> ``[(param, row factors
    [rows])]``, ``reset()``), whose factors scale the rows of the owned fp32 main elements after
    Muon and AdamW, before the parameters reach the model (``reset`` after every step).
    Raises ValueError for ``momentum`` outside [0, 1) or an unknown ``adjust_lr``.
    """

    def __init__(
        self,
        ddp: DataParallel,
        groups: ProcessGroups,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr: str = "original",
        ns_dtype: torch.dtype = torch.bfloat16,
        qk_clip=None,
        **kw,
    ):
        if not 0 <= momentum < 1 or adjust_lr not in ADJUST_LR:
            raise ValueError(f"muon momentum {momentum} must be in [0, 1) and adjust_lr one of {ADJUST_LR}")
        self.momentum, self.nesterov, self.ns_steps, self.adjust_lr = momentum, nesterov, ns_steps, adjust_lr
        self.ns_dtype, self.qk_clip = ns_dtype, qk_clip
        super().__init__(ddp, groups, **kw)
        self.packs = [self._pack_plan(buf) for buf in ddp.buffers]

    def _uses_adam(self, p: torch.Tensor) -> bool:
        return not tags.is_hidden_matrix(p)

    def _allocate_state(self, main_numel: int, numel: int) -> tuple:
        """The parent's state with ``exp_avg_sq`` only where AdamW runs (:class:`AdamOnlyMoments`):
        Muon keeps one moment, its momentum in ``exp_avg``."""
        skipped = []
        for i, buf in enumerate(self.ddp.buffers):
            for own in buf.owned():
                for p, pr, wr in buf.layout.param_pieces(own.world):
                    if tags.is_hidden_matrix(p):
                        start = self.offsets[i] + own.local.start + wr.start - own.world.start
                        skipped.append(Range(start, start + pr.size))
        main = torch.zeros(main_numel, dtype=torch.float32, device=self.device)
        exp_avg = torch.zeros(numel, dtype=torch.float32, device=self.device)
        return main, exp_avg, AdamOnlyMoments(numel, skipped, self.device)

    def formula(self) -> dict:
        """The parent's ZeRO formula less 4 bytes for each hidden-matrix element this rank owns
        (M: one fp32 moment instead of two; about H / N of the H hidden-matrix elements, as many
        as the shard boundaries leave here; the ranks of a shard group together own all H)."""
        out = super().formula()
        hidden = self.exp_avg_sq.before[-1]
        out["total"] -= 4 * hidden
        out["note"] += f", Muon: {hidden} owned hidden-matrix elements with one fp32 moment (4 bytes less)"
        return out

    def _pack_plan(self, buf) -> tuple[dict, list]:
        """``(offset of each hidden matrix in the buffer's pack, owned runs)``: each run is
        ``(param, param Range, gradient view, momentum view, main view)``."""
        offsets, total = {}, 0
        for p in buf.layout.params:
            if tags.is_hidden_matrix(p):
                offsets[id(p)] = (p, total)
                total += p.numel()
        runs = []
        for pc in self.pieces:
            if pc.buffer is not buf:
                continue
            for p, pr, wr in buf.layout.param_pieces(pc.world):
                if id(p) in offsets:
                    rel, s = wr.start - pc.world.start, pc.offset + wr.start - pc.world.start
                    grad, main = pc.grad[rel : rel + pr.size], pc.main[rel : rel + pr.size]
                    runs.append((p, pr, grad, self.exp_avg[s : s + pr.size], main))
        return (offsets, total), runs

    def _update(self, scale: float, coef: float, lr: float) -> None:
        """Muon on the hidden matrices from the gradients as reduced (before the AdamW
        windows unscale and clip theirs in place), then the parent's AdamW on the rest."""
        for buf, plan in zip(self.ddp.buffers, self.packs):
            if plan[0][1]:
                self._muon_buffer(buf, plan, scale, coef, lr)
        super()._update(scale, coef, lr)
        if self.qk_clip is not None:
            self._clip_qk(self.qk_clip.factors())

    def step(self, lr=None, loss_tokens=None):
        """The parent's step, then QK-Clip's maxima cleared (also after a skipped step)."""
        try:
            return super().step(lr, loss_tokens)
        finally:
            if self.qk_clip is not None:
                self.qk_clip.reset()

    @torch.no_grad()
    def _clip_qk(self, factors: list) -> None:
        """Scale each owned run of the fp32 main params of ``factors``' parameters row by row:
        ``(param, rows [R])`` with the param's ``numel / R`` elements a row (1 for a bias)."""
        by_id = {id(p): rows for p, rows in factors}
        for pc in self.pieces:
            for p, pr, wr in pc.buffer.layout.param_pieces(pc.world):
                rows = by_id.get(id(p))
                if rows is None:
                    continue
                rel, width = wr.start - pc.world.start, p.numel() // rows.numel()
                row = torch.arange(pr.start, pr.end, device=rows.device) // width  # (run,)
                pc.main[rel : rel + pr.size].mul_(rows[row].to(pc.main.device))

    def _muon_buffer(self, buf, plan, scale: float, coef: float, lr: float) -> None:
        (offsets, total), runs = plan
        pack = torch.zeros(total, dtype=torch.float32, device=self.device)
        mu = self.momentum
        for p, pr, grad, mom, _ in runs:  # 1: momentum and U on the owned elements
            g = grad.float().clone()
            if scale != 1.0:
                g.mul_(1.0 / scale)
            if coef < 1.0:
                g.mul_(coef)
            mom.lerp_(g, 1 - mu)
            off = offsets[id(p)][1]
            pack[off + pr.start : off + pr.end].copy_(g.lerp(mom, mu) if self.nesterov else mom)
        if buf.strategy.shards_optimizer:  # 2: the whole TP-local matrices on every rank
            C.all_reduce_sum(pack, buf.group)
        packs = C.all_gather_list(pack, self.groups.tp)  # 3
        updates = {}
        for key, (p, off) in offsets.items():
            local = [q[off : off + p.numel()].view(p.shape) for q in packs]
            full, rank, size = local[self.groups.tp_rank], 0, 1
            if tags.is_partitioned(p):
                rank, size = tags.partition_coords(p, self.groups.tp_rank, self.groups.tp_size)
                full = join_partitions(local[:size], p.partition_dim, p.partition_stride)
            ortho = newton_schulz(full, self.ns_steps, dtype=self.ns_dtype)  # 4
            if size > 1:
                ortho = tags.partition_tensor(ortho, p.partition_dim, rank, size, p.partition_stride)
            updates[key] = (ortho.reshape(-1).float(), lr * lr_scale(tuple(full.shape), self.adjust_lr))
        for p, pr, _, _, main in runs:
            flat, step = updates[id(p)]
            main.mul_(1 - lr * (self.weight_decay if tags.decays(p) else 0.0))
            main.add_(flat[pr.start : pr.end], alpha=-step)
