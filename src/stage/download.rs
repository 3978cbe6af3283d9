//! `download`: materialises the base model and the dataset as an artifact.
//!
//! Local files are copied in (so later stages read exactly the bytes that were fingerprinted);
//! a scratch model is created here: a tokenizer trained on the dataset and seeded random
//! weights. Hub sources are fetched into the shared HF cache at the commit the plan resolved
//! (every file checked against its digest) and hard-linked into the artifact, so a model is
//! stored once on disk.

use std::path::Path;

use serde_json::json;

use super::{StageCtx, StageError};
use crate::data::format::alpaca_prompt;
use crate::data::{DataError, Row, for_each_row};
use crate::model::{ModelError, ModelFolder};
use crate::plan::key::{Corpus, DatasetKey, DownloadKey, ModelKey, Source};
use crate::recipe::{DataFormat, Problem};

pub fn run(ctx: &StageCtx<'_>, key: &DownloadKey) -> Result<serde_json::Value, StageError> {
    let ds_out = ctx.out.join("dataset");
    let model_out = ctx.out.join("model");
    let mut fetched = serde_json::Map::new();
    // A Hub dataset's card may name configs: then only the chosen one's files are fetched.
    let config = match &key.settings.dataset {
        DatasetKey::Repo { config, .. } => Some(config.as_deref()),
        DatasetKey::Path { .. } => None,
    };
    for (name, source, dest, config) in
        [("model", &key.sources.model, &model_out, None), ("dataset", &key.sources.dataset, &ds_out, config)]
    {
        match source {
            Some(Source::Hub { source: src, commit }) => {
                let report = fetch_hub(ctx, src, commit, dest, config)?;
                fetched.insert(
                    name.to_string(),
                    json!({ "repo": src.repo.id, "revision": src.repo.revision, "commit": report.commit, "files": report.files.len() }),
                );
            }
            Some(local @ Source::Local { path, .. }) => {
                copy_source(path, dest)?;
                let copied = if path.is_dir() { dest.clone() } else { dest.join(path.file_name().unwrap_or_default()) };
                super::check_source(ctx, &copied, local)?;
            }
            None => {}
        }
    }
    std::fs::create_dir_all(&model_out).map_err(StageError::io("cannot create the model folder"))?;
    let model = match &key.settings.model {
        ModelKey::Scratch { scratch: spec, seed, corpus, .. } => {
            ctx.ui.status(
                "scratch",
                format!(
                    "training a {}-token tokenizer on the dataset, initialising {:?} weights",
                    spec.vocab_size, spec.arch
                ),
            );
            // Rows stream from the dataset through a bounded channel into the tokenizer trainer,
            // which keeps word counts, not texts: memory does not grow with the dataset.
            // The train split's rows only: no held-out split shapes the vocabulary.
            let at = ctx.spans.origin(&["dataset", "split"]).or_else(|| super::encode::dataset_origin(ctx));
            let files = crate::data::source::split_files(
                &ds_out,
                (corpus.split.as_deref(), corpus.config.as_deref()),
                &corpus.reading,
                at,
            )?;
            let (tx, rx) = std::sync::mpsc::sync_channel::<String>(1024);
            let (created, read) = std::thread::scope(|s| {
                let reader = s.spawn(|| {
                    let mut n = 0usize;
                    let r = for_each_row(
                        &files,
                        true,
                        &mut |row| {
                            if let Some(text) = corpus_text(&row, corpus) {
                                n += 1;
                                // The trainer hung up: it failed, and says why below.
                                tx.send(text)
                                    .map_err(|_| DataError::Invalid { message: "stopped".into(), help: None })?;
                            }
                            Ok(())
                        },
                        &mut |_| {},
                    );
                    drop(tx);
                    r.map(|skipped| (n, skipped))
                });
                let created = crate::model::scratch::create(&model_out, spec, rx.into_iter(), *seed);
                (created, reader.join().expect("the row reader does not panic"))
            });
            let cfg = created?;
            let (rows, skipped) = read?;
            if rows == 0 {
                // Only bad rows: said as tokenize says it; else no row has text.
                let (files, at) =
                    (super::encode::shown_files(&ds_out, &files.files), super::encode::dataset_origin(ctx));
                if skipped.count > 0 {
                    super::encode::check_rows(0, 0, &skipped, || files.clone(), at)?;
                }
                return Err(Problem::new(
                    "rtune::data::empty",
                    format!("the dataset {files} has no rows with text to train the scratch model's tokenizer on"),
                )
                .at(at, "this dataset")
                .help("check the dataset's path and `dataset.format` (the tokenizer learns the rows as the format renders them)")
                .into());
            }
            ctx.ui.status("scratch", format!("tokenizer trained on {rows} rows"));
            json!({ "source": "scratch", "arch": cfg.arch, "vocab_size": cfg.vocab_size, "layers": cfg.num_layers, "hidden_size": cfg.hidden_size })
        }
        ModelKey::Path { .. } => {
            let folder = checked_model(ctx, &model_out, key.sources.model.as_ref())?;
            json!({ "source": "path", "arch": folder.config.arch, "vocab_size": folder.config.vocab_size, "layers": folder.config.num_layers })
        }
        ModelKey::Repo { .. } => {
            let folder = checked_model(ctx, &model_out, key.sources.model.as_ref())?;
            json!({ "source": "hub", "hub": fetched.get("model"), "arch": folder.config.arch, "vocab_size": folder.config.vocab_size, "layers": folder.config.num_layers })
        }
    };
    let files = crate::store::walk(&ds_out).map_err(StageError::io("cannot list the dataset"))?;
    Ok(json!({ "model": model, "dataset": { "files": files.len(), "hub": fetched.get("dataset") } }))
}

