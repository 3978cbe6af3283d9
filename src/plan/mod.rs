//! Plans: which stages run, on what device, with which fingerprint, and why.
//!
//! Planning reads the recipe, the lock file and the store's manifests; it never loads a model,
//! so `rtune plan` answers in milliseconds.

pub mod lockfile;
mod render;

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::{Value, json};

pub use lockfile::{LockFile, LockedStage};
pub use render::{render_dot, render_text};

use crate::destination::Verdict;
use crate::device::{self, Inventory, Resolution};
use crate::fingerprint::{self, FINGERPRINT_VERSION};
use crate::hub::{HubEnv, RepoKind, RepoRef};
use crate::recipe::stages::Port;
use crate::recipe::{
    EvaluateSettings, LoadedRecipe, Problem, QuantizeSettings, StageKind, StageSpec, TrainSettings, UploadSettings,
};
use crate::store::Store;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// A committed artifact with this fingerprint exists and passes a quick check.
    Cached,
    /// The stage will run.
    Run,
    /// The artifact is cached, but the files it put outside the store (an upload's
    /// destination) are missing or changed: they are copied again from the store.
    Restore,
    /// Not selected by `--only`.
    Skip,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Cached => "cached",
            Action::Run => "run",
            Action::Restore => "restore",
            Action::Skip => "skip",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PlannedStage {
    pub name: String,
    pub kind: StageKind,
    pub needs: Vec<String>,
    pub implicit: bool,
    /// Whether the stage's numbers depend on the device (then device and dtype are fingerprinted).
    pub uses_device: bool,
    /// What was hashed into the fingerprint.
    pub doc: Value,
    pub fingerprint: String,
    pub action: Action,
    pub reason: String,
}

impl PlannedStage {
    pub fn short(&self) -> &str {
        fingerprint::short(&self.fingerprint)
    }

    /// The resolved settings of this stage.
    pub fn settings(&self) -> &Value {
        &self.doc["settings"]
    }

    /// Input fingerprints by port name.
    pub fn input(&self, port: &str) -> Option<&str> {
        self.doc["inputs"][port].as_str()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub recipe: String,
    pub device: Resolution,
    pub threads: usize,
    /// Hub sources resolve from the HF cache only.
    pub offline: bool,
    pub stages: Vec<PlannedStage>,
}

impl Plan {
    pub fn stage(&self, name: &str) -> Option<&PlannedStage> {
        self.stages.iter().find(|s| s.name == name)
    }
}

/// Stage selection from the command line.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub only: Option<String>,
    pub from: Option<String>,
    pub force: Vec<String>,
    /// Never use the network: Hub sources resolve from the HF cache (also `HF_HUB_OFFLINE=1`).
    pub offline: bool,
}

pub fn port_name(p: Port) -> &'static str {
    match p {
        Port::Model => "model",
        Port::Dataset => "dataset",
        Port::Tokens => "tokens",
        Port::Weights => "weights",
        Port::Exports => "exports",
    }
}

