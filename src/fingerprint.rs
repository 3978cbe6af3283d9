//! Fingerprints: blake3 of the canonical JSON of everything that changes a stage's output.
//!
//! Canonical means: object keys sorted ([`crate::json::sorted`]: serde_json keeps insertion
//! order in this build, as rows need), floats written in
//! their shortest round-trip form (so `2e-4` and `0.0002` hash the same), settings typed before
//! hashing (so `1` and `1.0` hash the same where a float is meant), and no paths, mtimes, thread
//! counts or log levels.

use std::path::Path;

use serde_json::Value;

use crate::recipe::diag::show;

/// Version of the fingerprint document's layout. Bump it when what goes into every fingerprint
/// changes. History:
/// - 1: first version.
/// - 2: a scratch model's `download` includes the dataset format and column map its tokenizer
///   is trained on (`model.corpus`); every stage downstream of it changes with it.
/// - 3: each stage hashes its typed key ([`crate::plan::key`]), which is all its executor gets
///   from the recipe. New in the keys: a Hub dataset's exclude patterns; quantize's PEFT base
///   name and shipped chat template, and its device as it computes (f32, no engine choice);
///   evaluate's prompt format; the upload card's base model, dataset repo and recipe file name.
///   An evaluate stage's own-data `chat_template` is left out when unset, as tokenize's was.
pub const FINGERPRINT_VERSION: u32 = 3;

/// Version of each stage kind's output. Bump a kind's number when its output for the same
/// inputs changes, so artifacts built by an older rtune are not reused.
/// History: all 1 — first version; upload 2 — model card and loss curve added; train,
/// evaluate, quantize 2 — fused cross-entropy; 3 — the fused CPU engine; train 4 —
/// counter-based LoRA dropout masks; train 5 — base weights train on the fused CPU engine;
/// tokenize 2, evaluate 4 — rows and prompts start with BOS only where the tokenizer adds one;
/// quantize 5 — merged folders in the base's dtypes; quantize 6 — GGUFs as llama-quantize
/// writes them, calibrated by an importance matrix; upload 4 — GGUFs in the model card;
/// quantize 7 — the importance matrix's pass packs rows into 512-token sequences (its sums
/// move by float rounding, and with them the odd calibrated block); quantize 8 — SentencePiece
/// vocabularies in GGUFs, Gemma's GGUFs; quantize 9 — no `rope_freqs` in GGUFs of linear
/// rotary scaling; quantize 10 — Ollama Modelfiles beside the GGUFs; upload 5 — the card's
/// "Try it" section.
pub fn stage_version(kind: crate::recipe::StageKind) -> u32 {
    use crate::recipe::StageKind::*;
    match kind {
        // 2: a UTF-8 byte order mark is not data, a CSV cell may hold line breaks, and `chat`
        // rows may be ShareGPT's `conversations` (a scratch model's tokenizer is trained on the
        // rows; before, such rows were bad).
        // 3: files read as datasets' loaders read them — a dataset card config's `sep`, `field`,
        // `sample_by` and `keep_linebreaks` are applied (they were ignored), `.tsv` files are data,
        // and a `.json` file's JSON Lines, pretty-printed objects and strings are rows (before:
        // an error, or with `skip_bad_rows` bad rows).
        Download => 3,
        // 2: `alpaca` rows start with BOS only where the tokenizer puts one in front of text
        // (`ModelFolder::row_bos`); Qwen and GPT-2-style tokenizers (SmolLM2) add none, and rows
        // of their models no longer start with the config's `bos_token_id`.
        // 3: rows are read as download's version 2 reads them (byte order marks, multi-line
        // CSV cells, ShareGPT conversations).
        // 4: rows are read as download's version 3 reads them (a card's loader settings, .tsv,
        // .json layouts).
        Tokenize => 4,
        // 2: the fused CPU cross-entropy sums in another order, so losses, gradients and
        // therefore trained weights differ in the last bits from version 1's.
        // 3: f32 LoRA runs on the CPU use the fused engine (src/engine/fused/), whose sums run
        // in another order again.
        // 4 (train): LoRA dropout masks come from a counter-based generator keyed by seed,
        // micro-batch, layer and element (the same on every engine and device), not from one
        // sequential stream; runs with dropout train on other masks than version 3's.
        // 5 (train): f32 runs on the CPU that train base weights (alone or beside an adapter)
        // use the fused engine too, not candle's autograd: other summation orders.
        Train => 5,
        // 4: prompts (and an evaluate stage's own dataset) start with BOS as tokenize's rows do
        // (`row_bos`); `chat` prompts are rendered with the chat template.
        // 5: an evaluate stage's own dataset is read as download's version 3 reads rows.
        Evaluate => 5,
        // 4: exported folders and GGUF carry the chat template the data was rendered with
        // (and its turn-end token as a stop token), the full tokenizer files, and PEFT names a
        // local base by its recipe path.
        // 5: merged folders keep the base's dtypes (a bf16 base: bf16 weights, not f32), merged
        // tensor by tensor from the mapped checkpoint; the GGUF self-check's reference loss is
        // computed by the candle model one layer at a time (another summation order), and on
        // the CPU over as many eval rows as fit its budget.
        // 6: GGUF tensors are quantized as llama.cpp's `llama-quantize` quantizes them — its
        // reference quantizers (Q4_K/Q5_K search their scales differently from candle's, which
        // wrote them before) and its per-tensor types (the output layer in Q6_K, the `_M`
        // mixes, Q5_0/Q5_1 where rows are not whole K-quant blocks, not Q8_0); `gguf-q4_k` is
        // `gguf-q4_k_m` and its file `model-q4_k_m.gguf` (was `model-q4k.gguf`); and, unless
        // `imatrix = false`, those from q6_k down calibrated by an importance matrix of the
        // train split (`gguf/imatrix.gguf`), as `llama-quantize --imatrix` quantizes them; the
        // self-check also reports how often each file's top token is the unquantized model's.
        // 7: the importance matrix's pass runs the train rows packed into 512-token sequences
        // (each row its own document): the same tokens, sums within float rounding.
        // 8: a GGUF of a model whose folder has a SentencePiece `tokenizer.model` (Llama 2,
        // TinyLlama, Mistral v0.x) carries its pieces, as llama.cpp's converter writes them —
        // version 7 wrote their `▁` pieces as a GPT-2 vocabulary, which llama.cpp tokenizes
        // wrongly, so those files must not be reused; every GGUF records the head size
        // (`attention.key_length`/`value_length`); Gemma's GGUFs are written.
        // 9: a GGUF of a model with linear rotary scaling (Gemma 3 4B and larger) carried a
        // llama3-style `rope_freqs` tensor that llama.cpp's Gemma 3 refuses to load ("wrong
        // number of tensors"), so those files must not be reused; image-text Gemma 3 folders
        // export (merged folders carry their vision tower; adapters target the text model).
        // 10: beside each GGUF, an Ollama Modelfile (`gguf/model-<type>.Modelfile`) with the chat
        // template translated into Ollama's Go template syntax and checked by rendering both;
        // exports.json says which template, or why there is none.
        Quantize => 10,
        // 2: uploads carry a generated model card and the loss curve.
        // 3: upload.json records each file's digest, size and the store file it copies, so
        // `plan` can check the destination and `run` restore it.
        // (Still 3, with new inputs: the card's sources are declared ports — `card:train` for
        // the training section and loss curve, `card:eval:<stage>` for each evaluation — so
        // fingerprints changed without a version bump.)
        // 4: the model card lists the GGUF files with their measured perplexity, top-token
        // agreement and the importance matrix that calibrated them.
        // 5: the model card's "Try it" section (llama-server and Ollama commands for the GGUFs).
        Upload => 5,
    }
}

