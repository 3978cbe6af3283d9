#!/usr/bin/env bash
# rtune for macOS, checked from Linux without a Mac: clippy (warnings denied) type-checks every
# target of the Apple-silicon build (aarch64-apple-darwin) — the default features (Vulkan through
# the system's loader or MoltenVK; device::host's sysctl and getrusage) and `--features metal`
# (candle's Metal backend) — with the C and C++ of the dependencies (ring, zstd, blake3's NEON
# code, tokenizers' esaxx, the GPU kernels' emulator) compiled by zig's clang against the macOS
# headers zig ships. Nothing is linked (that needs Apple's SDK) and nothing runs (that needs a
# Mac): this finds code that does not build for macOS — a Linux-only call, a missing `cfg` — not
# how it behaves there.
#
#   scripts/toolchain/macos-check.sh
#
# Installs what is missing: rustup's aarch64-apple-darwin target, and zig from PyPI's `ziglang`
# wheel (pinned by sha256, unpacked with unzip: no Python) under $CARGO_TARGET_DIR/zig.
set -euo pipefail
cd "$(dirname "$0")/../.."
target=aarch64-apple-darwin
rustup target list --installed | grep -qx "$target" || rustup target add "$target"

tdir=${CARGO_TARGET_DIR:-target}
mkdir -p "$tdir"
zig_dir="$(cd "$tdir" && pwd)/zig"
wheel="https://files.pythonhosted.org/packages/59/e3/2a34676370a11c36b7cd04ffb2439c1089c0530cf4b01408c77cf7f8d9c3/ziglang-0.17.1-py3-none-manylinux_2_12_x86_64.manylinux2010_x86_64.musllinux_1_1_x86_64.whl"
sum=ea6cc5d87b033cf0aedfbc8f9549a908cae6c50ac31f1698188fa48a74524b54
zig="$zig_dir/ziglang/zig"
if [ ! -x "$zig" ]; then
  command -v unzip >/dev/null || { apt-get update -qq && apt-get install -y -qq unzip >/dev/null; }
  mkdir -p "$zig_dir"
  file="$zig_dir/$(basename "$wheel")"
  if ! echo "$sum  $file" | sha256sum -c --status 2>/dev/null; then
    curl -fsSL --retry 3 -o "$file" "$wheel"
    echo "$sum  $file" | sha256sum -c --quiet
  fi
  unzip -qo "$file" 'ziglang/*' -d "$zig_dir"
  chmod +x "$zig"
  rm -f "$file"
fi

# cc-rs calls the compiler with clang's `--target=arm64-apple-macosx`, which zig does not parse;
# zig is given its own target instead.
mkdir -p "$zig_dir/bin"
for tool in cc c++; do
  cat >"$zig_dir/bin/$tool" <<EOF
#!/bin/sh
for a in "\$@"; do shift; case "\$a" in --target=*) ;; *) set -- "\$@" "\$a" ;; esac; done
exec "$zig" $tool -target aarch64-macos "\$@"
EOF
done
printf '#!/bin/sh\nexec "%s" ar "$@"\n' "$zig" >"$zig_dir/bin/ar"
chmod +x "$zig_dir/bin/"*
export CC_aarch64_apple_darwin="$zig_dir/bin/cc" CXX_aarch64_apple_darwin="$zig_dir/bin/c++" \
  AR_aarch64_apple_darwin="$zig_dir/bin/ar"

echo "== macOS ($target), default features: every target"
cargo clippy --locked --target "$target" --all-targets -- -D warnings
echo "== macOS ($target), --features metal"
cargo clippy --locked --target "$target" --lib --bins --features metal -- -D warnings
# zig leaves an object file in the folder of a crate whose build script probes its compiler.
rm -f a.o crates/*/a.o
echo "macOS check passed (type-checked; not linked or run)"
