#!/usr/bin/env bash
# GGUF calibration, side by side: the same trained model exported by `rtune run` with and without
# an importance matrix, each file's distance from the f32 model measured in llama.cpp
# (scripts/interop/gguf-kld.py: KL divergence, same top token, perplexity) on rtune's eval split and on
# held-out text of another source. Results: docs/benchmarks.md, "GGUF calibration".
#
#   scripts/bench/imatrix.sh RTUNE [WORK_DIR]
#
# Needs Python 3 with llama-cpp-python, gguf and numpy (pip install llama-cpp-python gguf numpy);
# never run in CI. The corpus is prose from Python's own documentation: the training text is
# pydoc's topics and the standard library's docstrings, the held-out text numpy's docstrings.
# The model: a scratch Llama 256 wide, 4 layers, fully fine-tuned for 8 epochs (every matrix
# whole K-quant blocks), then exported to f32 and seven quantized types.
set -euo pipefail
rtune=$(realpath "$1")
scripts=$(dirname "$(dirname "$(realpath "$0")")")
work=${2:-$(mktemp -d)}
mkdir -p "$work/data"
cd "$work"
python3 - <<'PY'
import contextlib, importlib, inspect, io, json, random, re, sys
import numpy as np
import pydoc_data.topics as topics

def paragraphs(docs, seen):
    for d in docs:
        for p in re.split(r"\n\s*\n", d or ""):
            p = " ".join(p.split())
            if len(p) >= 200 and not p.startswith(">>>") and p not in seen:
                seen.add(p)
                yield p

seen, docs = set(), list(topics.topics.values())
for m in sorted(sys.stdlib_module_names):
    if m.startswith("_") or m in ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"):
        continue
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            mod = importlib.import_module(m)
    except Exception:
        continue
    for o in [mod] + [getattr(mod, n, None) for n in dir(mod) if not n.startswith("_")]:
        try:
            docs.append(inspect.getdoc(o))
        except Exception:
            pass
train = list(paragraphs(docs, seen))
random.Random(0).shuffle(train)
with open("data/docs.jsonl", "w") as f:
    for p in train:
        f.write(json.dumps({"text": p}) + "\n")
held = "\n".join(paragraphs((inspect.getdoc(getattr(np, n)) for n in dir(np)), set(seen)))
open("heldout.txt", "w").write(held[:120000])
print(f"corpus: {len(train)} training paragraphs, {len(held[:120000])} characters held out")
PY
cat > imatrix.toml <<'TOML'
[recipe]
name = "imatrix-bench"
seed = 42

[model]
scratch = { arch = "llama", hidden_size = 256, num_layers = 4, num_heads = 4, num_kv_heads = 2, intermediate_size = 768, vocab_size = 2048 }

[dataset]
path = "data/docs.jsonl"
format = "text"
eval_fraction = 0.05
max_seq_len = 128

[adapter]
kind = "none"

[device]
prefer = ["cpu"]
dtype = ["f32"]

[stages.train]
epochs = 8
batch_size = 16
learning_rate = 1e-3
schedule = { kind = "cosine", warmup_steps = 20 }
clip_grad_norm = 1.0
eval_every = 200

[stages.quantize]
formats = ["gguf-f32", "gguf-q6_k", "gguf-q5_k_s", "gguf-q4_k_m", "gguf-q4_k_s", "gguf-q4_0", "gguf-q3_k_m", "gguf-q2_k"]
TOML
export RTUNE_CACHE_DIR="$work/cache" RTUNE_NO_PROGRESS=1
lscpu | grep -m1 'Model name' || true
artifact() { python3 -c 'import json,sys; print(next(s["artifact"] for s in json.load(sys.stdin)["stages"] if s["name"] == sys.argv[1]))' "$1"; }
plain=$("$rtune" run imatrix.toml --set stages.quantize.imatrix=false --json | artifact quantize)
calibrated=$("$rtune" run imatrix.toml --json | artifact quantize)
tokens=$("$rtune" run imatrix.toml --json | artifact tokenize)
for text in "$tokens/eval" heldout.txt; do
  echo "== $text"
  files=()
  for t in q6_k q5_k_s q4_k_m q4_k_s q4_0 q3_k_m q2_k; do files+=("$plain/gguf/model-$t.gguf" "$calibrated/gguf/model-$t.gguf"); done
  python3 "$scripts/interop/gguf-kld.py" "$text" "$plain/gguf/model-f32.gguf" "${files[@]}" 2>/dev/null |
    sed "s#$plain/gguf/#plain      #; s#$calibrated/gguf/#calibrated #"
done
