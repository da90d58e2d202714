#!/usr/bin/env bash
# Runs the test suite (CPU, gloo ranks on loopback) in two lanes:
#   quick: ruff (lint and format check) and every test not marked slow;
#   slow:  the tests marked slow (multi-rank sweeps, real launches), as MEGAZERO_TEST_SHARDS (default 2)
#          pytest processes side by side, each on its own test files (tests/support/shards.py) and its
#          own block of rendezvous ports (tests/support/ports.py); MEGAZERO_TEST_SHARDS=1 runs it as one.
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
SHARDS=${MEGAZERO_TEST_SHARDS:-2}
if ! [[ "$SHARDS" =~ ^[1-8]$ ]]; then
  echo "megazero: MEGAZERO_TEST_SHARDS=$SHARDS is not a shard count; fix: a whole number from 1 to 8 (1 runs the slow lane as one pytest process)" >&2
  exit 2
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

# The slow lane as $SHARDS pytest processes side by side: shard I of N keeps its own test files
# (MEGAZERO_TEST_SHARD=I/N, read by tests/conftest.py), draws its rendezvous ports from its own Nth
# of 10000-19999 (MEGAZERO_TEST_PORTS), so no two shards meet on a port, and writes its output to its
# own log, printed when the shard ends. The lane fails when a shard fails.
slow_shards() {  # slow_shards [pytest args]
  local logs i first span=$((10000 / SHARDS)) rc=0 empty=0 left=$SHARDS t0=$SECONDS
  logs=$(mktemp -d "${TMPDIR:-/tmp}/megazero-slow.XXXXXX")
  local -a pids=() done=() codes=()
  for ((i = 1; i <= SHARDS; i++)); do
    first=$((10000 + (i - 1) * span))
    MEGAZERO_TEST_SHARD="$i/$SHARDS" MEGAZERO_TEST_PORTS="$first-$((first + span - 1))" \
      MEGAZERO_TEST_TIMES="$logs/times$i.txt" "$PY" -m pytest -m slow "$@" >"$logs/shard$i.log" 2>&1 &
    pids[i]=$!
  done
  trap 'kill "${pids[@]}" 2>/dev/null; exit 130' INT TERM  # an interrupted lane ends its shards
  echo "[megazero] slow lane: $SHARDS shards side by side, logs in $logs" >&2
  while [ "$left" -gt 0 ]; do
    sleep 1
    for ((i = 1; i <= SHARDS; i++)); do
      if [ -z "${done[i]:-}" ] && ! kill -0 "${pids[i]}" 2>/dev/null; then
        codes[i]=0
        wait "${pids[i]}" || codes[i]=$?
        done[i]=1
        left=$((left - 1))
        echo "[megazero] ===== slow shard $i/$SHARDS: exit ${codes[i]} after $((SECONDS - t0)) s ($logs/shard$i.log) =====" >&2
        cat "$logs/shard$i.log"
      fi
    done
  done
  for ((i = 1; i <= SHARDS; i++)); do  # pytest's summary line of every shard, together
    echo "[megazero] slow shard $i/$SHARDS: exit ${codes[i]}: $(grep -E '^=+ .* in [0-9.]+s' "$logs/shard$i.log" | tail -n 1)" >&2
    case "${codes[i]}" in
      0) ;;
      5) empty=$((empty + 1)) ;;  # no test of the selection fell to this shard
      *) [ "$rc" != 0 ] || rc=${codes[i]} ;;
    esac
  done
  [ "$empty" != "$SHARDS" ] || rc=5
  trap - INT TERM
  cat "$logs"/times*.txt 2>/dev/null | sort -rn >"$logs/slow_times.txt" || true
  echo "[megazero] measured seconds per test file: $logs/slow_times.txt (the table tests/support/shards.py splits by: tests/support/slow_times.txt)" >&2
  return "$rc"
}

lane() {  # lane NAME [pytest args]
  local name=$1
  shift
  local start=$SECONDS rc=0
  case "$name" in
    quick) lint && "$PY" -m pytest -m "not slow" "$@" || rc=$? ;;
    slow)
      if [ "$SHARDS" = 1 ]; then "$PY" -m pytest -m slow "$@" || rc=$?; else slow_shards "$@" || rc=$?; fi ;;
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
