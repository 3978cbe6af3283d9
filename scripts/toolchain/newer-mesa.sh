#!/usr/bin/env bash
# A newer Mesa lavapipe for CI: Debian 13's backported Mesa (26.x), whose lavapipe has
# VK_KHR_cooperative_matrix — Debian 12's (22.3) has not — so the Vulkan engine's matrix-unit
# product (`gemm_cm`) runs and is tested without a GPU. The packages are unpacked, not
# installed, into target/newer-mesa with the Debian 13 libraries they need (glibc included), and
# a program runs under that root's dynamic loader, beside nothing of the system's.
#
#   scripts/toolchain/newer-mesa.sh install                      # download and unpack (~90 MB; once)
#   scripts/toolchain/newer-mesa.sh run <program> [args…]        # run a program on that lavapipe
#   scripts/toolchain/newer-mesa.sh validate <program> [args…]   # the same under Khronos' validation layer:
#                                                      # fails if the layer reports an error
#
# As cargo's runner, so that tests run on it:
#   CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$PWD/scripts/newer-mesa.sh run" cargo test …
#
# Versions are resolved from the archive's indexes when installing (backports first), so the
# script follows Debian's updates; it fails if a library lavapipe needs is not found.
set -euo pipefail
root=${NEWER_MESA_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)/target/newer-mesa}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
lib=$root/usr/lib/x86_64-linux-gnu

install() {
  rm -rf "$root"
  mkdir -p "$root/debs"
  for suite in trixie-backports trixie; do
    curl -fsS --retry 3 -m 300 "$mirror/dists/$suite/main/binary-amd64/Packages.xz" | xz -dc
    echo
  done >"$root/Packages"
  # Package → "Filename|dependencies" (the first entry wins: backports before the release).
  awk 'BEGIN { RS = ""; FS = "\n" }
    { name = ""; file = ""; deps = ""
      for (i = 1; i <= NF; i++) {
        if ($i ~ /^Package: /) name = substr($i, 10)
        else if ($i ~ /^Filename: /) file = substr($i, 11)
        else if ($i ~ /^(Pre-)?Depends: /) deps = deps "," substr($i, index($i, ":") + 2)
      }
      if (name != "" && !(name in seen)) { seen[name] = 1; print name "|" file "|" deps } }' \
    "$root/Packages" >"$root/index"
  # Packages whose files lavapipe does not load (maintainer scripts, data, alternatives).
  local skip=" debconf dpkg perl-base libc-bin base-files tzdata debianutils mawk install-info
    gcc-14-base libc-gconv-modules-extra libx11-data libdrm-common "
  local queue=(mesa-vulkan-drivers libvulkan1 vulkan-validationlayers libc6 libstdc++6) seen=" " p entry file deps d
  while [ ${#queue[@]} -gt 0 ]; do
    p=${queue[0]}
    queue=("${queue[@]:1}")
    case "$seen$skip" in *" $p "*) continue ;; esac
    seen="$seen$p "
    entry=$(grep -m1 "^$p|" "$root/index") || { echo "newer-mesa: package $p not found" >&2; exit 1; }
    file=$(cut -d'|' -f2 <<<"$entry")
    deps=$(cut -d'|' -f3 <<<"$entry")
    curl -fsS --retry 3 -m 300 -o "$root/debs/${file##*/}" "$mirror/$file"
    dpkg-deb -x "$root/debs/${file##*/}" "$root"
    for d in $(tr ',' '\n' <<<"$deps" | sed 's/|.*//; s/(.*//; s/:any//' | tr -d ' '); do
      queue+=("$d")
    done
  done
  rm -rf "$root/debs" "$root/Packages" "$root/index"
  printf '{"file_format_version":"1.0.0","ICD":{"library_path":"%s","api_version":"1.4.0"}}\n' \
    "$lib/libvulkan_lvp.so" >"$root/lvp_icd.json"
  if "$lib/ld-linux-x86-64.so.2" --library-path "$lib" --list "$lib/libvulkan_lvp.so" | grep -q 'not found'; then
    echo "newer-mesa: lavapipe misses libraries:" >&2
    "$lib/ld-linux-x86-64.so.2" --library-path "$lib" --list "$lib/libvulkan_lvp.so" | grep 'not found' >&2
    exit 1
  fi
  echo "newer-mesa: $(ls "$root"/usr/share/doc | grep -c .) packages in $root ($(du -sh "$root" | cut -f1))"
}

# A program on this root's lavapipe: its driver only, under its own dynamic loader.
on_root() {
  [ -e "$root/lvp_icd.json" ] || { echo "newer-mesa: run \`scripts/toolchain/newer-mesa.sh install\` first" >&2; exit 1; }
  exec env VK_ICD_FILENAMES="$root/lvp_icd.json" VK_DRIVER_FILES="$root/lvp_icd.json" \
    "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$@"
}

case "${1:-}" in
  install) install ;;
  run)
    shift
    on_root "$@"
    ;;
  validate)
    # Every Vulkan call and every SPIR-V module the engine creates is checked against the spec
    # (Debian 13's Vulkan-ValidationLayers; its messages go to a log, shown when there are
    # errors). A driver may run invalid usage as intended — lavapipe often does — and another
    # not, so the tests fail on any error.
    shift
    log=$(mktemp)
    rc=0
    VK_LAYER_PATH="$root/usr/share/vulkan/explicit_layer.d" VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation \
      VK_KHRONOS_VALIDATION_LOG_FILENAME="$log" on_root "$@" |
      sed -u '/^Validation Layer Info - Logging validation error to/d' || rc=$?
    errors=$(grep -c "Validation Error" "$log" || true)
    if [ "$errors" -gt 0 ]; then
      head -c 20000 "$log" >&2
      echo "newer-mesa: the validation layer reported $errors errors (above)" >&2
      [ $rc -ne 0 ] || rc=1
    fi
    rm -f "$log"
    exit $rc
    ;;
  *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
