"""Building the model within bounded memory and the model's cheap GPU items
(item 7: the rotary table, SDPA's ``enable_gqa``, ``--tf32``, the sequence-parallel copies).

- Every parameter of a stage made one full tensor at a time (model/materialize.py), and at
  ZeRO-3 written straight into its gather unit's shard, equals slicing ``init_full_weights``
  (the whole model at once, as every stage was built before) bit for bit: tp 1 and 2, both
  blocks (GPT-2; LLaMA-style with RoPE, RMSNorm, SwiGLU, GQA, untied), bf16, a last pipeline
  stage with its copy of the tied embedding, buckets that cut parameters.
- Peak host memory while building a 4-layer stage at tp 2, and at ZeRO-3 dp 2, measured from
  torch's profiler (every CPU tensor allocation and free, as tests/layouts/test_checkpoint_shards.py
  measures checkpoint I/O), stays within 2 x (largest full tensor + this rank's shards), and
  within ``model.build.build_peak_bytes``' prediction, where building from
  ``init_full_weights`` held the whole stage in fp32.
- Sliding-window layers share one mask per forward; an unbounded window is full attention.
"""

import pytest
import torch

from megazero import tags
from megazero.config import config_from_argv
from megazero.data_parallel.ddp import DataParallel
from megazero.data_parallel.zero3_gather import Zero3Options
from megazero.process_groups import ProcessGroups
from megazero.tensor_parallel.random import RNGTracker
from megazero.topology import Topology
from model.build import build_gpt_config, build_model_chunks, build_peak_bytes, initial_values, set_tf32, zero3_units
from model.config import GPTConfig
from model.gpt import VOCAB_TENSORS, Attention, GPTStage, init_full_weights, resize_vocab
from model.rope import RotaryTable, rotary_cos_sin, rotary_cos_sin_at
from tests.support.distributed import run_distributed

SEED = 5
LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    num_query_groups=2,
    add_bias_linear=False,
    tie_embeddings=False,
)


