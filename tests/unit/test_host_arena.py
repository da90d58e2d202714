"""Pinned host memory of offload as one exactly-sized arena per offloaded buffer.

CUDA's caching host allocator rounds every ``pin_memory=True`` tensor up to a power of two;
``megazero.offload.host_memory.HostArena`` allocates exactly the bytes and page-locks
them in place once. On this CPU-only machine nothing can be pinned, so a recording registrar
stands in for ``cudaHostRegister``: the arena logic, the byte counts and what the model-state
table reports are the same code as on CUDA.
"""

import gc
import io
import sys

import pytest
import torch

from megazero.offload.host_memory import CudaRegistrar, HostArena, can_pin, page_bytes, page_range
from megazero.optim.offload import HOST_BYTES_PER_ELEMENT, HostOffloadOptimizer
from megazero.process_groups import ProcessGroups
from tests.support.zero import ADAM, build, make_batches, tiny_cfg, train


class Recorder:
    """Registrar that records instead of calling ``cudaHostRegister``."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def register(self, ptr, nbytes):
        self.registered.append((ptr, nbytes))

    def unregister(self, ptr):
        self.unregistered.append(ptr)


PAGE = page_bytes()


def _whole_pages(n: int, page: int = PAGE) -> int:
    return -(-n // page) * page


def test_arena_is_one_allocation_pinned_once_as_whole_pages():
    rec = Recorder()
    arena = HostArena([3, 0, 5], torch.float32, pin=True, registrar=rec)
    ptr = arena.flat.data_ptr()
    assert ptr % PAGE == 0 and rec.registered == [(ptr, PAGE)]
    assert arena.nbytes == 32 and arena.pinned_bytes == PAGE
    assert [p.numel() for p in arena.parts] == [3, 0, 5]
    assert [p.storage_offset() - arena.flat.storage_offset() for p in arena.parts] == [0, 3, 3]  # end to end
    assert {p.untyped_storage().data_ptr() for p in arena.parts} == {arena.flat.untyped_storage().data_ptr()}
    assert all(torch.equal(p, torch.zeros(p.numel())) for p in arena.parts)
    del arena
    gc.collect()
    assert rec.unregistered == [ptr]
    plain = HostArena([7], torch.bfloat16, pin=False, registrar=rec)
    assert plain.pinned_bytes == 0 and plain.nbytes == 14 and len(rec.registered) == 1
    with pytest.raises(ValueError, match=">= 0"):
        HostArena([-1], torch.float32, pin=False)
    assert not can_pin(torch.device("cpu"))


def _offload(pin_memory=True, registrar=None, stage=1):
    groups = ProcessGroups.single()
    cfg = tiny_cfg()
    model, ddp, _ = build(cfg, groups, stage, False)
    opt = HostOffloadOptimizer(
        ddp,
        groups,
        pin_memory=pin_memory,
        registrar=registrar,
        lr=ADAM["lr"],
        weight_decay=ADAM["weight_decay"],
        clip_grad=1.0,
    )
    return cfg, model, ddp, opt


@pytest.mark.parametrize("stage", [1, 2])
def test_offloaded_state_pins_exactly_16_bytes_per_owned_element(stage):
    """One registration for the whole host state (main, moments, gradient copy): the bytes
    the model-state table lists on the host, rounded up to whole pages, reported by
    ``pinned_bytes``; a CPU model without a registrar pins nothing and touches no CUDA call."""
    rec = Recorder()
    cfg, model, ddp, opt = _offload(registrar=rec, stage=stage)
    owned = sum(buf.owned_numel() for buf in ddp.buffers)
    exact = HOST_BYTES_PER_ELEMENT * owned
    train(model, ddp, opt, ProcessGroups.single(), make_batches(cfg, 2), 2, steps=2)
    got = opt.model_state_bytes()
    assert rec.registered == [(opt.arena.flat.data_ptr(), _whole_pages(exact))]
    assert opt.arena.nbytes == exact == sum(got[k] for k in opt.HOST_PARTS if k in got)
    assert opt.pinned_bytes() == _whole_pages(exact)
    assert opt.bytes_by_place()["host"] == exact
    lo, hi = opt.arena.flat.data_ptr(), opt.arena.flat.data_ptr() + exact
    for t in (opt._main, opt.exp_avg, opt.exp_avg_sq, opt.host_grads):
        assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * 4 <= hi  # parts of the arena
    assert _offload(pin_memory=True)[3].pinned_bytes() == 0  # CPU: nothing to pin


def _assert_whole_disjoint_pages(ranges, page=PAGE):
    """Every registered (start, length) starts on a page boundary, is whole pages, and no two
    share a page (the driver refuses a page registered twice)."""
    assert ranges
    for start, n in ranges:
        assert start % page == 0 and n % page == 0 and n > 0, (start, n, page)
    spans = sorted((start, start + n) for start, n in ranges)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, spans


def test_zero3_offload_param_shards_are_one_arena_each(monkeypatch):
    """Each ZeRO-3 gather unit's host parameter shard is its own arena; the pinned bytes are
    the host shards' bytes (the ``host_params`` part of the table), each rounded up to whole
    pages, registered page-aligned with no page shared between two units."""
    from megazero.data_parallel import zero3
    from megazero.data_parallel.ddp import DataParallel
    from megazero.data_parallel.zero3_gather import Zero3Options
    from model.build import zero3_units
    from model.gpt import GPTStage
    from tests.support.zero import BUCKET, SEED

    rec = Recorder()
    monkeypatch.setattr(zero3, "can_pin", lambda device: True)
    monkeypatch.setattr(CudaRegistrar, "register", lambda self, ptr, n: rec.register(ptr, n))
    monkeypatch.setattr(CudaRegistrar, "unregister", lambda self, ptr: rec.unregister(ptr))
    groups, cfg = ProcessGroups.single(), tiny_cfg()
    model = GPTStage(cfg, groups, range(cfg.num_layers), True, True, SEED)
    ddp = DataParallel(
        [model],
        groups,
        zero_stage=3,
        bucket_size=BUCKET,
        overlap_comm=True,
        units=[zero3_units(model)],
        zero3=Zero3Options(offload_param=True),
    )
    offloaded = [b for b in ddp.buffers if b.host_arena is not None]
    assert len(offloaded) > 1
    shard_bytes = [b.layout.shard_numel * b.params_shard.element_size() for b in offloaded]
    assert sorted(n for _, n in rec.registered) == sorted(_whole_pages(n) for n in shard_bytes)
    assert ddp.host_param_bytes() == sum(shard_bytes)
    assert ddp.pinned_bytes() == sum(n for _, n in rec.registered)
    assert any(n < PAGE for n in shard_bytes)  # small units: several would fit in one page
    _assert_whole_disjoint_pages(rec.registered)


@pytest.mark.parametrize("page", [PAGE, 65536])  # this machine's, and 64 KiB (aarch64 kernels)
def test_many_small_arenas_register_whole_disjoint_pages(page):
    """ZeRO-3 parameter offload's pattern: many small arenas (a norm's shard is a few
    bytes) side by side, in several dtypes, plus large ones: each registered range is
    page-aligned, whole pages, disjoint from every other, and covers its arena's parts."""
    rec = Recorder()
    sizes = [[n] for n in range(1, 40)] + [[3, 0, 5], [page // 4 + 1], [3 * page]]
    arenas = [
        HostArena(s, dtype, pin=True, registrar=rec, **({} if page == PAGE else dict(page=page)))
        for s in sizes
        for dtype in (torch.float32, torch.bfloat16)
    ]
    assert len(rec.registered) == len(arenas)
    _assert_whole_disjoint_pages(rec.registered, page)
    for a, (start, n) in zip(arenas, rec.registered):
        assert a.flat.data_ptr() == start and a.nbytes <= n == a.pinned_bytes == _whole_pages(a.nbytes, page)
        assert all(
            start <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= start + n
            for p in a.parts
            if p.numel()
        )
        a.flat.fill_(1)  # the parts are usable memory
    assert page_range(page + 1, page, page) == (page, 2 * page) and page_range(2 * page, 1, page) == (2 * page, page)


def test_model_state_table_shows_the_pinned_bytes(tmp_path, monkeypatch):
    from megazero.runtime.monitor import Monitor

    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    rows = [dict(rank=0, psi=10, bytes={"params": 40, "host exp_avg": 40}, formula=80, pinned=2**20)]
    with Monitor(
        str(tmp_path), tensorboard_dir=None, metrics_file="m.jsonl", rank=0, is_logging_rank=True, config_text=""
    ) as mon:
        mon.log_model_state_table(rows)
    monkeypatch.undo()
    head, row = out.getvalue().splitlines()[1:3]
    assert head.split()[-1] == "pinned" and row.split()[-2:] == ["1.00", "MiB"]


def test_background_save_stages_every_chunk_in_one_reused_buffer():
    """``--async-save``: the owned chunks' host copy is one exactly-sized buffer, not one
    copy per chunk, and the manager hands the same buffer to the next save."""
    from megazero.checkpoint import core
    from megazero.checkpoint.manager import CheckpointManager
    from megazero.checkpoint.shards import Chunk

    state = torch.arange(20, dtype=torch.float32)
    mine = {
        "a/main_param": [Chunk((0,), (6,), state[:6]), Chunk((8,), (4,), state[8:12])],
        "b/exp_avg": [Chunk((0, 0), (2, 3), state[14:20].view(2, 3))],
    }
    manager = CheckpointManager(ProcessGroups.single(), async_save=True)
    asked = []

    def staging(numel, device):
        asked.append((numel, device))
        return manager._staging(numel, device)

    staged = core.stage_chunks(mine, staging)
    assert asked == [(16, torch.device("cpu"))]
    flat = manager.staging.flat
    assert flat.numel() == 16 and manager.staging.pinned_bytes == 0  # CPU: not pinned
    for key, cs in mine.items():
        for c, s in zip(cs, staged[key]):
            assert s.offsets == c.offsets and s.sizes == c.sizes and torch.equal(s.tensor, c.tensor)
            assert s.tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    state.add_(100)  # training goes on: the staged copy keeps the saved values
    assert staged["a/main_param"][1].tensor.tolist() == [8.0, 9.0, 10.0, 11.0]
    core.stage_chunks(mine, staging)
    assert manager.staging.flat.data_ptr() == flat.data_ptr()  # reused by the next save
