//! The Hub layer against a local Hub (tests/common/hub.rs): downloads land in the exact layout
//! huggingface_hub produces (fixture made by tests/fixtures/hub/make_python_layout.py), offline mode,
//! resume, digest checks, hostile answers, auth, retries, uploads, and recipes with Hub sources.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::hub::HubServer;
use common::stdout;

/// stderr with the diagnostic's line wrapping undone.
fn stderr(o: &Output) -> String {
    let e = common::stderr(o);
    e.split_whitespace().filter(|w| *w != "│").collect::<Vec<_>>().join(" ")
}

const TOKEN: &str = "hf_testtoken_1234567890abcdef";

/// The repo the layout fixture was made from: a regular JSON, a nested text file, and one LFS
/// file (≥ 1 KiB).
pub fn fixture_repo() -> Vec<(&'static str, Vec<u8>)> {
    let mut weights = Vec::new();
    let mut x: u32 = 12345;
    for _ in 0..3000 {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        weights.push((x >> 16) as u8);
    }
    vec![
        ("config.json", br#"{"model_type": "llama", "hidden_size": 8}"#.to_vec()),
        ("sub/notes.txt", b"nested file\n".to_vec()),
        ("model.safetensors", weights),
        ("README.md", b"# tiny\n".to_vec()),
    ]
}

struct Env {
    dir: tempfile::TempDir,
    server: HubServer,
}

impl Env {
    fn new() -> Env {
        Env::on(HubServer::start())
    }

    /// On `server`, reset to hold only the fixture repo.
    fn on(server: HubServer) -> Env {
        server.reset();
        server.add_commit("model", "test-org/tiny-model", &fixture_repo());
        Env { dir: tempfile::tempdir().unwrap(), server }
    }

    fn hf_home(&self) -> PathBuf {
        self.dir.path().join("hf")
    }

    fn hub_cache(&self) -> PathBuf {
        self.hf_home().join("hub")
    }

    fn rtune(&self, args: &[&str], extra: &[(&str, &str)]) -> Output {
        self.command(args, extra).output().unwrap()
    }

    /// `rtune args` against this Hub, with its own caches and `extra` variables.
    fn command(&self, args: &[&str], extra: &[(&str, &str)]) -> Command {
        let mut c = common::rtune_cmd();
        c.args(args)
            .current_dir(self.dir.path())
            .env("RTUNE_CACHE_DIR", self.dir.path().join("rtune-cache"))
            .env("NO_COLOR", "1")
            .env("RTUNE_NO_PROGRESS", "1")
            .env("HF_HOME", self.hf_home())
            .env("HF_ENDPOINT", &self.server.url)
            .env("RTUNE_HUB_BACKOFF_MS", "10")
            .env_remove("HF_HUB_CACHE")
            .env_remove("HF_TOKEN")
            .env_remove("HF_HUB_OFFLINE");
        for (k, v) in extra {
            c.env(k, v);
        }
        c
    }

    fn ok(&self, args: &[&str], extra: &[(&str, &str)]) -> Output {
        let o = self.rtune(args, extra);
        assert!(o.status.success(), "rtune {args:?} failed:\n{}", stderr(&o));
        o
    }
}

/// Every path under the cache (without `.locks`): `blob <size>`, `ref <commit>`, `link <target>`.
pub fn layout(cache: &Path) -> String {
    let mut out = Vec::new();
    let mut stack = vec![cache.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(cache).unwrap().to_string_lossy().replace('\\', "/");
            if rel.starts_with(".locks") || rel.contains("/.no_exist") {
                continue;
            }
            let ft = e.file_type().unwrap();
            if ft.is_symlink() {
                out.push(format!("{rel} -> {}", std::fs::read_link(&p).unwrap().to_string_lossy()));
            } else if ft.is_dir() {
                stack.push(p);
            } else if rel.contains("/refs/") {
                out.push(format!("{rel} = {}", std::fs::read_to_string(&p).unwrap()));
            } else {
                out.push(format!("{rel} ({} bytes)", std::fs::metadata(&p).unwrap().len()));
            }
        }
    }
    out.sort();
    out.join("\n") + "\n"
}

#[test]
fn download_produces_the_same_cache_layout_as_huggingface_hub() {
    let env = Env::new();
    let o = env.ok(&["download", "test-org/tiny-model"], &[]);
    let snap = stdout(&o);
    assert!(
        snap.trim().ends_with(&format!("snapshots/{}", env.server.files_commit("model", "test-org/tiny-model"))),
        "{snap}"
    );
    let expected = std::fs::read_to_string(common::root().join("tests/fixtures/hub/python-layout.txt")).unwrap();
    assert_eq!(layout(&env.hub_cache()), expected, "layout differs from huggingface_hub's (fixture)");
    for (path, bytes) in fixture_repo() {
        assert_eq!(std::fs::read(Path::new(snap.trim()).join(path)).unwrap(), bytes, "{path}");
    }
    // A second run fetches nothing: no file GETs reach the server.
    env.server.state.lock().unwrap().log.clear();
    let o = env.ok(&["download", "test-org/tiny-model", "--json"], &[]);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["bytes_fetched"], 0);
    let log = env.server.state.lock().unwrap().log.clone();
    assert!(log.iter().all(|(r, _)| r.starts_with("GET /api/")), "{log:?}");
}

/// Regenerates tests/fixtures/hub/python-layout.txt with huggingface_hub (needs Python):
/// `cargo test --test hub -- --ignored python_layout`.
#[test]
#[ignore]
fn python_layout_fixture() {
    let env = Env::new();
    let cache = env.dir.path().join("py-cache");
    let st = Command::new("python3")
        .arg(common::root().join("tests/fixtures/hub/make_python_layout.py"))
        .args(["--endpoint", &env.server.url, "--cache", cache.to_str().unwrap(), "--repo", "test-org/tiny-model"])
        .status()
        .unwrap();
    assert!(st.success());
    let out = common::root().join("tests/fixtures/hub/python-layout.txt");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(out, layout(&cache)).unwrap();
}

#[test]
fn include_exclude_and_offline_after_one_online_run() {
    let env = Env::new();
    let o = env.ok(
        &["download", "test-org/tiny-model", "--include", "*.json", "--include", "*.txt", "--exclude", "sub/*"],
        &[],
    );
    let snap = PathBuf::from(stdout(&o).trim());
    assert!(snap.join("config.json").exists());
    assert!(!snap.join("sub/notes.txt").exists());
    assert!(!snap.join("model.safetensors").exists());
    env.ok(&["download", "test-org/tiny-model"], &[]);

    // Offline: the server is not asked anything, by flag or by variable.
    env.server.state.lock().unwrap().log.clear();
    let a = env.ok(&["download", "test-org/tiny-model", "--offline"], &[]);
    let b = env.ok(&["download", "test-org/tiny-model"], &[("HF_HUB_OFFLINE", "1")]);
    assert_eq!(stdout(&a), stdout(&b));
    assert!(env.server.state.lock().unwrap().log.is_empty());

    // Offline and not cached: a clear error with the command that would fetch it.
    let o = env.rtune(&["download", "test-org/other", "--offline"], &[]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("rtune::hub::offline_missing") && e.contains("rtune download test-org/ other"), "{e}");
}

