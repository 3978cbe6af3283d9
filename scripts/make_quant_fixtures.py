#!/usr/bin/env python3
"""Reference fixtures for rtune's GGUF quantization, made with llama.cpp itself.

    pip install llama-cpp-python gguf numpy     # builds llama.cpp (llama-cpp-python 0.3.36 here)
    python scripts/make_quant_fixtures.py tests/fixtures/quant

Writes two files that `cargo test --test model` reads (CI needs no Python):

- `blocks.gguf`: rows of f32 values chosen to reach every branch of ggml's quantizers (all
  zero, constant, one-signed, below ggml's zero threshold, integer ties, outliers, huge
  dynamic range, bf16-rounded weights, Gaussian weights of several scales) as tensor `input`,
  and the same rows quantized by llama.cpp's `ggml_quantize_chunk` (what `llama-quantize` calls
  without an importance matrix) to each type rtune writes, as tensors named after the type;
  then an importance vector over the row's columns (`importance`: spread over six orders of
  magnitude, with zeros and outliers) and the rows quantized with it (`<type>.imatrix`, what
  `llama-quantize --imatrix` calls) for each type that uses one.
- `mixes.json`: for small models of each architecture and shape that matter (untied and tied
  heads, rows that are not whole K-quant blocks or not even whole 32-blocks, an 80-layer
  grouped-query Llama, which llama.cpp takes for a 70B), the ggml type `llama-quantize` gives
  every 2-D weight for each file type rtune exports: the file type's usual type and the tensors
  that differ from it (`types`), and the same with an importance matrix (`types_imatrix`).
"""

import ctypes
import json
import os
import sys
import tempfile

import gguf
import llama_cpp
import numpy as np

Q = gguf.GGMLQuantizationType
# The types rtune writes (quantizers) and the file types it exports (llama_ftype, name).
TYPES = [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# The types whose quantizers use an importance matrix.
WEIGHTED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# (`gguf-f32` is left out: every tensor stays f32, and llama_model_quantize from an f32 file to
# LLAMA_FTYPE_ALL_F32 dies of a bus error in this llama.cpp.)
# llama_ftype → (rtune's name, the type most matrices take).
FTYPES = {
    1: ("f16", "F16"),
    7: ("q8_0", "Q8_0"),
    18: ("q6_k", "Q6_K"),
    17: ("q5_k_m", "Q5_K"),
    16: ("q5_k_s", "Q5_K"),
    15: ("q4_k_m", "Q4_K"),
    14: ("q4_k_s", "Q4_K"),
    2: ("q4_0", "Q4_0"),
    13: ("q3_k_l", "Q3_K"),
    12: ("q3_k_m", "Q3_K"),
    11: ("q3_k_s", "Q3_K"),
    10: ("q2_k", "Q2_K"),
}
ROW = 512


def rows() -> np.ndarray:
    rng = np.random.default_rng(20261125)
    out = []
    for sigma in [1.0, 0.02, 1e-3, 30.0]:
        out.append(rng.normal(0, sigma, ROW))
    x = rng.normal(0, 0.02, ROW)
    x[::37] *= 20  # outliers
    out.append(x)
    out.append(np.zeros(ROW))
    out.append(np.full(ROW, 0.5))
    out.append(np.full(ROW, -0.25))
    out.append(rng.uniform(0.1, 1.0, ROW))  # all positive: the minimum is clamped to 0
    out.append(-rng.uniform(0.1, 1.0, ROW))
    out.append(rng.normal(0, 1e-20, ROW))  # below GROUP_MAX_EPS
    x = rng.normal(0, 0.05, ROW)
    x[rng.uniform(size=ROW) < 0.5] = 0  # sparse
    out.append(x)
    x = rng.normal(0, 0.05, ROW)
    x[:16] = 0  # one Q6_K group zero
    x[32:64] = 0  # one Q4_K/Q5_K group zero
    x[256:] = 0  # a whole super-block zero
    out.append(x)
    out.append(rng.integers(-3, 4, ROW).astype(np.float64))  # ties in the rounding
    out.append(rng.integers(-15, 16, ROW).astype(np.float64) / 8)
    out.append(np.exp(rng.uniform(np.log(1e-4), np.log(1e3), ROW)) * rng.choice([-1, 1], ROW))
    x = rng.normal(0, 1e-4, ROW)
    x[100] = 50.0
    x[300] = -70.0
    out.append(x)
    out.append(rng.laplace(0, 0.01, ROW))
    out.append(rng.normal(0.01, 0.002, ROW))  # offset, one-signed in most groups
    out.append(np.linspace(-1, 1, ROW))
    x = rng.normal(0, 0.02, ROW).astype(np.float32)
    x = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)  # bf16-rounded, as most checkpoints
    out.append(x.astype(np.float64))
    # Exact rounding ties, which ggml breaks its own ways (`roundf`: away from zero;
    # `nearest_int`: to even): Q8_0 with d = 1 and halves; Q6_K's first levels with
    # iscale = -32 / -64 = 0.5 and odd integers; Q4_K/Q5_K with iscale = 15 / 30 = 0.5.
    x = rng.integers(-126, 126, ROW) + 0.5
    x[::32] = 127
    out.append(x)
    x = (2 * rng.integers(-32, 32, ROW) + 1).astype(np.float64)
    x[::16] = -64
    out.append(x)
    x = (2 * rng.integers(0, 15, ROW) + 1).astype(np.float64)
    x[::32] = 0
    x[1::32] = 30
    out.append(x)
    while len(out) < 32:
        out.append(rng.normal(0, rng.choice([0.01, 0.02, 0.05, 0.1]), ROW))
    return np.stack(out).astype(np.float32)


