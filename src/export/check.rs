//! The checks every export passes before the stage keeps it: the merged folder read back
//! tensor by tensor and computing what the adapter model computes, and each GGUF read back by
//! candle's GGUF code (Llama, Qwen2, Qwen3) or as llama.cpp reads it (Gemma) to compare its
//! perplexity and top tokens with the adapter model's. The models run one decoder layer at a
//! time: a check never holds the whole model.

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use super::ExportError;
use super::merged::{Form, Merged};
use crate::data::TokenStore;
use crate::engine::HostBatch;
use crate::engine::candle::ops::cross_entropy;
use crate::model::{Batch, ModelError, ModelFolder};
use crate::rng::Rng;

/// What a GGUF is compared with: the adapter model's mean next-token loss over the self-check's
/// rows, and its most likely next token at each position that counts (in the order the rows and
/// their positions come).
pub struct Reference {
    pub loss: f64,
    pub top: Vec<u32>,
}

/// A model that computes whole rows, one decoder layer at a time: the adapter model, or a Gemma
/// GGUF as llama.cpp reads it.
trait Rows {
    fn hidden(&self, batches: &[Batch]) -> Result<Vec<Tensor>, ModelError>;
    fn logits(&self, h: &Tensor) -> Result<Tensor, ModelError>;
}

impl Rows for super::merged::Streamed<'_, '_> {
    fn hidden(&self, batches: &[Batch]) -> Result<Vec<Tensor>, ModelError> {
        self.hidden(batches)
    }
    fn logits(&self, h: &Tensor) -> Result<Tensor, ModelError> {
        self.logits(h)
    }
}

impl Rows for super::gguf::read::GgufModel {
    fn hidden(&self, batches: &[Batch]) -> Result<Vec<Tensor>, ModelError> {
        self.hidden(batches)
    }
    fn logits(&self, h: &Tensor) -> Result<Tensor, ModelError> {
        self.logits(h)
    }
}

/// The adapter model's [`Reference`] over the first `rows` eval rows (one row a batch, as the
/// evaluate stage batches them), computed one decoder layer at a time.
pub fn adapter_reference(
    merged: &Merged<'_>,
    eval: &TokenStore,
    rows: usize,
    device: &Device,
) -> Result<Reference, ExportError> {
    rows_reference(&merged.streamed(Form::Adapter, device)?, eval, rows, device)
}

