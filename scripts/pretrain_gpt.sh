#!/usr/bin/env bash
# Front door: bash scripts/pretrain_gpt.sh [--tp T] [--cp C] [--pp P] [--dp D] [--nnodes N] [--node-rank R]
#             [--master-addr A] [--master-port PORT] [--rdzv-backend static|c10d] [--rdzv-id ID]
#             [--max-restarts K] [--data-dir DIR] [train.py flags ...]
#        bash scripts/pretrain_gpt.sh --help   (both sets of flags; prepares and starts nothing)
#
# Launches torchrun with T*C*P*D/N processes per node. Every flag it does not know goes to
# train.py unchanged. Without --data-path (and without --mock-data) it prepares the embedded
# default corpus once (Python standard library -> sentencepiece tokenizer -> .bin/.idx) under
# --data-dir (default: $MEGAZERO_DATA_DIR or <repo>/.cache/data) and trains on it.
set -euo pipefail

# --help: the launcher's flags, then train.py's (megazero.config needs only the standard
# library), and nothing else: no environment check, no data, no run directory, no torchrun.
usage() {
  cat <<'USAGE'
usage: bash scripts/pretrain_gpt.sh [launcher flags] [train.py flags]

launcher flags (read by this script):
  --tp, --tensor-model-parallel-size T    tensor-parallel size (default: 1)
  --cp, --context-parallel-size C         context-parallel size (default: 1): each sequence split over C ranks
  --pp, --pipeline-model-parallel-size P  pipeline-parallel size (default: 1)
  --dp, --data-parallel-size D            data-parallel size (default: 1); T*C*P*D ranks in all
  --nnodes N                              number of nodes (default: 1); T*C*P*D/N ranks per node
  --node-rank R                           this node's rank, 0 to N-1 (default: 0)
  --master-addr A                         address of node 0's rendezvous (default: 127.0.0.1)
  --master-port PORT                      its port (default: a free one on one node, 29500 on several)
  --data-dir DIR                          where the embedded default corpus is prepared when no
                                          --data-path is given (default: $MEGAZERO_DATA_DIR or
                                          <repo>/.cache/data)
  --run-dir DIR                           logs, metrics and TensorBoard files (default:
                                          <repo>/runs/<date>-tp<T>[cp<C>]pp<P>dp<D>)
  --distributed-timeout-s S               also bounds the rendezvous (passed on to train.py)
  -h, --help                              this help
Every other flag goes to train.py unchanged:

USAGE
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  local py="${MEGAZERO_VENV:+$MEGAZERO_VENV/bin/python}"
  py="${py:-$(command -v python3 || command -v python)}"
  "$py" -c 'from megazero.config import build_parser; build_parser().print_help()'
}
for a in "$@"; do
  case "$a" in -h|--help) usage; exit 0 ;; esac
done

source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEGAZERO_ROOT"

TP=1; CP=1; PP=1; DP=1; NNODES=1; NODE_RANK=0; MASTER_ADDR=127.0.0.1; MASTER_PORT=""
DATA_DIR="${MEGAZERO_DATA_DIR:-$MEGAZERO_ROOT/.cache/data}"
ARGS=(); LAYOUT=(); HAVE_DATA=0; RUN_DIR=""; HAVE_TOK=0; DIST_TIMEOUT=300  # train.py's default, seconds
RDZV_BACKEND=static; RDZV_ID="${SLURM_JOB_ID:-megazero}"; MAX_RESTARTS=0; SAVE=""; LOAD=""
# --flag=value is split into --flag value, so both spellings reach the cases below.
SPLIT=()
for a in "$@"; do
  if [[ "$a" == --*=* ]]; then SPLIT+=("${a%%=*}" "${a#*=}"); else SPLIT+=("$a"); fi
