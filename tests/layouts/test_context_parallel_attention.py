"""Context-parallel attention (megazero/context_parallel) against full-sequence SDPA.

Pure tests: the zigzag layout (split/merge round trip, token positions), the block plan
(no block above the causal diagonal, every causal chunk pair computed exactly once, equal work
on every rank) and the block math (a fully masked row gives out 0, lse -inf, no NaN).

Distributed tests, one ``run_distributed`` per cp size C = 2, 3, 4 running every case of that
size: ``ring_attention`` (p2p) and, where h and G divide by C, ``all_to_all_attention`` (a2a),
with G = 1, 2, (3,) h key/value heads, without and with packed documents. Every rank returns
its local output and dq, dk, dv (for a fixed upstream gradient); the parent merges them with
``merge_from_ranks`` and compares with ``F.scaled_dot_product_attention`` on the whole sequence
(K/V expanded, explicit mask for documents). Inputs and the ring run in float32; the oracle
runs in float64 on the same values, and the error is measured relative to the oracle's largest
magnitude: ``max|ours - oracle| / max|oracle| <= 1e-6`` (float32 SDPA itself is within a few
1e-7 of the float64 oracle). The bytes counted in ``collectives.counter`` per forward and
backward equal ``ring_bytes_per_layer`` / ``a2a_bytes_per_layer`` exactly; with a
``mask_cache`` shared by two calls (two layers of a micro-batch) a2a gathers the document ids
once. With attention sinks (one logit per head, gpt-oss), the ring and the all-to-all equal an
explicit float64 softmax with a sink column, their outputs and dq, dk, dv, and the sinks'
gradient summed over the cp ranks. With values of another head size than the keys (``d_v != d``,
DeepSeek's multi-head latent attention: ``MLA_CASES`` at C = 2, ring einsum and fused blocks, a2a,
with and without documents), the same oracle and byte counts hold.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import collectives
from megazero.context_parallel import zigzag as Z
from megazero.context_parallel.attention import (
    a2a_bytes_per_layer,
    all_to_all_attention,
    local_attention,
    ring_attention,
    ring_bytes_per_layer,
)
from megazero.context_parallel.blockwise import block_attention, block_attention_backward, block_mask, merge_partials
from tests.support.distributed import run_distributed

B, D, CHUNK = 2, 8, 4  # batch, head dim, tokens per zigzag chunk
TOL = 1e-6
HEADS = {2: (4, (1, 2, 4)), 3: (6, (1, 2, 3, 6)), 4: (8, (1, 2, 4, 8))}  # C: (h, G values)


# -- pure: zigzag layout and block plan ------------------------------------------------------
@pytest.mark.parametrize("C", [1, 2, 3, 4])
def test_split_merge_roundtrip_and_token_index(C):
    T = 2 * C * 3
    x = torch.arange(2 * T * 5).reshape(2, T, 5)
    parts = [Z.split_for_rank(x, 1, r, C) for r in range(C)]
    for r, part in enumerate(parts):
        idx = Z.local_token_index(T, r, C)
        assert torch.equal(part, x[:, idx])
        n = T // (2 * C)
        assert idx.tolist() == [*range(r * n, (r + 1) * n), *range((2 * C - 1 - r) * n, (2 * C - r) * n)]
    assert torch.equal(Z.merge_from_ranks(parts, 1, C), x)
    every = torch.cat([Z.local_token_index(T, r, C) for r in range(C)])
    assert sorted(every.tolist()) == list(range(T))


def test_split_names_the_setting():
    with pytest.raises(ValueError, match=r"--seq-length 10 .*2\*C = 4"):
        Z.split_for_rank(torch.zeros(10), 0, 0, 2)


@pytest.mark.parametrize("C", [1, 2, 3, 4, 5])
def test_block_plan_is_causal_complete_and_balanced(C):
    seen = []
    for r in range(C):
        pairs = Z.block_pairs(r, C)
        for step, q_chunk, kv_chunk, kind in pairs:
            assert q_chunk in Z.zigzag_chunks(r, C)
            assert kv_chunk in Z.zigzag_chunks(Z.ring_source(r, step, C), C)
            assert kv_chunk <= q_chunk, "a block above the causal diagonal is computed"
            assert kind == (Z.DIAGONAL if kv_chunk == q_chunk else Z.FULL)
            seen.append((q_chunk, kv_chunk))
        kinds = [p[3] for p in pairs]
        assert kinds.count(Z.DIAGONAL) == 2 and kinds.count(Z.FULL) == 2 * C - 1
        # work: full = 1 block, diagonal = 1/2 block; the same on every rank
        assert Z.block_work(r, C) == 2 * C
    causal = [(i, j) for i in range(2 * C) for j in range(i + 1)]
    assert sorted(seen) == causal, "every causal chunk pair exactly once over all ranks"


def test_fully_masked_row_is_zero_and_nan_free():
    q, k, v = torch.randn(1, 2, 3, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 4, 5, dtype=torch.bool)
    mask[0, 1] = False  # query 1 sees no key
    out, lse = block_attention(q, k, v, mask, 0.3)
    assert torch.isneginf(lse[..., 1]).all() and torch.isfinite(lse[..., [0, 2, 3]]).all()
    assert (out[..., 1, :] == 0).all() and not out.isnan().any()
    empty = torch.full_like(lse, float("-inf"))
    o, l = merge_partials(out, lse, torch.zeros_like(out), empty)
    assert torch.equal(o, out) and torch.equal(l, lse)
    o, l = merge_partials(torch.zeros_like(out), empty, torch.zeros_like(out), empty)
    assert (o == 0).all() and torch.isneginf(l).all()
    grads = block_attention_backward(q, k, v, torch.randn_like(q), torch.randn_like(lse), lse, mask, 0.3)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][..., 1, :] == 0).all()


# -- oracle and inputs -----------------------------------------------------------------------
def _segments(T: int, seed: int) -> torch.Tensor:
    """Packed documents ``[B, T]`` in natural order; a document starts at token CHUNK (chunk 1),
    so queries there see nothing of chunk 0: fully masked rows in the full block (1, 0)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, T, generator=g) < 0.2
    starts[:, 0], starts[0, CHUNK] = False, True
    return torch.cumsum(starts.long(), dim=1)


