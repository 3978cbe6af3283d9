//! Whole runs of the real binary: caching and invalidation, the default recipe end to end,
//! resume after SIGKILL, the loss guard, and gradient accumulation.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

/// A short training run: a few steps, so cache tests stay fast.
const FAST: &[&str] =
    &["--set", "stages.train.max_steps=6", "--set", "stages.train.eval_every=0", "--set", "stages.train.batch_size=8"];

fn args<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(extra).copied().collect()
}

#[test]
fn second_run_is_cached_and_a_change_reruns_exactly_its_dependents() {
    let p = Project::tiny_offline();
    let first = p.run_json(&args(&["tiny.toml"], FAST));
    assert!(outcomes(&first).iter().all(|(_, o)| o == "built"), "{:?}", outcomes(&first));
    let second = p.run_json(&args(&["tiny.toml"], FAST));
    assert!(outcomes(&second).iter().all(|(_, o)| o == "cached"), "{:?}", outcomes(&second));

    let changed = args(&["tiny.toml"], &args(FAST, &["--set", "stages.train.learning_rate=5e-3"]));
    let plan = stdout(&p.run(&args(&["plan"], &changed)));
    assert!(plan.contains("settings changed: train.learning_rate: 2e-3 → 5e-3"), "{plan}");
    assert!(plan.contains("input changed: train"), "{plan}");
    assert!(plan.contains("4 to run, 3 cached"), "{plan}");
    let third = p.run_json(&changed);
    let o = outcomes(&third);
    let built: Vec<&str> = o.iter().filter(|(_, x)| x == "built").map(|(n, _)| n.as_str()).collect();
    assert_eq!(built, ["train", "evaluate", "quantize", "upload"], "{o:?}");

    // The dataset edited by one byte changes the download fingerprint and everything after.
    let data = p.path().join("data/synthetic-alpaca.jsonl");
    let mut bytes = std::fs::read(&data).unwrap();
    let i = bytes.iter().position(|b| *b == b'?').unwrap();
    bytes[i] = b'!';
    std::fs::write(&data, bytes).unwrap();
    let plan = stdout(&p.run(&args(&["plan"], &changed)));
    assert!(plan.contains("source changed: dataset"), "{plan}");
    assert!(plan.contains("7 to run, 0 cached"), "{plan}");
}

#[test]
fn locked_run_fails_when_the_plan_differs() {
    let p = Project::tiny_offline();
    p.run_json(&args(&["tiny.toml"], FAST));
    let ok = p.run(&args(&["run", "tiny.toml", "--locked"], FAST));
    assert!(ok.status.success(), "{}", stderr(&ok));
    let o = p.run(&args(&["run", "tiny.toml", "--locked", "--set", "stages.train.epochs=5"], FAST));
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(stderr(&o).contains("stage `train` would change: settings.train.epochs: 3 → 5"), "{}", stderr(&o));
}

fn artifact(report: &serde_json::Value, stage: &str) -> PathBuf {
    let s = report["stages"].as_array().unwrap().iter().find(|s| s["name"] == stage).unwrap();
    PathBuf::from(s["artifact"].as_str().unwrap())
}

/// The README's main command: the default recipe end to end. Every artifact exists and loads,
/// training learns (eval loss falls by at least 30%), and the tuned model beats the base.
#[test]
fn default_recipe_end_to_end() {
    let p = Project::tiny_offline();
    // README's tour runs exactly this, in a checkout's layout: its output blocks must be true.
    let readme = ReadmeTour::new();
    let report = p.run_json(&["tiny.toml"]);
    let model_dir = artifact(&report, "download").join("model");
    let folder = rtune::model::ModelFolder::open(&model_dir).unwrap();
    folder.tokenizer().unwrap();
    let tokens = rtune::data::TokenStore::open(&artifact(&report, "tokenize"), "train").unwrap();
    assert!(tokens.len() > 2000);
    let train = artifact(&report, "train");
    let spec = rtune::model::peft::read_config(&train).unwrap();
    assert_eq!(spec.rank, 8);
    assert!(train.join("loss_curve.svg").is_file());
    let m = &report["stages"].as_array().unwrap().iter().find(|s| s["name"] == "train").unwrap()["metrics"];
    let drop = m["eval_loss_drop"].as_f64().unwrap();
    assert!(drop >= 0.30, "eval loss fell only {:.1}%: {m}", drop * 100.0);
    let loss = |stage: &str| {
        report["stages"].as_array().unwrap().iter().find(|s| s["name"] == stage).unwrap()["metrics"]["eval_loss"]
            .as_f64()
            .unwrap()
    };
    assert!(loss("evaluate") < loss("eval_base"), "tuned {} vs base {}", loss("evaluate"), loss("eval_base"));
    // Exports: a PEFT folder, a merged HF folder that loads and computes what the adapter does,
    // and their copies in the upload destination.
    let exports = artifact(&report, "quantize");
    assert_eq!(rtune::model::peft::read_config(&exports.join("peft-adapter")).unwrap().rank, 8);
    let merged = rtune::model::ModelFolder::open(&exports.join("merged")).unwrap();
    merged.tokenizer().unwrap();
    assert!(
        merged
            .load_weights(&candle_core::Device::Cpu, candle_core::DType::F32)
            .unwrap()
            .contains_key("model.embed_tokens.weight")
    );
    let q = &report["stages"].as_array().unwrap().iter().find(|s| s["name"] == "quantize").unwrap()["metrics"];
    assert!(q["formats"]["safetensors-merged"]["max_logit_diff"].as_f64().unwrap() < 1e-3, "{q}");
    let g = &q["formats"]["gguf-q8_0"];
    let ratio = g["perplexity_ratio"].as_f64().unwrap();
    assert!((ratio - 1.0).abs() < 0.02, "q8_0 GGUF perplexity is {:.2}% off the f32 model: {g}", (ratio - 1.0) * 100.0);
    let mut f = std::fs::File::open(exports.join("gguf/model-q8_0.gguf")).unwrap();
    let gguf = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    for key in [
        "general.architecture",
        "llama.block_count",
        "llama.rope.dimension_count",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
    ] {
        assert!(gguf.metadata.contains_key(key), "GGUF lacks {key}");
    }
    for name in
        ["token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output_norm.weight", "output.weight"]
    {
        assert!(gguf.tensor_infos.contains_key(name), "GGUF lacks tensor {name}");
    }
    assert_eq!(gguf.tensor_infos["blk.0.attn_q.weight"].ggml_dtype, candle_core::quantized::GgmlDType::Q8_0);
    let out = p.path().join("out/tiny-offline");
    assert!(out.join("merged/model.safetensors").is_file() && out.join("peft-adapter/adapter_config.json").is_file());
    assert!(out.join("gguf/model-q8_0.gguf").is_file());
    // The Alpaca prompt it trained with, for Ollama, stopping at EOS.
    assert_eq!(q["ollama"]["template"], "alpaca", "{q}");
    let m = std::fs::read_to_string(out.join("gguf/model-q8_0.Modelfile")).unwrap();
    assert!(m.contains("FROM ./model-q8_0.gguf\n") && m.contains("PARAMETER stop \"</s>\"\n"), "{m}");
    // The model card says how to run it: llama-server with the file's template, and Ollama.
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(card.contains("## Try it") && card.contains("llama-server -m gguf/model-q8_0.gguf --jinja"), "{card}");
    assert!(card.contains("ollama create my-model -f gguf/model-q8_0.Modelfile"), "{card}");
    let again = p.run(&["run", "tiny.toml"]);
    assert!(stderr(&again).matches("    cached  ").count() == 7, "{}", stderr(&again));
    readme.check();
}

/// README.md's "30-second tour", run as a newcomer runs it (from a checkout's root, on
/// `recipes/tiny-offline.toml`, with a fresh cache), and compared with its output blocks: the
/// plan table byte for byte; the run's lines and the `--set` plan's rows with timings, the
/// cache path and fingerprints (shown as `…`) normalised.
struct ReadmeTour {
    dir: tempfile::TempDir,
    plan: String,
}

