#!/bin/bash
# Submit a Hydra multirun to SLURM through hydra-submitit-launcher (conf/hydra/launcher/slurm.yaml);
# every job requeues itself on time-out or preemption and resumes from its run directory.
#
#   slurm/sweep.sh experiment=table4_mu_1,table4_mu_sqrt,table4_mu_dk,table4_mu_4dk,table4_mu_learned
#   slurm/sweep.sh experiment=table1_750m_kdn_diag mixer.noise=learned,fixed_r hydra.launcher.nodes=2
#   PARTITION=gpu slurm/sweep.sh experiment=table5_fixed_r,table5_fixed_r_omega
set -euo pipefail
cd "$(dirname "$0")/.."
extra=()
if [ -n "${PARTITION:-}" ]; then extra+=("hydra.launcher.partition=${PARTITION}"); fi
exec python train.py -m hydra/launcher=slurm "${extra[@]}" "$@"