def _oracle(q, k, v, seg, dy, window=None):
    """SDPA on the whole sequence in float64, K/V expanded: (y, dq, dk, dv); with a sliding
    ``window`` W the keys W or more positions back are masked too."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    R = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(R, dim=1), v.repeat_interleave(R, dim=1)
    if seg is None and window is None:
        y = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    else:
        T = q.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None]  # (1, T, T) causal
        if window is not None:  # keep i - j < W: drop the band from diagonal -W down
            mask = mask & ~torch.ones(T, T, dtype=torch.bool).tril(-window)
        if seg is not None:
            mask = mask & (seg[:, :, None] == seg[:, None, :])  # (B, T, T)
        y = F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask[:, None])
    y.backward(dy.double())
    return y, q.grad, k.grad, v.grad


def _cases(C: int):
    """(name, method, h, G, documents) for cp size C; a2a only where h and G divide by C."""
    h, groups = HEADS[C]
    out = []
    for G in groups:
        for docs in (False, True):
            out.append((f"p2p G={G} docs={docs}", "p2p", h, G, docs))
            if G % C == 0:
                out.append((f"a2a G={G} docs={docs}", "a2a", h, G, docs))
    return out


def _inputs(C: int, h: int, G: int, docs: bool, seed: int, dv: int = D):
    T = 2 * C * CHUNK
    g = torch.Generator().manual_seed(seed)
    q, dy = torch.randn(B, h, T, D, generator=g), torch.randn(B, h, T, dv, generator=g)
    k, v = torch.randn(B, G, T, D, generator=g), torch.randn(B, G, T, dv, generator=g)
    return q, k, v, dy, _segments(T, seed) if docs else None


MLA_CASES = [  # (name, method, documents, ring block kernel, d_v) at C 2 with h = G = 4 heads, d = D = 8
    ("mla p2p einsum", "p2p", False, "einsum", 5),
    ("mla p2p einsum docs", "p2p", True, "einsum", 12),
    ("mla p2p fused", "p2p", False, "auto", 5),
    ("mla p2p fused docs", "p2p", True, "auto", 12),
    ("mla a2a", "a2a", False, None, 5),
    ("mla a2a docs", "a2a", True, None, 12),
]


def _mla_inputs(i: int, docs: bool, dv: int):
    return _inputs(2, 4, 4, docs, seed=700 + i, dv=dv)


# -- distributed: one spawn per cp size ------------------------------------------------------
def _counted(before: dict) -> dict:
    return {kind: n - before.get(kind, 0) for kind, n in collectives.counter.items() if n != before.get(kind, 0)}


def _run_case(rank, C, group, cp_ranks, method, full, part_rank, **kw):
    q, k, v, dy, seg = (
        None if t is None else Z.split_for_rank(t, 2 if t.dim() == 4 else 1, part_rank, C) for t in full
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    idx = Z.local_token_index(q.shape[2] * C, part_rank, C)
    before = dict(collectives.counter)
    if method == "p2p":
        y = ring_attention(q, k, v, group=group, cp_ranks=cp_ranks, token_index=idx, segment_ids=seg, **kw)
    else:
        y = all_to_all_attention(q, k, v, group=group, token_index=idx, segment_ids=seg, **kw)
    forward = _counted(before)
    before = dict(collectives.counter)
    y.backward(dy)
    return (y.detach(), q.grad, k.grad, v.grad), forward, _counted(before)


def _shared_documents(rank, C):
    """Two layers of one micro-batch through a2a with one ``mask_cache``: the document ids are
    gathered at the first only, and each output equals the uncached call's."""
    full = _inputs(C, 2 * C, C, True, seed=11)
    q, k, v, _, seg = (None if t is None else Z.split_for_rank(t, 2 if t.dim() == 4 else 1, rank, C) for t in full)
    idx = Z.local_token_index(q.shape[2] * C, rank, C)
    cache, gathered, same = {}, [], []
    for _ in range(2):
        before = dict(collectives.counter)
        y = all_to_all_attention(q, k, v, group=dist.group.WORLD, token_index=idx, segment_ids=seg, mask_cache=cache)
        gathered.append(_counted(before).get("all_gather", 0))
        plain = all_to_all_attention(q, k, v, group=dist.group.WORLD, token_index=idx, segment_ids=seg)
        same.append(torch.equal(y, plain))
    return gathered, same


