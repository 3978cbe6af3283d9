#!/usr/bin/env bash
# The owed GPU checks of issue 18 (and 17), in parts that each fit one `run` call (10 minutes)
# on the lent NVIDIA machine, most decisive first. Build and fetch what they carry here first
# (scripts/gpu-prep.sh); docs/devices.md, "The owed GPU checks", gives the calls.
#
#   scripts/gpu-session.sh vulkan   # carry .gpu .gpu-spike .gl: rtune doctor through Vulkan; the
#                                   # GEMM spike (cuBLAS beside each candidate); rtune's own
#                                   # products and attention on CUDA and Vulkan side by side
#                                   # (gpu_timings); the GPU engine's tests through Vulkan
#   scripts/gpu-session.sh verify   # carry .gpu .gl: scripts/gpu-verify.sh without the tests
#                                   # (CUDA and Vulkan against the CPU: default recipe, bf16/f16,
#                                   # full fine-tune)
#   scripts/gpu-session.sh bench    # carry .gpu .gl: SmolLM2-135M/360M at 4×512 through Vulkan
#                                   # (bf16, then f16) against PyTorch + PEFT on CUDA, and rtune
#                                   # on CUDA
#   scripts/gpu-session.sh more     # carry .gpu .gl: the scalar attention's share, a full
#                                   # fine-tune against PyTorch on CUDA and through Vulkan, and
#                                   # QLoRA (nf4-dq) on CUDA and through Vulkan
#
# Logs and results go under $OUT/<part> (the device tool brings $OUT back); the end of the
# output is a summary. SHAPES overrides the benchmarks' shapes. A dry run without a GPU, on
# lavapipe (with PyTorch on the CPU and a fake nvidia-smi on PATH):
#   RTUNE_TIMING_TOKENS=32 SHAPES=smoke:2x128 TORCH_DEVICE=cpu scripts/gpu-session.sh bench
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:?which part: vulkan, verify, bench or more}"
out="${OUT:-/tmp/rtune-gpu-session}/$part"
mkdir -p "$out"
export OUT="$out" RTUNE_NO_PROGRESS=1
# The loader into the system, as the device README says, so that every program finds it.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
# shellcheck source=/dev/null
. scripts/gpu-env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
read -ra shapes <<<"${SHAPES:-smollm2-135m:4x512 smollm2-360m:4x512}"
status=0
log() { echo "== $*" | tee -a "$out/summary.txt"; }
summarize() { # benchmark logs: their tables and each rtune run's last training line
  for f in "$@"; do
    echo "-- $f" | tee -a "$out/summary.txt"
    grep -E "^\||MFU|rtune failed|train +eval loss|error" "$out/$f.txt" | tee -a "$out/summary.txt"
  done
}

case "$part" in
vulkan)
  log "rtune doctor"
  .gpu/rtune doctor 2>&1 | tee "$out/doctor.txt" | tee -a "$out/summary.txt" || status=1
  log "GEMM spike (cuBLAS, then each candidate through Vulkan)"
  timeout 300 spikes/vulkan-gemm/gpu.sh >"$out/spike.txt" 2>&1 || status=1
  grep -E "^==|GFLOP|TFLOP|error|skipped|not carried" "$out/spike.txt" | head -60 | tee -a "$out/summary.txt"
  log "rtune's products and attention on CUDA and through Vulkan (gpu_timings)"
  timeout 120 .gpu/gpu_engine --ignored --nocapture --test-threads 1 gpu_timings >"$out/timings.txt" 2>&1 || status=1
  grep -E "^\||did not run|panicked" "$out/timings.txt" | tee -a "$out/summary.txt"
  log "the GPU engine's tests (emulator, CUDA, and through Vulkan on the matrix units doctor lists)"
  mu=$(grep -A1 "^  vulkan:" "$out/doctor.txt" | grep -o "cooperative matrices: .*" | grep -oE "\bb?f16\b" | sort -u | paste -sd, || true)
  RTUNE_REQUIRE_MATRIX_UNITS="$mu" RTUNE_REQUIRE_VULKAN=1 timeout 150 .gpu/gpu_engine --test-threads 1 \
    >"$out/gpu_engine-vulkan.txt" 2>&1 || status=1
  grep -E "test result|panicked|FAILED" "$out/gpu_engine-vulkan.txt" | tee -a "$out/summary.txt"
  ;;
verify)
  # The engine's tests ran in part `vulkan`.
  TESTS=0 timeout 560 scripts/gpu-verify.sh >"$out/verify.txt" 2>&1 || status=1
  sed -n '/^== CUDA vs CPU/,$p' "$out/verify.txt" | tee -a "$out/summary.txt"
  ;;
bench)
  log "Vulkan bf16 against PyTorch + PEFT"
  OUT="$out/vulkan-bf16" DEVICE=vulkan timeout 250 scripts/gpu_bench.sh "${shapes[@]}" >"$out/vulkan-bf16.txt" 2>&1 || status=1
  log "Vulkan f16 (cooperative matrices where listed)"
  OUT="$out/vulkan-f16" DEVICE=vulkan DTYPE=f16 SKIP_TORCH=1 timeout 120 scripts/gpu_bench.sh "${shapes[@]}" \
    >"$out/vulkan-f16.txt" 2>&1 || status=1
  log "CUDA bf16"
  OUT="$out/cuda-bf16" DEVICE=cuda SKIP_TORCH=1 timeout 120 scripts/gpu_bench.sh "${shapes[@]}" >"$out/cuda-bf16.txt" 2>&1 || status=1
  summarize vulkan-bf16 vulkan-f16 cuda-bf16
  ;;
more)
  log "Vulkan f16 with the scalar attention kernels"
  OUT="$out/vulkan-f16-scalar" RTUNE_GPU_ATTENTION=scalar DEVICE=vulkan DTYPE=f16 SKIP_TORCH=1 timeout 120 \
    scripts/gpu_bench.sh "${shapes[1]:-${shapes[0]}}" >"$out/vulkan-f16-scalar.txt" 2>&1 || status=1
  log "full fine-tune: CUDA against PyTorch, then Vulkan"
  OUT="$out/full-cuda" TRAIN=full timeout 200 scripts/gpu_bench.sh "${shapes[0]}" >"$out/full-cuda.txt" 2>&1 || status=1
  OUT="$out/full-vulkan" TRAIN=full DEVICE=vulkan SKIP_TORCH=1 timeout 150 scripts/gpu_bench.sh "${shapes[0]}" \
    >"$out/full-vulkan.txt" 2>&1 || status=1
  log "QLoRA (nf4-dq, bf16): CUDA, then Vulkan (rtune alone: the image has no bitsandbytes)"
  OUT="$out/qlora-cuda" TRAIN=qlora SKIP_TORCH=1 timeout 60 scripts/gpu_bench.sh "${shapes[1]:-${shapes[0]}}" \
    >"$out/qlora-cuda.txt" 2>&1 || status=1
  OUT="$out/qlora-vulkan" TRAIN=qlora DEVICE=vulkan SKIP_TORCH=1 timeout 60 scripts/gpu_bench.sh \
    "${shapes[1]:-${shapes[0]}}" >"$out/qlora-vulkan.txt" 2>&1 || status=1
  summarize vulkan-f16-scalar full-cuda full-vulkan qlora-cuda qlora-vulkan
  ;;
*)
  echo "unknown part $part: vulkan, verify, bench or more" >&2
  exit 2
  ;;
esac
echo
[ $status = 0 ] && echo "part $part: done" || echo "part $part: SOME CHECKS FAILED (logs under $out)"
exit $status
