#!/usr/bin/env bash
# The CPU engines side by side on the path users run (`rtune run`, train stage): the fused CPU
# engine (the default for f32 on the CPU) against candle's autograd (`RTUNE_ENGINE=candle`, what
# trained base weights on the CPU before 2026-11-24), one after the other on the same recipe,
# for a LoRA adapter, a LoRA adapter with the norms and embedding beside it, and a full
# fine-tune. Prints a markdown table of tokens/s (the train stage's steady-state rate) and peak
# RSS (the process's, which runs the train stage alone) from each run's report.
#
#   scripts/bench/cpu-engines.sh [STEPS]        # default 12 steps (3 more run as warm-up)
#
# The model is a scratch Llama (random weights, the dataset's own tokenizer): hidden 512, 8
# layers, 8 heads (4 KV), MLP 1536, vocabulary 2048; batch 4 × 128 tokens (no packing); the
# bundled synthetic dataset. RTUNE (default target/release/rtune, built if missing) the binary.
set -euo pipefail
cd "$(dirname "$0")/../.."
steps="${1:-12}"
rtune="${RTUNE:-target/release/rtune}"
[ -x "$rtune" ] || cargo build --release --quiet
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/data"
cp recipes/data/synthetic-alpaca.jsonl "$root/data/"
cat >"$root/bench.toml" <<EOF
[recipe]
name = "cpu-engines"
seed = 0

[model]
scratch = { arch = "llama", hidden_size = 512, num_layers = 8, num_heads = 8, num_kv_heads = 4, intermediate_size = 1536, vocab_size = 2048 }

[dataset]
path = "data/synthetic-alpaca.jsonl"
format = "alpaca"
eval_fraction = 0.01
max_seq_len = 128
packing = false

[adapter]
kind = "lora"
rank = 8
alpha = 16
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]

[device]
prefer = ["cpu"]
dtype = ["f32"]

[stages.train]
max_steps = $((steps + 3))
batch_size = 4
learning_rate = 1e-4
schedule = { kind = "constant" }
eval_batches = 1
eval_every = 0
checkpoint_every = 0
EOF
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) threads; $("$rtune" --version)" >&2
export RTUNE_NO_PROGRESS=1 RTUNE_CACHE_DIR="$root/cache"
# The model and tokens first, so that each measured process runs the train stage alone (its
# peak RSS is the training's).
"$rtune" run "$root/bench.toml" --only download --quiet >/dev/null
"$rtune" run "$root/bench.toml" --only tokenize --quiet >/dev/null
printf '\n| trains | engine | tok/s | peak RSS |\n|---|---|---|---|\n'
for what in lora lora+norms full; do
  case "$what" in
  lora) sets=() ;;
  lora+norms) sets=(--set 'stages.train.trainable=["adapter", "*norm*", "model.embed_tokens.weight"]') ;;
  full) sets=(--set adapter.kind=none) ;;
  esac
  for engine in fused candle; do
    log="$root/$what-$engine.log"
    RTUNE_ENGINE="$engine" "$rtune" run "$root/bench.toml" "${sets[@]}" --only train --force train --json \
      >"$root/report.json" 2>"$log"
    python3 - "$root/report.json" "$what" "$engine" <<'PY'
import json, sys
report, what, engine = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
m = next(s for s in report["stages"] if s["name"] == "train")["metrics"]
print(f"| {what} | {m['engine']} | {m['tokens_per_s']:,.0f} | {m['peak_rss_bytes'] / 2**20:,.0f} MiB |")
PY
  done
done
