"""ZeRO-3 (P_os+g+p, Rajbhandari et al., SC'20, sec. 5.3): parameters sharded too.

Each DP rank keeps 1/N of every parameter buffer (``ShardedBuffer.params_shard``, local
coordinates, the same shards as the gradients and optimizer state) and gathers a buffer's
parameters only while they compute. A buffer here is one *gather unit* of a model chunk
(a transformer layer, the embedding, the head, or the chunk's remaining parameters; the
schedule of gathers, prefetches and releases is :mod:`megazero.data_parallel.zero3_gather`):

1. ``start_gather`` issues the all-gather of every bucket into a fresh ``params_flat``
   (``async_op=True`` when prefetching); ``finish_gather`` waits for it and points each
   parameter's ``.data`` at its view of the gathered buffer;
2. ``release`` frees the gathered buffer's memory (its storage resized to 0 bytes; the
   next gather fills the same storage again, so tensors autograd saved as its views stay
   valid without keeping the memory): ``.data`` becomes a zero-stride placeholder of the
   parameter's shape (reading it gives zeros);
3. gradients are reduce-scattered per micro-batch exactly as in ZeRO-2 (``Stage2``);
4. the optimizer updates the shard in place (an fp32 model's shard is its main params), so
   nothing is gathered after the step.

With ``offload_param`` (ZeRO-Infinity's ``offload_param: {device: cpu}``, Rajbhandari et al.
2021) the shard lives in host memory between uses (one exactly-sized ``HostArena`` per
buffer, page-locked on CUDA as whole pages of its own) and is copied to the device bucket by
bucket just before its all-gather. With ``param_swap`` (``offload_param: {device: nvme}``) the shards live in a swap
file instead and are read into a bounded set of host slots for each gather and rebuilt from
the optimizer's main params after the step (:mod:`megazero.offload.param_swap`).
Persistent memory is (p + g + m + 8) Psi / N per rank (the p Psi / N part on the host with
offload) plus the gathered units while they compute.
"""

from __future__ import annotations

import torch

from megazero import collectives as C
from megazero.data_parallel.policy import ShardParameters
from megazero.data_parallel.sharding import Stage2
from megazero.offload.host_memory import HostArena, can_pin