/// The model folder copied to `copy`, read as far as later stages will: config.json, the
/// tokenizer and the safetensors headers (each file whole). A damaged or missing file is an error
/// here, naming it as the recipe names the model (`bm/model.safetensors`, not the cache's copy)
/// and pointing at the recipe's `model.path` or `model.repo` — not stages later.
fn checked_model(ctx: &StageCtx<'_>, copy: &Path, source: Option<&Source>) -> Result<ModelFolder, StageError> {
    let check = || -> Result<ModelFolder, ModelError> {
        let folder = ModelFolder::open(copy)?;
        folder.tokenizer()?;
        folder.stored()?;
        Ok(folder)
    };
    let (shown, at) = match source {
        Some(Source::Local { shown, at, .. }) => (shown.clone(), ctx.spans.origin(at)),
        Some(Source::Hub { source, .. }) => (source.repo.display(), ctx.spans.origin(&source.at)),
        None => return Ok(check()?),
    };
    let rename = |p: &str| match Path::new(p).strip_prefix(copy) {
        Ok(rest) if rest.as_os_str().is_empty() => shown.clone(),
        Ok(rest) => format!("{shown}/{}", rest.display()),
        Err(_) => p.to_string(),
    };
    let problem = match check() {
        Ok(folder) => return Ok(folder),
        Err(ModelError::BadFile { path, source }) => {
            Problem::new("rtune::model::bad_file", format!("cannot read `{}`: {source}", rename(&path)))
                .help("the file is damaged or not what its name says: copy or download it again")
        }
        Err(ModelError::MissingFile { dir, file }) => {
            Problem::new("rtune::model::missing_file", format!("model folder `{}` has no `{file}`", rename(&dir)))
                .help("a Hugging Face model folder holds config.json, *.safetensors and tokenizer.json")
        }
        Err(e) => return Err(e.into()),
    };
    Err(problem.at(at, "this model").into())
}

/// Fetch a Hub source at the planned commit into the HF cache (reused blobs re-verified), then
/// copy its files into `dest`. With `config` (a dataset), a card naming configs narrows the
/// files to that config's ([`config_files`]).
fn fetch_hub(
    ctx: &StageCtx<'_>,
    src: &crate::plan::HubSource,
    commit: &str,
    dest: &Path,
    config: Option<Option<&str>>,
) -> Result<crate::hub::DownloadReport, StageError> {
    let env = crate::hub::HubEnv::from_env(None, ctx.offline);
    let cache = crate::hub::HubCache::new(&env.cache_dir);
    let client = crate::hub::Client::new(env);
    let pinned = src.repo.with_revision(commit);
    let wanted = match config {
        Some(config) => config_files(ctx, (&client, &cache), &pinned, &src.wanted, config)?,
        None => src.wanted.clone(),
    };
    let report = crate::hub::snapshot(&client, &cache, &pinned, &wanted, ctx.ui)?;
    if report.commit != commit {
        return Err(StageError::Internal(format!("asked for {commit}, got {}", report.commit)));
    }
    // Record the named revision too, as huggingface_hub would.
    cache.write_ref(&src.repo, commit)?;
    if report.files.is_empty() {
        return Err(Problem::new(
            "rtune::hub::no_files",
            format!("{} has no files matching {}", src.repo.display(), src.wanted.include.join(", ")),
        )
        .at(ctx.spans.origin(&src.at), "this repository")
        .help("check the repository, or set `dataset.files` to the data files' patterns")
        .into());
    }
    for f in &report.files {
        let from = std::fs::canonicalize(report.snapshot.join(&f.path))
            .map_err(StageError::io(format!("cannot read `{}` in the HF cache", f.path)))?;
        let to = dest.join(&f.path);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(StageError::io(format!("cannot create `{}`", parent.display())))?;
        }
        // A copy, never a hard link: the store makes its objects read-only and trusts their
        // bytes, and a shared inode would let damage (or a permission change) in one cache reach
        // the other. Where the file system supports it the kernel copies by reflink.
        std::fs::copy(&from, &to).map_err(StageError::io(format!("cannot copy `{}`", f.path)))?;
    }
    ctx.ui.status("download", format!("{} at {}: {} files", src.repo.display(), &commit[..12], report.files.len()));
    Ok(report)
}

