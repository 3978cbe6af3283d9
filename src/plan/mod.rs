//! Plans: which stages run, on what device, with which fingerprint, and why.
//!
//! Planning reads the recipe, the lock file and the store's manifests; it never loads a model,
//! so `rtune plan` answers in milliseconds.

pub mod key;
pub mod lockfile;
mod render;
mod resolve;
mod sources;

use resolve::resolve_key;
use sources::offline_preflight;

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::Value;

pub use key::{Inputs, StageKey};
pub use lockfile::{LockFile, LockedStage};
pub use render::{render_dot, render_text};
pub use sources::{CARD, DATASET_FILES, HubSource, MODEL_FILES, config_wanted, hub_problem, hub_sources};

use crate::destination::Verdict;
use crate::device::{self, Inventory, Resolution};
use crate::fingerprint;
use crate::hub::HubEnv;
use crate::recipe::stages::Port;
use crate::recipe::{ExportFormat, LoadedRecipe, Problem, Settled, StageKind, StageSettings, StageSpec, TrainSettings};
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
    /// What was hashed into the fingerprint: the key as JSON, with inputs and versions.
    pub doc: Value,
    /// What the stage's executor gets from the recipe (all of it hashed, see [`key`]).
    #[serde(skip)]
    pub key: StageKey,
    /// The artifacts it reads, by port, as fingerprints (also in `doc`).
    #[serde(skip)]
    pub inputs: Inputs,
    pub fingerprint: String,
    pub action: Action,
    pub reason: String,
}

impl PlannedStage {
    pub fn short(&self) -> &str {
        fingerprint::short(&self.fingerprint)
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
    /// The devices the stages compute on, as discovery describes them (name, memory, driver,
    /// vendor): recorded in manifests.
    pub devices: Vec<device::DeviceInfo>,
}

impl Plan {
    pub fn stage(&self, name: &str) -> Option<&PlannedStage> {
        self.stages.iter().find(|s| s.name == name)
    }

    /// The artifacts this recipe uses in `store` (what `rtune cache prune --keep` keeps): its
    /// stages' fingerprints as planned here, those its lock file records (the last run, perhaps
    /// on another device), and every input those artifacts' documents name, transitively (an
    /// export made from an older training run keeps that run).
    pub fn uses(&self, lock: &LockFile, store: &Store) -> BTreeSet<String> {
        let mut keep: BTreeSet<String> = self.stages.iter().map(|s| s.fingerprint.clone()).collect();
        if let Some(r) = lock.recipes.get(&self.recipe) {
            keep.extend(r.stages.values().map(|s| s.fingerprint.clone()));
        }
        let mut todo: Vec<String> = keep.iter().cloned().collect();
        while let Some(fp) = todo.pop() {
            let Some(m) = store.manifest(&fp) else { continue };
            let inputs = m.inputs.get("inputs").and_then(Value::as_object).into_iter().flatten();
            for input in inputs.filter_map(|(_, v)| v.as_str()) {
                if keep.insert(input.to_string()) {
                    todo.push(input.to_string());
                }
            }
        }
        keep
    }

