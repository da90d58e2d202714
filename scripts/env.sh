# Sourced by scripts/pretrain_gpt.sh and scripts/test.sh: picks the Python that runs megazero.
#
# - If the current python already has torch, numpy, sentencepiece, tensorboard and einops
#   (a cluster container, an activated environment), it is used as it is.
# - Otherwise a virtual environment at $MEGAZERO_VENV (default: <repo>/.venv) is created or
#   reused, torch==2.13.0 is installed first when no torch is present (a looser request would
#   pull a multi-GB CUDA build; on a GPU machine install the torch you want before running),
#   then the project with its dev extra.
# Exports PY (the interpreter) and MEGAZERO_ROOT.
set -euo pipefail
MEGAZERO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MEGAZERO_ROOT
_deps_ok() {
  "$1" - <<'PY' >/dev/null 2>&1
import torch, numpy, sentencepiece, tensorboard, einops, pytest  # noqa: F401
PY
}
_host_py="$(command -v python3 || command -v python)"
if [ -z "${MEGAZERO_VENV:-}" ] && _deps_ok "$_host_py"; then
  PY="$_host_py"
else
  venv="${MEGAZERO_VENV:-$MEGAZERO_ROOT/.venv}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "[megazero] creating virtual environment $venv" >&2
    "$_host_py" -m venv "$venv"
  fi
  PY="$venv/bin/python"
  if ! _deps_ok "$PY"; then
    echo "[megazero] installing dependencies into $venv (once)" >&2
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
      "$PY" -m pip install -q "torch==2.13.0"
    fi
    "$PY" -m pip install -q -e "$MEGAZERO_ROOT[dev]"
  fi
fi
export PY
