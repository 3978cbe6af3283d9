//! `tokenize`: dataset rows → a seeded train/eval split of token ids and loss masks, packed or
//! not, in the memory-mapped token store, with `stats.json`.

use serde_json::json;

use super::{StageCtx, StageError, write_json};
use crate::data::{DataError, Encoded, Renderer, TokenWriter, read_rows};
use crate::model::ModelFolder;
use crate::rng::Rng;

const CHUNK: usize = 2048;

/// Read `data` (a file or folder) and encode every row with `[dataset]`'s format and the
/// model's tokenizer, in parallel chunks with progress. Returns the encoded rows, the bad rows
/// (skipped when `skip_bad_rows`, else the first is the error) and the number of rows read.
pub(super) fn encode_dataset(
    ctx: &StageCtx<'_>,
    folder: &ModelFolder,
    data: &std::path::Path,
) -> Result<(Vec<Encoded>, Vec<DataError>, usize), StageError> {
    let d = &ctx.loaded.recipe.dataset;
    let tokenizer = folder.tokenizer()?;
    let (rows, mut bad) = read_rows(data, d.skip_bad_rows)?;
    if rows.is_empty() {
        return Err(DataError::Invalid {
            message: format!("`{}` has no rows", data.display()),
            help: Some("check the dataset's path and format".into()),
        }
        .into());
    }
    let chat = match d.format {
        crate::recipe::DataFormat::Chat => {
            Some(crate::data::chat::ChatTemplate::for_model(folder, d.chat_template.as_deref())?)
        }
        _ => None,
    };
    let renderer = Renderer {
        tokenizer: &tokenizer,
        format: d.format,
        bos: folder.config.bos_token_id,
        eos: folder.config.eos_token_ids.first().copied(),
        max_seq_len: d.max_seq_len,
        truncate: d.truncate,
        train_on_prompt: d.train_on_prompt,
        column_map: &d.column_map,
        chat: chat.as_ref(),
    };
    let mut encoded: Vec<Encoded> = Vec::with_capacity(rows.len());
    let mut bar = ctx.ui.bar("tokenize", rows.len() as u64);
    for (i, chunk) in rows.chunks(CHUNK).enumerate() {
        for r in renderer.encode(chunk)? {
            match r {
                Ok(e) => encoded.push(e),
                Err(e) if d.skip_bad_rows => bad.push(e),
                Err(e) => return Err(e.into()),
            }
        }
        bar.set(((i + 1) * CHUNK).min(rows.len()) as u64, "rows");
    }
    bar.finish();
    if encoded.is_empty() {
        return Err(DataError::Invalid {
            message: format!("every row was dropped ({} bad rows)", bad.len()),
            help: bad.first().map(|b| b.to_string()),
        }
        .into());
    }
    Ok((encoded, bad, rows.len()))
}

pub fn run(ctx: &StageCtx<'_>) -> Result<serde_json::Value, StageError> {
    let d = &ctx.loaded.recipe.dataset;
    let folder = ModelFolder::open(&ctx.input("model")?.join("model"))?;
    let data_dir = ctx.input("dataset")?.join("dataset");
    let (encoded, bad, rows) = encode_dataset(ctx, &folder, &data_dir)?;
    // Seeded split by row.
    let mut order: Vec<usize> = (0..encoded.len()).collect();
    Rng::derive(ctx.seed(), "split").shuffle(&mut order);
    let mut n_eval = (encoded.len() as f64 * d.eval_fraction).round() as usize;
    if d.eval_fraction > 0.0 && encoded.len() > 1 {
        n_eval = n_eval.clamp(1, encoded.len() - 1);
    }
    let mut is_eval = vec![false; encoded.len()];
    for &i in &order[..n_eval] {
        is_eval[i] = true;
    }
    let mut train = TokenWriter::create(ctx.out, "train")?;
    let mut eval = TokenWriter::create(ctx.out, "eval")?;
    let mut packer = Packer::new(d.max_seq_len);
    for (e, ev) in encoded.iter().zip(&is_eval) {
        if *ev {
            eval.push(&e.ids, &e.mask, &vec![0; e.ids.len()])?;
        } else if d.packing {
            if let Some((ids, mask, seg)) = packer.add(e) {
                train.push(&ids, &mask, &seg)?;
            }
        } else {
            train.push(&e.ids, &e.mask, &vec![0; e.ids.len()])?;
        }
    }
    if let Some((ids, mask, seg)) = packer.flush() {
        train.push(&ids, &mask, &seg)?;
    }
    let train_seqs = train.finish(ctx.out, "train")?;
    let eval_seqs = eval.finish(ctx.out, "eval")?;
    let tokens: usize = encoded.iter().map(|e| e.ids.len()).sum();
    let stats = json!({
        "rows": rows + bad.len(),
        "used_rows": encoded.len(),
        "train_rows": encoded.len() - n_eval,
        "eval_rows": n_eval,
        "train_sequences": train_seqs,
        "eval_sequences": eval_seqs,
        "tokens": tokens,
        "prompt_tokens": encoded.iter().map(|e| e.prompt_tokens).sum::<usize>(),
        "response_tokens": encoded.iter().map(|e| e.response_tokens).sum::<usize>(),
        "truncated_rows": encoded.iter().filter(|e| e.truncated).count(),
        "dropped_rows": bad.len(),
        "dropped_reasons": bad.iter().take(5).map(|b| b.to_string()).collect::<Vec<_>>(),
        "longest_row": encoded.iter().map(|e| e.ids.len()).max().unwrap_or(0),
        "packing": d.packing,
        "format_version": crate::data::tokens::TOKENS_VERSION,
    });
    write_json(&ctx.out.join("stats.json"), &stats)?;
    ctx.ui.status(
        "tokenize",
        format!(
            "{} rows → {} train / {} eval, {tokens} tokens, {} truncated, {} dropped",
            rows + bad.len(),
            encoded.len() - n_eval,
            n_eval,
            stats["truncated_rows"],
            bad.len()
        ),
    );
    for b in bad.iter().take(3) {
        ctx.ui.warn(format!("dropped: {b}"));
    }
    Ok(stats)
}

/// Greedy packing of rows into sequences of at most `max` tokens; each row keeps its own
/// segment index so attention and positions never cross rows.
struct Packer {
    max: usize,
    ids: Vec<u32>,
    mask: Vec<u8>,
    seg: Vec<u16>,
}

type Packed = (Vec<u32>, Vec<u8>, Vec<u16>);

impl Packer {
    fn new(max: usize) -> Packer {
        Packer { max, ids: Vec::new(), mask: Vec::new(), seg: Vec::new() }
    }

    fn add(&mut self, e: &Encoded) -> Option<Packed> {
        let out = if !self.ids.is_empty() && self.ids.len() + e.ids.len() > self.max { self.flush() } else { None };
        // Neighbouring rows only need different indices, so wrapping is fine.
        let s = self.seg.last().map(|s| s.wrapping_add(1)).unwrap_or(0);
        self.ids.extend(&e.ids);
        self.mask.extend(&e.mask);
        self.seg.extend(std::iter::repeat_n(s, e.ids.len()));
        out
    }

    fn flush(&mut self) -> Option<Packed> {
        if self.ids.is_empty() {
            return None;
        }
        Some((std::mem::take(&mut self.ids), std::mem::take(&mut self.mask), std::mem::take(&mut self.seg)))
    }
}
