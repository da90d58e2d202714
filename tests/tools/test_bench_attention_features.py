"""scripts/bench/bench_attention_features.py at tiny shapes: one line per variant in the documented
format, every variant timed in every round, and causal's ratio 1.00."""

import re

from scripts.bench.bench_attention_features import main


def test_bench_prints_every_variant_with_its_ratio(capsys):
    argv = ["--batch", "1", "--heads", "4", "--groups", "2", "--seq", "32", "--head-dim", "8", "--window", "8"]
    assert main(argv + ["--rounds", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("attention core fwd+bwd, B 1, heads 4 (kv 2), T 32, d 8, window 8, fp32, median of 3")
    rows = {line.split()[0]: line for line in out[2:]}
    assert list(rows) == ["causal", "window", "sinks", "sinks-explicit", "sinks+window"]
    row = re.compile(r"^\S+\s+[\d.]+\s+[\d.]+-[\d.]+\s+[\d.]+$")
    assert all(row.match(line) for line in rows.values()), out
    assert rows["causal"].split()[-1] == "1.00"