impl ReadmeTour {
    fn new() -> ReadmeTour {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("recipes/data")).unwrap();
        std::fs::copy(root().join("recipes/tiny-offline.toml"), dir.path().join("recipes/tiny-offline.toml")).unwrap();
        std::fs::copy(
            root().join("recipes/data/synthetic-alpaca.jsonl"),
            dir.path().join("recipes/data/synthetic-alpaca.jsonl"),
        )
        .unwrap();
        let o = rtune(dir.path(), &dir.path().join("cache"), &["plan", "recipes/tiny-offline.toml"]);
        assert!(o.status.success(), "{}", stderr(&o));
        ReadmeTour { plan: stdout(&o), dir }
    }

    /// The lines of the README block that starts with `$ <command>`.
    fn block(command: &str) -> Vec<String> {
        let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
        let start = readme.find(&format!("$ {command}\n")).unwrap_or_else(|| panic!("README has no `$ {command}`"));
        let body = &readme[start..];
        let body = &body[body.find('\n').unwrap() + 1..body.find("```").unwrap()];
        body.lines().map(str::to_string).collect()
    }

    fn check(&self) {
        let (dir, cache) = (self.dir.path(), self.dir.path().join("cache"));
        assert_eq!(
            Self::block("rtune plan recipes/tiny-offline.toml").join("\n") + "\n",
            self.plan,
            "README's plan block"
        );

        let o = rtune(dir, &cache, &["run", "recipes/tiny-offline.toml"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let home = cache.display().to_string();
        let actual: Vec<String> = format!("{}{}", stderr(&o), stdout(&o))
            .lines()
            .map(|l| normalise(&l.replace(&home, "~/.cache/rtune")))
            .collect();
        for line in Self::block("rtune run recipes/tiny-offline.toml").iter().filter(|l| l.as_str() != "…") {
            let want = normalise(line);
            assert!(
                actual.contains(&want),
                "README's run block says\n{want}\nbut the run printed\n{}",
                actual.join("\n")
            );
        }

        let command = "rtune plan recipes/tiny-offline.toml --set stages.train.learning_rate=5e-3";
        let args: Vec<&str> = command.split(' ').skip(1).collect();
        let o = rtune(dir, &cache, &args);
        let actual: Vec<String> = stdout(&o).lines().map(hide_fingerprint).collect();
        for line in Self::block(command) {
            assert!(
                actual.contains(&line),
                "README's --set block says\n{line}\nbut plan printed\n{}",
                actual.join("\n")
            );
        }
    }
}

/// `(7.3s, 69688 tok/s)` → `(…)`, as the floating-point noise figures of the quantize lines (the
/// logit difference, the GGUF's perplexity, its ratio and its top-token agreement); artifact paths cut to their 8-digit
/// prefix and `…`, as the README shows them; trailing spaces dropped.
fn normalise(line: &str) -> String {
    let mut out = line.trim_end().to_string();
    if let Some(i) = out.find(" steps (") {
        out = format!("{} steps (…)", &out[..i]);
    }
    // Rounding-level noise that differs between the test build and a release build.
    if let Some(i) = out.find("vs the adapter model ") {
        out = format!("{}vs the adapter model …", &out[..i]);
    }
    if let (Some(a), Some(b)) = (out.find("unquantized ("), out.find("%)")) {
        out = format!("{}unquantized (…){}", &out[..a], &out[b + 2..]);
    }
    // How often its top token is the unquantized model's moves with the same kernels' rounding.
    if let Some(a) = out.find("same top token ")
        && let Some(b) = out[a..].find("% of").map(|i| a + i)
    {
        out = format!("{}same top token …{}", &out[..a], &out[b..]);
    }
    // The GGUF's perplexity comes from candle's quantized kernels, whose last digit moves
    // between CPUs (3.162 on an Intel Xeon, 3.163 on an AMD EPYC).
    if let Some(a) = out.find(".gguf: perplexity ")
        && let Some(b) = out[a..].find(" vs ").map(|i| a + i)
    {
        out = format!("{}.gguf: perplexity …{}", &out[..a], &out[b..]);
    }
    if let Some(i) = out.find("/store-v1/artifacts/") {
        let fp_start = i + "/store-v1/artifacts/".len();
        let fp: String = out[fp_start..].chars().take(8).collect();
        out = format!("{}{fp}…", &out[..fp_start]);
    }
    out
}

/// A plan row with its 12-digit fingerprint shown as `…`, as README's `--set` block does.
fn hide_fingerprint(line: &str) -> String {
    line.split("  ")
        .map(|cell| {
            let c = cell.trim();
            if c.len() == 12 && c.bytes().all(|b| b.is_ascii_hexdigit()) {
                cell.replace(c, "…")
            } else {
                cell.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("  ")
}

/// Start `rtune run tiny.toml` with `set` in the background and wait until training has
/// checkpointed at `step` (false if it finished or stalled first); the child is still running.
fn run_until_checkpoint(p: &Project, set: &[&str], step: u64) -> (std::process::Child, bool) {
    let mut cmd = common::rtune_cmd();
    cmd.args(args(&["run", "tiny.toml"], set))
        .current_dir(p.path())
        .env("RTUNE_CACHE_DIR", p.cache())
        .env("RTUNE_NO_PROGRESS", "1");
    cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let reached = wait_for_checkpoint(&p.cache().join("store-v1/work"), step, &mut child);
    (child, reached)
}

fn wait_for_checkpoint(work_root: &Path, min_step: u64, child: &mut std::process::Child) -> bool {
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        for e in std::fs::read_dir(work_root).into_iter().flatten().flatten() {
            for c in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
                let name = c.file_name().to_string_lossy().to_string();
                if let Some(step) = name.strip_prefix("ckpt-").and_then(|s| s.parse::<u64>().ok())
                    && step >= min_step
                {
                    return true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Kill -9 mid-training, run again: it resumes from the checkpoint and the final adapter is
/// bit-for-bit the adapter of an uninterrupted run.
#[test]
fn resume_after_sigkill_matches_an_uninterrupted_run() {
    let set = [
        "--set",
        "stages.train.max_steps=24",
        "--set",
        "stages.train.checkpoint_every=4",
        "--set",
        "stages.train.eval_every=0",
        "--set",
        "stages.train.batch_size=8",
    ];
    let p = Project::tiny_offline();
    let (mut child, reached) = run_until_checkpoint(&p, &set, 8);
    let _ = child.kill();
    let _ = child.wait();
    assert!(reached, "training finished or stalled before a checkpoint at step 8");
    let o = p.run(&args(&["run", "tiny.toml"], &set));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("continuing from the checkpoint at step"), "{}", stderr(&o));
    let resumed = p.run_json(&args(&["tiny.toml"], &set));

    let fresh = Project::tiny_offline();
    let uninterrupted = fresh.run_json(&args(&["tiny.toml"], &set));
    let a = std::fs::read(artifact(&resumed, "train").join("adapter_model.safetensors")).unwrap();
    let b = std::fs::read(artifact(&uninterrupted, "train").join("adapter_model.safetensors")).unwrap();
    assert!(a == b, "the resumed adapter differs from the uninterrupted one");
    let verify = p.run(&["cache", "verify"]);
    assert!(verify.status.success() && stdout(&verify).contains(", 0 damaged"), "{}", stdout(&verify));
}

#[test]
fn absurd_learning_rate_trips_the_loss_guard() {
    let p = Project::tiny_offline();
    let o = p.run(&[
        "run",
        "tiny.toml",
        "--set",
        "stages.train.learning_rate=10",
        "--set",
        "stages.train.max_steps=60",
        "--set",
        "stages.train.eval_every=0",
        "--set",
        "stages.train.clip_grad_norm=1000",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("rtune::train::loss_guard"), "{err}");
    assert!(err.contains("training stopped by the loss guard after 5 bad steps"), "{err}");
    let ls = stdout(&p.run(&["cache", "ls", "--json"]));
    let list: serde_json::Value = serde_json::from_str(&ls).unwrap();
    assert!(
        list.as_array().unwrap().iter().all(|m| m["kind"] != "train"),
        "a failed train stage left an artifact: {ls}"
    );
}

/// batch 8 × accum 1 and batch 2 × accum 4 take the same optimizer step.
#[test]
fn gradient_accumulation_matches_a_large_batch() {
    let p = Project::tiny_offline();
    let common = [
        "--set",
        "stages.train.max_steps=1",
        "--set",
        "stages.train.eval_every=0",
        "--set",
        "stages.train.schedule.warmup_steps=0",
    ];
    let big = p.run_json(&args(
        &["tiny.toml", "--set", "stages.train.batch_size=8", "--set", "stages.train.grad_accum=1"],
        &common,
    ));
    let small = p.run_json(&args(
        &["tiny.toml", "--set", "stages.train.batch_size=2", "--set", "stages.train.grad_accum=4"],
        &common,
    ));
    let load = |r: &serde_json::Value| {
        rtune::model::peft::read_weights(&artifact(r, "train"), &candle_core::Device::Cpu).unwrap()
    };
    let (a, b) = (load(&big), load(&small));
    let mut max = 0f32;
    let mut moved = 0f32;
    for (k, x) in &a {
        let d = (x - &b[k]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        max = max.max(d);
        if k.contains("lora_B") {
            moved = moved.max(x.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap());
        }
    }
    assert!(moved > 1e-4, "the step did not move the adapter");
    assert!(max < 1e-5, "max difference {max}");
}

/// `--force` rebuilds one stage, `--from` a stage and its dependents, `--only` one stage whose
/// inputs are built (and refuses when they are not), `--until` a stage and what it needs.
#[test]
fn only_from_and_force_select_stages() {
    let p = Project::tiny_offline();
    let only = p.run(&args(&["run", "tiny.toml", "--only", "train"], FAST));
    assert_eq!(only.status.code(), Some(1), "inputs not built yet");
    assert!(stderr(&only).contains("`--only train` needs stage `download`, which is not built"), "{}", stderr(&only));
    p.run_json(&args(&["tiny.toml", "--only", "download"], FAST));
    let r = p.run_json(&args(&["tiny.toml", "--only", "tokenize"], FAST));
    let o = outcomes(&r);
    assert_eq!(o[0], ("download".into(), "cached".into()));
    assert_eq!(o[1], ("tokenize".into(), "built".into()));
    assert!(o[2..].iter().all(|(_, x)| x == "skipped"), "{o:?}");
    // `--until train`: train and what it needs, nothing downstream of it or beside it.
    let plan = p.run(&args(&["plan", "tiny.toml", "--until", "train"], FAST));
    assert!(stdout(&plan).contains("not needed by `train` (--until)"), "{}", stdout(&plan));
    let o = outcomes(&p.run_json(&args(&["tiny.toml", "--until", "train"], FAST)));
    let built: Vec<&str> = o.iter().filter(|(_, x)| x == "built").map(|(n, _)| n.as_str()).collect();
    assert_eq!(built, ["train"], "{o:?}");
    let rest = o.iter().filter(|(n, _)| !["download", "tokenize", "train"].contains(&n.as_str()));
    assert!(rest.clone().count() == 4 && rest.into_iter().all(|(_, x)| x == "skipped"), "{o:?}");
    p.run_json(&args(&["tiny.toml"], FAST));

    let forced = p.run_json(&args(&["tiny.toml", "--force", "eval_base"], FAST));
    let built: Vec<String> = outcomes(&forced).into_iter().filter(|(_, x)| x == "built").map(|(n, _)| n).collect();
    assert_eq!(built, ["eval_base"]);
    let from = p.run_json(&args(&["tiny.toml", "--from", "train"], FAST));
    let built: Vec<String> = outcomes(&from).into_iter().filter(|(_, x)| x == "built").map(|(n, _)| n).collect();
    assert_eq!(built, ["train", "evaluate", "quantize", "upload"]);
    let typo = p.run(&args(&["plan", "tiny.toml", "--force", "trian"], FAST));
    assert!(stderr(&typo).contains("did you mean `train`?"), "{}", stderr(&typo));
}

/// Two runs of one recipe at once on one cache: each stage is built once; the other run waits
/// for the build lock and reuses the artifact.
#[test]
fn concurrent_runs_build_each_stage_once() {
    let p = Project::tiny_offline();
    let spawn = || {
        common::rtune_cmd()
            .args(args(&["run", "tiny.toml", "--json"], FAST))
            .current_dir(p.path())
            .env("RTUNE_CACHE_DIR", p.cache())
            .env("RTUNE_NO_PROGRESS", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(a.status.success() && b.status.success(), "{}\n{}", stderr(&a), stderr(&b));
    let ra: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
    let rb: serde_json::Value = serde_json::from_slice(&b.stdout).unwrap();
    for ((name, x), (_, y)) in outcomes(&ra).into_iter().zip(outcomes(&rb)) {
        let built = [x.as_str(), y.as_str()].iter().filter(|o| **o == "built").count();
        assert_eq!(built, 1, "stage {name} built {built} times ({x}, {y})");
    }
}

/// A byte flipped inside a stored artifact: `cache verify` reports it, the plan says the artifact
/// is damaged, the next run rebuilds it (identically: training is deterministic), and the cache
/// verifies clean again.
#[test]
fn corrupted_artifact_is_reported_and_rebuilt() {
    let p = Project::tiny_offline();
    let first = p.run_json(&args(&["tiny.toml"], FAST));
    let adapter = artifact(&first, "train").join("adapter_model.safetensors");
    let original = std::fs::read(&adapter).unwrap();
    let mut bytes = original.clone();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x5a;
    let mut perm = std::fs::metadata(&adapter).unwrap().permissions();
    #[allow(clippy::permissions_set_readonly_false)]
    perm.set_readonly(false);
    std::fs::set_permissions(&adapter, perm).unwrap();
    std::fs::write(&adapter, &bytes).unwrap();

    let verify = p.run(&["cache", "verify"]);
    assert_eq!(verify.status.code(), Some(1));
    let report = stdout(&verify);
    assert!(
        stdout(&verify).contains("(train train): `adapter_model.safetensors` does not match its digest"),
        "{}",
        stdout(&verify)
    );
    let plan = stdout(&p.run(&args(&["plan", "tiny.toml"], FAST)));
    assert!(plan.contains("artifact damaged (found damaged by `rtune cache verify`); rebuilding"), "{plan}");
    let again = p.run_json(&args(&["tiny.toml"], FAST));
    let built: Vec<String> = outcomes(&again).into_iter().filter(|(_, x)| x == "built").map(|(n, _)| n).collect();
    // The quantize artifact's PEFT export holds the same bytes, so the store keeps one object
    // for both files: both artifacts were damaged, and only they are rebuilt.
    assert!(
        report.contains("(quantize quantize): `peft-adapter/adapter_model.safetensors` does not match"),
        "{report}"
    );
    assert_eq!(built, ["train", "quantize"], "only the damaged artifacts are rebuilt");
    assert_eq!(std::fs::read(&adapter).unwrap(), original, "rebuilt to the same bytes");
    let verify = p.run(&["cache", "verify"]);
    assert!(verify.status.success(), "{}", stdout(&verify));
}

/// Ctrl-C (SIGINT) during training saves a checkpoint and exits with a clear message; the next
/// run resumes from it.
#[cfg(unix)]
#[test]
fn ctrl_c_checkpoints_then_the_next_run_resumes() {
    let set = [
        "--set",
        "stages.train.max_steps=400",
        "--set",
        "stages.train.checkpoint_every=0",
        "--set",
        "stages.train.eval_every=0",
    ];
    let p = Project::tiny_offline();
    let child = common::rtune_cmd()
        .args(args(&["run", "tiny.toml"], &set))
        .current_dir(p.path())
        .env("RTUNE_CACHE_DIR", p.cache())
        .env("RTUNE_NO_PROGRESS", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until training has written metrics, then interrupt.
    let deadline = Instant::now() + Duration::from_secs(300);
    let work = p.cache().join("store-v1/work");
    while Instant::now() < deadline {
        let started = std::fs::read_dir(&work).into_iter().flatten().flatten().any(|e| {
            std::fs::read_to_string(e.path().join("metrics.jsonl")).map(|m| m.lines().count() > 3).unwrap_or(false)
        });
        if started {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("training interrupted at step"), "{err}");
    assert!(err.contains("run the same command again to resume"), "{err}");
    let again = p.run(&args(&["run", "tiny.toml"], &set));
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(stderr(&again).contains("continuing from the checkpoint at step"), "{}", stderr(&again));
}

/// SIGKILL at seeded pseudo-random moments across the whole pipeline (download, tokenize,
/// training and its checkpoints, evaluation, exports, upload), several times in a row; then a
/// normal run. The cache verifies clean and every artifact is byte-identical to an
/// uninterrupted run's.
#[test]
fn kills_at_random_points_never_corrupt_the_cache() {
    let set = args(FAST, &["--set", "stages.train.max_steps=12", "--set", "stages.train.checkpoint_every=2"]);
    let reference = Project::tiny_offline();
    let start = Instant::now();
    let clean = reference.run_json(&args(&["tiny.toml"], &set));
    let total = start.elapsed();

    // Files that record timings or memory of the run that built them, not its results.
    let timing = |f: &str| f == "metrics.json" || f == "metrics.jsonl";
    let files = |d: &Path| -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        let mut stack = vec![d.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap().flatten() {
                let rel = e.path().strip_prefix(d).unwrap().display().to_string();
                if e.file_type().unwrap().is_dir() {
                    stack.push(e.path());
                } else if !timing(&rel) {
                    out.push((rel, std::fs::read(e.path()).unwrap()));
                }
            }
        }
        out.sort();
        out
    };
    let mut x: u64 = 0x5eed;
    for round in 0..6 {
        let p = Project::tiny_offline();
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let frac = 0.05 + 0.9 * ((x >> 33) as f64 / (1u64 << 31) as f64);
        let delay = total.mul_f64(frac);
        let mut child = common::rtune_cmd()
            .args(args(&["run", "tiny.toml"], &set))
            .current_dir(p.path())
            .env("RTUNE_CACHE_DIR", p.cache())
            .env("RTUNE_NO_PROGRESS", "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        let _ = child.kill();
        let _ = child.wait();
        let at = format!("round {round}, killed after {} ms of {} ms", delay.as_millis(), total.as_millis());
        let done = p.run_json(&args(&["tiny.toml"], &set));
        let verify = p.run(&["cache", "verify"]);
        assert!(verify.status.success() && stdout(&verify).contains(", 0 damaged"), "{at}: {}", stdout(&verify));
        for (name, _) in outcomes(&clean) {
            let (a, b) = (files(&artifact(&clean, &name)), files(&artifact(&done, &name)));
            let differ: Vec<&String> = a.iter().zip(&b).filter(|(x, y)| x != y).map(|(x, _)| &x.0).collect();
            assert!(a.len() == b.len() && differ.is_empty(), "{at}: stage {name} differs in {differ:?}");
        }
        let gc = p.run(&["cache", "gc"]);
        assert!(gc.status.success(), "{at}: {}", stderr(&gc));
    }
}

/// A stage about to run re-hashes its inputs: silent damage to an input artifact stops the
/// stage with a clear error (nothing is built from bad bytes), and the next run rebuilds it.
#[test]
fn damaged_inputs_are_caught_before_a_stage_reads_them() {
    let p = Project::tiny_offline();
    let first = p.run_json(&args(&["tiny.toml"], FAST));
    let tokens = artifact(&first, "tokenize");
    let victim = tokens.join("train.ids");
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[0] ^= 0x01; // same size: only a re-hash notices
    let mut perm = std::fs::metadata(&victim).unwrap().permissions();
    #[allow(clippy::permissions_set_readonly_false)]
    perm.set_readonly(false);
    std::fs::set_permissions(&victim, perm).unwrap();
    std::fs::write(&victim, &bytes).unwrap();

    let o = p.run(&args(&["run", "tiny.toml", "--force", "train"], FAST));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("rtune::store::damaged_input") && e.contains("stage `train` cannot start"), "{e}");
    let again = p.run_json(&args(&["tiny.toml"], FAST));
    let built: Vec<String> = outcomes(&again).into_iter().filter(|(_, x)| x == "built").map(|(n, _)| n).collect();
    assert!(built.contains(&"tokenize".to_string()), "{built:?}");
    assert!(p.run(&["cache", "verify"]).status.success());
}

/// A full disk, simulated with a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored, so writes past
/// 256 KiB fail with EFBIG as they would with ENOSPC): the stage that hits it fails with a
/// clear error, nothing partial is committed, and a later run completes.
#[cfg(target_os = "linux")]
#[test]
fn a_full_disk_fails_cleanly_and_loses_nothing() {
    use std::os::unix::process::CommandExt;
    let p = Project::tiny_offline();
    let mut cmd = common::rtune_cmd();
    cmd.args(args(&["run", "tiny.toml"], FAST))
        .current_dir(p.path())
        .env("RTUNE_CACHE_DIR", p.cache())
        .env("RTUNE_NO_PROGRESS", "1")
        .env("NO_COLOR", "1");
    // SAFETY: only async-signal-safe libc calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit { rlim_cur: 256 << 10, rlim_max: 256 << 10 };
            libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("File too large") && !e.contains("panicked"), "{e}");
    // Whatever was committed verifies; the rest is rebuilt by a normal run.
    let verify = p.run(&["cache", "verify"]);
    assert!(verify.status.success() && stdout(&verify).contains(", 0 damaged"), "{}", stdout(&verify));
    let done = p.run_json(&args(&["tiny.toml"], FAST));
    assert!(outcomes(&done).iter().any(|(_, o)| o == "built"));
    assert!(p.run(&["cache", "verify"]).status.success());
}

/// Every file under `dir`, relative path → bytes.
fn tree(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                let rel = e.path().strip_prefix(dir).unwrap().to_string_lossy().replace('\\', "/");
                out.insert(rel, std::fs::read(e.path()).unwrap());
            }
        }
    }
    out
}

/// Issue 19: a `dir://` upload's destination is an output too. A second checkout sharing the
/// cache gets the same files; a deleted or edited exported file is restored from the store
/// (nothing upstream re-runs), and `plan` says why.
#[test]
fn exports_are_restored_in_a_second_checkout_and_after_deletion_or_edit() {
    let first = Project::tiny_offline();
    first.run_json(&args(&["tiny.toml"], FAST));
    let second = Project::tiny_offline();
    let run2 = |a: &[&str]| rtune(second.path(), &first.cache(), a);
    let o = run2(&args(&["run", "tiny.toml", "--json"], FAST));
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let got = outcomes(&report);
    assert!(got.iter().all(|(n, x)| x == if n == "upload" { "restored" } else { "cached" }), "{got:?}");
    let (a, b) = (first.path().join("out/tiny-offline"), second.path().join("out/tiny-offline"));
    let exported = tree(&a);
    assert!(exported.contains_key("gguf/model-q8_0.gguf") && exported.contains_key("merged/config.json"));
    assert_eq!(exported, tree(&b), "the two checkouts' exports differ");

    // Deleted: `plan` names it, `run` copies it back from the store.
    std::fs::remove_file(b.join("gguf/model-q8_0.gguf")).unwrap();
    let plan = stdout(&run2(&args(&["plan", "tiny.toml"], FAST)));
    assert!(plan.contains("restore  destination incomplete: gguf/model-q8_0.gguf missing"), "{plan}");
    assert!(plan.contains("0 to run, 1 to restore, 6 cached"), "{plan}");
    let o = run2(&args(&["run", "tiny.toml"], FAST));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(tree(&b), exported);

    // Edited (same size, so only the digest can tell): restored, the edit kept beside.
    let card = b.join("README.md");
    let mut bytes = std::fs::read(&card).unwrap();
    bytes[0] = b'#';
    std::fs::write(&card, &bytes).unwrap();
    let plan = stdout(&run2(&args(&["plan", "tiny.toml"], FAST)));
    assert!(plan.contains("destination changed: README.md"), "{plan}");
    let o = run2(&args(&["run", "tiny.toml"], FAST));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("had changed since rtune wrote it"), "{}", stderr(&o));
    assert_eq!(std::fs::read(b.join("README.md.rtune-replaced")).unwrap(), bytes);
    std::fs::remove_file(b.join("README.md.rtune-replaced")).unwrap();
    assert_eq!(tree(&b), exported);

    // The whole folder gone; then an intact destination is simply cached.
    std::fs::remove_dir_all(&b).unwrap();
    let plan = stdout(&run2(&args(&["plan", "tiny.toml"], FAST)));
    assert!(plan.contains("restore  destination missing"), "{plan}");
    run2(&args(&["run", "tiny.toml"], FAST));
    let plan = stdout(&run2(&args(&["plan", "tiny.toml"], FAST)));
    assert!(plan.contains("0 to run, 7 cached"), "{plan}");
    assert_eq!(tree(&b), exported);
}

/// A model folder as transformers 5 saves it: `rope_parameters` and `dtype` in config.json, the
/// chat template only in `chat_template.jinja`, tokenizer_config.json fields users rely on.
fn transformers5_folder(dir: &Path, rows: &[String]) -> String {
    let spec: rtune::recipe::ScratchModel = toml::from_str(
        "arch = \"llama\"\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 1\nintermediate_size = 64\nvocab_size = 400",
    )
    .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    rtune::model::scratch::create(dir, &spec, rows.iter(), 3).unwrap();
    let read = |n: &str| read_json(&dir.join(n));
    let write = |n: &str, v: &serde_json::Value| std::fs::write(dir.join(n), serde_json::to_string_pretty(v).unwrap());
    let mut config = read("config.json");
    let theta = config.as_object_mut().unwrap().remove("rope_theta").unwrap();
    config["rope_parameters"] = serde_json::json!({ "rope_type": "default", "rope_theta": theta });
    config["dtype"] = config.as_object_mut().unwrap().remove("torch_dtype").unwrap();
    write("config.json", &config).unwrap();
    let mut tc = read("tokenizer_config.json");
    tc["padding_side"] = "left".into();
    tc["model_max_length"] = 2048.into();
    tc["added_tokens_decoder"] = serde_json::json!({
        "2": { "content": "</s>", "special": true, "lstrip": false, "rstrip": false, "normalized": false, "single_word": false }
    });
    write("tokenizer_config.json", &tc).unwrap();
    // Zephyr's layout: turns end with EOS.
    let template = "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}";
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
    template.to_string()
}

/// `data.jsonl` (64 rows of the synthetic dataset) and `base/`, a transformers 5 folder of a
/// small scratch model, in `p`.
fn small_base_project(p: &Path) {
    let alpaca = std::fs::read_to_string(root().join("recipes/data/synthetic-alpaca.jsonl")).unwrap();
    let rows: Vec<String> = alpaca.lines().take(64).map(String::from).collect();
    std::fs::write(p.join("data.jsonl"), rows.join("\n")).unwrap();
    transformers5_folder(&p.join("base"), &rows);
}

/// `small_base_project`'s base weights stored again in `dtype`, after `edit`.
fn rewrite_base_weights(
    p: &Path,
    dtype: candle_core::DType,
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, candle_core::Tensor>),
) {
    let base = rtune::model::ModelFolder::open(&p.join("base")).unwrap();
    let mut weights = base.load_weights(&candle_core::Device::Cpu, dtype).unwrap();
    edit(&mut weights);
    rtune::model::folder::save_safetensors(&p.join("base/model.safetensors"), &weights).unwrap();
}

/// Mistral v0.1's sliding window (here 128 tokens): rtune attends over whole sequences, exact only
/// within the window, so rows longer than it are a clear error before training, naming the
/// setting; rows that fit train.
#[test]
fn rows_longer_than_a_sliding_window_are_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    small_base_project(p);
    let mut config = read_json(&p.join("base/config.json"));
    config["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    config["model_type"] = "mistral".into();
    config["sliding_window"] = 128.into();
    std::fs::write(p.join("base/config.json"), config.to_string()).unwrap();
    let recipe = "[recipe]\nname = \"window\"\n[model]\npath = \"base\"\n[dataset]\npath = \"data.jsonl\"\nformat = \"alpaca\"\n\
                  max_seq_len = 512\nskip_bad_rows = true\n[device]\nprefer = [\"cpu\"]\n[stages.train]\nmax_steps = 1\n";
    std::fs::write(p.join("window.toml"), recipe).unwrap();
    let cache = p.join("cache");
    let o = rtune(p, &cache, &["run", "window.toml"]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("rtune::train::too_long"), "{err}");
    assert!(err.contains("sliding window of 128") && err.contains("`dataset.max_seq_len` to 128"), "{err}");
    let o = rtune(p, &cache, &["run", "window.toml", "--set", "dataset.max_seq_len=128"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A dataset with no rows, or whose every row is bad, is an error naming the file as the user knows
/// it (not the cache's copy) and pointing at `dataset.path`: an empty file when the plan is made,
/// before any stage runs; a file of blank lines or bad rows before a scratch model's tokenizer
/// learns from nothing (download), or at tokenize for a model of its own. Nothing is cached, and
/// the same cache then runs the fixed recipe.
#[test]
fn an_empty_or_wholly_bad_dataset_is_a_located_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    small_base_project(p);
    std::fs::write(p.join("empty.jsonl"), "").unwrap();
    std::fs::write(p.join("blank.jsonl"), "\n\n").unwrap();
    std::fs::write(p.join("bad.jsonl"), "garbage\n{\"instruction\": 1\n").unwrap();
    let local = "[recipe]\nname = \"local\"\n[model]\npath = \"base\"\n[dataset]\npath = \"data.jsonl\"\n\
                 format = \"alpaca\"\n[device]\nprefer = [\"cpu\"]\n[stages.train]\nmax_steps = 1\n";
    let scratch = std::fs::read_to_string(root().join("recipes/tiny-offline.toml")).unwrap();
    let scratch = scratch.replace("data/synthetic-alpaca.jsonl", "data.jsonl");
    std::fs::write(p.join("local.toml"), local).unwrap();
    std::fs::write(p.join("scratch.toml"), &scratch).unwrap();
    let cache = p.join("cache");
    for (recipe, stage) in [("local.toml", "tokenize"), ("scratch.toml", "download")] {
        for (file, failed, code, message) in [
            ("empty.jsonl", None, "rtune::data::empty", "the dataset `empty.jsonl` is empty"),
            ("blank.jsonl", Some(stage), "rtune::data::empty", "the dataset `blank.jsonl` has no rows"),
            (
                "bad.jsonl",
                Some(stage),
                "rtune::data::all_dropped",
                "every row of the dataset `bad.jsonl` was dropped (2 bad rows)",
            ),
        ] {
            let text =
                std::fs::read_to_string(p.join(recipe)).unwrap().replace("\"data.jsonl\"", &format!("\"{file}\""));
            std::fs::write(p.join("broken.toml"), text).unwrap();
            let o = rtune(p, &cache, &["run", "broken.toml", "--set", "dataset.skip_bad_rows=true"]);
            let err = stderr(&o);
            let what = format!("{recipe} with {file}");
            // An empty file is refused by the plan (invalid input), the others by a stage.
            assert_eq!(o.status.code(), Some(if failed.is_some() { 3 } else { 1 }), "{what}: {err}");
            assert_eq!(err.contains(" failed"), failed.is_some(), "{what}: {err}");
            assert!(failed.is_none_or(|s| err.contains(&format!("stage `{s}` failed"))), "{what}: {err}");
            assert!(err.contains(code) && err.contains(message), "{what}: {err}");
            assert!(err.contains(&format!("path = \"{file}\"")), "{what}: {err}");
            assert!(err.contains("this dataset") && !err.contains("store-v1"), "{what}: {err}");
            if file == "bad.jsonl" {
                assert!(err.contains("the first: bad.jsonl:1: malformed JSON"), "{what}: {err}");
            }
        }
        let o = rtune(p, &cache, &["run", recipe, "--set", "stages.train.max_steps=1"]);
        assert!(o.status.success(), "{recipe}: {}", stderr(&o));
    }
}

/// `dataset.eval_fraction = 0` holds no rows out: what needs an eval split (an evaluate stage
/// with neither a dataset nor prompts, early stopping) is refused by the plan, located at the
/// fraction; the rest runs and says what it measured instead of eval losses of NaN over 0 tokens
/// (train reports its train loss, evaluate only generates, the GGUF self-check reads train rows).
#[test]
fn no_eval_split_is_refused_where_needed_and_said_where_not() {
    let p = Project::tiny_offline();
    let none = ["--set", "dataset.eval_fraction=0"];
    let o = p.run(&args(&["plan", "tiny.toml"], &none));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("rtune::plan::no_eval_split") && err.contains("stage `eval_base` measures the eval split"),
        "{err}"
    );
    assert!(err.contains("dataset.eval_fraction = 0\n") || err.contains("1 │ dataset.eval_fraction = 0"), "{err}");
    let o = p.run(&args(
        &["plan", "tiny.toml", "--set", "stages.train.early_stopping={patience = 2}"],
        &args(&none, &["--set", "stages.eval_base.prompts=[\"hi\"]"]),
    ));
    assert!(stderr(&o).contains("`early_stopping` watches the eval loss"), "{}", stderr(&o));

    let o = p.run(&args(&args(&["run", "tiny.toml", "--set", "stages.eval_base.prompts=[\"hi\"]"], &none), FAST));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("train loss ") && err.contains("(no eval split)") && !err.contains("NaN"), "{err}");
    assert!(err.contains("base model: no eval loss (the eval split is empty)"), "{err}");
    assert!(err.contains("tokens of the train split (there is no eval split)"), "{err}");
}

/// A dataset file of a kind rtune does not read (an .xml) is refused when the plan is made,
/// located at `dataset.path` (the download stage failed, naming a folder in the cache); the
/// extensions it reads are read in any case (`DATA.JSONL` was ignored after the download), and a
/// tab-separated `.tsv` reads as datasets reads it.
#[test]
fn a_dataset_rtune_cannot_read_is_refused_by_the_plan() {
    let p = Project::tiny_offline();
    std::fs::write(p.path().join("data/x.xml"), "<rows><row>a</row></rows>\n").unwrap();
    let o = p.plan(&["dataset.path=\"data/x.xml\""]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("rtune::data::unsupported") && err.contains("`data/x.xml` is not a file rtune reads"),
        "{err}"
    );
    assert!(err.contains(".csv, .tsv, .txt") && err.contains("this dataset"), "{err}");
    std::fs::copy(p.path().join("data/synthetic-alpaca.jsonl"), p.path().join("data/DATA.JSONL")).unwrap();
    let o = p.run(&["run", "tiny.toml", "--until", "tokenize", "--set", "dataset.path=\"data/DATA.JSONL\""]);
    assert!(o.status.success() && stderr(&o).contains("3000 rows → 2850 train"), "{}", stderr(&o));
    let tsv: String = (0..40).map(|i| format!("what is {i}, twice?\t\t\"{}\"\n", 2 * i)).collect();
    std::fs::write(p.path().join("data/x.tsv"), format!("instruction\tinput\toutput\n{tsv}")).unwrap();
    let o = p.run(&["run", "tiny.toml", "--until", "tokenize", "--set", "dataset.path=\"data/x.tsv\""]);
    assert!(o.status.success() && stderr(&o).contains("40 rows → 38 train"), "{}", stderr(&o));
}

/// The recipe's loader settings read a single file as `load_dataset(…, sep=…, field=…)` does:
/// a semicolon CSV, a JSON file whose `data` field holds the rows; a separator rtune cannot read
/// literally is refused by the plan, located at it.
#[test]
fn the_recipes_loader_settings_read_a_file() {
    let p = Project::tiny_offline();
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(p.path().join("data/synthetic-alpaca.jsonl"))
        .unwrap()
        .lines()
        .take(60)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let doc = serde_json::json!({ "version": "1.0", "data": rows });
    std::fs::write(p.path().join("data/x.json"), doc.to_string()).unwrap();
    let quote = |v: &serde_json::Value| format!("\"{}\"", v.as_str().unwrap().replace('"', "\"\""));
    let csv: String = rows
        .iter()
        .map(|r| format!("{};{};{}\n", quote(&r["instruction"]), quote(&r["input"]), quote(&r["output"])))
        .collect();
    std::fs::write(p.path().join("data/x.csv"), format!("instruction;input;output\n{csv}")).unwrap();
    let tokenize = |sets: &[&str]| {
        let mut args = vec!["run", "tiny.toml", "--until", "tokenize"];
        for s in sets {
            args.extend(["--set", s]);
        }
        p.run(&args)
    };
    let o = tokenize(&["dataset.path=\"data/x.json\"", "dataset.field=\"data\""]);
    assert!(o.status.success() && stderr(&o).contains("60 rows → 57 train"), "{}", stderr(&o));
    let o = tokenize(&["dataset.path=\"data/x.csv\"", "dataset.sep=\";\""]);
    assert!(o.status.success() && stderr(&o).contains("60 rows → 57 train"), "{}", stderr(&o));
    // Without the separator the header is one column: no row has an instruction.
    let o = tokenize(&["dataset.path=\"data/x.csv\""]);
    assert!(!o.status.success(), "{}", stderr(&o));
    let o = p.plan(&["dataset.path=\"data/x.csv\"", "dataset.sep=\"\\\\s+\""]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("is a regular expression") && err.contains("this setting"), "{err}");
}

/// With `skip_bad_rows`, each bad row is dropped and counted once, whoever refuses it: the
/// reader (malformed JSON, a line that is not UTF-8) or the renderer (a field of the wrong
/// type). The renderer's were counted twice in the rows total.
#[test]
fn skipped_rows_are_counted_once() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    small_base_project(p);
    let mut data = std::fs::read(p.join("data.jsonl")).unwrap();
    data.extend_from_slice(b"\nnot json\n{\"instruction\": \"\xff\"}\n{\"instruction\": 5, \"output\": \"x\"}\n");
    std::fs::write(p.join("data.jsonl"), data).unwrap();
    let recipe = "[recipe]\nname = \"bad\"\n[model]\npath = \"base\"\n[dataset]\npath = \"data.jsonl\"\n\
                  format = \"alpaca\"\nskip_bad_rows = true\n[device]\nprefer = [\"cpu\"]\n[stages.train]\nmax_steps = 1\n";
    std::fs::write(p.join("bad.toml"), recipe).unwrap();
    let o = rtune(p, &p.join("cache"), &["run", "bad.toml", "--until", "tokenize", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let stats = read_json(&artifact(&report, "tokenize").join("stats.json"));
    assert_eq!(
        (&stats["rows"], &stats["used_rows"], &stats["dropped_rows"]),
        (&67.into(), &64.into(), &3.into()),
        "{stats}"
    );
    assert!(stderr(&o).contains("67 rows → "), "{}", stderr(&o));
}

/// A model folder with a damaged or missing file is refused by the download stage, which names the
/// file as the recipe names the folder (`base/model.safetensors`, not the cache's copy) and points
/// at `model.path` — not a stage or two later. The folder mended, the same cache runs.
#[test]
fn a_damaged_model_folder_is_a_located_error_at_download() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    small_base_project(p);
    let recipe = "[recipe]\nname = \"damaged\"\n[model]\npath = \"base\"\n[dataset]\npath = \"data.jsonl\"\n\
                  format = \"alpaca\"\n[device]\nprefer = [\"cpu\"]\n[stages.train]\nmax_steps = 1\n";
    std::fs::write(p.join("damaged.toml"), recipe).unwrap();
    let cache = p.join("cache");
    let weights = p.join("base/model.safetensors");
    let tokenizer = p.join("base/tokenizer.json");
    let (good_weights, good_tokenizer) = (std::fs::read(&weights).unwrap(), std::fs::read(&tokenizer).unwrap());
    let cases: [(&str, &dyn Fn(), &str); 3] = [
        (
            "truncated weights",
            &|| std::fs::write(&weights, &good_weights[..good_weights.len() / 2]).unwrap(),
            "cannot read `base/model.safetensors`: ",
        ),
        ("a broken tokenizer", &|| std::fs::write(&tokenizer, "{").unwrap(), "cannot read `base/tokenizer.json`: "),
        ("no tokenizer", &|| std::fs::remove_file(&tokenizer).unwrap(), "model folder `base` has no `tokenizer.json`"),
    ];
    for (what, damage, message) in cases {
        damage();
        let o = rtune(p, &cache, &["run", "damaged.toml"]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(3), "{what}: {err}");
        assert!(err.contains("stage `download` failed") && err.contains(message), "{what}: {err}");
        assert!(
            err.contains("path = \"base\"") && err.contains("this model") && !err.contains("store-v1"),
            "{what}: {err}"
        );
        std::fs::write(&weights, &good_weights).unwrap();
        std::fs::write(&tokenizer, &good_tokenizer).unwrap();
    }
    let o = rtune(p, &cache, &["run", "damaged.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A bf16 checkpoint exports a bf16 merged folder (what PEFT's `merge_and_unload` leaves), read
/// back bit for bit, with the logit difference its rounding costs reported; `merged_dtype = "f32"`
/// writes f32 and says so in config.json.
#[test]
fn a_bf16_base_merges_into_bf16_unless_told_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    small_base_project(p);
    rewrite_base_weights(p, candle_core::DType::BF16, |_| {});
    let recipe = "[recipe]\nname = \"bf16\"\n[model]\npath = \"base\"\n[dataset]\npath = \"data.jsonl\"\nformat = \"alpaca\"\n\
                  [device]\nprefer = [\"cpu\"]\ndtype = [\"f32\"]\n[stages.train]\nmax_steps = 3\nlearning_rate = 1e-2\n\
                  [stages.quantize]\nformats = [\"safetensors-merged\"]\n";
    std::fs::write(p.join("bf16.toml"), recipe).unwrap();
    let cache = p.join("cache");
    for (set, dtype, torch) in
        [(None, "BF16", None), (Some("stages.quantize.merged_dtype=\"f32\""), "F32", Some("float32"))]
    {
        let mut args = vec!["run", "bf16.toml", "--json"];
        if let Some(set) = set {
            args.extend(["--set", set]);
        }
        let o = rtune(p, &cache, &args);
        assert!(o.status.success(), "{}", stderr(&o));
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let exports = artifact(&report, "quantize");
        let metrics = read_json(&exports.join("exports.json"));
        let merged = &metrics["formats"]["safetensors-merged"];
        assert_eq!(merged["dtypes"], serde_json::json!([dtype.to_lowercase()]), "{merged}");
        assert!(merged["max_logit_diff"].as_f64().unwrap() < 1e-4, "{merged}");
        // Rounding to bf16 moves the logits a little; an f32 folder is the f32 merge itself.
        let as_written = merged["max_logit_diff_as_written"].as_f64();
        assert_eq!(as_written.is_some(), dtype == "BF16", "{merged}");
        assert!(as_written.is_none_or(|d| d > 0.0 && d < 0.1), "{merged}");
        let bytes = std::fs::read(exports.join("merged/model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert!(st.tensors().iter().all(|(_, v)| format!("{:?}", v.dtype()) == dtype), "{dtype}");
        let config = read_json(&exports.join("merged/config.json"));
        // A transformers 5 config names it `dtype`.
        if let Some(torch) = torch {
            assert_eq!((&config["dtype"], config.get("torch_dtype")), (&serde_json::json!(torch), None));
        }
    }
}

/// A GGUF whose self-check is not a number fails the stage, named and located, instead of
/// shipping with a warning: here an f16 file of a model whose weights exceed f16's range (the
/// file holds infinities), as a broken GPU kernel did on an H200. Training stays cached.
#[test]
fn a_gguf_whose_self_check_is_not_a_number_fails_the_stage() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    small_base_project(p);
    rewrite_base_weights(p, candle_core::DType::F32, |weights| {
        let name = "model.layers.0.mlp.down_proj.weight";
        let scaled = (weights[name].clone() * 1e7).unwrap();
        weights.insert(name.to_string(), scaled);
    });
    let recipe = "[recipe]\nname = \"big\"\n[model]\npath = \"base\"\n[dataset]\npath = \"data.jsonl\"\nformat = \"alpaca\"\n\
                  [device]\nprefer = [\"cpu\"]\n[stages.train]\nmax_steps = 1\n\
                  [stages.quantize]\nformats = [\"gguf-f16\"]\n";
    std::fs::write(p.join("big.toml"), recipe).unwrap();
    let cache = p.join("cache");
    let o = rtune(p, &cache, &["run", "big.toml"]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("rtune::quantize::self_check"), "{err}");
    assert!(err.contains("model-f16.gguf: its self-check") && err.contains("perplexity of NaN"), "{err}");
    assert!(err.contains("big.toml") && err.contains("this export"), "located at the formats: {err}");
    assert!(err.contains("65504") && err.contains("`gguf-f32`"), "the CPU's hint: {err}");
    let o = rtune(p, &cache, &["plan", "big.toml"]);
    let plan = String::from_utf8_lossy(&o.stdout);
    assert!(plan.lines().any(|l| l.starts_with("train") && l.contains("cached")), "{plan}");
}

fn gguf_chat_template(path: &Path) -> (String, Option<u32>) {
    use candle_core::quantized::gguf_file::{Content, Value};
    let mut f = std::fs::File::open(path).unwrap();
    let c = Content::read(&mut f).unwrap();
    let t = match c.metadata.get("tokenizer.chat_template") {
        Some(Value::String(s)) => s.clone(),
        other => panic!("tokenizer.chat_template: {other:?}"),
    };
    let eot = match c.metadata.get("tokenizer.ggml.eot_token_id") {
        Some(Value::U32(v)) => Some(*v),
        _ => None,
    };
    (t, eot)
}

/// Issue 19: the template the model was trained with ships with every export, byte for byte,
/// and renders a conversation exactly as training did; the base folder's tokenizer settings,
/// generation config and layout (transformers 5) carry over.
#[test]
fn exports_carry_the_trained_chat_template_and_the_folders_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let alpaca = std::fs::read_to_string(root().join("recipes/data/synthetic-alpaca.jsonl")).unwrap();
    let rows: Vec<String> = alpaca
        .lines()
        .take(64)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            serde_json::json!({ "messages": [
                { "role": "user", "content": v["instruction"] },
                { "role": "assistant", "content": v["output"] },
            ] })
            .to_string()
        })
        .collect();
    std::fs::create_dir_all(p.join("data")).unwrap();
    std::fs::write(p.join("data/chat.jsonl"), rows.join("\n")).unwrap();
    let template = transformers5_folder(&p.join("base"), &rows);
    std::fs::write(
        p.join("chat.toml"),
        r#"[recipe]
name = "chat"
[model]
path = "base"
[dataset]
path = "data/chat.jsonl"
format = "chat"
eval_fraction = 0.1
max_seq_len = 256
[adapter]
kind = "lora"
rank = 4
alpha = 8
targets = ["q_proj", "v_proj"]
[device]
prefer = ["cpu"]
[stages.train]
max_steps = 2
batch_size = 4
[stages.evaluate]
prompts = ["Name a colour."]
max_new_tokens = 2
[stages.quantize]
formats = ["peft-adapter", "safetensors-merged", "gguf-q8_0"]
[stages.upload]
to = "dir://out"
"#,
    )
    .unwrap();
    let cache = p.join("cache");
    let conversation: Vec<serde_json::Value> = serde_json::from_value(serde_json::json!([
        { "role": "system", "content": "Be brief." },
        { "role": "user", "content": "Name a colour." },
        { "role": "assistant", "content": "Blue." },
        { "role": "user", "content": "Another?" },
    ]))
    .unwrap();
    let base = rtune::model::ModelFolder::open(&p.join("base")).unwrap();
    let render = |source: &str, dir: &Path| {
        let (bos, eos) = rtune::data::chat::special_tokens(dir);
        rtune::data::chat::ChatTemplate::new(source, &bos, &eos).unwrap().render(&conversation, true).unwrap()
    };

    for over in [None, Some("chatml")] {
        let mut cmd = vec!["run", "chat.toml", "--json"];
        if over.is_some() {
            cmd.extend(["--set", "dataset.chat_template=\"chatml\""]);
        }
        let o = rtune(p, &cache, &cmd);
        assert!(o.status.success(), "{}", stderr(&o));
        let trained = rtune::data::chat::ChatTemplate::for_model(&base, over).unwrap();
        // The evaluate stage's prompt is a user turn of the trained template, with its
        // generation prompt.
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let eval = read_json(&artifact(&report, "evaluate").join("metrics.json"));
        let user = [serde_json::json!({ "role": "user", "content": "Name a colour." })];
        let rendered = &eval["results"]["tuned"]["samples"][0]["rendered"];
        assert_eq!(rendered, trained.render(&user, true).unwrap().as_str(), "{eval}");
        let expected_source = if over.is_some() { rtune::data::chat::CHATML.to_string() } else { template.clone() };
        let want = trained.render(&conversation, true).unwrap();
        let out = p.join("out");
        for folder in ["merged", "peft-adapter"] {
            let d = out.join(folder);
            let jinja = std::fs::read_to_string(d.join("chat_template.jinja")).unwrap();
            assert_eq!(jinja, expected_source, "{folder}/chat_template.jinja");
            let tc = read_json(&d.join("tokenizer_config.json"));
            assert_eq!(tc["chat_template"], expected_source.as_str(), "{folder}/tokenizer_config.json");
            assert_eq!(tc["padding_side"], "left");
            assert_eq!(tc["model_max_length"], 2048);
            assert_eq!(tc["added_tokens_decoder"]["2"]["content"], "</s>");
            assert_eq!(render(&jinja, &d), want, "{folder} renders otherwise than training");
        }
        let merged_cfg = read_json(&out.join("merged/config.json"));
        assert!(merged_cfg["rope_parameters"]["rope_theta"].is_number() && merged_cfg["dtype"] == "float32");
        assert!(out.join("merged/generation_config.json").is_file());
        let adapter = read_json(&out.join("peft-adapter/adapter_config.json"));
        assert_eq!(adapter["base_model_name_or_path"], "base");
        let (gguf_template, eot) = gguf_chat_template(&out.join("gguf/model-q8_0.gguf"));
        assert_eq!(gguf_template.as_bytes(), expected_source.as_bytes(), "GGUF tokenizer.chat_template");
        assert_eq!(render(&gguf_template, &out.join("merged")), want);
        // Zephyr ends turns with EOS; the scratch vocabulary has no `<|im_end|>` to stop at.
        assert_eq!(eot, None);
        // Ollama: ChatML translates (a Modelfile beside the GGUF); Zephyr's template is none of
        // the families rtune writes, which the report says, and no Modelfile is written.
        let exports = read_json(&artifact(&report, "quantize").join("exports.json"));
        let modelfile = out.join("gguf/model-q8_0.Modelfile");
        if over.is_some() {
            assert_eq!(exports["ollama"]["template"], "chatml", "{exports}");
            let m = std::fs::read_to_string(&modelfile).unwrap();
            assert!(m.contains("FROM ./model-q8_0.gguf\nTEMPLATE \"\"\"{{- range .Messages }}<|im_start|>"), "{m}");
        } else {
            assert!(exports["ollama"]["untranslated"].as_str().unwrap().contains("none of the Ollama templates"));
            assert!(!modelfile.exists() && stderr(&o).contains("warning  no Ollama Modelfile"), "{}", stderr(&o));
        }
        let card = std::fs::read_to_string(out.join("README.md")).unwrap();
        let origin =
            if over.is_some() { "dataset.chat_template = \"chatml\"" } else { "base model's chat_template.jinja" };
        assert!(card.contains("## Chat template") && card.contains(origin), "{card}");
    }
}

/// The model card says how the run was made, overrides included: its command line carries the
/// recipe-setting variables and every `--set` (quoted for a shell), and the recipe section lists
/// them after the file; a shell given that command line gets the same words back.
#[test]
fn the_model_card_names_the_overrides_the_run_used() {
    let p = Project::tiny_offline();
    let sets = [
        r#"stages.train.trainable=["adapter", "*norm*"]"#,
        "stages.train.max_steps=2",
        "stages.evaluate.max_new_tokens=2",
    ];
    let mut args = vec!["run", "tiny.toml"];
    for s in &sets {
        args.extend(["--set", s]);
    }
    let o = rtune_cmd()
        .args(&args)
        .current_dir(p.path())
        .env("RTUNE_CACHE_DIR", p.cache())
        .env("RTUNE_NO_PROGRESS", "1")
        .env("RTUNE_STAGES__TRAIN__EVAL_EVERY", "0")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let card = std::fs::read_to_string(p.path().join("out/tiny-offline/README.md")).unwrap();
    let line = card.lines().find(|l| l.starts_with("Fine-tuned from")).unwrap();
    let command = line.split('`').nth(1).unwrap();
    assert_eq!(
        command,
        r#"RTUNE_STAGES__TRAIN__EVAL_EVERY=0 rtune run tiny.toml --set 'stages.train.trainable=["adapter", "*norm*"]' --set stages.train.max_steps=2 --set stages.evaluate.max_new_tokens=2"#
    );
    let words = std::process::Command::new("sh").arg("-c").arg(format!("printf '%s\\n' {command}")).output();
    if let Ok(words) = words {
        let want: Vec<&str> = ["RTUNE_STAGES__TRAIN__EVAL_EVERY=0", "rtune", "run", "tiny.toml"]
            .into_iter()
            .chain(args[2..].iter().copied())
            .collect();
        assert_eq!(String::from_utf8_lossy(&words.stdout).lines().collect::<Vec<_>>(), want);
    }
    let listed = card.split("Run with these settings over the file").nth(1).expect("the overrides listed");
    assert!(listed.contains("- `RTUNE_STAGES__TRAIN__EVAL_EVERY=0`\n- `stages.train.trainable="), "{listed}");
}

/// Issue 21: `cache gc` never runs beside a build (it used to delete a long run's staging and
/// could remove objects between their move into the store and the manifest naming them).
#[test]
fn cache_gc_refuses_while_a_run_uses_the_cache() {
    let set = ["--set", "stages.train.max_steps=400", "--set", "stages.train.checkpoint_every=2"];
    let p = Project::tiny_offline();
    let (mut child, reached) = run_until_checkpoint(&p, &set, 2);
    let gc = p.run(&["cache", "gc"]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(reached, "training finished or stalled before its first checkpoint");
    assert!(!gc.status.success() && stderr(&gc).contains("rtune::store::busy"), "{}", stderr(&gc));
    let gc = p.run(&["cache", "gc"]);
    assert!(gc.status.success(), "{}", stderr(&gc));
    // The killed run left resumable work and no artifact: a stopped run, which `prune` removes
    // when no kept recipe would resume it (the plain recipe trains other steps).
    let dry = p.run(&["cache", "prune", "--keep", "tiny.toml", "--dry-run", "--json"]);
    let dry: serde_json::Value = serde_json::from_slice(&dry.stdout).expect("prune --json");
    let removed = dry["removed"].as_array().unwrap();
    assert!(removed.len() == 1 && removed[0]["kind"] == "stopped run", "{dry}");
    let work = p.cache().join("store-v1/work").join(removed[0]["fingerprint"].as_str().unwrap());
    assert!(work.is_dir(), "a dry run removes nothing");
    let rm = p.run(&["cache", "rm", &removed[0]["fingerprint"].as_str().unwrap()[..10]]);
    assert!(rm.status.success() && stdout(&rm).contains("1 stopped run removed"), "{}", stdout(&rm));
    assert!(!work.exists());
}

/// `cache prune --keep` removes every artifact the named recipes do not use — neither their
/// plans here nor their lock files (the last run, here with other settings) — and leaves what
/// they share; `cache rm` removes artifacts by fingerprint prefix, and a later run rebuilds them.
#[test]
fn cache_prune_keeps_what_named_recipes_use_and_rm_removes_by_fingerprint() {
    let p = Project::tiny_offline();
    let recipe = std::fs::read_to_string(p.path().join("tiny.toml")).unwrap();
    let other = recipe.replace("name = \"tiny-offline\"", "name = \"other\"").replace("rank = 8", "rank = 4");
    assert_ne!(other, recipe);
    std::fs::write(p.path().join("other.toml"), other).unwrap();
    let trained = |recipe: &str| {
        let r = p.run_json(&args(&[recipe, "--until", "train"], FAST));
        r["stages"].as_array().unwrap().iter().find(|s| s["name"] == "train").unwrap()["fingerprint"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (mine, theirs) = (trained("tiny.toml"), trained("other.toml"));
    let listed = |p: &Project| -> Vec<String> {
        let o = p.run(&["cache", "ls", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v.as_array().unwrap().iter().map(|m| m["fingerprint"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(listed(&p).len(), 4, "download and tokenize shared, two trainings");
    let ls = stdout(&p.run(&["cache", "ls"]));
    assert!(ls.lines().any(|l| l.starts_with(&theirs[..12]) && l.ends_with("  other.toml")), "{ls}");

    let dry = p.run(&["cache", "prune", "--keep", "other.toml", "--dry-run"]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    let text = stdout(&dry);
    assert!(text.contains(&format!("would remove {}  train", &mine[..12])) && text.contains("  tiny.toml\n"), "{text}");
    assert!(text.contains("1 artifact and 0 stopped runs would go"), "{text}");
    assert_eq!(listed(&p).len(), 4, "a dry run removes nothing");

    let pruned = p.run(&["cache", "prune", "--keep", "other.toml"]);
    assert!(pruned.status.success(), "{}", stderr(&pruned));
    assert!(!listed(&p).contains(&mine) && listed(&p).contains(&theirs), "{}", stdout(&pruned));
    assert!(!p.cache().join("store-v1/artifacts").join(&mine).exists());
    let o = outcomes(&p.run_json(&args(&["other.toml", "--until", "train"], FAST)));
    assert!(o[..3].iter().all(|(_, x)| x == "cached"), "{o:?}");

    let unknown = p.run(&["cache", "rm", "zzzz"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(stderr(&unknown).contains("no artifact or stopped run `zzzz` in the cache"), "{}", stderr(&unknown));
    let download = listed(&p).into_iter().find(|f| f != &theirs).unwrap();
    let all = p.run(&["cache", "rm", ""]);
    assert!(!all.status.success(), "an empty prefix names nothing");
    let rm = p.run(&["cache", "rm", &download[..8]]);
    assert!(rm.status.success(), "{}", stderr(&rm));
    let o = outcomes(&p.run_json(&args(&["other.toml", "--until", "train"], FAST)));
    assert_eq!(o.iter().filter(|(_, x)| x == "built").count(), 1, "{o:?}");
    assert_eq!(o.iter().filter(|(_, x)| x == "cached").count(), 2, "{o:?}");
}

/// The default recipe on a Vulkan device (lavapipe in CI) against the same run on the CPU: every
/// stage builds, training runs on the GPU engine there, quantize merges on the CPU, and the eval
/// losses agree within 1e-4 relative (f32). Shortened to 4 steps here; CI also runs the whole
/// recipe (`default_recipe_on_vulkan_end_to_end_matches_the_cpu`, 3.5 minutes on Mesa 26's lavapipe).
#[test]
fn default_recipe_on_vulkan_matches_the_cpu() {
    default_recipe_on_vulkan(SHORT_RUN);
}

/// The default recipe shortened to 4 training steps and 4 generated tokens.
const SHORT_RUN: &[&str] = &[
    "--set",
    "stages.train.max_steps=4",
    "--set",
    "stages.train.eval_every=0",
    "--set",
    "stages.evaluate.max_new_tokens=4",
];

/// Issue 18's acceptance on lavapipe: `rtune run recipes/tiny-offline.toml --set
/// 'device.prefer=["vulkan"]'` end to end, all 537 steps, against the CPU. Run by .ci/run
/// (`cargo test --test pipeline -- --ignored vulkan`, on Mesa 26's lavapipe with each `rtune`
/// under the validation layer); ignored in the plain `cargo test` for its minutes.
#[test]
#[ignore]
fn default_recipe_on_vulkan_end_to_end_matches_the_cpu() {
    let (cpu, vk) = default_recipe_on_vulkan(&[]);
    if vk.is_null() {
        return; // no Vulkan device (said above)
    }
    let train = |r: &serde_json::Value| {
        r["stages"].as_array().unwrap().iter().find(|s| s["name"] == "train").unwrap()["metrics"].clone()
    };
    let (c, v) = (train(&cpu), train(&vk));
    assert_eq!((c["steps"].as_u64(), v["steps"].as_u64()), (Some(537), Some(537)), "{c}\n{v}");
    assert!(v["engine"].as_str().unwrap_or_default().contains("GPU engine"), "{v}");
    let (a, b) = (c["eval_loss_end"].as_f64().unwrap(), v["eval_loss_end"].as_f64().unwrap());
    assert!((a - b).abs() <= 1e-4 * a, "eval loss after training: {b} on Vulkan vs {a} on the CPU");
}

/// The Vulkan device the tests use — `RTUNE_TEST_VULKAN=N` picks device N, as in
/// tests/gpu_engine.rs; else plain `vulkan` (the first hardware GPU, else lavapipe) — as the
/// preference and the device it resolves to; None (said) when there is none.
fn vulkan_under_test() -> Option<(String, rtune::device::DeviceInfo)> {
    let wanted = std::env::var("RTUNE_TEST_VULKAN").map_or("vulkan".to_string(), |n| format!("vulkan:{n}"));
    let inv = rtune::device::Inventory::probe(true);
    let found = rtune::device::resolve(std::slice::from_ref(&wanted), &[rtune::recipe::Dtype::F32], &inv)
        .ok()
        .filter(|r| r.class == rtune::device::DeviceClass::Vulkan)
        .and_then(|r| inv.devices.iter().find(|d| d.class == r.class && d.ordinal == r.ordinal).cloned());
    let Some(d) = found else {
        assert!(
            std::env::var_os("RTUNE_REQUIRE_VULKAN").is_none(),
            "RTUNE_REQUIRE_VULKAN is set but no usable Vulkan device is listed"
        );
        eprintln!("no usable Vulkan device: skipped");
        return None;
    };
    Some((wanted, d))
}

/// Two Vulkan devices where Mesa's lavapipe is installed: its ICD file, and a second one in `dir`
/// naming a copy of its library (the loader opens each library once, so the copy is a second
/// driver with a device of its own), as a `VK_ICD_FILENAMES` value. None (said) without it.
fn two_lavapipes(dir: &Path) -> Option<String> {
    let icd = ["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d"]
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("lvp_icd")));
    let found = icd.and_then(|icd| {
        let mut json = read_json(&icd);
        let lib = PathBuf::from(json["ICD"]["library_path"].as_str()?);
        let copy = dir.join("libvulkan_lvp_copy.so");
        std::fs::copy(&lib, &copy).ok()?;
        json["ICD"]["library_path"] = copy.to_string_lossy().into();
        let second = dir.join("lvp_copy.json");
        std::fs::write(&second, json.to_string()).ok()?;
        Some(format!("{}:{}", icd.display(), second.display()))
    });
    if found.is_none() {
        assert!(std::env::var_os("RTUNE_REQUIRE_VULKAN").is_none(), "RTUNE_REQUIRE_VULKAN is set but lavapipe is not");
        eprintln!("no lavapipe to list twice: skipped");
    }
    found
}

/// `device.gpus = 2` on two Vulkan devices (lavapipe twice) trains and evaluates as one device
/// does: the plan names both, the train and evaluate stages' manifests record both, and the step
/// losses, gradient norms and eval losses of the short default recipe agree with one device's
/// within 1e-5 relative (the gradients are summed in another order, nothing else differs). The
/// same artifact fingerprints: `gpus` is not part of them.
#[test]
fn data_parallel_on_two_vulkan_devices_trains_as_one() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(icds) = two_lavapipes(tmp.path()) else { return };
    let env = [("VK_ICD_FILENAMES", icds.as_str())];
    let doctor = stdout(&rtune_with(tmp.path(), &tmp.path().join("cache"), &["doctor"], &env));
    assert!(doctor.contains("vulkan   2 GPUs can train together: `[device] gpus = 2`"), "{doctor}");
    let run = |gpus: &str| {
        let p = Project::tiny_offline();
        let set = [r#"device.prefer=["vulkan:0"]"#, gpus];
        let report = p.run_json_with(&args(&["tiny.toml", "--set", set[0], "--set", set[1]], SHORT_RUN), &env);
        let plan = rtune_with(
            p.path(),
            &p.cache(),
            &args(&["plan", "tiny.toml", "--set", set[0], "--set", set[1]], SHORT_RUN),
            &env,
        );
        (p, report, stdout(&plan))
    };
    let (_one_dir, one, _) = run("device.gpus=1");
    let (two_dir, two, plan) = run("device.gpus=2");
    assert!(plan.contains("data parallel: training runs on 2 GPUs at once (vulkan:0, vulkan:1)"), "{plan}");
    assert!(plan.contains("vulkan:0+1/f32"), "{plan}");
    let stage = |r: &serde_json::Value, name: &str| {
        r["stages"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap().clone()
    };
    assert_eq!(stage(&one, "train")["fingerprint"], stage(&two, "train")["fingerprint"]);
    for name in ["eval_base", "evaluate"] {
        let (a, b) = (
            stage(&one, name)["metrics"]["eval_loss"].as_f64().unwrap(),
            stage(&two, name)["metrics"]["eval_loss"].as_f64().unwrap(),
        );
        assert!((a - b).abs() <= 1e-5 * a, "{name}: eval loss {b} on two devices vs {a} on one");
    }
    // Step by step, the loss each step trained on (each device's share weighted by its tokens)
    // and the norm of the summed gradients.
    let losses = |r: &serde_json::Value| -> Vec<f64> {
        let log = std::fs::read_to_string(artifact(r, "train").join("metrics.jsonl")).unwrap();
        let steps = log.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok());
        steps
            .filter(|s| s["loss"].is_number())
            .flat_map(|s| [s["loss"].as_f64(), s["grad_norm"].as_f64()])
            .flatten()
            .collect()
    };
    let (a, b) = (losses(&one), losses(&two));
    assert_eq!(a.len(), 8, "{a:?}");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x, "step losses on one device {a:?} vs two {b:?}");
    }
    let fp = stage(&two, "train")["fingerprint"].as_str().unwrap().to_string();
    let run_info = read_json(&two_dir.cache().join("store-v1/manifests").join(format!("{fp}.json")))["run"].clone();
    assert_eq!(run_info["data_parallel"], serde_json::json!(["vulkan:0", "vulkan:1"]), "{run_info}");
    assert_eq!(run_info["peers_info"][0]["ordinal"], 1, "{run_info}");
    // The evaluate stages share their batches too (and measure what one device does).
    for name in ["eval_base", "evaluate"] {
        let fp = stage(&two, name)["fingerprint"].as_str().unwrap().to_string();
        let manifest = read_json(&two_dir.cache().join("store-v1/manifests").join(format!("{fp}.json")));
        assert_eq!(manifest["run"]["data_parallel"], serde_json::json!(["vulkan:0", "vulkan:1"]), "{name}");
        assert_eq!(stage(&one, name)["fingerprint"], stage(&two, name)["fingerprint"]);
    }
    // A step of one row keeps one GPU busy, and the plan says so.
    let set = [r#"device.prefer=["vulkan:0"]"#, "device.gpus=2", "stages.train.batch_size=1"];
    let args: Vec<&str> = ["plan", "tiny.toml"].into_iter().chain(set.iter().flat_map(|s| ["--set", *s])).collect();
    let plan = stdout(&rtune_with(two_dir.path(), &two_dir.cache(), &args, &env));
    assert!(
        plan.contains("stage `train` trains on 1 row a step (batch_size 1 × grad_accum 1): 1 of the 2 GPUs"),
        "{plan}"
    );
    let metrics = &stage(&two, "train")["metrics"];
    assert!(metrics["engine"].as_str().unwrap().starts_with("data parallel on 2 GPUs: GPU engine ("), "{metrics}");
}

/// The default recipe's exports without the PEFT folder (for base weights that train).
const NO_PEFT: &str = r#"stages.quantize.formats=["safetensors-merged", "gguf-q8_0"]"#;

/// What cannot train on a Vulkan device — another engine than the GPU engine, asked for by
/// `RTUNE_ENGINE` (candle has no Vulkan backend) — is refused by `plan`, located in the recipe,
/// not by the stage once earlier stages have run.
#[test]
fn plan_refuses_other_engines_on_vulkan() {
    let Some((wanted, info)) = vulkan_under_test() else { return };
    let device = info.class.device_name(info.ordinal);
    let p = Project::tiny_offline();
    let prefer = format!(r#"device.prefer=["{wanted}"]"#);
    let plan = |extra: &str, engine: Option<&str>| {
        let mut c = rtune_cmd();
        c.args(["plan", "tiny.toml", "--set", &prefer, "--set", extra, "--set", NO_PEFT])
            .current_dir(p.path())
            .env("RTUNE_CACHE_DIR", p.cache());
        match engine {
            Some(e) => c.env("RTUNE_ENGINE", e),
            None => c.env_remove("RTUNE_ENGINE"),
        };
        c.output().unwrap()
    };
    let o = plan("recipe.seed=1", Some("candle"));
    let err = stderr(&o);
    assert!(!o.status.success(), "plan accepted RTUNE_ENGINE=candle on {device}");
    assert!(err.contains("rtune::plan::engine_unavailable") && err.contains(&device), "{err}");
    assert!(err.contains("device.prefer"), "the error points at `device.prefer`: {err}");
    // Base weights train there (the GPU engine trains them since 2026-11-24).
    for extra in ["adapter.kind=none", r#"stages.train.trainable=["*norm*"]"#] {
        let o = plan(extra, None);
        assert!(o.status.success(), "{extra}: {}", stderr(&o));
    }
}

/// `trainable` is `["adapter"]` (with an adapter) or weight patterns: `"adapter"` among
/// patterns used to be a pattern naming nothing (training the other weights and no adapter),
/// and `["adapter"]` with `adapter.kind = "none"` a silent full fine-tune. Both are refused at
/// `trainable` (also where a `[device.<name>]` table sets it); the lone `["adapter"]` with LoRA,
/// and patterns alone, plan.
#[test]
fn trainable_is_the_adapter_or_weight_patterns() {
    let p = Project::tiny_offline();
    let adapts = "in full beside the adapter";
    for (sets, says) in [
        (&[r#"stages.train.trainable=["adapter", "all"]"#][..], adapts),
        (&[r#"stages.train.trainable=["adapter", "*.self_attn.*"]"#][..], adapts),
        (&[r#"stages.train.trainable=["adapter"]"#, "adapter.kind=none"][..], "but `adapter.kind = \"none\"`"),
    ] {
        let o = p.plan(sets);
        let err = stderr(&o);
        assert!(!o.status.success(), "{sets:?}: plan accepted it");
        assert!(err.contains("rtune::plan::trainable") && err.contains(says), "{sets:?}: {err}");
        assert!(err.contains("stages.train.trainable = ["), "{sets:?}: located at the setting: {err}");
    }
    // The device's `[device.<name>]` overrides are what runs, so `plan` checks them merged.
    let o = p.plan(&[r#"device.cpu.train.trainable=["adapter", "all"]"#]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("rtune::plan::trainable"), "an override's clash planned: {err}");
    assert!(err.contains("device.cpu.train.trainable = ["), "located at the override: {err}");
    // `validate` knows no device: it checks every `[device.<name>]` table the recipe has.
    let o = p.run(&["validate", "tiny.toml", "--set", r#"device.rocm.train.trainable=["adapter", "all"]"#]);
    let err = stderr(&o);
    assert!(
        !o.status.success() && err.contains("rtune::plan::trainable"),
        "validate passed an override's clash: {err}"
    );
    for sets in [
        &[r#"stages.train.trainable=["adapter"]"#][..],
        &[r#"stages.train.trainable=["adapter", "*norm*"]"#][..],
        &[r#"stages.train.trainable=["*norm*"]"#, r#"stages.quantize.formats=["safetensors-merged"]"#][..],
    ] {
        let o = p.plan(sets);
        assert!(o.status.success(), "{sets:?}: {}", stderr(&o));
    }
}

/// A LoRA adapter and base weights train together (PEFT's `modules_to_save`): the train stage
/// saves one PEFT folder whose saved modules hold the base weights (the embedding, tied to the LM
/// head in the default recipe's model, with the head beside it), and every later stage loads it
/// as it trained — the evaluate stage's loss is the train stage's last eval loss, the merged and
/// GGUF exports pass their self-checks. A weight the adapter also sits on is refused when the
/// model is loaded, naming both settings.
#[test]
fn an_adapter_and_base_weights_train_together() {
    let p = Project::tiny_offline();
    let run = |extra: &[&str]| {
        let base = [
            "--set",
            "stages.train.max_steps=4",
            "--set",
            "stages.train.eval_every=2",
            "--set",
            "stages.evaluate.max_new_tokens=2",
        ];
        p.run(&[&["run", "tiny.toml", "--json"], &base[..], extra].concat())
    };
    let trainable = r#"stages.train.trainable=["adapter", "*norm*", "model.embed_tokens.weight"]"#;
    // The default targets include `lm_head`, whose weight is the tied embedding.
    let o = run(&["--set", trainable]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("rtune::model::adapter_on_trained_weight"), "{err}");
    assert!(err.contains("`model.embed_tokens.weight`") && err.contains("`lm_head`"), "{err}");
    let o = run(&["--set", trainable, "--set", r#"adapter.targets=["q_proj", "v_proj", "down_proj"]"#]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // (download and tokenize built in the refused run.)
    assert!(outcomes(&report).iter().all(|(_, o)| o == "built" || o == "cached"), "{:?}", outcomes(&report));
    let trained = artifact(&report, "train");
    assert!(!trained.join("weights.safetensors").exists());
    let modules = serde_json::json!([
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm"
    ]);
    let exports = artifact(&report, "quantize");
    for dir in [trained.clone(), exports.join("peft-adapter")] {
        let c = read_json(&dir.join("adapter_config.json"));
        assert_eq!(c["modules_to_save"], modules, "{}", dir.display());
        assert_eq!(c["ensure_weight_tying"], true, "{}", dir.display());
    }
    let metrics = read_json(&trained.join("metrics.json"));
    assert_eq!(metrics["trainable"], "lora+weights");
    let evaluated = read_json(&artifact(&report, "evaluate").join("metrics.json"));
    let (end, tuned) = (metrics["eval_loss_end"].as_f64().unwrap(), evaluated["eval_loss"].as_f64().unwrap());
    assert!((end - tuned).abs() <= 1e-6 * end, "evaluate {tuned} vs train's last eval {end}");
    assert!(metrics["eval_loss_start"].as_f64().unwrap() - end > 0.05, "it trained: {metrics}");
    assert!(exports.join("merged/model.safetensors").is_file() && exports.join("gguf/model-q8_0.gguf").is_file());
    // The trained norms and embedding are the merged folder's, as the adapter folder holds them.
    let saved = rtune::model::peft::read_weights(&trained, &candle_core::Device::Cpu).unwrap();
    let saved = saved.into_iter().filter(|(k, _)| !rtune::model::lora::is_adapter_param(k)).collect();
    assert_merged_holds(&exports.join("merged"), &saved);
}

/// Every tensor of `want` that the merged folder `dir` has equals it bit for bit (the norms,
/// embedding or whole model a stage trained), and there is at least one.
fn assert_merged_holds(dir: &Path, want: &std::collections::BTreeMap<String, candle_core::Tensor>) {
    let folder = rtune::model::ModelFolder::open(dir).unwrap();
    let merged = folder.load_weights(&candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    let bits = |t: &candle_core::Tensor| -> Vec<u32> {
        let v = t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    };
    let mut compared = 0;
    for (name, t) in want.iter().filter(|(n, _)| merged.contains_key(*n)) {
        assert_eq!(bits(&merged[name]), bits(t), "{name} in the merged folder is not the trained value");
        compared += 1;
    }
    assert!(compared > 0, "no trained tensor in the merged folder");
}

/// Every stage of `report` built, its train stage trained (the eval loss fell by more than 0.5)
/// and its evaluate stage measured the train stage's last eval loss: the train artifact and its
/// metrics.
fn built_trained_and_evaluated(report: &serde_json::Value) -> (PathBuf, serde_json::Value) {
    assert!(outcomes(report).iter().all(|(_, o)| o == "built"), "{:?}", outcomes(report));
    let trained = artifact(report, "train");
    let metrics = read_json(&trained.join("metrics.json"));
    let end = metrics["eval_loss_end"].as_f64().unwrap();
    assert!(metrics["eval_loss_start"].as_f64().unwrap() - end > 0.5, "it trained: {metrics}");
    let tuned = read_json(&artifact(report, "evaluate").join("metrics.json"))["eval_loss"].as_f64().unwrap();
    assert!((end - tuned).abs() <= 1e-6 * end, "evaluate {tuned} vs train's last eval {end}");
    (trained, metrics)
}

/// The default recipe with its model replaced by `model` (a `model.scratch=…` setting) and
/// `trainable` weights beside the adapter, for 30 steps (two new tokens per prompt), then `extra`.
fn run_scratch_arch(p: &Project, model: &str, trainable: &str, extra: &[&str]) -> serde_json::Value {
    let trainable = format!("stages.train.trainable={trainable}");
    let base = ["tiny.toml", "--set", model, "--set", &trainable, "--set", "stages.train.max_steps=30"];
    p.run_json(&[&base[..], &["--set", "stages.evaluate.max_new_tokens=2"], extra].concat())
}

/// The default recipe's model as a Qwen3 (heads wider than hidden / heads, a query and key
/// RMSNorm in each layer).
const QWEN3: &str = "model.scratch={arch=\"qwen3\", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, \
                     head_dim=32, intermediate_size=128, vocab_size=512}";

/// A Qwen3 model trains (its query norms beside the adapter, as `modules_to_save`), evaluates
/// and exports end to end: the merged folder is a Qwen3 folder with its head norms, and the GGUF
/// reads back in candle's quantized Qwen3 at the unquantized model's perplexity.
#[test]
fn a_qwen3_model_trains_and_exports_end_to_end() {
    let p = Project::tiny_offline();
    let report = run_scratch_arch(&p, QWEN3, r#"["adapter", "*.q_norm.weight"]"#, &[]);
    let (trained, _) = built_trained_and_evaluated(&report);
    let c = read_json(&trained.join("adapter_config.json"));
    assert_eq!(
        c["modules_to_save"],
        serde_json::json!(["model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.q_norm"])
    );
    let exports = artifact(&report, "quantize");
    let config = read_json(&exports.join("merged/config.json"));
    assert_eq!(
        (config["architectures"][0].as_str(), config["head_dim"].as_u64()),
        (Some("Qwen3ForCausalLM"), Some(32))
    );
    let merged = rtune::model::ModelFolder::open(&exports.join("merged")).unwrap();
    let weights = merged.load_weights(&candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    for n in ["model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"] {
        assert_eq!(weights.get(n).map(|t| t.dims().to_vec()), Some(vec![32]), "{n} in the merged folder");
    }
    let quantize = report["stages"].as_array().unwrap().iter().find(|s| s["name"] == "quantize").unwrap();
    let gguf = &quantize["metrics"]["formats"]["gguf-q8_0"];
    let ratio = gguf["perplexity_ratio"].as_f64().unwrap();
    assert!((ratio - 1.0).abs() < 0.003, "q8_0 perplexity ratio {ratio}: {gguf}");
}

/// The default recipe's model as a Gemma 3 (heads wider than hidden / heads; three layers, all
/// local in Gemma 3's pattern of one global layer in six, their window of 512 wider than these
/// rows — the golden tiny-gemma3 of tests/model.rs has windows that bite and a global layer).
const GEMMA3: &str = "model.scratch={arch=\"gemma3\", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, \
                      head_dim=32, intermediate_size=128, vocab_size=512}";

/// A scratch Gemma 3 trains (its norms beside the adapter), evaluates, generates and exports
/// end to end on the CPU (the fused engine): a Gemma 3 folder of the trained values with its four
/// norms a layer and PEFT's adapter; then its GGUF, checked as llama.cpp reads it.
#[test]
fn a_gemma3_model_trains_and_exports_end_to_end() {
    let p = Project::tiny_offline();
    let norms = r#"["adapter", "*feedforward_layernorm.weight"]"#;
    let formats = r#"stages.quantize.formats=["peft-adapter", "safetensors-merged"]"#;
    let report = run_scratch_arch(&p, GEMMA3, norms, &["--set", formats]);
    let (trained, metrics) = built_trained_and_evaluated(&report);
    let c = read_json(&trained.join("adapter_config.json"));
    assert_eq!(c["modules_to_save"].as_array().map(Vec::len), Some(6), "{c}");
    assert_eq!(metrics["engine"].as_str(), Some("fused CPU engine"), "{metrics}");
    let exports = artifact(&report, "quantize");
    let config = read_json(&exports.join("merged/config.json"));
    assert_eq!(config["architectures"][0].as_str(), Some("Gemma3ForCausalLM"));
    let merged = rtune::model::ModelFolder::open(&exports.join("merged")).unwrap();
    let weights = merged.load_weights(&candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    let trained_norms = rtune::model::peft::read_weights(&trained, &candle_core::Device::Cpu).unwrap();
    for n in rtune::model::FEEDFORWARD_NORMS {
        let name = format!("model.layers.2.{n}.weight");
        let (got, want) = (&weights[&name], &trained_norms[&name]);
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{name} in the merged folder is the trained value");
    }
    // GGUF (the default recipe's q8_0): llama.cpp's Gemma 3 with rtune's byte-level BPE
    // vocabulary, checked as llama.cpp reads it; only the quantize and upload stages run again.
    let report = run_scratch_arch(&p, GEMMA3, norms, &[]);
    let outcome = |name: &str| {
        report["stages"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap()["outcome"].clone()
    };
    assert_eq!((outcome("train"), outcome("evaluate")), (serde_json::json!("cached"), serde_json::json!("cached")));
    let quantize = report["stages"].as_array().unwrap().iter().find(|s| s["name"] == "quantize").unwrap();
    let gguf = &quantize["metrics"]["formats"]["gguf-q8_0"];
    let ratio = gguf["perplexity_ratio"].as_f64().unwrap();
    assert!((ratio - 1.0).abs() < 0.01, "q8_0 perplexity ratio {ratio}: {gguf}");
    assert!(gguf["top_token_agreement"].as_f64().unwrap() > 0.95, "{gguf}");
    let mut f = std::fs::File::open(artifact(&report, "quantize").join("gguf/model-q8_0.gguf")).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    assert_eq!(content.metadata["general.architecture"].to_string().unwrap(), "gemma3");
    assert_eq!(content.metadata["tokenizer.ggml.model"].to_string().unwrap(), "gpt2");
    for name in ["blk.2.post_attention_norm.weight", "blk.2.ffn_norm.weight", "blk.2.post_ffw_norm.weight"] {
        assert!(content.tensor_infos.contains_key(name), "GGUF lacks {name}");
    }
}

/// The Gemma 3 model on Vulkan (the GPU engine) against the CPU (the fused engine): the eval
/// losses agree within 1e-4 relative after 4 steps.
#[test]
fn a_gemma3_model_on_vulkan_matches_the_cpu() {
    let model = ["--set", GEMMA3, "--set", r#"stages.quantize.formats=["peft-adapter", "safetensors-merged"]"#];
    default_recipe_on_vulkan(&[&model[..], SHORT_RUN].concat());
}

/// The Qwen3 model on Vulkan (the GPU engine) against the CPU (the fused engine): the eval
/// losses agree within 1e-4 relative after 4 steps.
#[test]
fn a_qwen3_model_on_vulkan_matches_the_cpu() {
    default_recipe_on_vulkan(&[&["--set", QWEN3][..], SHORT_RUN].concat());
}

/// QLoRA (`adapter.quantize_base = "nf4"`): the adapter trains over the 4-bit base (its first eval
/// loss is the 4-bit model's, not the original's), the evaluate stage computes with the same
/// base (its loss is the train stage's last), the adapter is a plain PEFT adapter, and the
/// exports merge it into the original weights (the merged model agrees with the adapter over
/// the original base, which the quantize stage checks).
#[test]
fn qlora_trains_over_a_4bit_base_and_exports_into_the_original_weights() {
    let p = Project::tiny_offline();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "tiny.toml",
            "--set",
            "stages.train.max_steps=30",
            "--set",
            "stages.evaluate.max_new_tokens=2",
            "--set",
            r#"adapter.targets=["q_proj", "v_proj", "lm_head"]"#,
        ];
        args.extend(extra);
        p.run_json(&args)
    };
    // Both runs upload their card to the same `dir://` destination.
    let card = || std::fs::read_to_string(p.path().join("out/tiny-offline/README.md")).unwrap();
    let dense = run(&[]);
    let dense_card = card();
    let qlora = run(&["--set", r#"adapter.quantize_base="nf4""#]);
    let qlora_card = card();
    // The download and tokenize stages are the dense run's; everything from train on is new.
    let built: Vec<_> = outcomes(&qlora).into_iter().filter(|(_, o)| o == "built").map(|(s, _)| s).collect();
    assert_eq!(built, ["train", "eval_base", "evaluate", "quantize", "upload"], "{:?}", outcomes(&qlora));
    let train = |r: &serde_json::Value| read_json(&artifact(r, "train").join("metrics.json"));
    let (d, q) = (train(&dense), train(&qlora));
    let start = |m: &serde_json::Value| m["eval_loss_start"].as_f64().unwrap();
    assert!((start(&d) - start(&q)).abs() > 1e-4, "the 4-bit base is another model: {d}\n{q}");
    let end = q["eval_loss_end"].as_f64().unwrap();
    assert!(start(&q) - end > 0.5, "it trained: {q}");
    let tuned = read_json(&artifact(&qlora, "evaluate").join("metrics.json"))["eval_loss"].as_f64().unwrap();
    assert!((end - tuned).abs() <= 1e-6 * end, "evaluate {tuned} vs train's last eval {end}");
    let config = read_json(&artifact(&qlora, "train").join("adapter_config.json"));
    assert_eq!(config["peft_type"], "LORA");
    assert!(qlora_card.contains("- qlora\n") && qlora_card.contains("bnb_4bit_use_double_quant=False"), "{qlora_card}");
    assert!(!dense_card.contains("qlora") && !dense_card.contains("QLoRA"), "{dense_card}");
    let quantize = qlora["stages"].as_array().unwrap().iter().find(|s| s["name"] == "quantize").unwrap();
    let diff = quantize["metrics"]["formats"]["safetensors-merged"]["max_logit_diff"].as_f64().unwrap();
    assert!(diff < 1e-3, "merged into the original weights: {diff}");
    // A linear without an adapter is the original, not its 4-bit values.
    let load = |dir: PathBuf| {
        let folder = rtune::model::ModelFolder::open(&dir).unwrap();
        let w = folder.load_weights(&candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
        w["model.layers.0.mlp.gate_proj.weight"].flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let original = load(artifact(&qlora, "download").join("model"));
    assert!(load(artifact(&qlora, "quantize").join("merged")) == original, "the merged gate_proj is not the original");
    assert!(rtune::model::nf4::round_trip(&original, rtune::recipe::BaseQuant::Nf4) != original);
}

/// QLoRA with double quantization on Vulkan (the GPU engine, dequantizing scales and weights on
/// the device) against the CPU: the eval losses agree within 1e-4 relative after 4 steps.
#[test]
fn qlora_on_vulkan_matches_the_cpu() {
    default_recipe_on_vulkan(&[&["--set", r#"adapter.quantize_base="nf4-dq""#][..], SHORT_RUN].concat());
}

/// Settings a `[device.<name>]` table overrides are checked as the stage's own are: `validate`
/// checks every table, `plan` the chosen device's (an override used to pass both and fail when
/// its stage ran).
#[test]
fn stage_checks_see_device_overrides() {
    let p = Project::tiny_offline();
    for (set, code) in [
        (r#"device.cuda.upload.to="dir://../elsewhere""#, "rtune::plan::bad_destination"),
        (r#"device.cuda.quantize.max_shard_size="lots""#, "rtune::plan::bad_size"),
    ] {
        let o = p.run(&["validate", "tiny.toml", "--set", set]);
        let err = stderr(&o);
        assert!(!o.status.success() && err.contains(code), "{set}: {err}");
        assert!(err.contains(&set.replace('=', " = ")), "{set}: located at the override: {err}");
        // `plan` on the CPU does not apply `[device.cuda]`; on CUDA it would.
        let o = p.plan(&[set, r#"device.prefer=["cpu"]"#]);
        assert!(o.status.success(), "{set}: plan on the CPU applied [device.cuda]: {}", stderr(&o));
        let cpu = set.replace("device.cuda.", "device.cpu.");
        let o = p.plan(&[&cpu, r#"device.prefer=["cpu"]"#]);
        assert!(!o.status.success() && stderr(&o).contains(code), "{cpu}: {}", stderr(&o));
    }
}

/// A train stage that trains base weights (`adapter.kind = "none"`, or `trainable` patterns)
/// has no adapter to export: `plan` refuses `peft-adapter` asked for, at `formats`, naming what
/// decided it (a selective fine-tune used to pass `plan` and fail in `quantize` after training);
/// without `formats`, the default exports leave the PEFT folder out and every stage builds.
#[test]
fn base_weights_that_train_export_no_peft_adapter() {
    let p = Project::tiny_offline();
    for (extra, says) in [
        (r#"adapter.kind="none""#, r#"`adapter.kind = "none"`"#),
        (r#"stages.train.trainable=["*norm*"]"#, "`stages.train.trainable`"),
    ] {
        let o = p.plan(&[extra]);
        let err = stderr(&o);
        assert!(!o.status.success(), "{extra}: plan accepted a PEFT export");
        assert!(err.contains("rtune::plan::no_adapter") && err.contains(says), "{extra}: {err}");
        assert!(err.contains("tiny.toml:47") && err.contains("no adapter to export"), "{extra}: located: {err}");
    }
    // Formats, or what trains, set only in the chosen device's overrides are checked too.
    let overrides: [&[&str]; 2] = [
        &[
            r#"stages.quantize.formats=["gguf-q8_0"]"#,
            r#"device.cpu.quantize.formats=["peft-adapter"]"#,
            "adapter.kind=none",
        ],
        &[r#"device.cpu.train.trainable=["*norm*"]"#],
    ];
    for sets in overrides {
        let o = p.plan(&[&["device.prefer=[\"cpu\"]"], sets].concat());
        let err = stderr(&o);
        assert!(!o.status.success() && err.contains("rtune::plan::no_adapter"), "{sets:?}: {err}");
    }
    let recipe = p.path().join("tiny.toml");
    let text = std::fs::read_to_string(&recipe).unwrap();
    let without: String = text.lines().filter(|l| !l.starts_with("formats =")).map(|l| format!("{l}\n")).collect();
    assert_ne!(text, without, "the recipe lists its formats");
    std::fs::write(&recipe, without).unwrap();
    let report = p.run_json(&[
        "tiny.toml",
        "--set",
        r#"stages.train.trainable=["*norm*", "lm_head.weight"]"#,
        "--set",
        "stages.train.max_steps=2",
        "--set",
        "stages.train.eval_every=0",
        "--set",
        "stages.evaluate.max_new_tokens=2",
    ]);
    assert!(outcomes(&report).iter().all(|(_, o)| o == "built"), "{:?}", outcomes(&report));
    let exports = artifact(&report, "quantize");
    assert!(exports.join("merged/model.safetensors").is_file() && !exports.join("peft-adapter").exists());
    let trained = artifact(&report, "train");
    assert!(trained.join("weights.safetensors").is_file() && !trained.join("adapter_config.json").exists());
    let weights = candle_core::safetensors::load(trained.join("weights.safetensors"), &candle_core::Device::Cpu);
    assert_merged_holds(&exports.join("merged"), &weights.unwrap().into_iter().collect());
}

/// A full fine-tune of the default recipe's model on Vulkan (the GPU engine) against the same on
/// the CPU (candle's autograd): every stage builds and the eval losses agree within 1e-4
/// relative after 4 AdamW steps on every weight.
#[test]
fn full_fine_tune_on_vulkan_matches_the_cpu() {
    default_recipe_on_vulkan(&[&["--set", "adapter.kind=none", "--set", NO_PEFT], SHORT_RUN].concat());
}

/// A LoRA adapter and base weights trained together on Vulkan (the GPU engine) against the same
/// on the CPU (candle's autograd): the eval losses agree within 1e-4 relative after 4 steps.
#[test]
fn an_adapter_and_base_weights_on_vulkan_match_the_cpu() {
    let mixed = [
        "--set",
        r#"stages.train.trainable=["adapter", "*norm*", "model.embed_tokens.weight"]"#,
        "--set",
        r#"adapter.targets=["q_proj", "v_proj", "down_proj"]"#,
    ];
    default_recipe_on_vulkan(&[&mixed[..], SHORT_RUN].concat());
}

/// Runs the default recipe with `extra` settings on the CPU and on Vulkan, checks what both
/// tests check, and returns the two reports (CPU, Vulkan).
fn default_recipe_on_vulkan(extra: &[&str]) -> (serde_json::Value, serde_json::Value) {
    let Some((wanted, info)) = vulkan_under_test() else {
        return (serde_json::Value::Null, serde_json::Value::Null);
    };
    let (device, name) = (info.class.device_name(info.ordinal), info.name.clone());
    let run = |prefer: &str| {
        let p = Project::tiny_offline();
        let report = p.run_json(&args(&["tiny.toml", "--set", prefer], extra));
        assert!(outcomes(&report).iter().all(|(_, o)| o == "built"), "{:?}", outcomes(&report));
        (p, report)
    };
    let (_cpu_dir, cpu) = run(r#"device.prefer=["cpu"]"#);
    let prefer = format!(r#"device.prefer=["{wanted}"]"#);
    let (vk_dir, vk) = run(&prefer);
    let stage = |r: &serde_json::Value, name: &str| {
        r["stages"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap().clone()
    };
    for name in ["eval_base", "evaluate"] {
        let (a, b) = (
            stage(&cpu, name)["metrics"]["eval_loss"].as_f64().unwrap(),
            stage(&vk, name)["metrics"]["eval_loss"].as_f64().unwrap(),
        );
        assert!((a - b).abs() <= 1e-4 * a.abs(), "{name}: eval loss {b} on Vulkan vs {a} on the CPU");
    }
    let train = artifact(&vk, "train");
    let log = std::fs::read_to_string(train.join("train_log.jsonl")).unwrap_or_default();
    let plan = stdout(&vk_dir.run(&args(&["plan", "tiny.toml", "--set", &prefer], extra)));
    assert!(
        plan.contains(&format!("{device}/f32")) && plan.contains("cpu/f32"),
        "train on Vulkan, quantize on the CPU:\n{plan}{log}"
    );
    assert_eq!(plan.contains("is a software Vulkan driver running on the CPU"), !info.gpu, "{plan}");
    // The train stage says which kernels ran its products and attention (the CPU engine: none to
    // choose); on a CPU device, the per-lane ones.
    let kernels = |r: &serde_json::Value| stage(r, "train")["metrics"]["kernels"].clone();
    assert!(kernels(&cpu).is_null(), "{}", kernels(&cpu));
    let k = kernels(&vk).as_str().unwrap_or_default().to_string();
    assert!(k.starts_with("products ") && k.contains("; attention "), "{k}");
    assert_eq!(k.contains("(gemm_sg: a CPU device)"), !info.gpu, "{k}");
    assert!(vk_dir.path().join("out/tiny-offline/merged/model.safetensors").is_file());
    // Manifests record the device each stage computed on, as discovery described it.
    let run_of = |stage_name: &str| {
        let fp = stage(&vk, stage_name)["fingerprint"].as_str().unwrap().to_string();
        let path = vk_dir.cache().join("store-v1/manifests").join(format!("{fp}.json"));
        read_json(&path)["run"].clone()
    };
    let (train_run, quantize_run) = (run_of("train"), run_of("quantize"));
    assert_eq!((train_run["device"].as_str(), train_run["dtype"].as_str()), (Some(device.as_str()), Some("f32")));
    assert_eq!(train_run["device_info"]["name"].as_str(), Some(name.as_str()), "{train_run}");
    assert!(train_run["device_info"]["memory_bytes"].as_u64().unwrap() > 0, "{train_run}");
    assert_eq!(quantize_run["device"].as_str(), Some("cpu"), "{quantize_run}");
    assert!(run_of("download").get("device").is_none());
    (cpu, vk)
}

/// A calibrated GGUF export: the quantize stage makes an importance matrix of `imatrix_tokens`
/// train tokens, writes it beside the files as llama.cpp's imatrix GGUF, and quantizes the
/// K-quant file with it (its metadata names it; its bytes differ from the plain file's); q8_0,
/// which an importance matrix does not change, is the same either way; `imatrix = false` makes
/// none.
#[test]
fn calibrated_gguf_exports_carry_their_importance_matrix() {
    use candle_core::quantized::gguf_file::Content;
    let p = Project::tiny_offline();
    let formats = "stages.quantize.formats=[\"gguf-q4_k_m\", \"gguf-q8_0\", \"gguf-f32\"]";
    let set = args(FAST, &["--set", formats, "--set", "stages.quantize.imatrix_tokens=500"]);
    let run = |extra: &[&str]| {
        let report = p.run_json(&args(&["tiny.toml"], &args(&set, extra)));
        artifact(&report, "quantize")
    };
    let metadata = |path: &Path| Content::read(&mut std::fs::File::open(path).unwrap()).unwrap().metadata;
    let on = run(&[]);
    let exports: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(on.join("exports.json")).unwrap()).unwrap();
    let f = &exports["formats"];
    assert_eq!(f["imatrix"]["tokens"], 500, "{f}");
    assert_eq!(f["imatrix"]["matrices"], 14, "two layers of seven linears: {f}");
    assert_eq!((&f["gguf-q4_k_m"]["imatrix"], &f["gguf-q8_0"]["imatrix"]), (&true.into(), &false.into()));
    // The self-check's top tokens line up with the reference's: the f32 file picks the very same.
    let same = |t: &str| f[t]["top_token_agreement"].as_f64().unwrap();
    assert_eq!(same("gguf-f32"), 1.0, "{f}");
    assert!(same("gguf-q8_0") > 0.9 && same("gguf-q4_k_m") > 0.5, "{f}");
    let im = rtune::export::gguf::Imatrix::read(&on.join("gguf/imatrix.gguf")).unwrap();
    assert_eq!((im.tokens(), im.len()), (500, 14));
    assert!(im.importance("blk.1.ffn_down.weight").unwrap().iter().all(|v| v.is_finite() && *v >= 0.0));
    let md = metadata(&on.join("gguf/model-q4_k_m.gguf"));
    assert_eq!(md["quantize.imatrix.file"].to_string().unwrap(), "imatrix.gguf");
    assert_eq!(md["quantize.imatrix.entries_count"].to_u32().unwrap(), 14);
    assert!(!metadata(&on.join("gguf/model-q8_0.gguf")).contains_key("quantize.imatrix.file"));
    // The upload carries the matrix, and the model card says which file it calibrated.
    let out = p.path().join("out/tiny-offline");
    assert_eq!(
        std::fs::read(out.join("gguf/imatrix.gguf")).unwrap(),
        std::fs::read(on.join("gguf/imatrix.gguf")).unwrap()
    );
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    let gguf = card.split("\n## GGUF\n").nth(1).unwrap_or_else(|| panic!("no GGUF section: {card}"));
    let row =
        |f: &str| gguf.lines().find(|l| l.starts_with(&format!("| `gguf/{f}` | "))).unwrap_or_else(|| panic!("{card}"));
    assert!(row("model-q4_k_m.gguf").ends_with("% | `gguf/imatrix.gguf` (500 train tokens) |"), "{card}");
    assert!(row("model-f32.gguf").contains("| 100.0% |"), "{card}");
    assert!(row("model-q8_0.gguf").ends_with("% | – |"), "{card}");

    let off = run(&["--set", "stages.quantize.imatrix=false"]);
    assert_ne!(off, on, "another fingerprint");
    assert!(!off.join("gguf/imatrix.gguf").exists());
    assert!(!metadata(&off.join("gguf/model-q4_k_m.gguf")).contains_key("quantize.imatrix.file"));
    let bytes = |dir: &Path, f: &str| std::fs::read(dir.join("gguf").join(f)).unwrap();
    assert_ne!(bytes(&on, "model-q4_k_m.gguf"), bytes(&off, "model-q4_k_m.gguf"), "calibration changes the blocks");
    assert_eq!(bytes(&on, "model-q8_0.gguf"), bytes(&off, "model-q8_0.gguf"));
}

/// `imatrix_file`: a named importance matrix calibrates the GGUFs instead of a computed one —
/// rtune's own file gives the very bytes its computed matrix gave, llama.cpp's `.dat` (made by
/// llama-imatrix for this model's shape) is read too, its content is fingerprinted (an edit
/// re-runs the stage), and one made for another shape is a located error.
#[test]
fn a_named_importance_matrix_calibrates() {
    let p = Project::tiny_offline();
    let formats = "stages.quantize.formats=[\"gguf-q4_k_m\"]";
    let run = |extra: &[&str]| {
        let report = p.run_json(&args(&["tiny.toml"], &args(&args(FAST, &["--set", formats]), extra)));
        artifact(&report, "quantize")
    };
    let computed = run(&["--set", "stages.quantize.imatrix_tokens=500"]);
    std::fs::copy(computed.join("gguf/imatrix.gguf"), p.path().join("calib.gguf")).unwrap();
    let named = run(&["--set", "stages.quantize.imatrix_file=\"calib.gguf\""]);
    assert_ne!(named, computed);
    let bytes = |dir: &Path, f: &str| std::fs::read(dir.join("gguf").join(f)).unwrap();
    assert_eq!(bytes(&named, "model-q4_k_m.gguf"), bytes(&computed, "model-q4_k_m.gguf"));
    assert_eq!(bytes(&named, "imatrix.gguf"), bytes(&computed, "imatrix.gguf"), "written again as it was read");
    let exports: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(named.join("exports.json")).unwrap()).unwrap();
    assert_eq!(exports["formats"]["imatrix"]["given"], true);
    let card = std::fs::read_to_string(p.path().join("out/tiny-offline/README.md")).unwrap();
    assert!(card.contains("| `gguf/imatrix.gguf` (the recipe's file) |"), "{card}");

    // llama.cpp's older format, from llama-imatrix itself.
    let fixture = root().join("tests/fixtures/quant/llama-imatrix.dat");
    std::fs::copy(&fixture, p.path().join("calib.dat")).unwrap();
    let from_dat = run(&["--set", "stages.quantize.imatrix_file=\"calib.dat\""]);
    let back = rtune::export::gguf::Imatrix::read(&from_dat.join("gguf/imatrix.gguf")).unwrap();
    let theirs = rtune::export::gguf::Imatrix::read(&fixture).unwrap();
    assert_eq!(back.importance("blk.1.ffn_down.weight"), theirs.importance("blk.1.ffn_down.weight"));

    // Its content, not its name, is what counts.
    let set = args(FAST, &["--set", formats, "--set", "stages.quantize.imatrix_file=\"calib.dat\""]);
    let plan = |set: &[&str]| stdout(&p.run(&args(&["plan", "tiny.toml"], set)));
    assert!(plan(&set).contains("0 to run"), "{}", plan(&set));
    let mut edited = std::fs::read(p.path().join("calib.dat")).unwrap();
    let last = edited.len() - 12;
    edited[last] ^= 1;
    std::fs::write(p.path().join("calib.dat"), edited).unwrap();
    let again = plan(&set);
    assert!(again.lines().any(|l| l.starts_with("quantize ") && l.contains("source changed: imatrix")), "{again}");

    // A matrix made for another shape is refused before any file is written.
    let mut other = rtune::export::gguf::Imatrix::new("another model");
    let x = candle_core::Tensor::ones((4, 32), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    other.add(0, &[0, 1, 2], &x).unwrap();
    other.write(&p.path().join("other.gguf")).unwrap();
    let o = p.run(&args(
        &["run", "tiny.toml"],
        &args(FAST, &["--set", formats, "--set", "stages.quantize.imatrix_file=\"other.gguf\""]),
    ));
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("rtune::quantize::imatrix_mismatch"), "{err}");
    assert!(err.contains("gives `blk.0.attn_k.weight` 32 input columns where this model has 64"), "{err}");
}

/// An image-text Gemma 3 folder (`Gemma3ForConditionalGeneration`, as Gemma 3 4B, 12B and 27B
/// ship) fine-tunes its text model: the LoRA adapter targets the text model alone, under PEFT's
/// names; the merged folder is the whole image-text model again — every tensor the base has,
/// under the same names, the vision tower bit for bit — and the GGUF is the text model, as
/// llama.cpp's converter writes one (the vision tower goes to its own mmproj file there).
#[test]
fn an_image_text_gemma3_fine_tunes_its_text_model_and_exports_the_whole_model() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let fixture = root().join("tests/fixtures/gemma3-mm");
    std::fs::create_dir(p.join("base")).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(f), p.join("base").join(f)).unwrap();
    }
    let alpaca = std::fs::read_to_string(root().join("recipes/data/synthetic-alpaca.jsonl")).unwrap();
    std::fs::write(p.join("data.jsonl"), alpaca.lines().take(64).collect::<Vec<_>>().join("\n")).unwrap();
    let recipe = "[recipe]\nname = \"gemma3-mm\"\n[model]\npath = \"base\"\n[dataset]\npath = \"data.jsonl\"\n\
                  format = \"alpaca\"\nmax_seq_len = 256\n[device]\nprefer = [\"cpu\"]\n[adapter]\n\
                  targets = [\"q_proj\", \"v_proj\", \"gate_proj\"]\n[stages.train]\nmax_steps = 4\n\
                  learning_rate = 1e-2\n[stages.evaluate]\nmax_new_tokens = 2\n[stages.quantize]\n\
                  formats = [\"peft-adapter\", \"safetensors-merged\", \"gguf-q8_0\"]\n";
    std::fs::write(p.join("mm.toml"), recipe).unwrap();
    let o = rtune(p, &p.join("cache"), &["run", "mm.toml", "--until", "quantize", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let exports = artifact(&report, "quantize");

    let adapter = read_json(&exports.join("peft-adapter/adapter_config.json"));
    assert_eq!(adapter["target_modules"], r"(model\.language_model\..*\.)?(gate_proj|q_proj|v_proj)");
    let saved = candle_core::safetensors::load(
        exports.join("peft-adapter/adapter_model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert_eq!(saved.len(), 6 * 3 * 2);
    assert!(saved.keys().all(|k| k.starts_with("base_model.model.model.language_model.layers.")), "{:?}", saved.keys());

    let merged = read_json(&exports.join("merged/config.json"));
    assert_eq!(merged["architectures"][0], "Gemma3ForConditionalGeneration");
    assert_eq!(merged["vision_config"], read_json(&fixture.join("config.json"))["vision_config"]);
    let read = |path: &Path| {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensors().into_iter().map(|(n, v)| (n, v.data().to_vec())).collect::<std::collections::BTreeMap<_, _>>()
    };
    let (base, out) = (read(&fixture.join("model.safetensors")), read(&exports.join("merged/model.safetensors")));
    assert_eq!(base.keys().collect::<Vec<_>>(), out.keys().collect::<Vec<_>>(), "the base's names, every one");
    for (name, bytes) in &base {
        let merges =
            ["q_proj", "v_proj", "gate_proj"].iter().any(|m| name.contains(m)) && name.starts_with("language_model.");
        assert_eq!(&out[name] == bytes, !merges, "{name}: merged where an adapter is, carried over elsewhere");
    }

    let quantize = report["stages"].as_array().unwrap().iter().find(|s| s["name"] == "quantize").unwrap();
    let gguf = &quantize["metrics"]["formats"]["gguf-q8_0"];
    assert!((gguf["perplexity_ratio"].as_f64().unwrap() - 1.0).abs() < 0.01, "{gguf}");
    let mut f = std::fs::File::open(exports.join("gguf/model-q8_0.gguf")).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    assert_eq!(content.metadata["general.architecture"].to_string().unwrap(), "gemma3");
    let top: Vec<&String> = content.tensor_infos.keys().filter(|n| !n.starts_with("blk.")).collect();
    assert_eq!(content.tensor_infos.len(), 2 + 6 * 13, "the text model's tensors alone: {top:?}");
}
