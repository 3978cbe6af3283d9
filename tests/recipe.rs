//! The recipe engine through the real binary: every kind of mistake rendered as a located
//! diagnostic (snapshots), the shipped recipes, plan rendering, and a pinned fingerprint.

mod common;

use std::collections::BTreeSet;

use common::*;

fn validate(file: &str, extra: &[&str]) -> (i32, String) {
    let dir = root().join("tests/fixtures/invalid");
    let cache = tempfile::tempdir().unwrap();
    let mut args = vec!["validate", file];
    args.extend_from_slice(extra);
    let o = rtune(&dir, cache.path(), &args);
    (o.status.code().unwrap_or(-1), stderr(&o))
}

#[test]
fn every_mistake_is_a_located_snapshot_tested_diagnostic() {
    let mut files: Vec<String> = std::fs::read_dir(root().join("tests/fixtures/invalid"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    files.sort();
    let mut codes = BTreeSet::new();
    for f in &files {
        let extra: &[&str] = if f == "bad_set.toml" { &["--set", "stages.train.epochs=[1,"] } else { &[] };
        let (code, err) = validate(f, extra);
        assert_eq!(code, 1, "{f} should be invalid:\n{err}");
        assert!(!err.contains("panicked"), "{f}: {err}");
        for line in err.lines() {
            if let Some(c) = line.trim().strip_prefix("Error: ") {
                codes.insert(c.to_string());
            }
        }
        snapshot(&format!("invalid/{}.txt", f.trim_end_matches(".toml")), &err);
    }
    assert!(codes.len() >= 12, "only {} distinct diagnostics: {codes:?}", codes.len());
}

#[test]
fn a_bad_set_says_it_came_from_the_command_line() {
    let (code, err) =
        validate("bad_set.toml", &["--set", "stages.train.batch_size=lots", "--set", "stages.train.epohcs=2"]);
    assert_eq!(code, 1);
    assert!(err.contains("╭─[--set:1:"), "{err}");
    assert!(err.contains("`stages.train.batch_size` must be an integer, found a string"), "{err}");
    assert!(err.contains("did you mean `epochs`?"), "{err}");
}

#[test]
fn env_layers_sit_between_the_file_and_set() {
    let dir = root().join("tests/fixtures/invalid");
    let cache = tempfile::tempdir().unwrap();
    let o = common::rtune_cmd()
        .args(["validate", "bad_set.toml"])
        .current_dir(&dir)
        .env("RTUNE_CACHE_DIR", cache.path())
        .env("NO_COLOR", "1")
        .env("RTUNE_STAGES__TRAIN__EPOCHS", "zero")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1));
    assert!(err.contains("[env RTUNE_STAGES__TRAIN__EPOCHS:1:"), "{err}");
}

