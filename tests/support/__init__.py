"""What tests (and benchmarks) share: the gloo rank runner (distributed), the plain
single-process GPT oracle (reference), optional-extra checks (extras), paths, fixture files, and
the helpers of each test family (layouts, zero, moe, checkpoint, hf_*, launch, ...). A test
module imports helpers only from here, never from another test module (tests/unit/test_dependencies.py)."""
