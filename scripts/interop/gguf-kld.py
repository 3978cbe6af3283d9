#!/usr/bin/env python3
"""How far quantized GGUFs are from their f32 model, measured in llama.cpp: the mean KL divergence
of each file's next-token distributions from the f32 file's, how often its top token is the f32
file's, and its perplexity — what `llama-perplexity --kl-divergence` reports, over a text file.

    pip install llama-cpp-python numpy
    python3 scripts/interop/gguf-kld.py TEXT_FILE F32.gguf QUANT.gguf [QUANT.gguf ...]
    python3 scripts/interop/gguf-kld.py TOKENIZE_ARTIFACT/eval F32.gguf QUANT.gguf [...]

The text is cut into chunks of 128 tokens (each evaluated from an empty context); the first half
of each chunk is context only, the second half is scored, as llama-perplexity does. A split of
rtune's token store (`<tokenize artifact>/eval`: `eval.ids`, `eval.offsets`) is read as its
rows, each evaluated alone and scored from its second token. Used for the
importance-matrix measurements in docs/benchmarks.md; never run in CI (no Python there).
"""

import os
import sys

import llama_cpp
import numpy as np

# Tokens per chunk of a text file.
CTX = 128


def logits(path: str, chunks) -> np.ndarray:
    """The f64 logits that predict each scored token: `chunks` are (ids, first scored index)."""
    n_ctx = max(len(c) for c, _ in chunks)
    m = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, verbose=False)
    out = []
    for c, first in chunks:
        m.reset()
        m.eval(c)
        out.append(np.array(m.scores[: len(c)], dtype=np.float64)[first - 1 : -1])
    return np.concatenate(out)


def token_rows(prefix: str):
    ids = np.fromfile(prefix + ".ids", dtype="<u4")
    offsets = np.fromfile(prefix + ".offsets", dtype="<u8")
    return [(ids[a:b].tolist(), 1) for a, b in zip(offsets[:-1], offsets[1:]) if b - a > 1]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def main() -> int:
    text, ref, quants = sys.argv[1], sys.argv[2], sys.argv[3:]
    if os.path.exists(text + ".offsets"):
        chunks = token_rows(text)
    else:
        vocab = llama_cpp.Llama(model_path=ref, vocab_only=True, verbose=False)
        ids = vocab.tokenize(open(text, encoding="utf-8").read().encode(), add_bos=False)
        chunks = [(ids[i : i + CTX], CTX // 2) for i in range(0, len(ids) - CTX + 1, CTX)]
    targets = np.concatenate([np.array(c[first:]) for c, first in chunks])
    p = log_softmax(logits(ref, chunks))
    rows = np.arange(len(targets))
    print(f"{len(chunks)} chunks, {len(targets)} tokens scored; f32 perplexity {np.exp(-p[rows, targets].mean()):.4f}")
    for q in quants:
        lq = log_softmax(logits(q, chunks))
        kld = (np.exp(p) * (p - lq)).sum(axis=1)
        same = (p.argmax(axis=1) == lq.argmax(axis=1)).mean()
        ppl = np.exp(-lq[rows, targets].mean())
        print(f"{q}: KLD mean {kld.mean():.6f} (99th percentile {np.percentile(kld, 99):.6f}), "
              f"same top token {same * 100:.2f}%, perplexity {ppl:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
