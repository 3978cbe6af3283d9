//! `tokenize`: dataset rows → a seeded train/eval split of token ids and loss masks, packed or
//! not, in the memory-mapped token store, with `stats.json`.

use serde_json::json;

use super::encode::{check_rows, dataset_origin, encode_each, shown_files};
use super::{StageCtx, StageError, write_json};
use crate::data::tokens::Packer;
use crate::data::{Encoded, TokenWriter};
use crate::model::ModelFolder;
use crate::plan::key::TokenizeKey;
use crate::rng::Rng;

pub fn run(ctx: &StageCtx<'_>, key: &TokenizeKey) -> Result<serde_json::Value, StageError> {
    let d = &key.settings;
    let folder = ModelFolder::open(&ctx.model_dir()?)?;
    let data_dir = ctx.input("dataset")?.join("dataset");
    // Pass 1: every encoded row, in order, into a scratch token store on disk; only counts
    // stay in memory.
    let scratch = ctx.store.staging()?;
    let mut all = TokenWriter::create(scratch.path(), "all")?;
    let mut acc = Totals::default();
    let (bad, rows) = encode_each(ctx, &d.rendering, &folder, &data_dir, &mut |e| {
        acc.add(&e);
        all.push(&e.ids, &e.mask, &vec![0; e.ids.len()])?;
        Ok(())
    })?;
    all.finish(scratch.path(), "all")?;
    let used = acc.rows;
    check_rows(rows, used, &bad, || shown_files(&data_dir), dataset_origin(ctx))?;
    // Seeded split by row.
    let mut order: Vec<usize> = (0..used).collect();
    Rng::derive(d.seed, "split").shuffle(&mut order);
    let mut n_eval = (used as f64 * d.eval_fraction).round() as usize;
    if d.eval_fraction > 0.0 && used > 1 {
        n_eval = n_eval.clamp(1, used - 1);
    }
    let mut is_eval = vec![false; used];
    for &i in &order[..n_eval] {
        is_eval[i] = true;
    }
    drop(order);
    // Pass 2: read the scratch store back in order (sequentially, not mapped, so the pages
    // do not stay resident) into the train and eval splits, packing train rows.
    let mut train = TokenWriter::create(ctx.out, "train")?;
    let mut eval = TokenWriter::create(ctx.out, "eval")?;
    let mut packer = Packer::new(d.rendering.max_seq_len);
    let mut reader = crate::data::tokens::SequentialReader::open(scratch.path(), "all")?;
    for ev in &is_eval {
        let (ids, mask) = reader.next_row()?;
        if *ev {
            eval.push(&ids, &mask, &vec![0; ids.len()])?;
        } else if d.packing {
            if let Some((ids, mask, seg)) = packer.add(&ids, &mask) {
                train.push(&ids, &mask, &seg)?;
            }
        } else {
            train.push(&ids, &mask, &vec![0; ids.len()])?;
        }
    }
    if let Some((ids, mask, seg)) = packer.flush() {
        train.push(&ids, &mask, &seg)?;
    }
    drop(reader);
    drop(scratch);
    let train_seqs = train.finish(ctx.out, "train")?;
    let eval_seqs = eval.finish(ctx.out, "eval")?;
    let stats = json!({
        "rows": rows,
        "used_rows": used,
        "train_rows": used - n_eval,
        "eval_rows": n_eval,
        "train_sequences": train_seqs,
        "eval_sequences": eval_seqs,
        "tokens": acc.tokens,
        "prompt_tokens": acc.prompt_tokens,
        "response_tokens": acc.response_tokens,
        "truncated_rows": acc.truncated,
        "dropped_rows": bad.count,
        "dropped_reasons": bad.first.iter().take(5).map(|b| b.to_string()).collect::<Vec<_>>(),
        "longest_row": acc.longest,
        "packing": d.packing,
        "format_version": crate::data::tokens::TOKENS_VERSION,
    });
    write_json(&ctx.out.join("stats.json"), &stats)?;
    ctx.ui.status(
        "tokenize",
        format!(
            "{} rows → {} train / {} eval, {} tokens, {} truncated, {} dropped",
            rows,
            used - n_eval,
            n_eval,
            acc.tokens,
            acc.truncated,
            bad.count
        ),
    );
    for b in bad.first.iter().take(3) {
        ctx.ui.warn(format!("dropped: {b}"));
    }
    Ok(stats)
}

/// Running totals of the encoded rows, for stats.json.
#[derive(Default)]
struct Totals {
    rows: usize,
    tokens: usize,
    prompt_tokens: usize,
    response_tokens: usize,
    truncated: usize,
    longest: usize,
}

impl Totals {
    fn add(&mut self, e: &Encoded) {
        self.rows += 1;
        self.tokens += e.ids.len();
        self.prompt_tokens += e.prompt_tokens;
        self.response_tokens += e.response_tokens;
        self.truncated += usize::from(e.truncated);
        self.longest = self.longest.max(e.ids.len());
    }
}