/// Make the plan of a loaded recipe.
pub fn make(
    loaded: &LoadedRecipe,
    store: &Store,
    lock: &LockFile,
    inv: &Inventory,
    sel: &Selection,
) -> Result<Plan, Problem> {
    let recipe = &loaded.recipe;
    for name in sel.only.iter().chain(&sel.from).chain(&sel.force) {
        if loaded.stages.get(name).is_none() {
            let names = loaded.stages.list.iter().map(|s| s.name.as_str());
            let mut p = Problem::new("rtune::plan::unknown_stage", format!("the recipe has no stage `{name}`"));
            p = match crate::recipe::diag::did_you_mean(name, names.clone()) {
                Some(m) => p.help(format!("did you mean `{m}`?")),
                None => p.help(format!("stages: {}", names.collect::<Vec<_>>().join(", "))),
            };
            return Err(p);
        }
    }
    let device = device::resolve_with(&recipe.device.prefer, |d| recipe.device.dtypes_for(d), inv).map_err(|e| {
        Problem::new("rtune::device::none", e.to_string())
            .at(loaded.origin(&["device", "prefer"]), "none of these is usable")
            .help("add `\"cpu\"` at the end of `device.prefer` as a last resort")
    })?;
    let threads = recipe.device.threads.unwrap_or(inv.cpu_threads);
    let forced: BTreeSet<String> = match &sel.from {
        Some(f) => loaded.stages.downstream(f),
        None => BTreeSet::new(),
    }
    .into_iter()
    .chain(sel.force.iter().cloned())
    .collect();
    let only_set = sel.only.as_ref().map(|o| BTreeSet::from([o.clone()]));
    let previous = lock.recipes.get(&recipe.recipe.name);
    let hub = HubEnv::from_env(None, sel.offline);

    let mut planned: Vec<PlannedStage> = Vec::new();
    for spec in &loaded.stages.list {
        support::check(spec, loaded)?;
        let mut settings = resolve_settings(spec, loaded, &device).map_err(|e| {
            Problem::new("rtune::plan::settings", format!("stage `{}`: {e}", spec.name))
                .at(loaded.origin(&["stages", &spec.name]), "in this stage")
        })?;
        if spec.kind == StageKind::Upload {
            // The model card shows the recipe (its text, name and description), so they are
            // part of what the upload writes (the evaluations it shows are inputs, below).
            settings["card"] = json!({
                "name": recipe.recipe.name,
                "description": recipe.recipe.description,
                "recipe_text": blake3::hash(loaded.text.as_bytes()).to_hex().to_string(),
            });
        }
        let uses_device = matches!(spec.kind, StageKind::Train | StageKind::Evaluate | StageKind::Quantize);
        let mut inputs = serde_json::Map::new();
        for (port, producer) in spec.inputs(&loaded.stages) {
            let fp = planned.iter().find(|p| p.name == producer.name).map(|p| p.fingerprint.clone());
            inputs.insert(port_name(port).into(), json!(fp));
        }
        if spec.kind == StageKind::Upload {
            // The card's evaluation table reads the evaluations planned before the upload, and
            // its training section (metrics, loss curve) the train stage the exports came from.
            for p in planned.iter().filter(|p| p.kind == StageKind::Evaluate && p.action != Action::Skip) {
                inputs.insert(format!("card:eval:{}", p.name), json!(p.fingerprint));
            }
            let upstream = loaded.stages.upstream(&spec.name);
            if let Some(t) = planned.iter().find(|p| p.kind == StageKind::Train && upstream.contains(&p.name)) {
                inputs.insert("card:train".into(), json!(t.fingerprint));
            }
        }
        let mut doc = json!({
            "fingerprint_version": FINGERPRINT_VERSION,
            "stage_version": fingerprint::stage_version(spec.kind),
            "kind": spec.kind.as_str(),
            "settings": settings,
            "inputs": inputs,
        });
        if uses_device {
            doc["device"] = json!({ "class": device.class.as_str(), "dtype": device.dtype.as_str() });
            // Only when set, so existing fingerprints stay valid.
            if recipe.device.tf32 && device.class == crate::device::DeviceClass::Cuda {
                doc["device"]["tf32"] = json!(true);
            }
            if let Some(engine) = crate::engine::requested() {
                doc["device"]["engine"] = json!(engine);
            }
        }
        if spec.kind == StageKind::Evaluate
            && let Some(rel) = settings["evaluate"]["dataset"].as_str()
        {
            let digest = local_digest(loaded, "dataset", rel, &["stages", &spec.name, "dataset"])?;
            doc["sources"] = json!({ "dataset": digest });
        }
        if spec.kind == StageKind::Download {
            let locked = previous.and_then(|r| r.stages.get(&spec.name)).map(|d| &d.inputs["sources"]);
            doc["sources"] = source_digests(loaded, &hub, locked)?;
        }
        let fp = fingerprint::of(&doc);
        let cached = store.manifest(&fp).map(|m| store.quick_check(&m));
        let old = previous.and_then(|r| r.stages.get(&spec.name));
        let (mut action, mut reason) = match (&cached, forced.contains(&spec.name)) {
            (_, true) => (
                Action::Run,
                if sel.from.is_some() && !sel.force.contains(&spec.name) {
                    format!("forced (--from {})", sel.from.as_deref().unwrap_or_default())
                } else {
                    "forced (--force)".to_string()
                },
            ),
            (Some(Ok(())), false) if spec.kind == StageKind::Upload => {
                match crate::destination::check(loaded, store, &fp, &hub) {
                    Verdict::Intact => (Action::Cached, String::new()),
                    Verdict::NotChecked(why) => (Action::Cached, why),
                    Verdict::Stale(why) => (Action::Restore, why),
                }
            }
            (Some(Ok(())), false) => (Action::Cached, String::new()),
            (Some(Err(why)), false) => (Action::Run, format!("artifact damaged ({why}); rebuilding")),
            (None, false) => (Action::Run, why_run(old, &doc, &fp, spec, &planned)),
        };
        if let Some(only) = &only_set
            && !only.contains(&spec.name)
            && matches!(action, Action::Run | Action::Restore)
        {
            let upstream_of_only = loaded.stages.upstream(sel.only.as_deref().unwrap_or_default());
            if upstream_of_only.contains(&spec.name) && action == Action::Run {
                return Err(Problem::new(
                    "rtune::plan::input_not_built",
                    format!(
                        "`--only {}` needs stage `{}`, which is not built",
                        sel.only.as_deref().unwrap_or_default(),
                        spec.name
                    ),
                )
                .help(format!(
                    "run `rtune run {} --only {}` first, or drop `--only`",
                    loaded.name(),
                    spec.name
                )));
            }
            action = Action::Skip;
            reason = "not selected (--only)".into();
        }
        if spec.kind == StageKind::Download && action == Action::Run && hub.offline {
            offline_preflight(loaded, &hub, &doc["sources"])?;
        }
        planned.push(PlannedStage {
            name: spec.name.clone(),
            kind: spec.kind,
            needs: spec.needs.clone(),
            implicit: spec.implicit,
            uses_device,
            doc,
            fingerprint: fp,
            action,
            reason,
        });
    }
    Ok(Plan { recipe: recipe.recipe.name.clone(), device, threads, offline: hub.offline, stages: planned })
}

