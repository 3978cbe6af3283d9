//! Start-up and cached re-runs of the `rtune` binary: `rtune ls`, `rtune plan` of the default
//! recipe, and `rtune run` of the default recipe (seven stages) with every stage cached, in a
//! private cache. Median wall time of 20 runs each (after one full run that fills the cache). Run:
//!
//!     cargo bench --bench startup

mod common;

use std::process::Command;
use std::time::Instant;

fn main() {
    let reps = if common::smoke() { 2 } else { 20 };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let cache = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let recipe = root.join("recipes/tiny-offline.toml");
    let upload = format!("stages.upload.to=dir://{}", out.path().display());
    let rtune = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_rtune"))
            .args(args)
            .env("RTUNE_CACHE_DIR", cache.path())
            .env("RTUNE_NO_PROGRESS", "1")
            .output()
            .unwrap();
        assert!(o.status.success(), "rtune {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    let recipe = recipe.to_str().unwrap();
    let run = ["run", recipe, "--set", &upload];
    rtune(&run);
    for (name, args) in [
        ("rtune ls", &["ls"][..]),
        ("rtune plan (7 stages)", &["plan", recipe][..]),
        ("rtune run, all cached", &run[..]),
    ] {
        let mut times: Vec<f64> = (0..reps)
            .map(|_| {
                let start = Instant::now();
                rtune(args);
                start.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        println!("  {name:<24} median {:.1} ms", times[times.len() / 2] * 1e3);
    }
}
