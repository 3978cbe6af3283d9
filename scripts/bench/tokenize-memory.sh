#!/usr/bin/env bash
# Peak RSS and throughput of the tokenize stage on a large generated JSONL, through the path
# users run (`rtune run … --only tokenize`), for one or two rtune binaries side by side.
#
#   scripts/bench/tokenize-memory.sh SIZE_MB RTUNE [OLD_RTUNE]
#
# The dataset is the bundled synthetic Alpaca file repeated (each copy's instructions numbered,
# so rows differ) up to SIZE_MB; the model is the tiny-offline scratch model (its tokenizer is
# trained once on the small file). Prints one line per binary: seconds, MB/s, peak RSS.
set -euo pipefail
size_mb=$1; shift
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="${BENCH_DIR:-$(mktemp -d)}"
mkdir -p "$work"
grep "model name" /proc/cpuinfo | head -1 || true
if [ ! -f "$work/data/big-$size_mb.jsonl" ]; then
  mkdir -p "$work/data"
  python3 - "$root/recipes/data/synthetic-alpaca.jsonl" "$work/data/big-$size_mb.jsonl" "$size_mb" <<'PY'
import json, sys
src, dst, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(src) if l.strip()]
limit, n, k = mb << 20, 0, 0
with open(dst, "w") as f:
    while n < limit:
        for r in rows:
            r = dict(r, instruction=f"{r['instruction']} (#{k})")
            line = json.dumps(r) + "\n"
            f.write(line); n += len(line)
            if n >= limit: break
        k += 1
PY
fi
for bin in "$@"; do
  proj="$work/proj-$(basename "$(dirname "$bin")")-$size_mb"
  rm -rf "$proj"; mkdir -p "$proj/data"
  ln -f "$work/data/big-$size_mb.jsonl" "$proj/data/big.jsonl" 2>/dev/null || cp "$work/data/big-$size_mb.jsonl" "$proj/data/big.jsonl"
  # The scratch model: built once by the tiny-offline recipe's download stage.
  if [ ! -d "$work/model" ]; then
    mkdir -p "$work/tiny/data"; cp "$root/recipes/tiny-offline.toml" "$work/tiny/"
    cp "$root/recipes/data/synthetic-alpaca.jsonl" "$work/tiny/data/"
    (cd "$work/tiny" && RTUNE_CACHE_DIR="$work/tiny-cache" "$bin" run tiny-offline.toml --only download -q >/dev/null)
    cp -r "$work"/tiny-cache/store-v1/artifacts/*/model "$work/model"
  fi
  cat > "$proj/bench.toml" <<TOML
[recipe]
name = "tokenize-bench"
[model]
path = "$work/model"
[dataset]
path = "data/big.jsonl"
format = "alpaca"
eval_fraction = 0.01
max_seq_len = 256
packing = true
[stages.train]
TOML
  export RTUNE_CACHE_DIR="$proj/cache" RTUNE_NO_PROGRESS=1
  (cd "$proj" && "$bin" run bench.toml --only download -q >/dev/null)
  start=$(date +%s.%N)
  /usr/bin/time -f "%M" -o "$proj/rss" bash -c "cd '$proj' && '$bin' run bench.toml --only tokenize -q >/dev/null"
  end=$(date +%s.%N)
  python3 - "$bin" "$size_mb" "$start" "$end" "$(cat "$proj/rss")" <<'PY'
import sys
b, mb, s, e, rss = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
print(f"{b}: {mb} MB JSONL tokenized in {e-s:.1f} s ({mb/(e-s):.1f} MB/s), peak RSS {rss/1024:.0f} MB")
PY
  rm -rf "$proj/cache"
done