/// Why a stage with no cached artifact runs, compared with the last recorded run.
fn why_run(old: Option<&LockedStage>, doc: &Value, fp: &str, spec: &StageSpec, planned: &[PlannedStage]) -> String {
    let Some(old) = old else { return "new".into() };
    if old.fingerprint == fp {
        return "not in the cache".into();
    }
    if old.kind != spec.kind.as_str() {
        return format!("kind changed: {} → {}", old.kind, spec.kind);
    }
    let mut parts = Vec::new();
    if old.inputs["fingerprint_version"] != doc["fingerprint_version"]
        || old.inputs["stage_version"] != doc["stage_version"]
    {
        parts.push("rtune's output format for this stage changed".to_string());
    }
    let settings = fingerprint::diff(&old.inputs["settings"], &doc["settings"]);
    if !settings.is_empty() {
        let shown: Vec<String> = settings.iter().take(3).cloned().collect();
        let more = if settings.len() > 3 { format!(" (+{} more)", settings.len() - 3) } else { String::new() };
        parts.push(format!("settings changed: {}{more}", shown.join(", ")));
    }
    if old.inputs["device"] != doc["device"] {
        let d = |v: &Value| format!("{}/{}", v["class"].as_str().unwrap_or("-"), v["dtype"].as_str().unwrap_or("-"));
        parts.push(format!("device changed: {} → {}", d(&old.inputs["device"]), d(&doc["device"])));
    }
    if old.inputs["sources"] != doc["sources"] {
        let changed: Vec<String> = fingerprint::diff(&old.inputs["sources"], &doc["sources"])
            .iter()
            .filter_map(|l| l.split(':').next().map(String::from))
            .collect();
        parts.push(format!("source changed: {}", changed.join(", ")));
    }
    let mut changed_inputs = Vec::new();
    if let Some(ins) = doc["inputs"].as_object() {
        for (port, fp) in ins {
            if old.inputs["inputs"][port] != *fp {
                let producer = planned
                    .iter()
                    .find(|p| Some(p.fingerprint.as_str()) == fp.as_str())
                    .map(|p| p.name.clone())
                    .unwrap_or_else(|| port.clone());
                if !changed_inputs.contains(&producer) {
                    changed_inputs.push(producer);
                }
            }
        }
    }
    if !changed_inputs.is_empty() {
        // In pipeline order, not port order.
        changed_inputs.sort_by_key(|name| planned.iter().position(|p| &p.name == name).unwrap_or(usize::MAX));
        parts.push(format!("input changed: {}", changed_inputs.join(", ")));
    }
    if parts.is_empty() { "fingerprint changed".into() } else { parts.join("; ") }
}