done
set -- ${SPLIT[@]+"${SPLIT[@]}"}
need() { [ "$#" -ge 2 ] || { echo "megazero: config error: $1 needs a value" >&2; exit 2; }; }
while [ "$#" -gt 0 ]; do
  case "$1" in
    --tp|--tensor-model-parallel-size) need "$@"; TP="$2"; LAYOUT+=("$1" "$2"); shift 2 ;;
    --pp|--pipeline-model-parallel-size) need "$@"; PP="$2"; LAYOUT+=("$1" "$2"); shift 2 ;;
    --cp|--context-parallel-size) need "$@"; CP="$2"; LAYOUT+=("$1" "$2"); shift 2 ;;
    --dp|--data-parallel-size) need "$@"; DP="$2"; LAYOUT+=("$1" "$2"); shift 2 ;;
    --nnodes) need "$@"; NNODES="$2"; shift 2 ;;
    --node-rank) need "$@"; NODE_RANK="$2"; shift 2 ;;
    --master-addr) need "$@"; MASTER_ADDR="$2"; shift 2 ;;
    --master-port) need "$@"; MASTER_PORT="$2"; shift 2 ;;
    --data-dir) need "$@"; DATA_DIR="$2"; shift 2 ;;
    --run-dir) need "$@"; RUN_DIR="$2"; shift 2 ;;
    --rdzv-backend) need "$@"; RDZV_BACKEND="$2"; shift 2 ;;
    --rdzv-id) need "$@"; RDZV_ID="$2"; shift 2 ;;
    --max-restarts) need "$@"; MAX_RESTARTS="$2"; ARGS+=("$1" "$2"); shift 2 ;;
    --save) need "$@"; SAVE="$2"; ARGS+=("$1" "$2"); shift 2 ;;
    --load) need "$@"; LOAD="$2"; ARGS+=("$1" "$2"); shift 2 ;;
    --distributed-timeout-s) need "$@"; DIST_TIMEOUT="$2"; ARGS+=("$1" "$2"); shift 2 ;;
    --data-path|--mock-data) HAVE_DATA=1; ARGS+=("$1"); shift ;;
    --tokenizer-model) HAVE_TOK=1; ARGS+=("$1"); shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
for v in TP CP PP DP NNODES; do  # decimal, no leading zero (bash would read 08 as octal)
  [[ "${!v}" =~ ^[1-9][0-9]{0,5}$ ]] || { echo "megazero: config error: --$(echo $v | tr 'A-Z_' 'a-z-') must be a whole number >= 1, got '${!v}'" >&2; exit 2; }
done
[[ "$NODE_RANK" =~ ^(0|[1-9][0-9]{0,5})$ ]] || { echo "megazero: config error: --node-rank must be a whole number >= 0, got '$NODE_RANK'" >&2; exit 2; }
case "$RDZV_BACKEND" in static|c10d) ;; *)
  echo "megazero: config error: --rdzv-backend must be static or c10d, got '$RDZV_BACKEND'" >&2; exit 2 ;; esac
if [ "$NODE_RANK" -ge "$NNODES" ]; then
  echo "megazero: config error: --node-rank $NODE_RANK is not below --nnodes $NNODES; fix: number the nodes 0 to $((NNODES - 1))" >&2
  exit 2
fi

