//! Runs a plan: stages in order, cached ones skipped, each built under its fingerprint's lock
//! and committed atomically; `rtune.lock` is updated after every stage that completes.

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;
use serde_json::json;

use crate::Error;
use crate::plan::{self, Action, LockFile, Plan};
use crate::recipe::{LoadedRecipe, Problem};
use crate::stage::{self, StageCtx};
use crate::store::{Manifest, Store, write_atomic};
use crate::ui::{Ui, human_bytes};

/// What a run did, stage by stage.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub recipe: String,
    pub stages: Vec<StageReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StageReport {
    pub name: String,
    pub kind: String,
    pub fingerprint: String,
    /// `cached`, `built`, `restored` (an upload's destination copied again from the store),
    /// `skipped`, or `reused` (built meanwhile by another rtune run).
    pub outcome: String,
    pub artifact: Option<PathBuf>,
    pub metrics: serde_json::Value,
    pub seconds: f64,
}

impl StageReport {
    fn new(
        planned: &crate::plan::PlannedStage,
        outcome: &str,
        artifact: Option<PathBuf>,
        metrics: serde_json::Value,
        seconds: f64,
    ) -> StageReport {
        StageReport {
            name: planned.name.clone(),
            kind: planned.kind.as_str().into(),
            fingerprint: planned.fingerprint.clone(),
            outcome: outcome.into(),
            artifact,
            metrics,
            seconds,
        }
    }
}

impl RunReport {
    pub fn stage(&self, name: &str) -> Option<&StageReport> {
        self.stages.iter().find(|s| s.name == name)
    }
}

/// Where the lock file of a recipe lives.
pub fn lock_path(loaded: &LoadedRecipe) -> PathBuf {
    LockFile::path_for(&loaded.source.base_dir())
}

