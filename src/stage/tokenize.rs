//! `tokenize`: dataset rows → a seeded train/eval split of token ids and loss masks, packed or
//! not, in the memory-mapped token store, with `stats.json`.

use serde_json::json;

use super::encode::{check_rows, dataset_origin, encode_each, shown_files};
use super::{StageCtx, StageError, write_json};
use crate::data::DataFiles;
use crate::data::source::split_files;
use crate::data::tokens::Packer;
use crate::data::{Encoded, TokenWriter};
use crate::model::ModelFolder;
use crate::plan::key::TokenizeKey;
use crate::rng::Rng;

pub fn run(ctx: &StageCtx<'_>, key: &TokenizeKey) -> Result<serde_json::Value, StageError> {
    let d = &key.settings;
    let folder = ModelFolder::open(&ctx.model_dir()?)?;
    let data_dir = ctx.input("dataset")?.join("dataset");
    // A folder's files of the train split (and of the eval split, when one is named).
    let at = |key: &str| ctx.spans.origin(&["dataset", key]).or_else(|| dataset_origin(ctx));
    let train_files = split_files(&data_dir, (d.split.as_deref(), d.config.as_deref()), &d.reading, at("split"))?;
    let eval_files = match &d.eval_split {
        Some(split) => Some(split_files(&data_dir, (Some(split), d.config.as_deref()), &d.reading, at("eval_split"))?),
        None => None,
    };
    if let (Some(eval), Some(eval_files)) = (&d.eval_split, &eval_files) {
        let train = (d.split.as_deref().unwrap_or("train"), &train_files.files[..]);
        crate::data::source::check_disjoint(&data_dir, train, (eval, &eval_files.files), at("eval_split"))?;
    }
    // Pass 1: every encoded row, in order (the train split's, then the eval split's), into a
    // scratch token store on disk; only counts stay in memory.
    let scratch = ctx.store.staging()?;
    let mut all = TokenWriter::create(scratch.path(), "all")?;
    let mut acc = Totals::default();
    let mut encode = |files: &DataFiles, acc: &mut Totals| {
        encode_each(ctx, &d.rendering, &folder, files, &mut |e| {
            acc.add(&e);
            all.push(&e.ids, &e.mask, &vec![0; e.ids.len()])?;
            Ok(())
        })
    };
    let (mut bad, mut rows) = encode(&train_files, &mut acc)?;
    let used = acc.rows;
    check_rows(rows, used, &bad, || shown_files(&data_dir, &train_files.files), dataset_origin(ctx))?;
    let own_eval = match &eval_files {
        Some(files) => {
            let (eval_bad, eval_rows) = encode(files, &mut acc)?;
            let name = || format!("split `{}`", d.eval_split.as_deref().unwrap_or_default());
            check_rows(eval_rows, acc.rows - used, &eval_bad, name, at("eval_split"))?;
            rows += eval_rows;
            bad.count += eval_bad.count;
            bad.first.extend(eval_bad.first);
            Some(acc.rows - used)
        }
        None => None,
    };
    all.finish(scratch.path(), "all")?;
    let used = acc.rows;
    let mut is_eval = vec![false; used];
    let n_eval = match own_eval {
        Some(n) => {
            // The eval split's rows, after the train split's.
            is_eval[used - n..].fill(true);
            n
        }
        None => {
            // Seeded split by row.
            let mut order: Vec<usize> = (0..used).collect();
            Rng::derive(d.seed, "split").shuffle(&mut order);
            let mut held = (used as f64 * d.eval_fraction).round() as usize;
            if d.eval_fraction > 0.0 && used > 1 {
                held = held.clamp(1, used - 1);
            }
            for &i in &order[..held] {
                is_eval[i] = true;
            }
            held
        }
    };
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
    // The folder's splits that neither train nor evaluate, said so that none is missed.
    let unread: Vec<_> = train_files.unread.iter().filter(|(name, _)| Some(name) != d.eval_split.as_ref()).collect();
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
        "split": d.split,
        "eval_split": d.eval_split,
        "unread_splits": unread.iter().map(|(name, files)| (name.clone(), json!(files.len()))).collect::<serde_json::Map<_, _>>(),
        "format_version": crate::data::tokens::TOKENS_VERSION,
    });
    write_json(&ctx.out.join("stats.json"), &stats)?;
    ctx.ui.status(
        "tokenize",
        format!(
            "{} rows → {} train / {} eval, {} tokens, {} truncated, {} dropped{}",
            rows,
            used - n_eval,
            n_eval,
            acc.tokens,
            acc.truncated,
            bad.count,
            splits_said(d.split.as_deref(), d.eval_split.as_deref(), &unread),
        ),
    );
    for b in bad.first.iter().take(3) {
        ctx.ui.warn(format!("dropped: {b}"));
    }
    Ok(stats)
}

/// ` (split `train`, eval split `test`; not read: `validation` (1 file))`, for a folder's splits.
fn splits_said(split: Option<&str>, eval: Option<&str>, unread: &[&(String, Vec<String>)]) -> String {
    let Some(split) = split else { return String::new() };
    let mut said = format!(" (split `{split}`");
    if let Some(eval) = eval {
        said += &format!(", eval split `{eval}`");
    }
    if !unread.is_empty() {
        said += &format!("; not read: {}", crate::data::splits::describe(unread.iter().copied()));
    }
    said + ")"
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