    /// What discovery said of device `ordinal` of `class`, if a stage computes on it.
    pub fn device_info(&self, class: device::DeviceClass, ordinal: usize) -> Option<&device::DeviceInfo> {
        self.devices.iter().find(|i| i.class == class && i.ordinal == ordinal)
    }
}

/// Stage selection from the command line.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub only: Option<String>,
    /// Build this stage and its upstream only (`--until`, as Snakemake's).
    pub until: Option<String>,
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

/// `name` is no stage of the recipe: the closest stage's name, or all of them.
pub fn unknown_stage(loaded: &LoadedRecipe, name: &str) -> Problem {
    let names = loaded.stages.list.iter().map(|s| s.name.as_str());
    let p = Problem::new("rtune::plan::unknown_stage", format!("the recipe has no stage `{name}`"));
    match crate::recipe::diag::did_you_mean(name, names.clone()) {
        Some(m) => p.help(format!("did you mean `{m}`?")),
        None => p.help(format!("stages: {}", names.collect::<Vec<_>>().join(", "))),
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
    for name in sel.only.iter().chain(&sel.until).chain(&sel.from).chain(&sel.force) {
        if loaded.stages.get(name).is_none() {
            return Err(unknown_stage(loaded, name));
        }
    }
    let device = device::resolve_with(&recipe.device.prefer, |d| recipe.device.dtypes_for(d), inv)
        .map_err(|e| {
            Problem::new("rtune::device::none", e.to_string())
                .at(loaded.origin(&["device", "prefer"]), "none of these is usable")
                .help("add `\"cpu\"` at the end of `device.prefer` as a last resort")
        })?
        .with_peers(recipe.device.gpus, inv);
    let threads = recipe.device.threads.unwrap_or(inv.cpu_threads);
    let forced: BTreeSet<String> = match &sel.from {
        Some(f) => loaded.stages.downstream(f),
        None => BTreeSet::new(),
    }
    .into_iter()
    .chain(sel.force.iter().cloned())
    .collect();
    let only_set = sel.only.as_ref().map(|o| BTreeSet::from([o.clone()]));
    let until_set = sel.until.as_ref().map(|u| loaded.stages.upstream(u));
    let previous = lock.recipes.get(&recipe.recipe.name);
    let hub = HubEnv::from_env(None, sel.offline);

    let mut planned: Vec<PlannedStage> = Vec::new();
    for spec in &loaded.stages.list {
        support::check(spec, loaded, &device.override_names())?;
        let locked = previous.and_then(|r| r.stages.get(&spec.name)).map(|d| &d.inputs["sources"]);
        let key = resolve_key(spec, loaded, &device, &hub, locked)?;
        support::check_device(&key, loaded)?;
        let mut inputs = Inputs::new();
        for (port, producer) in spec.inputs(&loaded.stages) {
            if let Some(p) = planned.iter().find(|p| p.name == producer.name) {
                inputs.insert(port_name(port).into(), p.fingerprint.clone());
            }
        }
        if spec.kind() == StageKind::Upload {
            // The card's evaluation table reads the evaluations planned before the upload, and
            // its training section (metrics, loss curve) the train stage the exports came from.
            for p in planned.iter().filter(|p| p.kind == StageKind::Evaluate && p.action != Action::Skip) {
                inputs.insert(format!("card:eval:{}", p.name), p.fingerprint.clone());
            }
            let upstream = loaded.stages.upstream(&spec.name);
            if let Some(t) = planned.iter().find(|p| p.kind == StageKind::Train && upstream.contains(&p.name)) {
                inputs.insert("card:train".into(), t.fingerprint.clone());
            }
        }
        let uses_device = key.device().is_some();
        let doc = key::document(&key, &inputs);
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
            (Some(Ok(())), false) if spec.kind() == StageKind::Upload => {
                // One attempt: `plan` must not stall on an unreachable Hub (`run` asks again).
                match crate::destination::check(loaded, store, &fp, &HubEnv { attempts: 1, ..hub.clone() }) {
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
                    "`--until {}` builds it with the stages it needs; or run `rtune run {} --only {}` first",
                    sel.only.as_deref().unwrap_or_default(),
                    loaded.name(),
                    spec.name
                )));
            }
            action = Action::Skip;
            reason = "not selected (--only)".into();
        }
        if let (Some(needed), Some(until)) = (&until_set, &sel.until)
            && !needed.contains(&spec.name)
            && matches!(action, Action::Run | Action::Restore)
        {
            action = Action::Skip;
            reason = format!("not needed by `{until}` (--until)");
        }
        if let StageKey::Download(k) = &key
            && action == Action::Run
            && hub.offline
        {
            offline_preflight(loaded, &hub, &k.sources)?;
        }
        planned.push(PlannedStage {
            name: spec.name.clone(),
            kind: spec.kind(),
            needs: spec.needs.clone(),
            implicit: spec.implicit,
            uses_device,
            doc,
            key,
            inputs,
            fingerprint: fp,
            action,
            reason,
        });
    }
    let devices = inv
        .devices
        .iter()
        .filter(|d| {
            let mut keys = planned.iter().filter_map(|p| p.key.device());
            keys.any(|k| k.class == d.class && (k.ordinal == d.ordinal || k.peers.contains(&d.ordinal)))
        })
        .cloned()
        .collect();
    let mut device = device;
    // A step of fewer rows than GPUs leaves some idle (rows are what they share).
    for p in &planned {
        if let StageKey::Train(k) = &p.key
            && !k.device.peers.is_empty()
        {
            let (gpus, t) = (k.device.peers.len() + 1, &k.settings.train);
            let rows = t.batch_size as usize * t.grad_accum as usize;
            if rows < gpus {
                device.peers_notes.push(format!(
                    "stage `{}` trains on {rows} row{} a step (batch_size {} × grad_accum {}): {} of the {gpus} GPUs \
                     work at a time; raise batch_size or grad_accum to keep them all busy",
                    p.name,
                    if rows == 1 { "" } else { "s" },
                    t.batch_size,
                    t.grad_accum,
                    rows
                ));
            }
        }
    }
    Ok(Plan { recipe: recipe.recipe.name.clone(), device, threads, offline: hub.offline, stages: planned, devices })
}

