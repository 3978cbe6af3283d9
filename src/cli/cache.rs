//! `rtune cache`: inspect and maintain the artifact cache.

use std::collections::BTreeSet;

use serde_json::json;

use super::*;
use rtune::Error;
use rtune::recipe::Problem;
use rtune::store::Store;
use rtune::ui::{Ui, count, human_bytes};

/// Run `rtune cache` with its parsed arguments; the exit code on success.
pub fn run(g: &Global, command: CacheCommand, ui: &Ui) -> Result<u8, Error> {
    let store = store(g)?;
    match command {
        CacheCommand::Path => {
            ui.out(format!("{}\n", store.root().display()));
            Ok(0)
        }
        CacheCommand::Ls => {
            let ms = store.manifests();
            if g.json {
                let list: Vec<_> = ms.iter().map(|m| json!({"fingerprint": m.fingerprint, "kind": m.kind, "stage": m.stage, "recipe": m.recipe(), "bytes": m.total_size(), "path": store.artifact_dir(&m.fingerprint)})).collect();
                ui.out(format!("{}\n", serde_json::to_string_pretty(&list).expect("json")));
            } else {
                let mut out = String::new();
                for m in &ms {
                    out.push_str(&format!(
                        "{}  {:<9} {:<12} {:>10}  {}\n",
                        rtune::fingerprint::short(&m.fingerprint),
                        m.kind,
                        m.stage,
                        human_bytes(m.total_size()),
                        m.recipe()
                    ));
                }
                out.push_str(&format!(
                    "{} artifacts, {}\n",
                    ms.len(),
                    human_bytes(ms.iter().map(|m| m.total_size()).sum())
                ));
                ui.out(out);
            }
            Ok(0)
        }
        CacheCommand::Verify => {
            let mut bad = 0;
            let ms = store.manifests();
            for m in &ms {
                let problems = store.verify(m);
                if !problems.is_empty() {
                    bad += 1;
                    store.mark_damaged(&m.fingerprint, &problems)?;
                    ui.out(format!(
                        "damaged {} ({} {}): {}\n",
                        rtune::fingerprint::short(&m.fingerprint),
                        m.kind,
                        m.stage,
                        problems.join("; ")
                    ));
                }
            }
            ui.out(format!("{} artifacts verified, {bad} damaged\n", ms.len()));
            if bad > 0 {
                ui.status("verify", "damaged artifacts are rebuilt by the next run that needs them");
            }
            Ok(if bad > 0 { 1 } else { 0 })
        }
        CacheCommand::Gc => {
            let (n, bytes) = store.gc()?;
            ui.out(format!("removed {n} entries, freed {}\n", human_bytes(bytes)));
            Ok(0)
        }
        CacheCommand::Rm { fingerprints, dry_run } => {
            let mut gone = BTreeSet::new();
            for prefix in &fingerprints {
                gone.insert(find_in_cache(&store, prefix)?);
            }
            remove_from_cache(&store, &gone, dry_run, g.json, ui)
        }
        CacheCommand::Prune { keep, dry_run } => {
            let mut used = BTreeSet::new();
            for recipe in keep {
                let args = RecipeArgs { recipe, sets: Vec::new() };
                let (_, _, lock, plan) = make_plan(g, &args, &SelectArgs::default())?;
                used.extend(plan.uses(&lock, &store));
            }
            let gone = store.fingerprints().into_iter().filter(|fp| !used.contains(fp)).collect();
            remove_from_cache(&store, &gone, dry_run, g.json, ui)
        }
    }
}

/// The artifact or stopped run whose fingerprint starts with `prefix`: exactly one.
fn find_in_cache(store: &Store, prefix: &str) -> Result<String, Error> {
    let found: Vec<String> =
        store.fingerprints().into_iter().filter(|fp| !prefix.is_empty() && fp.starts_with(prefix)).collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(Problem::new("rtune::cache::unknown", format!("no artifact or stopped run `{prefix}` in the cache"))
            .help("`rtune cache ls` lists the artifacts, `rtune plan RECIPE` a recipe's fingerprints")
            .into()),
        many => Err(Problem::new("rtune::cache::ambiguous", format!("`{prefix}` begins {} fingerprints", many.len()))
            .help(format!(
                "give more of it: {}",
                many.iter().map(|f| rtune::fingerprint::short(f)).collect::<Vec<_>>().join(", ")
            ))
            .into()),
    }
}

/// Remove (or with `dry_run`, list) the artifacts and stopped runs `gone`, then what only they
/// used, and say what was freed.
fn remove_from_cache(store: &Store, gone: &BTreeSet<String>, dry_run: bool, json: bool, ui: &Ui) -> Result<u8, Error> {
    let artifacts: Vec<_> = store.manifests().into_iter().filter(|m| gone.contains(&m.fingerprint)).collect();
    let stopped: Vec<_> = store.unfinished().into_iter().filter(|(fp, _)| gone.contains(fp)).collect();
    let estimate = store.freed_by(gone);
    let (entries, freed) = if dry_run { (0, estimate) } else { store.remove(gone)? };
    if json {
        let list: Vec<_> = artifacts
            .iter()
            .map(|m| {
                let (fp, kind, stage, recipe) = (&m.fingerprint, &m.kind, &m.stage, m.recipe());
                json!({"fingerprint": fp, "kind": kind, "stage": stage, "recipe": recipe, "bytes": m.total_size()})
            })
            .chain(stopped.iter().map(|(fp, b)| json!({"fingerprint": fp, "kind": "stopped run", "bytes": b})))
            .collect();
        let report = json!({"dry_run": dry_run, "removed": list, "entries": entries, "freed_bytes": freed});
        ui.out(format!("{}\n", serde_json::to_string_pretty(&report).expect("json")));
        return Ok(0);
    }
    let verb = if dry_run { "would remove" } else { "removed" };
    let mut out = String::new();
    for m in &artifacts {
        let (fp, size) = (rtune::fingerprint::short(&m.fingerprint), human_bytes(m.total_size()));
        out.push_str(&format!("{verb} {fp}  {:<9} {:<12} {size:>10}  {}\n", m.kind, m.stage, m.recipe()));
    }
    for (fp, bytes) in &stopped {
        let (fp, size) = (rtune::fingerprint::short(fp), human_bytes(*bytes));
        out.push_str(&format!("{verb} {fp}  {:<9} {:<12} {size:>10}\n", "stopped", "(resumable)"));
    }
    let what = format!("{} and {}", count(artifacts.len(), "artifact"), count(stopped.len(), "stopped run"));
    out.push_str(&match dry_run {
        true => format!(
            "{what} would go, freeing {} (files that kept artifacts share stay), besides what `cache gc` frees\n",
            human_bytes(freed)
        ),
        false => format!("{what} removed, freed {}\n", human_bytes(freed)),
    });
    ui.out(out);
    Ok(0)
}