# Stopping the launcher (Ctrl-C, kill, a scheduler's SIGTERM or SIGUSR1) before training stops the
# step running now (data preparation, the preflight) and exits with 128 + the signal's number.
# During training the signal is passed to every rank of this node (torchrun itself ignores it):
# the ranks agree to stop after the same step, save with --save, write stop.json and exit 0; then
# this script prints one line (the checkpoint and how to resume) and exits with 128 + the signal's
# number (0 after --exit-interval / --exit-duration-in-mins). A second signal kills the ranks at
# once. A rank whose launcher or torchrun dies outright (kill -9) notices and stops the same way
# (megazero/runtime/launch.py).
CHILD=""; STOPPED=""; TORCHRUN=""; TOLD=" "
signum() { kill -l "$1"; }
rank_pids() { pgrep -P "$TORCHRUN" 2>/dev/null || true; }
relay() {  # the stop request to every rank not yet told (ranks that start later are told too)
  local p sig="$STOPPED"; [ "$sig" != HUP ] || sig=TERM
  for p in $(rank_pids); do
    case "$TOLD" in *" $p "*) ;; *) kill -s "$sig" "$p" 2>/dev/null || true; TOLD="$TOLD$p " ;; esac
  done
}
stop() {
  if [ -n "$STOPPED" ] && [ -n "$TORCHRUN" ]; then
    echo "[megazero] second signal ($1): killing the ranks now, without saving" >&2
    for p in $(rank_pids); do kill -KILL "$p" 2>/dev/null || true; done
    kill -KILL "$TORCHRUN" 2>/dev/null || true
    return
  fi
  STOPPED="$1"
  if [ -n "$TORCHRUN" ]; then
    echo "[megazero] SIG$1: every rank stops after its current step${SAVE:+ and saves to $SAVE}; signal again to kill them at once" >&2
    relay
  elif [ -n "$CHILD" ]; then
    kill -TERM "$CHILD" 2>/dev/null || true
  fi
}
trap 'stop TERM' TERM; trap 'stop INT' INT; trap 'stop HUP' HUP; trap 'stop USR1' USR1
run_child() {  # run "$@" in the background so a trapped signal reaches it; return its status
  "$@" & CHILD=$!
  [ "$1" != torchrun_ignoring_stop ] || TORCHRUN=$CHILD
  local status=0 polled=0
  wait "$CHILD" || status=$?
  while kill -0 "$CHILD" 2>/dev/null; do
    if [ -n "$STOPPED" ] && [ -n "$TORCHRUN" ]; then relay; polled=1; sleep 0.5; continue; fi
    status=0; wait "$CHILD" || status=$?
  done
  [ "$polled" = 0 ] || { status=0; wait "$CHILD" || status=$?; }  # its status, once it has ended
  CHILD=""; TORCHRUN=""
  return "$status"
}
torchrun_ignoring_stop() {  # torchrun, deaf to the stop signals: the ranks handle them
  trap '' TERM INT USR1
  TORCHELASTIC_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT exec "$PY" -m torch.distributed.run "$@"
}
stopped_exit() {
  [ -z "$STOPPED" ] || { echo "[megazero] stopped by SIG$STOPPED" >&2; exit $((128 + $(signum "$STOPPED"))); }
}