#[test]
fn interrupted_downloads_resume_and_bad_bytes_are_refused() {
    let env = Env::new();
    // The connection drops after 1000 bytes of the LFS file; the retry asks for the rest.
    env.server.state.lock().unwrap().cut_next_body = Some(1000);
    let o = env.ok(&["download", "test-org/tiny-model"], &[]);
    let log = env.server.state.lock().unwrap().log.clone();
    let cdn_gets = log.iter().filter(|(r, _)| r.starts_with("GET /cdn/")).count();
    assert_eq!(cdn_gets, 2, "one cut request, one resumed: {log:?}");
    let snap = PathBuf::from(stdout(&o).trim());
    assert_eq!(std::fs::read(snap.join("model.safetensors")).unwrap(), fixture_repo()[2].1);

    // A part that does not start where the kept bytes end is not appended: the next attempt
    // starts over.
    let env = Env::new();
    {
        let mut st = env.server.state.lock().unwrap();
        st.cut_next_body = Some(1000);
        st.shift_next_range = Some(10);
    }
    let o = env.ok(&["download", "test-org/tiny-model", "--include", "*.safetensors"], &[]);
    let snap = PathBuf::from(stdout(&o).trim());
    assert_eq!(std::fs::read(snap.join("model.safetensors")).unwrap(), fixture_repo()[2].1);
    let cdn_gets = env.server.state.lock().unwrap().log.iter().filter(|(r, _)| r.starts_with("GET /cdn/")).count();
    assert_eq!(cdn_gets, 3, "cut, shifted part refused, whole file");

    // Bytes left by an earlier answer that were not the file's (a `.incomplete` from a broken
    // proxy): the resumed file fails its digest and is fetched again from the start, in the
    // same run.
    let env = Env::new();
    let weights = &fixture_repo()[2].1;
    let blobs = env.hub_cache().join("models--test-org--tiny-model/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::write(blobs.join(format!("{}.incomplete", common::hub::sha256(weights))), vec![b'x'; 1000]).unwrap();
    let o = env.ok(&["download", "test-org/tiny-model", "--include", "*.safetensors"], &[]);
    assert!(stderr(&o).contains("downloading it again from the start"), "{}", stderr(&o));
    let snap = PathBuf::from(stdout(&o).trim());
    assert_eq!(&std::fs::read(snap.join("model.safetensors")).unwrap(), weights);

    // A file whose bytes do not match its digest is rejected and nothing of it is kept.
    let env = Env::new();
    env.server.state.lock().unwrap().corrupt = vec!["model.safetensors".into(), "config.json".into()];
    let o = env.rtune(&["download", "test-org/tiny-model", "--include", "config.json"], &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("rtune::hub::digest_mismatch"), "{}", stderr(&o));
    let o = env.rtune(&["download", "test-org/tiny-model", "--include", "*.safetensors"], &[]);
    assert!(stderr(&o).contains("rtune::hub::digest_mismatch"), "{}", stderr(&o));
    let repo = env.hub_cache().join("models--test-org--tiny-model");
    let blobs: Vec<_> = std::fs::read_dir(repo.join("blobs")).map(|d| d.flatten().collect()).unwrap_or_default();
    assert!(blobs.is_empty(), "no blob kept: {blobs:?}");
    assert!(!repo.join("snapshots").exists());
}

#[test]
fn hostile_answers_are_rejected_before_anything_is_written() {
    for bad in ["../../evil.json", "/etc/evil.json", "a/../../evil.json", "C:\\evil.json"] {
        let env = Env::new();
        env.server.state.lock().unwrap().extra_listing = vec![bad.into()];
        let o = env.rtune(&["download", "test-org/tiny-model"], &[]);
        assert!(!o.status.success(), "{bad}");
        assert!(stderr(&o).contains("rtune::hub::unsafe_path"), "{bad}: {}", stderr(&o));
        assert!(!env.hub_cache().exists(), "{bad}: nothing written");
        assert!(!env.dir.path().join("evil.json").exists() && !env.hf_home().join("evil.json").exists());
    }
    let env = Env::new();
    env.server.state.lock().unwrap().html_api = true;
    let o = env.rtune(&["download", "test-org/tiny-model"], &[]);
    let e = stderr(&o);
    assert!(e.contains("rtune::hub::bad_response") && e.contains("HTML"), "{e}");

    let o = env.rtune(&["download", "../etc"], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("rtune::hub::bad_repo_id"));
    let o = env.rtune(&["download", "test-org/tiny-model", "--revision", "../../x"], &[]);
    assert!(stderr(&o).contains("rtune::hub::bad_revision"));
}

#[test]
fn tokens_authenticate_and_never_show() {
    let env = Env::new();
    env.server.state.lock().unwrap().require_token = Some(TOKEN.into());
    let o = env.rtune(&["download", "test-org/tiny-model", "-v"], &[]);
    assert_eq!(o.status.code(), Some(3));
    assert!(stderr(&o).contains("rtune::hub::unauthorized") && stderr(&o).contains("HF_TOKEN"), "{}", stderr(&o));
    let o = env.rtune(&["download", "test-org/tiny-model", "--token", "hf_wrong"], &[]);
    assert!(stderr(&o).contains("rtune::hub::forbidden"), "{}", stderr(&o));

    // From the variable, the flag, and the token file.
    env.server.state.lock().unwrap().log.clear();
    let by_var = env.rtune(&["download", "test-org/tiny-model", "-v", "--json"], &[("HF_TOKEN", TOKEN)]);
    let by_flag = env.rtune(&["download", "test-org/tiny-model", "-v", "--token", TOKEN], &[]);
    std::fs::write(env.hf_home().join("token"), format!("{TOKEN}\n")).unwrap();
    let by_file = env.rtune(&["download", "test-org/tiny-model", "-v"], &[]);
    for o in [&by_var, &by_flag, &by_file] {
        assert!(o.status.success(), "{}", stderr(o));
        assert!(!stdout(o).contains(TOKEN) && !stderr(o).contains(TOKEN));
    }
    // The token went to the Hub but never to the CDN.
    let log = env.server.state.lock().unwrap().log.clone();
    assert!(log.iter().filter(|(r, _)| r.contains("/api/")).all(|(_, auth)| *auth));
    assert!(log.iter().filter(|(r, _)| r.contains("/cdn/")).all(|(_, auth)| !*auth), "{log:?}");
    // Nothing in the cache holds it.
    for f in walk_all(&env.hub_cache()) {
        if let Ok(text) = std::fs::read(&f) {
            assert!(!String::from_utf8_lossy(&text).contains(TOKEN), "{}", f.display());
        }
    }
}

fn walk_all(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

#[test]
fn server_errors_are_retried_with_backoff_then_reported() {
    let env = Env::new();
    env.server.state.lock().unwrap().fail_next = vec![503, 502, 500];
    env.ok(&["download", "test-org/tiny-model"], &[]);
    // A connection that drops while the listing's body is read is retried too.
    let env = Env::new();
    env.server.state.lock().unwrap().cut_next_json = Some(40);
    env.ok(&["download", "test-org/tiny-model"], &[]);
    let listings = env.server.state.lock().unwrap().log.iter().filter(|(r, _)| r.contains("/revision/")).count();
    assert_eq!(listings, 2, "the cut listing, then a whole one");
    let env = Env::new();
    env.server.state.lock().unwrap().fail_next = vec![503; 10];
    let o = env.rtune(&["download", "test-org/tiny-model"], &[("RTUNE_HUB_ATTEMPTS", "3")]);
    let e = stderr(&o);
    assert!(e.contains("rtune::hub::unreachable") && e.contains("3 attempts") && e.contains("HTTP 503"), "{e}");
    env.server.state.lock().unwrap().fail_next.clear();
    let o = env.rtune(&["download", "test-org/missing"], &[]);
    assert!(stderr(&o).contains("rtune::hub::not_found"), "{}", stderr(&o));
}

#[test]
fn upload_then_download_round_trip() {
    let env = Env::new();
    let src = env.dir.path().join("to-upload");
    std::fs::create_dir_all(src.join("gguf")).unwrap();
    let big: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect(); // multipart LFS
    let medium: Vec<u8> = (0..2_000u32).map(|i| (i * 3 % 256) as u8).collect(); // basic LFS
    std::fs::write(src.join("gguf/model.gguf"), &big).unwrap();
    std::fs::write(src.join("adapter_model.safetensors"), &medium).unwrap();
    std::fs::write(src.join("adapter_config.json"), b"{\"r\": 8}").unwrap();
    let o = env.rtune(&["upload", "me/new-model", src.to_str().unwrap(), "--token", TOKEN], &[]);
    assert!(stderr(&o).contains("rtune::hub::not_found"), "no repo yet: {}", stderr(&o));
    env.ok(&["upload", "me/new-model", src.to_str().unwrap(), "--create", "--token", TOKEN], &[]);
    // Uploading the same content again sends no LFS bytes (the Hub already has them).
    env.server.state.lock().unwrap().log.clear();
    let o = env.ok(&["upload", "me/new-model", src.to_str().unwrap(), "--create", "--json", "--token", TOKEN], &[]);
    let rep: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(rep["lfs_files"], 2);
    assert!(!env.server.state.lock().unwrap().log.iter().any(|(r, _)| r.starts_with("PUT")));

    let o = env.ok(&["download", "me/new-model"], &[]);
    let snap = PathBuf::from(stdout(&o).trim());
    assert_eq!(std::fs::read(snap.join("gguf/model.gguf")).unwrap(), big);
    assert_eq!(std::fs::read(snap.join("adapter_model.safetensors")).unwrap(), medium);
    assert_eq!(std::fs::read(snap.join("adapter_config.json")).unwrap(), b"{\"r\": 8}");
    assert!(env.server.state.lock().unwrap().repos["model:me/new-model"].private, "--create makes private repos");
}

trait FilesCommit {
    fn files_commit(&self, kind: &str, id: &str) -> String;
}

impl FilesCommit for HubServer {
    fn files_commit(&self, kind: &str, id: &str) -> String {
        self.state.lock().unwrap().repos[&format!("{kind}:{id}")].branches["main"].clone()
    }
}

/// A model folder and a dataset made in code, served as Hub repos.
fn publish_tiny_model_and_data(server: &HubServer) -> (String, String) {
    let rows: Vec<String> = synthetic_rows().into_iter().take(300).collect();
    let texts: Vec<String> = rows.clone();
    let dir = tempfile::tempdir().unwrap();
    let spec: rtune::recipe::ScratchModel = toml::from_str(
        "arch = \"llama\"\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 1\nintermediate_size = 64\nvocab_size = 400",
    )
    .unwrap();
    rtune::model::scratch::create(dir.path(), &spec, texts.iter(), 7).unwrap();
    let mut files = Vec::new();
    for name in ["config.json", "tokenizer.json", "model.safetensors"] {
        files.push((name, std::fs::read(dir.path().join(name)).unwrap()));
    }
    let model_commit = server.add_commit("model", "test-org/tiny-llama", &files);
    let data = rows.join("\n").into_bytes();
    let data_commit = server.add_commit(
        "dataset",
        "test-org/tiny-instructions",
        &[("data/train.jsonl", data), ("README.md", b"# data\n".to_vec()), ("dataset_infos.json", b"{}".to_vec())],
    );
    (model_commit, data_commit)
}

const HUB_RECIPE: &str = r#"
[recipe]
name = "hub-demo"
seed = 1

[model]
repo = "test-org/tiny-llama"

[dataset]
repo = "test-org/tiny-instructions"
format = "alpaca"
eval_fraction = 0.1
max_seq_len = 256

[adapter]
kind = "lora"
rank = 4
alpha = 8
targets = ["q_proj", "v_proj"]

[device]
prefer = ["cpu"]
dtype = ["f32"]

[stages.train]
max_steps = 4
batch_size = 8
learning_rate = 1e-2

[stages.evaluate]
model = "tuned"

[stages.quantize]
formats = ["peft-adapter", "safetensors-merged"]

[stages.upload]
to = "hf://test-org/tiny-llama-tuned"
create = true
"#;

#[test]
fn a_recipe_with_hub_sources_downloads_trains_and_uploads() {
    let env = Env::new();
    env.server.state.lock().unwrap().require_token = Some(TOKEN.into());
    let (model_commit, data_commit) = publish_tiny_model_and_data(&env.server);
    std::fs::write(env.dir.path().join("hub.toml"), HUB_RECIPE).unwrap();
    let auth = [("HF_TOKEN", TOKEN)];

    // Nothing is cached, so planning retries a connection dropped mid-answer.
    env.server.state.lock().unwrap().cut_next_json = Some(20);
    let plan = stdout(&env.ok(&["plan", "hub.toml", "--json"], &auth));
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    let sources = &plan["stages"][0]["doc"]["sources"];
    assert_eq!(sources["model"]["commit"], model_commit.as_str());
    assert_eq!(sources["dataset"]["commit"], data_commit.as_str());

    let o = env.ok(&["run", "hub.toml", "--json"], &auth);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(!stdout(&o).contains(TOKEN) && !common::stderr(&o).contains(TOKEN));
    // The commit is in rtune.lock; the files are in the shared HF cache (hard-linked into the artifact).
    let lock = std::fs::read_to_string(env.dir.path().join("rtune.lock")).unwrap();
    assert!(lock.contains(&model_commit) && lock.contains(&data_commit) && !lock.contains(TOKEN));
    let snap = env.hub_cache().join("models--test-org--tiny-llama/snapshots").join(&model_commit);
    assert!(snap.join("model.safetensors").exists());
    let ds_snap = env.hub_cache().join("datasets--test-org--tiny-instructions/snapshots").join(&data_commit);
    assert!(ds_snap.join("data/train.jsonl").exists() && !ds_snap.join("dataset_infos.json").exists());

    // The upload is one commit with the adapter, the merged model and a model card.
    let uploaded = env.server.files("model", "test-org/tiny-llama-tuned", "main").expect("repo created");
    for f in [
        "peft-adapter/adapter_config.json",
        "peft-adapter/adapter_model.safetensors",
        "merged/model.safetensors",
        "README.md",
        "loss_curve.svg",
    ] {
        assert!(uploaded.keys().any(|k| k.ends_with(f)), "{f} not in {:?}", uploaded.keys().collect::<Vec<_>>());
    }
    let card = String::from_utf8(uploaded["README.md"].clone()).unwrap();
    assert!(card.starts_with("---\nbase_model: test-org/tiny-llama\nlibrary_name: peft\n"), "{card}");
    assert!(card.contains("| evaluate | tuned |") && card.contains("```toml"), "{card}");
    let up = report["stages"].as_array().unwrap().iter().find(|s| s["name"] == "upload").unwrap();
    assert_eq!(up["metrics"]["commit"].as_str().unwrap().len(), 40);

    // Issue 19: with the Hub reachable, `plan` checks the uploaded files are still there; a
    // file deleted on the Hub makes the upload restore (re-commit) it from the store.
    let plan = stdout(&env.ok(&["plan", "hub.toml"], &auth));
    assert!(plan.contains("0 to run, 6 cached"), "{plan}");
    env.server.delete_files("model", "test-org/tiny-llama-tuned", &["README.md"]);
    let plan = stdout(&env.ok(&["plan", "hub.toml"], &auth));
    assert!(plan.contains("restore  destination changed on the Hub: README.md"), "{plan}");
    // A repo whose .gitignore excludes a file the export names refuses the commit (its record
    // would name a file the Hub does not keep), and commits nothing.
    env.server.state.lock().unwrap().ignored = vec!["README.md".into()];
    let o = env.rtune(&["run", "hub.toml"], &auth);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("rtune::hub::ignored") && e.contains("`README.md`"), "{e}");
    assert!(!env.server.files("model", "test-org/tiny-llama-tuned", "main").unwrap().contains_key("README.md"));
    env.server.state.lock().unwrap().ignored.clear();
    let o = env.ok(&["run", "hub.toml"], &auth);
    assert!(stderr(&o).contains("re-uploaded"), "{}", stderr(&o));
    let restored = env.server.files("model", "test-org/tiny-llama-tuned", "main").unwrap();
    assert_eq!(restored, uploaded);

    // Bytes replaced on the Hub by others of the same size (another fine-tune of the same shape
    // pushed to the repo) are found by their digests: an inline file's git blob id, an LFS
    // file's sha256.
    let largest = uploaded.iter().max_by_key(|(_, b)| b.len()).map(|(p, _)| p.clone()).unwrap();
    let flipped = |p: &str| {
        let mut b = uploaded[p].clone();
        let mid = b.len() / 2;
        b[mid] ^= 1;
        b
    };
    env.server.add_commit(
        "model",
        "test-org/tiny-llama-tuned",
        &[("README.md", flipped("README.md")), (largest.as_str(), flipped(&largest))],
    );
    let plan = stdout(&env.ok(&["plan", "hub.toml"], &auth));
    assert!(plan.contains(&format!("restore  destination changed on the Hub: README.md, {largest}")), "{plan}");
    env.ok(&["run", "hub.toml"], &auth);
    assert_eq!(env.server.files("model", "test-org/tiny-llama-tuned", "main").unwrap(), uploaded);

    // The plan lists the destination once (it must not stall on an unreachable Hub); when that
    // one answer fails, the run asks again as an upload would, and restores what is gone.
    let listing = "GET /api/models/test-org/tiny-llama-tuned/revision/";
    let few = [("HF_TOKEN", TOKEN), ("RTUNE_HUB_ATTEMPTS", "3")];
    env.server.delete_files("model", "test-org/tiny-llama-tuned", &["README.md"]);
    env.server.state.lock().unwrap().fail_matching = vec![(listing.into(), 503)];
    let o = env.ok(&["run", "hub.toml"], &few);
    let e = stderr(&o);
    assert!(e.contains("cached destination not checked: listing") && e.contains("re-uploaded"), "{e}");
    assert!(!e.contains("were not verified"), "{e}");
    assert_eq!(env.server.files("model", "test-org/tiny-llama-tuned", "main").unwrap(), uploaded);
    // A Hub that lists nothing: the run succeeds on what it has, and says it verified nothing.
    env.server.delete_files("model", "test-org/tiny-llama-tuned", &["README.md"]);
    env.server.state.lock().unwrap().fail_matching = vec![(listing.into(), 503); 4];
    let o = env.ok(&["run", "hub.toml"], &few);
    let e = stderr(&o);
    assert!(e.contains("upload: destination not checked") && e.contains("were not verified or restored"), "{e}");
    assert!(env.server.state.lock().unwrap().fail_matching.is_empty(), "the plan's one try and the run's three");
    assert!(!env.server.files("model", "test-org/tiny-llama-tuned", "main").unwrap().contains_key("README.md"));
    env.ok(&["run", "hub.toml"], &auth);
    assert_eq!(env.server.files("model", "test-org/tiny-llama-tuned", "main").unwrap(), uploaded);
    let plan = stdout(&env.ok(&["plan", "hub.toml", "--offline"], &[]));
    assert!(plan.contains("cached  destination not checked (offline)"), "{plan}");

    // Offline afterwards: every stage is cached and the Hub is not asked anything.
    env.server.state.lock().unwrap().log.clear();
    let o = env.ok(&["run", "hub.toml", "--offline", "--json"], &[]);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(common::outcomes(&report).iter().all(|(_, o)| o == "cached"), "{report}");
    assert!(env.server.state.lock().unwrap().log.is_empty());

    // A fresh HF cache offline: the pre-flight lists every missing file with the command to fetch it.
    std::fs::remove_dir_all(env.dir.path().join("rtune-cache")).unwrap();
    std::fs::remove_dir_all(env.hub_cache().join("models--test-org--tiny-llama/blobs")).unwrap();
    let o = env.rtune(&["plan", "hub.toml", "--offline"], &[]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("rtune::hub::offline_missing")
            && e.contains("config.json")
            && e.contains("rtune download test-org/tiny-llama"),
        "{e}"
    );
}

#[test]
fn shipped_hub_recipes_plan_against_a_local_hub() {
    let env = Env::new();
    let mut planned = 0;
    for entry in std::fs::read_dir(common::root().join("recipes")).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let recipe: toml::Table = toml::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let Some(model) = recipe["model"].get("repo").and_then(|r| r.as_str()) else { continue };
        let model_commit = env.server.add_commit("model", model, &[("config.json", b"{}".to_vec())]);
        if let Some(ds) = recipe["dataset"].get("repo").and_then(|r| r.as_str()) {
            env.server.add_commit("dataset", ds, &[("data.jsonl", b"{}".to_vec())]);
        }
        let o = env.rtune(&["plan", p.to_str().unwrap(), "--json"], &[]);
        assert!(o.status.success(), "{}: {}", p.display(), stderr(&o));
        let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(plan["stages"][0]["doc"]["sources"]["model"]["commit"], model_commit.as_str(), "{}", p.display());
        planned += 1;
    }
    assert!(planned >= 7, "planned {planned} Hub recipes");

    // Without a reachable Hub or a cache, planning fails fast with a clear error.
    let o = env.rtune(
        &["plan", common::root().join("recipes/smollm2-135m-lora.toml").to_str().unwrap()],
        &[("HF_ENDPOINT", "http://127.0.0.1:9"), ("RTUNE_HUB_ATTEMPTS", "5")],
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("rtune::hub::unreachable") && e.contains("--offline"), "{e}");
}

