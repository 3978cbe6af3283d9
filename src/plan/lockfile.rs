//! `rtune.lock`: the fingerprints of the last successful run of each recipe in a folder.
//!
//! One lock file serves every recipe in its folder (keyed by `recipe.name`), so `recipes/` can
//! hold many recipes. It records the full fingerprint document of each stage, so `rtune plan`
//! can say what changed even when the cache is empty, and `--locked` can fail with a diff.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// History: 1 — first version.
pub const LOCK_VERSION: u32 = 1;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LockFile {
    pub version: u32,
    pub recipes: BTreeMap<String, RecipeLock>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RecipeLock {
    pub stages: BTreeMap<String, LockedStage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LockedStage {
    pub kind: String,
    pub fingerprint: String,
    /// The fingerprint document (settings, device, inputs, sources).
    pub inputs: serde_json::Value,
}

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
#[error("cannot read lock file `{path}`: {reason}")]
#[diagnostic(
    code(rtune::lock::unreadable),
    help("delete it to start afresh; it is rewritten after the next successful run")
)]
pub struct LockError {
    pub path: String,
    pub reason: String,
}

impl LockFile {
    pub fn path_for(dir: &Path) -> std::path::PathBuf {
        dir.join("rtune.lock")
    }

    /// Read a lock file; a missing one is empty.
    pub fn read(path: &Path) -> Result<LockFile, LockError> {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let lock: LockFile = serde_json::from_str(&text)
                    .map_err(|e| LockError { path: path.display().to_string(), reason: e.to_string() })?;
                if lock.version != LOCK_VERSION {
                    return Err(LockError {
                        path: path.display().to_string(),
                        reason: format!("version {} is not supported (this rtune writes {LOCK_VERSION})", lock.version),
                    });
                }
                Ok(lock)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Ok(LockFile { version: LOCK_VERSION, ..Default::default() })
            }
            Err(e) => Err(LockError { path: path.display().to_string(), reason: e.to_string() }),
        }
    }

    pub fn to_text(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("lock serialises");
        s.push('\n');
        s
    }
}
