//! `quantize`: exports the trained model, orchestrating what [`crate::export`] writes and checks.
//! `peft-adapter` writes a PEFT LoRA folder; `safetensors-merged` merges the adapter into the
//! base weights one tensor at a time ([`Merged`]) and writes a Hugging Face model folder in the
//! base's dtypes (or `merged_dtype`), reads it back against the digests written, and checks that
//! the merged model computes what the adapter model computes. `gguf-*` writes llama.cpp's GGUF
//! ([`gguf`]) and loads it back to compare its eval-split perplexity and top tokens with the
//! adapter model's ([`check`]); the GGUF types that search their scales are first calibrated by
//! an importance matrix over train rows, or the one the recipe's `imatrix_file` names
//! ([`calibrate`]; written as `gguf/imatrix.gguf` either way). The stage decides which files,
//! where, what the report says and which failures are the recipe's; the export room does the
//! rest. The checks' models run one decoder layer at a time: an export never holds the whole
//! model.

use std::path::Path;

use candle_core::{DType, Device};
use serde_json::json;

use super::{StageCtx, StageError, write_json};
use crate::data::TokenStore;
use crate::export::check::{Reference, adapter_reference, check_merged, check_rows, check_written, gguf_eval_loss};
use crate::export::merged::Merged;
use crate::export::tokenizer::write_tokenizer_files;
use crate::export::{calibrate, gguf};
use crate::model::{ModelFolder, peft};
use crate::plan::key::QuantizeKey;
use crate::recipe::ExportFormat;

