#!/usr/bin/env python3
"""The PyTorch + PEFT side of the train-step protocol (docs/benchmarks.md), run by hand, never
in CI: HF transformers Llama with random weights, PEFT LoRA r=8 alpha=16 dropout 0 on
q/k/v/o_proj, AdamW lr 2e-4 wd 0, fp32 on the CPU with all cores, batch 4 x 128 tokens, median
seconds per step after 2 warm-ups, peak RSS of the process. Prints one JSON line. `--eval`
times evaluation instead, as `cargo bench --bench export` does rtune's: the mean loss of a
4 x 128 batch in eval mode under `torch.inference_mode()` (no gradients), median of 5 batches.

    python3 benches/reference/peft_bench.py tiny 30
    python3 benches/reference/peft_bench.py 135m 5
    python3 benches/reference/peft_bench.py --eval 135m
"""
import json
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import lora_model  # noqa: E402


evaluate = "--eval" in sys.argv
args = [a for a in sys.argv[1:] if not a.startswith("--")]
shape = args[0] if args else "tiny"
steps = int(args[1]) if len(args) > 1 else (5 if evaluate else 30 if shape == "tiny" else 5)
cfg, model, opt = lora_model(shape, 256)
ids = torch.randint(0, cfg.vocab_size, (4, 128))
times = []
if evaluate:
    model.eval()
for i in range(steps + 2):
    t0 = time.perf_counter()
    if evaluate:
        with torch.inference_mode():
            model(input_ids=ids, labels=ids).loss.item()
    else:
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
    "mode": "evaluate" if evaluate else "train",
    "shape": shape,
    "s_per_step": med,
    "tokens_per_s": 4 * 128 / med,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