def _windowed(rank, C):
    """The WINDOW_CASES through the ring and a2a; each einsum ring case counts its block calls
    (forward ``block_attention``, backward ``block_attention_backward``) by wrapping the ring's."""
    from megazero.context_parallel import ring

    results, calls = {}, {"forward": 0, "backward": 0}
    originals = ring.block_attention, ring.block_attention_backward

    def counted(kind, fn):
        def wrapper(*args):
            calls[kind] += 1
            return fn(*args)

        return wrapper

    ring.block_attention = counted("forward", originals[0])
    ring.block_attention_backward = counted("backward", originals[1])
    try:
        for i, (name, method, h, G, docs, kernel, window) in enumerate(WINDOW_CASES):
            calls.update(forward=0, backward=0)
            kw = dict(window=window) | ({"block_kernel": kernel} if method == "p2p" else {})
            full = _inputs(C, h, G, docs, seed=500 + i)
            run = _run_case(rank, C, dist.group.WORLD, list(range(C)), method, full, rank, **kw)
            results[name] = (*run, dict(calls))
    finally:
        ring.block_attention, ring.block_attention_backward = originals
    return results


def _rank_checks(rank, world, C):
    results = {}
    if C == 2:
        results["a2a shared"] = _shared_documents(rank, C)
        for i, (name, method, docs, kernel, dv) in enumerate(MLA_CASES):
            kw = {"block_kernel": kernel} if method == "p2p" else {}
            results[name] = _run_case(rank, C, dist.group.WORLD, [0, 1], method, _mla_inputs(i, docs, dv), rank, **kw)
    if C == 4:
        results["window"] = _windowed(rank, C)
    for i, (name, method, h, G, docs) in enumerate(_cases(C)):
        full = _inputs(C, h, G, docs, seed=100 * C + i)
        results[name] = _run_case(rank, C, dist.group.WORLD, list(range(C)), method, full, rank)
    q = torch.zeros(B, 4, 2 * CHUNK, D)
    k = torch.zeros(B, 1, 2 * CHUNK, D)
    try:
        all_to_all_attention(q, k, k, group=dist.group.WORLD, token_index=torch.arange(2 * CHUNK))
        results["a2a error"] = None
    except ValueError as e:
        results["a2a error"] = str(e)
    if C in (2, 4):
        for name, method, h, G, docs in _sink_cases(C):
            results[name] = _run_sinks(rank, C, method, _inputs(C, h, G, docs, seed=300 + C), _sinks(h))
    if world == 4:  # two cp groups of 2 inside 4 ranks: p2p peers are global ranks
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        cp_ranks = [0, 2] if rank % 2 == 0 else [1, 3]
        full = _inputs(2, 4, 2, True, seed=7)
        results["sub-group"] = _run_case(rank, 2, groups[rank % 2], cp_ranks, "p2p", full, cp_ranks.index(rank))
    return results


