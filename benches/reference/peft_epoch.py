#!/usr/bin/env python3
"""The PyTorch + PEFT side of the epoch benchmark (benches/epoch.rs), run by hand, never in CI:
one epoch over the rows `cargo bench --bench epoch -- SHAPE` wrote, in the same shuffled order
and batches, each batch padded to its longest row (transformers' DataCollatorForSeq2Seq), prompt
and padding labelled -100; LoRA r=8 alpha=16 dropout 0 on q/k/v/o_proj, AdamW lr 2e-4, fp32 on
the CPU with all cores. Prints one JSON line with the loop's wall time.

    python3 benches/reference/peft_epoch.py tiny
    python3 benches/reference/peft_epoch.py 135m
"""
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import lora_model  # noqa: E402


shape = sys.argv[1] if len(sys.argv) > 1 else "tiny"
root = Path(__file__).resolve().parent.parent.parent / "target/bench-epoch" / shape
data = json.loads((root / "rows.json").read_text())
rows, order, bs = data["rows"], data["order"], data["batch_size"]
cfg, model, opt = lora_model(shape, 1024)

batches = []
for b in range(0, len(order), bs):
    chunk = [rows[i] for i in order[b:b + bs]]
    t = max(len(r["ids"]) for r in chunk)
    ids = torch.zeros((len(chunk), t), dtype=torch.long)
    att = torch.zeros((len(chunk), t), dtype=torch.long)
    labels = torch.full((len(chunk), t), -100, dtype=torch.long)
    for j, r in enumerate(chunk):
        n = len(r["ids"])
        ids[j, :n] = torch.tensor(r["ids"])
        att[j, :n] = 1
        labels[j, r["prompt"]:n] = ids[j, r["prompt"]:n]
    batches.append((ids, att, labels))

start = time.perf_counter()
for ids, att, labels in batches:
    out = model(input_ids=ids, attention_mask=att, labels=labels)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
seconds = time.perf_counter() - start
tokens = sum(len(r["ids"]) for r in rows)
print(json.dumps({
    "impl": f"torch {torch.__version__} + peft",
    "shape": shape,
    "rows": len(rows),
    "seconds": seconds,
    "tokens_per_s": tokens / seconds,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