pub fn run(ctx: &StageCtx<'_>, key: &QuantizeKey) -> Result<serde_json::Value, StageError> {
    let s = &key.settings.quantize;
    let model_dir = ctx.model_dir()?;
    let weights_dir = ctx.input("weights")?;
    let folder = ModelFolder::open(&model_dir)?;
    // The tuned model, merged one tensor at a time from the mapped base in f32 (exact merges,
    // whatever dtype trained); the self-checks run on the key's device one layer at a time.
    let merged = Merged::open(&folder, Some(&weights_dir))?;
    // Before any export is written: an architecture without a GGUF writer fails the stage here.
    if s.formats.iter().any(|f| gguf::target(*f).is_some()) {
        gguf::check(&folder.config, &model_dir)?;
    }
    let device = key.device.resolution().candle_device().map_err(StageError::candle("cannot open the device"))?;
    let base_name = &key.settings.base_name;
    // The template the data was rendered with.
    let template = &key.settings.template;
    let tokenizer = folder.tokenizer()?;
    let chat = crate::data::chat::shipped(&folder, template.format, template.chat_template.as_deref(), &tokenizer)?;
    let gguf_chat =
        chat.as_ref().map(|c| gguf::ChatMetadata { template: &c.source, turn_end: c.turn_end.as_ref().map(|t| t.1) });
    let mut report = serde_json::Map::new();
    let mut gguf_files = Vec::new();
    // The importance matrix, once for every GGUF format that uses one.
    let given = key.sources.as_ref().and_then(|s| s.imatrix.as_ref());
    let imatrix = if s.uses_imatrix() && s.formats.iter().any(|f| f.calibrated()) {
        let start = std::time::Instant::now();
        let (im, made) = match given {
            // The recipe's file (checked against this model), written beside the GGUFs in
            // llama.cpp's GGUF form, whatever form it came in.
            Some(source) => (given_imatrix(ctx, source, &merged)?, "read from the recipe's file".to_string()),
            None => {
                let train = TokenStore::open(&ctx.input("tokens")?, "train")?;
                let budget = calibrate::imatrix_budget(s.imatrix_tokens, merged.params(), device.is_cpu());
                let im = calibrate::importance_matrix(ctx.ui, &merged, &train, budget, &device, &key.settings.name)?;
                if im.is_empty() {
                    return Err(StageError::Internal(
                        "the train split has no tokens to calibrate the GGUF quantization with (set `imatrix = false`)"
                            .into(),
                    ));
                }
                let made = format!("over {} train tokens", im.tokens());
                (im, made)
            }
        };
        mkdir(&ctx.out.join("gguf"))?;
        im.write(&ctx.out.join("gguf").join("imatrix.gguf"))?;
        ctx.ui.status(
            "quantize",
            format!(
                "imatrix.gguf: importance of {} matrices' input columns {made} ({:.1}s)",
                im.len(),
                start.elapsed().as_secs_f64()
            ),
        );
        report.insert(
            "imatrix".into(),
            json!({
                "file": "gguf/imatrix.gguf",
                "matrices": im.len(),
                "tokens": im.tokens(),
                "dataset": im.datasets,
                "given": given.is_some(),
            }),
        );
        Some(im)
    } else {
        None
    };
    // The rows the GGUF self-check reads (the eval split; the train split where
    // `dataset.eval_fraction = 0` holds none out), how many, the adapter model's answers, and
    // which split they are when not the eval split (for the report).
    let mut self_check: Option<(TokenStore, usize, Reference, &str)> = None;
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
                let shard = s.shard_bytes().map_err(StageError::Internal)?;
                let dtype = s.merged_dtype.map(crate::recipe::Dtype::candle);
                progress(ctx, &merged, "merge");
                let written = merged.save_safetensors(&dir, dtype, shard)?;
                merged.on_tensor(None);
                write_tokenizer_files(&dir, &model_dir, chat.as_ref(), true)?;
                write_json(&dir.join("config.json"), &merged.raw_config(dtype))?;
                let back = ModelFolder::open(&dir)?;
                check_written(&merged, &back, dtype, &written.digests)?;
                let files = written.files;
                // Rounded to a narrower dtype, the folder as written computes a little off the
                // f32 merge: how much is reported, not checked.
                let dtypes: std::collections::BTreeSet<&str> =
                    merged.layout().iter().map(|e| dtype_name(dtype.unwrap_or(e.dtype))).collect();
                let narrow: Vec<&str> = dtypes.iter().copied().filter(|d| *d != "f32").collect();
                let narrowed = !narrow.is_empty();
                let back = narrowed.then(|| Merged::open(&back, None)).transpose()?;
                let (diff, as_written) = check_merged(&merged, back.as_ref(), &device)?;
                if diff > 1e-3 {
                    return Err(StageError::Internal(format!(
                        "the merged model differs from the adapter model (max |logit difference| {diff})"
                    )));
                }
                let written_note =
                    as_written.map(|d| format!(" ({d:.2e} as written in {})", narrow.join("/"))).unwrap_or_default();
                ctx.ui.status(
                    "quantize",
                    format!(
                        "merged model written and read back; max |logit difference| vs the adapter model \
                         {diff:.2e}{written_note}"
                    ),
                );
                report.insert(
                    "safetensors-merged".into(),
                    json!({
                        "dir": "merged",
                        "tensors": merged.layout().len(),
                        "files": files,
                        "dtypes": dtypes,
                        "max_logit_diff": diff,
                        "max_logit_diff_as_written": as_written,
                    }),
                );
            }
            other => {
                let Some(target) = gguf::target(*other) else {
                    return Err(StageError::Internal(format!("export format {other:?} is not a GGUF format")));
                };
                let tag = target.tag;
                let file = format!("model-{tag}.gguf");
                mkdir(&ctx.out.join("gguf"))?;
                let path = ctx.out.join("gguf").join(&file);
                let name = &key.settings.name;
                progress(ctx, &merged, tag);
                let calibration = imatrix.as_ref().filter(|_| other.calibrated());
                let written = gguf::write(&path, &merged, &model_dir, name, *other, gguf_chat, calibration)?;
                gguf_files.push(file.clone());
                merged.on_tensor(None);
                // The eval rows and the adapter model's loss and top tokens on them, once for all GGUFs.
                let (eval, rows, reference, split) = match &self_check {
                    Some(c) => c,
                    None => {
                        let tokens = ctx.input("tokens")?;
                        let mut eval = TokenStore::open(&tokens, "eval")?;
                        let mut split = "";
                        if eval.is_empty() {
                            eval = TokenStore::open(&tokens, "train")?;
                            split = " of the train split (there is no eval split)";
                        }
                        let lens = (0..eval.len()).map(|r| eval.row(r).ids.len());
                        let rows = check_rows(lens, merged.params(), device.is_cpu());
                        let reference = adapter_reference(&merged, &eval, rows, &device)?;
                        self_check.insert((eval, rows, reference, split))
                    }
                };
                let (loss, n, same) = gguf_eval_loss(&path, merged.config(), eval, *rows, &reference.top, &device)?;
                let agreement = same as f64 / n.max(1) as f64;
                let reference = reference.loss;
                // A perplexity that is not finite is no quantization cost: the file or the reader
                // is broken, and a stage that passed it on would ship it (seen on an H200 whose
                // candle kernels could not run, 2026-11-27). The stage fails; the file is not kept.
                if !loss.is_finite() && reference.is_finite() && n > 0 {
                    let on = key.device.resolution().device_name();
                    return Err(crate::recipe::Problem::new(
                        "rtune::quantize::self_check",
                        format!(
                            "{file}: its self-check in candle's GGUF reader on {on} gives a perplexity of {} \
                             (the unquantized model's is {:.3}), so the file or the reader is broken",
                            loss.exp(),
                            reference.exp()
                        ),
                    )
                    .at(ctx.spans.origin(&["stages", ctx.name, "formats"]), "this export")
                    .help(if device.is_cpu() {
                        "nothing was kept; weights beyond a type's range become infinities in the file (f16 \
                         holds up to 65504: `gguf-f32` or a quantized type keeps them) — if they are not, please \
                         report it"
                    } else {
                        "nothing was kept; run the stage on the CPU (`--set device.prefer='[\"cpu\"]'`): a check \
                         that passes there points at the GPU's GGUF kernels (`rtune doctor` says which it uses) — \
                         please report it"
                    })
                    .into());
                }
                let ratio = (loss - reference).exp();
                // As llama-quantize does, matrices whose rows are not whole blocks of the type
                // take another: say how many, which a 4-bit file of a small model may surprise.
                let fell_back = match written.fallbacks.len() {
                    0 => String::new(),
                    k => format!(
                        "; {k} of {} matrices in a wider type (rows not whole blocks, as in llama.cpp)",
                        written.matrices
                    ),
                };
                ctx.ui.status(
                    "quantize",
                    format!(
                        "{file}: perplexity {:.3} vs {:.3} unquantized ({:+.2}%), same top token {:.1}% of {n} \
                         tokens{split}{fell_back}",
                        loss.exp(),
                        reference.exp(),
                        (ratio - 1.0) * 100.0,
                        agreement * 100.0
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
                        "imatrix": calibration.is_some(),
                        "tensors": written.tensors,
                        "fallback_types": written.fallbacks,
                        "eval_loss": loss,
                        "reference_eval_loss": reference,
                        "perplexity_ratio": ratio,
                        "top_token_agreement": agreement,
                        "eval_tokens": n,
                    }),
                );
            }
        }
    }
    let ollama = match gguf_files.is_empty() {
        true => serde_json::Value::Null,
        false => ollama_modelfiles(ctx, chat.as_ref(), &gguf_files)?,
    };
    let metrics = json!({ "formats": report, "chat_template": chat.as_ref().map(|c| json!({
        "origin": c.origin,
        "turn_end": c.turn_end.as_ref().map(|t| &t.0),
        "source": c.source,
    })), "ollama": ollama });
    write_json(&ctx.out.join("exports.json"), &metrics)?;
    Ok(metrics)
}