def _sink_cases(C: int):
    """Attention sinks at cp size C: the ring (G = 1 and all h heads) and the all-to-all, with documents."""
    h, groups = HEADS[C]
    return [(f"sinks p2p G={G}", "p2p", h, G, True) for G in (1, h)] + [(f"sinks a2a G={C}", "a2a", h, C, True)]


def _sinks(h: int) -> torch.Tensor:
    return torch.randn(h, generator=torch.Generator().manual_seed(5)) * 2


def _run_sinks(rank, C, method, full, sinks):
    """One rank's (y, dq, dk, dv, dsinks) of ``method`` with attention sinks."""
    q, k, v, dy, seg = (None if t is None else Z.split_for_rank(t, 2 if t.dim() == 4 else 1, rank, C) for t in full)
    q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    idx = Z.local_token_index(q.shape[2] * C, rank, C)
    kw = dict(group=dist.group.WORLD, token_index=idx, segment_ids=seg, sinks=sinks)
    if method == "p2p":
        y = ring_attention(q, k, v, cp_ranks=list(range(C)), **kw)
    else:
        y = all_to_all_attention(q, k, v, **kw)
    y.backward(dy)
    return y.detach(), q.grad, k.grad, v.grad, sinks.grad


def _sink_oracle(q, k, v, seg, dy, sinks):
    """Explicit float64 attention on the whole sequence with a sink column per head (dropped
    after the softmax, as transformers' gpt-oss): (y, dq, dk, dv, dsinks)."""
    q, k, v, sinks = (t.double().requires_grad_() for t in (q, k, v, sinks))
    B_, h, T, d = q.shape
    R = h // k.shape[1]
    scores = q @ k.repeat_interleave(R, dim=1).transpose(-1, -2) / d**0.5
    keep = torch.ones(T, T, dtype=torch.bool).tril() & (seg[:, :, None] == seg[:, None, :])
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    column = sinks.view(1, h, 1, 1).expand(B_, h, T, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :T]
    y = probs @ v.repeat_interleave(R, dim=1)
    y.backward(dy.double())
    return y, q.grad, k.grad, v.grad, sinks.grad


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref).abs().max() / ref.abs().max()).item()


def _compare(name, parts, full, C):
    """Merge the ranks' (y, dq, dk, dv) and compare with the oracle on the whole sequence."""
    q, k, v, dy, seg = full
    expected = _oracle(q, k, v, seg, dy)
    for what, j in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        got = Z.merge_from_ranks([p[j] for p in parts], 2, C)
        assert torch.isfinite(got).all(), f"{name}: {what} has NaN/inf"
        err = _relative_error(got, expected[j])
        assert err <= TOL, f"{name}: {what} relative error {err:.2e} > {TOL}"


def _theory(method, h, G, docs, C, dv=None):
    Tl = 2 * CHUNK
    if method == "p2p":
        return ring_bytes_per_layer(B, G, Tl, D, 4, C, documents=docs, d_v=dv)
    return a2a_bytes_per_layer(B, h, G, Tl, D, 4, C, documents=docs, d_v=dv)