class Stage3(ShardParameters, Stage2):
    """ZeRO-3: parameter shards, gathered per gather unit around forward and backward.

    ``offload_param`` (set before any buffer is built): keep ``params_shard`` in host memory;
    ``param_swap`` (a :class:`~megazero.offload.param_swap.ParamSwapper`, or None): keep
    it in the swap file (``buf.swapped``) beyond the swapper's ``max_in_cpu`` elements.
    """

    offload_param = False
    param_swap = None

    def init_params(self, buf, values) -> None:
        """Keep only this rank's shard of the parameters (host memory with offload: one exactly
        sized arena per buffer, pinned on CUDA): each parameter's value is asked for in turn
        (``values(p)``; not at all when no part of it lies in this rank's shard), its part in
        the shard copied in and the value dropped, so the full buffer never exists, nor, with
        an unmaterialized stage (``model.gpt.GPTStage(materialize=False)``), more than one
        parameter's partition. The parameters are then released (zero-stride placeholders)."""
        layout, device = buf.layout, buf.device
        buf.host_arena, buf.swapped = None, False
        if self.param_swap is not None:  # its own storage: resized to 0 bytes when swapped out
            buf.params_shard = torch.zeros(layout.shard_numel, dtype=buf.param_dtype, device="cpu")
        elif self.offload_param:  # zero-filled: the padding stays 0
            buf.host_arena = HostArena([layout.shard_numel], buf.param_dtype, pin=can_pin(device))
            buf.params_shard = buf.host_arena.parts[0]
        else:
            buf.params_shard = torch.zeros(layout.shard_numel, dtype=buf.param_dtype, device=device)
        for p in layout.params:
            r, flat = layout.param_range[id(p)], None
            for k in layout.param_buckets[id(p)]:
                b = layout.buckets[k]
                part = r.intersect(b.shard_world)  # world range of p in this rank's shard of b
                if part is None:
                    continue
                flat = values(p).reshape(-1) if flat is None else flat
                at = b.shard_local.start + part.start - b.shard_world.start
                buf.params_shard[at : at + part.size].copy_(flat[part.start - r.start : part.end - r.start])
        buf.placeholder = torch.zeros(1, dtype=buf.param_dtype, device=device)
        buf.pending_gather, buf.offloaded, buf.full = None, self.offload_param, None
        if self.param_swap is not None:
            self.param_swap.add(buf)  # written to the swap file unless kept within max_in_cpu
        self.release(buf)

    def owned_param_view(self, buf, own):
        return buf.params_shard[own.local.start : own.local.end]

    def start_gather(self, buf, group, async_op: bool) -> None:
        """Issue the all-gather of every bucket into a new buffer (kept in
        ``buf.pending_gather`` until :meth:`finish_gather`); no-op when gathered or pending."""
        if buf.params_flat is not None or buf.pending_gather is not None:
            return
        layout, device = buf.layout, buf.placeholder.device
        full = buf.full  # one storage per buffer: tensors autograd saved as its views see it
        if full is None:
            full = buf.full = torch.empty(layout.padded_numel, dtype=buf.params_shard.dtype, device=device)
        else:
            full.untyped_storage().resize_(layout.padded_numel * full.element_size())
        if buf.swapped:  # NVMe: a slot, read from the swap file; given back in finish_gather
            self.param_swap.acquire(buf, read=True, evict=self.finish_gather)
        works = []
        for b in layout.buckets:  # rank-major output == the bucket's world layout
            out = full[b.range.start : b.range.end]
            shard = buf.params_shard[b.shard_local.start : b.shard_local.end]
            if shard.device != device:  # offload_param: host -> device (one bucket's shard)
                shard = shard.to(device, non_blocking=True)
            works.append(C.all_gather_into(out, shard, group, async_op=async_op))
        buf.pending_gather = (full, works)

    def finish_gather(self, buf) -> None:
        """Wait for the pending all-gather and point the parameters at the gathered buffer."""
        if buf.pending_gather is None:
            return
        full, works = buf.pending_gather
        for w in works:
            if w is not None:
                w.wait()
        buf.pending_gather, buf.params_flat = None, full
        if buf.swapped:
            self.param_swap.drop(buf)  # the shard is unchanged until the step: nothing to write
        for p in buf.layout.params:
            r = buf.layout.param_range[id(p)]
            p.data = full[r.start : r.end].view_as(p)

    def gather(self, buf, group) -> None:
        """All-gather every bucket into a new ``params_flat`` now; point the params at it."""
        self.start_gather(buf, group, async_op=False)
        self.finish_gather(buf)

    def release(self, buf) -> None:
        """Free the gathered buffer's memory (its storage resized to 0 bytes, as FSDP does, so
        that views autograd saved, e.g. ``weight.t()``, hold no memory and see the values
        again once re-gathered); parameters keep their shapes (zero-stride zeros)."""
        self.finish_gather(buf)
        for p in buf.layout.params:
            p.data = buf.placeholder.expand(p.shape)
        if buf.full is not None:
            buf.full.untyped_storage().resize_(0)
        buf.params_flat = None

    def gather_params(self, buf, fill_shard, chunk_numel, group, dp_size):
        """After the update: a separate fp32 copy is cast into the shard; no collective. A
        swapped shard (NVMe) is rebuilt in a zero-filled slot from ``fill_shard``, written back
        and dropped. ``fill_shard`` None: the optimizer wrote the shard already (NVMe offload of
        the optimizer writes the owned runs while it walks its sub-groups)."""
        if fill_shard is None:
            return 0
        if buf.swapped:
            self.param_swap.acquire(buf, read=False, evict=self.finish_gather)
            fill_shard(0, buf.layout.shard_numel, buf.params_shard)
            self.param_swap.write_back(buf)
            self.param_swap.drop(buf)
            return 0
        if not buf.main_is_param:
            fill_shard(0, buf.layout.shard_numel, buf.params_shard)
        return 0

    def shard_on_host(self, buf):
        """Context in which ``buf.params_shard`` holds its values (NVMe: read into a slot)."""
        if self.param_swap is None:
            return super().shard_on_host(buf)
        return self.param_swap.reading(buf, evict=self.finish_gather)

    def gather_bound_bytes(self, buf, chunk_numel, dp_size):
        return 0

    def gathered_nbytes(self, buf) -> int:
        """Bytes of ``buf``'s parameters while gathered: its padded elements in the working dtype."""
        return buf.layout.padded_numel * buf.param_dtype.itemsize