/// Issue 21: a lock file is input too. A commit in it that is not a commit id is never used
/// (it would be printed into a command to paste), and suggested commands are shell-quoted.
#[test]
fn a_hostile_lock_file_commit_is_not_believed() {
    let env = Env::new();
    publish_tiny_model_and_data(&env.server);
    std::fs::write(env.dir.path().join("hub.toml"), HUB_RECIPE).unwrap();
    env.ok(&["run", "hub.toml", "--only", "download"], &[]);
    let lock_path = env.dir.path().join("rtune.lock");
    let lock = std::fs::read_to_string(&lock_path).unwrap();
    let commit = lock.split("\"commit\": \"").nth(1).unwrap()[..40].to_string();
    std::fs::write(&lock_path, lock.replace(&commit, "$(touch pwned)")).unwrap();
    std::fs::remove_dir_all(env.hub_cache()).unwrap();
    let o = env.rtune(&["plan", "hub.toml", "--offline"], &[]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("rtune::hub::offline_missing") && !e.contains("pwned"), "{e}");
}

/// Issue 21: a blob damaged in the HF cache is verified when reused and fetched again (bit rot
/// must not become permanent); a symlink planted as `.incomplete` is never followed; a listing
/// and headers that disagree on a size stop the transfer.
#[test]
fn damaged_blobs_planted_links_and_size_lies_are_caught() {
    let env = Env::new();
    let o = env.ok(&["download", "test-org/tiny-model"], &[]);
    let snap = PathBuf::from(stdout(&o).trim());
    let config = std::fs::canonicalize(snap.join("config.json")).unwrap();
    let good = std::fs::read(&config).unwrap();
    let mut bad = good.clone();
    bad[3] ^= 1;
    std::fs::write(&config, &bad).unwrap();
    let o = env.ok(&["download", "test-org/tiny-model"], &[]);
    assert!(stderr(&o).contains("does not match its digest"), "{}", stderr(&o));
    assert_eq!(std::fs::read(snap.join("config.json")).unwrap(), good);

    // A link planted where a download resumes: its target is left alone.
    let env = Env::new();
    let victim = env.dir.path().join("victim.txt");
    std::fs::write(&victim, b"precious").unwrap();
    let notes = &fixture_repo()[1].1;
    let blobs = env.hub_cache().join("models--test-org--tiny-model/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(&victim, blobs.join(format!("{}.incomplete", common::hub::blob_id(notes)))).unwrap();
    env.ok(&["download", "test-org/tiny-model"], &[]);
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");

    // The listing says 5 bytes; the file has 12: nothing is fetched.
    let env = Env::new();
    env.server.state.lock().unwrap().listed_size.insert("sub/notes.txt".into(), 5);
    let o = env.rtune(&["download", "test-org/tiny-model", "--include", "sub/*"], &[]);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("the listing says the file has 5 bytes but its headers say 12"), "{e}");
    let log = env.server.state.lock().unwrap().log.clone();
    assert!(!log.iter().any(|(r, _)| r.starts_with("GET ") && r.contains("notes.txt")), "{log:?}");
}

