//! The sources a recipe reads: local files and folders by content digest, Hub repos by the commit
//! their revision resolves to (online, or from the HF cache and rtune.lock), and the offline
//! pre-flight that lists every file missing from the HF cache at once.

use std::collections::BTreeSet;

use serde_json::{Value, json};

use super::key;
use crate::fingerprint;
use crate::hub::{HubEnv, RepoKind, RepoRef};
use crate::recipe::{LoadedRecipe, Problem};

/// The content digest of a local source file or folder named at `at` in the recipe.
fn local_digest(loaded: &LoadedRecipe, what: &str, rel: &str, at: &[&str]) -> Result<String, Problem> {
    let path = loaded.resolve_path(rel);
    fingerprint::digest_path(&path).map_err(|e| {
        Problem::new("rtune::source::unreadable", format!("cannot read {what} `{}`: {e}", path.display()))
            .at(loaded.origin(at), "this path")
            .help("paths are relative to the recipe's folder")
    })
}

/// A local source named at `at` in the recipe, by content.
pub(super) fn local_source(loaded: &LoadedRecipe, what: &str, rel: &str, at: &[&str]) -> Result<key::Source, Problem> {
    Ok(key::Source::Local {
        digest: local_digest(loaded, what, rel, at)?,
        path: loaded.resolve_path(rel),
        shown: rel.to_string(),
        at: at.iter().map(|s| s.to_string()).collect(),
    })
}

/// A local dataset named at `at` ([`local_source`]): one without data — an empty file, or a folder
/// without a data file in it — is an error here, before any stage runs.
pub(super) fn dataset_source(loaded: &LoadedRecipe, rel: &str, at: &[&str]) -> Result<key::Source, Problem> {
    let source = local_source(loaded, "dataset", rel, at)?;
    let path = loaded.resolve_path(rel);
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    if path.is_file() && !crate::data::source::supported(&name) {
        return Err(Problem::new("rtune::data::unsupported", format!("`{rel}` is not a file rtune reads as data"))
            .at(loaded.origin(at), "this dataset")
            .help(format!("a dataset is a {} file, or a folder holding them", crate::data::source::FORMATS)));
    }
    let files = crate::data::data_files(&path, None, None).map(|f| f.files).unwrap_or_default();
    if crate::data::total_bytes(&files) == 0 {
        return Err(Problem::new("rtune::data::empty", format!("the dataset `{rel}` is empty"))
            .at(loaded.origin(at), "this dataset")
            .help(format!("a dataset is a {} file, or a folder holding them", crate::data::source::FORMATS)));
    }
    Ok(source)
}