# The settings alone first: megazero.config needs only the standard library (a fraction of a
# second), so a mistake in them ends with its one line and exit code 2 before the corpus is
# prepared or torch is imported. The preflight below checks them again, with the data, the
# checkpoint and the device.
# Only the layout flags given are passed on: a size left out may come from --deepspeed-config
# (sequence_parallel_size is --cp), and the sizes the run will have are read back here. The
# second line is the folder of the NVMe swap files (--offload-nvme-path, empty without NVMe
# offload), swept after the ranks end (below).
SETTINGS=$("$PY" -c 'import math, sys; from megazero.config import config_from_argv, parallel_sizes
sizes = parallel_sizes(sys.argv[1:])
z = config_from_argv(sys.argv[1:], math.prod(sizes), print_warnings=False, needs_data=False).zero
print(*sizes)
print(z.offload_nvme_path if "nvme" in (z.offload_optimizer, z.offload_param) and z.offload_nvme_path else "")' \
  ${LAYOUT[@]+"${LAYOUT[@]}"} ${ARGS[@]+"${ARGS[@]}"}) || exit $?
read -r TP CP PP DP <<< "$(printf '%s\n' "$SETTINGS" | sed -n 1p)"
NVME_PATH="$(printf '%s\n' "$SETTINGS" | sed -n 2p)"
WORLD=$((TP * CP * PP * DP))
if [ $((WORLD % NNODES)) -ne 0 ]; then
  echo "megazero: config error: --tp x --cp x --pp x --dp = $WORLD is not divisible by --nnodes $NNODES; choose sizes whose product is a multiple of the node count" >&2
  exit 2
fi
NPROC=$((WORLD / NNODES))

if [ "$HAVE_DATA" = 0 ]; then
  echo "[megazero] no --data-path: preparing the embedded default corpus under $DATA_DIR (once)"
  PREP_FILE="$(mktemp)"
  prep_rc=0
  run_child "$PY" -m data.prepare --data-dir "$DATA_DIR" > "$PREP_FILE" || prep_rc=$?  # progress: stderr
  PREP_OUT="$(cat "$PREP_FILE")"; rm -f "$PREP_FILE"
  stopped_exit
  [ "$prep_rc" = 0 ] || exit "$prep_rc"
  printf '%s\n' "$PREP_OUT"
  DATA_PATH="$(printf '%s\n' "$PREP_OUT" | sed -n 's/^DATA_PATH=//p' | tail -n 1)"
  TOKENIZER_MODEL="$(printf '%s\n' "$PREP_OUT" | sed -n 's/^TOKENIZER_MODEL=//p' | tail -n 1)"
  [ -n "$DATA_PATH" ] && [ -n "$TOKENIZER_MODEL" ] || { echo "megazero: data preparation did not report DATA_PATH/TOKENIZER_MODEL" >&2; exit 1; }
  ARGS+=(--data-path "$DATA_PATH")
  [ "$HAVE_TOK" = 1 ] || ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
fi

[ -n "$RUN_DIR" ] || RUN_DIR="$MEGAZERO_ROOT/runs/$(date +%Y%m%d-%H%M%S)-tp${TP}$([ "$CP" = 1 ] || echo "cp$CP")pp${PP}dp${DP}"
# Node 0 hosts the rendezvous store on --master-port: a port in use is an error now, not a
# traceback from every rank later. Without --master-port a free one is picked (one node) or
# torchrun's default 29500 is used (several nodes).
port_free() { "$PY" -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try: s.bind(("", int(sys.argv[1])))
except OSError: sys.exit(1)' "$1"; }
if [ -z "$MASTER_PORT" ] && [ "$NNODES" -gt 1 ]; then
  MASTER_PORT=29500  # torchrun's default: every node must agree on it
elif [ -z "$MASTER_PORT" ]; then
  for _ in 1 2 3 4 5 6 7 8; do
    MASTER_PORT=$(( 20000 + RANDOM % 20000 ))
    if port_free "$MASTER_PORT"; then break; fi
  done
fi
if ! [[ "$MASTER_PORT" =~ ^[0-9]+$ ]] || [ "$MASTER_PORT" -lt 1 ] || [ "$MASTER_PORT" -gt 65535 ]; then
  echo "megazero: config error: --master-port must be a port number 1-65535, got '$MASTER_PORT'" >&2; exit 2
fi
if [ "$NODE_RANK" = 0 ] && ! port_free "$MASTER_PORT"; then
  echo "megazero: config error: --master-port $MASTER_PORT is already in use on this machine (another run?); fix: choose a free port, or leave --master-port out to pick one" >&2
  exit 2
fi
# Share the cores between the ranks of this node (torch would otherwise start one thread per core in each).
CORES=$(nproc 2>/dev/null || echo 1)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}"

export MEGAZERO_RANKS_PER_NODE=$NPROC  # the memory check shares this node among its ranks
# Settings and data are checked once here, so a mistake ends with one line and exit code 2. The
# preflight also writes the variables this run's ranks need (megazero.training.preflight, launch_exports:
# CUDA_DEVICE_MAX_CONNECTIONS=1 where tensor/context-parallel overlap needs it; a value already in
# the environment is kept), exported here so that they are set before any CUDA context exists.
EXPORTS="$(mktemp)"
"$PY" -c 'import sys; from megazero.training import preflight; sys.exit(preflight(sys.argv[3:], int(sys.argv[1]), sys.argv[2]))' "$WORLD" \
  "$EXPORTS" ${LAYOUT[@]+"${LAYOUT[@]}"} --run-dir "$RUN_DIR" "${ARGS[@]}" || { rc=$?; rm -f "$EXPORTS"; exit "$rc"; }
# shellcheck disable=SC1090  # written just now by the preflight
source "$EXPORTS"
for name in $(sed -n 's/^export \([A-Z_]*\)=.*/\1/p' "$EXPORTS"); do
  echo "[megazero] $name=${!name} ($(grep -B1 "^export $name=" "$EXPORTS" | sed -n 's/^# //p'))"
done
rm -f "$EXPORTS"

stopped_exit  # a signal that came during the preflight
mkdir -p "$RUN_DIR"
echo "[megazero] run directory: $RUN_DIR"
echo "[megazero] TensorBoard:   tensorboard --logdir $RUN_DIR/tensorboard"
# A node that never joins ends the rendezvous after --distributed-timeout-s (whole seconds), as a
# dead peer ends a collective.
RDZV_TIMEOUT=$("$PY" -c 'import math, sys; print(max(1, math.ceil(float(sys.argv[1]))))' "$DIST_TIMEOUT")
export MEGAZERO_LAUNCHER_PID=$$  # the ranks exit if this script is killed outright (-9)
export MEGAZERO_PREFLIGHT_DONE=1  # the ranks need not print the config warnings again
echo "[megazero] launching $NPROC process(es) on this node (tp=$TP $([ "$CP" = 1 ] || echo "cp=$CP ")pp=$PP dp=$DP, nnodes=$NNODES)"
if [ "$RDZV_BACKEND" = c10d ]; then  # dynamic rendezvous (restarts across nodes); node 0 hosts its store
  RDZV=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
        --rdzv-conf "timeout=$RDZV_TIMEOUT,is_host=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)")