/// `--locked`: the plan must match the lock file exactly.
pub fn check_locked(loaded: &LoadedRecipe, plan: &Plan, lock: &LockFile) -> Result<(), Error> {
    let path = lock_path(loaded);
    let recorded = lock.recipes.get(&plan.recipe).map(|r| &r.stages);
    let mut changes = Vec::new();
    let current = plan::locked_stages(plan);
    for (name, s) in &current {
        match recorded.and_then(|r| r.get(name)) {
            None => changes.push(crate::recipe::Problem::new(
                "rtune::lock::new_stage",
                format!("stage `{name}` is not in the lock file"),
            )),
            Some(old) if old.fingerprint != s.fingerprint => {
                let diffs = crate::fingerprint::diff(&old.inputs, &s.inputs);
                changes.push(crate::recipe::Problem::new(
                    "rtune::lock::changed",
                    format!(
                        "stage `{name}` would change: {}",
                        diffs.iter().take(4).cloned().collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    for name in recorded.into_iter().flat_map(|r| r.keys()) {
        if !current.contains_key(name) {
            changes.push(crate::recipe::Problem::new(
                "rtune::lock::removed_stage",
                format!("stage `{name}` is in the lock file but not in the recipe"),
            ));
        }
    }
    if changes.is_empty() { Ok(()) } else { Err(Error::LockMismatch { path: path.display().to_string(), changes }) }
}

/// Run every stage of `plan` that is not cached.
pub fn run(loaded: &LoadedRecipe, plan: &Plan, store: &Store, ui: &Ui) -> Result<RunReport, Error> {
    let lock_file = lock_path(loaded);
    // Held until the run ends: `cache gc` refuses to run meanwhile.
    let _in_use = store.use_shared()?;
    let mut report = RunReport { recipe: plan.recipe.clone(), stages: Vec::new() };
    let mut verified = std::collections::BTreeSet::new();
    for planned in &plan.stages {
        if crate::train::INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::Interrupted);
        }
        let started = Instant::now();
        let fp = &planned.fingerprint;
        let (action, reason) = recheck_destination(loaded, store, plan, planned, ui);
        match action {
            Action::Skip => {
                report.stages.push(StageReport::new(planned, "skipped", None, json!(null), 0.0));
                continue;
            }
            Action::Cached => {
                let m = store.manifest(fp);
                ui.status("cached", format!("{} ({})", planned.name, planned.short()));
                let metrics = m.map(|m| m.metrics).unwrap_or(json!(null));
                let seconds = started.elapsed().as_secs_f64();
                report.stages.push(StageReport::new(planned, "cached", Some(store.artifact_dir(fp)), metrics, seconds));
                continue;
            }
            Action::Restore => {
                let _lock = store.lock(fp, || {
                    ui.status(
                        "waiting",
                        format!("another rtune run is building {} ({})", planned.name, planned.short()),
                    )
                })?;
                ui.status("restoring", format!("{} ({}) — {}", planned.name, planned.short(), reason));
                restore(loaded, store, plan, planned, ui, false)?;
                record_in_lock(&lock_file, plan, &planned.name)?;
                let metrics = store.manifest(fp).map(|m| m.metrics).unwrap_or(json!(null));
                let seconds = started.elapsed().as_secs_f64();
                report.stages.push(StageReport::new(
                    planned,
                    "restored",
                    Some(store.artifact_dir(fp)),
                    metrics,
                    seconds,
                ));
                continue;
            }
            Action::Run => {}
        }
        let _lock = store.lock(fp, || {
            ui.status("waiting", format!("another rtune run is building {} ({})", planned.name, planned.short()))
        })?;
        let forced = planned.reason.starts_with("forced");
        if let Some(m) = store.manifest(fp).filter(|m| !forced && store.quick_check(m).is_ok()) {
            ui.status("reused", format!("{} ({}) was built by another run meanwhile", planned.name, planned.short()));
            // An upload built by another checkout wrote its files there, not here.
            if planned.kind == crate::recipe::StageKind::Upload {
                restore(loaded, store, plan, planned, ui, true)?;
            }
            let seconds = started.elapsed().as_secs_f64();
            report.stages.push(StageReport::new(planned, "reused", Some(store.artifact_dir(fp)), m.metrics, seconds));
            continue;
        }
        if planned.reason.starts_with("artifact damaged") || forced {
            store.evict(fp)?;
        }
        // Inputs are re-hashed (once per run) before a stage reads them: damage that happened
        // since they were built is caught here, marked, and rebuilt by the next run.
        for input in planned.inputs.values() {
            if !verified.insert(input.to_string()) {
                continue;
            }
            let Some(m) = store.manifest(input) else { continue };
            let problems = store.verify(&m);
            if !problems.is_empty() {
                store.mark_damaged(input, &problems)?;
                return Err(Problem::new(
                    "rtune::store::damaged_input",
                    format!(
                        "stage `{}` cannot start: its input `{}` ({}) is damaged: {}",
                        planned.name,
                        m.stage,
                        crate::fingerprint::short(input),
                        problems.join("; ")
                    ),
                )
                .help("run the same command again: the damaged artifact is rebuilt first")
                .into());
            }
        }
        ui.status("running", format!("{} ({}) — {}", planned.name, planned.short(), planned.reason));
        let staging = store.staging()?;
        let ctx = StageCtx::new(planned, loaded.spans(), plan.offline, store, staging.path(), ui);
        let metrics = stage::run(&ctx, &planned.key).map_err(|source| Error::stage(&planned.name, source))?;
        let mut manifest = Manifest::new(fp, planned.kind.as_str(), &planned.name);
        manifest.inputs = planned.doc.clone();
        manifest.metrics = metrics.clone();
        manifest.run = json!({
            "threads": plan.threads,
            "seconds": started.elapsed().as_secs_f64(),
            "recipe": loaded.name(),
        });
        // The stage's own device (quantize merges on the CPU after a Vulkan run), as discovery
        // described it.
        if let Some(d) = planned.key.device() {
            manifest.run["device"] = json!(d.resolution().device_name());
            manifest.run["dtype"] = json!(d.dtype.as_str());
            if let Some(info) = plan.device_info(d.class, d.ordinal) {
                manifest.run["device_info"] = json!(info);
            }
            // Data parallel: every device that trained, and what discovery said of the others.
            if !d.peers.is_empty() {
                let all: Vec<String> = d.resolution().ordinals().map(|o| d.class.device_name(o)).collect();
                manifest.run["data_parallel"] = json!(all);
                let peers: Vec<_> = d.peers.iter().filter_map(|&o| plan.device_info(d.class, o)).collect();
                manifest.run["peers_info"] = json!(peers);
            }
        }
        let manifest = store.commit(staging.path(), manifest)?;
        drop(staging);
        let work = store.work_dir(fp);
        if work.exists() {
            let _ = std::fs::remove_dir_all(&work);
        }
        record_in_lock(&lock_file, plan, &planned.name)?;
        ui.status(
            "built",
            format!(
                "{} in {:.1}s, {}",
                planned.name,
                started.elapsed().as_secs_f64(),
                human_bytes(manifest.total_size())
            ),
        );
        let seconds = started.elapsed().as_secs_f64();
        report.stages.push(StageReport::new(planned, "built", Some(store.artifact_dir(fp)), metrics, seconds));
    }
    // Cached stages are recorded too, so the lock describes the whole recipe.
    for s in &plan.stages {
        if s.action == Action::Cached {
            record_in_lock(&lock_file, plan, &s.name)?;
        }
    }
    Ok(report)
}

/// What to do with a planned stage. The plan checks an upload's Hub destination with one
/// attempt (a plan must not stall on an unreachable Hub); where that attempt failed, a run asks
/// again as persistently as an upload would, restores what it finds changed, and warns when the
/// Hub still does not answer — a run that verified nothing must not read as one that found the
/// destination intact.
fn recheck_destination(
    loaded: &LoadedRecipe,
    store: &Store,
    plan: &Plan,
    planned: &crate::plan::PlannedStage,
    ui: &Ui,
) -> (Action, String) {
    use crate::destination::{self, Verdict};
    let unchecked = planned.action == Action::Cached
        && planned.kind == crate::recipe::StageKind::Upload
        && !plan.offline
        && planned.reason.starts_with("destination not checked");
    if !unchecked {
        return (planned.action, planned.reason.clone());
    }
    let hub = crate::hub::HubEnv::from_env(None, false);
    match destination::check(loaded, store, &planned.fingerprint, &hub) {
        Verdict::Stale(why) => (Action::Restore, why),
        Verdict::Intact => (Action::Cached, String::new()),
        Verdict::NotChecked(why) => {
            ui.warn(format!(
                "{}: {why}; the files there were not verified or restored (run again when the Hub answers)",
                planned.name
            ));
            (Action::Cached, why)
        }
    }
}

/// Copy an upload's files to its destination again from the store (only when the destination
/// is found stale, with `check`).
fn restore(
    loaded: &LoadedRecipe,
    store: &Store,
    plan: &Plan,
    planned: &crate::plan::PlannedStage,
    ui: &Ui,
    check: bool,
) -> Result<(), Error> {
    use crate::destination::{self, Verdict};
    let hub = crate::hub::HubEnv::from_env(None, plan.offline);
    if check && !matches!(destination::check(loaded, store, &planned.fingerprint, &hub), Verdict::Stale(_)) {
        return Ok(());
    }
    let summary = destination::restore(loaded, store, &planned.fingerprint, &hub, ui)
        .map_err(|e| Error::stage(&planned.name, e.into()))?;
    ui.status(planned.kind.as_str(), &summary);
    Ok(())
}

/// Record one stage's fingerprint in the lock file (read-modify-write, atomic).
fn record_in_lock(path: &std::path::Path, plan: &Plan, stage: &str) -> Result<(), Error> {
    let mut lock = LockFile::read(path)?;
    let entry = lock.recipes.entry(plan.recipe.clone()).or_default();
    let current = plan::locked_stages(plan);
    entry.stages.retain(|name, _| current.contains_key(name));
    if let Some(s) = current.get(stage) {
        if entry.stages.get(stage) == Some(s) {
            return Ok(());
        }
        entry.stages.insert(stage.to_string(), s.clone());
    }
    write_atomic(path, lock.to_text().as_bytes())?;
    Ok(())
}
