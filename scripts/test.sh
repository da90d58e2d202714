#!/usr/bin/env bash
# Runs the test suite (CPU, gloo ranks on loopback). Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not slow"` for the quick inner loop.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEGAZERO_ROOT"
# The optional extras the tests exercise (Hugging Face interchange, W&B, data formats,
# lm-evaluation-harness). They are installed when missing; where that is impossible (no index)
# their tests skip, except under CI=true, where tests/support/extras.py turns such a skip into a failure.
if ! "$PY" -c "import transformers, safetensors, tokenizers, wandb, pyarrow, zstandard, datasets, lm_eval, accelerate" >/dev/null 2>&1; then
  echo "[megazero] installing the optional extras hf, wandb, data and eval for their tests" >&2
  "$PY" -m pip install -q -e "$MEGAZERO_ROOT[dev,hf,wandb,data,eval]" \
    || echo "[megazero] could not install the extras hf/wandb/data/eval: their tests will skip" >&2
fi
exec "$PY" -m pytest "$@"
