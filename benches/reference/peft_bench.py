#!/usr/bin/env python3
"""The PyTorch + PEFT side of the train-step protocol (docs/benchmarks.md), run by hand, never
in CI: HF transformers Llama with random weights, PEFT LoRA r=8 alpha=16 dropout 0 on
q/k/v/o_proj, AdamW lr 2e-4 wd 0, fp32 on the CPU with all cores, batch 4 x 128 tokens, median
seconds per step after 2 warm-ups, peak RSS of the process. Prints one JSON line.

    python3 benches/reference/peft_bench.py tiny 30
    python3 benches/reference/peft_bench.py 135m 5
"""
import json
import os
import resource
import statistics
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=1000, tie_word_embeddings=False),
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
}

shape = sys.argv[1] if len(sys.argv) > 1 else "tiny"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else (30 if shape == "tiny" else 5)
torch.set_num_threads(os.cpu_count())
torch.manual_seed(0)
cfg = LlamaConfig(max_position_embeddings=256, rms_norm_eps=1e-5, **SHAPES[shape])
model = LlamaForCausalLM(cfg)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.0)
ids = torch.randint(0, cfg.vocab_size, (4, 128))
times = []
for i in range(steps + 2):
    t0 = time.perf_counter()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out.loss.item()
    if i >= 2:
        times.append(time.perf_counter() - t0)
med = statistics.median(times)
print(json.dumps({
    "impl": f"torch {torch.__version__} + peft",
    "shape": shape,
    "s_per_step": med,
    "tokens_per_s": 4 * 128 / med,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
