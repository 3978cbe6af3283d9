#!/usr/bin/env bash
# The owed GPU checks of issue 18 (and 17) for a session whose GPU machine gives 15 minutes of
# device time, start and idle included: one call of about 9 minutes (`first`), the most decisive
# checks first, then, only if the machine is still warm and time is left, a short second call
# (`second`). Build and fetch what they carry here first (scripts/gpu/prep.sh); docs/devices.md,
# "The owed GPU checks", gives the calls.
#
#   scripts/gpu/session.sh first    # carry .gpu .gl (timeout_s 600):
#                                   # rtune doctor through Vulkan; rtune's own products and
#                                   # attention on CUDA and Vulkan (gpu_kernels timings: the matrix-unit
#                                   # attention's check); the products with each of gemm_cm's
#                                   # tiles (gpu_kernels tiles); SmolLM2-360M at 4×512 through
#                                   # Vulkan against PyTorch + PEFT on CUDA; the GPU engine's
#                                   # tests through Vulkan; the default recipe through Vulkan
#                                   # against the CPU;
#                                   # SmolLM2-135M as the 360M; the engine's tests on CUDA; a
#                                   # calibrated q4_k_m on CUDA against the CPU's; a scratch
#                                   # Gemma 3's q8_0 GGUF self-checked on CUDA
#   BUDGET=120 scripts/gpu/session.sh second   # carry .gpu .gl: what `first` leaves, most
#                                   # wanted first: `rtune doctor --check` (which kernels each
#                                   # GPU runs per dtype, the products' rate); the 360M through
#                                   # Vulkan with the tile `first`
#                                   # found fastest, and with attention through products, a
#                                   # kernel profile of its steps, Vulkan f16,
#                                   # QLoRA and the full fine-tune on CUDA and Vulkan against
#                                   # the CPU, QLoRA on CUDA against
#                                   # PyTorch + bitsandbytes, rtune on CUDA, the scalar
#                                   # attention's share, QLoRA through Vulkan, the exports' GPU
#                                   # memory for a 1.1B model
#
# BUDGET (seconds, default 540) bounds the whole call: every step has its own limit, cut to what
# is left, and a step that cannot get its minimum is skipped and named, so the call ends inside
# `run`'s timeout_s with everything it measured. The device tool brings back at most 8 files, so
# the call leaves two under $OUT: summary.txt (also printed at the end) and logs.tgz (every log,
# repacked after each step, so a call cut short still brings back what it finished). A dry run
# without a GPU, on lavapipe (PyTorch on the CPU, a fake nvidia-smi on PATH):
#   RTUNE_TIMING_TOKENS=32 SHAPES=smoke:2x128 TORCH_DEVICE=cpu scripts/gpu/session.sh first
set -uo pipefail
cd "$(dirname "$0")/../.."
part="${1:-first}"
case "$part" in first | second) ;; *)
  echo "unknown part $part: first or second" >&2
  exit 2
  ;;
esac
budget="${BUDGET:-540}"
final="${OUT:-/tmp/rtune-gpu-session-out}"
work="${WORK:-/tmp/rtune-gpu-session}/$part"
rm -rf "$work"
mkdir -p "$work" "$final"
export RTUNE_NO_PROGRESS=1 PYTHONUNBUFFERED=1
summary="$final/summary.txt"
: >"$summary"
status=0
say() { echo "$*" | tee -a "$summary"; }
pack() { tar -czf "$final/logs.tgz.part" -C "$work" . && mv "$final/logs.tgz.part" "$final/logs.tgz"; }
# step NAME LIMIT MIN COMMAND...: runs COMMAND with its output in NAME.txt, for at most LIMIT
# seconds (or what the budget has left); skipped when less than MIN is left.
step() {
  local name=$1 limit=$2 min=$3
  shift 3
  local left=$((budget - SECONDS))
  if [ "$left" -lt "$min" ]; then
    say "== $name: skipped, ${left} s of the budget left (needs ${min} s)"
    status=1
    return 1
  fi
  [ "$limit" -le "$left" ] || limit=$left
  local t0=$SECONDS rc=0
  timeout -k 5 "$limit" "$@" >"$work/$name.txt" 2>&1 || rc=$?
  local how="ok"
  [ $rc = 0 ] || how="FAILED (exit $rc)"
  [ $rc != 124 ] && [ $rc != 137 ] || how="STOPPED at its ${limit} s limit"
  [ $rc = 0 ] || status=1
  say "== $name: $how, $((SECONDS - t0)) s"
  pack
  return $rc
}
# show NAME PATTERN: the lines of a step's log that say what it found.
show() { grep -E "$2" "$work/$1.txt" 2>/dev/null | head -"${3:-60}" | tee -a "$summary"; }
bench_table() { # the benchmark's table and each run's last training line
  show "$1" "^\||MFU|rtune failed|train +eval loss|tok/s|kernels |failed a check|[Ee]rror|Traceback"
}