/// The 12-character prefix shown to people (the whole string if shorter, as in a hand-edited
/// lock file or manifest).
pub fn short(fp: &str) -> &str {
    fp.get(..12).unwrap_or(fp)
}

/// blake3 hex of the canonical form of `doc`.
pub fn of(doc: &Value) -> String {
    let text = serde_json::to_string(&crate::json::sorted(doc.clone())).expect("json values serialise");
    blake3::hash(text.as_bytes()).to_hex().to_string()
}

/// Content digest of a file, or of a folder (its sorted relative paths and file digests).
pub fn digest_path(path: &Path) -> std::io::Result<String> {
    let md = std::fs::metadata(path)?;
    if md.is_file() {
        return Ok(crate::store::hash_file(path)?.0);
    }
    let mut h = blake3::Hasher::new();
    for rel in crate::store::walk(path)? {
        let name = rel.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/");
        if name.starts_with('.') || name.contains("/.") {
            continue;
        }
        let (d, size) = crate::store::hash_file(&path.join(&rel))?;
        h.update(name.as_bytes());
        h.update(&[0]);
        h.update(d.as_bytes());
        h.update(&size.to_le_bytes());
    }
    Ok(h.finalize().to_hex().to_string())
}

/// Readable differences between two JSON documents: `path: old → new`, in key order.
pub fn diff(old: &Value, new: &Value) -> Vec<String> {
    let mut out = Vec::new();
    walk_diff("", old, new, &mut out);
    out
}

fn walk_diff(path: &str, old: &Value, new: &Value, out: &mut Vec<String>) {
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) => walk_diff(&p, x, y, out),
                    (None, Some(y)) => out.push(format!("{p}: (unset) → {}", show(y))),
                    (Some(x), None) => out.push(format!("{p}: {} → (unset)", show(x))),
                    (None, None) => {}
                }
            }
        }
        _ if old != new => out.push(format!("{path}: {} → {}", show(old), show(new))),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn equal_floats_written_differently_hash_the_same() {
        let a: Value = serde_json::from_str(r#"{"b": 2e-4, "a": 1}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"a": 1, "b": 0.0002}"#).unwrap();
        assert_eq!(of(&a), of(&b));
    }

    #[test]
    fn diff_names_the_changed_setting() {
        let d = diff(
            &json!({"train": {"learning_rate": 1e-4, "epochs": 1}}),
            &json!({"train": {"learning_rate": 3e-4, "epochs": 1}}),
        );
        assert_eq!(d, ["train.learning_rate: 1e-4 → 3e-4"]);
    }
}
