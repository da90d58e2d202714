"""Sharded checkpoints: each rank writes only its owned shards with global
offsets and reads back only the overlapping pieces, under any other (tp, pp, dp, ZeRO stage,
offload); the bytes a rank allocates while saving or loading are counted (torch's profiler
records every tensor allocation) and bounded by one bucket."""

import math

import pytest
import torch

from tests.support.checkpoint_shards import ARGS, checkpoint_session, close_trainer
from tests.support.distributed import run_distributed

MB4 = ["--micro-batch-size", "4"]
"""Micro-batches of 4 rows: 2 per step at dp 2 (the ZeRO-2 overlap and pp 2's 1F1B still have
two), 1 at dp 4; a step's CPU time on gloo ranks is its collectives' latency, one set per
micro-batch. The global batch (16) and so the losses are unchanged."""


def test_owned_boxes_rebuild_every_tp_partition():
    """The boxes of every flat range of every TP partition (strides 1 and 3, dims 0 and 1)
    placed at their global offsets rebuild exactly the elements ``tags.partition_tensor`` gave
    that rank, each once."""
    from megazero import tags
    from megazero.checkpoint.shards import flat_boxes, to_global

    full = torch.arange(12 * 18).view(12, 18)
    for dim, stride, tp in ((0, 1, 2), (0, 3, 2), (1, 3, 3), (1, 1, 1)):
        for rank in range(tp):
            local = tags.partition_tensor(full, dim, rank, tp, stride)
            p = tags.set_partitioned(torch.empty(local.shape), dim, stride)
            n = local.numel()
            for start, end in ((0, n), (5, n - 7), (3, 4), (local.shape[1], 3 * local.shape[1] + 1)):
                seen = torch.full((n,), -1, dtype=torch.long)
                pos = start
                for offsets, sizes in flat_boxes(tuple(local.shape), start, end):
                    box = local.reshape(-1)[pos : pos + math.prod(sizes)].view(sizes)
                    for g, size, lo, length in to_global(p, offsets, sizes, rank, tp):
                        want = full[tuple(slice(o, o + s) for o, s in zip(g, size))]
                        assert torch.equal(box.narrow(dim, lo, length), want), (dim, stride, rank, g)
                    seen[pos : pos + box.numel()] = box.reshape(-1)
                    pos += math.prod(sizes)
                assert pos == end and torch.equal(seen[start:end], local.reshape(-1)[start:end])


def _sessions(rank, world, root, extra, layouts):
    """``checkpoint_session`` (``ARGS + extra``, resumed from ``root``) for each {name: (layout flags,
    loads)} of ``layouts`` in turn, in one set of ranks (one spawn, not one per layout); only
    the first load of each is profiled (the ones checked). {name: this rank's result}."""
    return {
        name: checkpoint_session(rank, world, ARGS + extra + layout + ["--load", root], loads=loads, measure=1)
        for name, (layout, loads) in layouts.items()
    }


def test_save_and_load_hold_at_most_one_bucket_beyond_the_own_shards(tmp_path):
    """dp 2 ZeRO-2, buckets of 500 elements: DCP's tensor reads and writes allocate at most
    one fp32 bucket beyond the rank's own state (the chunks handed to DCP are views of it),
    the whole save/load, apart from DCP's plan exchange, at most one bucket and the RNG
    states; the same-layout resume is bit-identical, also the second load of the session, made
    two steps later while the overlapped parameter all-gathers of its last step were in flight
    (none is left in flight when DCP writes the loaded tensors)."""
    argv = ARGS + MB4 + ["--dp", "2", "--zero-stage", "2"]  # 2 micro-batches per step
    saved = run_distributed(checkpoint_session, 2, argv, save=str(tmp_path), save_after=2, steps=2)
    loaded = run_distributed(
        checkpoint_session, 2, argv + ["--load", str(tmp_path)], loads=[str(tmp_path)] * 2, steps=2
    )
    assert loaded[0]["losses"] == [saved[0]["losses"][1]] * 2  # bit for bit, both loads
    assert all(out["in_flight"] == [0, 0] for out in loaded), [out["in_flight"] for out in loaded]
    for out in saved + loaded:
        _check_peaks(out, out["peaks"], out["bucket"])