# The loader into the system, as the device README says, so that every program finds it.
for f in .gl/*.deb; do [ ! -e "$f" ] || dpkg -x "$f" /; done
ldconfig
# shellcheck source=/dev/null
. scripts/gpu/env.sh
say "== $(date -u +%FT%TZ) part $part, budget ${budget} s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv,noheader 2>&1 |
  tee -a "$summary"
read -ra shapes <<<"${SHAPES:-smollm2-360m:4x512 smollm2-135m:4x512}"
doctor_units() { # the matrix units' types that doctor lists for the Vulkan device
  grep -A1 "^  vulkan:" "$work/doctor.txt" | grep -o "cooperative matrices: .*" | grep -oE "\bb?f16\b" |
    sort -u | paste -sd, || true
}

case "$part" in
first)
  step doctor 30 5 .gpu/rtune doctor
  show doctor "." 40
  if grep -q "^  vulkan .*unavailable" "$work/doctor.txt"; then # why: the loader's own account
    step vulkan-probe 20 5 bash -c 'echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-}"; ls -l /usr/local/nvidia/share/vulkan/icd.d /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>&1; find / -xdev -name "*nvidia*icd*.json" 2>/dev/null | head; ldconfig -p | grep -E "libvulkan|GLX_nvidia|GLdispatch"; VK_LOADER_DEBUG=error,warn,driver .gpu/rtune doctor 2>&1 | grep -v "^  cpu" | head -60'
    show vulkan-probe "." 80
  fi
  step timings 120 30 .gpu/gpu_kernels timings
  show timings "^\||did not run|panicked|failed a check|matrix loads"
  # The products on the matrix units with each of gemm_cm's tiles beside the one the engine picks.
  step tiles 60 20 .gpu/gpu_kernels tiles
  show tiles "^\||fastest tile|no Vulkan|panicked|failed"
  # The speed goal: ≥ 0.5× PyTorch + PEFT on CUDA for the 360M shape at 4 × 512.
  OUT="$work/bench-vulkan-bf16" DEVICE=vulkan step bench-vulkan-bf16 170 60 scripts/gpu/bench.sh "${shapes[0]}"
  bench_table bench-vulkan-bf16
  # Correctness on a hardware Vulkan driver, on the matrix units doctor lists.
  RTUNE_REQUIRE_MATRIX_UNITS="$(doctor_units)" RTUNE_TEST_DEVICES=vulkan RTUNE_REQUIRE_VULKAN=1 \
    step tests-vulkan 150 40 .gpu/gpu_engine --test-threads 1
  show tests-vulkan "test result|panicked|FAILED|failed a check|matrix loads" 25
  # The default recipe through Vulkan against the CPU (eval loss within 1e-4).
  OUT="$work/verify-vulkan" CHECKS="cpu vulkan" TESTS=0 step verify-vulkan 120 50 scripts/gpu/verify.sh
  show verify-vulkan "eval loss|within|rror|FAIL|passed|no Vulkan"
  [ ${#shapes[@]} -lt 2 ] || {
    OUT="$work/bench-vulkan-bf16-2" DEVICE=vulkan step bench-vulkan-bf16-2 120 60 scripts/gpu/bench.sh "${shapes[1]}"
    bench_table bench-vulkan-bf16-2
  }
  # The engine's tests on CUDA (QLoRA kernels, data parallel with GPU 0 twice), and a q4_k_m
  # export calibrated and self-checked on CUDA beside the CPU's (candle's portable GGUF kernels).
  RTUNE_TEST_DEVICES=cuda RTUNE_REQUIRE_CUDA=1 step tests-cuda 100 40 .gpu/gpu_engine --test-threads 1
  show tests-cuda "test result|panicked|FAILED" 25
  OUT="$work/verify-q4km" CHECKS="cpu q4km" TESTS=0 step verify-q4km 90 40 scripts/gpu/verify.sh
  show verify-q4km "perplexity|vs CPU|rror|FAIL|passed"
  # A scratch Gemma 3 to its q8_0 GGUF on CUDA and the CPU: the GGUF read back as llama.cpp does
  # (export::gguf::read) on the device, beside the CPU's.
  OUT="$work/verify-gemma3" CHECKS="gemma3" TESTS=0 step verify-gemma3 60 20 scripts/gpu/verify.sh
  show verify-gemma3 "GGUF|rror|FAIL|passed"
  ;;
second)
  # Which kernels each GPU runs in each dtype after the first-use checks, and the products' rate.
  step doctor-check 45 15 .gpu/rtune doctor --check
  show doctor-check "^  (vulkan|cuda)|^ +(products|attention)|error|failed a check" 30
  # The 360M shape with the tile `first` found fastest over the products for every product, where
  # the machine kept `first`'s logs: does the engine's per-product pick lose to one fixed tile?
  tile=$(grep -o "fastest tile over the bf16 products: [0-9]*x[0-9]*" "${WORK:-/tmp/rtune-gpu-session}/first/tiles.txt" \
    2>/dev/null | grep -o "[0-9]*x[0-9]*$" || true)
  if [ -n "$tile" ]; then
    say "== the fastest tile in first: $tile"
    OUT="$work/bench-vulkan-tile" RTUNE_VULKAN_GEMM_TILE=$tile DEVICE=vulkan SKIP_TORCH=1 step bench-vulkan-tile 80 40 \
      scripts/gpu/bench.sh "${shapes[0]}"
    bench_table bench-vulkan-tile
  fi
  # Attention through matrix products (the engine's choice where the matrix-unit attention
  # fails its check or does not exist) against what the engine picks (bench-vulkan-bf16 in first).
  OUT="$work/bench-vulkan-products" RTUNE_GPU_ATTENTION=products DEVICE=vulkan SKIP_TORCH=1 \
    step bench-vulkan-products 80 40 scripts/gpu/bench.sh "${shapes[0]}"
  bench_table bench-vulkan-products
  # Where a Vulkan step's time goes, kernel by kernel (each dispatch waited for, so slower than the
  # benchmark; 5 steps): what to speed up next once products and attention are fast.
  OUT="$work/profile-vulkan" RTUNE_PROFILE=kernels STEPS=5 DEVICE=vulkan SKIP_TORCH=1 step profile-vulkan 60 30 \
    scripts/gpu/bench.sh "${shapes[0]}"
  grep -hE "in kernels|µs/call" "$work"/profile-vulkan/*.log 2>/dev/null | head -30 | tee -a "$summary"
  OUT="$work/bench-vulkan-f16" DEVICE=vulkan DTYPE=f16 SKIP_TORCH=1 step bench-vulkan-f16 80 40 \
    scripts/gpu/bench.sh "${shapes[0]}"
  bench_table bench-vulkan-f16
  # Gemma 3 (since 2026-12-02; its engine tests ran in `first`): the 270M shape through Vulkan and
  # on CUDA, each against PyTorch + PEFT on CUDA.
  OUT="$work/bench-gemma3-vulkan" DEVICE=vulkan step bench-gemma3-vulkan 100 50 scripts/gpu/bench.sh gemma3-270m:4x512
  bench_table bench-gemma3-vulkan
  OUT="$work/bench-gemma3-cuda" DEVICE=cuda SKIP_TORCH=1 step bench-gemma3-cuda 60 30 scripts/gpu/bench.sh gemma3-270m:4x512
  bench_table bench-gemma3-cuda
  OUT="$work/verify-cuda" CHECKS="cpu qlora full vulkan" TESTS=0 step verify-cuda 240 90 scripts/gpu/verify.sh
  show verify-cuda "eval loss|perplexity|within|vs CPU|rror|FAIL|passed"
  # QLoRA on CUDA against PyTorch + PEFT + bitsandbytes (carried by scripts/gpu/prep.sh), 135M at 4 × 512.
  OUT="$work/bench-cuda-qlora" DEVICE=cuda TRAIN=qlora step bench-cuda-qlora 120 60 \
    scripts/gpu/bench.sh smollm2-135m:4x512
  bench_table bench-cuda-qlora
  OUT="$work/bench-cuda-bf16" DEVICE=cuda SKIP_TORCH=1 step bench-cuda-bf16 60 30 scripts/gpu/bench.sh "${shapes[0]}"
  bench_table bench-cuda-bf16
  OUT="$work/bench-vulkan-f16-scalar" RTUNE_GPU_ATTENTION=scalar DEVICE=vulkan DTYPE=f16 SKIP_TORCH=1 \
    step bench-vulkan-f16-scalar 60 30 scripts/gpu/bench.sh "${shapes[0]}"
  bench_table bench-vulkan-f16-scalar
  # QLoRA's speed through Vulkan (on CUDA: 109,824 tok/s on an H200, 2026-11-27).
  OUT="$work/bench-vulkan-qlora" DEVICE=vulkan TRAIN=qlora SKIP_TORCH=1 step bench-vulkan-qlora 60 30 \
    scripts/gpu/bench.sh smollm2-135m:4x512
  bench_table bench-vulkan-qlora
  # The exports' device memory for a large model (TinyLlama-1.1B's shape, 4.4 GB in f32): the
  # self-checks run one decoder layer at a time on the GPU. Its files stay out of the logs.
  rm -rf /tmp/rtune-export-1b
  DEVICE=cuda BENCH_DIR=/tmp/rtune-export-1b step export-memory-cuda 150 60 \
    scripts/bench/export-memory.sh 1b "$PWD/.gpu/rtune"
  show export-memory-cuda "quantize \\(|rror"
  ;;
esac
pack
echo
say "part $part: $([ $status = 0 ] && echo "every step ran and passed" || echo "SOME STEPS FAILED OR WERE SKIPPED") in $SECONDS s (logs: logs.tgz)"
exit $status
