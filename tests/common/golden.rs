//! The golden fixtures (tests/fixtures/golden, made by tests/fixtures/golden/make_golden.py with
//! transformers and PEFT): each one's folder, and its batch with the positions that count.

use std::path::{Path, PathBuf};

use rtune::engine::HostBatch;

/// The golden fixture `name`'s folder.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden").join(name)
}

/// A golden fixture's batch (`expected.json`'s ids, lengths, and the positions whose next token
/// counts, as transformers shifts labels) and everything transformers computed on it.
pub struct Golden {
    pub rows: Vec<Vec<u32>>,
    pub lens: Vec<usize>,
    pub select: Vec<u32>,
    pub targets: Vec<u32>,
    pub expected: serde_json::Value,
}

pub fn golden(name: &str) -> Golden {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected.json")).unwrap()).unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(expected["ids"].clone()).unwrap();
    let mask: Vec<Vec<u32>> = serde_json::from_value(expected["mask"].clone()).unwrap();
    let labels: Vec<Vec<i64>> = serde_json::from_value(expected["labels"].clone()).unwrap();
    let t = rows[0].len();
    let lens = mask.iter().map(|m| m.iter().sum::<u32>() as usize).collect();
    // transformers shifts: position i predicts labels[i + 1]; -100 is ignored.
    let (mut select, mut targets) = (Vec::new(), Vec::new());
    for (r, l) in labels.iter().enumerate() {
        for i in 0..t - 1 {
            if l[i + 1] >= 0 {
                select.push((r * t + i) as u32);
                targets.push(l[i + 1] as u32);
            }
        }
    }
    Golden { rows, lens, select, targets, expected }
}

impl Golden {
    /// The batch as engines take it.
    pub fn host_batch(&self) -> HostBatch {
        HostBatch::from_parts(&self.rows, &self.lens, None, self.select.clone(), self.targets.clone())
    }
}
