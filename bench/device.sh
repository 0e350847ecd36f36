#!/bin/bash
# Kernel-side GPU work on a lent H200 (the `device` tool): one stage per call, logs and JSON under $OUT.
#   bash bench/device.sh kernels      # every gpu-marked kdn/mixer test, accuracy rows -> $OUT/accuracy.jsonl
#   bash bench/device.sh throughput   # bench.mixer_throughput at T = 8K and 32K (KDN, KDA, baselines)
#   bash bench/device.sh profile      # top CUDA kernels of one KDN layer fwd+bwd (8K)
# The device image lacks fla: carry its wheels in .whl/ (`pip download --no-deps flash-linear-attention==0.6.0
# fla-core==0.6.0 -d .whl`). bench/triton_cache/*.tgz holds Triton autotune results for that stack; restoring
# them skips most first-call autotuning (several minutes per fla op otherwise).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/device}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton} PYTHONUNBUFFERED=1
mkdir -p "$TRITON_CACHE_DIR"
for t in bench/triton_cache/*.tgz; do tar xzf "$t" --strip-components=1 -C "$TRITON_CACHE_DIR"; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
case "${1:-}" in
  kernels)
    KDN_ACCURACY_JSON=$OUT/accuracy.jsonl python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kdn_triton.py tests/test_mixers_gpu.py 2>&1 | tail -40 | tee "$OUT/kernels.log"
    ;;
  throughput)
    python3 -m bench.mixer_throughput --T 8192 32768 --out "$OUT/mixer_throughput.json" 2>&1 \
      | grep -v Warning | tee "$OUT/throughput.log"
    ;;
  profile)
    for m in kdn_iso kdn_diag kda; do python3 -m bench.profile_layer --mixer "$m" --T 8192 --rows 20; done \
      2>&1 | grep -v Warn | tee "$OUT/profile.log"
    ;;
  *)
    echo "usage: $0 kernels|throughput|profile" >&2
    exit 2
    ;;
esac
rc=$?
(cd "$TRITON_CACHE_DIR" && tar czf - $(find . -name '*.autotune.json')) > "$OUT/autotune.tgz"  # for bench/triton_cache
exit $rc
