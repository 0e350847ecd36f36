#!/bin/bash
# The body of every batch script (slurm/train.sbatch and the scripts python -m slurm.sweep renders): run "$@" once
# per node (srun, one task per node) and requeue the job when it stops with exit code 75. SLURM sends SIGUSR1
# `--signal` seconds before the time limit and SIGTERM on preemption; train.py (started per GPU by slurm.launch,
# which forwards the signals) saves at the next step boundary and exits 75. The batch shell traps the signals so
# that it outlives the tasks, then calls `scontrol requeue`, at most KDN_MAX_REQUEUES times (default 100). The
# requeued job runs the same script and resumes from the run directory.
set -uo pipefail
REQUEUE_EXIT_CODE=75  # trainer.preemption.REQUEUE_EXIT_CODE
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
signalled=0
trap 'signalled=1; echo "batch shell: got a signal; waiting for the tasks to checkpoint"' TERM USR1
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "$@" &
pid=$!
while :; do
  wait "$pid"
  rc=$?
  kill -0 "$pid" 2>/dev/null || break  # wait returned early because of a trapped signal
done
# A task killed by the signal before Python installed its handlers ends with 128 + the signal's number: USR1 (10),
# USR2 (12) or TERM (15) requeue too, and so does any signal death after this shell was signalled.
requeue=0
case "$rc" in "$REQUEUE_EXIT_CODE"|138|140|143) requeue=1 ;; esac
if [ "$signalled" -eq 1 ] && [ "$rc" -gt 128 ]; then requeue=1; fi
if [ "$requeue" -eq 1 ]; then
  restarts=${SLURM_RESTART_COUNT:-0}
  if [ "$restarts" -ge "${KDN_MAX_REQUEUES:-100}" ]; then
    echo "not requeueing job ${SLURM_JOB_ID}: requeued $restarts times already (KDN_MAX_REQUEUES)"
    exit "$rc"
  fi
  echo "requeueing job ${SLURM_JOB_ID}"
  scontrol requeue "${SLURM_JOB_ID}"
fi
exit "$rc"
