"""Pipeline parallelism on spawned gloo ranks: equal to one process, clear errors, tied copies.

Each ``run_distributed`` call batches several checks (spawning ranks costs seconds).
"""

import time
import weakref

import pytest
import torch
import torch.nn as nn

from megazero.data_parallel.finalize import finalize_param_grads
from megazero.pipeline.executor import run_schedule
from megazero.pipeline.p2p import PipelineConfigError, StageLinks, handshake
from megazero.pipeline.partition import is_post_process, is_pre_process, layer_ids
from megazero.pipeline.schedules import build_schedule, simulate
from megazero.process_groups import ProcessGroups
from megazero.topology import Topology
from tests.support.distributed import run_distributed

H, MB, M, LAYERS, LR = 16, 2, 8, 8, 0.2  # toy: width, micro-batch, micro-batches, layers
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
CPU = torch.device("cpu")


class ToyChunk(nn.Module):
    """Layers ``tanh(W_i x + b_i)`` for the given global layer ids; weights from (seed, id)."""

    def __init__(self, ids):
        super().__init__()
        self.layers = nn.ModuleList()
        for i in ids:
            g = torch.Generator().manual_seed(1000 + i)
            lin = nn.Linear(H, H)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(H, H, generator=g) / H**0.5)
                lin.bias.copy_(torch.randn(H, generator=g) * 0.1)
            self.layers.append(lin)

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def _toy_data(steps, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(M * MB, H, generator=g), torch.randn(M * MB, H, generator=g)) for _ in range(steps)]


def _toy_reference(steps, seed=7):
    model = ToyChunk(range(LAYERS))
    losses = []
    for x, y in _toy_data(steps, seed):
        model.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        losses.append(loss.item())
    return losses


class _Alive:
    """Counts the activations a stage keeps: each forward's input (or, on the first chunk,
    output) is tracked by a weak reference; ``peak`` is the most alive at once."""

    def __init__(self):
        self.refs, self.peak = [], 0

    def forward_step(self, batch, chunk, input_tensor):
        x = batch[0] if input_tensor is None else input_tensor
        out = chunk(x)
        self.refs = [w for w in self.refs if w() is not None]
        self.refs.append(weakref.ref(out if input_tensor is None else input_tensor))
        self.peak = max(self.peak, len(self.refs))
        return out, lambda o: ((o - batch[1]) ** 2).sum() / (M * MB * H)


def _toy_train(groups, kind, vp, steps, scale, seed=7):
    p, r = groups.pp_size, groups.pp_rank
    chunks = [ToyChunk(layer_ids(LAYERS, p, r, vp, v)) for v in range(vp)]
    actions = build_schedule(kind, M, p, r, vp)
    handshake(groups, (MB, H), torch.float32, M, vp, kind, device=CPU)
    losses, calls, alive = [], [], _Alive()
    for x, y in _toy_data(steps, seed):
        batches = list(zip(x.split(MB), y.split(MB)))
        for c in chunks:
            c.zero_grad()
        loss = run_schedule(
            actions,
            chunks,
            alive.forward_step,
            batches,
            groups,
            tensor_shape=(MB, H),
            dtype=torch.float32,
            num_microbatches=M,
            vp_size=vp,
            before_backward=lambda c, last: calls.append((c, last)),
            scale_loss=(lambda l: l * scale) if scale != 1 else None,
        )
        with torch.no_grad():
            for c in chunks:
                for prm in c.parameters():
                    prm -= LR * prm.grad / scale
        losses.append(loss.item())
    return losses, calls, alive.peak


def _toy_ranks(rank, world, steps):
    groups = ProcessGroups.build(Topology(pp=world), timeout_s=60)
    out = {kind: _toy_train(groups, kind, vp, steps, 8.0 if kind == "1f1b" else 1.0) for kind, vp in SCHEDULES}
    if world == 2:
        out["p2p"] = _p2p_checks(groups)
    if world == 4:
        out["errors"] = _mismatch_checks(groups)
        # pp 2 x dp 2: each data-parallel replica is its own pipeline with its own data.
        groups = ProcessGroups.build(Topology(pp=2, dp=2), timeout_s=60)
        out["dp"] = _toy_train(groups, "1f1b", 1, 1, 1.0, seed=7 + groups.dp_rank)[0]
        out["dp_errors"] = _mismatch_checks(groups)
    return out


def _p2p_checks(groups):
    """Megatron-named exchanges between stage 0 and 1; a wrongly shaped send is refused."""
    links = StageLinks(groups, (2, 3), torch.float32, CPU)
    t = torch.arange(6.0).view(2, 3)
    if groups.pp_rank == 0:
        links.send_forward(t, tag=5)
        first = links.recv_backward(tag=6)
        second = links.send_forward_recv_backward(t + 10, send_tag=7, recv_tag=8)
        with pytest.raises(ValueError, match=r"sends \(3, 2\).*configured for \(2, 3\)"):
            links.send_forward(t.t(), tag=9)
    else:
        x = links.recv_forward(tag=5)
        links.send_backward(x * 2, tag=6)
        second = links.send_backward_recv_forward(-t, send_tag=8, recv_tag=7)
        first = x
    return first.tolist(), second.tolist()


