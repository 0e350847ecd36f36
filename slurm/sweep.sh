#!/bin/bash
# Submit a named sweep (conf/sweep/NAME.yaml) to SLURM: the same as python -m slurm.sweep NAME [args].
#   slurm/sweep.sh table4_mu --dry-run
#   slurm/sweep.sh table1_750m seeds=3 cluster.partition=gpu
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m slurm.sweep "$@"
