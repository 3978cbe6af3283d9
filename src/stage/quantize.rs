//! `quantize`: exports the trained model. `peft-adapter` writes a PEFT LoRA folder;
//! `safetensors-merged` merges the adapter into the base weights one tensor at a time
//! ([`Merged`]) and writes a Hugging Face model folder in the base's dtypes (or
//! `merged_dtype`), reads it back against the digests written, and checks that the merged model
//! computes what the adapter model computes. `gguf-*` writes llama.cpp's GGUF (see
//! [`crate::model::gguf`]) and loads it back with candle's quantized Llama/Qwen2/Qwen3 code to
//! compare its eval-split perplexity and top tokens with the adapter model's; the GGUF types that
//! search their scales are first calibrated by an importance matrix over train rows, or the one
//! the recipe's `imatrix_file` names (written as `gguf/imatrix.gguf` either way).
//! The checks' models run one decoder layer at a time: an export never holds the whole model.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::json;

use super::{StageCtx, StageError, write_json};
use crate::data::TokenStore;
use crate::data::tokens::Packer;
use crate::engine::HostBatch;
use crate::model::merged::{Form, Merged};
use crate::model::ops::cross_entropy;
use crate::model::{Batch, ModelFolder, gguf, peft};
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
                let budget = imatrix_budget(s.imatrix_tokens, merged.params(), device.is_cpu());
                let im = importance_matrix(ctx, &merged, &train, budget, &device, &key.settings.name)?;
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
    let metrics = json!({ "formats": report, "chat_template": chat.as_ref().map(|c| json!({
        "origin": c.origin,
        "turn_end": c.turn_end.as_ref().map(|t| &t.0),
        "source": c.source,
    })) });
    write_json(&ctx.out.join("exports.json"), &metrics)?;
    Ok(metrics)
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

/// What a GGUF is compared with: the adapter model's mean next-token loss over the self-check's
/// rows, and its most likely next token at each position that counts (in the order the rows and
/// their positions come).
struct Reference {
    loss: f64,
    top: Vec<u32>,
}

/// A model that computes whole rows, one decoder layer at a time: the adapter model, or a Gemma
/// GGUF as llama.cpp reads it.
trait Rows {
    fn hidden(&self, batches: &[Batch]) -> Result<Vec<Tensor>, crate::model::ModelError>;
    fn logits(&self, h: &Tensor) -> Result<Tensor, crate::model::ModelError>;
}

impl Rows for crate::model::merged::Streamed<'_, '_> {
    fn hidden(&self, batches: &[Batch]) -> Result<Vec<Tensor>, crate::model::ModelError> {
        self.hidden(batches)
    }
    fn logits(&self, h: &Tensor) -> Result<Tensor, crate::model::ModelError> {
        self.logits(h)
    }
}

impl Rows for gguf::read::GgufModel {
    fn hidden(&self, batches: &[Batch]) -> Result<Vec<Tensor>, crate::model::ModelError> {
        self.hidden(batches)
    }
    fn logits(&self, h: &Tensor) -> Result<Tensor, crate::model::ModelError> {
        self.logits(h)
    }
}

/// The adapter model's [`Reference`] over the first `rows` eval rows (one row a batch, as the
/// evaluate stage batches them), computed one decoder layer at a time.
fn adapter_reference(
    merged: &Merged<'_>,
    eval: &TokenStore,
    rows: usize,
    device: &Device,
) -> Result<Reference, StageError> {
    rows_reference(&merged.streamed(Form::Adapter, device)?, eval, rows, device)
}

