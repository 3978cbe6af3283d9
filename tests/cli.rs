//! The command line itself: help texts, the checked-in schema and generated docs are fresh,
//! `ls`/`cp`/`cat`, cache commands, and the library example.

mod common;

use common::*;

#[test]
fn help_texts_are_complete_and_snapshot_tested() {
    let cache = tempfile::tempdir().unwrap();
    let top = rtune(&root(), cache.path(), &["--help"]);
    assert!(top.status.success());
    snapshot("help/rtune.txt", &stdout(&top));
    // Every command the top-level help lists.
    let text = stdout(&top);
    let commands: Vec<String> = text
        .split("Commands:\n")
        .nth(1)
        .unwrap()
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() >= 12, "{commands:?}");
    for cmd in &commands {
        let cmd = cmd.as_str();
        let o = rtune(&root(), cache.path(), &[cmd, "--help"]);
        assert!(o.status.success(), "{cmd}");
        snapshot(&format!("help/{cmd}.txt"), &stdout(&o));
    }
    let bad = rtune(&root(), cache.path(), &["frobnicate"]);
    assert_eq!(bad.status.code(), Some(2), "usage errors exit 2");
}

#[test]
fn checked_in_schema_and_reference_are_fresh() {
    let cache = tempfile::tempdir().unwrap();
    let schema = stdout(&rtune(&root(), cache.path(), &["schema"]));
    let path = root().join("schemas/recipe.schema.json");
    let reference = rtune::recipe::reference::markdown();
    let ref_path = root().join("docs/recipe-reference.md");
    if std::env::var_os("RTUNE_BLESS").is_some() {
        std::fs::write(&path, &schema).unwrap();
        std::fs::write(&ref_path, &reference).unwrap();
    }
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        schema,
        "schemas/recipe.schema.json is stale (RTUNE_BLESS=1 rewrites it)"
    );
    assert_eq!(
        std::fs::read_to_string(&ref_path).unwrap(),
        reference,
        "docs/recipe-reference.md is stale (RTUNE_BLESS=1 rewrites it)"
    );
    for key in ["learning_rate", "eval_fraction", "warmup_ratio", "`[device]`"] {
        assert!(reference.contains(key), "reference lacks {key}");
    }
}

#[test]
fn cp_copies_a_builtin_recipe_with_its_data_and_it_validates() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let o = rtune(dir.path(), &cache, &["cp", "tiny-offline", "mine.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(dir.path().join("data/synthetic-alpaca.jsonl").is_file());
    assert!(rtune(dir.path(), &cache, &["validate", "mine.toml"]).status.success());
    let again = rtune(dir.path(), &cache, &["cp", "tiny-offline", "mine.toml"]);
    assert_eq!(again.status.code(), Some(1), "never overwrites");
    let typo = rtune(dir.path(), &cache, &["cp", "tiny-ofline", "x.toml"]);
    assert!(stderr(&typo).contains("did you mean `tiny-offline`?"), "{}", stderr(&typo));
    let cat = rtune(dir.path(), &cache, &["cat", "tiny-offline", "--set", "stages.train.epochs=3"]);
    assert!(stdout(&cat).contains("epochs = 3"), "{}", stdout(&cat));
    // Resolved, the recipe loads back as the same stages: every fingerprint but the card's,
    // which carries the recipe's text.
    std::fs::write(dir.path().join("resolved.toml"), stdout(&cat)).unwrap();
    let plan = |args: &[&str]| {
        let o = rtune(dir.path(), &cache, args);
        assert!(o.status.success(), "{}", stderr(&o));
        let rows: Vec<(String, String)> = stdout(&o)
            .lines()
            .skip_while(|l| !l.starts_with("STAGE"))
            .skip(1)
            .take_while(|l| !l.is_empty())
            .map(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                (cols[0].trim_end_matches('*').to_string(), cols[4].to_string())
            })
            .collect();
        rows
    };
    let resolved = plan(&["plan", "resolved.toml"]);
    let layered = plan(&["plan", "mine.toml", "--set", "stages.train.epochs=3"]);
    assert_eq!(resolved.len(), 7, "{resolved:?}");
    for (a, b) in resolved.iter().zip(&layered) {
        assert_eq!(a.0, b.0);
        assert!(a.1 == b.1 || a.0 == "upload", "{a:?} vs {b:?}");
    }
}

