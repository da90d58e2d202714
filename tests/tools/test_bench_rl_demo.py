"""scripts/bench/bench_rl_demo.py: the curve read from a metrics file and the demo's verdict, and a
``--post-train grpo`` run in one process logs the curve it reads, starting at iteration 0 (the
policy before any update)."""

import json

import pytest

from scripts.bench import bench_rl_demo
from tests.support.rl import write_prompts


def _write(path, rows, extra=()):
    recs = [*extra]
    recs += [
        {"kind": "valid", "iteration": it, "sampled_reward": s, "greedy_reward": g, "sampled_length": n}
        for it, s, g, n in rows
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_curve_skips_other_records_and_a_later_record_replaces_an_earlier(tmp_path):
    other = [{"kind": "train", "iteration": 1, "loss": 0.1}, {"kind": "valid", "iteration": 5, "loss": 2.0}]
    path = _write(tmp_path / "m.jsonl", [(10, 0.6, 0.9, 5.0), (0, 0.4, 0.9, 5.0), (10, 0.7, 0.95, 5.5)], other)
    assert bench_rl_demo.read_curve(path) == [
        bench_rl_demo.Point(0, 0.4, 0.9, 5.0),
        bench_rl_demo.Point(10, 0.7, 0.95, 5.5),
    ]


@pytest.mark.parametrize(
    "rows, passed",
    [
        ([(0, 0.40, 0.90, 5.0), (20, 0.50, 0.80, 5.0), (40, 0.61, 0.90, 5.9)], True),
        ([(0, 0.40, 0.90, 5.0), (40, 0.59, 0.95, 5.0)], False),  # rise below 0.2
        ([(0, 0.40, 0.90, 5.0), (40, 0.70, 0.89, 5.0)], False),  # greedy fell
        ([(0, 0.40, 0.90, 5.0), (20, 0.5, 0.9, 3.9), (40, 0.70, 0.95, 5.0)], False),  # length -22 % on the way
        ([(0, 0.40, 0.90, 5.0), (40, 0.70, 0.95, 5.0), (50, 0.1, 0.1, 9.0)], True),  # past --steps: not compared
    ],
)
def test_verdict(tmp_path, rows, passed, capsys):
    path = _write(tmp_path / "m.jsonl", rows)
    verdict = bench_rl_demo.judge(bench_rl_demo.read_curve(path))
    assert verdict.passed is passed and verdict.end == 40
    assert bench_rl_demo.main(["--metrics", path]) == (0 if passed else 1)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| iteration |") and out[-1].startswith("PASS" if passed else "FAIL")
    assert f"rise {verdict.rise:+.3f}" in out[-1] and f"greedy change {verdict.greedy_change:+.3f}" in out[-1]


def test_no_start_is_exit_2(tmp_path, capsys):
    assert bench_rl_demo.main(["--metrics", _write(tmp_path / "m.jsonl", [(5, 0.4, 0.9, 5.0)])]) == 2
    assert "iteration 0" in capsys.readouterr().err


def test_a_grpo_run_logs_the_curve_from_iteration_0(tmp_path):
    """Two iterations of a tiny GRPO run validating every iteration: the held-out records at
    iterations 0, 1 and 2, the accuracies in [0, 1], lengths within --max-new-tokens."""
    from megazero import training

    tok, prefix = write_prompts(tmp_path, count=24)
    run = tmp_path / "run"
    argv = (
        "--post-train grpo --tokenizer-type HuggingFaceTokenizer --num-layers 1 --hidden-size 16 "
        "--num-attention-heads 2 --seq-length 48 --micro-batch-size 4 --global-batch-size 8 "
        "--grpo-prompts-per-step 4 --grpo-group-size 2 --max-new-tokens 4 --train-iters 2 --split 16,8,0 "
        "--eval-iters 1 --eval-interval 1 --device cpu --make-vocab-size-divisible-by 8"
    ).split()
    argv += ["--data-path", prefix, "--tokenizer-model", tok, "--run-dir", str(run)]
    assert training.main(argv) == 0
    curve = bench_rl_demo.read_curve(str(run / "metrics.jsonl"))
    assert [p.iteration for p in curve] == [0, 1, 2]
    assert all(0 <= p.sampled <= 1 and 0 <= p.greedy <= 1 and 0 < p.length <= 4 for p in curve)
