#!/usr/bin/env bash
# rtune and PyTorch + PEFT side by side on one NVIDIA GPU, one after the other, on the same
# shapes (issue 17): LoRA r16/α32/dropout 0.05 on q/k/v/o_proj, bf16, AdamW, constant learning
# rate, random-weight models made by transformers (benches/reference/gpu_shapes.py). rtune runs
# the path users run (`rtune run` on a recipe, training stage); its steady-state tokens/s and
# peak GPU memory come from the train stage's own report. PyTorch uses SDPA attention,
# autocast bf16 and fused AdamW (benches/reference/peft_gpu.py). Prints a markdown table.
#
#   . scripts/gpu/env.sh && scripts/gpu/bench.sh [SHAPE:BATCHxSEQ ...]
#
# Default shapes: smollm2-135m:4x1024 qwen2.5-0.5b:4x1024 qwen2.5-3b:4x1024 qwen2.5-3b:1x512
# (also: smollm2-360m, qwen3-0.6b, gemma3-270m; benches/reference/gpu_shapes.py).
# STEPS (default 20) timed steps each; RTUNE (default .gpu/rtune) the binary; SKIP_TORCH=1 runs
# rtune alone (e.g. with RTUNE_ENGINE=candle, to measure candle's autograd on the GPU); DEVICE
# (default cuda) and DTYPE (default bf16) are the recipe's device preference and dtype — issue
# 18's comparison is `DEVICE=vulkan scripts/gpu/bench.sh smollm2-135m:4x512 smollm2-360m:4x512`
# (the Vulkan engine on the same GPU against PyTorch on CUDA; scripts/gpu/env.sh brings the loader).
# TRAIN=full benchmarks a full fine-tune instead of LoRA: `adapter.kind = "none"` for rtune, and
# for PyTorch fp32 weights under autocast bf16 with AdamW over every weight (peft_gpu.py --full).
# TRAIN=qlora benchmarks QLoRA: `adapter.quantize_base = "nf4-dq"` (QUANT=nf4 without double
# quantization) for rtune, transformers' `load_in_4bit` NF4 base with double quantization
# (bitsandbytes) for PyTorch (peft_gpu.py --qlora).
# To dry-run this script without a GPU (PyTorch, transformers and PEFT on the CPU, rtune through
# lavapipe): TORCH_DEVICE=cpu DEVICE=vulkan RTUNE=target/release/rtune scripts/gpu/bench.sh smoke:2x128
set -euo pipefail
cd "$(dirname "$0")/../.."
root="${GPU_BENCH_DIR:-/tmp/rtune-gpu-bench}"
steps="${STEPS:-20}"
device="${DEVICE:-cuda}"
dtype="${DTYPE:-bf16}"
train="${TRAIN:-lora}"
torch_device="${TORCH_DEVICE:-cuda}"
base=""
case "$train" in lora) kind=lora torch_args=() ;; full) kind=none torch_args=(--full) ;;
qlora) kind=lora torch_args=(--qlora) base="quantize_base = \"${QUANT:-nf4-dq}\"" ;; *)
  echo "TRAIN is lora, full or qlora, not $train" >&2
  exit 2
  ;;
