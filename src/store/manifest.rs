//! One manifest per committed stage run.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Version of the manifest format. History: 1 — first version.
pub const MANIFEST_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub digest: String,
    pub size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub fingerprint: String,
    pub kind: String,
    /// The stage name in the recipe that built it (another recipe may reuse it under another name).
    pub stage: String,
    /// What went into the fingerprint (settings, device, input fingerprints, source digests).
    pub inputs: serde_json::Value,
    pub files: BTreeMap<String, FileEntry>,
    /// Stage results: losses, token counts, export sizes…
    pub metrics: serde_json::Value,
    /// Facts about the run that do not change its output (threads, host, timings).
    pub run: serde_json::Value,
    pub rtune_version: String,
}

impl Manifest {
    pub fn new(fingerprint: &str, kind: &str, stage: &str) -> Manifest {
        Manifest {
            format: MANIFEST_VERSION,
            fingerprint: fingerprint.to_string(),
            kind: kind.to_string(),
            stage: stage.to_string(),
            inputs: serde_json::Value::Null,
            files: BTreeMap::new(),
            metrics: serde_json::Value::Null,
            run: serde_json::Value::Null,
            rtune_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// Digests are blake3 hex and file names stay inside the artifact; a manifest that breaks
    /// either (hand-edited or damaged) is not trusted.
    pub fn is_well_formed(&self) -> bool {
        let hex64 = |d: &str| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit());
        self.files.iter().all(|(rel, f)| {
            hex64(&f.digest)
                && !rel.is_empty()
                && !rel.starts_with('/')
                && !rel.contains('\\')
                && rel.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
        })
    }

    /// The recipe the run that built it was given (as named on the command line).
    pub fn recipe(&self) -> &str {
        self.run.get("recipe").and_then(serde_json::Value::as_str).unwrap_or("-")
    }

    pub fn total_size(&self) -> u64 {
        self.files.values().map(|f| f.size).sum()
    }
}
