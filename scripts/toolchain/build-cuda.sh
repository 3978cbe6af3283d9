#!/usr/bin/env bash
# Build rtune with `--features cuda` on a machine without a GPU or a CUDA install (the toolkit
# comes from scripts/toolchain/cuda-toolkit.sh), and pack what a GPU machine runs into .gpu/: the stripped
# release binary, the GPU engine's tests and its kernel timings (benches/gpu_kernels.rs), gzipped (a GPU machine here takes 64 MiB per call;
# the binary is ~70 MiB stripped, ~20 MiB compressed). On the GPU machine:
#
#   . scripts/gpu/env.sh && .gpu/rtune doctor && scripts/gpu/verify.sh
#
# `--lint` (CI) only lints the CUDA code — clippy with `--features cuda`, warnings denied, which
# compiles every CUDA path and, through the build scripts, kernels.cu and candle's kernels with
# nvcc — and builds nothing to run: the release build is ~20 minutes and several GB cold, worth
# it only where a GPU will run it.
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(scripts/toolchain/cuda-toolkit.sh)"
# The lint checks in cargo's own target folder, reusing what CI's clippy checked (every crate
# whose features `cuda` leaves alone); the release build keeps a folder of its own.
if [ "${1:-}" = "--lint" ]; then
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
else
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda}"
fi
# candle-kernels' build script (cudaforge) compiles its quantized-matmul and MoE kernels with one
# nvcc at a time on half the cores — one on a 2-core runner, ~16 of CI's minutes — unless told.
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
if [ "${1:-}" = "--lint" ]; then
  # candle-kernels' build script also compiles llama.cpp's quantized-matmul and MoE kernels
  # (candle's quantized MoE; rtune calls none of them) into a static library: ~7 minutes of both
  # cores on a 2-core Xeon, for objects that a lint never links. The lint's nvcc (NVCC, which
  # rtune's build script and cudaforge both read first) compiles every PTX module for real —
  # rtune's kernels.cu and candle's, which the Rust code embeds — and makes each object compile
  # (`-c`) an empty object instead; the build below, where a GPU will run it, compiles them all.
  # A fixed path: NVCC is part of the build scripts' fingerprints (a changed one reruns them), and
  # a build without it (or the release build's folder) reruns them with the real nvcc.
  stub=$(realpath -m "$CARGO_TARGET_DIR")/nvcc-lint
  rm -rf "$stub"
  mkdir -p "$stub/bin"
  for d in include lib lib64; do [ ! -e "$CUDA_HOME/$d" ] || ln -s "$CUDA_HOME/$d" "$stub/$d"; done
  {
    echo '#!/usr/bin/env bash'
    echo 'args=("$@") out= object='
    echo 'while [ $# -gt 0 ]; do case $1 in -c) object=1 ;; -o) out=$2 ;; esac; shift; done'
    echo 'if [ -n "$object" ] && [ -n "$out" ]; then exec cc -c -x c /dev/null -o "$out"; fi'
    echo "exec '$CUDA_HOME/bin/nvcc' \"\${args[@]}\""
  } >"$stub/bin/nvcc"
  chmod +x "$stub/bin/nvcc"
  rc=0
  NVCC="$stub/bin/nvcc" cargo clippy --locked --features cuda --all-targets -- -D warnings || rc=$?
  # cudaforge keeps a cache of the objects it compiled, which a later build in this folder (run
  # again for its different NVCC) would trust: forget it, so that build compiles them for real.
  rm -f "$CARGO_TARGET_DIR"/debug/build/candle-kernels-*/out/.cudaforge_cache.json
  exit $rc
fi
cargo build --locked --release --features cuda
mkdir -p .gpu
strip -o .gpu/rtune "$CARGO_TARGET_DIR/release/rtune"
gzip -f -6 .gpu/rtune
tests=$(cargo test --locked --release --features cuda --test gpu_engine --bench gpu_kernels --no-run --message-format=json 2>/dev/null |
  grep -o '"executable":"[^"]*"' | sed 's/"executable":"//; s/"$//')
for t in $tests; do
  strip -o ".gpu/$(basename "$t" | sed 's/-[0-9a-f]*$//')" "$t"
  gzip -f -6 ".gpu/$(basename "$t" | sed 's/-[0-9a-f]*$//')"
done
pwd >.gpu/manifest-dir
ls -la .gpu
du -ch .gpu/*.gz | tail -1