/// A device key as the plan's reasons show it: `cuda/bf16`, with TF32 and a requested engine
/// where the key has them (`vulkan/f32 (RTUNE_ENGINE=gpu)`), so a change in any hashed part shows.
fn device_label(v: &Value) -> String {
    let mut s = format!("{}/{}", v["class"].as_str().unwrap_or("-"), v["dtype"].as_str().unwrap_or("-"));
    if v["tf32"] == Value::Bool(true) {
        s.push_str("+tf32");
    }
    if let Some(e) = v["engine"].as_str() {
        s.push_str(&format!(" (RTUNE_ENGINE={e})"));
    }
    for k in v["kernels"].as_array().into_iter().flatten().filter_map(Value::as_str) {
        s.push_str(&format!(" ({k})"));
    }
    s
}

/// Why a stage with no cached artifact runs, compared with the last recorded run.
fn why_run(old: Option<&LockedStage>, doc: &Value, fp: &str, spec: &StageSpec, planned: &[PlannedStage]) -> String {
    let Some(old) = old else { return "new".into() };
    if old.fingerprint == fp {
        return "not in the cache".into();
    }
    if old.kind != spec.kind().as_str() {
        return format!("kind changed: {} → {}", old.kind, spec.kind());
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
        parts.push(format!(
            "device changed: {} → {}",
            device_label(&old.inputs["device"]),
            device_label(&doc["device"])
        ));
    }
    if old.inputs["sources"] != doc["sources"] {
        // A stage that read no sources before (or reads none now) has none: an empty map.
        let or_empty = |v: &Value| if v.is_null() { serde_json::json!({}) } else { v.clone() };
        let changed: Vec<String> = fingerprint::diff(&or_empty(&old.inputs["sources"]), &or_empty(&doc["sources"]))
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

/// Every check `plan` makes on the recipe's stages (destinations, export formats, sizes), all
/// at once: `rtune validate` runs them too, so it and `plan` give the same verdict — except on
/// what the chosen device can run (`support::check_device`), which depends on the machine and
/// only `plan` and `run` resolve.
pub fn check_stages(loaded: &LoadedRecipe) -> Result<(), crate::recipe::Problems> {
    let problems: Vec<Problem> =
        loaded.stages.list.iter().filter_map(|spec| check_everywhere(spec, loaded).err()).collect();
    if problems.is_empty() { Ok(()) } else { Err(crate::recipe::Problems::new(loaded.name(), problems)) }
}

/// A stage as written, then with each `[device.<name>]` table's overrides: `validate` does not
/// know the device, so it checks every one the recipe has (one at a time; `plan` checks the
/// chosen device's, merged). The first problem found.
fn check_everywhere(spec: &StageSpec, loaded: &LoadedRecipe) -> Result<(), Problem> {
    support::check(spec, loaded, &[])?;
    for name in loaded.recipe.device.overrides.keys() {
        support::check(spec, loaded, std::slice::from_ref(name))?;
    }
    Ok(())
}

/// What the train stage whose weights a stage takes trains.
pub(crate) struct TrainedFrom {
    /// The train stage's name.
    pub train: String,
    /// A LoRA adapter (else base weights).
    pub adapter: bool,
    /// Decided by `stages.<train>.trainable` (else by `adapter.kind`).
    pub by_patterns: bool,
}

/// What the train stage feeding `spec`'s trained weights trains with the `overrides` of
/// [`StageSpec::on`]; None when no train stage feeds it.
pub(crate) fn trained_from(spec: &StageSpec, loaded: &LoadedRecipe, overrides: &[String]) -> Option<TrainedFrom> {
    let inputs = spec.inputs(&loaded.stages);
    let train = inputs.get(&Port::Weights).filter(|t| t.kind() == StageKind::Train)?;
    let patterns = match train.on(overrides).ok()?.settings {
        StageSettings::Train(t) => t.trainable,
        _ => None,
    };
    let kind = loaded.recipe.adapter.kind;
    Some(TrainedFrom {
        train: train.name.clone(),
        adapter: crate::recipe::trains_adapter(patterns.as_deref(), kind),
        by_patterns: patterns.is_some(),
    })
}

/// Which stage kinds and sources this build implements, checked at plan time so nothing
/// pretends to run.
mod support {
    use super::*;

    /// What a stage asks of its device that only one engine could do and that engine cannot
    /// run there: on a Vulkan device only the GPU engine trains (candle's autograd has no Vulkan
    /// backend), so another engine asked for by `RTUNE_ENGINE` would fail when the stage starts.
    /// (What depends on the model's shape is checked then.)
    pub fn check_device(key: &StageKey, loaded: &LoadedRecipe) -> Result<(), Problem> {
        let dev = match key {
            StageKey::Train(k) => &k.device,
            StageKey::Evaluate(k) => &k.device,
            _ => return Ok(()),
        };
        if !dev.peers.is_empty()
            && let Some(engine) = dev.engine.as_deref().filter(|e| !["auto", "gpu"].contains(e))
        {
            return Err(Problem::new(
                "rtune::plan::engine_unavailable",
                format!(
                    "RTUNE_ENGINE={engine} trains on one device, and `device.gpus` asks for {} at once",
                    dev.peers.len() + 1
                ),
            )
            .at(loaded.origin(&["device", "gpus"]), "data parallel: the GPU engine only")
            .help("unset RTUNE_ENGINE (or set it to `gpu`), or remove `device.gpus`"));
        }
        if dev.class != device::DeviceClass::Vulkan {
            return Ok(());
        }
        let on = dev.resolution().device_name();
        if let Some(why) = crate::device::vulkan_engine_refused(dev.engine.as_deref()) {
            return Err(Problem::new("rtune::plan::engine_unavailable", format!("{why} (the recipe runs on {on})"))
                .at(loaded.origin(&["device", "prefer"]), "resolves to a Vulkan device")
                .help("unset RTUNE_ENGINE (or set it to `gpu`), or put \"cpu\" or a CUDA device first"));
        }
        Ok(())
    }

    /// `stages.<train>.trainable`: `"adapter"` needs an adapter (else `["adapter"]` would read as
    /// a full fine-tune), and weight patterns beside it must leave the adapter's linears alone
    /// (a weight trains through an adapter or in full; the engines check every weight when the
    /// model is loaded, this catches `"all"` and patterns such as `"*proj*"` before anything
    /// runs). (An empty list is the recipe's own error.)
    fn check_trainable(
        train: &TrainSettings,
        at: Option<&crate::recipe::Origin>,
        loaded: &LoadedRecipe,
    ) -> Result<(), Problem> {
        let Some(patterns) = &train.trainable else {
            return Ok(());
        };
        let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
        if !patterns.contains(&crate::recipe::ADAPTER) {
            return Ok(());
        }
        let adapter = &loaded.recipe.adapter;
        if adapter.kind == crate::recipe::AdapterKind::None {
            return Err(Problem::new(
                "rtune::plan::trainable",
                "`trainable` names `\"adapter\"`, but `adapter.kind = \"none\"`",
            )
            .at(at, "no adapter to train")
            .help("set `adapter.kind = \"lora\"`, or `trainable = [\"all\"]` for a full fine-tune"));
        }
        for target in &adapter.targets {
            // The target's weight in the first layer (or the LM head's).
            let m = target.as_str();
            let weight = match crate::recipe::LAYER_LINEARS.iter().find(|l| l.rsplit('.').next() == Some(m)) {
                Some(linear) => format!("model.layers.0.{linear}.weight"),
                None => format!("{m}.weight"),
            };
            let pattern =
                patterns.iter().map(|p| if *p == "all" { "*" } else { p }).find(|p| crate::glob::fnmatch(p, &weight));
            if let Some(pattern) = pattern {
                return Err(Problem::new(
                    "rtune::plan::trainable",
                    format!(
                        "`trainable` trains `{pattern}` in full beside the adapter, and that names the weights the \
                         adapter's `{}` linears carry (`{weight}`, …)",
                        target.as_str()
                    ),
                )
                .at(at, "adapter and the weights it adapts")
                .help(
                    "a weight trains either through the adapter or in full: name only weights outside \
                       `adapter.targets` (such as `\"*norm*\"`), or drop `\"adapter\"` \
                       for a full fine-tune",
                ));
            }
        }
        Ok(())
    }

    /// `adapter.quantize_base`: the 4-bit base sits under a LoRA adapter, so every train stage
    /// trains one, and no weight pattern beside it names a 4-bit weight (a decoder linear's).
    /// The problem points at `trainable` where the stage sets it, else at `quantize_base`.
    fn check_quantized_base(
        train: &TrainSettings,
        at: Option<&crate::recipe::Origin>,
        loaded: &LoadedRecipe,
    ) -> Result<(), Problem> {
        let adapter = &loaded.recipe.adapter;
        let Some(quant) = adapter.quantize_base else { return Ok(()) };
        let quant = serde_json::to_value(quant).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default();
        let patterns = &train.trainable;
        if !crate::recipe::trains_adapter(patterns.as_deref(), adapter.kind) {
            return Err(Problem::new(
                "rtune::plan::quantized_base",
                format!(
                    "`adapter.quantize_base = \"{quant}\"` keeps the frozen base in 4 bits under a LoRA adapter, \
                     but this stage trains base weights without one"
                ),
            )
            .at(loaded.origin(&["adapter", "quantize_base"]), "4-bit base")
            .at(at, "no adapter")
            .help("a 4-bit weight cannot train: drop `quantize_base` for a full fine-tune, or add \"adapter\""));
        }
        for p in patterns.iter().flatten().filter(|p| *p != crate::recipe::ADAPTER) {
            let p = if p == "all" { "*" } else { p.as_str() };
            let weight = crate::recipe::LAYER_LINEARS
                .iter()
                .map(|l| format!("model.layers.0.{l}.weight"))
                .find(|w| crate::glob::fnmatch(p, w));
            if let Some(weight) = weight {
                return Err(Problem::new(
                    "rtune::plan::quantized_base",
                    format!(
                        "`trainable` trains `{p}` in full, which names weights `adapter.quantize_base` keeps in \
                         4 bits (`{weight}`, …)"
                    ),
                )
                .at(loaded.origin(&["adapter", "quantize_base"]), "4-bit base")
                .at(at, "trains 4-bit weights")
                .help(
                    "beside a 4-bit base, train only weights it keeps whole: norms, biases, the embedding, the LM head",
                ));
            }
        }
        Ok(())
    }

    /// What needs held-out rows (`what`, written at `at`) next to `dataset.eval_fraction = 0`,
    /// which holds none out: an error located at the fraction (else at `at`).
    fn check_eval_split(loaded: &LoadedRecipe, what: &str, at: Option<&crate::recipe::Origin>) -> Result<(), Problem> {
        if loaded.recipe.dataset.eval_fraction > 0.0 || loaded.recipe.dataset.eval_split.is_some() {
            return Ok(());
        }
        Err(Problem::new(
            "rtune::plan::no_eval_split",
            format!("{what}, but `dataset.eval_fraction = 0` holds no rows out"),
        )
        .at(loaded.origin(&["dataset", "eval_fraction"]).or(at), "no eval split")
        .help("set `dataset.eval_fraction` above 0 (0.05 holds out one row in twenty), or drop what needs it"))
    }

    /// `overrides`: the `[device.<name>]` tables whose settings apply, broadest first (the
    /// chosen device's `override_names`; none: the stages' own settings).
    pub fn check(spec: &StageSpec, loaded: &LoadedRecipe, overrides: &[String]) -> Result<(), Problem> {
        let Settled { settings, written } = resolve::settled(spec, loaded, overrides)?;
        let at = |key: &str| resolve::setting_origin(spec, loaded, overrides, key);
        match &settings {
            StageSettings::Download(_) => {}
            StageSettings::Tokenize(_) => sources::check_dataset_splits(loaded)?,
            StageSettings::Train(train) => {
                check_trainable(train, at("trainable"), loaded)?;
                check_quantized_base(train, at("trainable"), loaded)?;
                if train.early_stopping.is_some() {
                    check_eval_split(loaded, "`early_stopping` watches the eval loss", at("early_stopping"))?;
                }
            }
            StageSettings::Evaluate(evaluate) => {
                if evaluate.dataset.is_none() && evaluate.prompts.is_empty() {
                    let what = format!("stage `{}` measures the eval split and has no `prompts`", spec.name);
                    check_eval_split(loaded, &what, at("model"))?;
                }
            }
            StageSettings::Quantize(quantize) => {
                if let Some(size) = &quantize.max_shard_size
                    && let Err(e) = crate::recipe::parse_size(size)
                {
                    return Err(Problem::new("rtune::plan::bad_size", e)
                        .at(at("max_shard_size"), "not a size")
                        .help("e.g. \"5GB\", \"500MB\" or \"2GiB\""));
                }
                // Settings of the merged folder beside a list of formats without it do nothing.
                let listed = written.contains("formats").then_some(&quantize.formats);
                let set = |key: &&str| written.contains(*key);
                if let Some(formats) = listed
                    && !formats.iter().any(|f| f.canonical() == ExportFormat::SafetensorsMerged)
                    && let Some(key) = ["merged_dtype", "max_shard_size"].into_iter().find(set)
                {
                    return Err(Problem::new(
                        "rtune::plan::unused_setting",
                        format!("`{key}` shapes the `safetensors-merged` export, which `formats` does not list"),
                    )
                    .at(at(key), "applies to no export")
                    .help("add \"safetensors-merged\" to `formats`, or drop the key"));
                }
                // Likewise the importance matrix beside formats that quantize without one.
                if !listed.is_some_and(|f| f.iter().any(|f| f.calibrated()))
                    && let Some(key) = ["imatrix", "imatrix_tokens", "imatrix_file"].into_iter().find(set)
                {
                    return Err(Problem::new(
                        "rtune::plan::unused_setting",
                        format!("`{key}` calibrates GGUF quantization, which none of `formats` uses"),
                    )
                    .at(at(key), "applies to no export")
                    .help(
                        "an importance matrix calibrates `gguf-q6_k` and below (`gguf-q4_k_m`, …); \
                         f32, f16 and q8_0 ignore it: add such a format, or drop the key",
                    ));
                }
                // A file to calibrate with is the importance matrix: none is computed.
                if quantize.imatrix_file.is_some() {
                    if quantize.imatrix == Some(false) {
                        return Err(Problem::new(
                            "rtune::plan::conflicting_settings",
                            "`imatrix = false` quantizes without an importance matrix, and `imatrix_file` names one",
                        )
                        .at(at("imatrix_file"), "an importance matrix")
                        .help("drop `imatrix = false` to calibrate with the file, or the file to quantize without"));
                    }
                    if quantize.imatrix_tokens.is_some() {
                        return Err(Problem::new(
                            "rtune::plan::unused_setting",
                            "`imatrix_tokens` counts the tokens of a computed importance matrix; `imatrix_file` names one \
                             to use instead",
                        )
                        .at(at("imatrix_tokens"), "nothing to count")
                        .help("drop `imatrix_tokens`, or `imatrix_file` to compute one from the train split"));
                    }
                }
                // With the default list (no `formats`), base weights that train get no PEFT
                // export (resolve drops it); asked for explicitly, it is an error.
                let peft = listed.is_some_and(|f| f.iter().any(|f| f.canonical() == ExportFormat::PeftAdapter));
                if let (true, Some(TrainedFrom { adapter: false, by_patterns, train })) =
                    (peft, trained_from(spec, loaded, overrides))
                {
                    let why = match by_patterns {
                        true => format!("stage `{train}` trains base weights (`stages.{train}.trainable`)"),
                        false => "`adapter.kind = \"none\"`".to_string(),
                    };
                    return Err(Problem::new(
                        "rtune::plan::no_adapter",
                        format!("`peft-adapter` needs a LoRA adapter, but {why}"),
                    )
                    .at(at("formats"), "no adapter to export")
                    .help("export `safetensors-merged` or a GGUF format when base weights train"));
                }
            }
            StageSettings::Upload(upload) => {
                let to = upload.to.as_str();
                let at = at("to");
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn device_labels_show_every_hashed_part() {
        assert_eq!(super::device_label(&json!({"class": "cuda", "dtype": "bf16"})), "cuda/bf16");
        assert_eq!(super::device_label(&json!({"class": "cuda", "dtype": "f32", "tf32": true})), "cuda/f32+tf32");
        let engine = json!({"class": "vulkan", "dtype": "f32", "engine": "gpu"});
        assert_eq!(super::device_label(&engine), "vulkan/f32 (RTUNE_ENGINE=gpu)");
        let kernels = json!({"class": "cuda", "dtype": "bf16", "kernels": ["RTUNE_GPU_ATTENTION=scalar"]});
        assert_eq!(super::device_label(&kernels), "cuda/bf16 (RTUNE_GPU_ATTENTION=scalar)");
    }
}