#[test]
fn builtin_recipe_runs_by_name_from_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let o = rtune(dir.path(), &cache, &["plan", "tiny-offline"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("7 to run"), "{}", stdout(&o));
}

#[test]
fn cache_path_and_doctor() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("c");
    assert_eq!(stdout(&rtune(dir.path(), &cache, &["cache", "path"])).trim(), cache.display().to_string());
    assert!(cache.join("CACHEDIR.TAG").is_file());
    let doc = stdout(&rtune(dir.path(), &cache, &["doctor"]));
    assert!(doc.contains("build features: cuda=false metal=false vulkan=true"), "{doc}");
    // The system, for bug reports.
    let first = format!("rtune {} on {} {}\n", env!("CARGO_PKG_VERSION"), std::env::consts::OS, std::env::consts::ARCH);
    assert!(doc.starts_with(&first), "{doc}");
    assert!(doc.contains("rocm     unavailable: no AMD GPU is visible through Vulkan"), "{doc}");
    // A Vulkan driver (CI installs Mesa's lavapipe and sets RTUNE_REQUIRE_VULKAN) is listed
    // with what it supports; lavapipe has every feature the GPU engine needs, so it is usable.
    let json: serde_json::Value =
        serde_json::from_slice(&rtune(dir.path(), &cache, &["doctor", "--json"]).stdout).unwrap();
    let vulkan: Vec<&serde_json::Value> =
        json["devices"].as_array().unwrap().iter().filter(|d| d["class"] == "vulkan").collect();
    if std::env::var_os("RTUNE_REQUIRE_VULKAN").is_some() {
        assert!(!vulkan.is_empty(), "RTUNE_REQUIRE_VULKAN is set but doctor lists no Vulkan device: {json}");
    }
    for d in vulkan {
        let id = format!("vulkan:{}", d["ordinal"]);
        assert!(doc.contains(&format!("  {id} {}", d["name"].as_str().unwrap())), "{doc}");
        assert!(d["details"].as_str().unwrap().contains(", Vulkan 1."), "{d}");
        match d["unusable"].as_str() {
            None => assert!(d["dtypes"].as_array().unwrap().iter().any(|t| t == "f32"), "{d}"),
            Some(why) => assert!(why.starts_with("the GPU engine needs "), "{d}"),
        }
        if std::env::var_os("RTUNE_REQUIRE_VULKAN").is_some() && d["name"].as_str().unwrap().starts_with("llvmpipe") {
            assert!(d["unusable"].is_null(), "lavapipe has every feature the engine needs: {d}");
        }
    }
    if json["devices"].as_array().unwrap().iter().all(|d| d["class"] != "vulkan") {
        assert!(json["vulkan_note"].is_string(), "no Vulkan device and no reason: {json}");
    }
}