/// `model`'s mean next-token loss and most likely tokens over the first `rows` eval rows.
fn rows_reference(model: &impl Rows, eval: &TokenStore, rows: usize, device: &Device) -> Result<Reference, StageError> {
    let err = |what: &str| StageError::candle(format!("GGUF self-check reference: {what}"));
    let mut batches = Vec::new();
    let mut picks = Vec::new();
    for r in 0..rows {
        let row = eval.row(r);
        let hb = HostBatch::new(&[(row.ids.as_slice(), row.seg.as_slice(), row.mask.as_slice())]);
        if hb.select.is_empty() {
            continue;
        }
        batches.push(Batch::from_layout(&hb.ids, hb.b, hb.t, &hb.layout, device).map_err(err("batch"))?);
        let n = hb.select.len();
        let select = Tensor::from_slice(&hb.select, n, device).map_err(err("batch"))?;
        let targets = Tensor::from_slice(&hb.targets, n, device).map_err(err("batch"))?;
        picks.push((select, targets, n));
    }
    let hidden = model.hidden(&batches)?;
    let (mut sum, mut count, mut top) = (0f64, 0usize, Vec::new());
    for (h, (select, targets, n)) in hidden.iter().zip(&picks) {
        let h = h.flatten_to(1).and_then(|h| h.index_select(select, 0)).map_err(err("select"))?;
        let logits = model.logits(&h)?;
        let loss = cross_entropy(&logits, targets).and_then(|l| l.to_scalar::<f32>()).map_err(err("loss"))?;
        top.extend(logits.argmax(candle_core::D::Minus1).and_then(|t| t.to_vec1::<u32>()).map_err(err("top token"))?);
        sum += loss as f64 * *n as f64;
        count += n;
    }
    Ok(Reference { loss: if count > 0 { sum / count as f64 } else { f64::NAN }, top })
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
    let columns: std::collections::BTreeMap<String, usize> = merged
        .layout()
        .iter()
        .filter_map(|e| match e.shape.as_slice() {
            [_, cols] => gguf::tensor_name(&e.name, merged.config().sandwich_norms).map(|n| (n, *cols)),
            _ => None,
        })
        .collect();
    let mismatch = |what: String| -> StageError {
        crate::recipe::Problem::new("rtune::quantize::imatrix_mismatch", format!("`{shown}` {what}"))
            .at(ctx.spans.origin(at), "this importance matrix")
            .help("an importance matrix is made for one model: compute this one's (drop `imatrix_file`), or name one made for this base model")
            .into()
    };
    for (name, cols) in im.columns() {
        match columns.get(name) {
            None => return Err(mismatch(format!("has a matrix `{name}` that this model does not"))),
            Some(c) if *c != cols => {
                return Err(mismatch(format!("gives `{name}` {cols} input columns where this model has {c}")));
            }
            Some(_) => {}
        }
    }
    let decoder = columns.keys().filter(|n| n.starts_with("blk.")).count();
    let covered = im.columns().filter(|(n, _)| n.starts_with("blk.")).count();
    if covered < decoder {
        ctx.ui.warn(format!(
            "`{shown}` covers {covered} of the {decoder} decoder matrices; the others are quantized without an \
             importance matrix"
        ));
    }
    Ok(im)
}

/// What the importance matrix's pass may spend on the CPU by default: about 4·10¹² multiply-adds
/// (a couple of minutes on a desktop CPU), at least one llama-imatrix chunk.
const CPU_IMATRIX_MACS: f64 = 4e12;

/// Calibration tokens: `asked` where the recipe sets `imatrix_tokens`; else the default
/// (16,384), and on the CPU no more than [`CPU_IMATRIX_MACS`] allow for a model of `params`
/// weights, at least 512 — an 8B model calibrates on 512 tokens there, not for an hour.
fn imatrix_budget(asked: Option<u64>, params: usize, cpu: bool) -> usize {
    let tokens = asked.unwrap_or(crate::recipe::QuantizeSettings::DEFAULT_IMATRIX_TOKENS);
    let tokens = usize::try_from(tokens).unwrap_or(usize::MAX);
    match (asked, cpu) {
        (None, true) => tokens.min(((CPU_IMATRIX_MACS / params.max(1) as f64) as usize).max(gguf::imatrix::CHUNK)),
        _ => tokens,
    }
}

/// Seed of the order in which train rows calibrate the importance matrix.
const IMATRIX_SEED: u64 = 0x1a7_e1c5;

/// Tokens of train rows the importance matrix's pass packs into one sequence (llama-imatrix's
/// chunk); each row stays its own document.
const IMATRIX_PACK: usize = 512;

/// Hidden states the importance matrix's pass keeps at once (its rows go through the layers in
/// groups of about this size, each group streaming the layers again).
const IMATRIX_GROUP_BYTES: usize = 256 << 20;

