"""scripts/bench/bench_peers.py trains the same thing in every system: from identical weights and
batches, megazero ZeRO-0/1/2, DDP, ZeroRedundancyOptimizer and FSDP2 reach the same loss, and
the model-state bytes per rank follow the ZeRO accounting (16, 12 bytes per parameter...).
DeepSpeed and Megatron-core are not needed: the optional peers are switched off here, and
Megatron-core's weight layout is checked as a pure function of megazero's."""

import argparse
import math

import torch

from scripts.bench import bench_peers as B
from scripts.bench.bench_peers_optional import megatron_core_weights
from tests.support.distributed import run_distributed
from tests.support.paths import REPO

ARGS = dict(
    rounds=1,
    steps=2,
    layers=1,
    hidden=32,
    heads=2,
    seq=16,
    vocab=64,
    micro=2,
    accum=2,
    tp_layers=1,
    tp_hidden=32,
    tp_heads=2,
    tp_seq=16,
    tp_micro=2,
    tp_accum=2,
    optional=False,
    sync_param_gather=True,
    allocator="keep",
)


def test_every_system_trains_the_same_and_states_follow_zero():
    args = argparse.Namespace(**ARGS)
    names, skipped = B.systems_to_run(args)
    assert skipped == [
        "skipped deepspeed (--no-optional-peers): deepspeed-zero0 deepspeed-zero1 deepspeed-zero2",
        "skipped megatron-core (--no-optional-peers): megatron-core-tp2",
    ]
    assert names[:4] == ["floor", "megazero-zero0", "ddp", "megazero-zero1"]
    assert names[names.index("megazero-zero1") + 1] == "megazero-zero1-sync-gather"
    assert names[names.index("megazero-zero2") + 1] == "megazero-zero2-sync-gather"
    res = run_distributed(B.run_rank, 2, args, names, timeout_s=300)
    for out in res:
        # the parameter all-gather overlapped with the next forward or waited in the step:
        # the same bits (tests/layouts/test_param_gather_overlap.py checks every parameter)
        for stage in (1, 2):
            assert out[f"megazero-zero{stage}"]["loss"] == out[f"megazero-zero{stage}-sync-gather"]["loss"]
        # the floor runs forward and backward only: no collective, no update
        assert out["floor"]["comm"] == {}
        losses = {name: out[name]["loss"] for name in names if name not in ("megazero-tp2", "floor")}
        # every peer decays the matrices only, as megazero does (adamw_groups): one model
        for name, loss in losses.items():
            assert math.isclose(loss, losses["ddp"], rel_tol=1e-6), losses
        state = {name: out[name]["state"] for name in names}
        # ZeRO-0 and DDP: 4 (params) + 4 (grads) + 8 (Adam) bytes per parameter, up to padding
        assert math.isclose(state["megazero-zero0"], state["ddp"], rel_tol=1e-3), state
        assert state["megazero-zero1"] < state["megazero-zero0"]
        assert state["megazero-zero2"] < state["megazero-zero1"]
        assert math.isclose(state["megazero-zero1"] / state["megazero-zero0"], 12 / 16, rel_tol=1e-2)
        # tp 2: each rank holds about half of the same model's 16 bytes per parameter
        assert 0.5 < state["megazero-tp2"] / state["megazero-zero0"] < 0.6, state
    # both TP ranks trained on the same batches: one loss
    assert res[0]["megazero-tp2"]["loss"] == res[1]["megazero-tp2"]["loss"]
    # one tp2 step counted: Megatron's 4L + 2 all-reduces of [B, T, H] per micro-batch, the
    # cross-entropy's MAX [B, T] and SUM [3, B, T] per micro-batch, and the fp64 squared norm
    # once per step, which is also the inf/NaN check (scripts/bench/bench_comm.py, theory_tp)
    m, act, bt = 2, 4 * 2 * 16 * 32, 2 * 16
    assert res[0]["megazero-tp2"]["comm"] == {
        "all_reduce": [m * (4 * 1 + 2) + 2 * m + 1, m * (6 * act + 4 * 4 * bt) + 8]
    }
    lines = B.report(res, names, argparse.Namespace(**ARGS))
    assert "theory tp (Megatron): 12 all-reduces of [2, 16, 32] fp32 = 0.05 MB" in "\n".join(lines)
    assert [line for line in lines if line.startswith("ratio ")][-1].startswith("ratio megazero-zero2/fsdp2: ")
    assert lines[-1].startswith("overhead megazero-zero2/fsdp2: ")
    floor_lines = [line for line in lines if line.startswith("floor/")]
    assert [line.split(":")[0] for line in floor_lines] == [
        "floor/ddp",
        "floor/zero-redundancy-optimizer",
        "floor/fsdp2",
    ]
    assert "overhead over the floor megazero-zero0" in floor_lines[0]
    assert [line.split(":")[0] for line in lines if line.startswith("ratio") and "sync-gather:" in line] == [
        "ratio megazero-zero1/megazero-zero1-sync-gather",
        "ratio megazero-zero2/megazero-zero2-sync-gather",
    ]
    assert [line.split(":")[0] for line in lines if line.startswith("ratio ") and "sync-gather" not in line] == [
        "ratio megazero-zero0/ddp",
        "ratio megazero-zero1/zero-redundancy-optimizer",
        "ratio megazero-zero2/fsdp2",
    ]
    overheads = [line for line in lines if line.startswith("overhead ")]
    assert [line.split(":")[0] for line in overheads] == [
        "overhead megazero-zero0/ddp",
        "overhead megazero-zero1/zero-redundancy-optimizer",
        "overhead megazero-zero2/fsdp2",
    ]
    for line in overheads:
        value = line.split(": ")[1]
        assert value.startswith("n/a (") or float(value) == float(value), line


