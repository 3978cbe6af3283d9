//! `quantize`: exports the trained model. `peft-adapter` writes a PEFT LoRA folder;
//! `safetensors-merged` merges the adapter into the base weights and writes a Hugging Face model
//! folder, then loads it back and checks that it computes what the adapter model computes.
//! `gguf-*` writes llama.cpp's GGUF (see [`crate::model::gguf`]) and loads it back with candle's
//! quantized Llama/Qwen2/Qwen3 code to compare its eval-split perplexity with the f32 model's.

use std::path::Path;

use candle_core::{DType, Device};
use serde_json::json;

use super::{StageCtx, StageError, write_json};
use crate::data::TokenStore;
use crate::device::Resolution;
use crate::engine::candle::CandleEngine;
use crate::engine::{Checkpointing, Setup};
use crate::model::{Batch, ModelFolder, Trainable, Transformer, folder::save_safetensors_sharded, gguf, peft};
use crate::plan::key::QuantizeKey;
use crate::recipe::ExportFormat;
use crate::rng::Rng;

/// Tokenizer files of the base folder that travel with every exported folder, as they are
/// (tokenizer_config.json gains the shipped chat template, nothing else changes).
const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

pub fn run(ctx: &StageCtx<'_>, key: &QuantizeKey) -> Result<serde_json::Value, StageError> {
    let s = &key.settings.quantize;
    let model_dir = ctx.model_dir()?;
    let weights_dir = ctx.input("weights")?;
    let folder = ModelFolder::open(&model_dir)?;
    // Exports are computed in f32 (exact merges, whatever dtype trained) on the key's device;
    // the model is loaded only for a format that merges (a PEFT export copies the adapter).
    let mut tuned: Option<CandleEngine> = None;
    let device = key.device.resolution();
    let base_name = &key.settings.base_name;
    // The template the data was rendered with.
    let template = &key.settings.template;
    let tokenizer = folder.tokenizer()?;
    let chat = crate::data::chat::shipped(&folder, template.format, template.chat_template.as_deref(), &tokenizer)?;
    let gguf_chat =
        chat.as_ref().map(|c| gguf::ChatMetadata { template: &c.source, turn_end: c.turn_end.as_ref().map(|t| t.1) });
    let mut report = serde_json::Map::new();
    let mut self_check: Option<(TokenStore, f64)> = None;
    for format in &s.formats {
        match format {
            ExportFormat::PeftAdapter => {
                let dir = ctx.out.join("peft-adapter");
                mkdir(&dir)?;
                let spec = peft::read_config(&weights_dir)?;
                let weights = peft::read_weights(&weights_dir, &Device::Cpu)?;
                peft::write(&dir, &spec, &weights, base_name, &folder)?;
                write_tokenizer_files(&dir, &model_dir, chat.as_ref(), false)?;
                report.insert("peft-adapter".into(), json!({ "dir": "peft-adapter", "tensors": weights.len() }));
            }
            ExportFormat::SafetensorsMerged => {
                let dir = ctx.out.join("merged");
                mkdir(&dir)?;
                let engine = loaded(&mut tuned, &folder, &weights_dir, &device)?;
                let tensors = engine.model().merged_tensors();
                let shard = s.shard_bytes().map_err(StageError::Internal)?;
                // Each merged tensor is computed, written and dropped in turn.
                let files = save_safetensors_sharded(&dir, &tensors, shard)?;
                let unties = tensors.iter().any(|t| t.name == "lm_head.weight");
                write_tokenizer_files(&dir, &model_dir, chat.as_ref(), true)?;
                // An adapter on a tied LM head unties it: the merged head is its own tensor.
                let mut config = folder.raw_config.clone();
                if unties && folder.config.tie_word_embeddings {
                    config["tie_word_embeddings"] = json!(false);
                }
                write_json(&dir.join("config.json"), &config)?;
                let diff = check_merged(engine.model(), &dir)?;
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
                    json!({ "dir": "merged", "tensors": tensors.len(), "files": files, "max_logit_diff": diff }),
                );
            }
            other => {
                let Some((qtype, _)) = gguf::target(*other) else {
                    return Err(StageError::Internal(format!("export format {other:?} is not a GGUF format")));
                };
                let engine = loaded(&mut tuned, &folder, &weights_dir, &device)?;
                let merged = engine.model().merged_tensors();
                let tag = format!("{qtype:?}").to_lowercase();
                let file = format!("model-{tag}.gguf");
                mkdir(&ctx.out.join("gguf"))?;
                let path = ctx.out.join("gguf").join(&file);
                let name = &key.settings.name;
                let written = gguf::write(&path, &folder.config, &merged, &model_dir, name, *other, gguf_chat)?;
                // The eval rows and the unquantized model's loss on them, once for all GGUF formats.
                let (eval, reference) = match &self_check {
                    Some(c) => c,
                    None => {
                        let eval = TokenStore::open(&ctx.input("tokens")?, "eval")?;
                        let (reference, _) = crate::train::evaluate(engine, &eval, 1, SELF_CHECK_ROWS as u64)?;
                        self_check.insert((eval, reference))
                    }
                };
                let reference = *reference;
                let (loss, n) = gguf_eval_loss(&path, folder.config.arch, eval, engine.model().device())?;
                let ratio = (loss - reference).exp();
                ctx.ui.status(
                    "quantize",
                    format!(
                        "{file}: perplexity {:.3} vs {:.3} unquantized ({:+.2}%) over {n} tokens",
                        loss.exp(),
                        reference.exp(),
                        (ratio - 1.0) * 100.0
                    ),
                );
                if ratio > 1.5 {
                    ctx.ui.warn(format!(
                        "{file}: perplexity {ratio:.2}× the unquantized model's in candle's GGUF reader — more than \
                         quantization alone should cost; try a wider type (q8_0, f16), and if that too is off, \
                         report it: the file or the reader may be wrong"
                    ));
                }
                report.insert(
                    format!("gguf-{tag}"),
                    json!({
                        "file": format!("gguf/{file}"),
                        "tensors": written.tensors,
                        "fallback_types": written.fallbacks,
                        "eval_loss": loss,
                        "reference_eval_loss": reference,
                        "perplexity_ratio": ratio,
                        "eval_tokens": n,
                    }),
                );
            }
        }
    }
    let metrics = json!({ "formats": report, "chat_template": chat.as_ref().map(|c| json!({
        "origin": c.origin,
        "turn_end": c.turn_end.as_ref().map(|t| &t.0),
        "source": c.source,
    })) });
    write_json(&ctx.out.join("exports.json"), &metrics)?;
    Ok(metrics)
}

