"""Sharded checkpoints (issue 10, point 4): each rank writes only its owned shards with global
offsets and reads back only the overlapping pieces, under any other (tp, pp, dp, ZeRO stage,
offload); the bytes a rank allocates while saving or loading are counted (torch's profiler
records every tensor allocation) and bounded by one bucket."""
import math

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_train import BASE

BUCKET = 500   # --reduce-bucket-size (elements): chunks are at most one bucket
ARGS = [a if a != "10" else "8" for a in BASE] + ["--reduce-bucket-size", str(BUCKET)]
MB4 = ["--micro-batch-size", "4"]
"""Micro-batches of 4 rows: 2 per step at dp 2 (the ZeRO-2 overlap and pp 2's 1F1B still have
two), 1 at dp 4; a step's CPU time on gloo ranks is its collectives' latency, one set per
micro-batch. The global batch (16) and so the losses are unchanged."""


def test_owned_boxes_rebuild_every_tp_partition():
    """The boxes of every flat range of every TP partition (strides 1 and 3, dims 0 and 1)
    placed at their global offsets rebuild exactly the elements ``tags.partition_tensor`` gave
    that rank, each once."""
    from megazero.checkpoint.shards import flat_boxes, to_global
    from megazero import tags

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
                    box = local.reshape(-1)[pos:pos + math.prod(sizes)].view(sizes)
                    for g, size, lo, length in to_global(p, offsets, sizes, rank, tp):
                        want = full[tuple(slice(o, o + s) for o, s in zip(g, size))]
                        assert torch.equal(box.narrow(dim, lo, length), want), (dim, stride, rank, g)
                    seen[pos:pos + box.numel()] = box.reshape(-1)
                    pos += math.prod(sizes)
                assert pos == end and torch.equal(seen[start:end], local.reshape(-1)[start:end])


METADATA_OPS = ("gloo:gather", "gloo:scatter", "gloo:broadcast")  # DCP's plan exchange, gloo's side
PLAN_STEPS = ("reduce_scatter", "all_reduce", "all_gather", "broadcast_object", "gather_object",
              "scatter_object", "all_gather_object", "broadcast")   # DCP's _DistWrapper collectives


def _alloc_peaks(prof) -> tuple[int, int, int]:
    """(peak bytes of tensors allocated and still live during the profiled block, the same
    counted only inside DCP's file reader/writer (the tensor data), the peak of DCP's plan
    exchange) from the profiler's allocation events (every CPU tensor allocation and free,
    in time order; a free is matched to its allocation by address). The plan exchange
    (pickled plans and metadata) grows with the number of chunks, not with their elements,
    and is counted apart. The innermost marked range decides."""
    from torch._C._profiler import _EventType

    def name(e):
        try:
            return e.name
        except UnicodeDecodeError:  # some events carry undecodable names
            return ""

    def walk(events, data, meta):
        for e in events:
            n = name(e)
            d, m = (True, False) if n == "dcp_data" else (data, meta or n == "dcp_plans" or n in METADATA_OPS)
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                yield e.start_time_ns, f.alloc_size, f.ptr, d, m
            yield from walk(e.children, d, m)
    kind, totals, peaks = {}, [0, 0, 0], [0, 0, 0]
    for _, size, ptr, data, meta in sorted(walk(prof.profiler.kineto_results.experimental_event_tree(),
                                               False, False), key=lambda a: a[0]):
        if size > 0:
            kind[ptr] = (data, meta)
        data, meta = kind.pop(ptr, (data, meta)) if size < 0 else (data, meta)
        for i, counted in enumerate((not meta, data and not meta, meta)):
            if counted:
                totals[i] += size
                peaks[i] = max(peaks[i], totals[i])
    return tuple(peaks)


