#!/usr/bin/env python3
"""Load rtune's exports with the Python tools users would use, and compare.

    rtune run recipes/tiny-offline.toml
    python3 scripts/interop_check.py BASE_MODEL_DIR recipes/out/tiny-offline

BASE_MODEL_DIR is the `model/` folder of the download artifact (`rtune run --json` prints its
path). Needs torch, transformers and peft (and llama-cpp-python for the GGUF check); never run in CI.
"""
import glob
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
          "the request.\n\n### Instruction:\nWhat is the capital of France?\n\n### Response:\n")


def main():
    base_dir, out = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(out + "/merged")
    ids = torch.tensor([[tok.bos_token_id] + tok(PROMPT, add_special_tokens=False)["input_ids"]])
    merged = AutoModelForCausalLM.from_pretrained(out + "/merged").eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out + "/peft-adapter").eval()
    with torch.no_grad():
        a, b = merged(ids).logits, peft(ids).logits
    print("max |merged - peft| logits:", (a - b).abs().max().item())
    g = merged.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    print("merged greedy:", repr(tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True)))
    try:
        from llama_cpp import Llama
    except ImportError:
        return
    for path in sorted(glob.glob(out + "/gguf/*.gguf")):
        llm = Llama(model_path=path, n_ctx=256, verbose=False)
        same = llm.tokenize(PROMPT.encode(), add_bos=True) == ids[0].tolist()
        text = llm(PROMPT, max_tokens=12, temperature=0.0)["choices"][0]["text"]
        print(path.rsplit("/", 1)[-1], "tokenizes like transformers:", same, "greedy:", repr(text))


if __name__ == "__main__":
    main()
