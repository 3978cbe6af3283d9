#!/usr/bin/env bash
# Time of the quantize stage's importance-matrix pass (16,384 train tokens through the adapter
# model, one layer at a time, on the CPU) through the path users run (`rtune run … --only quantize
# --force quantize`), for one or two rtune binaries one after the other on the same trained
# adapter: each run stops once the stage reports `imatrix.gguf` (the GGUF's self-check that
# follows is timed by scripts/bench_export_memory.sh), and prints that line.
#
#   scripts/bench_imatrix_pass.sh RTUNE [OLD_RTUNE]
#
# The model: SmolLM2-135M's shape (hidden 576, 30 layers, MLP 1536, vocabulary 8192; random
# weights) with LoRA r=8 on q/k/v/o, trained 2 steps, on the default recipe's Alpaca rows (a
# few dozen tokens each).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${BENCH_DIR:-$(mktemp -d)}"
grep "model name" /proc/cpuinfo | head -1 || true
cp "$root/recipes/data/synthetic-alpaca.jsonl" "$work/rows.jsonl"
cat >"$work/bench.toml" <<'TOML'
[recipe]
name = "imatrix-pass"
seed = 42
[model]
scratch = { arch = "llama", hidden_size = 576, num_layers = 30, num_heads = 9, num_kv_heads = 3, intermediate_size = 1536, vocab_size = 8192 }
[dataset]
path = "rows.jsonl"
format = "alpaca"
eval_fraction = 0.05
[adapter]
rank = 8
alpha = 16
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
[device]
prefer = ["cpu"]
dtype = ["f32"]
[stages.train]
max_steps = 2
batch_size = 1
learning_rate = 1e-3
[stages.quantize]
formats = ["gguf-q4_k_m"]
TOML
export RTUNE_CACHE_DIR="$work/cache" RTUNE_NO_PROGRESS=1
(cd "$work" && "$1" run bench.toml --until train -q >/dev/null)
for bin in "$@"; do
  (cd "$work" && exec "$bin" run bench.toml --only quantize --force quantize) >"$work/log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null && ! grep -q "imatrix.gguf" "$work/log"; do sleep 0.2; done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  echo "$bin: $(grep -o "imatrix.gguf: .*" "$work/log" || echo "no importance matrix (see $work/log)")"
done
