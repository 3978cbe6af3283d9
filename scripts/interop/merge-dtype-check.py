#!/usr/bin/env python3
"""rtune's merged export of a bf16 (or f16) base against PEFT's own merge of the same adapter.

    python3 scripts/interop/merge-dtype-check.py BASE_MODEL_DIR EXPORTS_DIR

EXPORTS_DIR holds rtune's `peft-adapter/` and `merged/` of a run over BASE_MODEL_DIR. PEFT loads
the base in its stored dtype, applies the adapter and `merge_and_unload()`s it, as users merge;
the script compares every tensor with rtune's `merged/` (equal values, and the largest
difference in units of the last place), then the logits of rtune's merged model and of the
unmerged adapter model, both computed in f32. Needs torch, transformers, peft, safetensors;
never run in CI.
"""
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
import glob


def main():
    base_dir, out = sys.argv[1], sys.argv[2]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")
    dtype = base.dtype
    peft_merged = PeftModel.from_pretrained(base, out + "/peft-adapter").merge_and_unload().state_dict()
    ours = {}
    for f in sorted(glob.glob(out + "/merged/*.safetensors")):
        ours.update(load_file(f))
    print(f"base dtype {dtype}; rtune's merged tensors: {sorted({str(t.dtype) for t in ours.values()})}")
    differ, total, worst = 0, 0, 0
    for name, t in ours.items():
        p = peft_merged[name]
        assert p.dtype == t.dtype and p.shape == t.shape, name
        if t.dtype in (torch.bfloat16, torch.float16):
            ulps = (t.view(torch.int16).int() - p.view(torch.int16).int()).abs()
            worst = max(worst, int(ulps.max()))
        differ += int((t != p).sum())
        total += t.numel()
    print(f"values that differ from PEFT's merge_and_unload: {differ} of {total}, at most {worst} ulp")
    ids = torch.tensor([list(range(1, 33))])
    f32 = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(f32, out + "/peft-adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out + "/merged", dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    theirs.load_state_dict({k: v.float() for k, v in peft_merged.items()}, strict=False)
    with torch.no_grad():
        a = adapter(ids).logits
        for name, m in [("rtune's merged", merged), ("PEFT's merged", theirs.eval())]:
            print(f"max |{name} - adapter model| logits (f32): {(m(ids).logits - a).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