/// The settings of a stage with defaults applied and `[device.<name>]` overrides merged.
fn resolve_settings(spec: &StageSpec, loaded: &LoadedRecipe, device: &Resolution) -> Result<Value, serde_json::Error> {
    let recipe = &loaded.recipe;
    let mut table = Value::Object(spec.settings.clone());
    for dev in device.override_names() {
        if let Some(over) = recipe.device.overrides.get(&dev).and_then(|o| o.get(&spec.name)) {
            merge(&mut table, over);
        }
    }
    let seed = recipe.recipe.seed;
    Ok(match spec.kind {
        StageKind::Download => {
            let model = &recipe.model;
            let model = match (&model.scratch, &model.path, &model.repo) {
                // The tokenizer is trained on the dataset's rows rendered with its format and
                // column map, so those shape this artifact too.
                (Some(s), _, _) => json!({ "scratch": s, "seed": seed, "vocab_from": "dataset",
                    "corpus": { "format": recipe.dataset.format, "column_map": recipe.dataset.column_map } }),
                (_, Some(_), _) => json!({ "path": "(by content)" }),
                (_, _, Some(r)) => {
                    json!({ "repo": r, "revision": model.revision.clone().unwrap_or_else(|| "main".into()) })
                }
                _ => Value::Null,
            };
            let dataset = match (&recipe.dataset.repo, &recipe.dataset.path) {
                (Some(r), _) => json!({ "repo": r }),
                _ => json!({ "path": "(by content)" }),
            };
            json!({ "model": model, "dataset": dataset })
        }
        StageKind::Tokenize => {
            let d = &recipe.dataset;
            let mut v = json!({
                "format": d.format, "eval_fraction": d.eval_fraction, "max_seq_len": d.max_seq_len,
                "truncate": d.truncate, "packing": d.packing, "train_on_prompt": d.train_on_prompt,
                "skip_bad_rows": d.skip_bad_rows, "column_map": d.column_map, "seed": seed,
            });
            // Only when set, so existing fingerprints stay valid.
            if let Some(t) = &d.chat_template {
                v["chat_template"] = json!(t);
            }
            v
        }
        StageKind::Train => {
            let t: TrainSettings = serde_json::from_value(table)?;
            json!({ "train": t, "adapter": recipe.adapter, "seed": seed })
        }
        StageKind::Evaluate => {
            let e: EvaluateSettings = serde_json::from_value(table)?;
            if e.dataset.is_some() {
                // It tokenizes its own data: how rows become tokens is part of its output.
                let d = &recipe.dataset;
                let data = json!({
                    "format": d.format, "max_seq_len": d.max_seq_len, "truncate": d.truncate,
                    "train_on_prompt": d.train_on_prompt, "skip_bad_rows": d.skip_bad_rows,
                    "column_map": d.column_map, "chat_template": d.chat_template,
                });
                json!({ "evaluate": e, "data": data, "seed": seed })
            } else {
                json!({ "evaluate": e, "seed": seed })
            }
        }
        StageKind::Quantize => {
            let q: QuantizeSettings = serde_json::from_value(table)?;
            // The recipe's name is the GGUF's `general.name`.
            json!({ "quantize": q, "adapter": recipe.adapter, "name": recipe.recipe.name })
        }
        StageKind::Upload => {
            let u: UploadSettings = serde_json::from_value(table)?;
            json!({ "upload": u })
        }
    })
}