/// The tuned model in `slot`, loaded ([`tuned_engine`]) the first time it is asked for.
fn loaded<'a>(
    slot: &'a mut Option<CandleEngine>,
    folder: &ModelFolder,
    weights_dir: &Path,
    device: &Resolution,
) -> Result<&'a mut CandleEngine, StageError> {
    match slot {
        Some(engine) => Ok(engine),
        None => Ok(slot.insert(tuned_engine(folder, weights_dir, device)?)),
    }
}

/// The base model (its original weights) with the train stage's result applied, as candle
/// tensors on `device` (in f32), computing with the fused CPU engine where it can.
fn tuned_engine(folder: &ModelFolder, weights_dir: &Path, device: &Resolution) -> Result<CandleEngine, StageError> {
    let trainable = match weights_dir.join("adapter_config.json").is_file() {
        true => Trainable::lora(peft::read_config(weights_dir)?),
        false => Trainable::nothing(),
    };
    let setup = Setup {
        folder,
        trainable,
        seed: 0,
        device,
        optimizer: None,
        ema_decay: None,
        checkpointing: Checkpointing::Off,
        trained: Some(weights_dir),
        max_batch: (1, 1),
        tf32: false,
        engine: None,
        // Exports merge the adapter into the original weights, however the base was held
        // while it trained (`adapter.quantize_base`).
        base_quant: None,
    };
    let fused = device.class == crate::device::DeviceClass::Cpu;
    Ok(CandleEngine::build(&setup, fused)?)
}

/// Eval rows used by the GGUF self-check (token-by-token decoding is slow on big models).
const SELF_CHECK_ROWS: usize = 64;