/// A Modelfile beside each GGUF (`gguf/model-q8_0.Modelfile` for `gguf/model-q8_0.gguf`), with
/// the chat template translated for Ollama ([`crate::export::ollama`]); a template that cannot
/// be translated, or none, is said (as a warning, and in exports.json) and no Modelfile written.
fn ollama_modelfiles(
    ctx: &StageCtx<'_>,
    chat: Option<&crate::data::chat::Shipped>,
    gguf_files: &[String],
) -> Result<serde_json::Value, StageError> {
    use crate::export::ollama;
    let Some(chat) = chat else {
        let why =
            "the model has no chat template to translate; `ollama create` of the GGUF gives a plain completion model";
        ctx.ui.warn(format!("no Ollama Modelfile: {why}"));
        return Ok(json!({ "modelfiles": [], "untranslated": why }));
    };
    let stops: Vec<String> = chat.turn_end.iter().map(|t| t.0.clone()).collect();
    let made = ollama::translate(&chat.template).and_then(|t| {
        gguf_files
            .iter()
            .map(|f| ollama::modelfile(&t, f, &stops).map(|m| (f, m)))
            .collect::<Result<Vec<_>, _>>()
            .map(|m| (t, m))
    });
    let (t, files) = match made {
        Ok(x) => x,
        Err(why) => {
            ctx.ui.warn(format!("no Ollama Modelfile: {why} (the GGUF files carry the Jinja template for llama.cpp)"));
            return Ok(json!({ "modelfiles": [], "untranslated": why }));
        }
    };
    let mut names = Vec::new();
    for (gguf_file, text) in files {
        let name = format!("{}.Modelfile", gguf_file.strip_suffix(".gguf").unwrap_or(gguf_file));
        crate::store::write_atomic(&ctx.out.join("gguf").join(&name), text.as_bytes())?;
        names.push(format!("gguf/{name}"));
    }
    ctx.ui.status(
        "quantize",
        format!(
            "{}: Ollama template `{}`, rendering {} conversations as the chat template does{}",
            names.join(", "),
            t.family,
            t.checked,
            if t.system.is_some() { ", with its default system prompt" } else { "" }
        ),
    );
    Ok(json!({
        "modelfiles": names,
        "template": t.family,
        "default_system": t.system,
        "stop": stops,
        "conversations_checked": t.checked,
        "system_turns_refused": t.refuses_system,
    }))
}

