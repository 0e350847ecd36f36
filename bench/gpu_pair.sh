#!/bin/bash
# Two GPUs of one machine at once: bench/gpu.sh's stages for GPU 0 and for GPU 1 run side by side, then,
# optionally, stages that use both GPUs (e.g. parity2).
#   bash bench/gpu_pair.sh "STAGES FOR GPU 0" "STAGES FOR GPU 1" ["STAGES ON BOTH"]
# Stages within a group are separated by ';' (a stage may hold spaces: "warm=bench.mixer_throughput --T 2048").
# Time: the side-by-side groups end by PAIR1_S seconds (default: all of PAIR_S when no third group is given,
# else 300), the last group by PAIR_S (default 560) from the start. The wheels and the autotune cache are set up
# once, and the GPUs share one TRITON_CACHE_DIR (Triton writes its cache atomically).
# Back under $OUT: gpu0.log, gpu1.log, both.log; results.tgz (each group's $OUT, as gpu0/ gpu1/ both/) and
# autotune.tgz (to be merged into bench/kernel_cache/triton/). Wheels: as in bench/gpu.sh.
set -uo pipefail
START=$SECONDS
cd "$(dirname "$0")/.."

split_stages() {  # stages separated by ';' -> the array STAGES, each trimmed, empty ones dropped
  local parts=() s
  IFS=';' read -ra parts <<< "$1"
  STAGES=()
  for s in "${parts[@]}"; do
    s="${s#"${s%%[![:space:]]*}"}"
    s="${s%"${s##*[![:space:]]}"}"
    [ -n "$s" ] && STAGES+=("$s")
  done
}

# Every stage of every group is checked before any set-up, against the labels of bench/gpu.sh's stage case (one
# list of names), so that a misspelt stage costs no time: exit 2, as bench/gpu.sh would.
mapfile -t KNOWN < <(sed -n 's/^    \([a-z][a-z0-9_|=*]*\))$/\1/p' bench/gpu.sh | tr '|' '\n')
for group_stages in "$@"; do
  split_stages "$group_stages"
  for s in "${STAGES[@]}"; do
    ok=0
    for pattern in "${KNOWN[@]}"; do
      # shellcheck disable=SC2053
      [[ "$s" == $pattern ]] && { ok=1; break; }
    done
    if [ "$ok" = 0 ]; then
      echo "unknown stage $s; stages: ${KNOWN[*]} (bench/gpu.sh lists what each does)" >&2
      exit 2
    fi
  done
done

R=${OUT:-runs/gpu_pair}
W=$(mktemp -d)
mkdir -p "$R"
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
gpu_prepare || exit 1
export GPU_PREPARED=1 NO_AUTOTUNE_TGZ=1
PAIR_S=${PAIR_S:-560}
if [ -n "${3:-}" ]; then PAIR1_S=${PAIR1_S:-300}; else PAIR1_S=$PAIR_S; fi

group() {  # name, CUDA_VISIBLE_DEVICES, seconds left, stages separated by ';'
  split_stages "$4"
  CUDA_VISIBLE_DEVICES=$2 OUT=$W/$1 LOG=$R/$1.log GPU_S=$3 bash bench/gpu.sh "${STAGES[@]}"
}
rc=0
group gpu0 0 "$PAIR1_S" "$1" & p0=$!
group gpu1 1 "$PAIR1_S" "${2:-}" & p1=$!
wait $p0 || rc=$?
wait $p1 || rc=$?
if [ -n "${3:-}" ]; then
  group both 0,1 $((PAIR_S - (SECONDS - START))) "$3" || rc=$?
fi
tar czf "$R/results.tgz" -C "$W" .
pack_autotune "$R/autotune.tgz"
exit $rc
