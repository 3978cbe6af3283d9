#!/usr/bin/env bash
# rtune on Windows, checked from Linux: the Windows build (x86_64-pc-windows-gnu, cross-compiled
# with MinGW-w64) run under Wine —
#   1. the library's unit tests (the store's commits, locks and removals among them);
#   2. `rtune doctor`;
#   3. the default recipe end to end on the CPU beside the Linux build: the same artifacts
#      (fingerprints) and the same eval losses; then a second run finds everything cached, a
#      damaged artifact is found by `cache verify` and rebuilt by the next run, `cache rm` removes
#      one artifact, which the next run alone rebuilds, `cache gc` runs, and the store's objects
#      are read-only again;
#   4. training through Vulkan: `vulkan-1.dll` is Wine's winevulkan, which hands the calls to the
#      host's Vulkan (Mesa's lavapipe) under a virtual X server;
#   5. data parallel training through Vulkan on two devices (lavapipe listed twice) against 4.
# Wine is not Windows: it shows the build works against the Win32 API's documented behaviour
# (it found that FlushFileBuffers refuses read-only handles), not that every Windows version,
# file system or GPU driver behaves so.
#
#   scripts/toolchain/windows-check.sh
#
# Installs what is missing: rustup's x86_64-pc-windows-gnu target, and from Debian MinGW-w64,
# wine64 and xvfb (Xvfb). Builds in the dev profile, the dependencies at opt-level 1 but gemm's
# crates at 3 (see wcargo below).
set -euo pipefail
cd "$(dirname "$0")/../.."
target=x86_64-pc-windows-gnu
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
need=()
command -v x86_64-w64-mingw32-gcc >/dev/null 2>&1 || need+=(gcc-mingw-w64-x86-64 g++-mingw-w64-x86-64)
command -v wine >/dev/null 2>&1 || need+=(wine64)
command -v Xvfb >/dev/null 2>&1 || need+=(xvfb)
ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || need+=(mesa-vulkan-drivers libvulkan1)
if [ ${#need[@]} -gt 0 ]; then
  (apt-get install -y "${need[@]}" || (apt-get update && apt-get install -y "${need[@]}")) >/dev/null
fi

work=$(mktemp -d)
trap 'wineserver -k >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
export WINEPREFIX="$work/wine" WINEDEBUG=-all WINEDLLOVERRIDES="mscoree,mshtml=" RTUNE_NO_PROGRESS=1
# A path as Windows sees it. On a machine's first Wine run the prefix may still be setting up
# (a clean-clone run here once stopped at the first call, silently): wait for it and try again,
# and say so if it still fails.
wine_path() {
  winepath -w "$1" 2>/dev/null && return
  wineserver -w >/dev/null 2>&1 || true
  winepath -w "$1" || { echo "windows-check: winepath failed for $1" >&2; return 1; }
}

# Windows commands build without debug info: smaller on a CI runner's disk, faster to link. Their
# dependencies build at opt-level 1, not Cargo.toml's 3: candle-core, tokenizers and ash with
# their dependencies took 283 s instead of 506 s for this target (2-core Xeon, 2026-11-29), and
# these runs compute little outside the fused CPU engine's products, which are gemm's: its crates
# stay at 3. The results do not depend on it (no fast-math at any level): step 3 compares the
# artifacts' fingerprints and the eval losses with the Linux build's.
gemm3=()
for c in gemm gemm-common gemm-f16 gemm-f32 gemm-f64 gemm-c32 gemm-c64; do
  gemm3+=(--config "profile.dev.package.$c.opt-level=3")
done
wcargo() {
  local sub=$1
  shift
  CARGO_PROFILE_DEV_DEBUG=0 cargo "$sub" --locked --target "$target" \
    --config 'profile.dev.package."*".opt-level=1' "${gemm3[@]}" "$@"
}

echo "== build for Windows ($target)"
wcargo build --bin rtune
wcargo test --lib --no-run
# The Linux binary as `cargo test` builds it (for the integration tests): after CI's test run it
# is already there, where `cargo build` would recompile tokenizers and candle (~3 minutes).
cargo test --locked --no-run --test cli
tdir=${CARGO_TARGET_DIR:-target}
win=$tdir/$target/debug/rtune.exe
linux=$tdir/debug/rtune

# Rust's standard library imports ProcessPrng from bcryptprimitives.dll (Windows 10 and later);
# Wine 8 (Debian 12) has no such DLL. A stand-in that asks RtlGenRandom goes on Wine's PATH.
mkdir -p "$work/dll"
cat >"$work/dll/bcryptprimitives.c" <<'C'
#include <windows.h>
BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length); /* RtlGenRandom */
__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T length) {
    while (length) {
        ULONG n = length > 0x10000000 ? 0x10000000 : (ULONG)length;
        if (!SystemFunction036(data, n)) return FALSE;
        data += n;
        length -= n;
    }
    return TRUE;
}
C
x86_64-w64-mingw32-gcc -shared -O2 -o "$work/dll/bcryptprimitives.dll" "$work/dll/bcryptprimitives.c" -ladvapi32
wineboot -i >/dev/null 2>&1 || true
export WINEPATH
WINEPATH=$(wine_path "$work/dll")