/// `RTUNE_VULKAN_LIBRARY` names the one Vulkan library to open: one that is not there is a
/// located reason in doctor (never a crash, nor a silent search elsewhere); the system's loader
/// named so lists what it lists by default, and doctor says which library listed the devices.
#[test]
fn the_vulkan_library_can_be_named() {
    let dir = tempfile::tempdir().unwrap();
    let doctor_with = |lib: Option<&str>, env: &[(&str, &str)]| -> serde_json::Value {
        let mut cmd = rtune_cmd();
        cmd.args(["doctor", "--json"]).current_dir(dir.path()).env("RTUNE_CACHE_DIR", dir.path());
        cmd.envs(env.iter().copied());
        match lib {
            Some(l) => cmd.env("RTUNE_VULKAN_LIBRARY", l),
            None => cmd.env_remove("RTUNE_VULKAN_LIBRARY"),
        };
        let o = cmd.output().expect("rtune runs");
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let doctor = |lib: Option<&str>| doctor_with(lib, &[]);
    let vulkan =
        |j: &serde_json::Value| j["devices"].as_array().unwrap().iter().filter(|d| d["class"] == "vulkan").count();
    let missing = doctor(Some("/nonexistent/libvulkan.so.1"));
    let note = missing["vulkan_note"].as_str().unwrap_or_default();
    assert!(note.starts_with("no Vulkan loader (/nonexistent/libvulkan.so.1: "), "{missing}");
    assert_eq!(vulkan(&missing), 0, "{missing}");
    assert!(missing["vulkan_library"].is_null(), "{missing}");
    if std::env::var_os("RTUNE_REQUIRE_VULKAN").is_some() {
        let default = doctor(None);
        assert_eq!(default["vulkan_library"], "libvulkan.so.1", "{default}");
        let named = doctor(Some("libvulkan.so.1"));
        assert_eq!(vulkan(&named), vulkan(&default), "{named}");
        assert!(vulkan(&named) > 0, "{named}");
        assert_eq!(named["vulkan_library"], "libvulkan.so.1", "{named}");
        // The loader opens but finds no driver: said so, not "no loader".
        let no_driver =
            doctor_with(None, &[("VK_ICD_FILENAMES", "/nonexistent.json"), ("VK_DRIVER_FILES", "/nonexistent.json")]);
        let note = no_driver["vulkan_note"].as_str().unwrap_or_default();
        assert!(note.starts_with("no usable Vulkan driver (libvulkan.so.1: vkCreateInstance failed: "), "{no_driver}");
    }
}

/// `doctor --check` runs each GPU's products and attention in every dtype it trains in and says
/// which kernels ran, with the products' rate; without a GPU it says there is none to check.
#[test]
fn doctor_check_says_which_kernels_run_on_each_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let doctor = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = rtune_cmd();
        cmd.args(["doctor", "--check"]).args(args).current_dir(dir.path()).env("RTUNE_CACHE_DIR", dir.path());
        let o = cmd.envs(env.iter().copied()).env_remove("RTUNE_VULKAN_LIBRARY").output().expect("rtune runs");
        assert!(o.status.success(), "{}", stderr(&o));
        o
    };
    let none = [("VK_ICD_FILENAMES", "/nonexistent.json"), ("VK_DRIVER_FILES", "/nonexistent.json")];
    if !cfg!(feature = "cuda") {
        let text = stdout(&doctor(&[], &none));
        assert!(text.contains("kernel checks:\n  no GPU for the GPU engine\n"), "{text}");
    }
    if std::env::var_os("RTUNE_REQUIRE_VULKAN").is_none() {
        return;
    }
    let v: serde_json::Value = serde_json::from_slice(&doctor(&["--json"], &[]).stdout).unwrap();
    let checks = v["checks"].as_array().unwrap();
    let vk = checks.iter().find(|c| c["device"] == "vulkan:0").unwrap_or_else(|| panic!("{v}"));
    let dtypes: Vec<&str> = vk["dtypes"].as_array().unwrap().iter().map(|d| d["dtype"].as_str().unwrap()).collect();
    let listed = v["devices"].as_array().unwrap().iter().find(|d| d["class"] == "vulkan" && d["ordinal"] == 0).unwrap();
    assert_eq!(serde_json::json!(dtypes), listed["dtypes"], "every dtype the device trains in: {v}");
    for d in vk["dtypes"].as_array().unwrap() {
        assert!(d["products"].as_str().unwrap().starts_with("products "), "{d}");
        assert!(d["attention"].as_str().unwrap().starts_with("attention "), "{d}");
        assert!(d["tflops"].as_f64().unwrap() > 0.0 && d["size"].as_u64().unwrap() >= 256, "{d}");
        assert!(d["error"].is_null(), "{d}");
    }
    let text = stdout(&doctor(&[], &[]));
    assert!(text.contains("kernel checks:\n  vulkan:0 ") && text.contains(" TFLOP/s ("), "{text}");
}