/// Issue 21: what a server sends back is redacted and escaped before it is printed: a proxy
/// that echoes the Authorization header cannot put the token (or terminal escapes) on screen.
#[test]
fn echoed_tokens_and_escape_sequences_never_reach_the_terminal() {
    let env = Env::new();
    env.server.state.lock().unwrap().echo_auth = true;
    let o = env.rtune(&["download", "test-org/tiny-model"], &[("HF_TOKEN", TOKEN)]);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("rtune::hub::bad_response"), "{e}");
    assert!(!e.contains(TOKEN) && !e.contains('\u{1b}'), "{e}");
}

/// Issue 21, item 10: `rtune upload` honours HF_HUB_OFFLINE; a server that wants a large file
/// inline gets it through LFS (never read whole into a JSON body); a leftover `.incomplete`
/// longer than the file does not spoil a download that has one attempt.
#[test]
fn uploads_respect_offline_and_big_files_go_through_lfs_and_leftovers_restart() {
    let env = Env::new();
    let src = env.dir.path().join("to-upload");
    std::fs::create_dir_all(&src).unwrap();
    let big: Vec<u8> = (0..(11u32 << 20)).map(|i| (i % 253) as u8).collect();
    std::fs::write(src.join("big.bin"), &big).unwrap();
    let o =
        env.rtune(&["upload", "me/m", src.to_str().unwrap(), "--create", "--token", TOKEN], &[("HF_HUB_OFFLINE", "1")]);
    assert!(!o.status.success() && stderr(&o).contains("rtune::hub::offline"), "{}", stderr(&o));
    assert!(env.server.state.lock().unwrap().log.is_empty(), "nothing was sent offline");

    env.server.state.lock().unwrap().all_regular = true;
    let o = env.ok(&["upload", "me/m", src.to_str().unwrap(), "--create", "--json", "--token", TOKEN], &[]);
    let rep: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(rep["lfs_files"], 1, "{rep}");
    assert_eq!(env.server.files("model", "me/m", "main").unwrap()["big.bin"], big);

    // `rtune upload` skips a file the repo's .gitignore excludes, says so, and reports it.
    std::fs::write(src.join("notes.txt"), b"not kept").unwrap();
    {
        let mut st = env.server.state.lock().unwrap();
        st.all_regular = false;
        st.ignored = vec!["notes.txt".into()];
    }
    let o = env.ok(&["upload", "me/m", src.to_str().unwrap(), "--json", "--token", TOKEN], &[]);
    assert!(stderr(&o).contains("not uploaded: `notes.txt`"), "{}", stderr(&o));
    let rep: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(rep["ignored"], serde_json::json!(["notes.txt"]), "{rep}");
    assert!(!env.server.files("model", "me/m", "main").unwrap().contains_key("notes.txt"));

    let env = Env::new();
    let notes = &fixture_repo()[1].1;
    let blobs = env.hub_cache().join("models--test-org--tiny-model/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::write(blobs.join(format!("{}.incomplete", common::hub::blob_id(notes))), vec![b'x'; 100]).unwrap();
    let o = env.ok(&["download", "test-org/tiny-model", "--include", "sub/*"], &[("RTUNE_HUB_ATTEMPTS", "1")]);
    let snap = PathBuf::from(stdout(&o).trim());
    assert_eq!(&std::fs::read(snap.join("sub/notes.txt")).unwrap(), notes);
}

/// Run `cmd` with its output in files; `None` when it is still running after `secs` (killed).
fn output_within(mut cmd: Command, dir: &Path, secs: u64) -> Option<Output> {
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    cmd.stdout(std::fs::File::create(&out).unwrap()).stderr(std::fs::File::create(&err).unwrap());
    let mut child = cmd.spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    Some(Output { status, stdout: std::fs::read(out).unwrap(), stderr: std::fs::read(err).unwrap() })
}

impl Env {
    /// `rtune args` under a deadline, with two attempts per request (the chaos cases).
    fn rtune_within(&self, args: &[&str], secs: u64) -> Option<Output> {
        self.rtune_within_env(args, secs, &[])
    }

    fn rtune_within_env(&self, args: &[&str], secs: u64, extra: &[(&str, &str)]) -> Option<Output> {
        let mut vars = vec![("RTUNE_HUB_BACKOFF_MS", "1"), ("RTUNE_HUB_ATTEMPTS", "2")];
        vars.extend_from_slice(extra);
        output_within(self.command(args, &vars), self.dir.path(), secs)
    }

    /// The upload stage of `run --json`'s report recorded files that the Hub holds, each with
    /// the bytes it recorded.
    fn hub_holds_the_upload(&self, report: &[u8]) -> Result<(), String> {
        let report: serde_json::Value = serde_json::from_slice(report).map_err(|e| format!("report: {e}"))?;
        let stage = report["stages"].as_array().into_iter().flatten().find(|s| s["name"] == "upload");
        let dir = stage.and_then(|s| s["artifact"].as_str()).ok_or("no upload artifact in the report")?;
        let record = std::fs::read_to_string(Path::new(dir).join("upload.json")).map_err(|e| format!("record: {e}"))?;
        let record: serde_json::Value = serde_json::from_str(&record).unwrap();
        let repo = record["destination"].as_str().unwrap().strip_prefix("hf://").unwrap();
        let on_hub = self.server.files("model", repo, "main").ok_or(format!("{repo} is not on the Hub"))?;
        let files = record["files"].as_object().unwrap();
        if files.len() < 4 {
            return Err(format!("the record names {} files", files.len()));
        }
        for (path, w) in files {
            let bytes = on_hub.get(path).ok_or(format!("{path} is not on the Hub"))?;
            if blake3::hash(bytes).to_hex().as_str() != w["digest"] || bytes.len() as u64 != w["size"] {
                return Err(format!("{path} has other bytes on the Hub than the record's"));
            }
        }
        Ok(())
    }

    /// Every blob in the repo's cache folder is named by its digest, and every snapshot file
    /// holds the repo's bytes for its path.
    fn cache_is_sound(&self, id: &str, files: &std::collections::BTreeMap<String, Vec<u8>>) -> Result<(), String> {
        let repo = self.hub_cache().join(format!("models--{}", id.replace('/', "--")));
        for e in std::fs::read_dir(repo.join("blobs")).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.ends_with(".incomplete") {
                continue;
            }
            let bytes = std::fs::read(e.path()).map_err(|e| format!("blob {name}: {e}"))?;
            let digest = if name.len() == 64 { common::hub::sha256(&bytes) } else { common::hub::blob_id(&bytes) };
            if digest != name {
                return Err(format!("blob {name} holds bytes whose digest is {digest}"));
            }
        }
        for snap in std::fs::read_dir(repo.join("snapshots")).into_iter().flatten().flatten() {
            for f in walk_all(&snap.path()) {
                let rel = f.strip_prefix(snap.path()).unwrap().to_string_lossy().replace('\\', "/");
                let bytes = std::fs::read(&f).map_err(|e| format!("{rel}: {e}"))?;
                match files.get(&rel) {
                    Some(want) if *want == bytes => {}
                    Some(_) => return Err(format!("snapshot file {rel} has other bytes than the repo's")),
                    None => return Err(format!("snapshot file {rel} is not in the repo")),
                }
            }
        }
        Ok(())
    }
}