/// Mean next-token loss of a GGUF file over the first eval rows, decoded token by token with
/// candle's quantized Llama/Qwen2/Qwen3 (llama.cpp's conventions: it is a check of names,
/// layout and metadata as much as of quantization error).
fn gguf_eval_loss(
    path: &Path,
    arch: crate::recipe::Arch,
    eval: &TokenStore,
    device: &Device,
) -> Result<(f64, usize), StageError> {
    use candle_transformers::models::{quantized_llama, quantized_qwen2, quantized_qwen3};
    enum Q {
        Llama(quantized_llama::ModelWeights),
        Qwen2(quantized_qwen2::ModelWeights),
        Qwen3(quantized_qwen3::ModelWeights),
    }
    let ctx = |what: &str| StageError::candle(format!("GGUF self-check: {what}"));
    let mut f = std::fs::File::open(path).map_err(StageError::io(format!("cannot open `{}`", path.display())))?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).map_err(ctx("read"))?;
    let mut model = match arch {
        crate::recipe::Arch::Llama => {
            Q::Llama(quantized_llama::ModelWeights::from_gguf(content, &mut f, device).map_err(ctx("load"))?)
        }
        crate::recipe::Arch::Qwen2 => {
            Q::Qwen2(quantized_qwen2::ModelWeights::from_gguf(content, &mut f, device).map_err(ctx("load"))?)
        }
        crate::recipe::Arch::Qwen3 => {
            Q::Qwen3(quantized_qwen3::ModelWeights::from_gguf(content, &mut f, device).map_err(ctx("load"))?)
        }
    };
    let (mut sum, mut n) = (0f64, 0usize);
    for r in 0..eval.len().min(SELF_CHECK_ROWS) {
        let row = eval.row(r);
        // Each row starts afresh: Llama's and Qwen2's caches restart at position 0 by
        // themselves, Qwen3's keeps appending until cleared.
        if let Q::Qwen3(m) = &mut model {
            m.clear_kv_cache();
        }
        for j in 0..row.ids.len().saturating_sub(1) {
            let x = candle_core::Tensor::new(&[[row.ids[j]]], device).map_err(ctx("input"))?;
            let logits = match &mut model {
                Q::Llama(m) => m.forward(&x, j),
                Q::Qwen2(m) => m.forward(&x, j),
                Q::Qwen3(m) => m.forward(&x, j),
            }
            .map_err(ctx("forward"))?;
            if row.mask[j + 1] == 1 && row.seg[j + 1] == row.seg[j] {
                let v: Vec<f32> = logits.flatten_all().and_then(|l| l.to_vec1()).map_err(ctx("logits"))?;
                let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = max + v.iter().map(|x| (*x as f64 - max).exp()).sum::<f64>().ln();
                sum += lse - v[row.ids[j + 1] as usize] as f64;
                n += 1;
            }
        }
    }
    Ok((if n > 0 { sum / n as f64 } else { f64::NAN }, n))
}

/// Copy the base folder's tokenizer files (and, for a full model folder, generation_config.json)
/// into `dir`, then make the shipped chat template the folder's: `chat_template.jinja` (read
/// first by transformers ≥ 4.43, and llama.cpp's converter) and `chat_template` in
/// tokenizer_config.json (older transformers), with the turn-end token among the EOS ids that
/// `generate` stops at.
fn write_tokenizer_files(
    dir: &Path,
    model_dir: &Path,
    chat: Option<&crate::data::chat::Shipped>,
    generation: bool,
) -> Result<(), StageError> {
    let names = TOKENIZER_FILES.iter().chain(generation.then_some(&"generation_config.json"));
    for f in names {
        let src = model_dir.join(f);
        if src.is_file() {
            std::fs::copy(&src, dir.join(f)).map_err(StageError::io(format!("cannot copy `{f}`")))?;
        }
    }
    let Some(chat) = chat else { return Ok(()) };
    std::fs::write(dir.join("chat_template.jinja"), &chat.source)
        .map_err(StageError::io("cannot write chat_template.jinja"))?;
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

fn mkdir(dir: &Path) -> Result<(), StageError> {
    std::fs::create_dir_all(dir).map_err(StageError::io(format!("cannot create `{}`", dir.display())))
}

/// Load the merged folder back and compare its logits with the adapter model's on a fixed batch.
fn check_merged(adapter_model: &Transformer, dir: &Path) -> Result<f64, StageError> {
    let folder = ModelFolder::open(dir)?;
    let device = adapter_model.device();
    let weights = folder.load_weights(device, DType::F32)?;
    let merged = Transformer::new(&folder.config, &weights, &Trainable::nothing(), &mut Rng::new(0))?;
    let vocab = folder.config.vocab_size as u64;
    let mut rng = Rng::new(7);
    let rows: Vec<Vec<u32>> = (0..2).map(|_| (0..16).map(|_| (rng.next_u64() % vocab) as u32).collect()).collect();
    let batch = Batch::new(&rows, &[16, 16], None, device).map_err(StageError::candle("self-check batch"))?;
    let a = adapter_model.logits(&batch).map_err(StageError::candle("self-check"))?;
    let b = merged.logits(&batch).map_err(StageError::candle("self-check"))?;
    let d = (a - b).and_then(|d| d.abs()).and_then(|d| d.max_all()).and_then(|d| d.to_scalar::<f32>());
    Ok(d.map_err(StageError::candle("self-check"))? as f64)
}
