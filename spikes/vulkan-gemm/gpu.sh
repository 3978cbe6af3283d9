#!/usr/bin/env bash
# Issue 18's spike on the GPU machine: every candidate's GEMM rate through Vulkan on the NVIDIA
# driver, beside cuBLAS through PyTorch, in one command. Run from the repository root with the
# spike binaries carried gzipped under .gpu-spike/ (spikes/vulkan-gemm/build.sh makes them) and
# the Vulkan loader's .deb under .gl/ (scripts/gpu-prep.sh makes both; docs/devices.md, "The
# owed GPU checks"). A candidate not carried (burn, usually: 23 minutes to build) is skipped.
#
#   spikes/vulkan-gemm/gpu.sh      # CANDIDATE_TIMEOUT (s, default 60) bounds each candidate
set -uo pipefail
cd "$(dirname "$0")/../.."
for f in .gl/*.deb; do [ ! -e "$f" ] || dpkg -x "$f" /; done
ldconfig
# shellcheck source=/dev/null
. scripts/gpu-env.sh # NVIDIA's Vulkan ICD file, wherever the driver put it
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for z in .gpu-spike/vulkan-gemm-*.gz; do gunzip -c "$z" >"${z%.gz}" && chmod +x "${z%.gz}"; done
candidate() { # label binary args...
  local label=$1 bin=$2
  shift 2
  echo "== $label"
  # Each candidate has its own time limit, so one that hangs leaves the others their time.
  if [ -x "$bin" ]; then
    timeout "${CANDIDATE_TIMEOUT:-60}" "$bin" "$@" || { echo "($label failed: exit $?)"; failed=1; }
  else
    echo "(not carried: $bin)"
  fi
}
failed=0
iters=${ITERS:-30}
# CUBLAS_DTYPES=bf16 leaves out cuBLAS's f32 (a session short of minutes: bf16 is the rule's).
for dt in ${CUBLAS_DTYPES:-bf16 f32}; do
  echo "== cuBLAS (PyTorch) $dt"
  timeout 90 python3 spikes/vulkan-gemm/cublas.py --dtype "$dt" --iters "$iters"
done
for dt in f16 f32; do
  candidate "ash + SPIR-V (device addresses) $dt" .gpu-spike/vulkan-gemm-ash --dtype "$dt" --iters "$iters"
done
candidate "wgpu + WGSL f32" .gpu-spike/vulkan-gemm-wgsl --dtype f32 --iters "$iters"
for dt in f16 f32; do
  candidate "burn/CubeCL $dt" .gpu-spike/vulkan-gemm-burn --dtype "$dt" --iters "$iters"
done
exit $failed
