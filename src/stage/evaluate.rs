//! `evaluate`: mean loss and perplexity on the eval split for the base and/or tuned model, and
//! generations for fixed prompts (greedy, or seeded sampling), saved as metrics.json.

use candle_core::{DType, Device, Tensor};
use serde_json::{Value, json};

use super::{StageCtx, StageError, write_json};
use crate::data::TokenStore;
use crate::data::format::alpaca_prompt;
use crate::model::{KvCache, ModelFolder, Trainable, Transformer, peft};
use crate::recipe::{DataFormat, EvalModel, EvaluateSettings};
use crate::rng::Rng;
use crate::train::evaluate;

/// Tokenize an evaluate stage's own dataset (every row) into its work folder, after checking it
/// is still the file the plan fingerprinted.
fn own_dataset(ctx: &StageCtx<'_>, folder: &ModelFolder, rel: &str) -> Result<TokenStore, StageError> {
    let path = ctx.loaded.resolve_path(rel);
    let planned = ctx.stage.doc["sources"]["dataset"].as_str();
    super::check_source(ctx, &path, rel, planned, &["stages", &ctx.stage.name, "dataset"])?;
    let (encoded, bad, _) = super::tokenize::encode_dataset(ctx, folder, &path)?;
    for b in bad.iter().take(3) {
        ctx.ui.warn(format!("dropped: {b}"));
    }
    let dir = ctx.work.join("eval-tokens");
    std::fs::create_dir_all(&dir).map_err(StageError::io("cannot create the work folder"))?;
    let mut w = crate::data::TokenWriter::create(&dir, "eval")?;
    for e in &encoded {
        w.push(&e.ids, &e.mask, &vec![0; e.ids.len()])?;
    }
    w.finish(&dir, "eval")?;
    Ok(TokenStore::open(&dir, "eval")?)
}

pub fn run(ctx: &StageCtx<'_>) -> Result<Value, StageError> {
    let s: EvaluateSettings = serde_json::from_value(ctx.stage.settings()["evaluate"].clone())
        .map_err(|e| StageError::Internal(format!("resolved evaluate settings: {e}")))?;
    let device = ctx.device.candle_device().map_err(StageError::candle("cannot open the device"))?;
    let model_dir = ctx.input("model")?.join("model");
    let folder = ModelFolder::open(&model_dir)?;
    let (eval, source) = match &s.dataset {
        None => (TokenStore::open(&ctx.input("tokens")?, "eval")?, "the eval split".to_string()),
        Some(rel) => (own_dataset(ctx, &folder, rel)?, format!("`{rel}`")),
    };
    let tokenizer = folder.tokenizer()?;
    let which: Vec<&str> = match s.model {
        EvalModel::Base => vec!["base"],
        EvalModel::Tuned => vec!["tuned"],
        EvalModel::Both => vec!["base", "tuned"],
    };
    let mut results = serde_json::Map::new();
    for w in &which {
        let model = if *w == "base" {
            let weights = folder.load_weights(&device, ctx.device.candle_dtype())?;
            Transformer::new(&folder.config, &weights, &Trainable::Nothing, &mut Rng::new(0))?
        } else {
            tuned_model(&folder, &ctx.input("weights")?, &device, ctx.device.candle_dtype())?
        };
        let (loss, n) = evaluate(&model, &eval, s.batch_size as usize, 0)?;
        let mut samples = Vec::new();
        for (i, prompt) in s.prompts.iter().enumerate() {
            let text = match ctx.loaded.recipe.dataset.format {
                DataFormat::Alpaca => alpaca_prompt(prompt, ""),
                _ => prompt.clone(),
            };
            let enc =
                tokenizer.encode(text.as_str(), false).map_err(|e| StageError::Internal(format!("tokenizer: {e}")))?;
            let mut ids: Vec<u32> = folder.config.bos_token_id.into_iter().collect();
            ids.extend(enc.get_ids());
            let mut rng = Rng::derive(ctx.seed(), &format!("sample:{i}"));
            let out = generate(&model, &ids, &s, &folder.config.eos_token_ids, &mut rng)
                .map_err(StageError::candle("generate"))?;
            let completion =
                tokenizer.decode(&out, true).map_err(|e| StageError::Internal(format!("tokenizer: {e}")))?;
            samples.push(json!({ "prompt": prompt, "completion": completion, "tokens": out.len() }));
        }
        ctx.ui.status(
            "evaluate",
            format!("{w} model: eval loss {loss:.4}, perplexity {:.2} over {n} tokens of {source}", loss.exp()),
        );
        for smp in &samples {
            ctx.ui.detail(format!(
                "{:?} → {:?}",
                smp["prompt"].as_str().unwrap_or_default(),
                smp["completion"].as_str().unwrap_or_default()
            ));
        }
        results.insert(
            w.to_string(),
            json!({ "eval_loss": loss, "perplexity": loss.exp(), "eval_tokens": n, "samples": samples }),
        );
    }
    let primary = results.get(*which.last().expect("one model")).cloned().unwrap_or(Value::Null);
    let metrics = json!({
        "model": which.last(),
        "eval_loss": primary["eval_loss"],
        "perplexity": primary["perplexity"],
        "eval_tokens": primary["eval_tokens"],
        "results": results,
    });
    write_json(&ctx.out.join("metrics.json"), &metrics)?;
    Ok(metrics)
}