/// The bundled synthetic Alpaca rows, one JSON line each.
fn synthetic_rows() -> Vec<String> {
    std::fs::read_to_string(common::root().join("recipes/data/synthetic-alpaca.jsonl"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Rows as a JSON Lines file's bytes.
fn jsonl(rows: &[String]) -> Vec<u8> {
    (rows.join("\n") + "\n").into_bytes()
}

/// `rtune run --until tokenize` of HUB_RECIPE reading dataset `repo`, its eval fraction replaced
/// by `extra`: the tokenize stage's metrics and stderr, or the failure's stderr.
fn tokenize_hub_dataset(env: &Env, repo: &str, extra: &str) -> Result<(serde_json::Value, String), String> {
    tokenize_hub_dataset_stages(env, repo, extra).map(|(m, _, err)| (m, err))
}

/// [`tokenize_hub_dataset`], with the download stage's metrics too.
fn tokenize_hub_dataset_stages(
    env: &Env,
    repo: &str,
    extra: &str,
) -> Result<(serde_json::Value, serde_json::Value, String), String> {
    let recipe = HUB_RECIPE.replace("test-org/tiny-instructions", repo).replace("eval_fraction = 0.1\n", extra);
    std::fs::write(env.dir.path().join("hub.toml"), recipe).unwrap();
    let o = env.rtune(&["run", "hub.toml", "--until", "tokenize", "--json"], &[]);
    let err = common::stderr(&o);
    if !o.status.success() {
        return Err(err);
    }
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let metrics = |name: &str| {
        report["stages"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap()["metrics"].clone()
    };
    Ok((metrics("tokenize"), metrics("download"), err))
}

/// A Hub dataset's test shards never train: `data/{split}-00000-of-00001.*` files are splits as
/// 🤗 datasets reads them (before, every file's rows were pooled), and `eval_split` evaluates on
/// one of them.
#[test]
fn a_hub_dataset_trains_on_its_train_split() {
    let env = Env::new();
    publish_tiny_model_and_data(&env.server);
    let rows = synthetic_rows();
    env.server.add_commit(
        "dataset",
        "test-org/split-instructions",
        &[
            ("data/train-00000-of-00002.jsonl", jsonl(&rows[..40])),
            ("data/train-00001-of-00002.jsonl", jsonl(&rows[40..60])),
            ("data/test-00000-of-00001.jsonl", jsonl(&rows[60..70])),
            ("data/validation-00000-of-00001.jsonl", jsonl(&rows[70..75])),
            ("dataset_dict.json", b"{}".to_vec()),
        ],
    );
    let tokenize = |extra: &str| tokenize_hub_dataset(&env, "test-org/split-instructions", extra);
    let (m, err) = tokenize("").unwrap();
    assert_eq!((m["rows"].as_u64(), m["eval_rows"].as_u64()), (Some(60), Some(3)), "{m}");
    assert!(err.contains("not read: `validation` (1 file), `test` (1 file)"), "{err}");
    let (m, _) = tokenize("eval_split = \"test\"\n").unwrap();
    assert_eq!((m["train_rows"].as_u64(), m["eval_rows"].as_u64()), (Some(60), Some(10)), "{m}");
    // A split the shards do not name fails the stage, located at it, naming those they do.
    let err = tokenize("split = \"train_sft\"\n").unwrap_err();
    let flat = err.split_whitespace().filter(|w| *w != "│").collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("no split `train_sft`: they name `train` (2 files), `validation` (1 file), `test` (1 file)"),
        "{err}"
    );
    assert!(err.lines().any(|l| l.contains('│') && l.contains("split = \"train_sft\"")), "{err}");
}

/// A Hub dataset card's `configs:` say which files each split of a config holds, as
/// `load_dataset(repo, name)` reads them: the default config unless `dataset.config` names
/// another (before, the card was not even downloaded and every data file was pooled). Only the
/// card and the chosen config's files are downloaded (before, every config's), and its loader
/// settings (a CSV `sep`) apply.
#[test]
fn a_hub_dataset_card_chooses_the_config_files() {
    let env = Env::new();
    publish_tiny_model_and_data(&env.server);
    let rows = synthetic_rows();
    let card = "---\nlicense: mit\nconfigs:\n- config_name: sft\n  default: true\n  data_files:\n  - split: train\n    \
                path: sft/train-*\n  - split: test\n    path: sft/test-*\n- config_name: raw\n  data_dir: raw\n- config_name: blank\n  data_files: blank/train.jsonl\n- config_name: semi\n  \
                data_files: semi/train.csv\n  sep: ';'\n---\n# Data\n";
    // The `semi` config's rows as a semicolon-separated CSV (quoted: cells hold `;` and `"`).
    let quote = |v: &serde_json::Value| format!("\"{}\"", v.as_str().unwrap().replace('"', "\"\""));
    let mut semi = String::from("instruction;input;output\n");
    for r in &rows[200..230] {
        let r: serde_json::Value = serde_json::from_str(r).unwrap();
        semi += &format!("{};{};{}\n", quote(&r["instruction"]), quote(&r["input"]), quote(&r["output"]));
    }
    env.server.add_commit(
        "dataset",
        "test-org/configs",
        &[
            ("README.md", card.as_bytes().to_vec()),
            ("sft/train-00000-of-00001.jsonl", jsonl(&rows[..50])),
            ("sft/test-00000-of-00001.jsonl", jsonl(&rows[50..58])),
            ("raw/train.jsonl", jsonl(&rows[100..120])),
            ("blank/train.jsonl", b"\n\n".to_vec()),
            ("semi/train.csv", semi.into_bytes()),
        ],
    );
    let tokenize = |extra: &str| tokenize_hub_dataset(&env, "test-org/configs", extra);
    let (m, download, err) = tokenize_hub_dataset_stages(&env, "test-org/configs", "eval_split = \"test\"\n").unwrap();
    assert_eq!((m["train_rows"].as_u64(), m["eval_rows"].as_u64()), (Some(50), Some(8)), "{m}");
    assert!(!err.contains("not read"), "{err}");
    assert_eq!(download["dataset"]["files"], 3, "the card and sft's two files: {download}");
    let (m, download, _) = tokenize_hub_dataset_stages(&env, "test-org/configs", "config = \"raw\"\n").unwrap();
    assert_eq!(m["rows"], 20, "{m}");
    assert_eq!(download["dataset"]["files"], 2, "the card and raw's one file: {download}");
    let cached = layout(&env.hub_cache().join("datasets--test-org--configs/snapshots"));
    assert!(
        cached.contains("raw/train.jsonl") && !cached.contains("blank/"),
        "blank's file was never fetched: {cached}"
    );
    // Offline, with a new store, the HF cache's `raw` files are enough: the plan's offline check
    // reads the cached card too (it asked for every config's files).
    let fresh = env.dir.path().join("fresh-store");
    let o = env.rtune(
        &["run", "hub.toml", "--until", "tokenize"],
        &[("HF_HUB_OFFLINE", "1"), ("RTUNE_CACHE_DIR", fresh.to_str().unwrap())],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let (m, download, _) = tokenize_hub_dataset_stages(&env, "test-org/configs", "config = \"semi\"\n").unwrap();
    assert_eq!((m["rows"].as_u64(), &download["dataset"]["files"]), (Some(30), &2.into()), "{m} {download}");
    let err = tokenize("config = \"cooked\"\n").unwrap_err();
    let flat = err.split_whitespace().filter(|w| *w != "│").collect::<Vec<_>>().join(" ");
    assert!(flat.contains("the dataset has no config `cooked`: it has `sft`, `raw`, `blank`, `semi`"), "{err}");
    // A split without rows is named by its own files (not the card's, nor other configs').
    let err = tokenize("config = \"blank\"\n").unwrap_err();
    assert!(err.contains("the dataset `blank/train.jsonl` has no rows"), "{err}");
}

/// A Hub (or proxy, or network) that answers wrongly — any status, headers dropped or set to
/// garbage, bodies cut, flipped, doubled, replaced or framed wrongly, JSON fields of the wrong
/// shape, bytes that are not HTTP at all — never makes a download, an upload or a run of a
/// recipe with Hub sources panic or hang; a failure is a diagnostic (`rtune::hub` for the Hub
/// commands); the HF cache never holds a blob whose name is not its digest or a snapshot file
/// with bytes other than the repo's; and the same command afterwards against a sound Hub
/// succeeds with the right bytes. New cases every run (`CHAOS_CASES=n` for more,
/// `CHAOS_DEBUG=1` prints each case's damage and outcome).
mod chaos {
    use super::*;
    use common::hub::Chaos;
    use proptest::prelude::*;

    fn judge(what: &str, o: Option<Output>, applied: &[String]) -> Result<bool, TestCaseError> {
        if std::env::var_os("CHAOS_DEBUG").is_some() {
            eprintln!(
                "{what}: {applied:?} -> {:?}",
                o.as_ref().map(|o| (o.status.code(), stderr(o).lines().next().map(str::to_string)))
            );
        }
        let Some(o) = o else {
            return Err(TestCaseError::fail(format!("{what} hung (over 60 s) after {applied:#?}")));
        };
        let e = stderr(&o);
        prop_assert!(!e.contains("panicked"), "{what} panicked after {applied:#?}:\n{e}");
        prop_assert!(
            matches!(o.status.code(), Some(0 | 1 | 3)),
            "{what}: exit {:?} after {applied:#?}:\n{e}",
            o.status
        );
        if !o.status.success() {
            // `rtune run` wraps a stage's failure; the Hub's own commands say it is the Hub's.
            let code = if what == "run" { "rtune::" } else { "rtune::hub::" };
            prop_assert!(e.contains(code), "{what}: not a diagnostic after {applied:#?}:\n{e}");
        }
        Ok(o.status.success())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: std::env::var("CHAOS_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(48), failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn random_hub_answers_never_panic_hang_or_poison_the_cache(
            seed in any::<u64>(),
            percent in prop::sample::select(vec![15u64, 40, 100]),
            what in prop::sample::select(vec!["download", "upload", "run", "stage"]),
            restore in any::<bool>(),
        ) {
            // One server for every case (each would hold two listening sockets to the end).
            static SERVER: std::sync::OnceLock<HubServer> = std::sync::OnceLock::new();
            let env = Env::on(SERVER.get_or_init(HubServer::start).clone());
            let files: std::collections::BTreeMap<String, Vec<u8>> =
                fixture_repo().into_iter().map(|(p, b)| (p.to_string(), b)).collect();
            env.server.state.lock().unwrap().chaos = Some(Chaos::new(seed, percent));
            let src = env.dir.path().join("to-upload");
            if what == "run" {
                // A recipe with Hub sources: planning resolves both, the download stage fetches.
                env.server.state.lock().unwrap().chaos = None;
                publish_tiny_model_and_data(&env.server);
                std::fs::write(env.dir.path().join("hub.toml"), HUB_RECIPE).unwrap();
                env.server.state.lock().unwrap().chaos = Some(Chaos::new(seed, percent));
                let args = ["run", "hub.toml", "--until", "download"];
                let o = env.rtune_within(&args, 60);
                let applied = env.server.state.lock().unwrap().chaos.take().unwrap().applied;
                judge("run", o, &applied)?;
                let o = env.rtune_within(&args, 60).unwrap();
                prop_assert!(o.status.success(), "a sound Hub after {:#?}:\n{}", applied, stderr(&o));
                let o = env.rtune_within(&["cache", "verify"], 60).unwrap();
                prop_assert!(o.status.success(), "cache verify after {:#?}:\n{}", applied, stderr(&o));
            } else if what == "stage" {
                // A recipe's upload stage: its first commit, to a repo it creates, or (`restore`)
                // putting back files deleted on the Hub, which the plan finds by listing the repo.
                env.server.state.lock().unwrap().chaos = None;
                publish_tiny_model_and_data(&env.server);
                std::fs::write(env.dir.path().join("hub.toml"), HUB_RECIPE).unwrap();
                let auth = [("HF_TOKEN", TOKEN)];
                let sound = |args: &[&str]| env.rtune_within_env(args, 60, &auth).unwrap();
                let o = sound(if restore { &["run", "hub.toml"] } else { &["run", "hub.toml", "--until", "quantize"] });
                prop_assert!(o.status.success(), "the sound run before the chaos:\n{}", stderr(&o));
                if restore {
                    env.server.delete_files("model", "test-org/tiny-llama-tuned", &["README.md", "merged/model.safetensors"]);
                }
                env.server.state.lock().unwrap().chaos = Some(Chaos::new(seed, percent));
                let args = ["run", "hub.toml", "--json"];
                let o = env.rtune_within_env(&args, 60, &auth);
                let applied = env.server.state.lock().unwrap().chaos.take().unwrap().applied;
                let (e, out) = o.as_ref().map(|o| (stderr(o), o.stdout.clone())).unwrap_or_default();
                // A success has every recorded file on the Hub, unless the run said the Hub did
                // not let it check the destination (and so it verified nothing).
                if judge("run", o, &applied)? && !e.contains("were not verified or restored") {
                    env.hub_holds_the_upload(&out).map_err(|m| TestCaseError::fail(format!("{m} after {applied:#?}:\n{e}")))?;
                }
                let o = sound(&args);
                prop_assert!(o.status.success(), "a sound Hub after {:#?}:\n{}", applied, stderr(&o));
                env.hub_holds_the_upload(&o.stdout).map_err(|m| TestCaseError::fail(format!("{m} after {applied:#?}")))?;
                let o = sound(&["plan", "hub.toml"]);
                prop_assert!(stdout(&o).contains("0 to run"), "the plan after {:#?}:\n{}", applied, stdout(&o));
                let o = sound(&["cache", "verify"]);
                prop_assert!(o.status.success(), "cache verify after {:#?}:\n{}", applied, stderr(&o));
            } else if what == "upload" {
                // A file past the multipart threshold too.
                let mut files = files.clone();
                files.insert("big.bin".into(), (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect());
                std::fs::create_dir_all(src.join("sub")).unwrap();
                for (p, b) in &files {
                    std::fs::write(src.join(p), b).unwrap();
                }
                let args = ["upload", "me/up", src.to_str().unwrap(), "--create", "--token", TOKEN];
                let o = env.rtune_within(&args, 60);
                let applied = env.server.state.lock().unwrap().chaos.take().unwrap().applied;
                let e = o.as_ref().map(stderr).unwrap_or_default();
                if judge("upload", o, &applied)? {
                    // Every file is on the Hub with its bytes, or the upload said it was not sent
                    // (a `shouldIgnore` answer: the repo's .gitignore excludes it).
                    let got = env.server.files("model", "me/up", "main").unwrap_or_default();
                    for (p, b) in &files {
                        match got.get(p) {
                            Some(g) => prop_assert!(g == b, "{} has other bytes after {:#?}", p, applied),
                            None => prop_assert!(
                                e.contains("not uploaded:") && e.contains(&format!("`{p}`")),
                                "{} missing without a warning after {:#?}:\n{}", p, applied, e
                            ),
                        }
                    }
                }
                let o = env.rtune_within(&args, 60).unwrap();
                prop_assert!(o.status.success(), "a sound Hub after {:#?}:\n{}", applied, stderr(&o));
                prop_assert!(env.server.files("model", "me/up", "main") == Some(files), "the files on the Hub after {:#?}", applied);
            } else {
                let o = env.rtune_within(&["download", "test-org/tiny-model"], 60);
                let applied = env.server.state.lock().unwrap().chaos.take().unwrap().applied;
                judge("download", o, &applied)?;
                env.cache_is_sound("test-org/tiny-model", &files)
                    .map_err(|e| TestCaseError::fail(format!("{e} after {applied:#?}")))?;
                let o = env.rtune_within(&["download", "test-org/tiny-model"], 60).unwrap();
                prop_assert!(o.status.success(), "a sound Hub after {:#?}:\n{}", applied, stderr(&o));
                let snap = PathBuf::from(stdout(&o).trim());
                for (p, b) in &files {
                    prop_assert_eq!(&std::fs::read(snap.join(p)).unwrap(), b, "{} after {:#?}", p, applied);
                }
                env.cache_is_sound("test-org/tiny-model", &files).map_err(TestCaseError::fail)?;
            }
        }
    }
}