/// A Hub repo a recipe reads, with the files wanted from it.
#[derive(Debug, Clone)]
pub struct HubSource {
    pub repo: RepoRef,
    pub wanted: crate::hub::Wanted,
    /// Where the recipe names it, for diagnostics.
    pub at: [&'static str; 2],
}

/// The files of a model repo rtune needs: config, tokenizer, safetensors weights (and index).
pub const MODEL_FILES: [&str; 4] = ["*.json", "*.safetensors", "tokenizer.model", "*.txt"];
/// Default dataset files.
pub const DATASET_FILES: [&str; 6] = ["*.jsonl", "*.json", "*.csv", "*.tsv", "*.txt", "*.parquet"];

pub fn hub_sources(loaded: &LoadedRecipe) -> Vec<(&'static str, HubSource)> {
    let r = &loaded.recipe;
    let mut out = Vec::new();
    // Ids and revisions were checked when the recipe loaded.
    if let Some(id) = &r.model.repo
        && let Ok(repo) = RepoRef::new(id, RepoKind::Model, r.model.revision.as_deref())
    {
        let include = MODEL_FILES.iter().map(|s| s.to_string()).collect();
        let wanted = crate::hub::Wanted { include, exclude: vec![] };
        out.push(("model", HubSource { repo, wanted, at: ["model", "repo"] }));
    }
    if let Some(id) = &r.dataset.repo
        && let Ok(repo) = RepoRef::new(id, RepoKind::Dataset, r.dataset.revision.as_deref())
    {
        // The dataset card too, whose `configs:` may say which files each split holds — unless
        // `files` names the files instead (as `data_files=` overrides the card in datasets).
        let mut include: Vec<String> = match &r.dataset.files {
            Some(files) => files.clone(),
            None => DATASET_FILES.iter().map(|s| s.to_string()).collect(),
        };
        if r.dataset.files.is_none() || r.dataset.config.is_some() {
            include.push("README.md".into());
        }
        let exclude = vec!["dataset_info*.json".into(), "dataset_infos.json".into(), ".*".into()];
        out.push((
            "dataset",
            HubSource { repo, wanted: crate::hub::Wanted { include, exclude }, at: ["dataset", "repo"] },
        ));
    }
    out
}

/// The commit a Hub source's revision is at: fixed for a commit id; else asked of the Hub,
/// falling back (unreachable or offline) to the HF cache's ref, then to rtune.lock.
pub(super) fn resolve_hub(
    loaded: &LoadedRecipe,
    hub: &HubEnv,
    src: &HubSource,
    locked: Option<&Value>,
) -> Result<String, Problem> {
    if crate::hub::is_commit(&src.repo.revision) {
        return Ok(src.repo.revision.clone());
    }
    let cache = crate::hub::HubCache::new(&hub.cache_dir);
    let from_lock = || {
        locked
            .filter(|l| l["hub"] == json!(src.repo.id) && l["revision"] == json!(src.repo.revision))
            .and_then(|l| l["commit"].as_str())
            // A lock file is an input like any other: only a commit id is believed (it is
            // printed in commands to paste and used in URLs).
            .filter(|c| crate::hub::is_commit(c))
            .map(str::to_string)
    };
    let offline_fallback = || cache.resolve(&src.repo).map(|s| s.commit).or_else(from_lock);
    if hub.offline {
        return offline_fallback().ok_or_else(|| {
            Problem::new(
                "rtune::hub::offline_missing",
                format!(
                    "offline, and `{}` is not in the Hugging Face cache ({})",
                    src.repo.display(),
                    hub.cache_dir.display()
                ),
            )
            .at(loaded.origin(&src.at), "not cached")
            .help(format!(
                "on a machine with access, run: {}",
                crate::hub::download_command(&src.repo, &src.wanted.include)
            ))
        });
    }
    // With a commit to fall back to, one try (a plan stays quick while the Hub is down);
    // without one, a second try (one dropped connection should not fail the plan, and a
    // machine without a network waits one backoff, not all of them).
    let fallback = offline_fallback();
    let attempts = if fallback.is_some() { 1 } else { hub.attempts.min(2) };
    let client = crate::hub::Client::new(HubEnv { attempts, ..hub.clone() });
    let located = |e: &crate::hub::HubError| hub_problem(e).at(loaded.origin(&src.at), "this repository");
    match crate::hub::resolve_commit(&client, &src.repo) {
        Ok(c) => Ok(c),
        Err(e @ crate::hub::HubError::Unreachable { .. }) => fallback.ok_or_else(|| located(&e)),
        Err(e) => Err(located(&e)),
    }
}

/// A Hub error as a recipe problem (to be located at the recipe key it concerns).
pub fn hub_problem(e: &crate::hub::HubError) -> Problem {
    use miette::Diagnostic;
    let mut p = Problem::new(e.static_code(), e.to_string());
    if let Some(h) = e.help() {
        p = p.help(h.to_string());
    }
    p
}

/// A dataset card's file name.
pub const CARD: &str = "README.md";

/// The files of a Hub dataset to fetch, of the repository's files `names`, as its card (text
/// `card`) says: where the card names configs, the card and the files of every split of
/// `config` (the default config when None) among those `wanted` matches — as
/// `load_dataset(repo, name)` fetches them; otherwise `wanted` as it is. `Err` says why the card
/// cannot be read as asked.
pub fn config_wanted(
    names: &[String],
    card: &str,
    wanted: &crate::hub::Wanted,
    config: Option<&str>,
) -> Result<crate::hub::Wanted, String> {
    // The data files the card's patterns choose among, as a local folder's.
    let data: Vec<String> =
        names.iter().filter(|n| wanted.wants(n) && crate::data::source::is_data_file(n)).cloned().collect();
    Ok(match crate::data::configs::card_splits(Some(card), &data, config)? {
        None => wanted.clone(),
        Some((splits, _)) => {
            let mut include = vec![CARD.to_string()];
            include.extend(splits.iter().flat_map(|(_, files)| files).map(|f| crate::glob::escape(f)));
            crate::hub::Wanted { include, exclude: wanted.exclude.clone() }
        }
    })
}

/// Offline pre-flight: every file a download stage needs must be in the HF cache. Lists all
/// missing files at once, with the command that would fetch them.
pub(super) fn offline_preflight(loaded: &LoadedRecipe, hub: &HubEnv, sources: &key::Sources) -> Result<(), Problem> {
    let cache = crate::hub::HubCache::new(&hub.cache_dir);
    let mut missing: Vec<String> = Vec::new();
    let mut commands: Vec<String> = Vec::new();
    let mut first_at = None;
    for (key, source) in [("model", &sources.model), ("dataset", &sources.dataset)] {
        let Some(key::Source::Hub { source: src, commit }) = source else { continue };
        let commit = commit.as_str();
        let pinned = src.repo.with_revision(commit);
        let snap = cache.resolve(&pinned);
        let files: Vec<String> = snap
            .as_ref()
            .map(|s| cache.files(s))
            .unwrap_or_default()
            .into_iter()
            .filter(|f| src.wanted.wants(f))
            .collect();
        let mut lacking: Vec<String> = Vec::new();
        // A dataset's cached card narrows what it needs to its config's files, as the download
        // stage does (a card that cannot be read so is the download stage's error to give).
        let wanted = match (key, &snap, cache.read_tree(&pinned, commit)) {
            ("dataset", Some(snap), Some(names)) if src.wanted.wants(CARD) => {
                std::fs::read_to_string(snap.dir.join(CARD))
                    .ok()
                    .and_then(|card| {
                        config_wanted(&names, &card, &src.wanted, loaded.recipe.dataset.config.as_deref()).ok()
                    })
                    .unwrap_or_else(|| src.wanted.clone())
            }
            _ => src.wanted.clone(),
        };
        // The exact listing huggingface_hub or rtune saved when it was online, if there is one.
        if let Some(missing) = cache.missing(&pinned, commit, &wanted, &files) {
            lacking = missing;
        } else if key == "model" {
            for need in ["config.json", "tokenizer.json"] {
                if !files.iter().any(|f| f == need) {
                    lacking.push(need.into());
                }
            }
            if let Some(snap) = &snap
                && let Ok(text) = std::fs::read_to_string(snap.dir.join("model.safetensors.index.json"))
                && let Ok(index) = serde_json::from_str::<Value>(&text)
            {
                let shards: BTreeSet<&str> =
                    index["weight_map"].as_object().into_iter().flatten().filter_map(|(_, v)| v.as_str()).collect();
                lacking.extend(shards.into_iter().filter(|s| !files.iter().any(|f| f == s)).map(str::to_string));
            } else if !files.iter().any(|f| f.ends_with(".safetensors")) {
                lacking.push("*.safetensors".into());
            }
        } else if files.is_empty() {
            lacking.push(src.wanted.include.join(", "));
        }
        if !lacking.is_empty() {
            first_at.get_or_insert(src.at);
            commands.push(crate::hub::download_command(&src.repo.with_revision(commit), &wanted.include));
            missing.extend(lacking.into_iter().map(|f| format!("{}: {f}", src.repo.id)));
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(Problem::new(
        "rtune::hub::offline_missing",
        format!("offline, and {} file(s) are not in the Hugging Face cache: {}", missing.len(), missing.join("; ")),
    )
    .at(first_at.and_then(|at| loaded.origin(&at)), "needs these files")
    .help(format!("on a machine with access (same HF_HOME), run:\n{}", commands.join("\n"))))
}

/// The split of an evaluate stage's own local dataset `rel` (named at `at`) to read, checked
/// before any stage runs: for a file, none (a file is one split, with no config: naming one, at
/// `split_at` or `config_at`, is an error); for a folder, `split` (named at `split_at`) of its
/// card's `config` (named at `config_at`; the default config when None, or the files' names
/// without configs), which must name it, or when not named the folder's one split.
pub(super) fn local_split(
    loaded: &LoadedRecipe,
    rel: &str,
    at: &[&str],
    (split, split_at): (Option<&str>, &[&str]),
    (config, config_at): (Option<&str>, &[&str]),
) -> Result<Option<String>, Problem> {
    let path = loaded.resolve_path(rel);
    if !path.is_dir() {
        if let Some(c) = config {
            return Err(Problem::new(
                "rtune::plan::split_of_file",
                format!("`{rel}` is a file, which has no config `{c}`"),
            )
            .at(loaded.origin(config_at), "a config")
            .help("point the dataset at the folder whose README.md names the configs, or drop the config"));
        }
        return match split {
            Some(s) => Err(split_of_file(rel, s).at(loaded.origin(split_at), "a split")),
            None => Ok(None),
        };
    }
    let (splits, _) = crate::data::source::folder_splits(&path, config)
        .map_err(|e| crate::data::source::located(e, loaded.origin(config_at).or(loaded.origin(at)), "this dataset"))?;
    match (split, &splits[..]) {
        (Some(s), _) => {
            named_split(&splits, s, loaded.origin(split_at).or(loaded.origin(at)))?;
            Ok(Some(s.to_string()))
        }
        (None, [(one, _)]) => Ok(Some(one.clone())),
        (None, _) => Err(Problem::new(
            "rtune::plan::which_split",
            format!("the files of `{rel}` name several splits: {}", crate::data::splits::describe(&splits)),
        )
        .at(loaded.origin(at), "this dataset")
        .help(format!(
            "name the one to read: `{} = \"{}\"`",
            split_at.join("."),
            // A held-out split is what an evaluation usually wants.
            splits.iter().map(|(name, _)| name).find(|n| *n != "train").unwrap_or(&splits[0].0)
        ))),
    }
}

/// A split named for the single file `rel`, which is one split.
fn split_of_file(rel: &str, split: &str) -> Problem {
    Problem::new(
        "rtune::plan::split_of_file",
        format!("`{rel}` is a file, which is one split: it has no split `{split}`"),
    )
    .help("point the path at the folder that holds the split's files, or drop the split")
}

/// The files of split `name` among a folder's `splits`; a split they do not hold is a problem
/// located at `at`.
fn named_split<'s>(
    splits: &'s crate::data::splits::Splits,
    name: &str,
    at: Option<&crate::recipe::Origin>,
) -> Result<&'s [String], Problem> {
    match splits.iter().find(|(n, _)| n == name) {
        Some((_, files)) => Ok(files),
        None => {
            let e = crate::data::DataError::NoSplit { split: name.to_string(), found: splits.clone() };
            Err(crate::data::source::located(e, at, "this split"))
        }
    }
}

/// The loader settings the recipe sets over the dataset card's.
pub(super) fn loader_settings(d: &crate::recipe::Dataset) -> crate::data::configs::Overrides {
    crate::data::configs::Overrides { sep: d.sep.clone(), field: d.field.clone(), sample_by: d.sample_by }
}

/// `dataset.split` and `dataset.eval_split` against the dataset, before any stage runs: the eval
/// split is not beside `eval_fraction` nor the train split itself, and for a local folder both are
/// splits its files (or its card's config) name, without a file in common. The folder is read once.
pub(super) fn check_dataset_splits(loaded: &LoadedRecipe) -> Result<(), Problem> {
    let d = &loaded.recipe.dataset;
    let origin = |key: &str| loaded.origin(&["dataset", key]);
    if d.eval_split.is_some() && origin("eval_fraction").is_some() {
        return Err(Problem::new(
            "rtune::plan::eval_split",
            "`dataset.eval_split` and `dataset.eval_fraction` both choose the eval rows",
        )
        .at(origin("eval_fraction"), "a share of the train split")
        .help("keep one: the dataset's own eval split, or a share held out of the train split"));
    }
    // The recipe's loader settings, located at the one that cannot apply.
    if let Err((key, message)) = loader_settings(d).apply(Default::default()) {
        return Err(Problem::new("rtune::data::invalid", message)
            .at(origin(key), "this setting")
            .help("rtune reads a literal separator: one character, or a string that matches only itself"));
    }
    let train = d.split.as_deref().unwrap_or("train");
    if d.eval_split.as_deref() == Some(train) {
        return Err(Problem::new("rtune::plan::eval_split", format!("split `{train}` would both train and evaluate"))
            .at(origin("eval_split"), "the eval split")
            .help("evaluate on another split (`validation`, `test`), or hold rows out with `dataset.eval_fraction`"));
    }
    let Some(rel) = &d.path else { return Ok(()) };
    let path = loaded.resolve_path(rel);
    if !path.is_dir() {
        if let Some(c) = &d.config {
            return Err(Problem::new(
                "rtune::plan::split_of_file",
                format!("`{rel}` is a file, which has no config `{c}`"),
            )
            .at(origin("config"), "a config")
            .help("point the path at the folder whose README.md names the configs, or drop the config"));
        }
        for key in ["split", "eval_split"] {
            let named = if key == "split" { &d.split } else { &d.eval_split };
            if let Some(s) = named {
                return Err(split_of_file(rel, s).at(origin(key), "a split"));
            }
        }
        return Ok(());
    }
    // The dataset card's configs first, located at the config the recipe names.
    let (splits, _) = crate::data::source::folder_splits(&path, d.config.as_deref())
        .map_err(|e| crate::data::source::located(e, origin("config").or(origin("path")), "this dataset"))?;
    let train_files = named_split(&splits, train, origin("split").or(origin("path")))?;
    if let Some(eval) = &d.eval_split {
        let eval_files = named_split(&splits, eval, origin("eval_split").or(origin("path")))?;
        let paths = |files: &[String]| files.iter().map(|f| path.join(f)).collect::<Vec<_>>();
        let (train_paths, eval_paths) = (paths(train_files), paths(eval_files));
        crate::data::source::check_disjoint(&path, (train, &train_paths), (eval, &eval_paths), origin("eval_split"))?;
    }
    Ok(())
}
