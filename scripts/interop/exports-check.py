#!/usr/bin/env python3
"""Load rtune's exports with the Python tools users would use, and compare.

    rtune run recipes/tiny-offline.toml
    python3 scripts/interop/exports-check.py BASE_MODEL_DIR recipes/out/tiny-offline [TOKENS_DIR]

BASE_MODEL_DIR is the `model/` folder of the download artifact (`rtune run --json` prints its
path). Without a `peft-adapter` export (a full fine-tune) the PEFT comparison is skipped. With
TOKENS_DIR, the tokenize artifact, transformers computes the eval split's loss (token-weighted
over the loss mask, as rtune's evaluate stage does) for the base model and the merged export, to
compare with the losses rtune reported. Needs torch, transformers and peft (and
llama-cpp-python for the GGUF check); never run in CI.
"""
import glob
import os
import sys

import numpy as np

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
          "the request.\n\n### Instruction:\nWhat is the capital of France?\n\n### Response:\n")


def eval_loss(model, tokens_dir):
    """Mean loss over the eval split's masked tokens, each predicted from the tokens before it."""
    ids = np.fromfile(f"{tokens_dir}/eval.ids", dtype="<u4").astype(np.int64)
    mask = np.fromfile(f"{tokens_dir}/eval.mask", dtype="u1").astype(bool)
    off = np.fromfile(f"{tokens_dir}/eval.offsets", dtype="<u8")
    total, n = 0.0, 0
    with torch.no_grad():
        for r in range(len(off) - 1):
            x = torch.from_numpy(ids[off[r]:off[r + 1]])[None]
            logp = torch.log_softmax(model(x).logits[0].double(), -1)[:-1]
            lp = logp.gather(1, x[0, 1:, None])[:, 0]
            sel = torch.from_numpy(mask[off[r] + 1:off[r + 1]])
            total, n = total - lp[sel].sum().item(), n + int(sel.sum())
    return total / n, n


def main():
    base_dir, out = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(out + "/merged")
    ids = torch.tensor([[tok.bos_token_id] + tok(PROMPT, add_special_tokens=False)["input_ids"]])
    merged = AutoModelForCausalLM.from_pretrained(out + "/merged", dtype=torch.float32).eval()
    if os.path.isdir(out + "/peft-adapter"):
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, out + "/peft-adapter").eval()
        with torch.no_grad():
            a, b = merged(ids).logits, peft(ids).logits
        print("max |merged - peft| logits:", (a - b).abs().max().item())
    if len(sys.argv) > 3:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        for name, model in [("base", base), ("merged", merged)]:
            loss, n = eval_loss(model, sys.argv[3])
            print(f"{name}: eval loss {loss:.7f} over {n} tokens (transformers)")
    g = merged.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    print("merged greedy:", repr(tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True)))
    try:
        from llama_cpp import Llama
    except ImportError:
        return
    with torch.no_grad():
        want = merged(ids).logits[0].numpy()
    for path in sorted(glob.glob(out + "/gguf/model-*.gguf")):
        # f32 keys and values: llama.cpp's cache is f16 unless told.
        llm = Llama(model_path=path, n_ctx=256, verbose=False, logits_all=True, type_k=0, type_v=0, flash_attn=False)
        same = llm.tokenize(PROMPT.encode(), add_bos=True) == ids[0].tolist()
        llm.eval(ids[0].tolist())
        diff = float(np.abs(np.array(llm.scores[: ids.shape[1]]) - want).max())
        llm.reset()
        text = llm(PROMPT, max_tokens=12, temperature=0.0)["choices"][0]["text"]
        print(path.rsplit("/", 1)[-1], "tokenizes like transformers:", same, f"max |logit - merged's| {diff:.3g}",
              "greedy:", repr(text))


if __name__ == "__main__":
    main()
