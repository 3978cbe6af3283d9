//! Calibration of the GGUF quantization: the importance matrix of the model an export writes
//! (llama-imatrix's mean squares of each decoder matrix's input columns), computed over train
//! rows, or one a recipe names checked against the model.

use candle_core::Device;

use super::ExportError;
use super::gguf;
use super::merged::{Form, Merged};
use crate::data::TokenStore;
use crate::data::tokens::Packer;
use crate::engine::HostBatch;
use crate::model::{Batch, ModelError};
use crate::rng::Rng;
use crate::ui::Ui;

/// How much of this model's decoder an importance matrix covers: `(covered, decoder)` matrices,
/// once every matrix in it is one of this model's with its number of columns; else what is
/// wrong with it (`has a matrix … that this model does not`), to be said of the recipe's file.
pub fn coverage(im: &gguf::Imatrix, merged: &Merged<'_>) -> Result<(usize, usize), String> {
    let columns: std::collections::BTreeMap<String, usize> = merged
        .layout()
        .iter()
        .filter_map(|e| match e.shape.as_slice() {
            [_, cols] => gguf::tensor_name(&e.name, merged.config().sandwich_norms).map(|n| (n, *cols)),
            _ => None,
        })
        .collect();
    for (name, cols) in im.columns() {
        match columns.get(name) {
            None => return Err(format!("has a matrix `{name}` that this model does not")),
            Some(c) if *c != cols => {
                return Err(format!("gives `{name}` {cols} input columns where this model has {c}"));
            }
            Some(_) => {}
        }
    }
    let decoder = columns.keys().filter(|n| n.starts_with("blk.")).count();
    let covered = im.columns().filter(|(n, _)| n.starts_with("blk.")).count();
    Ok((covered, decoder))
}

/// What the importance matrix's pass may spend on the CPU by default: about 4·10¹² multiply-adds
/// (a couple of minutes on a desktop CPU), at least one llama-imatrix chunk.
const CPU_IMATRIX_MACS: f64 = 4e12;

/// Calibration tokens: `asked` where the recipe sets `imatrix_tokens`; else the default
/// (16,384), and on the CPU no more than [`CPU_IMATRIX_MACS`] allow for a model of `params`
/// weights, at least 512 — an 8B model calibrates on 512 tokens there, not for an hour.
pub fn imatrix_budget(asked: Option<u64>, params: usize, cpu: bool) -> usize {
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
pub fn importance_matrix(
    ui: &Ui,
    merged: &Merged<'_>,
    train: &TokenStore,
    budget: usize,
    device: &Device,
    recipe: &str,
) -> Result<gguf::Imatrix, ExportError> {
    let err = |what: &str| ModelError::candle(format!("importance matrix: {what}"));
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
    let mut bar = (merged.params() >= 100_000_000).then(|| ui.bar("quantize", (groups.len() * layers) as u64));
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

#[cfg(test)]
mod tests {
    use super::imatrix_budget;

    /// The importance matrix's default calibration fits the CPU's budget (at least a chunk);
    /// a GPU, or a recipe that says how many, gets them all.
    #[test]
    fn the_imatrix_default_fits_the_cpu() {
        assert_eq!(imatrix_budget(None, 135_000_000, true), 16_384, "4e12 / 135M = 29,629: all");
        assert_eq!(imatrix_budget(None, 360_000_000, true), 11_111);
        assert_eq!(imatrix_budget(None, 8_000_000_000, true), 512, "at least one chunk");
        assert_eq!(imatrix_budget(None, 8_000_000_000, false), 16_384);
        assert_eq!(imatrix_budget(Some(100_000), 8_000_000_000, true), 100_000, "as the recipe says");
    }
}
