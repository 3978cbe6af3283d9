#!/usr/bin/env bash
# Build rtune with `--features cuda` on a machine without a GPU or a CUDA install (the toolkit
# comes from scripts/cuda-toolkit.sh), and pack what a GPU machine runs into .gpu/: the stripped
# release binary and the GPU test binaries, gzipped (a GPU machine here takes 64 MiB per call;
# the binary is ~70 MiB stripped, ~20 MiB compressed). On the GPU machine:
#
#   . scripts/gpu-env.sh && .gpu/rtune doctor && scripts/gpu-verify.sh
#
# `--lint` (CI) only lints the CUDA code — clippy with `--features cuda`, warnings denied, which
# compiles every CUDA path and, through the build scripts, kernels.cu and candle's kernels with
# nvcc — and builds nothing to run: the release build is ~20 minutes and several GB cold, worth
# it only where a GPU will run it.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/cuda-toolkit.sh)"
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
  exec cargo clippy --locked --features cuda --all-targets -- -D warnings
fi
cargo build --locked --release --features cuda
mkdir -p .gpu
strip -o .gpu/rtune "$CARGO_TARGET_DIR/release/rtune"
gzip -f -6 .gpu/rtune
tests=$(cargo test --locked --release --features cuda --test gpu_engine --no-run --message-format=json 2>/dev/null |
  grep -o '"executable":"[^"]*"' | sed 's/"executable":"//; s/"$//')
for t in $tests; do
  strip -o ".gpu/$(basename "$t" | sed 's/-[0-9a-f]*$//')" "$t"
  gzip -f -6 ".gpu/$(basename "$t" | sed 's/-[0-9a-f]*$//')"
done
pwd >.gpu/manifest-dir
ls -la .gpu
du -ch .gpu/*.gz | tail -1
