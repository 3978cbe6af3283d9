//! JSON values in canonical key order.
//!
//! serde_json preserves insertion order in this build (its `preserve_order` feature): a
//! dataset row's keys, and so a chat template's `tojson` of a tool schema or a tool call's
//! arguments, keep the file's order, as 🤗 datasets and transformers keep it. What must not
//! depend on the order a struct or a literal lists its fields in — fingerprints, the documents
//! `plan` shows, the recipe schema — goes through [`sorted`].

use serde_json::Value;

/// `v` with every object's keys in sorted order, at every depth.
pub fn sorted(v: Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

/// `v` as pretty JSON text with its keys sorted at every depth — how rtune writes its JSON
/// files (manifests, metrics, settings), and how transformers and PEFT write `config.json` and
/// `adapter_config.json` (`sort_keys=True`), so their bytes do not follow a struct's field order.
pub fn pretty_sorted<T: serde::Serialize + ?Sized>(v: &T) -> String {
    let v = serde_json::to_value(v).expect("json values serialise");
    serde_json::to_string_pretty(&sorted(v)).expect("json values serialise")
}

/// Write `v` to `path` as rtune writes its JSON files: [`pretty_sorted`], with a final newline.
pub fn write_file<T: serde::Serialize + ?Sized>(path: &std::path::Path, v: &T) -> std::io::Result<()> {
    let mut text = pretty_sorted(v);
    text.push('\n');
    std::fs::write(path, text)
}
