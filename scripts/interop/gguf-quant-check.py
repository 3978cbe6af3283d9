#!/usr/bin/env python3
"""rtune's quantized GGUFs against llama.cpp's `llama-quantize` of rtune's own f32 GGUF.

    pip install llama-cpp-python gguf numpy
    rtune run recipe.toml          # with quantize.formats including "gguf-f32" and quantized ones
    python3 scripts/interop/gguf-quant-check.py OUT_DIR/gguf

For every `model-<type>.gguf` beside `model-f32.gguf`, llama.cpp quantizes the f32 file to the
same file type (with rtune's `imatrix.gguf` where rtune's file names it, as
`llama-quantize --imatrix` reads it); the script compares `general.file_type`, every tensor's ggml type and bytes,
then loads rtune's file in llama.cpp and compares its logits on a prompt with those of
llama.cpp's own file. Exit status 1 on any difference. Never run in CI (no Python there).
"""

import os
import sys
import tempfile

import gguf
import llama_cpp
import numpy as np

# llama_model_quantize, with an importance matrix: the fixture maker beside its fixtures
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "quant"))
from make_quant import quantize  # noqa: E402

FTYPES = {
    "f16": 1, "q8_0": 7, "q6_k": 18, "q5_k_m": 17, "q5_k_s": 16, "q4_k_m": 15, "q4_k_s": 14, "q4_0": 2,
    "q3_k_l": 13, "q3_k_m": 12, "q3_k_s": 11, "q2_k": 10,
}


def read_imatrix(path: str) -> dict:
    """An imatrix GGUF as llama-quantize's load_imatrix turns it into importance vectors: each
    matrix's f32 sums over its f32 count (rounded to whole tokens)."""
    r = gguf.GGUFReader(path)
    assert bytes(r.fields["general.type"].parts[-1]).decode() == "imatrix", path
    t = {x.name: np.asarray(x.data, dtype=np.float32).reshape(-1) for x in r.tensors}
    out = {}
    for name, sums in t.items():
        if name.endswith(".in_sum2"):
            base = name[: -len(".in_sum2")]
            count = np.float32(round(float(t[base + ".counts"][0])))
            out[base] = (sums / count).astype(np.float32) if count > 0 else np.ones_like(sums)
    return out


def logits(path: str, ids) -> np.ndarray:
    m = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=64, verbose=False)
    m.eval(ids)
    return np.array(m.scores[: len(ids)])


def main() -> int:
    folder = sys.argv[1]
    f32 = os.path.join(folder, "model-f32.gguf")
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for tag, ftype in FTYPES.items():
            ours = os.path.join(folder, f"model-{tag}.gguf")
            if not os.path.exists(ours):
                continue
            theirs = os.path.join(tmp, f"{tag}.gguf")
            a = gguf.GGUFReader(ours)
            # A file rtune calibrated names its importance matrix: llama.cpp quantizes with it.
            im = a.fields.get("quantize.imatrix.file")
            im = read_imatrix(os.path.join(folder, bytes(im.parts[-1]).decode())) if im else None
            quantize(f32, theirs, ftype, im)
            b = gguf.GGUFReader(theirs)
            ft = [int(r.fields["general.file_type"].parts[-1][0]) for r in (a, b)]
            tb = {t.name: t for t in b.tensors}
            types, differ = {}, []
            for t in a.tensors:
                u = tb[t.name]
                name = gguf.GGMLQuantizationType(t.tensor_type).name
                types[name] = types.get(name, 0) + 1
                if t.tensor_type != u.tensor_type or not np.array_equal(
                    np.asarray(t.data).view(np.uint8), np.asarray(u.data).view(np.uint8)
                ):
                    differ.append(f"{t.name} ({name} vs {gguf.GGMLQuantizationType(u.tensor_type).name})")
            ids = llama_cpp.Llama(model_path=ours, vocab_only=True, verbose=False).tokenize(b"The capital of France is")
            d = float(np.abs(logits(ours, ids) - logits(theirs, ids)).max())
            ok = ft[0] == ft[1] == ftype and not differ and len(tb) == len(a.tensors) and d == 0.0
            bad += not ok
            print(
                f"{tag:7} file_type {ft[0]} (llama.cpp {ft[1]}){' with imatrix' if im else ''}; "
                f"{len(a.tensors)} tensors {types}; "
                f"{len(differ)} differ from llama-quantize's{': ' + ', '.join(differ[:4]) if differ else ''}; "
                f"max |logit difference| in llama.cpp {d:.3g} — {'same' if ok else 'DIFFERENT'}"
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