def importance() -> np.ndarray:
    """Mean squared activations of a row's columns, as an imatrix holds them: log-normal over six
    orders of magnitude, a few dead (zero) columns and a few outliers."""
    rng = np.random.default_rng(20261127)
    w = np.exp(rng.normal(0, 2.5, ROW))
    w[rng.choice(ROW, 8, replace=False)] = 0
    w[rng.choice(ROW, 4, replace=False)] *= 1e4
    w[64:96] = 0  # a whole group dead
    return w.astype(np.float32)


def ggml_base():
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def blocks(path: str) -> None:
    lib = ggml_base()
    x = np.ascontiguousarray(rows())
    w = gguf.GGUFWriter(path, "rtune-quant-fixture")
    w.add_tensor("input", x)
    for ty in TYPES:
        size = lib.ggml_row_size(int(ty), ROW)
        buf = np.zeros((x.shape[0], size), dtype=np.uint8)
        n = lib.ggml_quantize_chunk(int(ty), x.ctypes.data, buf.ctypes.data, 0, x.shape[0], ROW, None)
        assert n == buf.size, (ty, n, buf.size)
        w.add_tensor(ty.name, buf, raw_dtype=ty)
    imp = np.ascontiguousarray(importance())
    w.add_tensor("importance", imp)
    for ty in WEIGHTED:
        size = lib.ggml_row_size(int(ty), ROW)
        buf = np.zeros((x.shape[0], size), dtype=np.uint8)
        n = lib.ggml_quantize_chunk(int(ty), x.ctypes.data, buf.ctypes.data, 0, x.shape[0], ROW, imp.ctypes.data)
        assert n == buf.size, (ty, n, buf.size)
        w.add_tensor(f"{ty.name}.imatrix", buf, raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Model shapes: a Hugging Face config (what rtune reads) per case.
CONFIGS = {
    # Untied head, 16 layers: use_more_bits picks layers 0, 1, 4, 7, 10, 13, 14, 15.
    "llama-16-untied": dict(arch="llama", layers=16, hidden=256, heads=4, kv=1, ffn=512, vocab=512, tied=False),
    # Tied embeddings (the embeddings are the output layer), 12 layers, Qwen2's q/k/v biases.
    "qwen2-12-tied": dict(arch="qwen2", layers=12, hidden=256, heads=4, kv=2, ffn=768, vocab=384, tied=True),
    # Qwen3 (query/key norms, wider heads), 10 layers, untied.
    "qwen3-10": dict(arch="qwen3", layers=10, hidden=256, heads=2, kv=1, ffn=512, vocab=256, tied=False, head_dim=256),
    # Rows of 320 (not whole 256-blocks) and an MLP of 176 (not whole 32-blocks): fallbacks.
    "llama-8-fallbacks": dict(arch="llama", layers=8, hidden=320, heads=5, kv=5, ffn=176, vocab=256, tied=True),
    # The default recipe's model shape: rows of 64.
    "llama-4-tiny": dict(arch="llama", layers=4, hidden=64, heads=4, kv=2, ffn=176, vocab=512, tied=True),
    # 80 layers with grouped-query attention: llama.cpp's "70B", whose value projections get Q5_K.
    "llama-80-gqa": dict(arch="llama", layers=80, hidden=256, heads=4, kv=1, ffn=256, vocab=256, tied=False),
}


def hf_config(c: dict) -> dict:
    head_dim = c.get("head_dim", c["hidden"] // c["heads"])
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[c["arch"]]
    return {
        "architectures": [arch],
        "model_type": c["arch"],
        "hidden_size": c["hidden"],
        "intermediate_size": c["ffn"],
        "num_hidden_layers": c["layers"],
        "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv"],
        "head_dim": head_dim,
        "vocab_size": c["vocab"],
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": c["tied"],
        "hidden_act": "silu",
    }


def tensors(c: dict):
    """(GGUF name, numpy shape rows × row) of the model, as rtune writes them."""
    h, ffn, hd = c["hidden"], c["ffn"], c.get("head_dim", c["hidden"] // c["heads"])
    q, kv = c["heads"] * hd, c["kv"] * hd
    out = [("token_embd.weight", (c["vocab"], h))]
    for i in range(c["layers"]):
        b = f"blk.{i}"
        out.append((f"{b}.attn_norm.weight", (h,)))
        if c["arch"] == "qwen3":
            out += [(f"{b}.attn_q_norm.weight", (hd,)), (f"{b}.attn_k_norm.weight", (hd,))]
        out.append((f"{b}.ffn_norm.weight", (h,)))
        out += [(f"{b}.attn_q.weight", (q, h)), (f"{b}.attn_k.weight", (kv, h)), (f"{b}.attn_v.weight", (kv, h))]
        if c["arch"] == "qwen2":
            out += [(f"{b}.attn_q.bias", (q,)), (f"{b}.attn_k.bias", (kv,)), (f"{b}.attn_v.bias", (kv,))]
        out.append((f"{b}.attn_output.weight", (h, q)))
        out += [(f"{b}.ffn_gate.weight", (ffn, h)), (f"{b}.ffn_up.weight", (ffn, h)), (f"{b}.ffn_down.weight", (h, ffn))]
    out.append(("output_norm.weight", (h,)))
    if not c["tied"]:
        out.append(("output.weight", (c["vocab"], h)))
    return out


def f32_model(path: str, c: dict) -> None:
    arch = c["arch"]
    hd = c.get("head_dim", c["hidden"] // c["heads"])
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(256)
    w.add_embedding_length(c["hidden"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_vocab_size(c["vocab"])
    w.add_file_type(0)
    rng = np.random.default_rng(1)
    for name, shape in tensors(c):
        w.add_tensor(name, rng.normal(0, 0.02, shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src: str, dst: str, ftype: int, imatrix=None) -> None:
    """llama-quantize `src` to `dst`; `imatrix`: {tensor name: importance vector}."""
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = os.cpu_count() or 1
    if imatrix is not None:
        keep = [(k.encode(), np.ascontiguousarray(v, dtype=np.float32)) for k, v in imatrix.items()]
        arr = (llama_cpp.llama_model_imatrix_data * (len(keep) + 1))()
        for i, (name, v) in enumerate(keep):
            arr[i].name = name
            arr[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = v.size
        p.imatrix = arr
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    assert rc == 0, f"llama_model_quantize {src} → {ftype}: {rc}"


def mixes(path: str) -> None:
    out = {"llama_cpp_python": llama_cpp.__version__, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, c in CONFIGS.items():
            src = os.path.join(tmp, f"{name}-f32.gguf")
            f32_model(src, c)
            # An importance matrix as llama-imatrix collects it: every decoder matrix.
            imatrix = {n: np.ones(shape[1]) for n, shape in tensors(c) if n.startswith("blk.") and len(shape) == 2}
            entry = {"config": hf_config(c)}
            for key, im in [("types", None), ("types_imatrix", imatrix)]:
                by_ftype = {}
                for ftype, (tag, usual) in FTYPES.items():
                    dst = os.path.join(tmp, f"{name}-{tag}.gguf")
                    quantize(src, dst, ftype, im)
                    r = gguf.GGUFReader(dst)
                    assert int(r.fields["general.file_type"].parts[-1][0]) == ftype
                    types = {t.name: Q(t.tensor_type).name for t in r.tensors if len(t.shape) == 2}
                    by_ftype[tag] = {
                        "usual": usual,
                        "others": {n: t for n, t in types.items() if t != usual},
                        "matrices": len(types),
                    }
                    os.remove(dst)
                entry[key] = by_ftype
                print(name, key, {t: (v["usual"], len(v["others"])) for t, v in by_ftype.items()}, flush=True)
            out["models"][name] = entry
            os.remove(src)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/quant"
    os.makedirs(out, exist_ok=True)
    blocks(os.path.join(out, "blocks.gguf"))
    mixes(os.path.join(out, "mixes.json"))


if __name__ == "__main__":
    main()
