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
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=1000, tie_word_embeddings=False),
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
}

shape = sys.argv[1] if len(sys.argv) > 1 else "tiny"
root = Path(__file__).resolve().parent.parent.parent / "target/bench-epoch" / shape
data = json.loads((root / "rows.json").read_text())
rows, order, bs = data["rows"], data["order"], data["batch_size"]
torch.set_num_threads(os.cpu_count())
torch.manual_seed(0)
cfg = LlamaConfig(max_position_embeddings=1024, rms_norm_eps=1e-5, **SHAPES[shape])
model = LlamaForCausalLM(cfg)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.0)

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
