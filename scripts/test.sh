#!/usr/bin/env bash
# Runs the test suite (CPU, gloo ranks on loopback) in two lanes:
#   quick: ruff (lint and format check) and every test not marked slow;
#   slow:  the tests marked slow (multi-rank sweeps, real launches).
# `bash scripts/test.sh` runs the quick lane, then (only if it passed) the slow one.
# `bash scripts/test.sh --lane quick|slow [pytest args]` runs one lane; any other arguments go to
# pytest as they are, e.g. `bash scripts/test.sh tests/layouts/test_train.py -k tp2`.
set -euo pipefail
if [ "${1:-}" = "--lane" ]; then  # a bad lane is refused before anything is set up
  case "${2:-}" in
    quick | slow) ;;
    *) echo "megazero: --lane ${2:-(none)} is not a lane; fix: --lane quick or --lane slow" >&2; exit 2 ;;
  esac
fi
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEGAZERO_ROOT"
# The optional extras the tests exercise (Hugging Face interchange, W&B, data formats,
# lm-evaluation-harness) and the linter. They are installed when missing; where that is impossible
# (no index) their tests skip, except under CI=true, where tests/support/extras.py turns such a
# skip into a failure.
if ! "$PY" -c "import transformers, safetensors, tokenizers, wandb, pyarrow, zstandard, datasets, lm_eval, accelerate, ruff" \
    >/dev/null 2>&1; then
  if _index_reachable "$PY"; then
    echo "[megazero] installing the optional extras hf, wandb, data and eval for their tests" >&2
    "$PY" -m pip install -q -e "$MEGAZERO_ROOT[dev,hf,wandb,data,eval]" \
      || echo "[megazero] could not install the extras hf/wandb/data/eval: their tests will skip" >&2
  else
    echo "[megazero] no package index answers: the extras hf/wandb/data/eval are not installed, their tests will skip" >&2
  fi
fi

lint() {
  if ! "$PY" -m ruff --version >/dev/null 2>&1; then
    echo "[megazero] ruff is not installed (pip install -e '.[dev]'): lint skipped" >&2
    [ "${CI:-}" != "true" ] || { echo "megazero: CI=true needs ruff for the quick lane" >&2; return 2; }
    return 0
  fi
  echo "[megazero] lint: ruff check, ruff format --check" >&2
  "$PY" -m ruff check . && "$PY" -m ruff format --check .
}

lane() {  # lane NAME [pytest args]
  local name=$1
  shift
  local start=$SECONDS rc=0
  case "$name" in
    quick) lint && "$PY" -m pytest -m "not slow" "$@" || rc=$? ;;
    slow) "$PY" -m pytest -m slow "$@" || rc=$? ;;
  esac
  echo "[megazero] lane $name: exit $rc after $((SECONDS - start)) s" >&2
  return "$rc"
}

if [ "${1:-}" = "--lane" ]; then
  name=$2
  shift 2
  lane "$name" "$@"
elif [ $# -gt 0 ]; then
  exec "$PY" -m pytest "$@"
else
  lane quick && lane slow
fi
