//! Resumable checkpoints in the train stage's work folder: `ckpt-<step>/` with the trained
//! parameters, AdamW moments, EMA weights and the loop state (step, data cursor, dropout RNG,
//! loss-guard and early-stopping state). Written to a temporary folder and renamed, so a kill
//! at any moment leaves either the previous checkpoint or the new one, never half of one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};

use super::optim::AdamW;
use super::{LoopState, TrainError, cerr, ioerr};
use crate::model::Transformer;
use crate::model::folder::save_safetensors;

#[derive(serde::Serialize, serde::Deserialize)]
struct Saved {
    state: LoopState,
    optimizer_step: u64,
}

pub fn save(
    work: &Path,
    model: &Transformer,
    opt: &AdamW,
    ema: Option<&BTreeMap<String, Tensor>>,
    state: &LoopState,
    keep: usize,
) -> Result<PathBuf, TrainError> {
    let tmp = tempfile::Builder::new()
        .prefix(".tmp-ckpt-")
        .tempdir_in(work)
        .map_err(ioerr(format!("cannot write a checkpoint in `{}`", work.display())))?;
    save_safetensors(&tmp.path().join("params.safetensors"), &model.param_values())?;
    let mut moments = BTreeMap::new();
    for (k, v) in &opt.m {
        moments.insert(format!("m/{k}"), v.clone());
    }
    for (k, v) in &opt.v {
        moments.insert(format!("v/{k}"), v.clone());
    }
    save_safetensors(&tmp.path().join("optimizer.safetensors"), &moments)?;
    if let Some(e) = ema {
        save_safetensors(&tmp.path().join("ema.safetensors"), e)?;
    }
    let saved = Saved { state: state.clone(), optimizer_step: opt.step };
    std::fs::write(tmp.path().join("state.json"), serde_json::to_vec_pretty(&saved).expect("json"))
        .map_err(ioerr("cannot write checkpoint state".into()))?;
    let dir = work.join(format!("ckpt-{:08}", state.step));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(ioerr(format!("cannot replace `{}`", dir.display())))?;
    }
    let kept = tmp.keep();
    std::fs::rename(&kept, &dir).map_err(ioerr(format!("cannot commit checkpoint `{}`", dir.display())))?;
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

pub fn load(
    dir: &Path,
    model: &Transformer,
    opt: &mut AdamW,
    ema: Option<&mut BTreeMap<String, Tensor>>,
) -> Result<LoopState, TrainError> {
    let text =
        std::fs::read_to_string(dir.join("state.json")).map_err(ioerr(format!("cannot read `{}`", dir.display())))?;
    let saved: Saved = serde_json::from_str(&text).map_err(|e| TrainError::Io {
        context: format!("checkpoint `{}` is damaged", dir.display()),
        source: std::io::Error::other(e),
    })?;
    let device = model.device().clone();
    let load = |name: &str| -> Result<BTreeMap<String, Tensor>, TrainError> {
        let p = dir.join(name);
        Ok(candle_core::safetensors::load(&p, &device).map_err(cerr("read checkpoint"))?.into_iter().collect())
    };
    model.load_params(&load("params.safetensors")?)?;
    let moments = load("optimizer.safetensors")?;
    for (k, v) in opt.m.iter_mut() {
        *v = moments
            .get(&format!("m/{k}"))
            .cloned()
            .ok_or_else(|| missing(dir, k))?
            .to_dtype(DType::F32)
            .map_err(cerr("read checkpoint"))?;
    }
    for (k, v) in opt.v.iter_mut() {
        *v = moments
            .get(&format!("v/{k}"))
            .cloned()
            .ok_or_else(|| missing(dir, k))?
            .to_dtype(DType::F32)
            .map_err(cerr("read checkpoint"))?;
    }
    opt.step = saved.optimizer_step;
    if let Some(e) = ema {
        *e = load("ema.safetensors")?;
    }
    Ok(saved.state)
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
