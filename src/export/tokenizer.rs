//! What an exported folder carries besides weights: the base's tokenizer files, and the chat
//! template the model was trained with made the folder's own.

use std::path::Path;

use serde_json::json;

use super::ExportError;
use crate::model::ModelError;

/// Tokenizer files of the base folder that travel with every exported folder, as they are
/// (tokenizer_config.json gains the shipped chat template, nothing else changes).
pub const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// Copy the base folder's tokenizer files (and, for a full model folder, generation_config.json)
/// into `dir`, then make the shipped chat template the folder's: `chat_template.jinja` (read
/// first by transformers ≥ 4.43, and llama.cpp's converter) and `chat_template` in
/// tokenizer_config.json (older transformers), with the turn-end token among the EOS ids that
/// `generate` stops at.
pub fn write_tokenizer_files(
    dir: &Path,
    model_dir: &Path,
    chat: Option<&crate::data::chat::Shipped>,
    generation: bool,
) -> Result<(), ExportError> {
    // A merged folder is a whole model: its generation settings, and an image-text model's
    // processor (image preprocessing, and its chat template unless rtune ships one).
    let mut names = TOKENIZER_FILES.to_vec();
    if generation {
        names.extend(["generation_config.json", "preprocessor_config.json", "processor_config.json"]);
        if chat.is_none() {
            names.push("chat_template.json");
        }
    }
    for f in names {
        let src = model_dir.join(f);
        if src.is_file() {
            std::fs::copy(&src, dir.join(f)).map_err(ModelError::io(format!("cannot copy `{f}`")))?;
        }
    }
    let Some(chat) = chat else { return Ok(()) };
    std::fs::write(dir.join("chat_template.jinja"), &chat.source)
        .map_err(ModelError::io("cannot write chat_template.jinja"))?;
    let read = |name: &str| -> Option<serde_json::Value> {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok()
    };
    let mut tc = read("tokenizer_config.json").unwrap_or_else(|| json!({}));
    match tc.get_mut("chat_template") {
        // Named templates: the default one is replaced, tool-use and others are kept.
        Some(serde_json::Value::Array(list)) if list.iter().any(|t| t["name"] == "default") => {
            for t in list.iter_mut().filter(|t| t["name"] == "default") {
                t["template"] = json!(chat.source);
            }
        }
        _ => tc["chat_template"] = json!(chat.source),
    }
    write_json(&dir.join("tokenizer_config.json"), &tc)?;
    if let (true, Some((_, id))) = (generation, &chat.turn_end) {
        let mut gc = read("generation_config.json").unwrap_or_else(|| json!({}));
        let ids = |v: &serde_json::Value| match v {
            serde_json::Value::Array(a) => a.clone(),
            serde_json::Value::Null => vec![],
            one => vec![one.clone()],
        };
        let mut eos = ids(&gc["eos_token_id"]);
        if eos.is_empty() {
            // No generation_config.json: `generate` falls back to config.json's EOS; keep it.
            let cfg: Option<serde_json::Value> =
                std::fs::read_to_string(model_dir.join("config.json")).ok().and_then(|t| serde_json::from_str(&t).ok());
            eos = cfg.map(|c| ids(&c["eos_token_id"])).unwrap_or_default();
        }
        if !eos.contains(&json!(id)) {
            eos.push(json!(id));
            gc["eos_token_id"] = if eos.len() == 1 { eos[0].clone() } else { json!(eos) };
            write_json(&dir.join("generation_config.json"), &gc)?;
        }
    }
    Ok(())
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), ExportError> {
    Ok(crate::json::write_file(path, v).map_err(ModelError::io(format!("cannot write `{}`", path.display())))?)
}
