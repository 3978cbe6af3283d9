#!/usr/bin/env bash
# Peak memory and time of the quantize stage (merged safetensors + q8_0 GGUF, with their
# self-checks) through the path users run (`rtune run … --only quantize --force quantize`), for
# one or two rtune binaries side by side on the same trained adapter.
#
#   scripts/bench/export-memory.sh SHAPE RTUNE [OLD_RTUNE]
#
# FORMATS='["gguf-q4_k"]' exports those formats instead (a TOML list). DEVICE=cuda runs the
# recipe on that device (the exports' self-checks then run there, one decoder layer at a time) and
# adds the GPU's peak memory during the quantize stage above its idle level (nvidia-smi, every
# 100 ms).
#
# SHAPE: `1b` (TinyLlama-1.1B's shape: hidden 2048, 22 layers, MLP 5632, vocab 32000, 4.4 GB in
# f32) or `tiny`. The model is a scratch model (random weights, f32); the adapter is LoRA r=8 on
# every projection, trained 2 steps so that its B matrices are not zero; the eval split is small
# (the GGUF self-check decodes every eval token on the CPU).
#
# IMATRIX=1 times only the importance matrix's pass (16,384 train tokens through the adapter model,
# one layer at a time): each run stops once the stage reports `imatrix.gguf` and prints that line
# (the default FORMATS becomes `["gguf-q4_k_m"]`; ROWS=3000 gives it the tokens to take).
#
# Prints one line per binary: wall seconds, peak anonymous memory (RssAnon sampled every 50 ms:
# what the process itself allocated) and peak RSS (`/usr/bin/time`: that plus the pages of mapped
# checkpoint files, which the kernel can drop and re-read).
set -euo pipefail
shape=$1; shift
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="${BENCH_DIR:-$(mktemp -d)}"
mkdir -p "$work/data"
grep "model name" /proc/cpuinfo | head -1 || true
case "$shape" in
  1b) scratch='{ arch = "llama", hidden_size = 2048, num_layers = 22, num_heads = 32, num_kv_heads = 4, intermediate_size = 5632, vocab_size = 32000, max_position_embeddings = 2048 }' ;;
  135m) scratch='{ arch = "llama", hidden_size = 576, num_layers = 30, num_heads = 9, num_kv_heads = 3, intermediate_size = 1536, vocab_size = 8192 }' ;;
  tiny) scratch='{ arch = "llama", hidden_size = 64, num_layers = 2, num_heads = 4, num_kv_heads = 2, intermediate_size = 128, vocab_size = 512 }' ;;
  *) echo "unknown shape $shape (1b, 135m, tiny)" >&2; exit 2 ;;
esac
head -"${ROWS:-300}" "$root/recipes/data/synthetic-alpaca.jsonl" > "$work/data/rows.jsonl"
# (Outside the here-document: inside it, the default's quotes would be removed.)
default='["safetensors-merged", "gguf-q8_0"]'
[ -z "${IMATRIX:-}" ] || default='["gguf-q4_k_m"]'
formats=${FORMATS:-$default}
cat > "$work/bench.toml" <<TOML
[recipe]
name = "export-bench"
seed = 1
[model]
scratch = $scratch
[dataset]
path = "data/rows.jsonl"
format = "alpaca"
eval_fraction = 0.02
max_seq_len = 64
[adapter]
rank = 8
alpha = 16
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
[device]
prefer = ["${DEVICE:-cpu}"]
dtype = ["f32"]
[stages.train]
max_steps = 2
batch_size = 1
learning_rate = 1e-3
[stages.quantize]
formats = $formats
TOML
export RTUNE_CACHE_DIR="$work/cache" RTUNE_NO_PROGRESS=1
# The model, tokens and adapter: built once (their stages are the same in every binary compared).
(cd "$work" && "$1" run bench.toml --only download -q >/dev/null && "$1" run bench.toml --only tokenize -q >/dev/null \
  && "$1" run bench.toml --only train -q >/dev/null)
# GPU machines may lack /usr/bin/time and pgrep: their figures are then left out, not zeros.
timer=()
[ ! -x /usr/bin/time ] || timer=(/usr/bin/time -f "%M" -o "$work/rss")
gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
if [ -n "${IMATRIX:-}" ]; then
  for bin in "$@"; do
    (cd "$work" && exec "$bin" run bench.toml --only quantize --force quantize) >"$work/log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && ! grep -q "imatrix.gguf" "$work/log"; do sleep 0.2; done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    echo "$bin: $(grep -o "imatrix.gguf: .*" "$work/log" || echo "no importance matrix (see $work/log)")"
  done
  exit 0
fi
for bin in "$@"; do
  if [ "${DEVICE:-cpu}" != cpu ]; then
    idle=$(gpu_used)
    (while :; do gpu_used; sleep 0.1; done) >"$work/gpu" 2>/dev/null &
    sampler=$!
  fi
  start=$(date +%s.%N)
  echo 0 >"$work/rss"
  (cd "$work" && exec "${timer[@]}" "$bin" run bench.toml --only quantize --force quantize -q \
    > "$work/out.json") &
  pid=$!
  peak=0
  while kill -0 "$pid" 2>/dev/null; do
    for p in $(pgrep -P "$pid" 2>/dev/null; pgrep -f "$bin run bench.toml" 2>/dev/null); do
      anon=$(awk '/^RssAnon/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)
      [ -n "$anon" ] && [ "$anon" -gt "$peak" ] && peak=$anon
    done
    sleep 0.05
  done
  wait "$pid"
  end=$(date +%s.%N)
  gpu=""
  if [ "${DEVICE:-cpu}" != cpu ]; then
    kill "$sampler" 2>/dev/null || true
    gpu=", peak GPU memory $(($(sort -n "$work/gpu" | tail -1) - idle)) MiB above idle (${DEVICE})"
  fi
  python3 - "$bin" "$shape" "$start" "$end" "$peak" "$(cat "$work/rss")" "$gpu" <<'PY'
import sys
b, shape, s, e, anon, rss = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
mib = lambda k: f"{k / 1024:.0f} MiB" if k > 0 else "n/a"
print(f"{b}: quantize ({shape}) {e-s:.1f} s, peak anonymous memory {mib(anon)}, peak RSS {mib(rss)}{sys.argv[7]}")
PY
done