fn merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// The content digest of a local source file or folder named at `at` in the recipe.
fn local_digest(loaded: &LoadedRecipe, what: &str, rel: &str, at: &[&str]) -> Result<String, Problem> {
    let path = loaded.resolve_path(rel);
    fingerprint::digest_path(&path).map_err(|e| {
        Problem::new("rtune::source::unreadable", format!("cannot read {what} `{}`: {e}", path.display()))
            .at(loaded.origin(at), "this path")
            .help("paths are relative to the recipe's folder")
    })
}

/// What the download stage fetches: content digests of local sources, and for Hub sources the
/// repo, the commit its revision resolves to, and the files wanted.
fn source_digests(loaded: &LoadedRecipe, hub: &HubEnv, previous: Option<&Value>) -> Result<Value, Problem> {
    let recipe = &loaded.recipe;
    let mut out = serde_json::Map::new();
    let mut add = |key: &str, rel: &str, at: [&str; 2]| -> Result<(), Problem> {
        out.insert(key.into(), json!(local_digest(loaded, key, rel, &at)?));
        Ok(())
    };
    if let Some(p) = &recipe.model.path {
        add("model", p, ["model", "path"])?;
    }
    if let Some(p) = &recipe.dataset.path {
        add("dataset", p, ["dataset", "path"])?;
    }
    for (key, source) in hub_sources(loaded) {
        let commit = resolve_hub(loaded, hub, &source, previous.and_then(|p| p.get(key)))?;
        out.insert(
            key.into(),
            json!({ "hub": source.repo.id, "revision": source.repo.revision, "commit": commit, "include": source.wanted.include }),
        );
    }
    Ok(Value::Object(out))
}