esac
rtune="${RTUNE:-.gpu/rtune}"
out="${OUT:-$root}"
mkdir -p "$root" "$out"
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(smollm2-135m:4x1024 qwen2.5-0.5b:4x1024 qwen2.5-3b:4x1024 qwen2.5-3b:1x512)
export RTUNE_NO_PROGRESS=1 PYTHONUNBUFFERED=1
results="$out/gpu_bench.jsonl"
: >"$results"
for spec in "${specs[@]}"; do
  shape=${spec%%:*} bs=${spec#*:}
  b=${bs%x*} t=${bs#*x}
  python3 -c "import sys; sys.path.insert(0, 'benches/reference'); import gpu_shapes; gpu_shapes.make('$shape', '$root', '$torch_device')"
  recipe="$root/$shape-${b}x$t-$device-$dtype-$train.toml"
  cat >"$recipe" <<EOF
[recipe]
name = "gpu-bench-$shape-${b}x$t-$device-$dtype-$train"
seed = 0

[model]
path = "$root/$shape"

[dataset]
path = "$root/data.jsonl"
format = "text"
eval_fraction = 0.01
max_seq_len = $t
packing = false

[adapter]
kind = "$kind"
rank = 16
alpha = 32
dropout = 0.05
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
$base

[device]
prefer = ["$device"]
dtype = ["$dtype"]

[stages.train]
max_steps = $((steps + 3))
batch_size = $b
learning_rate = 1e-4
schedule = { kind = "constant" }
eval_batches = 1
checkpoint_every = 0
EOF
  echo "== $shape $b×$t: rtune on $device ($dtype, $train)" >&2
  log="$out/rtune-$shape-${b}x$t-$device-$dtype-$train.log"
  if ! RTUNE_CACHE_DIR="$root/cache" "$rtune" run "$recipe" --force train >"$log" 2>&1; then
    echo "rtune failed on $shape $b×$t:" >&2
    tail -20 "$log" >&2
  fi
  # Which kernels ran (the matrix units' first-use checks decide on Vulkan), then the speed.
  grep -E "^ +kernels |failed a check|stands? in|instead" "$log" | head -4 >&2 || true
  grep -E "tok/s" "$log" | tail -2 >&2 || true
  if [ -n "${SKIP_TORCH:-}" ]; then
    continue
  fi
  echo "== $shape $b×$t: PyTorch ($train)" >&2
  ref=$(python3 benches/reference/peft_gpu.py "$root/$shape" "$b" "$t" "$steps" "${torch_args[@]}" --device "$torch_device" | tail -1)
  python3 - "$log" "$shape" "$b" "$t" "$ref" "$train" >>"$results" <<'PY'
import json, re, sys
log, shape, b, t, ref = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
train = sys.argv[6]
text = open(log).read()
m = re.search(r"eval loss \S+ → \S+ in (\d+) steps \(([\d.]+)s, (\d+) tok/s(?:, peak GPU ([\d.]+) (\w+))?", text)
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
engine = re.search(r"trained parameters, (.*)", text)
print(json.dumps({
    "shape": shape, "batch": b, "seq": t, "train": train,
    "rtune_tokens_per_s": float(m.group(3)) if m else None,
    "rtune_peak_bytes": float(m.group(4)) * units[m.group(5)] if m and m.group(4) else None,
    "rtune_engine": engine.group(1).strip() if engine else None,
    "torch": ref,
}))
PY
done
[ -s "$results" ] || exit 0
python3 - "$results" <<'PY'
import json, sys
sys.path.insert(0, "benches/reference")
from gpu_shapes import SHAPES
rows = [json.loads(l) for l in open(sys.argv[1])]
ref = {"lora": "PyTorch+PEFT", "qlora": "PyTorch+PEFT+bitsandbytes", "full": "PyTorch (full fine-tune)"}[rows[0].get("train", "lora")]
print(f"\n| shape | batch × seq | rtune tok/s | {ref} tok/s | speed ratio | rtune peak GPU | PyTorch peak GPU (allocated / reserved) | memory ratio |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    t = r["torch"]
    tps, peak = r["rtune_tokens_per_s"] or 0.0, r["rtune_peak_bytes"]
    gib = lambda b: "—" if b is None else f"{b / 2**30:.2f} GiB"
    ratio = "—" if peak is None or t["peak_allocated_bytes"] is None else f"{peak / t['peak_allocated_bytes']:.2f}x"
    print(f"| {r['shape']} | {r['batch']} × {r['seq']} | {tps:,.0f} | {t['tokens_per_s']:,.0f} | "
          f"{tps / t['tokens_per_s']:.2f}x | {gib(peak)} | "
          f"{gib(t['peak_allocated_bytes'])} / {gib(t['peak_reserved_bytes'])} | {ratio} |")
# Model FLOP utilisation: 4 FLOPs per weight per token (forward, and backward to the inputs —
# LoRA computes no gradient for frozen weights; 6 in a full fine-tune, which also computes the
# weights' gradients) plus attention (forward 2·t·d·H per token and layer with causal masking,
# backward twice that), against the H100 SXM's 989 TFLOP/s dense bf16.
for r in rows:
    arch, c = SHAPES[r["shape"]]
    h, L, inter, V = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    weights = L * (2 * h * q + 2 * h * kv + 3 * h * inter) + V * h
    per_token = (6 if r.get("train") == "full" else 4) * weights + L * 6 * r["seq"] * d * c["num_attention_heads"]
    for who, tps in [("rtune", r["rtune_tokens_per_s"] or 0.0), ("PyTorch", r["torch"]["tokens_per_s"])]:
        flops = per_token * tps
        print(f"{r['shape']} {r['batch']}×{r['seq']} {who}: {flops / 1e12:.0f} TFLOP/s model FLOPs, MFU {flops / 989e12:.1%}")
print(f"\n{rows[0]['torch']['device']}; {rows[0]['torch']['impl']}; rtune: {rows[0]['rtune_engine']}")
PY
