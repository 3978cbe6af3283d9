#!/usr/bin/env bash
# Issue 18's spike on the GPU machine: every candidate's GEMM rate through Vulkan on the NVIDIA
# driver, beside cuBLAS through PyTorch, in one command. Run from the repository root with the
# spike binaries carried gzipped under .gpu/ (spikes/vulkan-gemm/build.sh makes them) and the
# Vulkan loader's .deb under .gl/ (docs/devices.md says how):
#
#   spikes/vulkan-gemm/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for z in .gpu/vulkan-gemm-*.gz; do gunzip -c "$z" >"${z%.gz}" && chmod +x "${z%.gz}"; done
iters=${ITERS:-30}
echo "== cuBLAS (PyTorch) bf16";  python3 spikes/vulkan-gemm/cublas.py --dtype bf16 --iters "$iters"
echo "== cuBLAS (PyTorch) f32";   python3 spikes/vulkan-gemm/cublas.py --dtype f32 --iters "$iters"
echo "== wgpu + WGSL f32";        .gpu/vulkan-gemm-wgsl --dtype f32 --iters "$iters"
for dt in f16 f32; do
  echo "== ash + SPIR-V (device addresses) $dt"; .gpu/vulkan-gemm-ash --dtype "$dt" --iters "$iters"
done
for dt in f16 f32; do
  echo "== burn/CubeCL $dt";      .gpu/vulkan-gemm-burn --dtype "$dt" --iters "$iters"
done