def _mismatch_checks(groups):
    """Two deliberate mismatches (both in the pipeline of dp rank 0); every rank of every
    pipeline must raise within seconds."""
    r, results = groups.pp_rank, []
    bad = groups.dp_rank == 0
    for shape, m in (
        ((MB, H * (2 if r == 1 and bad else 1)), M),
        ((MB, H), M + (1 if r == groups.pp_size - 1 and bad else 0)),
    ):
        start = time.monotonic()
        try:
            handshake(groups, shape, torch.float32, m, 1, "1f1b", device=CPU)
            results.append((None, time.monotonic() - start))
        except PipelineConfigError as e:
            results.append((str(e), time.monotonic() - start))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_toy_pipeline_matches_single_process(world):
    """GPipe, 1F1B (with a loss scale) and interleaved: every rank's loss equals one process;
    before_backward flags each chunk's last backward; the activations kept alive are the
    simulator's count (1F1B: pp on stage 0, GPipe: m); at world 4 also pp 2 x dp 2 and the
    handshake errors."""
    steps = 3
    ref = _toy_reference(steps)
    out = run_distributed(_toy_ranks, world, steps, timeout_s=120)
    for kind, vp in SCHEDULES:
        expected_peak = simulate([build_schedule(kind, M, world, r, vp) for r in range(world)], world, vp).peak_inflight
        for rank in range(world):
            losses, calls, peak = out[rank][kind]
            assert losses == pytest.approx(ref, rel=1e-5), (kind, rank)
            assert peak == expected_peak[rank], (kind, rank)
            assert len(calls) == steps * M * vp
            for v in range(vp):
                flags = [last for c, last in calls[: M * vp] if c == v]
                assert flags == [False] * (M - 1) + [True], (kind, rank, v)
        assert out[0][kind][2] == {"gpipe": M, "1f1b": world}.get(kind, out[0][kind][2])
    if world == 2:
        t = torch.arange(6.0).view(2, 3)
        assert out[0]["p2p"] == ((t * 2).tolist(), (-t).tolist())
        assert out[1]["p2p"] == (t.tolist(), (t + 10).tolist())
    if world == 4:
        _check_dp_and_errors(out)


def _check_dp_and_errors(out):
    for rank in range(4):
        (msg_shape, t1), (msg_mb, t2) = out[rank]["errors"]
        assert t1 < 20 and t2 < 20
        assert "stage 0 has activation shape" in msg_shape and "(2, 16)" in msg_shape
        assert "stage 1 has (2, 32)" in msg_shape
        assert "number of micro-batches" in msg_mb and "= 8 but stage 3 has 9" in msg_mb
        dp_rank = rank % 2  # pp 2 x dp 2, order tp-dp-pp
        assert out[rank]["dp"] == pytest.approx(_toy_reference(1, seed=7 + dp_rank), rel=1e-5)
        for msg, elapsed in out[rank]["dp_errors"]:
            assert elapsed < 20
            if dp_rank == 0:
                assert "stage 0 has" in msg and "stage 1 has" in msg
            else:
                assert "another pipeline" in msg


def _meta_default_ranks(rank, world, steps):
    """The handshake, a mismatch it must name, StageLinks and 1F1B steps, all with "meta" as the
    default device and the real device passed explicitly: a tensor made without ``device=``
    is a meta tensor, which gloo refuses (as NCCL refuses a CPU tensor)."""
    groups = ProcessGroups.build(Topology(pp=world), timeout_s=60)
    r = groups.pp_rank
    chunk = ToyChunk(layer_ids(LAYERS, world, r, 1, 0))  # the model and data are built on the CPU
    data, actions = _toy_data(steps), build_schedule("1f1b", M, world, r, 1)
    losses = []
    with torch.device("meta"):
        handshake(groups, (MB, H), torch.float32, M, 1, "1f1b", device=CPU)
        try:
            handshake(groups, (MB, H * (1 + r)), torch.float32, M, 1, "1f1b", device=CPU)
            error = None
        except PipelineConfigError as e:
            error = str(e)
        for x, y in data:
            chunk.zero_grad()
            loss = run_schedule(
                actions,
                [chunk],
                _Alive().forward_step,
                list(zip(x.split(MB), y.split(MB))),
                groups,
                tensor_shape=(MB, H),
                dtype=torch.float32,
                num_microbatches=M,
                device=CPU,
            )
            with torch.no_grad():
                for prm in chunk.parameters():
                    prm -= LR * prm.grad
            losses.append(loss.item())
    return losses, error