#[test]
fn shipped_recipes_validate_and_the_offline_one_plans() {
    let cache = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(root().join("recipes")).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "toml") {
            let o = rtune(&root(), cache.path(), &["validate", p.to_str().unwrap()]);
            assert!(o.status.success(), "{}: {}", p.display(), stderr(&o));
        }
    }
    let ls = stdout(&rtune(&root(), cache.path(), &["ls"]));
    for name in [
        "tiny-offline",
        "qwen2.5-3b-lora-rocm",
        "qwen3-0.6b-lora",
        "qwen3-8b-qlora",
        "gemma3-270m-lora",
        "gemma3-4b-lora",
        "smollm2-135m-lora",
        "smollm2-360m-lora",
    ] {
        assert!(ls.contains(name), "{ls}");
    }
    let p = Project::tiny_offline();
    let o = p.run(&["plan", "tiny.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.starts_with("plan for recipe `tiny-offline` on cpu (f32)\n"), "{text}");
    assert!(text.contains("7 to run, 0 cached"), "{text}");
    let dot = stdout(&p.run(&["plan", "tiny.toml", "--format", "dot"]));
    assert!(dot.contains("\"tokenize\" -> \"train\";"), "{dot}");
}

/// Changing these fingerprints invalidates every user's cache: do it on purpose, with a
/// FINGERPRINT_VERSION (or stage version) bump, never by accident. One stage of every kind (two
/// evaluates: with and without trained weights). The keys' JSON layout is pinned by
/// `plan::key`'s unit test.
#[test]
fn golden_fingerprints() {
    let p = Project::tiny_offline();
    let o = p.run(&["plan", "tiny.toml", "--format", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let got: Vec<(String, String)> = plan["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap().to_string(), s["fingerprint"].as_str().unwrap().to_string()))
        .collect();
    let want = [
        ("download", "0272862a2302a0cc87f69b2d54b37879ccd86c4bdf0a11356562600578e3108a"),
        ("tokenize", "e017def9e04bad440ee17c8614c82239add69ab55befe61002700ebd1cb2c014"),
        ("train", "5cc9164ab4ff3e786c837fd57aa152ca61d4ce330e4c2ecc854c2db0fcda322d"),
        ("eval_base", "26d058c4e24b4898c38c17a2295d46b8177af30541988a8f523f4697a8003806"),
        ("evaluate", "35a5fc8c449493e72f228276e9b6513d73534504a560612ffef1dffc569c63d9"),
        ("quantize", "2415127de54a83dea850d56fdd64e15003e12117dd7b98b96fb211dabdc904de"),
        ("upload", "9b1574c26e5b41a755ee5af85260cf2e2dcd8549f1333c9e9ca1cd1e245d92ec"),
    ];
    let want: Vec<(String, String)> = want.iter().map(|(n, f)| (n.to_string(), f.to_string())).collect();
    assert_eq!(got, want);
}

#[test]
fn equivalent_spellings_share_a_fingerprint() {
    let p = Project::tiny_offline();
    let fp = |set: &str| {
        let o = p.run(&["plan", "tiny.toml", "--format", "json", "--set", set]);
        let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        plan["stages"][2]["fingerprint"].as_str().unwrap().to_string()
    };
    assert_eq!(fp("stages.train.learning_rate=1e-2"), fp("stages.train.learning_rate=0.01"));
    assert_eq!(fp("stages.train.weight_decay=0"), fp("stages.train.weight_decay=0.0"));
    assert_ne!(fp("stages.train.learning_rate=1e-2"), fp("stages.train.learning_rate=2e-2"));
}

/// Issue 20: a scratch model's tokenizer is trained on the dataset rendered with its format and
/// column map, so changing either changes the download fingerprint (it used to stay cached and
/// hand a stale tokenizer downstream).
#[test]
fn scratch_tokenizer_corpus_settings_change_the_download_fingerprint() {
    let p = Project::tiny_offline();
    let fp = |extra: &[&str]| {
        let mut args = vec!["plan", "tiny.toml", "--json"];
        args.extend_from_slice(extra);
        let o = p.run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        plan["stages"][0]["fingerprint"].as_str().unwrap().to_string()
    };
    let base = fp(&[]);
    assert_ne!(base, fp(&["--set", "dataset.format=text"]));
    assert_ne!(base, fp(&["--set", r#"dataset.column_map={instruction="input", input="instruction"}"#]));
    assert_eq!(base, fp(&["--set", "stages.train.learning_rate=1e-3"]));
}

/// Template variables shape the rows, so they are tokenize's (and what follows it), not the
/// model's; without them the fingerprints stay as they were (`golden_fingerprints`).
#[test]
fn chat_template_kwargs_change_the_tokenize_fingerprint() {
    let p = Project::tiny_offline();
    let fps = |extra: &[&str]| -> Vec<String> {
        let mut args = vec!["plan", "tiny.toml", "--json"];
        args.extend_from_slice(extra);
        let o = p.run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        plan["stages"].as_array().unwrap().iter().map(|s| s["fingerprint"].as_str().unwrap().to_string()).collect()
    };
    let base = fps(&[]);
    let off = fps(&["--set", "dataset.chat_template_kwargs={enable_thinking=false}"]);
    assert_eq!(base[0], off[0], "download");
    assert_ne!(base[1], off[1], "tokenize");
    assert_ne!(base[2], off[2], "train");
    // How rtune renders chat templates is versioned in chat rows' keys only.
    let doc = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["plan", "tiny.toml", "--json"];
        args.extend_from_slice(extra);
        let plan: serde_json::Value = serde_json::from_slice(&p.run(&args).stdout).unwrap();
        plan["stages"][1]["doc"]["settings"].clone()
    };
    assert_eq!(doc(&["--set", "dataset.format=chat"])["chat_rendering"], 2);
    assert!(doc(&[]).get("chat_rendering").is_none());
}

/// Issue 20: the engine changes the last bits of training, so asking for one (`RTUNE_ENGINE`)
/// is in the fingerprint of the stages that compute; without it, fingerprints stay as they were.
#[test]
fn the_requested_engine_is_in_the_fingerprint() {
    let p = Project::tiny_offline();
    let fps = |engine: Option<&str>| -> Vec<String> {
        let mut c = rtune_cmd();
        c.args(["plan", "tiny.toml", "--json"]).current_dir(p.path()).env("RTUNE_CACHE_DIR", p.cache());
        match engine {
            Some(e) => c.env("RTUNE_ENGINE", e),
            None => c.env_remove("RTUNE_ENGINE"),
        };
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        plan["stages"].as_array().unwrap().iter().map(|s| s["fingerprint"].as_str().unwrap().to_string()).collect()
    };
    let (none, candle, fused) = (fps(None), fps(Some("candle")), fps(Some("fused")));
    assert_eq!(none[..2], candle[..2], "download and tokenize do not compute with an engine");
    assert_ne!(none[2], candle[2]);
    assert_ne!(candle[2], fused[2]);
}

/// Issue 20: quantize writes the base model's name into the PEFT adapter
/// (`base_model_name_or_path`) and upload into the model card, so moving a local base model to
/// another path (same content: `download` stays cached) re-runs both. Before the typed keys,
/// both read `model.path` from the loaded recipe, unhashed, and stayed cached with the old name.
#[test]
fn a_local_base_models_path_is_in_the_exports_fingerprint() {
    let dir = tempfile::tempdir().unwrap();
    let model = root().join("tests/fixtures/golden/tiny-llama/model");
    for copy in ["base-a", "base-b"] {
        std::fs::create_dir_all(dir.path().join(copy)).unwrap();
        for f in std::fs::read_dir(&model).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, dir.path().join(copy).join(f.file_name().unwrap())).unwrap();
        }
    }
    std::fs::create_dir_all(dir.path().join("data")).unwrap();
    std::fs::copy(root().join("recipes/data/synthetic-alpaca.jsonl"), dir.path().join("data/d.jsonl")).unwrap();
    std::fs::write(
        dir.path().join("r.toml"),
        r#"[recipe]
name = "moved-base"
[model]
path = "base-a"
[dataset]
path = "data/d.jsonl"
format = "alpaca"
[stages.train]
max_steps = 1
[stages.quantize]
formats = ["peft-adapter"]
[stages.upload]
to = "dir://out"
"#,
    )
    .unwrap();
    let cache = dir.path().join("cache");
    let fps = |path: &str| -> std::collections::BTreeMap<String, String> {
        let o = rtune(dir.path(), &cache, &["plan", "r.toml", "--json", "--set", &format!("model.path={path}")]);
        assert!(o.status.success(), "{}", stderr(&o));
        let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        plan["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["name"].as_str().unwrap().to_string(), s["fingerprint"].as_str().unwrap().to_string()))
            .collect()
    };
    let (a, b) = (fps("base-a"), fps("base-b"));
    assert_eq!(a["download"], b["download"], "the same content downloads to the same artifact");
    assert_eq!(a["train"], b["train"]);
    assert_ne!(a["quantize"], b["quantize"], "the adapter names its base by path");
    assert_ne!(a["upload"], b["upload"], "the card names the base model");
}
