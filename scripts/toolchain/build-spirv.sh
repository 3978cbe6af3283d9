#!/usr/bin/env bash
# Compile the Vulkan engine's kernels (src/engine/gpu/vulkan/kernels.comp) to SPIR-V, one module
# per kernel and compute dtype, into src/engine/gpu/vulkan/spirv/, and write the index the
# engine embeds (index.rs). The modules are checked in, so building rtune needs no shader
# compiler; after editing kernels.comp, run this and commit the result.
#
#   scripts/toolchain/build-spirv.sh           # rebuild the modules
#   scripts/toolchain/build-spirv.sh --check   # fail if the checked-in modules differ from a fresh build (CI)
#
# Needs cargo only: the modules are compiled by tools/glslc, which builds a pinned glslang from
# crates.io (about 1.5 minutes the first time), so the bytes are the same wherever this runs and
# the kernels on the matrix units can use GLSL extensions newer than a distribution's glslang
# (GL_KHR_cooperative_matrix, GL_EXT_bfloat16).
set -euo pipefail
cd "$(dirname "$0")/../.."
src=src/engine/gpu/vulkan/kernels.comp
dest=src/engine/gpu/vulkan/spirv
cargo build --quiet --release --locked --manifest-path tools/glslc/Cargo.toml --target-dir tools/glslc/target
glslc=tools/glslc/target/release/rtune-glslc
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
typed="embed embed_bwd col_grad gather_rows scatter_add_rows add add_bias cast_from_f32 split_sum nf4_dequant rmsnorm_fwd rmsnorm_apply rmsnorm_bwd rope
  swiglu swiglu_bwd dropout dropout_acc cross_entropy attn_fwd attn_bwd_pre attn_bwd_dq attn_bwd_dkv
  attn_reduce_heads attn_probs attn_dscores attn_fwd_sg attn_bwd_dq_sg attn_bwd_dkv_sg"
plain="sum_scaled sum_squares col_sum adamw ema zero16 rounding_probe nf4_scales"
compile() { # name, defines...
  local name=$1
  shift
  "$glslc" "$@" -o "$out/$name.spv" "$src" >"$out/$name.log" 2>&1 ||
    { echo "build-spirv: $name failed:" >&2; cat "$out/$name.log" >&2; exit 1; }
  rm -f "$out/$name.log"
}
for k in $typed; do
  for t in f32 bf16 f16; do compile "${k}_$t" "-DK_$k" "-DT_${t^^}"; done
done
for k in $plain; do compile "$k" "-DK_$k" -DT_F32; done
for t in f32 bf16 f16; do
  compile "gemm_${t}_f32" -DK_gemm "-DT_${t^^}" -DC_F32
  [ "$t" = f32 ] || compile "gemm_${t}_$t" -DK_gemm "-DT_${t^^}"
  compile "gemm_sg_${t}_f32" -DK_gemm_sg "-DT_${t^^}" -DC_F32
  [ "$t" = f32 ] || compile "gemm_sg_${t}_$t" -DK_gemm_sg "-DT_${t^^}"
done
for t in bf16 f16; do
  compile "gemm_cm_${t}_f32" -DK_gemm_cm "-DT_${t^^}" -DC_F32
  compile "gemm_cm_${t}_$t" -DK_gemm_cm "-DT_${t^^}"
  compile "gemm_cm1_${t}_f32" -DK_gemm_cm1 "-DT_${t^^}" -DC_F32
  compile "gemm_cm1_${t}_$t" -DK_gemm_cm1 "-DT_${t^^}"
  for k in attn_fwd_mma attn_bwd_dq_mma attn_bwd_dkv_mma; do
    compile "${k}_$t" "-DK_$k" "-DT_${t^^}"
    compile "${k}_${t}_rows" "-DK_$k" "-DT_${t^^}" -DROW_LOADS
  done
  compile "cm_probe_$t" -DK_cm_probe "-DT_${t^^}"
done
{
  echo "// Written by scripts/toolchain/build-spirv.sh from kernels.comp; do not edit."
  echo "pub const KERNELS: &[(&str, &[u8])] = &["
  for f in $(cd "$out" && ls *.spv | sort); do
    echo "    (\"${f%.spv}\", include_bytes!(\"spirv/$f\")),"
  done
  echo "];"
} >"$out/index.rs"
if [ "${1:-}" = "--check" ]; then
  fail=0
  for f in "$out"/*.spv; do cmp -s "$f" "$dest/$(basename "$f")" || { echo "build-spirv: $(basename "$f") differs from kernels.comp" >&2; fail=1; }; done
  cmp -s "$out/index.rs" src/engine/gpu/vulkan/index.rs || { echo "build-spirv: index.rs differs" >&2; fail=1; }
  [ "$(ls "$dest" | wc -l)" = "$(ls "$out"/*.spv | wc -l)" ] || { echo "build-spirv: stale modules in $dest" >&2; fail=1; }
  [ $fail = 0 ] && echo "build-spirv: the checked-in SPIR-V matches kernels.comp"
  exit $fail
fi
rm -rf "$dest"
mkdir -p "$dest"
cp "$out"/*.spv "$dest/"
cp "$out/index.rs" src/engine/gpu/vulkan/index.rs
echo "build-spirv: $(ls "$dest" | wc -l) modules, $(du -sh "$dest" | cut -f1)"
