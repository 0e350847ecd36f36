#!/usr/bin/env bash
# The MQAR initialisation x precision experiment (docs/mqar.md, "Why Diagonal KDN trails KDA"), its arms side by side
# on one GPU:
#   bash bench/mqar_arms.sh [OUT] [eval.mqar overrides, e.g. widths=64,256]
# Default arms (ARMS, one "init precision mixers" per line): {fla, authors} init x {bf16, fp32} for Diagonal KDN, KDA
# in the two init arms (its kernel is fla's, so precision does not apply to it); width 128, 12 epochs, lr 3e-4,
# seeds 0, 1, 2; 18 models. Each arm is one `python -m eval.mqar` into OUT (default runs/mqar/arms), whose job names
# and results file carry the arm, and all start at once: their 6 groups of 3 jobs train together, as one grid's 6
# workers would. A rerun trains only what is missing. Exit status: 1 if any arm failed (each arm's log: OUT/logs/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/mqar/arms}
shift $(( $# > 0 ? 1 : 0 ))
ARMS=${ARMS:-"fla bf16 kdn_diag,kda
authors bf16 kdn_diag,kda
fla fp32 kdn_diag
authors fp32 kdn_diag"}
mkdir -p "$OUT/logs"
pids=()
while read -r init precision mixers; do
  [ -n "$init" ] || continue
  log="$OUT/logs/${init}_${precision}_${mixers//,/-}.log"
  python3 -m eval.mqar out="$OUT" mixers="$mixers" widths=128 lrs=3e-4 seeds=0,1,2 epochs=12 init="$init" \
    precision="$precision" "$@" > "$log" 2>&1 &
  pids+=($!)
  echo "arm init=$init precision=$precision mixers=$mixers: pid $!, log $log"
done <<< "$ARMS"
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "arms done (exit $rc)"
exit $rc