#[test]
fn explain_shows_fingerprint_inputs() {
    let p = Project::tiny_offline();
    let o = p.run(&["explain", "tiny.toml", "train", "--diff"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("\"learning_rate\": 0.002"), "{text}");
    assert!(text.contains("no earlier run of `train` is recorded"), "{text}");
    // The upload reads the train stage's metrics and loss curve for its card: a declared input,
    // not something its executor finds in the plan.
    let o = p.run(&["explain", "tiny.toml", "upload"]);
    let text = stdout(&o);
    assert!(text.contains("\"card:train\": \"") && text.contains("\"card:eval:evaluate\": \""), "{text}");
    // A misspelt stage gets the closest name, as `run --only` does.
    let o = p.run(&["explain", "tiny.toml", "trian"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("the recipe has no stage `trian`") && stderr(&o).contains("did you mean `train`?"));
}

/// An upload into a path that is a file is refused by the plan, located at `to`, before any
/// stage runs.
#[test]
fn an_upload_into_a_file_is_refused_by_the_plan() {
    let p = Project::tiny_offline();
    std::fs::write(p.path().join("afile"), b"x").unwrap();
    let o = p.plan(&["stages.upload.to=\"dir://afile\""]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("rtune::plan::bad_destination") && err.contains("afile` is a file"), "{err}");
    assert!(err.contains("names a file"), "{err}");
    assert!(p.plan(&["stages.upload.to=\"dir://a-folder\""]).status.success());
}

/// README promises two commands; CI must run the same test command.
#[test]
fn readme_commands_are_the_ones_ci_runs() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(readme.contains("cargo run --release -- run recipes/tiny-offline.toml"));
    assert!(readme.contains("\ncargo test "), "README gives `cargo test` as the test command");
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(ci.lines().any(|l| l.trim() == "cargo test"), ".ci/run runs the README's test command");
    assert!(root().join("recipes/tiny-offline.toml").is_file());
    // Every doc the README links to exists.
    for link in readme.split("](").skip(1).filter_map(|s| s.split(')').next()) {
        if !link.starts_with("http") {
            assert!(root().join(link).exists(), "README links to missing {link}");
        }
    }
}

/// `[device.<name>]` overrides merge into stage settings only when that device is chosen, and
/// the plan explains every skipped preference (snapshot).
#[test]
fn device_overrides_and_plan_explanation() {
    let p = Project::tiny_offline();
    let plan = |extra: &[&str]| {
        let mut a = vec!["plan", "tiny.toml", "--format", "json"];
        a.extend_from_slice(extra);
        let o = p.run(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let batch = |v: &serde_json::Value| v["stages"][2]["doc"]["settings"]["train"]["batch_size"].as_u64().unwrap();
    assert_eq!(batch(&plan(&[])), 16);
    assert_eq!(batch(&plan(&["--set", "device.cpu.train.batch_size=2"])), 2, "cpu override applies on the CPU");
    assert_eq!(batch(&plan(&["--set", "device.cuda.train.batch_size=2"])), 16, "cuda override does not");
    let text = p.run(&[
        "plan",
        "tiny.toml",
        "--set",
        "device.prefer=[\"rocm\", \"directml\", \"cuda:1\", \"metal\", \"cpu\"]",
        "--set",
        "device.dtype=[\"bf16\", \"f32\"]",
    ]);
    let out = stdout(&text);
    let head: String = out.lines().take(7).map(|l| format!("{l}\n")).collect();
    snapshot("plan/device-fallback.txt", &head);
    let none = p.run(&["plan", "tiny.toml", "--set", "device.prefer=[\"rocm\", \"metal\"]"]);
    assert_eq!(none.status.code(), Some(1));
    assert!(
        stderr(&none).contains("no preferred device is usable: rocm: no AMD GPU is visible through Vulkan"),
        "{}",
        stderr(&none)
    );
}

/// A cache that cannot be created (its parent is a file; permissions do not stop root) is a
/// clear error, not a panic, and nothing is half-written.
#[test]
fn an_unwritable_cache_is_a_clear_error() {
    let p = common::Project::tiny_offline();
    let blocker = p.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let o = rtune(p.path(), &blocker.join("cache"), &["run", "tiny.toml"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("rtune::store::io") && e.contains("not-a-dir/cache"), "{e}");
    assert!(e.contains("check that the cache directory is writable"), "{e}");
    assert!(!e.contains("panicked"), "{e}");
}