/// The importance matrix of the model `merged` exports (the adapter model, computed in f32 one
/// layer at a time on `device`): the mean square of each decoder matrix's input columns over
/// `budget` tokens of `train`'s rows, taken in a fixed shuffled order (the last one cut to fit;
/// every row whole when the split is smaller).
fn importance_matrix(
    ctx: &StageCtx<'_>,
    merged: &Merged<'_>,
    train: &TokenStore,
    budget: usize,
    device: &Device,
    recipe: &str,
) -> Result<gguf::Imatrix, StageError> {
    let err = |what: &str| StageError::candle(format!("importance matrix: {what}"));
    let mut order: Vec<usize> = (0..train.len()).collect();
    Rng::new(IMATRIX_SEED).shuffle(&mut order);
    let group_tokens = (IMATRIX_GROUP_BYTES / (4 * merged.config().hidden_size)).max(1);
    // Rows go through the model packed into sequences of up to IMATRIX_PACK tokens, each row its
    // own document (attention and positions restart at every row, as in a row alone; a packed
    // row's documents keep their boundaries), so that the products run on hundreds of positions
    // at once instead of one row's few dozen.
    let mut packer = Packer::new(IMATRIX_PACK);
    let mut sequences = Vec::new();
    let mut tokens = 0;
    for r in order {
        if tokens >= budget {
            break;
        }
        let row = train.row(r);
        let n = row.ids.len().min(budget - tokens);
        if n == 0 {
            continue;
        }
        sequences.extend(packer.add_documents(&row.ids[..n], &row.mask[..n], Some(&row.seg[..n])));
        tokens += n;
    }
    sequences.extend(packer.flush());
    let mut groups: Vec<Vec<Batch>> = vec![Vec::new()];
    let mut in_group = 0;
    for (ids, mask, seg) in &sequences {
        let hb = HostBatch::new(&[(ids.as_slice(), seg.as_slice(), mask.as_slice())]);
        if in_group > 0 && in_group + ids.len() > group_tokens {
            groups.push(Vec::new());
            in_group = 0;
        }
        let batch = Batch::from_layout(&hb.ids, hb.b, hb.t, &hb.layout, device).map_err(err("batch"))?;
        groups.last_mut().expect("one group at least").push(batch);
        in_group += ids.len();
    }
    let mut im = gguf::Imatrix::new(format!("{recipe}: the train split, {tokens} tokens"));
    let model = merged.streamed(Form::Adapter, device)?;
    let groups: Vec<&Vec<Batch>> = groups.iter().filter(|g| !g.is_empty()).collect();
    // A model of more than a moment's work shows its layers go by.
    let layers = merged.config().num_layers;
    let mut bar = (merged.params() >= 100_000_000).then(|| ctx.ui.bar("quantize", (groups.len() * layers) as u64));
    for (g, batches) in groups.iter().enumerate() {
        let mut last = None;
        model.observe(batches, &mut |layer, linears, x| {
            if let Some(bar) = bar.as_mut().filter(|_| last != Some(layer)) {
                bar.set((g * layers + layer + 1) as u64, &format!("imatrix: layer {layer}"));
            }
            last = Some(layer);
            im.add(layer, linears, x)
        })?;
    }
    Ok(im)
}

/// Eval rows the GGUF self-check reads at most.
const SELF_CHECK_ROWS: usize = 64;

/// What the GGUF self-check may spend on the CPU: about 2·10¹² multiply-adds (the reference
/// pass, then as many again decoding), a minute or two on a desktop CPU whatever the model;
/// on a GPU every row of [`SELF_CHECK_ROWS`].
const CPU_CHECK_MACS: f64 = 2e12;

/// How many of the eval rows (of token lengths `lens`) the GGUF self-check reads: the first
/// [`SELF_CHECK_ROWS`], and on the CPU only as many whole rows as fit [`CPU_CHECK_MACS`] for a
/// model of `params` weights (at least one): an 8B model's check decodes a few hundred tokens
/// there, not the thousands that would take an hour.
fn check_rows(lens: impl Iterator<Item = usize>, params: usize, cpu: bool) -> usize {
    let budget = if cpu { CPU_CHECK_MACS / params.max(1) as f64 } else { f64::INFINITY };
    let (mut rows, mut tokens) = (0, 0usize);
    for len in lens.take(SELF_CHECK_ROWS) {
        if rows > 0 && (tokens + len) as f64 > budget {
            break;
        }
        rows += 1;
        tokens += len;
    }
    rows
}

