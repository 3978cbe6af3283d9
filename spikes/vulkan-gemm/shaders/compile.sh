#!/usr/bin/env bash
# Compile the spike's GLSL kernels to the SPIR-V that is checked in beside them (glslang-tools).
set -euo pipefail
cd "$(dirname "$0")"
for f in *.comp; do glslangValidator -V --target-env vulkan1.2 -o "${f%.comp}.spv" "$f"; done