echo "== 1. unit tests under Wine"
CARGO_TARGET_X86_64_PC_WINDOWS_GNU_RUNNER=wine wcargo test --lib -- --test-threads 1

echo "== 2. rtune doctor"
wine "$win" doctor | tee "$work/doctor.txt"
# The CPU's name and the memory installed come from Win32 (device::host), not "cpu"/"unknown".
grep -Eq "^  cpu +[^ ].*  memory [0-9]" "$work/doctor.txt" || { echo "doctor shows no CPU memory"; exit 1; }
if grep -Eq "^  cpu +cpu  memory" "$work/doctor.txt"; then echo "doctor shows no CPU name"; exit 1; fi

echo "== 3. the default recipe on the CPU, Windows beside Linux"
recipe=recipes/tiny-offline.toml
wcache=$(wine_path "$work/wcache")
run_win() { RTUNE_CACHE_DIR="$wcache" wine "$win" "$@"; }
run_linux() { RTUNE_CACHE_DIR="$work/lcache" "$linux" "$@"; }
# Outputs (the recipe's upload folder, its lock file) go to a copy of the recipe's folder.
cp -r recipes "$work/recipes"
recipe="$work/recipes/tiny-offline.toml"
wrecipe=$(wine_path "$recipe")
run_win run "$wrecipe" --set 'device.prefer=["cpu"]' >"$work/win.out" 2>"$work/win.err" ||
  { tail -20 "$work/win.err"; exit 1; }
rm -f "$work/recipes/rtune.lock"
run_linux run "$recipe" --set 'device.prefer=["cpu"]' >"$work/linux.out" 2>"$work/linux.err" ||
  { tail -20 "$work/linux.err"; exit 1; }
# Stage names, outcomes and fingerprints (the last path component), then the eval losses.
summary() { sed -n '/^recipe .* done/,$p' "$1" | tr -d '\r' | sed -E 's#[^ ]*[/\\]([0-9a-f]{64})$#\1#'; }
diff <(summary "$work/linux.out") <(summary "$work/win.out") || { echo "the Windows build's results differ"; exit 1; }
summary "$work/win.out"
run_win run "$wrecipe" --set 'device.prefer=["cpu"]' >"$work/win2.out" 2>/dev/null
if grep -E "^  [a-z_]+ +built" "$work/win2.out"; then echo "a second run rebuilt stages"; exit 1; fi
# Damage one object of the train stage, as a stray edit would.
train_dir=$(winepath -u "$(grep -E '^  train ' "$work/win.out" | awk '{print $3}' | tr -d '\r')")
f="$train_dir/adapter_config.json"
chmod u+w "$f" && echo " " >>"$f"
if run_win cache verify >"$work/verify.txt" 2>&1; then echo "cache verify missed the damage"; exit 1; fi
grep damaged "$work/verify.txt"
run_win run "$wrecipe" --set 'device.prefer=["cpu"]' >"$work/win3.out" 2>"$work/win3.err"
grep -q "artifact damaged" "$work/win3.err" || { echo "the damaged artifact was not rebuilt"; exit 1; }
run_win cache verify
# `cache rm` there: an artifact's files are read-only hard links to its objects (removing them
# clears an attribute the objects share), so the objects must be protected again afterwards; the
# next run rebuilds that stage alone.
eval_fp=$(grep -E '^  eval_base ' "$work/win3.out" | awk '{print $3}' | tr -d '\r' | sed -E 's#.*[/\\]##')
run_win cache rm "${eval_fp:0:12}"
run_win run "$wrecipe" --set 'device.prefer=["cpu"]' >"$work/win4.out" 2>/dev/null
built=$(grep -E "^  [a-z_]+ +built" "$work/win4.out" | awk '{print $1}' | paste -sd,)
[ "$built" = eval_base ] || { echo "after cache rm, rebuilt: ${built:-nothing} (expected eval_base)"; exit 1; }
run_win cache gc
writable=$(find "$work/wcache" -path '*/objects/*' -type f -perm -u+w | wc -l)
[ "$writable" = 0 ] || { echo "$writable store objects lost their read-only protection"; exit 1; }

