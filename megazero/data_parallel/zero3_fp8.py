"""ZeRO-3 with FP8 all-gathers of the FP8 GEMMs' weights (Megatron-LM's ``--fp8-param-gather``,
torchao's ``enable_fsdp_float8_all_gather``; tensorwise current scaling only).

The weights that an FP8 GEMM quantises anyway (tagged ``tags.fp8_weight`` by the tensor-parallel
layers) form buffers of their own in each gather unit (``DataParallel``), so a buffer is all FP8
weights or none; the others are gathered in the working dtype as :class:`~megazero.data_parallel.
zero3.Stage3` does. An FP8 buffer's gather, in order:

1. amax: each rank takes the largest magnitude of each weight's pieces in its shard (0 for a weight
   with none there), MAX all-reduced over the buffer's shard group and then over tp (the weight's
   other tensor-parallel partitions; for a replicated weight the copies are equal and the MAX is a
   no-op): the amax of the whole logical weight, so the scale ``fp8_max / amax``
   (``ops.fp8.current_scale``) is the very one the GEMM computes from the gathered weight. A scale
   from the local shard's amax alone would differ per rank and from one process's (torchtitan
   #3109's bug, here on the ZeRO shard instead of the tp partition);
2. each rank quantises its shard, piece by piece with its weight's scale, to e4m3 and all-gathers
   the bytes: 1 byte per element instead of the working dtype's 2 or 4 (the scales are not sent:
   every rank holds them after step 1, 4 bytes per weight per all-reduce);
3. on completion each weight's ``tags.fp8_gathered`` becomes ``(q [N, K] e4m3, scale [1, 1])``,
   views of the gathered bytes and of the buffer's scales, which the FP8 GEMMs use as they are,
   forward and (``q^T``, same scale) backward; the parameter's ``.data`` stays the zero-stride
   placeholder (its working-dtype values are never gathered);
4. release: the byte buffer's storage is resized to 0, as Stage3's, so the views a GEMM saved for
   its backward hold no memory and see the same bytes again after the backward's re-gather (the
   shard does not change before the optimizer step).

The quantised weight is element for element the one ``ops.fp8.quantize`` makes of the gathered
working-dtype weight, so training is unchanged, only the wire carries fewer bytes
(tests/layouts/test_fp8.py). Shards on the host or NVMe (``offload_param``) are not supported.
"""

from __future__ import annotations

import torch

from megazero import collectives as C
from megazero import tags
from megazero.data_parallel.zero3 import Stage3
from megazero.ops.fp8 import current_scale

FP8 = torch.float8_e4m3fn
"""The forward operands' format (both ``--fp8-format`` choices): the gathered weights' bytes."""


def reduce_amax(amax: torch.Tensor, shard_group, tp_group) -> torch.Tensor:
    """MAX all-reduce of the per-weight ``amax [n]`` (fp32) over ``shard_group`` and then over
    ``tp_group``, in place: each weight's amax over all its ZeRO shards and tp partitions."""
    C.all_reduce_max(amax, shard_group)
    return C.all_reduce_max(amax, tp_group)


class Fp8GatherStage3(Stage3):
    """ZeRO-3 whose FP8-weight buffers are all-gathered as e4m3 bytes (module docstring).

    ``tp_group``: the tensor-parallel group the FP8 weights are partitioned over (amax reduced
    over it). A buffer is an FP8 buffer (``buf.fp8``) when every parameter in it is tagged
    ``fp8_weight``; others take Stage3's path. Raises ValueError for a buffer whose shard lives
    on the host or NVMe.
    """

    def __init__(self, tp_group=None):
        self.tp_group = tp_group

    def init_params(self, buf, values) -> None:
        layout = buf.layout
        buf.fp8 = all(tags.is_fp8_weight(p) for p in layout.params)
        if buf.fp8 and (self.offload_param or self.param_swap is not None):
            raise ValueError("--fp8-param-gather with --offload-param is not supported; fix: drop one of them")
        index = {id(p): i for i, p in enumerate(layout.params)}
        buf.fp8_pieces = []  # (weight index, local start, local end) of each piece of the shard
        for b in layout.buckets:
            for p, _, world in layout.param_pieces(b.shard_world):
                at = b.shard_local.start + world.start - b.shard_world.start
                buf.fp8_pieces.append((index[id(p)], at, at + world.size))
        buf.fp8_scales = torch.ones(len(layout.params), dtype=torch.float32, device=buf.device)
        super().init_params(buf, values)

    def gathered_nbytes(self, buf) -> int:
        return buf.layout.padded_numel if buf.fp8 else super().gathered_nbytes(buf)

    def start_gather(self, buf, group, async_op: bool) -> None:
        """Steps 1-2: the scales of the whole weights, then the all-gather of the e4m3 shard."""
        if not buf.fp8:
            return super().start_gather(buf, group, async_op)
        if buf.params_flat is not None or buf.pending_gather is not None:
            return
        layout, shard = buf.layout, buf.params_shard
        amax = torch.zeros(len(layout.params), dtype=torch.float32, device=shard.device)
        for i, a, e in buf.fp8_pieces:
            amax[i] = torch.maximum(amax[i], shard[a:e].abs().max().float())
        reduce_amax(amax, group, self.tp_group)
        buf.fp8_scales.copy_(current_scale(amax, FP8))
        fmax = torch.finfo(FP8).max
        packed = torch.zeros(layout.shard_numel, dtype=torch.uint8, device=shard.device)  # padding: +0
        q = packed.view(FP8)
        for i, a, e in buf.fp8_pieces:  # as ops.fp8.quantize: (x * scale).clamp(+-max) in fp32
            q[a:e] = (shard[a:e].float() * buf.fp8_scales[i]).clamp(-fmax, fmax).to(FP8)
        full = buf.full
        if full is None:
            full = buf.full = torch.empty(layout.padded_numel, dtype=torch.uint8, device=shard.device)
        else:
            full.untyped_storage().resize_(layout.padded_numel)
        works = []
        for b in layout.buckets:  # rank-major output == the bucket's world layout
            shard_bytes = packed[b.shard_local.start : b.shard_local.end]
            works.append(C.all_gather_into(full[b.range.start : b.range.end], shard_bytes, group, async_op))
        buf.pending_gather = (full, works, packed)  # packed: read by the collective until its wait

    def finish_gather(self, buf) -> None:
        """Step 3: wait, then hand each weight its ``(q, scale)`` views."""
        if not buf.fp8:
            return super().finish_gather(buf)
        if buf.pending_gather is None:
            return
        full, works, _ = buf.pending_gather
        for w in works:
            if w is not None:
                w.wait()
        buf.pending_gather, buf.params_flat = None, full
        q = full.view(FP8)
        for i, p in enumerate(buf.layout.params):
            r = buf.layout.param_range[id(p)]
            p.fp8_gathered = (q[r.start : r.end].view(p.shape), buf.fp8_scales[i : i + 1].view(1, 1))

    def release(self, buf) -> None:
        """Step 4 (Stage3's release), and the weights' ``fp8_gathered`` back to None."""
        super().release(buf)
        if getattr(buf, "fp8", False):
            for p in buf.layout.params:
                p.fp8_gathered = None