/// Mean next-token loss of a GGUF file over the first `rows` eval rows — decoded token by token
/// with candle's quantized Llama/Qwen2/Qwen3, and for Gemma computed row by row as llama.cpp
/// reads the file ([`gguf::read`]): a check of names, layout and metadata as much as of
/// quantization error —, the tokens it counted, and at how many of them its most likely token
/// is the reference's (`top`, one per counted token, in order; the first of equal logits, as
/// candle's argmax takes it).
fn gguf_eval_loss(
    path: &Path,
    cfg: &crate::model::ModelConfig,
    eval: &TokenStore,
    rows: usize,
    top: &[u32],
    device: &Device,
) -> Result<(f64, usize, usize), StageError> {
    let mut f = std::fs::File::open(path).map_err(StageError::io(format!("cannot open `{}`", path.display())))?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f)
        .map_err(StageError::candle("GGUF self-check: read"))?;
    let (loss, n, same) = match cfg.arch {
        crate::recipe::Arch::Gemma2 | crate::recipe::Arch::Gemma3 => {
            let model = gguf::read::GgufModel::with_content(path, content, cfg, device)?;
            let r = rows_reference(&model, eval, rows, device)?;
            let same = r.top.iter().zip(top).filter(|(a, b)| a == b).count();
            (r.loss, r.top.len(), same)
        }
        arch => candle_decoded_loss(content, &mut f, arch, eval, rows, top, device)?,
    };
    if n != top.len() {
        return Err(StageError::Internal(format!(
            "the GGUF self-check counted {n} tokens, its reference {}",
            top.len()
        )));
    }
    Ok((loss, n, same))
}

/// [`gguf_eval_loss`] through candle's quantized Llama/Qwen2/Qwen3, one token at a time.
fn candle_decoded_loss(
    content: candle_core::quantized::gguf_file::Content,
    f: &mut std::fs::File,
    arch: crate::recipe::Arch,
    eval: &TokenStore,
    rows: usize,
    top: &[u32],
    device: &Device,
) -> Result<(f64, usize, usize), StageError> {
    use candle_transformers::models::{quantized_llama, quantized_qwen2, quantized_qwen3};
    enum Q {
        Llama(quantized_llama::ModelWeights),
        Qwen2(quantized_qwen2::ModelWeights),
        Qwen3(quantized_qwen3::ModelWeights),
    }
    let ctx = |what: &str| StageError::candle(format!("GGUF self-check: {what}"));
    let mut model = match arch {
        crate::recipe::Arch::Llama => {
            Q::Llama(quantized_llama::ModelWeights::from_gguf(content, f, device).map_err(ctx("load"))?)
        }
        crate::recipe::Arch::Qwen2 => {
            Q::Qwen2(quantized_qwen2::ModelWeights::from_gguf(content, f, device).map_err(ctx("load"))?)
        }
        crate::recipe::Arch::Qwen3 => {
            Q::Qwen3(quantized_qwen3::ModelWeights::from_gguf(content, f, device).map_err(ctx("load"))?)
        }
        crate::recipe::Arch::Gemma2 | crate::recipe::Arch::Gemma3 => {
            return Err(StageError::Internal("candle's GGUF readers compute no Gemma as llama.cpp does".into()));
        }
    };
    let (mut sum, mut n, mut same) = (0f64, 0usize, 0usize);
    for r in 0..rows {
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
                let argmax = v.iter().position(|x| *x as f64 == max).unwrap_or(0) as u32;
                same += usize::from(top.get(n) == Some(&argmax));
                n += 1;
            }
        }
    }
    Ok((if n > 0 { sum / n as f64 } else { f64::NAN }, n, same))
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

/// The merged folder as written (`back`, opened again): its config.json reads back as the
/// merged model's, and it holds exactly the merged model's tensors, each with its shape, its
/// dtype and the bytes the writer computed (`digests`), bit for bit.
fn check_written(
    merged: &Merged<'_>,
    back: &ModelFolder,
    dtype: Option<DType>,
    digests: &std::collections::BTreeMap<String, blake3::Hash>,
) -> Result<(), StageError> {
    if back.config != *merged.config() {
        return Err(StageError::Internal("the merged folder's config.json reads back as another model".into()));
    }
    let stored = back.stored()?;
    if stored.len() != merged.layout().len() {
        return Err(StageError::Internal(format!(
            "the merged folder holds {} tensors, not the model's {}",
            stored.len(),
            merged.layout().len()
        )));
    }
    for e in merged.layout() {
        let same = stored.shape(&e.name) == Some(e.shape.as_slice())
            && stored.dtype(&e.name)? == dtype.unwrap_or(e.dtype)
            && digests.get(&e.name) == Some(&stored.digest(&e.name)?);
        if !same {
            return Err(StageError::Internal(format!(
                "`{}` reads back from the merged folder other than it was written",
                e.name
            )));
        }
    }
    // The base's other tensors (an image-text model's vision tower), carried over.
    let others: Vec<&str> = stored.others().collect();
    if others.len() + merged.layout().len() != digests.len() {
        return Err(StageError::Internal(format!(
            "the merged folder holds {} tensors besides the model's, not the base's {}",
            others.len(),
            digests.len() - merged.layout().len()
        )));
    }
    for name in others {
        if digests.get(name) != Some(&stored.other_digest(name)?) {
            return Err(StageError::Internal(format!(
                "`{name}` reads back from the merged folder other than it was written"
            )));
        }
    }
    Ok(())
}