def _measured(fn):
    """Run ``fn()`` under torch's profiler (CPU allocations) with DCP's tensor reads/writes
    and its plan collectives marked; returns ``_alloc_peaks``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.utils import _DistWrapper
    from torch.profiler import ProfilerActivity, profile, record_function

    marks = [(dcp.FileSystemWriter, "write_data", "dcp_data"), (dcp.FileSystemReader, "read_data", "dcp_data")]
    marks += [(_DistWrapper, m, "dcp_plans") for m in PLAN_STEPS if hasattr(_DistWrapper, m)]
    originals = []
    for cls, meth, label in marks:
        orig = getattr(cls, meth)
        originals.append((cls, meth, cls.__dict__.get(meth)))

        def marked(*a, _orig=orig, _label=label, **k):
            with record_function(_label):
                return _orig(*a, **k)
        setattr(cls, meth, marked)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        for cls, meth, own in originals:
            setattr(cls, meth, own) if own is not None else delattr(cls, meth)
    return _alloc_peaks(prof)


def _session(rank, world, argv, save=None, save_after=None, loads=(), steps=3, measure=None):
    """One launch: build the trainer of ``argv``; for each root in ``loads`` resume from it and
    train ``steps`` steps; without ``loads`` train ``save_after`` steps, save to ``save`` and
    train ``steps`` more. Returns losses per phase, the measured allocation peaks (the save and
    the loads under torch's profiler; only the first ``measure`` loads if given, the others None) and
    this rank's owned state bytes (3 fp32 tensors of its owned elements)."""
    import train
    from torch.distributed.checkpoint import FileSystemReader as dcp_reader
    from megazero.config import config_from_argv
    from megazero.process_groups import ProcessGroups
    from megazero.config import layout_topology

    cfg = config_from_argv(argv, world)
    run = train.prepare_run(cfg)
    train_ds, vocab = run.train, run.vocab_size
    groups = ProcessGroups.build(layout_topology(cfg))
    trainer = train.Trainer(cfg, groups, torch.device("cpu"), vocab)

    def run(n):
        out = []
        for _ in range(n):
            batches = train.dp_micro_batches(train_ds, trainer.state.consumed_samples, cfg, groups, "cpu")
            out.append(trainer.train_step(batches).values["loss"])
        return out
    own = 12 * sum(pr.size for _, _, pr, *_ in trainer.optimizer.owned_state())
    bucket = 4 * max(b.range.size for buf in trainer.optimizer.ddp.buffers for b in buf.layout.buckets)
    rng = sum(t.numel() * t.element_size() for t in trainer.chunks[0].rng_tracker.get_state().values()
              if torch.is_tensor(t))
    out = dict(own=own, bucket=bucket, step=trainer.optimizer.bucket_bound_bytes(), rng=rng, losses=[], peaks=[],
               in_flight=[])
    gather = trainer.optimizer.param_gather   # the overlapped all-gathers (ZeRO-1/2), or None
    read = dcp_reader.read_data

    def read_data(*a, **k):   # the all-gathers still in flight when DCP writes the loaded tensors
        out["in_flight"].append(0 if gather is None else gather.pending())
        return read(*a, **k)
    dcp_reader.read_data = read_data
    try:
        if not loads:
            out["losses"].append(run(save_after))
            out["peaks"].append(_measured(lambda: trainer.save_checkpoint(save)))
        for i, root in enumerate(loads):
            profiled = measure is None or i < measure
            out["peaks"].append(_measured(lambda: trainer.load_checkpoint(root)) if profiled
                                else trainer.load_checkpoint(root))
            out["losses"].append(run(steps))
        if not loads:
            out["losses"].append(run(steps))
    finally:   # the next session of these ranks wraps the original
        dcp_reader.read_data = read
    return out


def _sessions(rank, world, root, extra, layouts):
    """``_session`` (``ARGS + extra``, resumed from ``root``) for each {name: (layout flags,
    loads)} of ``layouts`` in turn, in one set of ranks (one spawn, not one per layout); only
    the first load of each is profiled (the ones checked). {name: this rank's result}."""
    return {name: _session(rank, world, ARGS + extra + layout + ["--load", root], loads=loads,
                           measure=1)
            for name, (layout, loads) in layouts.items()}


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-5), (got, want)


def test_save_and_load_hold_at_most_one_bucket_beyond_the_own_shards(tmp_path):
    """dp 2 ZeRO-2, buckets of 500 elements: DCP's tensor reads and writes allocate at most
    one fp32 bucket beyond the rank's own state (the chunks handed to DCP are views of it),
    the whole save/load, apart from DCP's plan exchange, at most one bucket and the RNG
    states; the same-layout resume is bit-identical, also the second load of the session, made
    two steps later while the overlapped parameter all-gathers of its last step were in flight
    (none is left in flight when DCP writes the loaded tensors)."""
    argv = ARGS + MB4 + ["--dp", "2", "--zero-stage", "2"]   # 2 micro-batches per step
    saved = run_distributed(_session, 2, argv, save=str(tmp_path), save_after=2, steps=2)
    loaded = run_distributed(_session, 2, argv + ["--load", str(tmp_path)], loads=[str(tmp_path)] * 2, steps=2)
    assert loaded[0]["losses"] == [saved[0]["losses"][1]] * 2   # bit for bit, both loads
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
    print(name, "own", out["own"], "bucket", out["bucket"], "step", out["step"], "rng", out["rng"],
          "peaks (all but plans, DCP data, plans):", peaks)
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
    from scripts.convert_checkpoint import consolidate

    root, full = str(tmp_path / "sharded"), str(tmp_path / "full")
    z3 = ARGS + Z3_ARGS + ["--tp", "2", "--pp", "2", "--dp", "2", "--zero-stage", "3"]
    saved = run_distributed(_session, 8, z3, save=root, save_after=3, timeout_s=600)
    whole = saved[0]["losses"][1]
    consolidate(root, full)
    # micro-batches per step: 1 at dp 4, 2 at tp 4 (micro-batch 8), 2 at pp 2 x dp 2
    layouts = {"(1,1,4) ZeRO-1": (["--dp", "4", "--zero-stage", "1"], [root, full]),
               "(4,1,1) ZeRO-0": (["--micro-batch-size", "8", "--tp", "4", "--zero-stage", "0"], [root]),
               "(1,2,2) ZeRO-2 offload": (["--pp", "2", "--dp", "2", "--zero-stage", "2",
                                           "--offload-optimizer", "cpu"], [root])}
    results = {"(2,2,2) ZeRO-3 save": saved}
    per_rank = run_distributed(_sessions, 4, root, Z3_ARGS, layouts, timeout_s=600)   # the 3 layouts, one spawn
    for name in layouts:
        results[name] = [r[name] for r in per_rank]
        for losses in results[name][0]["losses"]:   # rank 0 reports the step's loss
            _close(losses, whole)
    saved_bucket = max(out["bucket"] for out in saved)
    for name, outs in results.items():
        for out in outs:   # the sharded checkpoint's save and loads (not the full-tensor copy)
            _check_peaks(out, out["peaks"][:1], saved_bucket, name)
