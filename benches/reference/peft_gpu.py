#!/usr/bin/env python3
"""The PyTorch + PEFT side of the GPU benchmark (scripts/gpu/bench.sh), run on the GPU machine,
never in CI. The model folder from gpu_shapes.py loaded in bf16, PEFT LoRA r16 alpha32 dropout
0.05 on q/k/v/o_proj (adapters in fp32, PEFT's default), torch.autocast(bf16), SDPA attention,
fused AdamW (lr 1e-4), random token ids of the benchmarked shape, labels = ids. Gradient
checkpointing only with --checkpointing. Times `steps` steps after 3 warm-ups with CUDA
synchronisation; prints one JSON line. With --full, a full fine-tune instead: no PEFT, the
weights in fp32 (the master copies) under autocast(bf16), AdamW over every weight — the usual
mixed-precision recipe (transformers' Trainer with bf16=True). With --qlora, QLoRA: the model
loaded by transformers with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_compute_dtype=bfloat16, bnb_4bit_use_double_quant=True) — every linear but the LM
head in bitsandbytes' 4-bit NF4, its scales in 8 bits —
and the same LoRA adapter over it (needs bitsandbytes).

    python3 benches/reference/peft_gpu.py MODEL_DIR BATCH SEQ STEPS [--checkpointing] [--full|--qlora] [--device cpu]

`--device cpu` only dry-runs the script (and scripts/gpu/bench.sh) on a machine without a GPU: no peak
memory is reported there.
"""
import json
import sys
import time

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model_dir, batch, seq, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
checkpointing = "--checkpointing" in sys.argv
full = "--full" in sys.argv
qlora = "--qlora" in sys.argv
dev = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
cuda = dev == "cuda"
torch.manual_seed(0)
weights_dtype = torch.float32 if full else torch.bfloat16
if qlora:
    import bitsandbytes
    from transformers import BitsAndBytesConfig
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=weights_dtype, attn_implementation="sdpa",
                                                 quantization_config=quant, device_map={"": dev})
else:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=weights_dtype, attn_implementation="sdpa").to(dev)
if checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
model.config.use_cache = False
if not full:
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0, fused=cuda)
vocab = model.config.vocab_size
g = torch.Generator(device=dev).manual_seed(0)
batches = [torch.randint(3, min(vocab, 4000), (batch, seq), device=dev, generator=g) for _ in range(4)]


def sync():
    if cuda:
        torch.cuda.synchronize()


def step(ids):
    with torch.autocast(dev, dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss


for i in range(3):
    step(batches[i % 4])
sync()
if cuda:
    torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
for i in range(steps):
    loss = step(batches[i % 4])
loss.item()
sync()
seconds = time.perf_counter() - start
print(json.dumps({
    "impl": f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}; "
            "SDPA attention, autocast bf16, " + ("fused AdamW" if cuda else "AdamW") + (", gradient checkpointing" if checkpointing else "")
            + ("; full fine-tune, fp32 weights" if full else "")
            + (f"; QLoRA, bitsandbytes {bitsandbytes.__version__} nf4 + double quantization" if qlora else ""),
    "device": torch.cuda.get_device_name() if cuda else dev,
    "batch": batch, "seq": seq, "steps": steps,
    "seconds": seconds,
    "tokens_per_s": batch * seq * steps / seconds,
    "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
    "loss": loss.item(),
}))