/// The merged model's logits against the adapter model's on a fixed batch (both computed in
/// f32 one layer at a time on `device`): the largest absolute difference; and the same for the
/// folder `written` as it reads back, where given. Both models read the train stage's output
/// through [`Merged`]: this checks the merge and the folder, not that reading (the pipeline
/// tests compare the merged folder with the trained values directly).
fn check_merged(
    merged: &Merged<'_>,
    written: Option<&Merged<'_>>,
    device: &Device,
) -> Result<(f64, Option<f64>), StageError> {
    let vocab = merged.config().vocab_size as u64;
    let mut rng = Rng::new(7);
    let rows: Vec<Vec<u32>> = (0..2).map(|_| (0..16).map(|_| (rng.next_u64() % vocab) as u32).collect()).collect();
    let batch = Batch::new(&rows, &[16, 16], None, device).map_err(StageError::candle("self-check batch"))?;
    // One model at a time: each is dropped before the next is built.
    let logits = |m: &Merged<'_>, form: Form| -> Result<Tensor, StageError> {
        let model = m.streamed(form, device)?;
        let h = model.hidden(std::slice::from_ref(&batch))?;
        Ok(model.logits(&h[0])?)
    };
    let adapter = logits(merged, Form::Adapter)?;
    let max_diff = |other: Tensor| -> Result<f64, StageError> {
        let d = (&adapter - other).and_then(|d| d.abs()).and_then(|d| d.max_all()).and_then(|d| d.to_scalar::<f32>());
        Ok(d.map_err(StageError::candle("self-check"))? as f64)
    };
    let diff = max_diff(logits(merged, Form::Merged)?)?;
    // The written folder is a plain model: its weights are what its "adapter model" holds.
    let as_written = written.map(|w| logits(w, Form::Adapter).and_then(&max_diff)).transpose()?;
    Ok((diff, as_written))
}

#[cfg(test)]
mod tests {
    use super::check_rows;

    /// The GGUF self-check reads at most 64 rows; on the CPU, whole rows within its budget and
    /// at least one.
    /// The importance matrix's default calibration fits the CPU's budget (at least a chunk);
    /// a GPU, or a recipe that says how many, gets them all.
    #[test]
    fn the_imatrix_default_fits_the_cpu() {
        use super::imatrix_budget;
        assert_eq!(imatrix_budget(None, 135_000_000, true), 16_384, "4e12 / 135M = 29,629: all");
        assert_eq!(imatrix_budget(None, 360_000_000, true), 11_111);
        assert_eq!(imatrix_budget(None, 8_000_000_000, true), 512, "at least one chunk");
        assert_eq!(imatrix_budget(None, 8_000_000_000, false), 16_384);
        assert_eq!(imatrix_budget(Some(100_000), 8_000_000_000, true), 100_000, "as the recipe says");
    }

    #[test]
    fn the_self_check_reads_what_the_device_affords() {
        let lens = || std::iter::repeat_n(200, 100);
        assert_eq!(check_rows(lens(), 8_000_000_000, false), 64, "a GPU reads every row");
        assert_eq!(check_rows(lens(), 100_000, true), 64, "a tiny model on the CPU too");
        // 2e12 / 8e9 = 250 tokens: one row of 200 (a second would pass the budget).
        assert_eq!(check_rows(lens(), 8_000_000_000, true), 1);
        assert_eq!(check_rows(lens(), 1_100_000_000, true), 9, "1,818 tokens for 1.1B");
        assert_eq!(check_rows(std::iter::once(5000), 8_000_000_000, true), 1, "at least one row");
        assert_eq!(check_rows(std::iter::empty(), 100, true), 0);
    }
}
