#!/usr/bin/env bash
# Importance matrices made by llama.cpp's own llama-imatrix, for tests/model.rs
# (`llama_imatrix_files_read_alike`) and tests/pipeline.rs (`a_named_importance_matrix_calibrates`):
#
#   scripts/make_imatrix_fixtures.sh RTUNE LLAMA_IMATRIX
#
# RTUNE: an rtune binary; LLAMA_IMATRIX: llama.cpp's llama-imatrix (built from the llama.cpp that
# llama-cpp-python 0.3.36 vendors: cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF, then
# cmake --build build --target llama-imatrix). rtune exports the default recipe's model (2 layers,
# 64 wide, MLP 128: the tests' model shape) as an f32 GGUF; llama-imatrix runs it over the bundled
# synthetic dataset's outputs in chunks of 64 tokens and writes the same matrix in both of its
# formats: tests/fixtures/quant/llama-imatrix.gguf and tests/fixtures/quant/llama-imatrix.dat.
# Never run in CI.
set -euo pipefail
rtune=$(realpath "$1")
imatrix=$(realpath "$2")
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$root/recipes/tiny-offline.toml" "$work/"
cp -r "$root/recipes/data" "$work/"
cd "$work"
export RTUNE_CACHE_DIR="$work/cache" RTUNE_NO_PROGRESS=1
"$rtune" run tiny-offline.toml --set stages.train.max_steps=20 --set 'stages.quantize.formats=["gguf-f32"]' \
  --json >run.json 2>/dev/null
model=$(python3 -c 'import json; print(next(s["artifact"] for s in json.load(open("run.json"))["stages"] if s["name"] == "quantize"))')/gguf/model-f32.gguf
python3 -c 'import json; print("\n".join(json.loads(l)["output"] for l in open("data/synthetic-alpaca.jsonl")))' >text.txt
for format in gguf dat; do
  "$imatrix" -m "$model" -f text.txt -c 64 --chunks 40 --no-ppl --output-format "$format" \
    -o "$root/tests/fixtures/quant/llama-imatrix.$format" >/dev/null 2>&1
done
ls -l "$root/tests/fixtures/quant/llama-imatrix".*