@pytest.mark.parametrize("C", [2, 3, 4])
def test_cp_attention_equals_full_sdpa(C):
    out = run_distributed(_rank_checks, C, C, timeout_s=120)
    for i, (name, method, h, G, docs) in enumerate(_cases(C)):
        full = _inputs(C, h, G, docs, seed=100 * C + i)
        _compare(name, [out[r][name][0] for r in range(C)], full, C)
        theory = _theory(method, h, G, docs, C)
        for r in range(C):
            _, forward, backward = out[r][name]
            assert forward == theory.forward, f"{name} rank {r}: forward bytes {forward}"
            assert backward == theory.backward, f"{name} rank {r}: backward bytes {backward}"
    error = out[0]["a2a error"]
    if C == 2:
        assert "--cp-comm-type a2a" in error and "G = 1" in error and "C = 2" in error
        for r in range(C):  # the document ids of a micro-batch are gathered at its first layer only
            assert out[r]["a2a shared"] == ([B * 2 * CHUNK * 8, 0], [True, True])
        for i, (name, method, docs, _, dv) in enumerate(MLA_CASES):  # d_v != d: out [B, h, T, d_v]
            _compare(name, [out[r][name][0] for r in range(C)], _mla_inputs(i, docs, dv), C)
            theory = _theory(method, 4, 4, docs, C, dv)
            assert all(out[r][name][1:] == (theory.forward, theory.backward) for r in range(C)), name
    if C in (2, 4):  # attention sinks: out and every gradient, the sinks' summed over the cp ranks
        for name, method, h, G, docs in _sink_cases(C):
            full = _inputs(C, h, G, docs, seed=300 + C)
            expected = _sink_oracle(*full[:3], full[4], full[3], _sinks(h))
            for what, j in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
                got = Z.merge_from_ranks([out[r][name][j] for r in range(C)], 2, C)
                assert _relative_error(got, expected[j]) <= TOL, f"{name}: {what}"
            dsinks = sum(out[r][name][4] for r in range(C))
            assert _relative_error(dsinks, expected[4]) <= TOL, f"{name}: dsinks {dsinks} vs {expected[4]}"
            assert expected[4].abs().min() > 1e-3  # every head's sink moves the loss
    if C == 4:
        _check_windowed([out[r]["window"] for r in range(C)], C)
        sub = [out[r]["sub-group"] for r in range(4)]
        full = _inputs(2, 4, 2, True, seed=7)
        for ranks in ([0, 2], [1, 3]):
            _compare(f"sub-group {ranks}", [sub[r][0] for r in ranks], full, 2)


WINDOW = 6  # sliding window W: at CHUNK 4 a query chunk reaches 2 key chunks back, partly
WINDOW_CASES = [  # (name, method, h, G, documents, ring block kernel, window)
    ("p2p window G=2", "p2p", 8, 2, False, "einsum", WINDOW),
    ("p2p window G=2 docs", "p2p", 8, 2, True, "einsum", WINDOW),
    ("p2p window G=4 docs fused", "p2p", 8, 4, True, "auto", WINDOW),
    # a window of 3 inside a chunk of 4: the diagonal blocks too need the mask, not is_causal
    ("p2p window 3 G=2 fused", "p2p", 8, 2, False, "auto", 3),
    ("a2a window G=4 docs", "a2a", 8, 4, True, None, WINDOW),
]
# blocks each rank computes at C 4 with W 6: query chunk c (positions 4c .. 4c+3) meets key
# chunks c-2 .. c (4c - (4(c-3) + 3) = 9 >= 6 puts c-3 and earlier wholly outside); rank r holds
# chunks r and 7-r, so min(r, 2) + 1 + 3 blocks, against 2C+1 = 9 without the window
WINDOW_BLOCKS = [4, 5, 6, 6]


def _check_windowed(per_rank, C):
    """Windowed ring and a2a equal the float64 windowed oracle (forward and gradients), the bytes
    are the unwindowed formula's (K/V still go round), and the einsum ring computes WINDOW_BLOCKS
    blocks forward and backward (none of the skipped ones)."""
    for i, (name, method, h, G, docs, kernel, window) in enumerate(WINDOW_CASES):
        full = _inputs(C, h, G, docs, seed=500 + i)
        q, k, v, dy, seg = full
        expected = _oracle(q, k, v, seg, dy, window=window)
        for what, j in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
            got = Z.merge_from_ranks([p[name][0][j] for p in per_rank], 2, C)
            err = _relative_error(got, expected[j])
            assert err <= TOL, f"{name}: {what} relative error {err:.2e} > {TOL}"
        theory = _theory(method, h, G, docs, C)
        for r, p in enumerate(per_rank):
            assert (p[name][1], p[name][2]) == (theory.forward, theory.backward), f"{name} rank {r} bytes"
            if kernel == "einsum":
                assert p[name][3] == {"forward": WINDOW_BLOCKS[r], "backward": WINDOW_BLOCKS[r]}, f"{name} rank {r}"


