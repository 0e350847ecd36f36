# Shared by bench/gpu.sh and bench/gpu_pair.sh (sourced, from the repository root).
# gpu_prepare: install the carried wheels (WHEELS, default .whl/) into /tmp/site, unpack the carried site
#   archives (SITES, default .site/*.tar.xz: installed packages too large as wheels, see models/README.md) into
#   it, and put it on PYTHONPATH; restore bench/kernel_cache/triton/*.tgz into TRITON_CACHE_DIR and
#   bench/kernel_cache/tilelang/*.tgz into TILELANG_CACHE_DIR. With GPU_PREPARED set, only PYTHONPATH is set (a parent
#   script prepared this machine already).
# pack_autotune FILE: every *.autotune.json under TRITON_CACHE_DIR as one tarball, for bench/kernel_cache/triton/.
# pack_tilelang FILE: TileLang's compiled kernels (TILELANG_CACHE_DIR) as one tarball, for bench/kernel_cache/tilelang/;
#   nothing when it holds none. Without them a fresh machine compiles Mamba-3 MIMO's three kernels first (26-86 s
#   each on an H200), minutes before a MIMO model trains.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton}
# every autotuner keeps its choice in that cache, also those that do not ask to (mamba-ssm's: its SISO kernels
# otherwise retune in every process)
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tilelang}

gpu_prepare() {
  local wheels=${WHEELS:-.whl} sites=${SITES:-.site} t have_wheels=0 have_sites=0
  # each kind is tested on its own: one ls of both globs fails as soon as either matches nothing
  compgen -G "$wheels/*.whl" >/dev/null && have_wheels=1
  compgen -G "$sites/*.tar.xz" >/dev/null && have_sites=1
  if [ "$have_wheels" = 1 ] || [ "$have_sites" = 1 ]; then
    if [ -z "${GPU_PREPARED:-}" ]; then
      if [ "$have_wheels" = 1 ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          "$wheels"/*.whl || return 1
      fi
      for t in "$sites"/*.tar.xz; do
        [ -e "$t" ] || continue
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall("/tmp/site", filter="data")' "$t" \
          || return 1
      done
    fi
    export PYTHONPATH=/tmp/site:$PWD
  fi
  [ -n "${GPU_PREPARED:-}" ] && return 0
  mkdir -p "$TRITON_CACHE_DIR"
  for t in bench/kernel_cache/triton/*.tgz; do
    [ -e "$t" ] || continue
    tar xzf "$t" --strip-components=1 -C "$TRITON_CACHE_DIR" || return 1
  done
  mkdir -p "$TILELANG_CACHE_DIR"
  for t in bench/kernel_cache/tilelang/*.tgz; do [ -e "$t" ] && tar xzf "$t" -C "$TILELANG_CACHE_DIR"; done
  return 0
}

pack_autotune() {
  # shellcheck disable=SC2046
  (cd "$TRITON_CACHE_DIR" && tar czf - $(find . -name '*.autotune.json')) > "$1"
}

pack_tilelang() {
  [ -n "$(find "$TILELANG_CACHE_DIR" -type f -not -path "$TILELANG_CACHE_DIR/tmp/*" 2>/dev/null | head -1)" ] \
    || return 0
  tar czf "$1" --exclude=tmp -C "$TILELANG_CACHE_DIR" .
}
