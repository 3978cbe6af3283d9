#!/usr/bin/env bash
# The GPU checks (issue 17), on a machine with an NVIDIA GPU, with binaries from
# scripts/toolchain/build-cuda.sh:
#
#   . scripts/gpu/env.sh && scripts/gpu/verify.sh
#
# 1. `rtune doctor` sees the GPU;
# 2. the GPU engine's tests (tests/gpu_engine.rs) pass on the GPU as well as on the emulator:
#    every kernel against a reference, the engine against candle autograd on the fixtures;
# 3. the default recipe runs end to end on CUDA (f32), and on the CPU: eval losses and the first
#    50 training losses are compared;
# 4. the default recipe's training in bf16 and f16 (loss scaling) on CUDA; a q4_k_m export
#    calibrated by an importance matrix computed on CUDA, beside the CPU's;
# 5. a full fine-tune of the default recipe's model, 50 steps on CUDA (the GPU engine, and
#    candle's autograd with RTUNE_ENGINE=candle) and on the CPU (the fused CPU engine), compared;
# 6. QLoRA (`adapter.quantize_base = "nf4-dq"`), 50 steps on CUDA and on the CPU, compared;
# 7. a scratch Gemma 3 end to end on CUDA and the CPU: training, evaluation and its q8_0 GGUF
#    self-checked on the device (the quantize stage reads the GGUF back as llama.cpp does,
#    export::gguf::read, on the run's device);
# 8. where a Vulkan loader is present (scripts/gpu/env.sh brings one from .gl/): the GPU engine's tests on
#    the GPU through Vulkan, and the default recipe (and the full fine-tune and QLoRA) through
#    Vulkan against the CPU (issue 18).
# Logs go to $OUT (or /tmp/rtune-gpu-verify). TESTS=0 skips the engine's tests (2 and 7's).
# CHECKS picks groups (default all, in this order): cuda (3's CUDA run), cpu (the CPU's runs, the
# reference of every comparison), q4km (4's export), lowprec (4's bf16/f16), full (5), qlora (6),
# gemma3 (7), vulkan (8; with full and qlora, their Vulkan runs too). Only comparisons whose runs were
# picked are made, e.g. CHECKS="cpu vulkan" TESTS=0 for the default recipe through Vulkan alone.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/rtune-gpu-verify}"
mkdir -p "$out"
export RTUNE_NO_PROGRESS=1
status=0
step() { echo; echo "== $*"; }
checks=" ${CHECKS:-cuda cpu q4km lowprec full qlora gemma3 vulkan} "
picked() { [[ "$checks" == *" $1 "* ]]; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
.gpu/rtune doctor 2>&1 | tee "$out/doctor.txt" || status=1

tests="${TESTS:-1}"
if [ "$tests" != 0 ]; then
  step "GPU engine tests (emulator and CUDA)"
  .gpu/gpu_engine --test-threads 1 2>&1 | tee "$out/gpu_engine.txt" | grep -E "^test |test result|panicked|error" || status=1
fi

run_recipe() { # name cache-dir args...
  local name=$1 cache=$2
  shift 2
  local t0=$SECONDS
  RTUNE_CACHE_DIR="$cache" .gpu/rtune run recipes/tiny-offline.toml "$@" >"$out/$name.stdout" 2>"$out/$name.stderr" || status=1
  echo "$name: $((SECONDS - t0)) s"
  grep -E "train |evaluate |quantize |upload |error|Error" "$out/$name.stderr" | head -20
}
if picked cuda; then
  step "default recipe on CUDA (f32)"
  run_recipe tiny-cuda /tmp/rtune-cache-cuda
fi
if picked cpu; then
  step "default recipe on the CPU"
  run_recipe tiny-cpu /tmp/rtune-cache-cpu --set 'device.prefer=["cpu"]'
fi
if picked q4km; then
  step "a calibrated GGUF (the importance matrix's pass on the device) on CUDA and the CPU"
  calibrated=(--until quantize --set 'stages.quantize.formats=["gguf-q4_k_m"]')
  run_recipe q4km-cuda /tmp/rtune-cache-cuda "${calibrated[@]}"
  run_recipe q4km-cpu /tmp/rtune-cache-cpu "${calibrated[@]}" --set 'device.prefer=["cpu"]'
fi
if picked lowprec; then
  step "default recipe's training on CUDA in bf16 and f16"
  run_recipe tiny-bf16 /tmp/rtune-cache-cuda --until train --set 'device.dtype=["bf16"]'
  run_recipe tiny-f16 /tmp/rtune-cache-cuda --until train --set 'device.dtype=["f16"]'
fi
full=(--until train --set adapter.kind=none --set stages.train.max_steps=50 --set stages.train.learning_rate=1e-4
  --set 'stages.quantize.formats=["safetensors-merged"]')
if picked full; then
  step "full fine-tune, 50 steps, on CUDA and the CPU"
  run_recipe full-cuda /tmp/rtune-cache-cuda "${full[@]}"
  RTUNE_ENGINE=candle run_recipe full-cuda-candle /tmp/rtune-cache-cuda "${full[@]}"
  run_recipe full-cpu /tmp/rtune-cache-cpu "${full[@]}" --set 'device.prefer=["cpu"]'
fi
qlora=(--until train --set 'adapter.quantize_base="nf4-dq"' --set stages.train.max_steps=50)
if picked qlora; then
  step "QLoRA (nf4-dq), 50 steps, on CUDA and the CPU"
  run_recipe qlora-cuda /tmp/rtune-cache-cuda "${qlora[@]}"
  run_recipe qlora-cpu /tmp/rtune-cache-cpu "${qlora[@]}" --set 'device.prefer=["cpu"]'
fi
# tests/pipeline.rs's scratch Gemma 3 (a_gemma3_model_trains_and_exports_end_to_end), to its GGUF.
gemma3=(--set 'model.scratch={arch="gemma3", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128, vocab_size=512}'
  --set 'stages.train.trainable=["adapter", "*feedforward_layernorm.weight"]' --set stages.train.max_steps=30
  --set stages.evaluate.max_new_tokens=2 --set 'stages.quantize.formats=["gguf-q8_0"]')
if picked gemma3; then
  step "a scratch Gemma 3 to its q8_0 GGUF, self-checked on the device, on CUDA and the CPU"
  run_recipe gemma3-cuda /tmp/rtune-cache-cuda --until quantize "${gemma3[@]}"
  run_recipe gemma3-cpu /tmp/rtune-cache-cpu --until quantize "${gemma3[@]}" --set 'device.prefer=["cpu"]'
fi

if ! picked vulkan; then
  :
elif step "Vulkan: the GPU engine's tests and the default recipe" && .gpu/rtune doctor 2>/dev/null | grep -q "^  vulkan:"; then
  .gpu/rtune doctor 2>&1 | grep -A1 "^  vulkan:" | tee "$out/doctor-vulkan.txt"
  # Where the driver lists cooperative matrices (doctor shows their shapes), the tests must run
  # f16 — and bf16 if listed — products and attention on them (gemm_cm, attn_*_mma) and pass
  # their first-use checks.
  mu=$(grep -o "cooperative matrices: .*" "$out/doctor-vulkan.txt" | grep -oE "\bb?f16\b" | sort -u | paste -sd, || true)
  if [ "$tests" != 0 ]; then
    RTUNE_REQUIRE_MATRIX_UNITS="$mu" RTUNE_TEST_VULKAN="${RTUNE_TEST_VULKAN:-0}" RTUNE_REQUIRE_VULKAN=1 .gpu/gpu_engine --test-threads 1 2>&1 |
      tee "$out/gpu_engine-vulkan.txt" | grep -E "^test |test result|panicked" || status=1
  fi
  run_recipe tiny-vulkan /tmp/rtune-cache-vulkan --set 'device.prefer=["vulkan"]'
  ! picked full || run_recipe full-vulkan /tmp/rtune-cache-vulkan "${full[@]}" --set 'device.prefer=["vulkan"]'
  ! picked qlora || run_recipe qlora-vulkan /tmp/rtune-cache-vulkan "${qlora[@]}" --set 'device.prefer=["vulkan"]'
else # asked for (CHECKS names it, as it does by default) and not run: a failure, not a pass
  echo "no Vulkan device (carry the loader's and glvnd's .debs under .gl/: scripts/gpu/prep.sh); leave vulkan out of CHECKS on a machine without one"
  status=1
fi

step "against the CPU"
python3 - "$out" <<'PY' || status=1
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
def ran(name):
    return (out / f"{name}.stdout").exists()
def artifact(name, stage):
    for line in (out / f"{name}.stdout").read_text().splitlines():
        m = re.match(rf"\s*{stage}\s+\S+\s+(\S+)", line)
        if m:
            return Path(m.group(1).replace("~", str(Path.home())))
    raise RuntimeError(f"no {stage} artifact: the run failed (see {name}.stderr)")
def curve(name):
    p = artifact(name, "train")
    recs = [json.loads(l) for l in (p / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r], json.loads((p / "metrics.json").read_text())
def fails(name, check):
    """Run one comparison (True: it failed); a run without its artifacts fails it, named."""
    try:
        return check()
    except Exception as e:
        print(f"{name}: {e}")
        return True
def default_recipe(name):
    (got, mg), (cpu, mp) = curve(name), curve("tiny-cpu")
    worst = max(abs(a - b) / abs(b) for a, b in zip(got[:50], cpu[:50]))
    d = abs(mg["eval_loss_end"] - mp["eval_loss_end"]) / mp["eval_loss_end"]
    print(f"{name}: first 50 training losses within {worst:.2e} relative of the CPU's; eval loss after training "
          f"{mg['eval_loss_end']:.7f} vs CPU {mp['eval_loss_end']:.7f} ({d:.2e} relative), "
          f"{mg.get('tokens_per_s')} tok/s, {mg.get('engine')}")
    for run in [name, "tiny-cpu"]:
        m = json.loads((artifact(run, "evaluate") / "metrics.json").read_text())
        print(f"{run}: evaluate stage eval loss {m['eval_loss']:.7f}")
    return worst > 1e-4 or d > 1e-4
def low_precision(name):
    _, m = curve(name)
    print(f"{name} on CUDA: eval loss {m['eval_loss_end']:.5f}, {m.get('engine')}")
    return False
def calibrated(name):
    def q4km(run):
        return json.loads((artifact(run, "quantize") / "exports.json").read_text())["formats"]["gguf-q4_k_m"]
    g, c = q4km(name), q4km("q4km-cpu")
    ppl = lambda e: 2.718281828459045 ** e["eval_loss"]
    d = abs(ppl(g) - ppl(c)) / ppl(c)
    print(f"{name}: q4_k_m calibrated on the device: perplexity {ppl(g):.4f} (CPU's file {ppl(c):.4f}, "
          f"{d:.2e} relative), same top token {g['top_token_agreement']:.1%} (CPU's {c['top_token_agreement']:.1%})")
    # The importance matrices differ by float rounding only: a few blocks may round the other way.
    return d > 1e-2 or not (g["imatrix"] and c["imatrix"])
def gemma3(name):
    (got, mg), (cpu, mp) = curve(name), curve("gemma3-cpu")
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, cpu))
    q8 = lambda run: json.loads((artifact(run, "quantize") / "exports.json").read_text())["formats"]["gguf-q8_0"]
    g, c = q8(name), q8("gemma3-cpu")
    d = abs(g["eval_loss"] - c["eval_loss"]) / c["eval_loss"]
    print(f"{name}: 30 training losses within {worst:.2e} relative of the CPU's ({mg.get('engine')}); q8_0 GGUF "
          f"read back on the device: eval loss {g['eval_loss']:.6f} vs the CPU's file {c['eval_loss']:.6f} ({d:.2e} "
          f"relative), perplexity ratio {g['perplexity_ratio']:.4f} (CPU {c['perplexity_ratio']:.4f}), same top token "
          f"{g['top_token_agreement']:.1%} (CPU {c['top_token_agreement']:.1%})")
    return worst > 1e-4 or d > 1e-3 or abs(g["perplexity_ratio"] - 1) > 0.01 or g["top_token_agreement"] < 0.95
