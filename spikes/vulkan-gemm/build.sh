#!/usr/bin/env bash
# Build each candidate of issue 18's spike on its own (release), timing the build from a clean
# target folder and reporting the binary's size and its crate count; copies the binaries
# gzipped to $SPIKE_OUT (default .gpu-spike/ at the repository's root, git-ignored) for
# spikes/vulkan-gemm/gpu.sh.
#
#   spikes/vulkan-gemm/build.sh [wgsl] [burn] [ash]
set -euo pipefail
cd "$(dirname "$0")"
grep "model name" /proc/cpuinfo | head -1; nproc
out="$(cd ../.. && pwd)/${SPIKE_OUT:-.gpu-spike}"
mkdir -p "$out"
for c in "${@:-wgsl burn ash}"; do
  for cand in $c; do
    target="${SPIKE_TARGET:-/tmp/vulkan-gemm-target}-$cand"
    rm -rf "$target"
    cargo fetch --quiet
    start=$(date +%s)
    CARGO_TARGET_DIR="$target" cargo build --release --quiet --features "$cand"
    end=$(date +%s)
    crates=$(cargo tree --features "$cand" -e normal --prefix none | sed 's/ (\*)//' | sort -u | wc -l)
    bin="$target/release/vulkan-gemm"
    size=$(stat -c %s "$bin")
    echo "$cand: clean release build $((end - start)) s, binary $((size / 1024 / 1024)) MiB, $crates crates"
    gzip -c "$bin" >"$out/vulkan-gemm-$cand.gz"
  done
done