echo "== 4. training through Vulkan (winevulkan → lavapipe)"
# Wine picks its display driver when a session's first program starts: end the session that
# started without a display, and run the rest under one virtual X server (a session does not
# follow its programs to another one: under a second xvfb-run, winevulkan finds no driver).
display=$(for n in $(seq 90 199); do [ -e "/tmp/.X$n-lock" ] || { echo "$n"; break; }; done)
Xvfb ":$display" -nolisten tcp >/dev/null 2>&1 &
xvfb=$!
trap 'wineserver -k >/dev/null 2>&1 || true; kill "$xvfb" 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 100); do [ -e "/tmp/.X11-unix/X$display" ] && break; sleep 0.1; done
export DISPLAY=":$display"
wineserver -k >/dev/null 2>&1 || true
wineserver -w >/dev/null 2>&1 || true
RTUNE_CACHE_DIR="$wcache" wine "$win" run "$wrecipe" --set 'device.prefer=["vulkan"]' \
  --set stages.train.max_steps=4 >"$work/vk.out" 2>"$work/vk.err" || { tail -20 "$work/vk.err"; exit 1; }
grep -E "GPU engine \(|eval loss .* → " "$work/vk.err"
grep -q "GPU engine (llvmpipe" "$work/vk.err" || { echo "training did not run on the Vulkan device"; exit 1; }
# The same steps by the Linux build on the same driver: the same losses.
run_linux run "$recipe" --set 'device.prefer=["vulkan"]' --set stages.train.max_steps=4 >/dev/null 2>"$work/vk-linux.err"
losses() { grep -E "^ +train +([0-9]+/4 loss|eval loss)" "$1" | sed -E 's/ [0-9.]+ tok\/s//; s/ in 4 steps \(.*//' | tr -d '\r'; }
[ "$(losses "$work/vk-linux.err" | wc -l)" = 5 ] || { echo "the Linux run logged no losses"; exit 1; }
diff <(losses "$work/vk-linux.err") <(losses "$work/vk.err") || { echo "Vulkan training differs between Windows and Linux"; exit 1; }

echo "== 5. data parallel through Vulkan: two lavapipe devices train as one (device.gpus = 2)"
# A second device: lavapipe's library copied under another name (the loader opens each library
# once, so the copy is a second driver), named beside the first in VK_ICD_FILENAMES.
icd=$(ls /usr/share/vulkan/icd.d/lvp_icd*.json | head -1)
lib=$(sed -n 's/.*"library_path": *"\([^"]*\)".*/\1/p' "$icd")
cp "$lib" "$work/libvulkan_lvp_copy.so"
sed "s#\"$lib\"#\"$work/libvulkan_lvp_copy.so\"#" "$icd" >"$work/lvp_copy.json"
VK_ICD_FILENAMES="$icd:$work/lvp_copy.json" RTUNE_CACHE_DIR="$(wine_path "$work/wcache-dp")" \
  wine "$win" run "$wrecipe" --set 'device.prefer=["vulkan:0"]' --set device.gpus=2 \
  --set stages.train.max_steps=4 >"$work/dp.out" 2>"$work/dp.err" || { tail -20 "$work/dp.err"; exit 1; }
grep -E "data parallel|eval loss .* → " "$work/dp.err"
grep -q "data parallel on 2 GPUs: GPU engine (llvmpipe" "$work/dp.err" ||
  { echo "training did not run on two Vulkan devices"; exit 1; }
# The tuned model's eval loss is one device's (step 4), to the last printed digit's rounding.
tuned() { grep -E "^ +train +eval loss" "$1" | sed -E 's/.*→ ([0-9.]+).*/\1/' | tr -d '\r'; }
awk -v a="$(tuned "$work/vk.err")" -v b="$(tuned "$work/dp.err")" 'BEGIN {
  d = a - b; if (a == "" || b == "" || d > 2e-4 || d < -2e-4) { print "eval loss " b " on two devices vs " a " on one"; exit 1 } }'
echo "windows-check: ok"