def _cfgs(tp: int):
    base = dict(
        vocab_size=101,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    yield GPTConfig(**base)
    yield GPTConfig(**base, params_dtype=torch.bfloat16)
    yield GPTConfig(**base, **LLAMA, sequence_parallel=tp > 1)


def _sliced(cfg: GPTConfig, stage: GPTStage) -> dict:
    """Today's route: every full tensor at once (``init_full_weights``), then this rank's slice."""
    g, full = stage.groups, init_full_weights(cfg, SEED, stage.groups.tp_size)
    out = {}
    for name, p in stage.named_parameters():
        t = full[name]
        if name in VOCAB_TENSORS:
            t = resize_vocab(t, cfg.vocab_size, stage.padded_vocab)
        if tags.is_partitioned(p):
            t = tags.partition_tensor(t, p.partition_dim, g.tp_rank, g.tp_size, p.partition_stride)
        out[name] = t.to(p.dtype)
    return out


def _stage_run(rank, world, tp, pp):
    groups = ProcessGroups.build(Topology(tp=tp, pp=pp, dp=world // tp // pp))
    bad = []
    for cfg in _cfgs(tp):
        n = cfg.num_layers // pp
        stage = GPTStage(
            cfg,
            groups,
            range(groups.pp_rank * n, (groups.pp_rank + 1) * n),
            groups.pp_rank == 0,
            groups.pp_rank == pp - 1,
            SEED,
        )
        want = _sliced(cfg, stage)
        bad += [name for name, p in stage.named_parameters() if not torch.equal(p.detach(), want[name])]
        if groups.dp_size > 1:
            bad += _zero3_mismatches(cfg, groups, stage, want)
    return bad


def _zero3_mismatches(cfg, groups, materialized, want):
    """ZeRO-3 built from an unmaterialized stage: each shard equals the shard of the stage
    built whole; each unit gathered equals today's slices."""
    z3 = Zero3Options(param_persistence_threshold=20)  # the norms stay whole (a ZeRO-2 buffer)
    ref = DataParallel(
        [materialized],
        groups,
        zero_stage=3,
        bucket_size=301,
        overlap_comm=False,
        units=[zero3_units(materialized)],
        zero3=z3,
    )
    stage = GPTStage(
        cfg,
        groups,
        materialized.layer_ids,
        materialized.pre_process,
        materialized.post_process,
        SEED,
        materialize=False,
    )
    ddp = DataParallel(
        [stage],
        groups,
        zero_stage=3,
        bucket_size=301,
        overlap_comm=False,
        units=[zero3_units(stage)],
        zero3=z3,
        initial_values=initial_values([stage]),
    )
    bad = []
    for i, (a, b) in enumerate(zip(ref.buffers, ddp.buffers)):
        got, expect = (b.params_shard, a.params_shard) if b.params_shard is not None else (b.params_flat, a.params_flat)
        bad += [] if torch.equal(got, expect) else [f"zero3 buffer {i}"]
    for buf in ddp.buffers:
        ddp.strategy.gather(buf, groups.dp)
    bad += [f"zero3 {name}" for name, p in stage.named_parameters() if not torch.equal(p.detach(), want[name])]
    return bad


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1-dp2-zero3", "tp2", "pp2-tied-copy"])
def test_stages_built_one_tensor_at_a_time_equal_init_full_weights_sliced(tp, pp):
    for bad in run_distributed(_stage_run, 2, tp, pp):
        assert bad == []


def test_placeholders_refuse_to_pass_for_values():
    """An unmaterialized stage holds no memory and reads as NaN; DataParallel without its
    initial values refuses it rather than training from placeholders."""
    cfg = next(_cfgs(1))
    stage = GPTStage(cfg, ProcessGroups.single(), range(2), True, True, SEED, materialize=False)
    assert all(p.stride() == (0,) * p.dim() and torch.isnan(p).all() for p in stage.parameters())
    with pytest.raises(ValueError, match="placeholder"):
        DataParallel([stage], ProcessGroups.single(), zero_stage=3, bucket_size=301, overlap_comm=False)
    stage.materialize()
    with pytest.raises(RuntimeError, match="already given"):
        stage.initial_partition("final_ln.weight")


# -- peak memory while building ---------------------------------------------------------------


def _peak_bytes(fn):
    """(peak bytes of CPU tensors allocated inside ``fn()`` and live at once, ``fn()``'s result),
    from torch's profiler allocation events in time order (a free matched to its allocation by
    address; frees of older tensors ignored)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = []

    def walk(nodes):
        for e in nodes:
            if e.tag == _EventType.Allocation:
                events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live, now, peak = {}, 0, 0
    for _, size, ptr in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = size
            now += size
            peak = max(peak, now)
        elif ptr in live:
            now -= live.pop(ptr)
    return peak, result


ARGV = [
    "--mock-data",
    "--vocab-size",
    "250",
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "256",
    "--seq-length",
    "32",
    "--seed",
    str(SEED),
]


def _memory_run(rank, world, extra):
    cfg = config_from_argv(ARGV + extra, world)
    gcfg = build_gpt_config(cfg, 250)
    p = cfg.parallel
    groups = ProcessGroups.build(Topology(tp=p.tp, pp=1, dp=p.dp))
    cpu = torch.device("cpu")
    names = [n for n, _ in GPTStage(gcfg, groups, range(4), True, True, SEED, materialize=False).named_parameters()]
    full = init_full_weights(gcfg, SEED, p.tp, names)
    out = dict(
        full_stage=sum(t.numel() * t.element_size() for t in full.values()),
        largest_full=max(t.numel() * t.element_size() for t in full.values()),
        predicted=build_peak_bytes(cfg, gcfg),
    )
    del full
    before, _ = _peak_bytes(
        lambda: GPTStage(
            gcfg, groups, range(4), True, True, SEED, full_weights=init_full_weights(gcfg, SEED, p.tp, names)
        )
    )
    if cfg.zero.stage != 3:
        peak, chunks = _peak_bytes(lambda: build_model_chunks(gcfg, cfg, groups, cpu))
        out.update(shards=sum(q.numel() * q.element_size() for q in chunks[0].parameters()), grads=0)
    else:

        def build():
            chunks = build_model_chunks(gcfg, cfg, groups, cpu)
            return DataParallel(
                chunks,
                groups,
                zero_stage=3,
                bucket_size=cfg.model.hidden_size**2,
                overlap_comm=False,
                units=[zero3_units(c) for c in chunks],
                zero3=Zero3Options(param_persistence_threshold=0),
                initial_values=initial_values(chunks),
            )

        peak, ddp = _peak_bytes(build)
        out.update(shards=sum(b.param_bytes() for b in ddp.buffers), grads=sum(b.grad_bytes() for b in ddp.buffers))
    return dict(out, before=before, peak=peak)


@pytest.mark.parametrize(
    "extra",
    [["--tp", "2"], ["--dp", "2", "--zero-stage", "3", "--zero3-param-persistence-threshold", "0"]],
    ids=["tp2", "zero3-dp2"],
)
def test_build_peak_memory_is_shards_plus_one_full_tensor(extra):
    """The build's peak (less ZeRO's gradient shard, which DataParallel allocates beside it) is
    at most 2 x (largest full tensor + this rank's parameter shards) and within the predicted
    peak; building from ``init_full_weights`` held the whole stage in fp32 (over that bound)."""
    for out in run_distributed(_memory_run, 2, extra):
        bound = 2 * (out["largest_full"] + out["shards"])
        build = out["peak"] - out["grads"]
        assert build <= bound < out["before"], out
        assert out["peak"] <= 2 * (out["largest_full"] + out["shards"] + out["grads"])
        assert out["before"] >= out["full_stage"]
        predicted = out["predicted"]
        assert predicted.full == out["largest_full"]
        assert predicted.resident == pytest.approx(out["shards"], rel=0.01)  # the buckets' padding
        assert out["shards"] <= build <= predicted.peak


def test_build_peak_bytes_without_zero3_is_the_partitions_plus_one_parameter_in_flight():
    cfg = config_from_argv(ARGV + ["--tp", "2"], 2)
    gcfg = build_gpt_config(cfg, 250)
    got = build_peak_bytes(cfg, gcfg)
    ranks_elements = sum(e.local_numel(2) for e in gcfg.parameter_spec(2))
    assert got.resident == 4 * ranks_elements
    # the largest in flight: the [256, 64] word embedding, its [128, 64] rows (already fp32 on the CPU)
    assert got.full == 4 * 256 * 64 and got.in_flight == 4 * (256 + 128) * 64
    z3 = ARGV + ["--dp", "2", "--zero-stage", "3", "--bf16"]
    spec = gcfg.parameter_spec(1)
    sharded = config_from_argv(z3 + ["--zero3-param-persistence-threshold", "0"], 2)
    halves = sum(-(-e.numel // 2) for e in spec)
    assert build_peak_bytes(sharded, build_gpt_config(sharded, 250)).resident == 2 * halves  # bf16 shards
    # DeepSpeed's own threshold of 100,000 elements (the default is 10 x hidden): every tensor here stays whole
    whole = config_from_argv(z3 + ["--zero3-param-persistence-threshold", "100000"], 2)
    assert build_peak_bytes(whole, build_gpt_config(whole, 250)).resident == 2 * sum(e.numel for e in spec)


# -- item 7: rotary table, enable_gqa, TF32 ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_table_rows_equal_the_tables_rebuilt_per_layer(dtype):
    table = RotaryTable(64, 8, 10000.0)
    for T in (1, 7, 16, 64):
        assert all(torch.equal(a, b) for a, b in zip(table.first(T, dtype), rotary_cos_sin(T, 8, 10000.0, dtype=dtype)))
    positions = torch.randint(0, 64, (3, 20))
    assert all(
        torch.equal(a, b) for a, b in zip(table.at(positions, dtype), rotary_cos_sin_at(positions, 8, 10000.0, dtype))
    )
    with pytest.raises(ValueError, match="exceed"):
        table.first(65, dtype)


def test_a_stage_shares_one_rotary_table_across_its_layers():
    cfg = GPTConfig(vocab_size=101, num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, **LLAMA)
    stage = GPTStage(cfg, ProcessGroups.single(), range(3), True, True, SEED)
    assert len({id(block.attn.rope) for block in stage.layers.values()}) == 1


def test_a_stage_builds_one_window_mask_per_forward_and_its_layers_share_it(monkeypatch):
    """Sliding-window layers on the plain path: layers 1 and 3 of 4 (``--window-size 5,0
    --window-attn-skip-freq 2``) take one ``[1, 1, T, T]`` mask, built once per forward (counted)
    and the same tensor in both; a window of -1 is full attention, the output equal bit for bit."""
    import model.gpt as gpt

    built = []

    def counted(*args):
        built.append(args)
        return gpt_mask(*args)

    gpt_mask = gpt.document_mask
    monkeypatch.setattr(gpt, "document_mask", counted)
    base = dict(vocab_size=101, num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, **LLAMA)
    cfg = GPTConfig(**base, window_size=[5, 0], window_attn_skip_freq=[2])
    stage = GPTStage(cfg, ProcessGroups.single(), range(4), True, True, SEED).eval()
    assert [block.attn.window for block in stage.layers.values()] == [6, None, 6, None]
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(2):
            stage(ids)
    assert len(built) == 2 and list(stage.attention_masks) == [("window", 16, 6, torch.float32, torch.device("cpu"))]
    mask = stage.attention_masks[("window", 16, 6, torch.float32, torch.device("cpu"))][0, 0]  # (T, T)
    assert int(mask.isinf().sum()) == 16 * 15 // 2 + 10 * 11 // 2  # the future, and i - j >= 6: 55 pairs
    plain = GPTStage(GPTConfig(**base), ProcessGroups.single(), range(4), True, True, SEED).eval()
    unbounded = GPTStage(GPTConfig(**base, window_size=[-1, 0]), ProcessGroups.single(), range(4), True, True, SEED)
    with torch.no_grad():
        assert torch.equal(plain(ids), unbounded.eval()(ids))


@pytest.mark.parametrize("groups", [1, 2])
def test_enable_gqa_equals_repeated_keys_and_values(monkeypatch, groups):
    """Grouped-query attention through SDPA's ``enable_gqa`` (no repeated K/V tensors): the same
    output bit for bit; the K/V gradients sum a group's heads in another order, equal to fp32
    rounding."""
    import model.gpt as gpt

    if not gpt.SDPA_GQA:
        pytest.skip("torch < 2.5: SDPA has no enable_gqa")
    cfg = GPTConfig(
        vocab_size=101,
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        attention_dropout=0.0,
        **dict(LLAMA, num_query_groups=groups),
    )
    torch.manual_seed(0)
    attn = Attention(cfg, None, False, RNGTracker(1, 0))
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 16, 32)

    def run(gqa):
        monkeypatch.setattr(gpt, "SDPA_GQA", gqa)
        xi = x.clone().requires_grad_(True)
        y = attn(xi)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), [xi, *attn.parameters()])
        return y, grads

    (y1, g1), (y0, g0) = run(True), run(False)
    assert torch.equal(y1, y0)
    for a, b in zip(g1, g0):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_tf32_flag_is_off_by_default_and_acts_on_cuda_only(monkeypatch):
    assert config_from_argv(["--mock-data"], 1).precision.tf32 is False
    assert config_from_argv(["--mock-data", "--tf32"], 1).precision.tf32 is True
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    before = (
        (matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
        if new_api
        else (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    )

    def state():
        return (
            (matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
            if new_api
            else (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        )

    try:
        set_tf32(True, torch.device("cpu"))
        set_tf32(False, torch.device("cuda"))
        assert state() == before
        set_tf32(True, torch.device("cuda"))  # only flips the switches: no CUDA context is made
        assert state() == (("tf32", "tf32") if new_api else (True, True))
    finally:
        if new_api:
            matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before
        else:
            matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _sp_copies_run(rank, world, layers):
    """Layout copies (``aten.clone`` of ``.contiguous()``/``reshape``) made in the TP/SP borders
    (megazero/tensor_parallel) during one forward and one backward of a ``layers``-layer stage."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase, self.counts = "forward", {"forward": 0, "backward": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.clone.default and any(
                "megazero/tensor_parallel/" in f.filename for f in traceback.extract_stack()
            ):
                self.counts[self.phase] += 1
            return func(*args, **(kwargs or {}))

    cfg = GPTConfig(
        vocab_size=256,
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        sequence_parallel=True,
    )
    stage = GPTStage(cfg, ProcessGroups.build(Topology(tp=2, pp=1, dp=1)), range(layers), True, True, SEED)
    x = torch.randint(0, 256, (2, 32))
    with Count() as count:
        loss = stage(x, x).sum()
        count.phase = "backward"
        loss.backward()
    return count.counts


def test_sequence_parallel_layer_makes_six_layout_copies_forward_and_six_backward():
    """docs/design.md ("Model"): batch-first activations cost each sequence-parallel layer 6
    copies in the forward (2 all-gathers x 1, 2 reduce-scatters x 2) and 6 in the backward,
    which Megatron's sequence-first layout avoids; counted here as the difference between a
    2-layer and a 1-layer stage at tp 2."""
    one, two = (run_distributed(_sp_copies_run, 2, n)[0] for n in (1, 2))
    assert {k: two[k] - one[k] for k in one} == {"forward": 6, "backward": 6}
