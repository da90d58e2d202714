#!/usr/bin/env bash
# Runs the test suite (CPU, gloo ranks on loopback). Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not slow"` for the quick inner loop.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEGAZERO_ROOT"
exec "$PY" -m pytest "$@"