/// `model`'s mean next-token loss and most likely tokens over the first `rows` eval rows.
fn rows_reference(
    model: &impl Rows,
    eval: &TokenStore,
    rows: usize,
    device: &Device,
) -> Result<Reference, ExportError> {
    let err = |what: &str| ModelError::candle(format!("GGUF self-check reference: {what}"));
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

/// Eval rows the GGUF self-check reads at most.
pub const SELF_CHECK_ROWS: usize = 64;

/// What the GGUF self-check may spend on the CPU: about 2·10¹² multiply-adds (the reference
/// pass, then as many again decoding), a minute or two on a desktop CPU whatever the model;
/// on a GPU every row of [`SELF_CHECK_ROWS`].
const CPU_CHECK_MACS: f64 = 2e12;

/// How many of the eval rows (of token lengths `lens`) the GGUF self-check reads: the first
/// [`SELF_CHECK_ROWS`], and on the CPU only as many whole rows as fit [`CPU_CHECK_MACS`] for a
/// model of `params` weights (at least one): an 8B model's check decodes a few hundred tokens
/// there, not the thousands that would take an hour.
pub fn check_rows(lens: impl Iterator<Item = usize>, params: usize, cpu: bool) -> usize {
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
/// reads the file ([`super::gguf::read`]): a check of names, layout and metadata as much as of
/// quantization error —, the tokens it counted, and at how many of them its most likely token
/// is the reference's (`top`, one per counted token, in order; the first of equal logits, as
/// candle's argmax takes it).
pub fn gguf_eval_loss(
    path: &Path,
    cfg: &crate::model::ModelConfig,
    eval: &TokenStore,
    rows: usize,
    top: &[u32],
    device: &Device,
) -> Result<(f64, usize, usize), ExportError> {
    let mut f = std::fs::File::open(path).map_err(ModelError::io(format!("cannot open `{}`", path.display())))?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f)
        .map_err(ModelError::candle("GGUF self-check: read"))?;
    let (loss, n, same) = match cfg.arch {
        crate::recipe::Arch::Gemma2 | crate::recipe::Arch::Gemma3 => {
            let model = super::gguf::read::GgufModel::with_content(path, content, cfg, device)?;
            let r = rows_reference(&model, eval, rows, device)?;
            let same = r.top.iter().zip(top).filter(|(a, b)| a == b).count();
            (r.loss, r.top.len(), same)
        }
        arch => candle_decoded_loss(content, &mut f, arch, eval, rows, top, device)?,
    };
    if n != top.len() {
        return Err(ExportError::Internal(format!(
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
) -> Result<(f64, usize, usize), ExportError> {
    use candle_transformers::models::{quantized_llama, quantized_qwen2, quantized_qwen3};
    enum Q {
        Llama(quantized_llama::ModelWeights),
        Qwen2(quantized_qwen2::ModelWeights),
        Qwen3(quantized_qwen3::ModelWeights),
    }
    let ctx = |what: &str| ModelError::candle(format!("GGUF self-check: {what}"));
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
            return Err(ExportError::Internal("candle's GGUF readers compute no Gemma as llama.cpp does".into()));
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

/// The merged folder as written (`back`, opened again): its config.json reads back as the
/// merged model's, and it holds exactly the merged model's tensors, each with its shape, its
/// dtype and the bytes the writer computed (`digests`), bit for bit.
pub fn check_written(
    merged: &Merged<'_>,
    back: &ModelFolder,
    dtype: Option<DType>,
    digests: &std::collections::BTreeMap<String, blake3::Hash>,
) -> Result<(), ExportError> {
    if back.config != *merged.config() {
        return Err(ExportError::Internal("the merged folder's config.json reads back as another model".into()));
    }
    let stored = back.stored()?;
    if stored.len() != merged.layout().len() {
        return Err(ExportError::Internal(format!(
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
            return Err(ExportError::Internal(format!(
                "`{}` reads back from the merged folder other than it was written",
                e.name
            )));
        }
    }
    // The base's other tensors (an image-text model's vision tower), carried over.
    let others: Vec<&str> = stored.others().collect();
    if others.len() + merged.layout().len() != digests.len() {
        return Err(ExportError::Internal(format!(
            "the merged folder holds {} tensors besides the model's, not the base's {}",
            others.len(),
            digests.len() - merged.layout().len()
        )));
    }
    for name in others {
        if digests.get(name) != Some(&stored.other_digest(name)?) {
            return Err(ExportError::Internal(format!(
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
pub fn check_merged(
    merged: &Merged<'_>,
    written: Option<&Merged<'_>>,
    device: &Device,
) -> Result<(f64, Option<f64>), ExportError> {
    let vocab = merged.config().vocab_size as u64;
    let mut rng = Rng::new(7);
    let rows: Vec<Vec<u32>> = (0..2).map(|_| (0..16).map(|_| (rng.next_u64() % vocab) as u32).collect()).collect();
    let batch = Batch::new(&rows, &[16, 16], None, device).map_err(ModelError::candle("self-check batch"))?;
    // One model at a time: each is dropped before the next is built.
    let logits = |m: &Merged<'_>, form: Form| -> Result<Tensor, ExportError> {
        let model = m.streamed(form, device)?;
        let h = model.hidden(std::slice::from_ref(&batch))?;
        Ok(model.logits(&h[0])?)
    };
    let adapter = logits(merged, Form::Adapter)?;
    let max_diff = |other: Tensor| -> Result<f64, ExportError> {
        let d = (&adapter - other).and_then(|d| d.abs()).and_then(|d| d.max_all()).and_then(|d| d.to_scalar::<f32>());
        Ok(d.map_err(ModelError::candle("self-check"))? as f64)
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
