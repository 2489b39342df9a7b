#!/usr/bin/env bash
# Runs a command under CUDA MPS (Multi-Process Service): the ranks of a test that share a GPU then
# run at the same time, each on its own share of the SMs, instead of taking turns in time slices.
#
#   tools/with_mps.sh N command [args...]    N: ranks per GPU; each rank gets 100/N % of the SMs
#   e.g. tools/with_mps.sh 4 python3 tests/ops/ep_intranode_test.py --nproc 4
#
# Starts a private MPS control daemon (its pipe and log directories in a fresh temporary
# directory, so it neither meets nor disturbs another MPS on the machine), runs the command with
# CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and (unless
# set) CUDA_DEVICE_MAX_CONNECTIONS in its environment (every rank process inherits them), and stops
# the daemon when the command ends. Exit status: the command's; 2 when MPS could not be started.
#
# Sourced (as tools/run_gpu_tests.sh does), it defines mps_start N and mps_stop instead.

# mps_start <ranks per GPU>: starts the daemon and exports the client settings. Returns 1 (with
# the reason on stderr) when MPS is not available here.
mps_start() {
  local n=$1
  if ! [[ $n =~ ^[0-9]+$ ]] || ((n < 1)); then
    echo "with_mps.sh: ranks per GPU must be a positive integer, got '$n'" >&2
    return 1
  fi
  if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "with_mps.sh: nvidia-cuda-mps-control is not on PATH (it comes with the NVIDIA driver)" >&2
    return 1
  fi
  MORI_MPS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/mori-mps.XXXXXX") || return 1
  export CUDA_MPS_PIPE_DIRECTORY=$MORI_MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MORI_MPS_DIR/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if ! nvidia-cuda-mps-control -d; then
    echo "with_mps.sh: nvidia-cuda-mps-control -d failed" >&2
    mps_stop
    return 1
  fi
  # The daemon answers on its control pipe once it is up (bounded wait: 10 s).
  local i
  for ((i = 0; i < 100; i++)); do
    if echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; then
      export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n))
      # Hardware work queues: under MPS the clients share one pool, and a client that sets no
      # CUDA_DEVICE_MAX_CONNECTIONS gets few, so its streams alias onto the same queues. The RDMA
      # emulator's copies then wait behind a stream whose next work waits for those copies
      # (docs/rdma.md, "Hardware work queues"). 64 in all fit 4 clients of 16 on an H200 (4 of 32
      # do not: a client's context creation then fails with "out of memory").
      if [[ -z ${CUDA_DEVICE_MAX_CONNECTIONS:-} ]]; then
        local conn=$((64 / n))
        ((conn > 32)) && conn=32
        ((conn < 2)) && conn=2
        export CUDA_DEVICE_MAX_CONNECTIONS=$conn
        MORI_MPS_SET_CONNECTIONS=1
      fi
      echo "== CUDA MPS on (control daemon in $MORI_MPS_DIR): $n rank(s) per GPU, each" \
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" \
        "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
      return 0
    fi
    sleep 0.1
  done
  echo "with_mps.sh: the MPS control daemon did not answer within 10 s" >&2
  mps_stop
  return 1
}

# mps_stop: stops the daemon mps_start started (and its server), prints the log lines that report
# errors, removes its directory. A no-op when none was started.
mps_stop() {
  [[ -n ${MORI_MPS_DIR:-} ]] || return 0
  local pidfile=$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid pid="" i alive=1
  [[ -r $pidfile ]] && pid=$(<"$pidfile")
  echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1 || true
  # quit returns before the daemon has exited (it waits for its clients): wait, bounded (20 s).
  for ((i = 0; i < 200; i++)); do
    if [[ -n $pid ]]; then
      kill -0 "$pid" 2>/dev/null || { alive=0; break; }
    elif ! [[ -e $CUDA_MPS_PIPE_DIRECTORY/control ]]; then
      alive=0
      break
    fi
    sleep 0.1
  done
  if grep -qiE 'error|fail' "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null; then
    echo "== CUDA MPS log lines with errors:" >&2
    grep -hiE 'error|fail' "$CUDA_MPS_LOG_DIRECTORY"/*.log | tail -20 >&2
  fi
  if ((alive)); then
    echo "with_mps.sh: the MPS daemon${pid:+ (pid $pid)} has not exited (a client still running?);" \
      "stop it with: echo quit | CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY nvidia-cuda-mps-control" >&2
  else
    rm -rf "$MORI_MPS_DIR"
  fi
  unset MORI_MPS_DIR CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
  [[ -n ${MORI_MPS_SET_CONNECTIONS:-} ]] && unset CUDA_DEVICE_MAX_CONNECTIONS
  unset MORI_MPS_SET_CONNECTIONS
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  set -uo pipefail
  if (($# < 2)); then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
  fi
  n=$1
  shift
  mps_start "$n" || exit 2
  trap 'trap "" INT TERM; mps_stop' EXIT  # a second signal must not cut the stop short
  # The command runs as a child waited for, so that a signal reaches the traps at once; they send
  # it SIGTERM (an asynchronous child ignores SIGINT) and stop the daemon once it has ended.
  "$@" &
  child=$!
  trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 130' INT
  trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM
  wait "$child"
  exit $?
fi