def test_window_plan_skips_blocks_out_of_reach():
    """``zigzag.window_overlap`` against the positions themselves: OUTSIDE exactly when no (query,
    key) pair of the two chunks is within the window, INSIDE exactly when every pair is."""
    n = CHUNK
    for W in (1, 3, 4, 6, 9, 100):
        for qc in range(8):
            for kc in range(qc + 1):
                gaps = [(qc * n + a) - (kc * n + b) for a in range(n) for b in range(n)]
                got = Z.window_overlap(qc, kc, n, W)
                if all(g >= W for g in gaps):
                    assert got == Z.OUTSIDE
                elif all(g < W for g in gaps):
                    assert got == Z.INSIDE
                else:
                    assert got == Z.PARTIAL
    assert Z.window_overlap(7, 0, n, None) == Z.INSIDE


def test_documents_make_fully_masked_block_rows():
    """Every case's documents start one at token CHUNK, so in the full block (q chunk 1, kv
    chunk 0), which some rank computes at every C, a query row sees no key: the distributed
    tests go through the -inf path of ``block_attention`` and ``merge_partials``."""
    n = CHUNK
    for C in (2, 3, 4):
        assert any(p[1:3] == (1, 0) for r in range(C) for p in Z.block_pairs(r, C))
        T = 2 * C * n
        seg, pos = _segments(T, seed=C), torch.arange(T)
        mask = block_mask(pos[n : 2 * n], pos[:n], seg[:, n : 2 * n], seg[:, :n], causal=False)
        assert (~mask.any(-1)).any()


# -- cp = 1 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("docs", [False, True])
def test_group_size_one_is_plain_attention(G, docs):
    q, k, v, dy, seg = _inputs(1, 4, G, docs, seed=G)
    T = q.shape[2]
    expected = _oracle(q, k, v, seg, dy)[0]
    for y in (
        ring_attention(q, k, v, group=None, cp_ranks=[0], token_index=torch.arange(T), segment_ids=seg),
        all_to_all_attention(q, k, v, group=None, token_index=torch.arange(T), segment_ids=seg),
        local_attention(q, k, v, token_index=torch.arange(T), segment_ids=seg),
    ):
        assert _relative_error(y, expected) <= TOL


def test_row_tiles_give_the_one_pass_result(monkeypatch):
    """Blocks run in row tiles of SCORE_TILE_BYTES of scores: with tiles of 3 rows (and a
    document mask with empty rows) forward and backward equal the one-tile pass to fp64 rounding."""
    from megazero.context_parallel import blockwise as bw

    g = torch.Generator().manual_seed(3)
    B, G, R, Tq, Tk, d = 2, 2, 2, 10, 7, 4
    q = torch.randn(B, G, R, Tq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, G, Tk, d, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(B, G, R, Tq, d, generator=g, dtype=torch.float64)
    mask = torch.rand(B, Tq, Tk, generator=g) < 0.6
    mask[:, 4] = False  # an empty row
    whole = bw.block_attention(q, k, v, mask, 0.5)
    delta = (do * whole[0]).sum(-1)
    whole_grads = bw.block_attention_backward(q, k, v, do, delta, whole[1], mask, 0.5)
    assert bw.tile_rows(B, G * R, Tq, Tk, 8) == Tq  # the default budget: one tile here
    monkeypatch.setattr(bw, "SCORE_TILE_BYTES", B * G * R * Tk * 8 * 3)
    assert len(bw.score_tiles(q, Tk)) == 4  # 3 + 3 + 3 + 1 rows
    tiled = bw.block_attention(q, k, v, mask, 0.5)
    tiled_grads = bw.block_attention_backward(q, k, v, do, delta, tiled[1], mask, 0.5)
    for a, b in zip((*whole, *whole_grads), (*tiled, *tiled_grads)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert torch.isfinite(a.nan_to_num(neginf=0)).all()
