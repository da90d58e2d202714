"""Checkpoints (docs/design.md, contract 4): resuming reproduces the uninterrupted run, under the
same layout bit for bit and under any other layout to summation-order rounding; writes are
atomic, and a broken checkpoint is an error that names it."""

import math
import os
import shutil

import pytest
import torch

from tests.support.checkpoint import ARGS, run_checkpointed
from tests.support.distributed import run_distributed
from tests.support.layouts import LLAMA


def run_checkpointed_jobs(rank, world, jobs):
    """Several ``run_checkpointed``s one after the other in one set of ranks (each builds its own process
    groups and Trainer): ``jobs`` = [(argv, steps, save, load)] -> their results, in order."""
    return [run_checkpointed(rank, world, argv, steps, save=save, load=load) for argv, steps, save, load in jobs]


MB4 = ["--micro-batch-size", "4"]
"""The 4-rank resume tests' micro-batch: 2 micro-batches per step at dp 2 (gradients still
accumulate, pp 2's 1F1B still has 2), not 4; a step's CPU time on gloo ranks is its collectives'
latency, one set per micro-batch. The global batch (16), and so the losses, are unchanged."""
LAYOUT_A = ["--tp", "2", "--dp", "2", "--zero-stage", "1"] + MB4
# buckets of 2,000 elements (parameters still straddle them; DCP costs ~10 ms of CPU per chunk)
LAYOUT_B = ["--pp", "2", "--dp", "2", "--zero-stage", "2", "--reduce-bucket-size", "2000"] + MB4


def test_resume_same_layout_is_bit_identical_and_other_layout_matches(tmp_path):
    ckpt = str(tmp_path)
    # one set of 4 ranks runs, in order: the uninterrupted run, the first half with a save,
    # and three resumes from that save (the same layout, another one, tp 4)
    whole, first, same, other, tp4 = run_distributed(
        run_checkpointed_jobs,
        4,
        [
            (ARGS + LAYOUT_A, 6, None, None),
            (ARGS + LAYOUT_A, 3, ckpt, None),
            (ARGS + LAYOUT_A, 3, None, ckpt),
            (ARGS + LAYOUT_B, 3, None, ckpt),
            (ARGS + ["--tp", "4", "--micro-batch-size", "8"], 3, None, ckpt),
        ],
        timeout_s=600,
    )[0]
    whole = whole[0]
    assert first[0] == whole[:3]
    assert open(tmp_path / "latest").read().strip() == "3"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "latest"]
    assert same[1] == 3 and same[2] == 6 * 16
    assert same[0] == whole[3:]  # bit for bit
    for got, want in zip(other[0], whole[3:]):
        assert math.isclose(got, want, rel_tol=1e-5), (got, want)
    # a tensor-parallel size with another vocabulary padding (1001 -> 1008 at tp 1, 1008 at tp 4)
    for got, want in zip(tp4[0], whole[3:]):
        assert math.isclose(got, want, rel_tol=1e-5), (got, want)


@pytest.mark.slow
def test_zero3_checkpoint_resumes_under_zero3_and_another_layout(tmp_path):
    """Saved under pp 2 x dp 2 ZeRO-3 (tied embeddings, parameters sharded): the same layout
    resumes bit for bit, tp 2 x dp 2 ZeRO-1 within 1e-5 relative."""
    # buckets of 2,000 elements (parameters still straddle them): a DCP save or load costs some
    # 10 ms of CPU per chunk, and ZeRO-3 cuts its shards per bucket
    z3, ckpt = ["--pp", "2", "--dp", "2", "--zero-stage", "3", "--reduce-bucket-size", "2000"] + MB4, str(tmp_path)
    whole, first, same, other = run_distributed(
        run_checkpointed_jobs,
        4,
        [
            (ARGS + z3, 6, None, None),
            (ARGS + z3, 3, ckpt, None),
            (ARGS + z3, 3, None, ckpt),
            (ARGS + LAYOUT_A, 3, None, ckpt),
        ],
        timeout_s=600,
    )[0]  # in order, in one set of ranks
    whole = whole[0]
    assert first[0] == whole[:3]
    assert same[0] == whole[3:]
    for got, want in zip(other[0], whole[3:]):
        assert math.isclose(got, want, rel_tol=1e-5), (got, want)