/// A Hub repo a recipe reads, with the files wanted from it.
pub struct HubSource {
    pub repo: RepoRef,
    pub wanted: crate::hub::Wanted,
    /// Where the recipe names it, for diagnostics.
    pub at: [&'static str; 2],
}

/// The files of a model repo rtune needs: config, tokenizer, safetensors weights (and index).
pub const MODEL_FILES: [&str; 4] = ["*.json", "*.safetensors", "tokenizer.model", "*.txt"];
/// Default dataset files.
pub const DATASET_FILES: [&str; 5] = ["*.jsonl", "*.json", "*.csv", "*.txt", "*.parquet"];

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
        let include = r.dataset.files.clone().unwrap_or_else(|| DATASET_FILES.iter().map(|s| s.to_string()).collect());
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
fn resolve_hub(
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
    let client = crate::hub::Client::new(HubEnv { attempts: 1, ..hub.clone() });
    let located = |e: &crate::hub::HubError| hub_problem(e).at(loaded.origin(&src.at), "this repository");
    match crate::hub::resolve_commit(&client, &src.repo) {
        Ok(c) => Ok(c),
        Err(e @ crate::hub::HubError::Unreachable { .. }) => offline_fallback().ok_or_else(|| located(&e)),
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

/// Offline pre-flight: every file a download stage needs must be in the HF cache. Lists all
/// missing files at once, with the command that would fetch them.
fn offline_preflight(loaded: &LoadedRecipe, hub: &HubEnv, sources: &Value) -> Result<(), Problem> {
    let cache = crate::hub::HubCache::new(&hub.cache_dir);
    let mut missing: Vec<String> = Vec::new();
    let mut commands: Vec<String> = Vec::new();
    let mut first_at = None;
    for (key, src) in hub_sources(loaded) {
        let commit = sources[key]["commit"].as_str().unwrap_or_default();
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
        // The exact listing huggingface_hub or rtune saved when it was online, if there is one.
        if let Some(missing) = cache.missing(&pinned, commit, &src.wanted, &files) {
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
            commands.push(crate::hub::download_command(&src.repo.with_revision(commit), &src.wanted.include));
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

/// Every check `plan` makes on the recipe's stages (destinations, export formats, sizes), all
/// at once: `rtune validate` runs them too, so it and `plan` give the same verdict.
pub fn check_stages(loaded: &LoadedRecipe) -> Result<(), crate::recipe::Problems> {
    let problems: Vec<Problem> =
        loaded.stages.list.iter().filter_map(|spec| support::check(spec, loaded).err()).collect();
    if problems.is_empty() { Ok(()) } else { Err(crate::recipe::Problems::new(loaded.name(), problems)) }
}

/// Which stage kinds and sources this build implements, checked at plan time so nothing
/// pretends to run.
mod support {
    use super::*;

    pub fn check(spec: &StageSpec, loaded: &LoadedRecipe) -> Result<(), Problem> {
        let recipe = &loaded.recipe;
        match spec.kind {
            StageKind::Download => {}
            StageKind::Tokenize => {}
            StageKind::Train | StageKind::Evaluate => {}
            StageKind::Quantize => {
                if let Some(size) = spec.settings.get("max_shard_size").and_then(|v| v.as_str())
                    && let Err(e) = crate::recipe::parse_size(size)
                {
                    return Err(Problem::new("rtune::plan::bad_size", e)
                        .at(loaded.origin(&["stages", &spec.name, "max_shard_size"]), "not a size")
                        .help("e.g. \"5GB\", \"500MB\" or \"2GiB\""));
                }
                // With the default list (no `formats`), a full fine-tune gets no PEFT export.
                let formats = spec.settings.get("formats").and_then(|f| f.as_array()).cloned().unwrap_or_default();
                let peft = formats.iter().any(|f| f.as_str() == Some("peft-adapter"));
                if peft && recipe.adapter.kind == crate::recipe::AdapterKind::None {
                    return Err(Problem::new(
                        "rtune::plan::no_adapter",
                        "`peft-adapter` needs a LoRA adapter, but `adapter.kind = \"none\"`",
                    )
                    .at(loaded.origin(&["stages", &spec.name, "formats"]), "no adapter to export")
                    .help("export `safetensors-merged` or a GGUF format for a full fine-tune"));
                }
            }
            StageKind::Upload => {
                let to = spec.settings.get("to").and_then(|t| t.as_str()).unwrap_or_default();
                let at = loaded.origin(&["stages", &spec.name, "to"]);
                if let Some(rest) = to.strip_prefix("hf://") {
                    return crate::hub::parse_hf_url(rest)
                        .map(|_| ())
                        .map_err(|e| hub_problem(&e).at(at, "not `hf://owner/name[@revision]`"));
                }
                let Some(path) = to.strip_prefix("dir://") else {
                    return Err(Problem::new(
                        "rtune::plan::bad_destination",
                        format!("`{to}` is not an upload destination"),
                    )
                    .at(at, "expected dir://… or hf://…")
                    .help("`dir://out/my-model` (relative to the recipe) or `hf://owner/name`"));
                };
                if path.is_empty()
                    || std::path::Path::new(path).components().any(|c| matches!(c, std::path::Component::ParentDir))
                {
                    return Err(Problem::new(
                        "rtune::plan::bad_destination",
                        format!("`{to}` must name a folder without `..`"),
                    )
                    .at(at, "escapes the recipe's folder")
                    .help("write below the recipe's folder, or give an absolute path"));
                }
            }
        }
        Ok(())
    }
}

/// Per-stage fingerprints, for `rtune.lock`.
pub fn locked_stages(plan: &Plan) -> BTreeMap<String, LockedStage> {
    plan.stages
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                LockedStage { kind: s.kind.as_str().into(), fingerprint: s.fingerprint.clone(), inputs: s.doc.clone() },
            )
        })
        .collect()
}
