#!/bin/bash
# GPU checks and benchmarks in time-limited stages on any CUDA machine; one log and the results under $OUT. The log
# starts with the provenance that docs/results/README.md asks for: date, GPU, driver, torch, CUDA, Triton, fla, commit.
#   bash bench/gpu.sh kernels throughput profile train100m throughput750m
# Each stage runs under its own time limit (<STAGE>_S or STAGE_S seconds, default 240), so that a slow stage
# leaves time for the ones after it; no stage runs past GPU_S seconds from the start (default 560), so that the
# autotune tarball is always written; a stage that ignores SIGTERM (train.py does, to checkpoint at the next
# step) is killed KILL_S (15) seconds after its limit.
# Stages:
#   kernels        gpu-marked tests (KDN_TESTS: files, default the kdn and mixer GPU tests; KDN_K: a -k expression),
#                  accuracy rows -> $OUT/accuracy.jsonl; `kernels=EXPR` takes EXPR as its -k expression instead
#                  (several kernels stages per run; each one's limit is KERNELS_S); KDN_PYTEST_ARGS: extra pytest
#                  options, default "-n 10" (pytest-xdist: the tests run, and their kernels compile, in 10 processes
#                  at once; first-call compilation bounds these runs); KDN_PYTEST_ARGS= runs them in one process
#   throughput     bench.mixer_throughput (BENCH_ARGS, default: kdn_diag kdn_iso kda at T = 8K and 32K);
#                  `throughput=ARGS` takes ARGS instead
#   profile        top CUDA kernels of one layer fwd+bwd at 8K (PROFILE_MIXERS, default: kdn_iso kdn_diag kda;
#                  PROFILE_ARGS, e.g. --ops for the operators behind them)
#   profile_step   bench.profile_step: a whole model's training step (default: 750M kdn_diag / kdn_iso / kda at
#                  4096 x 8); `profile_step=ARGS` takes ARGS; JSON -> $OUT/profile_step_<n>.json (n-th such stage)
#   train100m      slurm/gpu_checks.sh 100m (~100M KDN, 500 steps); summary -> $OUT/train100m.json
#   throughput750m slurm/gpu_checks.sh throughput (750M kdn_diag / kdn_iso / kda; `throughput750m=kdn_diag,kda`
#                  runs those); summary, metrics and the profiles of steps 21-22 (summaries and traces) -> $OUT
#   throughput750m_paper  the same at the paper's 0.5M-token batch (slurm/gpu_checks.sh throughput_paper; default
#                  kdn_diag,kda; `throughput750m_paper=MIXERS`); files named throughput750m_paper*
#   bench=MODULE ARGS  `python -m bench.MODULE ARGS --out $OUT/MODULE.json` (e.g. "bench=norm_throughput
#                  --block-rows 32 64"); a later stage of the same module writes MODULE_2.json, MODULE_3.json, ...
#   env=NAME=VALUE sets NAME for the stages after it (e.g. "env=KDN_TESTS=tests/test_mixers_gpu.py")
#   mqar[=ARGS]    `python -m eval.mqar out=$MQAR_OUT ARGS` (MQAR_OUT default runs/mqar/full): the MQAR grid,
#                  resuming from the job files and checkpoints there; MQAR_JOBS names a folder of job files or
#                  a grid's job summary (e.g. bench/results/mqar_h200_grid/jobs.json), copied in first where
#                  MQAR_OUT has no job of that name; every job file comes back as $OUT/mqar_jobs.tgz
#   parity1        slurm/gpu_checks.sh parity1: the one-GPU reference run of the parity check
#   parity2        slurm/gpu_checks.sh parity2: the two-GPU runs (DDP, FSDP) and their comparisons -> $OUT;
#                  `parity2=fsdp` (or ddp) runs one of them
#   resume2        slurm/gpu_checks.sh resume2 (two GPUs, FSDP; `resume2=ddp` for DDP): exact resume across a
#                  sharded checkpoint and the HF export loaded back -> $OUT
#   warm=MODULE ARGS  bench.warm_triton: the workload `python -m MODULE ARGS` in WARM_WORKERS (12) processes that
#                  compile their share of every autotune configuration, so that a later stage running the same
#                  kernels only times them (e.g. "warm=bench.mixer_throughput --mixers deltanet --repeats 1
#                  --out /tmp/warm.json")
# Set-up (bench/gpu_env.sh): wheels in .whl/ (or the folder WHEELS names) are installed first, for an image
# without fla (`pip download --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0 -d .whl`); the Triton
# autotune results in bench/kernel_cache/triton/*.tgz are restored into TRITON_CACHE_DIR, which skips most first-call
# autotuning (several minutes per fla op otherwise) on the stack they were made on. The run's autotune results
# come back as $OUT/autotune.tgz, to be saved in bench/kernel_cache/triton/, and TileLang's compiled kernels (when any) as
# $OUT/tilelang_cache.tgz, for bench/kernel_cache/tilelang/ (neither when NO_AUTOTUNE_TGZ is set).
# bench/gpu_pair.sh runs two of these at once, one per GPU; it installs the wheels and restores the cache
# first (GPU_PREPARED=1) and writes each log to LOG.
set -uo pipefail
START=$SECONDS
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
LOG=${LOG:-$OUT/gpu.log}
mkdir -p "$OUT"
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
gpu_prepare || exit 1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  # fla's version from its distribution, as bench.provenance records it beside each figure: importing fla itself
  # imports every op module (about 8 s of each run)
  python3 -c "from importlib import metadata; import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'fla', metadata.version('flash-linear-attention'))"
  if [ -n "${KDN_GIT_COMMIT:-}" ]; then echo "commit $KDN_GIT_COMMIT"; else
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo 'not recorded (no git checkout)')$(git diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')"; fi
} 2>&1 | grep -v Warn | tee -a "$LOG"
rc=0
stage_arg() {  # stage, name: what follows "name=" in the stage, or nothing
  local a=${1#"$2"}
  echo "${a#=}"
}
run_stage() {  # name, command...; the limit is $<NAME>_S (e.g. KERNELS_S) or $STAGE_S
  local name=$1; shift
  local base=${name%% *}
  local var; var="$(echo "${base%%=*}" | tr '[:lower:]' '[:upper:]')_S"
  local limit=${!var:-${STAGE_S:-240}}
  local left=$(( ${GPU_S:-560} - (SECONDS - START) - ${KILL_S:-15} - 5 ))
  if [ "$left" -lt 10 ]; then
    echo "=== $name skipped: GPU_S reached" | tee -a "$LOG"
    rc=124
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "=== $name ($(date -u +%T), limit $limit s)" | tee -a "$LOG"
  timeout -k "${KILL_S:-15}" "$limit" "$@" 2>&1 | grep -v -e Warning -e '_cpu_device_warning' | tee -a "$LOG"
  local s=${PIPESTATUS[0]}
  echo "=== $name exit $s" | tee -a "$LOG"
  [ "$s" = 0 ] || rc=$s
}
for stage in "$@"; do
  case "$stage" in
    kernels|kernels=*)
      expr=$(stage_arg "$stage" kernels)
      expr=${expr:-${KDN_K:-}}
      select=()  # no -k without an expression: a stand-in such as "not nothing" deselects tests named "...nothing"
      [ -n "$expr" ] && select=(-k "$expr")
      # shellcheck disable=SC2086
      run_stage "kernels $expr" env KDN_ACCURACY_JSON="$OUT/accuracy.jsonl" KDN_INSTAFAIL=1 \
        python3 -m pytest -v ${KDN_PYTEST_ARGS--n 10} \
        -p no:cacheprovider -m gpu "${select[@]}" \
        ${KDN_TESTS:-tests/test_kdn_triton.py tests/test_kdn_varlen_interpret.py tests/test_mixers_gpu.py tests/test_wy_tilelang_gpu.py tests/test_intra_gpu.py tests/test_state_output_gpu.py}
      ;;
    env=*=*)
      export "${stage#env=}"
      echo "=== ${stage#env=}" | tee -a "$LOG"
      ;;
    bench=*)
      read -r mod args <<< "${stage#bench=}"
      out="$OUT/$mod.json"
      n=2
      while [ -e "$out" ]; do out="$OUT/${mod}_$n.json"; n=$((n + 1)); done  # a module's second stage: MODULE_2.json
      # shellcheck disable=SC2086
      run_stage "bench $mod" python3 -m "bench.$mod" $args --out "$out"
      ;;
    mqar|mqar=*)
      args=$(stage_arg "$stage" mqar)
      mq=${MQAR_OUT:-runs/mqar/full}
      mkdir -p "$mq/jobs"
      if [ -f "${MQAR_JOBS:-}" ]; then
        python3 -m eval.mqar.jobs unpack "$MQAR_JOBS" "$mq/jobs" | tee -a "$LOG"
      elif [ -n "${MQAR_JOBS:-}" ]; then
        for f in "$MQAR_JOBS"/*.json; do [ -e "$f" ] && [ ! -e "$mq/jobs/${f##*/}" ] && cp "$f" "$mq/jobs/"; done
      fi
      # shellcheck disable=SC2086
      run_stage "mqar $args" python3 -m eval.mqar out="$mq" $args
      tar czf "$OUT/mqar_jobs.tgz" -C "$mq" jobs
      ;;
    warm=*)
      # shellcheck disable=SC2086
      run_stage "warm ${stage#warm=}" python3 -m bench.warm_triton --workers "${WARM_WORKERS:-12}" -m ${stage#warm=}
      ;;
    throughput|throughput=*)
      args=$(stage_arg "$stage" throughput)
      # shellcheck disable=SC2086
      run_stage throughput python3 -m bench.mixer_throughput \
        ${args:-${BENCH_ARGS:---mixers kdn_diag kdn_iso kda --T 8192 32768}} --out "$OUT/mixer_throughput.json"
      ;;
    profile)
      for m in ${PROFILE_MIXERS:-kdn_iso kdn_diag kda}; do
        # shellcheck disable=SC2086
        run_stage "profile $m" python3 -m bench.profile_layer --mixer "$m" --T 8192 --rows 25 ${PROFILE_ARGS:-}
      done
      ;;
    profile_step|profile_step=*)
      args=$(stage_arg "$stage" profile_step)
      # shellcheck disable=SC2086
      n_profile=$(( ${n_profile:-0} + 1 ))
      run_stage profile_step python3 -m bench.profile_step ${args} --out "$OUT/profile_step_$n_profile.json"
      ;;
    train100m)
      run_stage train100m bash slurm/gpu_checks.sh 100m
      cp runs/gpu_100m_kdn_diag/summary.json "$OUT/train100m.json" 2>/dev/null
      ;;
    throughput750m|throughput750m=*|throughput750m_paper|throughput750m_paper=*)
      name=${stage%%=*}
      if [ "$name" = throughput750m ]; then check=throughput run=gpu_throughput_750m
      else check=throughput_paper run=gpu_throughput_750m_paper_batch; fi
      run_stage "$stage" bash slurm/gpu_checks.sh $check $(stage_arg "$stage" "$name")
      cp runs/$run/summary.json "$OUT/$name.json" 2>/dev/null
      for r in runs/$run/[0-9]*; do
        [ -f "$r/metrics.jsonl" ] && cp "$r/metrics.jsonl" "$OUT/${name}_$(basename "$r").jsonl"
        [ -f "$r/profile/summary.json" ] && cp "$r/profile/summary.json" "$OUT/${name}_$(basename "$r")_profile.json"
        [ -f "$r/profile/trace.json.gz" ] && cp "$r/profile/trace.json.gz" "$OUT/${name}_$(basename "$r")_trace.json.gz"
      done
      ;;
    parity1|parity2|parity2=*|resume2|resume2=*)
      check=${stage%%=*}
      arg=$(stage_arg "$stage" "$check")
      run_stage "$stage" bash slurm/gpu_checks.sh "$check" ${arg:+"$arg"}
      for r in runs/gpu_parity_* runs/gpu_resume_*; do  # each run's metrics and whichever summaries it wrote
        [ -d "$r" ] && mkdir -p "$OUT/$(basename "$r")" && cp "$r"/{summary,compare}.json "$r"/metrics.jsonl \
          "$OUT/$(basename "$r")/" 2>/dev/null
      done
      ;;
    *)
      echo "unknown stage $stage; stages: kernels[=EXPR] warm=MODULE... bench=MODULE... throughput[=ARGS] profile" \
        "train100m throughput750m[=MIXERS] throughput750m_paper[=MIXERS] parity1 parity2[=ddp|fsdp] resume2[=fsdp|ddp] profile_step[=ARGS] mqar[=ARGS] env=NAME=VALUE" >&2
      exit 2
      ;;
  esac
done
[ -n "${NO_AUTOTUNE_TGZ:-}" ] || { pack_autotune "$OUT/autotune.tgz"; pack_tilelang "$OUT/tilelang_cache.tgz"; }
exit $rc