/// The files of a Hub dataset to fetch: where its card (README.md) names configs, the card and
/// the files of every split of `config` (the default config when None), as
/// `load_dataset(repo, name)` fetches them — a repository of many configs (or one whose `all`
/// config repeats the others) does not download every config's data for one. Otherwise every
/// file `wanted` matches. The card is fetched first; the repository's file list comes from the
/// Hub (or, offline, from the HF cache's record of the commit).
fn config_files(
    ctx: &StageCtx<'_>,
    (client, cache): (&crate::hub::Client, &crate::hub::HubCache),
    pinned: &crate::hub::RepoRef,
    wanted: &crate::hub::Wanted,
    config: Option<&str>,
) -> Result<crate::hub::Wanted, StageError> {
    const CARD: &str = crate::plan::CARD;
    if !wanted.wants(CARD) {
        return Ok(wanted.clone());
    }
    let names = if client.env.offline {
        cache.read_tree(pinned, &pinned.revision)
    } else {
        crate::hub::list_files(client, pinned)?.map(|l| l.files.into_keys().collect())
    };
    let Some(names) = names.filter(|n| n.iter().any(|f| f == CARD)) else { return Ok(wanted.clone()) };
    let card_only = crate::hub::Wanted { include: vec![CARD.into()], exclude: Vec::new() };
    let card = crate::hub::snapshot(client, cache, pinned, &card_only, ctx.ui)?;
    let path = card.snapshot.join(CARD);
    let text = std::fs::read_to_string(&path).map_err(StageError::io(format!("cannot read `{}`", path.display())))?;
    match crate::plan::config_wanted(&names, &text, wanted, config) {
        Ok(narrowed) => Ok(narrowed),
        Err(message) => {
            let (at, label) = match ctx.spans.origin(&["dataset", "config"]) {
                Some(at) => (Some(at), "this config"),
                None => (ctx.spans.origin(&["dataset", "repo"]), "this dataset"),
            };
            let help = Some(crate::data::source::CARD_HELP.into());
            Err(crate::data::source::located(DataError::Invalid { message, help }, at, label).into())
        }
    }
}

/// Copy a file (into `dest/<name>`) or a folder's files (into `dest/`), skipping hidden files.
fn copy_source(src: &Path, dest: &Path) -> Result<(), StageError> {
    std::fs::create_dir_all(dest).map_err(StageError::io(format!("cannot create `{}`", dest.display())))?;
    let pairs: Vec<(std::path::PathBuf, std::path::PathBuf)> = if src.is_dir() {
        crate::store::walk(src)
            .map_err(StageError::io(format!("cannot list `{}`", src.display())))?
            .into_iter()
            .filter(|rel| !rel.components().any(|c| c.as_os_str().to_string_lossy().starts_with('.')))
            .map(|rel| (src.join(&rel), dest.join(&rel)))
            .collect()
    } else {
        let name =
            src.file_name().ok_or_else(|| StageError::Internal(format!("`{}` has no file name", src.display())))?;
        vec![(src.to_path_buf(), dest.join(name))]
    };
    for (from, to) in pairs {
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(StageError::io(format!("cannot create `{}`", parent.display())))?;
        }
        std::fs::copy(&from, &to).map_err(StageError::io(format!("cannot copy `{}`", from.display())))?;
    }
    Ok(())
}

/// The text a scratch tokenizer learns from one row: the row as training will see it (the
/// Alpaca prompt and response, the text, or the conversation's contents).
fn corpus_text(r: &Row, corpus: &Corpus) -> Option<String> {
    let get = |k: &str| {
        let col = corpus.column_map.get(k).map(String::as_str).unwrap_or(k);
        r.fields.get(col).and_then(|v| v.as_str()).unwrap_or_default().to_string()
    };
    match corpus.format {
        DataFormat::Alpaca => Some(format!("{}{}", alpaca_prompt(&get("instruction"), &get("input")), get("output"))),
        DataFormat::Text => Some(get("text")).filter(|t| !t.is_empty()),
        DataFormat::Chat => {
            let msgs = crate::data::format::conversation(r, &corpus.column_map).ok()?;
            Some(msgs.iter().filter_map(|m| m["content"].as_str()).collect::<Vec<_>>().join("\n"))
        }
    }
}
