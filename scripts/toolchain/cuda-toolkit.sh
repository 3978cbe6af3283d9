#!/usr/bin/env bash
# A CUDA 13.0 build toolkit without a GPU or a system CUDA install: nvcc, the runtime headers
# and libcudart from NVIDIA's PyPI wheels (pinned by sha256), plus link stubs for the libraries
# rtune only calls through cudarc (libcuda, cuBLAS, cuBLASLt, cuRAND, NVRTC) — the real ones come
# with the NVIDIA driver and CUDA runtime on the machine that runs the binary.
#
#   scripts/toolchain/cuda-toolkit.sh [DIR]        # default: target/cuda-toolkit; prints the env to export
#
# Pinned to CUDA 13.0 to match the GPU machines' driver 580: PTX from a newer nvcc does not load
# on an older driver (docs/devices.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
dest="${1:-target/cuda-toolkit}"
mkdir -p "$dest/wheels"
dest="$(cd "$dest" && pwd)"

wheels=(
  "https://files.pythonhosted.org/packages/71/8b/a546c12881fffeba927d810598987df25d74b8b241788c7db8dfc93b0173/nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03"
  "https://files.pythonhosted.org/packages/2e/24/d1558f3b68b1d26e706813b1d10aa1d785e4698c425af8db8edc3dced472/nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"
  "https://files.pythonhosted.org/packages/05/69/a1ec4d9f0747d85964206feb47bf359f48a2d6af74c0add8abba6efe3dda/nvidia_cuda_crt-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4"
  "https://files.pythonhosted.org/packages/15/b0/ee41e6d1108d959b5097163e7190c2d0f7857dea75606ce358f0275891b4/nvidia_nvvm-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0"
  "https://files.pythonhosted.org/packages/ab/fb/0384bb2129bed6b1b39f8e44471c615ab5ab29b7e55817538a1d390d8f84/nvidia_cuda_cccl-13.0.85-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649"
)

if [ ! -x "$dest/bin/nvcc" ]; then
  command -v unzip >/dev/null || { apt-get update -qq && apt-get install -y -qq unzip >/dev/null; }
  for w in "${wheels[@]}"; do
    url="${w% *}" sum="${w#* }" file="$dest/wheels/$(basename "${w% *}")"
    if ! echo "$sum  $file" | sha256sum -c --status 2>/dev/null; then
      curl -fsSL --retry 3 -o "$file" "$url"
      echo "$sum  $file" | sha256sum -c --quiet
    fi
    unzip -qo "$file" 'nvidia/cu13/*' -d "$dest/wheels/x"
  done
  cp -a "$dest/wheels/x/nvidia/cu13/." "$dest/"
  rm -rf "$dest/wheels/x"
  ln -sf libcudart.so.13 "$dest/lib/libcudart.so"
fi

# Link stubs: every function cudarc's bindings declare, under the real library's soname.
cudarc="$(cargo metadata --format-version 1 --locked --features cuda 2>/dev/null |
  grep -o '"manifest_path":"[^"]*/cudarc-[0-9.]*/Cargo.toml"' | head -1 | sed 's/.*:"//; s#/Cargo.toml"##')"
[ -d "$cudarc" ] || { echo "cudarc sources not found (run cargo fetch first)" >&2; exit 1; }
mkdir -p "$dest/lib/stubs"
stub() { # name soname bindings-module
  local c="$dest/lib/stubs/$1.c"
  grep -oP '^pub unsafe fn \K\w+' "$cudarc/src/$3/sys/mod.rs" | sort -u | sed 's/.*/void &(void) {}/' >"$c"
  cc -shared -fPIC -o "$dest/lib/stubs/$2" -Wl,-soname,"$2" "$c"
  ln -sf "$2" "$dest/lib/stubs/$1.so"
  rm "$c"
}
stub libcuda libcuda.so.1 driver
stub libcublas libcublas.so.13 cublas
stub libcublasLt libcublasLt.so.13 cublaslt
stub libcurand libcurand.so.10 curand
stub libnvrtc libnvrtc.so.13 nvrtc

cat <<ENV
export CUDA_HOME="$dest" PATH="$dest/bin:\$PATH" CUDARC_CUDA_VERSION=13000 CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-80}
export LIBRARY_PATH="$dest/lib/stubs:$dest/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
ENV
