"""User tools and benchmarks: plan, generate, evaluate, and the bench_* measurements."""
