"""Sharded-checkpoint sessions: ARGS of the layout test, checkpoint_session (save / load under
torch's profiler) and close_trainer."""

import math

import torch

from tests.support.layouts import BASE

BUCKET = 500  # --reduce-bucket-size (elements): chunks are at most one bucket


ARGS = [a if a != "10" else "8" for a in BASE] + ["--reduce-bucket-size", str(BUCKET)]


METADATA_OPS = ("gloo:gather", "gloo:scatter", "gloo:broadcast")  # DCP's plan exchange, gloo's side


PLAN_STEPS = (
    "reduce_scatter",
    "all_reduce",
    "all_gather",
    "broadcast_object",
    "gather_object",
    "scatter_object",
    "all_gather_object",
    "broadcast",
)  # DCP's _DistWrapper collectives


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
    for _, size, ptr, data, meta in sorted(
        walk(prof.profiler.kineto_results.experimental_event_tree(), False, False), key=lambda a: a[0]
    ):
        if size > 0:
            kind[ptr] = (data, meta)
        data, meta = kind.pop(ptr, (data, meta)) if size < 0 else (data, meta)
        for i, counted in enumerate((not meta, data and not meta, meta)):
            if counted:
                totals[i] += size
                peaks[i] = max(peaks[i], totals[i])
    return tuple(peaks)


def allocation_peak(fn) -> int:
    """Peak bytes of the CPU tensors allocated while ``fn()`` runs and still live at that
    moment (torch's profiler allocation events, every tensor counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _alloc_peaks(prof)[0]


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


def checkpoint_session(rank, world, argv, save=None, save_after=None, loads=(), steps=3, measure=None):
    """One launch: build the trainer of ``argv``; for each root in ``loads`` resume from it and
    train ``steps`` steps; without ``loads`` train ``save_after`` steps, save to ``save`` and
    train ``steps`` more. Returns losses per phase, the measured allocation peaks (the save and
    the loads under torch's profiler; only the first ``measure`` loads if given, the others None) and
    this rank's owned state bytes (3 fp32 tensors of its owned elements)."""
    from torch.distributed.checkpoint import FileSystemReader as dcp_reader

    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    cfg = config_from_argv(argv, world)
    trainer = build_trainer(cfg, data=training.prepare_run(cfg))

    def run(n):
        out = []
        for _ in range(n):
            batches = trainer.next_batches()
            out.append(trainer.train_step(batches).values["loss"])
        return out

    own = 12 * sum(pr.size for _, _, pr, *_ in trainer.optimizer.owned_state())
    bucket = 4 * max(b.range.size for buf in trainer.optimizer.ddp.buffers for b in buf.layout.buckets)
    rng = sum(
        t.numel() * t.element_size() for t in trainer.chunks[0].rng_tracker.get_state().values() if torch.is_tensor(t)
    )
    out = dict(
        own=own, bucket=bucket, step=trainer.optimizer.bucket_bound_bytes(), rng=rng, losses=[], peaks=[], in_flight=[]
    )
    gather = trainer.optimizer.param_gather  # the overlapped all-gathers (ZeRO-1/2), or None
    read = dcp_reader.read_data

    def read_data(*a, **k):  # the all-gathers still in flight when DCP writes the loaded tensors
        out["in_flight"].append(0 if gather is None else gather.pending())
        return read(*a, **k)

    dcp_reader.read_data = read_data
    try:
        if not loads:
            out["losses"].append(run(save_after))
            out["peaks"].append(_measured(lambda: trainer.save_checkpoint(save)))
        for i, root in enumerate(loads):
            profiled = measure is None or i < measure
            out["peaks"].append(
                _measured(lambda: trainer.load_checkpoint(root)) if profiled else trainer.load_checkpoint(root)
            )
            out["losses"].append(run(steps))
        if not loads:
            out["losses"].append(run(steps))
    finally:  # the next session of these ranks wraps the original
        dcp_reader.read_data = read
    return out


def close_trainer(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-5), (got, want)