else
  RDZV=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
        --rdzv-conf "timeout=$RDZV_TIMEOUT")
fi
rm -rf "$RUN_DIR/stop.json" "$RUN_DIR/failures" "$RUN_DIR/torchrun.log" "$RUN_DIR/nccl_trace"  # an early end on purpose, failures, NCCL dumps
# torchrun's stderr (its failure summary: which rank ended first, with what code or signal) is
# also kept in RUN_DIR/torchrun.log, read below to name the culprit.
exec 3> >(trap '' INT TERM USR1 HUP; exec tee -a "$RUN_DIR/torchrun.log" >&2); TEE=$!  # deaf to Ctrl-C, as torchrun
rc=0
run_child torchrun_ignoring_stop --nnodes "$NNODES" --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" \
  "${RDZV[@]}" train.py ${LAYOUT[@]+"${LAYOUT[@]}"} --run-dir "$RUN_DIR" "${ARGS[@]}" 2>&3 || rc=$?
exec 3>&-; wait "$TEE" 2>/dev/null || true
# A rank that was killed (or ended by torchrun after a peer died) left its NVMe swap folders:
# every rank of this node has ended now, so each folder whose process is gone goes, one line each
# (megazero/offload/swap_dirs.py; a restarted attempt's rank swept the earlier attempt's already).
if [ -n "$NVME_PATH" ]; then
  "$PY" -c 'import sys; from megazero.offload.swap_dirs import sweep_stale
sweep_stale(sys.argv[1], log=lambda line: print(line, file=sys.stderr, flush=True))' "$NVME_PATH" || true
fi
echo "[megazero] run directory: $RUN_DIR   (tensorboard --logdir $RUN_DIR/tensorboard)"
if [ "$rc" = 0 ] && [ -f "$RUN_DIR/stop.json" ]; then  # an early end on purpose: one line, its status
  STOP_LINE=$("$PY" -c 'import json, sys
r = json.load(open(sys.argv[1])); save, load = sys.argv[2:4]
why = {"time": "--exit-duration-in-mins", "interval": "--exit-interval"}.get(r["reason"], r["reason"])
if r["reason"] in ("non-finite", "no-loss-tokens"):
    sys.exit(print(r["status"]))  # the ranks printed the one line
resume = ("run the same command again (it has --load %s)" % load if load and load == save
          else "run the same command with --load %s" % save)
where = "checkpoint %s; to resume, %s" % (r["checkpoint"], resume) if r["checkpoint"] else "nothing saved (no --save)"
print(r["status"], "[megazero] stopped after iteration %d (%s): %s" % (r["iteration"], why, where))' \
    "$RUN_DIR/stop.json" "$SAVE" "$LOAD")
  [ "${STOP_LINE#* }" = "$STOP_LINE" ] || echo "${STOP_LINE#* }" >&2
  [ -z "$STOPPED" ] || exit $((128 + $(signum "$STOPPED")))
  exit "${STOP_LINE%% *}"
fi
stopped_exit
if [ "$rc" != 0 ]; then  # who failed first (torchrun's summary), what the others waited in (their reports)
  "$PY" -c 'import sys; from megazero.runtime.resilience import name_culprits
line = name_culprits(sys.argv[1], int(sys.argv[2]))
if line: print(line)' "$RUN_DIR" "$WORLD" >&2 || true
fi
if [ "$rc" != 0 ]; then
  echo "[megazero] training failed (exit code $rc); the error is above. A node that never joins or a rank that dies ends the run after --distributed-timeout-s $DIST_TIMEOUT." >&2
fi
exit $rc