/// Show the tensors `merged` computes from now on as progress of `what` — for a model whose
/// exports take more than a moment (over 100M parameters).
fn progress<'a>(ctx: &StageCtx<'_>, merged: &Merged<'a>, what: &str) {
    if merged.params() < 100_000_000 {
        return;
    }
    let mut bar = ctx.ui.bar("quantize", merged.layout().len() as u64);
    let (what, mut done) = (what.to_string(), 0);
    merged.on_tensor(Some(Box::new(move |name: &str| {
        done += 1;
        bar.set(done, &format!("{what} {name}"));
    })));
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// The importance matrix a recipe names (`imatrix_file`), once it is still the file the plan
/// fingerprinted and every matrix in it is one of this model's, with its number of columns.
/// Decoder matrices it leaves out are quantized without one (as llama-quantize does), said once.
fn given_imatrix(
    ctx: &StageCtx<'_>,
    source: &crate::plan::key::Source,
    merged: &Merged<'_>,
) -> Result<gguf::Imatrix, StageError> {
    let crate::plan::key::Source::Local { path, shown, at, .. } = source else {
        return Err(StageError::Internal("an importance matrix file is a local file".into()));
    };
    super::check_source(ctx, path, source)?;
    let im = gguf::Imatrix::read(path)?;
    let (covered, decoder) = calibrate::coverage(&im, merged).map_err(|what| -> StageError {
        crate::recipe::Problem::new("rtune::quantize::imatrix_mismatch", format!("`{shown}` {what}"))
            .at(ctx.spans.origin(at), "this importance matrix")
            .help("an importance matrix is made for one model: compute this one's (drop `imatrix_file`), or name one made for this base model")
            .into()
    })?;
    if covered < decoder {
        ctx.ui.warn(format!(
            "`{shown}` covers {covered} of the {decoder} decoder matrices; the others are quantized without an \
             importance matrix"
        ));
    }
    Ok(im)
}

fn mkdir(dir: &Path) -> Result<(), StageError> {
    std::fs::create_dir_all(dir).map_err(StageError::io(format!("cannot create `{}`", dir.display())))
}