def test_interrupted_save_keeps_previous_checkpoint_and_errors_name_the_file(tmp_path):
    from megazero.checkpoint import CheckpointError, latest_iteration

    run_distributed(run_checkpointed, 2, ARGS + ["--dp", "2"], 2, save=str(tmp_path))
    os.makedirs(tmp_path / "iter_0000005.tmp")  # a save that died before its rename
    (tmp_path / "iter_0000005.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_iteration(str(tmp_path)) == 2
    resumed = run_distributed(run_checkpointed, 1, ARGS, 1, load=str(tmp_path))[0]
    assert resumed[1] == 2
    # the same iteration saved again (resume, no step, save) replaces it and leaves no old copy
    run_distributed(run_checkpointed, 1, ARGS, 0, save=str(tmp_path), load=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000005.tmp", "latest"]
    assert run_distributed(run_checkpointed, 1, ARGS, 1, load=str(tmp_path))[0][0] == resumed[0]
    (tmp_path / "latest").write_text("7\n")
    with pytest.raises(CheckpointError, match="iteration 7 but .*iter_0000007 is missing"):
        latest_iteration(str(tmp_path))
    for bad in ("-5\n", "two\n"):
        (tmp_path / "latest").write_text(bad)
        with pytest.raises(CheckpointError, match="latest does not hold an iteration number"):
            latest_iteration(str(tmp_path))
    os.remove(tmp_path / "latest")
    os.makedirs(tmp_path / "latest")  # a directory where the pointer file belongs
    with pytest.raises(CheckpointError, match="latest does not hold an iteration number"):
        latest_iteration(str(tmp_path))
    os.rmdir(tmp_path / "latest")
    with pytest.raises(CheckpointError, match=r"holds checkpoints \[2\] but no 'latest' file"):
        latest_iteration(str(tmp_path))  # never a silent fresh start beside saved iterations
    with pytest.raises(CheckpointError, match="is one iteration inside a checkpoint directory; fix: --load"):
        latest_iteration(str(tmp_path / "iter_0000002"))
    (tmp_path / "latest").write_text("2\n")
    from megazero.checkpoint import peek
    from tests.support.distributed import RankError

    d = tmp_path / "iter_0000002"
    rng = (d / "rng_0.pt").read_bytes()
    (d / "rng_0.pt").write_bytes(rng[: len(rng) // 2])  # a damaged RNG file
    with pytest.raises(CheckpointError, match=f"rng_0.pt has size {len(rng) // 2}, saved as size {len(rng)}"):
        peek(str(tmp_path))
    (d / "rng_0.pt").write_bytes(rng)
    files = sorted(f for f in os.listdir(d) if f.endswith(".distcp"))
    data = (d / files[0]).read_bytes()
    (d / files[0]).write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match=f"{files[0]} has {len(data) // 2} bytes, the metadata needs"):
        peek(str(tmp_path))
    (d / files[0]).write_bytes(b"\0" * len(data))  # same size, garbage: only the checksum finds it
    assert peek(str(tmp_path))["iteration"] == 2
    with pytest.raises(CheckpointError, match=f"{files[0]} has size {len(data)} and CRC-32 .* saved as"):
        peek(str(tmp_path), verify=True)  # what the launcher's preflight runs
    with pytest.raises(RankError, match="reading the tensors failed"):
        run_distributed(run_checkpointed, 1, ARGS, 1, load=str(tmp_path))
    os.remove(d / files[0])
    with pytest.raises(RankError, match=f"{files[0]} is missing"):  # found by checkpoint.peek too
        run_distributed(run_checkpointed, 1, ARGS, 1, load=str(tmp_path))


def test_llama_block_resumes_under_another_layout(tmp_path):
    """The LLaMA-style block's checkpoint (spec names: no position table, no biases, grouped
    QKV rows) saved under tp 2 x dp 2 resumes under pp 2 x dp 2 as the uninterrupted run."""
    args, ckpt = ARGS + LLAMA, str(tmp_path)
    whole, _, other = run_distributed(
        run_checkpointed_jobs,
        4,
        [(args + LAYOUT_A, 6, None, None), (args + LAYOUT_A, 3, ckpt, None), (args + LAYOUT_B, 3, None, ckpt)],
        timeout_s=600,
    )[0]  # in order, in one set of ranks
    whole = whole[0]
    assert other[1] == 3
    for got, want in zip(other[0], whole[3:]):
        assert math.isclose(got, want, rel_tol=1e-5), (got, want)


def test_checkpoint_problems_stop_before_any_rank_starts(tmp_path, capsys):
    """A checkpoint of another model, or a broken one, is refused by the launcher's preflight
    (exit code 2, one line naming the setting or the file); a resume with another global batch
    size continues past the end of the shorter run's sample count."""
    from megazero import training

    run_distributed(run_checkpointed, 1, ARGS, 3, save=str(tmp_path))
    assert training.preflight(ARGS + ["--load", str(tmp_path)], 1) == 0
    assert "warning" not in capsys.readouterr().err
    # settings a resume cannot honour are warned about, naming both values
    shorter = [a if a != "6" else "3" for a in ARGS] + [
        "--load",
        str(tmp_path),
        "--seed",
        "8",
        "--lr-warmup-iters",
        "1",
    ]
    assert training.preflight(shorter, 1) == 0
    err = capsys.readouterr().err
    assert "at iteration 3, not below --train-iters 3: nothing to train" in err
    assert "was trained with seed = 7, this run has 8" in err
    assert training.preflight(ARGS + ["--load", str(tmp_path), "--num-layers", "2"], 1) == 2
    assert "num_layers = 4, this model 2" in capsys.readouterr().err
    assert training.preflight(ARGS + ["--load", str(tmp_path), "--untie-embeddings-and-output-weights"], 1) == 2
    assert "tie_embeddings" in capsys.readouterr().err
    assert training.preflight(ARGS + ["--load", str(tmp_path), "--normalization", "RMSNorm"], 1) == 2
    assert "normalization = LayerNorm, this model RMSNorm" in capsys.readouterr().err
    smaller = [a if a != "16" or i == 0 or ARGS[i - 1] != "--global-batch-size" else "8" for i, a in enumerate(ARGS)]
    resumed = run_distributed(run_checkpointed, 1, smaller, 3, load=str(tmp_path))[0]  # 48 + 3 x 8 samples
    assert resumed[2] == 3 * 16 + 3 * 8 and all(math.isfinite(x) for x in resumed[0])
    meta = tmp_path / "iter_0000003" / "meta.pt"
    meta.write_bytes(meta.read_bytes()[:40])
    assert training.preflight(ARGS + ["--load", str(tmp_path)], 1) == 2
    assert "meta.pt is unreadable" in capsys.readouterr().err


def _resumed_rng(rank, world, argv, load):
    """What ``load_checkpoint`` prints on this rank and the dropout tracker it leaves."""
    import contextlib
    import io

    from megazero import training
    from megazero.config import config_from_argv
    from megazero.training import build_trainer

    cfg = config_from_argv(argv + ["--load", load], world)
    trainer = build_trainer(cfg, data=training.prepare_run(cfg))
    built_seed = trainer.chunks[0].rng_tracker.seed
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.load_checkpoint(load)
    return out.getvalue(), built_seed, trainer.chunks[0].rng_tracker.get_state()


def test_every_rng_file_is_checked_before_any_rank_starts(tmp_path, capsys):
    """Each rank's rng_<rank>.pt missing, truncated or from another run is a checkpoint error
    naming it in the launcher's preflight (exit code 2); a resume under another layout
    re-seeds every rank by ``resume_seed`` and says so once."""
    from megazero import training
    from megazero.tensor_parallel.random import RNGTracker, resume_seed

    args = ARGS + ["--dp", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    run_distributed(run_checkpointed, 2, args, 2, save=str(tmp_path / "a"))
    run_distributed(run_checkpointed, 2, args + ["--seed", "8"], 2, save=str(tmp_path / "b"))  # another run
    d, other = tmp_path / "a" / "iter_0000002", tmp_path / "b" / "iter_0000002"
    load = args + ["--load", str(tmp_path / "a")]
    assert training.preflight(load, 2) == 0
    capsys.readouterr()
    for rank in (0, 1):
        name = f"rng_{rank}.pt"
        good, foreign = (d / name).read_bytes(), (other / name).read_bytes()
        assert foreign != good
        for kind, damaged in (("missing", None), ("truncated", good[:-7]), ("another run", foreign)):
            os.remove(d / name)
            if damaged is not None:
                (d / name).write_bytes(damaged)
            assert training.preflight(load, 2) == 2, (name, kind)
            err = capsys.readouterr().err
            assert err.startswith(f"megazero: checkpoint error: {d / name} "), (kind, err)
            assert err.count("\n") == 1
            (d / name).write_bytes(good)
    assert training.preflight(load, 2) == 0
    results = run_distributed(_resumed_rng, 2, ARGS + ["--tp", "2", "--hidden-dropout", "0.1"], str(tmp_path / "a"))
    assert results[1][0] == "" and results[0][0].count("\n") == 1
    assert "saved under another layout" in results[0][0] and "re-seeded" in results[0][0]
    for tp_rank, (_, built_seed, state) in enumerate(results):
        want = RNGTracker(resume_seed(built_seed, 2), tp_rank).get_state()
        for region in ("replicated", "tp"):
            assert torch.equal(state[region], want[region]), (tp_rank, region)
    assert torch.equal(results[0][2]["replicated"], results[1][2]["replicated"])  # TP-replicated
    assert not torch.equal(results[0][2]["replicated"], RNGTracker(built_seed, 0).get_state()["replicated"])


def _resumed_rng_each(rank, world, argv, loads):
    """``_resumed_rng`` for each checkpoint root of ``loads``, one after the other."""
    return [_resumed_rng(rank, world, argv, load) for load in loads]


def test_rng_states_of_another_device_type_reseed_on_resume(tmp_path):
    """A checkpoint whose dropout streams were drawn on CUDA (Philox: 16-byte generator
    states, as ``torch.cuda.get_rng_state`` returns) resumed on CPU under the same layout:
    the states are not set (a CPU generator's is 5056 bytes), every stream is re-seeded by
    ``resume_seed`` as under another layout, and rank 0 says so in one line. Both the
    recorded device type and, for a state saved without it, the states' size are read."""
    from megazero import training
    from megazero.checkpoint import file_checksum
    from megazero.tensor_parallel.random import RNGTracker, resume_seed

    args = ARGS + ["--hidden-dropout", "0.1"]
    run_distributed(run_checkpointed, 1, args, 2, save=str(tmp_path / "recorded"))
    shutil.copytree(tmp_path / "recorded", tmp_path / "unrecorded")
    for root in ("recorded", "unrecorded"):
        d = tmp_path / root / "iter_0000002"
        state = torch.load(d / "rng_0.pt", weights_only=False)
        assert state["replicated"].numel() == 5056  # drawn on CPU
        state.update(replicated=torch.arange(16, dtype=torch.uint8), tp=torch.arange(16, 32, dtype=torch.uint8))
        state.pop("device", None)
        if root == "recorded":
            state["device"] = "cuda"
        torch.save(state, d / "rng_0.pt")
        meta = torch.load(d / "meta.pt", weights_only=False)
        meta["files"]["rng_0.pt"] = file_checksum(str(d / "rng_0.pt"))
        torch.save(meta, d / "meta.pt")
        assert training.preflight(args + ["--load", str(tmp_path / root)], 1) == 0
    got = run_distributed(_resumed_rng_each, 1, args, [str(tmp_path / "recorded"), str(tmp_path / "unrecorded")])[0]
    for (printed, built_seed, state), drawn in zip(got, ("cuda", "another device type")):
        assert printed.count("\n") == 1 and f"with dropout streams drawn on {drawn}, this run draws on cpu" in printed
        assert "re-seeded from --seed and iteration 2" in printed
        want = RNGTracker(resume_seed(built_seed, 2), 0).get_state()
        assert state["device"] == "cpu"
        for region in ("replicated", "tp"):
            assert torch.equal(state[region], want[region]), region
    with pytest.raises(ValueError, match="RNG state was drawn on cuda, this tracker draws on cpu"):
        RNGTracker(1, 0).set_state(dict(want, device="cuda"))


def test_prune_keeps_the_newest_and_never_a_later_one(tmp_path):
    from megazero.checkpoint import iteration_dir, prune, saved_iterations

    for it in (1, 2, 3, 4, 5, 9):
        os.makedirs(iteration_dir(str(tmp_path), it))
    os.makedirs(tmp_path / "iter_0000006.tmp")  # an unfinished save is not a checkpoint
    assert prune(str(tmp_path), 0, 5) == [] and saved_iterations(str(tmp_path)) == [1, 2, 3, 4, 5, 9]
    assert prune(str(tmp_path), 2, 5) == [1, 2, 3]
    assert saved_iterations(str(tmp_path)) == [4, 5, 9]
    assert prune(str(tmp_path), 1, 5) == [4] and saved_iterations(str(tmp_path)) == [5, 9]


def test_memory_plan_refuses_model_states_that_cannot_fit(capsys, monkeypatch):
    """A position table of 4e8 rows needs about 200 GB of model states per rank: refused
    before launch naming the fix; the plan's model states follow the ZeRO formulas."""
    from megazero import training
    from megazero.config import config_from_argv
    from megazero.planning import memory
    from megazero.planning.plan import plan_memory
    from model.build import build_gpt_config

    def plan(argv, world, vocab):
        cfg = config_from_argv(argv, world)
        return plan_memory(cfg, build_gpt_config(cfg, vocab))

    monkeypatch.setenv("MEGAZERO_RANKS_PER_NODE", "1")
    assert training.preflight(ARGS, 1) == 0
    assert "memory per rank (pipeline stage 0): model states" in capsys.readouterr().out
    huge = ARGS + ["--max-position-embeddings", "400000000"]
    assert training.preflight(huge, 1) == 2
    err = capsys.readouterr().err
    assert err.startswith("megazero: memory error: the model states of one rank of pipeline stage 0 need")
    assert "--zero-stage 2" in err and "larger --dp" not in err  # ZeRO-0: more ranks alone do not help
    plans = {z: plan(ARGS + ["--dp", "4", "--zero-stage", str(z)], 4, 1001) for z in (0, 2, 3)}
    psi = plans[0].params
    assert plans[0].model_state_bytes == 16 * psi  # fp32 params (= main params), grads, 2 moments
    assert plans[2].model_state_bytes == 4 * psi + 12 * psi / 4
    assert plans[3].model_state_bytes == 16 * psi / 4  # (p + g + K) Psi / N
    with pytest.raises(memory.MemoryPlanError, match="--zero-stage 3"):
        memory.check_fits(plans[2], int(plans[2].model_state_bytes) - 1)
    with pytest.raises(memory.MemoryPlanError):
        memory.check_fits(plans[0], int(plans[0].model_state_bytes) - 1)
    assert "activations may not fit" in memory.check_fits(plans[0], int(plans[0].model_state_bytes) + 1)
    assert memory.check_fits(plans[0], int(plans[0].total_bytes) + 1) is None
    # pp 2: stage 1 has the larger total (the logits), stage 0 the larger states (a long
    # position table): the states of stage 0 decide whether the run can start
    pp2 = plan(ARGS + ["--pp", "2", "--max-position-embeddings", "40000", "--micro-batch-size", "8"], 2, 50000)
    assert (pp2.stage, pp2.most_states.stage) == (1, 0)
    assert pp2.most_states.model_state_bytes > pp2.model_state_bytes
    with pytest.raises(memory.MemoryPlanError, match="stage 0 need"):
        memory.check_fits(pp2, int(pp2.most_states.model_state_bytes) - 1)
    # the in-flight counts simulated with at most 4 pp micro-batches equal the full simulation
    from megazero.pipeline.schedules import build_schedule, simulate

    for kind, vp in (("1f1b", 1), ("interleaved", 2)):
        full = simulate([build_schedule(kind, 64, 4, r, vp) for r in range(4)], 4, vp).peak_inflight
        assert memory.inflight_per_stage(kind, 4, vp, 64) == full
    assert (
        memory.inflight_per_stage("gpipe", 4, 1, 64)
        == [64] * 4
        == simulate([build_schedule("gpipe", 64, 4, r, 1) for r in range(4)], 4, 1).peak_inflight
    )