Z3_ARGS = MB4 + ["--reduce-bucket-size", "2000"]
"""The layout test's extra flags: 2 micro-batches per step at dp 2, and buckets of 2,000
elements, a third of the saving ranks' own state at most (their chunks: a DCP save or load
costs some 10 ms of CPU per chunk, and at 500 elements the test was mostly that)."""


def _check_peaks(out: dict, peaks: list, saved_bucket: int, name: str = "") -> None:
    """DCP's reads and writes allocate at most one fp32 bucket (of the saving or the loading
    layout); the whole save/load at most that, the optimizer step's temporaries (the
    all-gather after a load) and the RNG states beside the tensors."""
    print(
        name,
        "own",
        out["own"],
        "bucket",
        out["bucket"],
        "step",
        out["step"],
        "rng",
        out["rng"],
        "peaks (all but plans, DCP data, plans):",
        peaks,
    )
    for peak, data_peak, _ in peaks:
        assert data_peak <= max(out["bucket"], saved_bucket) < out["own"], (name, out)
        assert peak <= max(out["bucket"], saved_bucket, out["step"]) + 2 * out["rng"], (name, out)


@pytest.mark.slow
def test_save_under_tp2_pp2_dp2_zero3_loads_under_other_layouts(tmp_path):
    """Saved under (tp, pp, dp) = (2, 2, 2) ZeRO-3 with tied embeddings after 3 steps; loaded
    under (1, 1, 4) ZeRO-1 (also its consolidated full-tensor copy, the older format),
    (4, 1, 1) ZeRO-0 and (1, 2, 2) ZeRO-2 with --offload-optimizer cpu: the next 3 steps equal
    the uninterrupted (2, 2, 2) run within 1e-5; every DCP read/write holds at most one bucket
    (the saving or the loading layout's) beyond the own shards."""
    from megazero.checkpoint import consolidate_checkpoint

    root, full = str(tmp_path / "sharded"), str(tmp_path / "full")
    z3 = ARGS + Z3_ARGS + ["--tp", "2", "--pp", "2", "--dp", "2", "--zero-stage", "3"]
    saved = run_distributed(checkpoint_session, 8, z3, save=root, save_after=3, timeout_s=600)
    whole = saved[0]["losses"][1]
    consolidate_checkpoint(root, full)
    # micro-batches per step: 1 at dp 4, 2 at tp 4 (micro-batch 8), 2 at pp 2 x dp 2
    layouts = {
        "(1,1,4) ZeRO-1": (["--dp", "4", "--zero-stage", "1"], [root, full]),
        "(4,1,1) ZeRO-0": (["--micro-batch-size", "8", "--tp", "4", "--zero-stage", "0"], [root]),
        "(1,2,2) ZeRO-2 offload": (
            ["--pp", "2", "--dp", "2", "--zero-stage", "2", "--offload-optimizer", "cpu"],
            [root],
        ),
    }
    results = {"(2,2,2) ZeRO-3 save": saved}
    per_rank = run_distributed(_sessions, 4, root, Z3_ARGS, layouts, timeout_s=600)  # the 3 layouts, one spawn
    for name in layouts:
        results[name] = [r[name] for r in per_rank]
        for losses in results[name][0]["losses"]:  # rank 0 reports the step's loss
            close_trainer(losses, whole)
    saved_bucket = max(out["bucket"] for out in saved)
    for name, outs in results.items():
        for out in outs:  # the sharded checkpoint's save and loads (not the full-tensor copy)
            _check_peaks(out, out["peaks"][:1], saved_bucket, name)