def against_cpu(name, reference, what, tol):
    (fc, mfc), (fp, mfp) = curve(name), curve(reference)
    w = max(abs(a - b) / abs(b) for a, b in zip(fc, fp))
    print(f"{what}, 50 steps, {name}: max relative loss difference vs CPU {w:.2e}; eval loss "
          f"{mfc['eval_loss_end']:.6f} vs {mfp['eval_loss_end']:.6f} ({mfc.get('engine')} / {mfp.get('engine')})")
    return w > tol
checks = [
    ("tiny-cuda", default_recipe), ("tiny-vulkan", default_recipe),
    ("tiny-bf16", low_precision), ("tiny-f16", low_precision),
    ("q4km-cuda", calibrated),
    ("full-cuda", lambda n: against_cpu(n, "full-cpu", "full fine-tune", 1e-3)),
    ("full-cuda-candle", lambda n: against_cpu(n, "full-cpu", "full fine-tune", 1e-3)),
    ("full-vulkan", lambda n: against_cpu(n, "full-cpu", "full fine-tune", 1e-3)),
    ("qlora-cuda", lambda n: against_cpu(n, "qlora-cpu", "QLoRA (nf4-dq)", 1e-4)),
    ("qlora-vulkan", lambda n: against_cpu(n, "qlora-cpu", "QLoRA (nf4-dq)", 1e-4)),
    ("gemma3-cuda", gemma3),
]
failed = False
for name, check in checks:
    if ran(name):
        failed |= fails(name, lambda: check(name))
if failed:
    print("FAIL")
    sys.exit(1)
PY
echo
[ $status = 0 ] && echo "all GPU checks passed" || echo "SOME GPU CHECKS FAILED"
exit $status