def test_handshake_and_schedule_on_a_meta_default_device():
    """Under ``with torch.device("meta")`` (the CPU passed explicitly) the pipeline handshake
    and a 1F1B run on 2 stages work and equal one process; a mismatch is still named. Fails
    when a p2p tensor forgets ``device=`` (the handshake's CPU int64 vectors, which
    NCCL cannot send, ended every --pp > 1 run before step 1)."""
    steps = 2
    out = run_distributed(_meta_default_ranks, 2, steps, timeout_s=120)
    for losses, error in out:
        assert losses == pytest.approx(_toy_reference(steps), rel=1e-5)
        assert "stage 0 has activation shape" in error and "stage 1 has (2, 32)" in error


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_no_pipelining_in_one_process(device):
    """Schedule "none" (gradient accumulation, no torch.distributed): loss and gradients equal
    one pass over the whole batch."""
    x, y = (t.to(device) for t in _toy_data(1)[0])
    ref = ToyChunk(range(LAYERS)).to(device)
    ref_loss = ((ref(x) - y) ** 2).mean()
    ref_loss.backward()
    chunk = ToyChunk(range(LAYERS)).to(device)
    loss = run_schedule(
        build_schedule("none", M, 1, 0),
        [chunk],
        _Alive().forward_step,
        list(zip(x.split(MB), y.split(MB))),
        ProcessGroups.single(),
        tensor_shape=(MB, H),
        dtype=torch.float32,
        num_microbatches=M,
    )
    assert loss.device.type == device and loss.dtype == torch.float64 and loss.dim() == 0  # summed in fp64
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for a, b in zip(chunk.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="3 micro-batches for num_microbatches 8"):
        run_schedule(
            build_schedule("none", M, 1, 0),
            [chunk],
            _Alive().forward_step,
            [(x, y)] * 3,
            ProcessGroups.single(),
            tensor_shape=(MB, H),
            dtype=torch.float32,
            num_microbatches=M,
        )


# -- the GPT of model/gpt.py against tests/support/reference.py ----------------------------------------
GPT_STEPS, T, VOCAB = 10, 8, 50


def _gpt_cfg():
    from model.config import GPTConfig

    return GPTConfig(
        vocab_size=VOCAB,
        num_layers=8,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=T,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        make_vocab_size_divisible_by=16,
    )


def _gpt_data():
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(GPT_STEPS):
        seq = torch.randint(0, VOCAB, (M * MB, T + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))  # (tokens, labels), each (M*MB, T)
    return out


def _gpt_forward_step(batch, chunk, input_tensor):
    tokens, labels = batch
    x = tokens if input_tensor is None else input_tensor
    out = chunk(x, labels if chunk.post_process else None)  # (MB, T) losses or (MB, T, H)
    return out, lambda per_token: per_token.sum() / (M * MB * T)


def _tied_copies_equal(chunks, groups):
    """True when both copies of the word embedding (first and last stage) are bit-identical."""
    from megazero import collectives

    if groups.embedding is None:
        return None
    mine = [c.embedding.word_embeddings.weight for c in chunks if hasattr(c, "embedding")]
    copies = collectives.all_gather_list(mine[0].detach(), groups.embedding)
    return all(torch.equal(copies[0], c) for c in copies[1:])


def _gpt_train(groups, kind, vp):
    from model.gpt import GPTStage

    cfg, p, r = _gpt_cfg(), groups.pp_size, groups.pp_rank
    chunks = [
        GPTStage(
            cfg,
            groups,
            layer_ids(cfg.num_layers, p, r, vp, v),
            is_pre_process(r, v),
            is_post_process(r, p, v, vp),
            seed=3,
        )
        for v in range(vp)
    ]
    params = [q for c in chunks for q in c.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    actions = build_schedule(kind, M, p, r, vp)
    shape = (MB, T, cfg.hidden_size)
    handshake(groups, shape, torch.float32, M, vp, kind, device=CPU)
    losses, tied = [], [_tied_copies_equal(chunks, groups)]
    for tokens, labels in _gpt_data():
        opt.zero_grad(set_to_none=True)
        batches = list(zip(tokens.split(MB), labels.split(MB)))
        loss = run_schedule(
            actions,
            chunks,
            _gpt_forward_step,
            batches,
            groups,
            tensor_shape=shape,
            dtype=torch.float32,
            num_microbatches=M,
            vp_size=vp,
        )
        _, n_tied = finalize_param_grads(params, None, groups.embedding)
        opt.step()
        losses.append(loss.item())
        tied.append(_tied_copies_equal(chunks, groups))
    return losses, tied, n_tied


def _gpt_ranks(rank, world):
    groups = ProcessGroups.build(Topology(pp=world), timeout_s=60)
    return {kind: _gpt_train(groups, kind, vp) for kind, vp in SCHEDULES}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gpt_pipeline_matches_reference(world):
    from model.gpt import init_full_weights
    from tests.support.reference import train_reference

    ref = train_reference(
        init_full_weights(_gpt_cfg(), 3),
        _gpt_data(),
        vocab_size=VOCAB,
        num_heads=2,
        lr=1e-2,
        steps=GPT_STEPS,
        optimizer="adamw",
    )
    out = run_distributed(_gpt_ranks, world, timeout_s=240)
    for kind, _ in SCHEDULES:
        for rank in range(world):
            losses, tied, n_tied = out[rank][kind]
            assert losses == pytest.approx(ref, rel=1e-5), (kind, rank)
            end = rank in (0, world - 1)
            assert tied == ([True] * (GPT_STEPS + 1) if end else [None] * (GPT_STEPS + 1))
            assert n_tied == (1 if end else 0)
