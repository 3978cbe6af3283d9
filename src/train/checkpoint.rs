//! Resumable checkpoints in the train stage's work folder: `ckpt-<step>/` with the trained
//! parameters, AdamW moments, EMA weights and the loop state (step, data cursor — which also
//! keys dropout masks —, loss-guard, loss-scale and early-stopping state). Written to a temporary folder,
//! fsynced and renamed, so a kill or a power loss at any moment leaves either the previous
//! checkpoint or the new one, never half of one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;

use super::{LoopState, TrainError, cerr, ioerr};
use crate::engine::EngineState;
use crate::model::folder::save_safetensors;

#[derive(serde::Serialize, serde::Deserialize)]
struct Saved {
    state: LoopState,
    optimizer_step: u64,
}

pub fn save(work: &Path, engine: &EngineState, state: &LoopState, keep: usize) -> Result<PathBuf, TrainError> {
    let tmp = tempfile::Builder::new()
        .prefix(".tmp-ckpt-")
        .tempdir_in(work)
        .map_err(ioerr(format!("cannot write a checkpoint in `{}`", work.display())))?;
    save_safetensors(&tmp.path().join("params.safetensors"), &engine.params)?;
    let mut moments = BTreeMap::new();
    for (k, v) in &engine.m {
        moments.insert(format!("m/{k}"), v.clone());
    }
    for (k, v) in &engine.v {
        moments.insert(format!("v/{k}"), v.clone());
    }
    save_safetensors(&tmp.path().join("optimizer.safetensors"), &moments)?;
    if let Some(e) = &engine.ema {
        save_safetensors(&tmp.path().join("ema.safetensors"), e)?;
    }
    let saved = Saved { state: state.clone(), optimizer_step: engine.optimizer_step };
    std::fs::write(tmp.path().join("state.json"), crate::json::pretty_sorted(&saved))
        .map_err(ioerr("cannot write checkpoint state".into()))?;
    let dir = work.join(format!("ckpt-{:08}", state.step));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(ioerr(format!("cannot replace `{}`", dir.display())))?;
    }
    // Durable before it is named, and named durably before older checkpoints are removed: a
    // power loss leaves the previous checkpoint or this one, never a name without its bytes.
    crate::store::sync_tree(tmp.path()).map_err(ioerr("cannot sync the checkpoint".into()))?;
    let kept = tmp.keep();
    std::fs::rename(&kept, &dir).map_err(ioerr(format!("cannot commit checkpoint `{}`", dir.display())))?;
    crate::store::sync_dir(work);
    let mut all = list(work);
    while all.len() > keep.max(1) {
        let old = all.remove(0);
        let _ = std::fs::remove_dir_all(old);
    }
    Ok(dir)
}

/// Checkpoint folders, oldest first.
fn list(work: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(work)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("ckpt-")) && p.join("state.json").is_file()
        })
        .collect();
    v.sort();
    v
}

pub fn latest(work: &Path) -> Option<PathBuf> {
    list(work).pop()
}

/// The engine state and loop state of checkpoint `dir` (on the CPU; the engine moves them).
pub fn load(dir: &Path) -> Result<(EngineState, LoopState), TrainError> {
    let text =
        std::fs::read_to_string(dir.join("state.json")).map_err(ioerr(format!("cannot read `{}`", dir.display())))?;
    let saved: Saved = serde_json::from_str(&text).map_err(|e| TrainError::Io {
        context: format!("checkpoint `{}` is damaged", dir.display()),
        source: std::io::Error::other(e),
    })?;
    let load = |name: &str| -> Result<BTreeMap<String, Tensor>, TrainError> {
        let p = dir.join(name);
        Ok(candle_core::safetensors::load(&p, &candle_core::Device::Cpu)
            .map_err(cerr("read checkpoint"))?
            .into_iter()
            .collect())
    };
    let params = load("params.safetensors")?;
    let (mut m, mut v) = (BTreeMap::new(), BTreeMap::new());
    for (k, t) in load("optimizer.safetensors")? {
        if let Some(name) = k.strip_prefix("m/") {
            m.insert(name.to_string(), t);
        } else if let Some(name) = k.strip_prefix("v/") {
            v.insert(name.to_string(), t);
        }
    }
    for k in params.keys() {
        if !m.contains_key(k) || !v.contains_key(k) {
            return Err(missing(dir, k));
        }
    }
    let ema = if dir.join("ema.safetensors").is_file() { Some(load("ema.safetensors")?) } else { None };
    Ok((EngineState { params, ema, m, v, optimizer_step: saved.optimizer_step }, saved.state))
}

fn missing(dir: &Path, k: &str) -> TrainError {
    TrainError::Io {
        context: format!("checkpoint `{}` has no optimizer state for `{k}`", dir.display()),
        source: std::io::Error::other("incomplete checkpoint"),
    }
}

/// Drop metric records after `step` (they belong to work the checkpoint does not include).
pub fn truncate_metrics(path: &Path, step: u64) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let kept: String = text
        .lines()
        .filter(|l| {
            step > 0
                && serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(path, kept)
}
