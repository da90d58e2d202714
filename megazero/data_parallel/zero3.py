"""ZeRO-3 (P_os+g+p, Rajbhandari et al., SC'20, sec. 5.3): parameters sharded too.

Each DP rank keeps 1/N of every parameter buffer (``ShardedBuffer.params_shard``, local
coordinates, the same shards as the gradients and optimizer state) and gathers a model
chunk's parameters only while the chunk computes:

1. before the chunk's forward (a forward pre-hook), every bucket is all-gathered from the
   shards into a fresh ``params_flat`` and each parameter's ``.data`` becomes a view of it;
2. after the forward (a forward hook) the gathered buffer is dropped: ``.data`` becomes a
   zero-stride placeholder of the parameter's shape (reading it gives zeros);
3. before the chunk's backward (a full backward pre-hook) the parameters are gathered again;
   once every parameter of the buffer has its gradient in this micro-batch they are dropped;
4. gradients are reduce-scattered per micro-batch exactly as in ZeRO-2 (``Stage2``);
5. the optimizer updates the shard in place (an fp32 model's shard is its main params), so
   nothing is gathered after the step.

Granularity is the model chunk (megazero does not know the model's layers); persistent
memory is (p + g + m + 8) Psi / N per rank plus one gathered chunk while it computes.
Tensors saved by autograd as views of the gathered buffer keep it alive until their backward.
"""
from __future__ import annotations

import torch

from megazero import collectives as C
from megazero.data_parallel.sharding import Stage2


class Stage3(Stage2):
    """ZeRO-3: parameter shards, gathered per model chunk around forward and backward."""

    stage = 3
    gathers_on_demand = True

    def setup(self, buf) -> None:
        """Keep this rank's shard of the parameters and drop the full buffer."""
        layout = buf.layout
        buf.params_shard = torch.empty(layout.shard_numel, dtype=buf.params_flat.dtype,
                                       device=buf.params_flat.device)
        for b in layout.buckets:
            buf.params_shard[b.shard_local.start:b.shard_local.end].copy_(
                buf.params_flat[b.shard_world.start:b.shard_world.end])
        buf.placeholder = torch.zeros(1, dtype=buf.params_shard.dtype, device=buf.params_shard.device)
        self.release(buf)

    def owned_param_view(self, buf, own):
        return buf.params_shard[own.local.start:own.local.end]

    def gather(self, buf, group) -> None:
        """All-gather every bucket into a new ``params_flat``; point the params at it."""
        if buf.params_flat is not None:
            return
        layout = buf.layout
        full = torch.empty(layout.padded_numel, dtype=buf.params_shard.dtype,
                           device=buf.params_shard.device)
        for b in layout.buckets:   # rank-major output == the bucket's world layout
            C.all_gather_into(full[b.range.start:b.range.end],
                              buf.params_shard[b.shard_local.start:b.shard_local.end], group)
        buf.params_flat = full
        for p in layout.params:
            r = layout.param_range[id(p)]
            p.data = full[r.start:r.end].view_as(p)

    def release(self, buf) -> None:
        """Drop the gathered buffer; parameters keep their shapes (zero-stride zeros)."""
        for p in buf.layout.params:
            p.data = buf.placeholder.expand(p.shape)
        buf.params_flat = None

    def gather_params(self, buf, fill_shard, chunk_numel, group, dp_size):
        """After the update: a separate fp32 copy is cast into the shard; no collective."""
        if not buf.main_is_param:
            fill_shard(0, buf.layout.shard_numel, buf.params_shard)
        return 0

    def gather_bound_bytes(self, buf, chunk_numel, dp_size):
        return 0

    def formula_bytes(self, psi, n, param_bytes, grad_bytes, main_bytes):
        return (param_bytes + grad_bytes + main_bytes + 8) * psi / n
