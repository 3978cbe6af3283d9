#!/usr/bin/env bash
# Build here, without a GPU, everything the owed GPU checks carry to the GPU machine
# (scripts/gpu/session.sh runs them there; docs/devices.md, "The owed GPU checks"):
#
#   .gl/          the Vulkan loader (Debian's libvulkan1) and glvnd (libglvnd0 and friends): the GPU
#                 machine has the NVIDIA driver's Vulkan ICD but neither
#   .gpu/         rtune and the GPU engine's tests built with CUDA (scripts/toolchain/build-cuda.sh:
#                 ~20 minutes cold on 2 cores), and bitsandbytes for PyTorch's QLoRA reference
#
# Both are git-ignored, so a `run` call takes only what it names in `carry` (64 MiB a call,
# working tree included). rtune is rebuilt as the tree changes (.gpu/commit says from what). Prints what each session part carries and fails if one
# is over the limit.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The loader and glvnd: NVIDIA's Vulkan ICD (libGLX_nvidia) needs libGLdispatch from libglvnd0;
# with the loader alone, vkCreateInstance finds no driver (seen on an H200, 2026-11-27).
if ! ls .gl/libvulkan1_*.deb .gl/libglvnd0_*.deb >/dev/null 2>&1; then
  mkdir -p .gl /tmp/amd64/partial
  o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64)
  apt-get "${o[@]}" update -qq
  (cd .gl && apt-get "${o[@]}" download libvulkan1 libglvnd0 libegl1 libgl1 libglx0 libopengl0 libgles2)
fi
# Always: cargo rebuilds only what changed, so the binaries are never older than the tree.
scripts/toolchain/build-cuda.sh
git describe --always --dirty >.gpu/commit
# bitsandbytes, which PyTorch's QLoRA reference needs and the GPU machine lacks (PyPI's wheel,
# pinned; 43 MB with a library per CUDA and ROCm release, so only CUDA 13's and the CPU's are
# kept: 7 MB packed). scripts/gpu/env.sh puts it on PYTHONPATH there.
bnb=bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl
bnb_sha=55348a9a4a21bfd99cf8c7b32fe67b4030ae5c2a05738e03c1747f65fa6ec283
if [ ! -f .gpu/bitsandbytes.tgz ]; then
  dl=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_24_x86_64 \
    --dest "$dl" bitsandbytes==0.50.2
  echo "$bnb_sha  $dl/$bnb" | sha256sum -c --quiet
  mkdir "$dl/py"
  (cd "$dl/py" && unzip -q "../$bnb" && find bitsandbytes -name 'libbitsandbytes_*.so' \
    ! -name 'libbitsandbytes_cuda13*.so' ! -name 'libbitsandbytes_cpu.so' -delete)
  tar -czf .gpu/bitsandbytes.tgz -C "$dl/py" .
  rm -rf "$dl"
fi
# Only the gzipped binaries travel: copies unpacked by a dry run here (scripts/gpu/env.sh unpacks them on
# the GPU machine) would count against the limit.
find .gpu -maxdepth 1 -type f ! -name '*.gz' ! -name '*.tgz' ! -name commit ! -name manifest-dir -delete
rm -rf .gpu/py
# What each part of scripts/gpu/session.sh carries, with the tracked files that travel anyway.
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024))
status=0
for part in "first:.gpu .gl" "second:.gpu .gl"; do
  name=${part%%:*} dirs=${part#*:}
  # shellcheck disable=SC2086
  bytes=$(($(du -cb $dirs | tail -1 | cut -f1) + tree))
  echo "part $name carries $dirs: $((bytes / 1024 / 1024)) MiB with the working tree (limit 64 MiB)"
  [ "$bytes" -lt "$limit" ] || status=1
done
exit $status
