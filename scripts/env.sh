# Sourced by scripts/pretrain_gpt.sh, scripts/gpu_check.sh and scripts/test.sh: picks the Python
# that runs megazero.
#
# - If the current python already has torch, numpy, sentencepiece, tensorboard and einops
#   (a cluster container, an activated environment), it is used as it is.
# - Otherwise a virtual environment at $MEGAZERO_VENV (default: <repo>/.venv) is created or
#   reused, torch==2.13.0 is installed first when no torch is present (a looser request would
#   pull a multi-GB CUDA build; on a GPU machine install the torch you want before running),
#   then the project with its dev extra.
# - Nothing is installed when pip has no package source: no local wheel folder or file:// index
#   of its configuration exists and no http(s) index (pypi.org unless one is configured) answers
#   within 3 s. One line names what is missing and the script exits 2, instead of pip retrying
#   for minutes on a machine without a network.
# Exports PY (the interpreter) and MEGAZERO_ROOT.
set -euo pipefail
MEGAZERO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MEGAZERO_ROOT
_missing() {  # the modules megazero needs that python "$1" does not have, comma-separated
  # found, not imported: importing torch costs seconds on every launch; a module that is present
  # but broken fails at its import in the run, with its own traceback
  "$1" - <<'PY' 2>/dev/null || echo "torch, numpy, sentencepiece, tensorboard, einops, pytest"
import importlib.util
mods = ("torch", "numpy", "sentencepiece", "tensorboard", "einops", "pytest")
print(", ".join(m for m in mods if importlib.util.find_spec(m) is None))
PY
}
_deps_ok() { [ -z "$(_missing "$1")" ]; }
_index_reachable() {  # pip of python "$1" has a package source: a local wheel folder or file:// index
  # that exists, or an http(s) index whose host accepts a connection within 3 s (pypi.org unless
  # an index-url is configured); read from pip's configuration, which includes the PIP_* variables
  "$1" - <<'PY' >/dev/null 2>&1
import os, socket, subprocess, sys, urllib.parse
keys = ("index-url", "extra-index-url", "find-links")
try:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            timeout=60).stdout.splitlines()
except Exception:
    listed = []
found = {k: [] for k in keys}
for line in listed:
    name, _, value = line.partition("=")
    if name.rsplit(".", 1)[-1] in keys:
        found[name.rsplit(".", 1)[-1]] += value.strip().strip("'\"").split()
for k in keys:
    found[k] += os.environ.get("PIP_" + k.upper().replace("-", "_"), "").split()
sources = found["index-url"] or ["https://pypi.org/simple"]
for src in sources + found["extra-index-url"] + found["find-links"]:
    u = urllib.parse.urlparse(src)
    if u.scheme in ("", "file"):
        if os.path.exists(u.path or src):
            sys.exit(0)
        continue
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=3).close()
        sys.exit(0)
    except OSError:
        pass
sys.exit(1)
PY
}
_host_py="$(command -v python3 || command -v python)"
if [ -z "${MEGAZERO_VENV:-}" ] && _deps_ok "$_host_py"; then
  PY="$_host_py"
else
  venv="${MEGAZERO_VENV:-$MEGAZERO_ROOT/.venv}"
  if [ ! -x "$venv/bin/python" ] || ! _deps_ok "$venv/bin/python"; then
    if ! _index_reachable "$_host_py"; then
      if [ -x "$venv/bin/python" ]; then what="$venv lacks $(_missing "$venv/bin/python")"
      elif [ -n "${MEGAZERO_VENV:-}" ]; then what="MEGAZERO_VENV=$venv does not exist"
      else what="$_host_py lacks $(_missing "$_host_py")"; fi
      echo "megazero: environment error: $what and pip has no package source (no network, no local wheels)," \
        "so nothing is installed; fix: install them into $_host_py, or set MEGAZERO_VENV to an environment" \
        "that has them" >&2
      exit 2
    fi
    if [ ! -x "$venv/bin/python" ]; then
      echo "[megazero] creating virtual environment $venv" >&2
      "$_host_py" -m venv "$venv"
    fi
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
