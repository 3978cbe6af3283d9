//! `evaluate`: mean loss and perplexity on the eval split for the base and/or tuned model, and
//! generations for fixed prompts (greedy, or seeded sampling), saved as metrics.json.

use serde_json::{Value, json};

use super::{StageCtx, StageError, write_json};
use crate::data::TokenStore;
use crate::data::format::alpaca_prompt;
use crate::engine::{Checkpointing, Engine, Setup};
use crate::model::{ModelFolder, Trainable, peft};
use crate::plan::key::{DeviceKey, EvaluateKey, Rendering, Source};
use crate::recipe::{DataFormat, EvalModel};
use crate::rng::Rng;
use crate::train::evaluate;

/// Tokenize an evaluate stage's own dataset (every row of the file, or of the folder's `split`
/// of its card's `config`) into its work folder, after checking it is still what the plan
/// fingerprinted.
fn own_dataset(
    ctx: &StageCtx<'_>,
    folder: &ModelFolder,
    (path, source): (&std::path::Path, &Source),
    rendering: &Rendering,
    (split, config): (Option<&str>, Option<&str>),
) -> Result<TokenStore, StageError> {
    super::check_source(ctx, path, source)?;
    let Source::Local { shown, at, .. } = source else {
        return Err(StageError::Internal("an evaluate stage's dataset is a local file".into()));
    };
    let files = crate::data::source::split_files(path, (split, config), &Default::default(), ctx.spans.origin(at))?;
    let named = (&format!("`{shown}`")[..], ctx.spans.origin(at));
    let (encoded, bad, _) = super::encode::encode_dataset(ctx, rendering, folder, &files, named)?;
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

pub fn run(ctx: &StageCtx<'_>, key: &EvaluateKey) -> Result<Value, StageError> {
    let s = &key.settings.evaluate;
    let folder = ModelFolder::open(&ctx.model_dir()?)?;
    let own = key.sources.as_ref().and_then(|s| s.dataset.as_ref()).zip(key.settings.data.as_ref());
    let (eval, source) = match own {
        None => (TokenStore::open(&ctx.input("tokens")?, "eval")?, "the eval split".to_string()),
        Some((src @ Source::Local { path, shown, .. }, rendering)) => {
            let split = s.split.as_deref();
            let named = match split {
                Some(split) => format!("split `{split}` of `{shown}`"),
                None => format!("`{shown}`"),
            };
            (own_dataset(ctx, &folder, (path, src), rendering, (split, s.config.as_deref()))?, named)
        }
        Some(_) => return Err(StageError::Internal("an evaluate stage's dataset is a local file".into())),
    };
    let longest = crate::train::check_lengths(&folder.config, &[&eval])?;
    let tokenizer = folder.tokenizer()?;
    // Chat data: prompts become a user turn of the template the data was rendered with, and
    // generation also stops at the token that ends the assistant's turn.
    let chat = match &key.settings.prompt_template {
        Some(t) => {
            let template = crate::data::chat::ChatTemplate::for_model(&folder, t.chat_template.as_deref())?
                .with_kwargs(&t.chat_template_kwargs);
            let turn_end = crate::data::chat::turn_end(&template, &tokenizer).map(|(_, id)| id);
            Some((template, turn_end))
        }
        None => None,
    };
    let bos = folder.row_bos(&tokenizer);
    let mut stops = folder.config.eos_token_ids.clone();
    stops.extend(chat.as_ref().and_then(|c| c.1));
    let which: Vec<&str> = match s.model {
        EvalModel::Base => vec!["base"],
        EvalModel::Tuned => vec!["tuned"],
        EvalModel::Both => vec!["base", "tuned"],
    };
    let mut results = serde_json::Map::new();
    for w in &which {
        let weights_dir = if *w == "base" { None } else { Some(ctx.input("weights")?) };
        let mut engine = eval_engine(
            &key.device,
            &folder,
            weights_dir.as_deref(),
            key.settings.base_quant,
            s.batch_size as usize,
            longest,
        )?;
        let (loss, n) = evaluate(&mut *engine, &eval, s.batch_size as usize, 0)?;
        let mut samples = Vec::new();
        for (i, prompt) in s.prompts.iter().enumerate() {
            // A chat template writes its own BOS, as the training rows had it.
            let (text, bos) = match (&chat, key.settings.prompt_format) {
                (Some((template, _)), _) => {
                    let turn = [json!({"role": "user", "content": prompt})];
                    let text = template
                        .render(&turn, true)
                        .map_err(|e| StageError::Internal(format!("chat template, prompt {i}: {e}")))?;
                    (text, None)
                }
                (None, DataFormat::Alpaca) => (alpaca_prompt(prompt, ""), bos),
                (None, _) => (prompt.clone(), bos),
            };
            let enc =
                tokenizer.encode(text.as_str(), false).map_err(|e| StageError::Internal(format!("tokenizer: {e}")))?;
            let mut ids: Vec<u32> = bos.into_iter().collect();
            ids.extend(enc.get_ids());
            let mut rng = Rng::derive(key.settings.seed, &format!("sample:{i}"));
            let limit = folder.config.max_positions();
            let sampling = crate::generate::Sampling {
                max_new_tokens: s.max_new_tokens,
                temperature: s.temperature,
                top_k: s.top_k,
                top_p: s.top_p,
                repetition_penalty: 1.0,
            };
            let (out, _) = crate::generate::generate(&mut *engine, &ids, &sampling, &stops, limit, &mut rng, |_| {})?;
            let completion =
                tokenizer.decode(&out, true).map_err(|e| StageError::Internal(format!("tokenizer: {e}")))?;
            let mut sample = json!({ "prompt": prompt, "completion": completion, "tokens": out.len() });
            if chat.is_some() {
                // What the model saw: the prompt as the chat template renders a user turn.
                sample["rendered"] = json!(text);
            }
            samples.push(sample);
        }
        let measured = match n {
            // `dataset.eval_fraction = 0` holds no rows out (the plan allows it only with prompts).
            0 => format!("{w} model: no eval loss ({source} is empty)"),
            _ => format!("{w} model: eval loss {loss:.4}, perplexity {:.2} over {n} tokens of {source}", loss.exp()),
        };
        ctx.ui.status("evaluate", measured);
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

/// An engine for evaluating the base model (`trained` None) or the base model with a train
/// stage's result applied (a PEFT adapter, or trained weights), on the stage's device, its
/// linears in 4 bits with `base_quant`.
pub(crate) fn eval_engine(
    device: &DeviceKey,
    folder: &ModelFolder,
    trained: Option<&std::path::Path>,
    base_quant: Option<crate::recipe::BaseQuant>,
    batch_size: usize,
    longest: usize,
) -> Result<Box<dyn Engine>, StageError> {
    let trainable = match trained {
        Some(dir) if dir.join("adapter_config.json").is_file() => Trainable::lora(peft::read_config(dir)?),
        _ => Trainable::nothing(),
    };
    let resolution = device.resolution();
    let setup = Setup {
        folder,
        trainable,
        seed: 0,
        device: &resolution,
        optimizer: None,
        ema_decay: None,
        checkpointing: Checkpointing::Off,
        trained,
        max_batch: (batch_size, longest.max(1)),
        tf32: device.tf32,
        engine: device.engine.as_deref(),
        base_quant,
    };
    Ok(crate::engine::build(&setup)?)
}
