//! Helpers shared by the integration tests: run the real binary, compare snapshots.
#![allow(dead_code)]

pub mod golden;
pub mod gpu;
pub mod hub;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `rtune` binary with one compute thread: the test harness runs tests in parallel (two on
/// two cores), and two rtune processes each spinning up a pool per core oversubscribe the
/// machine badly (the pipeline tests took 4x longer in parallel than one after another).
///
/// `RTUNE_TEST_RUNNER` (a program and its arguments, split at spaces) runs each `rtune` through
/// it, as cargo's runner variable does for test binaries: .ci/run runs the Vulkan recipe's
/// processes on Mesa 26's lavapipe under the validation layer (`scripts/toolchain/newer-mesa.sh validate`).
pub fn rtune_cmd() -> Command {
    let bin = env!("CARGO_BIN_EXE_rtune");
    let runner = std::env::var("RTUNE_TEST_RUNNER").unwrap_or_default();
    let mut words = runner.split_whitespace();
    let mut c = match words.next() {
        Some(program) => {
            let mut c = Command::new(program);
            c.args(words).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    c.env("RAYON_NUM_THREADS", "1");
    c
}

/// Run `rtune` in `cwd` with its own cache, no colour and no progress bars.
pub fn rtune(cwd: &Path, cache: &Path, args: &[&str]) -> Output {
    rtune_with(cwd, cache, args, &[])
}

/// [`rtune`] with more environment variables.
pub fn rtune_with(cwd: &Path, cache: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    rtune_cmd()
        .args(args)
        .current_dir(cwd)
        .env("RTUNE_CACHE_DIR", cache)
        .env("NO_COLOR", "1")
        .env("RTUNE_NO_PROGRESS", "1")
        .env_remove("HF_HUB_OFFLINE")
        .envs(env.iter().copied())
        .output()
        .expect("rtune runs")
}

/// A JSON file's value (artifacts' metrics, exported configs).
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Compare `actual` with `tests/snapshots/<name>`; `RTUNE_BLESS=1` rewrites the snapshot.
pub fn snapshot(name: &str, actual: &str) {
    let path = root().join("tests/snapshots").join(name);
    if std::env::var_os("RTUNE_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("no snapshot {} (run with RTUNE_BLESS=1)", path.display()));
    assert_eq!(expected, actual, "snapshot {name} differs (RTUNE_BLESS=1 rewrites it)");
}

/// A temporary project: the tiny-offline recipe and its data, and a cache folder.
pub struct Project {
    pub dir: tempfile::TempDir,
}

impl Project {
    pub fn tiny_offline() -> Project {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("data")).unwrap();
        std::fs::copy(root().join("recipes/tiny-offline.toml"), dir.path().join("tiny.toml")).unwrap();
        std::fs::copy(
            root().join("recipes/data/synthetic-alpaca.jsonl"),
            dir.path().join("data/synthetic-alpaca.jsonl"),
        )
        .unwrap();
        Project { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn cache(&self) -> PathBuf {
        self.dir.path().join("cache")
    }

    pub fn run(&self, args: &[&str]) -> Output {
        rtune(self.path(), &self.cache(), args)
    }

    /// `rtune plan tiny.toml` with each of `sets` as a `--set`.
    pub fn plan(&self, sets: &[&str]) -> Output {
        let mut args = vec!["plan", "tiny.toml"];
        for s in sets {
            args.extend(["--set", s]);
        }
        self.run(&args)
    }

    /// `rtune run … --json`, returning stage name → outcome, asserting success.
    pub fn run_json(&self, args: &[&str]) -> serde_json::Value {
        self.run_json_with(args, &[])
    }

    /// [`Self::run_json`] with more environment variables.
    pub fn run_json_with(&self, args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
        let mut all = vec!["run"];
        all.extend_from_slice(args);
        all.push("--json");
        let o = rtune_with(self.path(), &self.cache(), &all, env);
        assert!(o.status.success(), "rtune {all:?} failed:\n{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    }
}

pub fn outcomes(report: &serde_json::Value) -> Vec<(String, String)> {
    report["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap().to_string(), s["outcome"].as_str().unwrap().to_string()))
        .collect()
}
