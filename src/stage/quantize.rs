//! `quantize`: exports the trained model. `peft-adapter` writes a PEFT LoRA folder;
//! `safetensors-merged` merges the adapter into the base weights and writes a Hugging Face model
//! folder, then loads it back and checks that it computes what the adapter model computes.
//! GGUF formats are rejected at plan time until the GGUF writer lands.

use std::path::Path;

use candle_core::{DType, Device};
use serde_json::json;

use super::{StageCtx, StageError, write_json};
use crate::model::{Batch, ModelFolder, Trainable, Transformer, folder::save_safetensors, peft};
use crate::recipe::{ExportFormat, QuantizeSettings};
use crate::rng::Rng;

/// Files of a model folder that travel with merged weights.
const FOLDER_FILES: [&str; 5] =
    ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"];

pub fn run(ctx: &StageCtx<'_>) -> Result<serde_json::Value, StageError> {
    let s: QuantizeSettings = serde_json::from_value(ctx.stage.settings()["quantize"].clone())
        .map_err(|e| StageError::Internal(format!("resolved quantize settings: {e}")))?;
    let model_dir = ctx.input("model")?.join("model");
    let weights_dir = ctx.input("weights")?;
    let folder = ModelFolder::open(&model_dir)?;
    // Exports are computed on the CPU in f32: exact merges, whatever device trained.
    let model = super::evaluate::tuned_model(&folder, &weights_dir, &Device::Cpu, DType::F32)?;
    let base_name = ctx.loaded.recipe.model.repo.clone().unwrap_or_default();
    let mut report = serde_json::Map::new();
    for format in &s.formats {
        match format {
            ExportFormat::PeftAdapter => {
                let dir = ctx.out.join("peft-adapter");
                mkdir(&dir)?;
                let spec = peft::read_config(&weights_dir)?;
                let weights = peft::read_weights(&weights_dir, &Device::Cpu)?;
                peft::write(&dir, &spec, &weights, &base_name)?;
                report.insert("peft-adapter".into(), json!({ "dir": "peft-adapter", "tensors": weights.len() }));
            }
            ExportFormat::SafetensorsMerged => {
                let dir = ctx.out.join("merged");
                mkdir(&dir)?;
                let merged = model.merged_weights().map_err(StageError::candle("merge the adapter"))?;
                save_safetensors(&dir.join("model.safetensors"), &merged)?;
                for f in FOLDER_FILES.iter().filter(|f| **f != "config.json") {
                    let src = model_dir.join(f);
                    if src.is_file() {
                        std::fs::copy(&src, dir.join(f)).map_err(StageError::io(format!("cannot copy `{f}`")))?;
                    }
                }
                // An adapter on a tied LM head unties it: the merged head is its own tensor.
                let mut config = folder.raw_config.clone();
                if merged.contains_key("lm_head.weight") && folder.config.tie_word_embeddings {
                    config["tie_word_embeddings"] = json!(false);
                }
                write_json(&dir.join("config.json"), &config)?;
                let diff = check_merged(&model, &dir)?;
                if diff > 1e-3 {
                    return Err(StageError::Internal(format!(
                        "the merged model differs from the adapter model (max |logit difference| {diff})"
                    )));
                }
                ctx.ui.status(
                    "quantize",
                    format!("merged model written; max |logit difference| vs the adapter model {diff:.2e}"),
                );
                report.insert(
                    "safetensors-merged".into(),
                    json!({ "dir": "merged", "tensors": merged.len(), "max_logit_diff": diff }),
                );
            }
            other => {
                return Err(StageError::Internal(format!(
                    "export format {other:?} passed planning but is not implemented"
                )));
            }
        }
    }
    let metrics = json!({ "formats": report });
    write_json(&ctx.out.join("exports.json"), &metrics)?;
    Ok(metrics)
}

fn mkdir(dir: &Path) -> Result<(), StageError> {
    std::fs::create_dir_all(dir).map_err(StageError::io(format!("cannot create `{}`", dir.display())))
}

/// Load the merged folder back and compare its logits with the adapter model's on a fixed batch.
fn check_merged(adapter_model: &Transformer, dir: &Path) -> Result<f64, StageError> {
    let folder = ModelFolder::open(dir)?;
    let weights = folder.load_weights(&Device::Cpu, DType::F32)?;
    let merged = Transformer::new(&folder.config, &weights, &Trainable::Nothing, &mut Rng::new(0))?;
    let vocab = folder.config.vocab_size as u64;
    let mut rng = Rng::new(7);
    let rows: Vec<Vec<u32>> = (0..2).map(|_| (0..16).map(|_| (rng.next_u64() % vocab) as u32).collect()).collect();
    let batch = Batch::new(&rows, &[16, 16], None, &Device::Cpu).map_err(StageError::candle("self-check batch"))?;
    let a = adapter_model.logits(&batch).map_err(StageError::candle("self-check"))?;
    let b = merged.logits(&batch).map_err(StageError::candle("self-check"))?;
    let d = (a - b).and_then(|d| d.abs()).and_then(|d| d.max_all()).and_then(|d| d.to_scalar::<f32>());
    Ok(d.map_err(StageError::candle("self-check"))? as f64)
}
