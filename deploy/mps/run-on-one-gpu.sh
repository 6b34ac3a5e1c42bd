#!/usr/bin/env bash
# pdserve on one GPU: the router, the prefill worker and the decode worker as three processes, the
# two workers sharing the GPU through NVIDIA MPS, each limited to its share of the SMs.
#
#   deploy/mps/run-on-one-gpu.sh [flags for every service, e.g. --model-path /models/llama-3.1-8b]
#
# PDSERVE_PREFILL_SM_PERCENT (default 30) and PDSERVE_DECODE_SM_PERCENT (default 100) become each
# worker's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; `python -m loadtest.engine.bench_mps_split` measures which
# split to use (deploy/mps/README.md). The MPS control daemon is started unless one already answers
# in CUDA_MPS_PIPE_DIRECTORY. Ctrl-C or SIGTERM stops the services, then the daemon if this script
# started it; if one service exits, the others are stopped the same way.
set -euo pipefail

readonly GRACE_S=15  # SIGTERM, then this long before SIGKILL
readonly SERVICES=(router prefill decode)

log() { printf 'run-on-one-gpu: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

sm_percent() {  # NAME VALUE: VALUE if it is a whole number from 1 to 100
  if ! [[ $2 =~ ^[0-9]{1,3}$ ]] || ((10#$2 < 1 || 10#$2 > 100)); then
    die "$1 must be a whole number from 1 to 100, not '$2'"
  fi
  printf '%d' "$((10#$2))"
}

# Defaults measured on the H200 with the 8B shape (docs/BENCHMARKS.md, "MPS split").
prefill_percent=$(sm_percent PDSERVE_PREFILL_SM_PERCENT "${PDSERVE_PREFILL_SM_PERCENT:-30}")
decode_percent=$(sm_percent PDSERVE_DECODE_SM_PERCENT "${PDSERVE_DECODE_SM_PERCENT:-100}")
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x $repo/.venv/bin/python ]]; then PYTHON=$repo/.venv/bin/python; else PYTHON=python3; fi
fi
command -v nvidia-cuda-mps-control >/dev/null || die "nvidia-cuda-mps-control is not on PATH (it comes with the NVIDIA driver)"

export PDSERVE_MODEL_DEVICE=${PDSERVE_MODEL_DEVICE:-cuda:0}
export PDSERVE_MODEL_DTYPE=${PDSERVE_MODEL_DTYPE:-bfloat16}
# NVIDIA's default pipe folder, so a daemon an administrator started is found; the log folder
# moves out of /var/log, which only root may write.
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}
export PYTHONPATH=$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}
unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE  # set per worker below, never inherited
cd "$repo"

pids=()
started_mps=false

mps_answers() { echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; }

# shellcheck disable=SC2317  # shellcheck 0.9 does not see that the EXIT trap reaches these three
any_running() {
  local pid
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

# shellcheck disable=SC2317
stop_services() {
  local pid deadline=$((SECONDS + GRACE_S))
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  while any_running && ((SECONDS < deadline)); do sleep 0.2; done
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      log "pid $pid did not stop within ${GRACE_S} s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  wait || true
}

# shellcheck disable=SC2317
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  stop_services
  if [[ $started_mps == true ]]; then
    log "stopping the MPS daemon it started"
    echo quit | nvidia-cuda-mps-control || log "could not stop the MPS daemon in $CUDA_MPS_PIPE_DIRECTORY"
  fi
  exit "$status"
}

trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if mps_answers; then
  log "using the MPS daemon already running in $CUDA_MPS_PIPE_DIRECTORY"
else
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  started_mps=true
  nvidia-cuda-mps-control -d
  for _ in {1..50}; do mps_answers && break; sleep 0.2; done
  mps_answers || die "the MPS daemon does not answer; see $CUDA_MPS_LOG_DIRECTORY/control.log"
  log "started the MPS daemon in $CUDA_MPS_PIPE_DIRECTORY"
fi

"$PYTHON" -m services.router "$@" &
pids+=("$!")
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$prefill_percent "$PYTHON" -m services.prefill "$@" &
pids+=("$!")
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$decode_percent "$PYTHON" -m services.decode "$@" &
pids+=("$!")
log "router pid ${pids[0]}, prefill pid ${pids[1]} (${prefill_percent}% of the SMs)," \
    "decode pid ${pids[2]} (${decode_percent}%), on $PDSERVE_MODEL_DEVICE in $PDSERVE_MODEL_DTYPE"

status=0
wait -n || status=$?
for i in "${!pids[@]}"; do
  kill -0 "${pids[$i]}" 2>/dev/null || log "${SERVICES[$i]} exited (status $status); stopping the others"
done
exit $((status == 0 ? 1 : status))
