#!/usr/bin/env python3
"""The Python `tokenizers` library doing what rtune's tokenize stage does on the same data:
read JSONL, render the Alpaca prompt, encode prompts and outputs in batches (no special tokens),
add bos/eos. Run after `cargo bench --bench tokenize`:

    python3 scripts/bench/tokenize-speed.py target/bench-tokenize
"""
import json
import os
import statistics
import sys
import time

from tokenizers import Tokenizer

ALPACA_WITH_INPUT = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"

d = sys.argv[1]
tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
times, tokens = [], 0
for _ in range(3):
    t0 = time.perf_counter()
    with open(os.path.join(d, "alpaca-100k.jsonl")) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    tokens = 0
    for i in range(0, len(rows), 4096):
        chunk = rows[i : i + 4096]
        prompts = [(ALPACA_WITH_INPUT if r.get("input", "").strip() else ALPACA_NO_INPUT).format(instruction=r["instruction"], input=r.get("input", "")) for r in chunk]
        p = tok.encode_batch(prompts, add_special_tokens=False)
        o = tok.encode_batch([r["output"] for r in chunk], add_special_tokens=False)
        for a, b in zip(p, o):
            ids = [bos] + a.ids + b.ids + [eos]
            tokens += len(ids)
    times.append(time.perf_counter() - t0)
med = statistics.median(times)
print(f"python tokenizers (alpaca, {len(rows)} rows, {tokens} tokens): median {med:.2f} s of 3 = {len(rows)/med:.0f} rows/s, {tokens/med:.0f} tokens/s")
