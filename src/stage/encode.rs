//! Dataset rows → encoded token sequences, streamed in parallel chunks: shared by `tokenize`
//! and by an `evaluate` stage that tokenizes its own dataset.

use super::{StageCtx, StageError};
use crate::data::{DataError, DataFiles, Encoded, Renderer, Row, Skipped, for_each_row, total_bytes};
use crate::model::ModelFolder;
use crate::plan::key::Rendering;
use crate::recipe::{Origin, Problem};

const CHUNK: usize = 2048;

/// Read `files` (from [`crate::data::data_files`]) and encode every row with `[dataset]`'s format and the
/// model's tokenizer, streaming: rows are read, encoded (in parallel chunks) and handed to
/// `each` one chunk at a time, so memory does not grow with the dataset. Returns the rows
/// skipped as bad (when `skip_bad_rows`; else the first is the error) and the dataset's rows,
/// bad ones included (each counted once, whether the reader or the renderer refused it).
pub fn encode_each(
    ctx: &StageCtx<'_>,
    d: &Rendering,
    folder: &ModelFolder,
    files: &DataFiles,
    each: &mut dyn FnMut(Encoded) -> Result<(), StageError>,
) -> Result<(Skipped, usize), StageError> {
    let tokenizer = folder.tokenizer()?;
    let chat = match d.format {
        crate::recipe::DataFormat::Chat => Some(
            crate::data::chat::ChatTemplate::for_model(folder, d.chat_template.as_deref())?
                .with_kwargs(&d.chat_template_kwargs),
        ),
        _ => None,
    };
    let renderer = Renderer {
        tokenizer: &tokenizer,
        format: d.format,
        bos: folder.row_bos(&tokenizer),
        eos: folder.config.eos_token_ids.first().copied(),
        max_seq_len: d.max_seq_len,
        truncate: d.truncate,
        train_on_prompt: d.train_on_prompt,
        column_map: &d.column_map,
        chat: chat.as_ref(),
    };
    let mut bar = ctx.ui.bar("tokenize", total_bytes(&files.files));
    let (mut rows, mut bad) = (0usize, Skipped::default());
    let mut chunk: Vec<Row> = Vec::with_capacity(CHUNK);
    let mut failure: Option<StageError> = None;
    let mut flush = |chunk: &mut Vec<Row>, bad: &mut Skipped| -> Result<(), StageError> {
        for r in renderer.encode(chunk)? {
            match r {
                Ok(e) => each(e)?,
                Err(e) if d.skip_bad_rows => bad.push(e),
                Err(e) => return Err(e.into()),
            }
        }
        chunk.clear();
        Ok(())
    };
    let pos = std::cell::Cell::new(0u64);
    let read = for_each_row(
        files,
        d.skip_bad_rows,
        &mut |row| {
            rows += 1;
            chunk.push(row);
            if chunk.len() == CHUNK {
                if let Err(e) = flush(&mut chunk, &mut bad) {
                    failure = Some(e);
                    return Err(DataError::Invalid { message: "stopped".into(), help: None });
                }
                bar.set(pos.get(), "bytes");
            }
            Ok(())
        },
        &mut |n| pos.set(n),
    );
    if let Some(e) = failure {
        return Err(e);
    }
    let skipped = read?;
    flush(&mut chunk, &mut bad)?;
    bar.finish();
    // `rows` counts what the reader handed on, the renderer's bad rows among them.
    let total = rows + skipped.count;
    // Rows the reader rejected come before those the renderer did, as they were read.
    let mut all = skipped;
    all.count += bad.count;
    all.first.extend(bad.first);
    Ok((all, total))
}

/// [`encode_each`], collected (for small datasets: evaluate's own data), which the recipe names
/// as `name` at `at`.
pub fn encode_dataset(
    ctx: &StageCtx<'_>,
    d: &Rendering,
    folder: &ModelFolder,
    files: &DataFiles,
    (name, at): (&str, Option<&Origin>),
) -> Result<(Vec<Encoded>, Vec<DataError>, usize), StageError> {
    let mut encoded = Vec::new();
    let (bad, rows) = encode_each(ctx, d, folder, files, &mut |e| {
        encoded.push(e);
        Ok(())
    })?;
    check_rows(rows, encoded.len(), &bad, || name.to_string(), at)?;
    Ok((encoded, bad.first, rows))
}

/// A dataset with no rows, or with every row dropped, is an error, naming the dataset as `name()`
/// says (asked only then) and located where the recipe names it (`at`).
pub fn check_rows(
    rows: usize,
    used: usize,
    bad: &Skipped,
    name: impl FnOnce() -> String,
    at: Option<&Origin>,
) -> Result<(), StageError> {
    if used > 0 {
        return Ok(());
    }
    let name = name();
    if rows == 0 && bad.count == 0 {
        return Err(Problem::new("rtune::data::empty", format!("the dataset {name} has no rows"))
            .at(at, "this dataset")
            .help("check the dataset's path and `dataset.format`")
            .into());
    }
    let mut p = Problem::new(
        "rtune::data::all_dropped",
        format!("every row of the dataset {name} was dropped ({} bad rows)", bad.count),
    )
    .at(at, "this dataset");
    if let Some(first) = bad.first.first() {
        p = p.help(format!("the first: {first}"));
    }
    Err(p.into())
}

/// Where the recipe names its dataset (`dataset.path` or `dataset.repo`).
pub fn dataset_origin<'a>(ctx: &StageCtx<'a>) -> Option<&'a Origin> {
    ctx.spans.origin(&["dataset", "path"]).or_else(|| ctx.spans.origin(&["dataset", "repo"]))
}

/// A dataset's data `files` (of folder `dir`) as the recipe's user knows them: `` `a.jsonl` ``,
/// or the first few of many (relative to the folder).
pub fn shown_files(dir: &std::path::Path, files: &[std::path::PathBuf]) -> String {
    let shown = |f: &std::path::PathBuf| format!("`{}`", f.strip_prefix(dir).unwrap_or(f).display());
    let mut names: Vec<String> = files.iter().take(3).map(shown).collect();
    if files.len() > 3 {
        names.push(format!("{} more", files.len() - 3));
    }
    if names.is_empty() { "(an empty folder)".to_string() } else { names.join(", ") }
}
