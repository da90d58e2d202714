"""Multi-rank equivalence: every layout on gloo ranks against the single-process oracle (tests.support.reference)."""
