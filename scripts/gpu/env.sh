# Source this on a GPU machine before running a CUDA build of rtune that was compiled elsewhere
# (scripts/toolchain/build-cuda.sh): it puts the CUDA 13 libraries rtune links against (cuBLAS, cuBLASLt,
# cuRAND, NVRTC, the runtime) on LD_LIBRARY_PATH — from the CUDA toolkit if installed, else
# from PyTorch's NVIDIA wheels — and unpacks binaries carried as .gpu/*.gz.
#
#   . scripts/gpu/env.sh && .gpu/rtune doctor
dirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  $(python3 -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null); do
  for lib in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libcudart.so.13; do
    if [ -e "$d/$lib" ]; then
      case ":$dirs:" in *":$d:"*) ;; *) dirs="$dirs:$d" ;; esac
    fi
  done
done
export LD_LIBRARY_PATH="${dirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for z in .gpu/*.gz; do
  [ -e "$z" ] || continue
  [ -e "${z%.gz}" ] || { gunzip -c "$z" >"${z%.gz}" && chmod +x "${z%.gz}"; }
done
# The Vulkan loader, where the machine lacks one: libvulkan1's .deb carried under .gl/ (see
# docs/devices.md, "Vulkan"), unpacked beside it; NVIDIA's ICD file where the driver puts it.
if ! ldconfig -p 2>/dev/null | grep -q libvulkan.so.1 && ls .gl/*.deb >/dev/null 2>&1; then
  for f in .gl/*.deb; do dpkg -x "$f" .gl/root; done
  export LD_LIBRARY_PATH="$PWD/.gl/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ -z "${VK_DRIVER_FILES:-}" ]; then
  for icd in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
    /etc/vulkan/icd.d/nvidia_icd.json /usr/local/share/vulkan/icd.d/nvidia_icd.json; do
    if [ -f "$icd" ]; then
      export VK_DRIVER_FILES=$icd
      break
    fi
  done
fi
# Test binaries find their fixtures under the path they were built in.
if [ -f .gpu/manifest-dir ] && [ ! -e "$(cat .gpu/manifest-dir)" ]; then
  mkdir -p "$(dirname "$(cat .gpu/manifest-dir)")" && ln -s "$PWD" "$(cat .gpu/manifest-dir)"
fi
# bitsandbytes for PyTorch's QLoRA reference, where the machine has none (scripts/gpu/prep.sh packs it).
if [ -f .gpu/bitsandbytes.tgz ] && ! python3 -c 'import bitsandbytes' 2>/dev/null; then
  [ -d .gpu/py ] || { mkdir -p .gpu/py && tar -xzf .gpu/bitsandbytes.tgz -C .gpu/py; }
  export PYTHONPATH="$PWD/.gpu/py${PYTHONPATH:+:$PYTHONPATH}"
fi