/// The base model with the train stage's result applied (a PEFT adapter or trained weights).
pub(super) fn tuned_model(
    folder: &ModelFolder,
    weights_dir: &std::path::Path,
    device: &Device,
    dtype: DType,
) -> Result<Transformer, StageError> {
    let mut weights = folder.load_weights(device, dtype)?;
    if weights_dir.join("adapter_config.json").is_file() {
        let spec = peft::read_config(weights_dir)?;
        let model = Transformer::new(&folder.config, &weights, &Trainable::Lora(spec), &mut Rng::new(0))?;
        model.load_params(&peft::read_weights(weights_dir, device)?)?;
        return Ok(model);
    }
    let trained = candle_core::safetensors::load(weights_dir.join("weights.safetensors"), device)
        .map_err(StageError::candle("cannot read the trained weights"))?;
    for (k, v) in trained {
        let v = v.to_dtype(dtype).map_err(StageError::candle("convert trained weights"))?;
        weights.insert(k, v);
    }
    Ok(Transformer::new(&folder.config, &weights, &Trainable::Nothing, &mut Rng::new(0))?)
}

/// Greedy (temperature 0) or seeded top-k/top-p sampling with a KV cache; stops at eos.
pub fn generate(
    model: &Transformer,
    prompt: &[u32],
    s: &EvaluateSettings,
    eos: &[u32],
    rng: &mut Rng,
) -> candle_core::Result<Vec<u32>> {
    let mut cache = KvCache::default();
    let mut logits = model.step(prompt, &mut cache)?;
    let mut out = Vec::new();
    let limit = model.cfg.max_position_embeddings.saturating_sub(prompt.len());
    for _ in 0..s.max_new_tokens.min(limit) {
        let next = pick(&logits, s, rng)?;
        if eos.contains(&next) {
            break;
        }
        out.push(next);
        logits = model.step(&[next], &mut cache)?;
    }
    Ok(out)
}

fn pick(logits: &Tensor, s: &EvaluateSettings, rng: &mut Rng) -> candle_core::Result<u32> {
    let v: Vec<f32> = logits.to_vec1()?;
    if s.temperature <= 0.0 {
        // First maximum, as torch.argmax.
        let mut best = 0;
        for (i, x) in v.iter().enumerate() {
            if *x > v[best] {
                best = i;
            }
        }
        return Ok(best as u32);
    }
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|a, b| v[*b].total_cmp(&v[*a]));
    if let Some(k) = s.top_k {
        idx.truncate(k.max(1));
    }
    let max = v[idx[0]] as f64;
    let mut probs: Vec<f64> = idx.iter().map(|&i| ((v[i] as f64 - max) / s.temperature).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(top_p) = s.top_p {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (j, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= top_p {
                keep = j + 1;
                break;
            }
        }
        probs.truncate(keep);
        let t: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= t);
    }
    let mut r = rng.next_f64();
    for (j, p) in probs.iter().enumerate() {
        if r < *p {
            return Ok(idx[j] as u32);
        }
        r -= p;
    }
    Ok(idx[probs.len() - 1] as u32)
}
