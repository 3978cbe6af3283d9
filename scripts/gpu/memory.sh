#!/usr/bin/env bash
# Memory checks on a GPU machine, after scripts/gpu/bench.sh has written its recipes (same
# GPU_BENCH_DIR): the 3B shape at 4 × 1024 with activation checkpointing (peak and speed
# against the run without; ONLY_OOM=1 skips it), and a batch far too large with checkpointing
# off, to show the out-of-memory error and what it suggests.
#
#   . scripts/gpu/env.sh && scripts/gpu/bench.sh qwen2.5-3b:4x1024 && scripts/gpu/memory.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
root="${GPU_BENCH_DIR:-/tmp/rtune-gpu-bench}"
rtune="${RTUNE:-.gpu/rtune}"
recipe="$root/qwen2.5-3b-4x1024.toml"
export RTUNE_NO_PROGRESS=1 RTUNE_CACHE_DIR="$root/cache"
if [ -z "${ONLY_OOM:-}" ]; then
  echo "== qwen2.5-3b 4×1024 with gradient_checkpointing = true"
  "$rtune" run "$recipe" --force train --set stages.train.gradient_checkpointing=true 2>&1 | grep -E "train  .*(steps|tok/s)" | tail -2
fi
echo "== qwen2.5-3b 128×1024 with gradient_checkpointing = false (expected: out of memory)"
"$rtune" run "$recipe" --force train --set stages.train.batch_size=128 --set stages.train.gradient_checkpointing=false >"$root/oom.log" 2>&1
code=$?
tail -12 "$root/oom.log"
echo "exit code $code"
