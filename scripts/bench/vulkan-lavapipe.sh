#!/usr/bin/env bash
# Side by side on one machine, one command: the default recipe through Vulkan (lavapipe on a
# machine without a GPU) with two rtune binaries, e.g. before and after a kernel change, each in
# a fresh cache, then the same recipe on the CPU engine as the reference. Prints each run's
# train line and eval losses.
#
#   scripts/bench/vulkan-lavapipe.sh OLD_RTUNE NEW_RTUNE [STEPS]   # STEPS: all (default) or a number
set -euo pipefail
old=$(realpath "$1") new=$(realpath "$2") steps=${3:-all}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$(dirname "$0")/../../recipes/tiny-offline.toml" "$(dirname "$0")/../../recipes/data" "$work/"
cd "$work"
grep -m1 "model name" /proc/cpuinfo; nproc
vulkaninfo --summary 2>/dev/null | grep -E "deviceName|driverInfo" | head -2 || true
extra=()
[ "$steps" = all ] || extra=(--set "stages.train.max_steps=$steps")
run() { # label, binary, device
  local cache
  cache="$work/cache-$1"
  echo "== $1 ($3)"
  RTUNE_CACHE_DIR="$cache" RTUNE_NO_PROGRESS=1 /usr/bin/time -f "   wall %e s" "$2" run tiny-offline.toml \
    --set "device.prefer=[\"$3\"]" "${extra[@]}" 2>&1 | grep -E "^ +train  eval loss|^ +evaluate  (base|tuned)|wall"
  rm -rf "$cache" out
}
run before "$old" vulkan
run after "$new" vulkan
run reference "$new" cpu