def test_peer_parameter_groups_are_megazeros():
    """adamw_groups decays exactly the parameters megazero's optimizer decays (tags.decays)."""
    from megazero import tags
    from megazero.process_groups import ProcessGroups
    from scripts.bench.bench_peers_optional import adamw_groups

    model = B.peer_model(argparse.Namespace(**ARGS), ProcessGroups.single())
    decay, rest = adamw_groups(model.parameters(), 0.1)
    assert (decay["weight_decay"], rest["weight_decay"]) == (0.1, 0.0)
    assert {id(p) for p in decay["params"]} == {id(p) for p in model.parameters() if tags.decays(p)}
    assert rest["params"] and {id(p) for p in rest["params"]} == {
        id(p) for p in model.parameters() if not tags.decays(p)
    }


def test_megatron_core_layout_interleaves_q_k_v_per_head():
    cfg = B.peer_gpt_config(argparse.Namespace(**ARGS))
    full = {}
    for n, shape in [
        ("embedding.word_embeddings.weight", (64, 32)),
        ("final_ln.weight", (32,)),
        ("embedding.position_embeddings.weight", (16, 32)),
        ("final_ln.bias", (32,)),
    ]:
        full[n] = torch.randn(shape)
    for name, shape in [
        ("ln1", (32,)),
        ("attn.qkv", (96, 32)),
        ("attn.proj", (32, 32)),
        ("ln2", (32,)),
        ("mlp.fc1", (128, 32)),
        ("mlp.fc2", (32, 128)),
    ]:
        full[f"layers.0.{name}.weight"] = torch.randn(shape)
        full[f"layers.0.{name}.bias"] = torch.randn(shape[0])
    out = megatron_core_weights(full, cfg)
    assert len(out) == len(full)
    d = cfg.head_dim  # 16: head h of Megatron's rows is [q_h; k_h; v_h]
    qkv, theirs = full["layers.0.attn.qkv.weight"], out["decoder.layers.0.self_attention.linear_qkv.weight"]
    for h in range(2):
        for j in range(3):
            row = (3 * h + j) * d
            assert torch.equal(theirs[row : row + d], qkv[j * 32 + h * d : j * 32 + (h + 1) * d])
    bias = out["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert torch.equal(bias[d : 2 * d], full["layers.0.attn.qkv.bias"][32 : 32 + d])  # k of head 0
    assert out["decoder.layers.0.mlp.linear_fc2.weight"] is full["layers.0.mlp.fc2.weight"]


def test_only_the_benchmark_imports_deepspeed_or_megatron():
    """The peers are benchmark-only: no module of megazero/, model/, data/, train.py or the
    tests imports them, and bench_peers_optional.py imports them only inside its runners."""
    import ast

    root = REPO
    files = [root / "train.py"] + [
        f for d in ("megazero", "model", "data", "tests", "scripts") for f in sorted((root / d).rglob("*.py"))
    ]
    for f in files:
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            peers = [n for n in names if n.split(".")[0] in ("deepspeed", "megatron")]
            if f.name == "bench_peers_optional.py":
                top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not (peers and node in top), f"{f}: module-level import of {peers}"
            else:
                assert not peers, f"{f} imports {peers}"
