"""GradBuffer's range look-ups (bisect over the bucket and parameter ends) return exactly
what a scan of every bucket / parameter returns, for ranges anywhere in the buffer."""

import random

import torch

from megazero.data_parallel.grad_buffer import GradBuffer, Range


def _scan_local_to_world(layout, local, rank):
    out = []
    for b in layout.buckets:
        part = b.shard_local.intersect(local)
        if part is not None:
            out.append((part.shift(layout.shard_world_range(b, rank).start - b.shard_local.start), part))
    return out


def _scan_param_pieces(layout, world):
    out = []
    for p in layout.params:
        r = layout.param_range[id(p)]
        part = r.intersect(world)
        if part is not None:
            out.append((p, part.shift(-r.start), part))
    return out


def test_lookups_equal_a_full_scan():
    rng = random.Random(0)
    shapes = [(7, 5), (0,), (3,), (64,), (11, 13), (1,), (40, 2), (0, 4), (9,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for bucket, dp in [(1, 1), (16, 2), (37, 4), (1000, 3)]:
        for rank in range(dp):
            layout = GradBuffer(params, bucket, dp, rank)
            for _ in range(200):
                a = rng.randrange(0, layout.shard_numel + 1)
                local = Range(a, rng.randrange(a, layout.shard_numel + 1))
                assert layout.local_to_world(local, rank) == _scan_local_to_world(layout, local, rank)
                a = rng.randrange(0, layout.padded_numel + 1)
                world = Range(a, rng.randrange(a, layout.padded_numel + 1))
                got, want = layout.param_pieces(world), _scan_param_pieces(layout, world)
                assert [(id(p), r, w) for p, r, w in got] == [(id(p), r, w) for p, r, w in want]
