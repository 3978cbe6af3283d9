//! The `rtune` binary: parses the command line, runs a command, maps errors to exit codes.

#![allow(clippy::result_large_err)] // see lib.rs

mod cli;

use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use serde_json::json;

use cli::{CacheCommand, Cli, Command, PlanFormat, RecipeArgs, SelectArgs};
use rtune::device::{self, Inventory};
use rtune::plan::{self, LockFile, Selection};
use rtune::recipe::{self, Overrides, Problem, builtin};
use rtune::store::Store;
use rtune::ui::{Ui, count, human_bytes};
use rtune::{Error, exec, hub};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let ui = Ui::new(cli.global.quiet, cli.global.verbose);
    // First Ctrl-C: the training loop checkpoints and stops. Second: exit at once.
    let _ = ctrlc::set_handler(|| {
        if rtune::train::INTERRUPTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: saving a checkpoint (press Ctrl-C again to quit at once)");
    });
    match run(cli, &ui) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            report(&e);
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

fn report(e: &dyn miette::Diagnostic) {
    let color = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    if color {
        let width = terminal_width().unwrap_or(100);
        let handler = miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode()).with_width(width);
        let mut s = String::new();
        let _ = handler.render_report(&mut s, e);
        eprint!("{s}");
    } else {
        eprint!("{}", rtune::ui::render_plain(e));
    }
}

fn terminal_width() -> Option<usize> {
    std::env::var("COLUMNS").ok()?.parse().ok()
}

fn repo_kind(t: cli::RepoType) -> hub::RepoKind {
    match t {
        cli::RepoType::Model => hub::RepoKind::Model,
        cli::RepoType::Dataset => hub::RepoKind::Dataset,
    }
}

fn store(cli: &cli::Global) -> Result<Store, Error> {
    let root = cli.cache_dir.clone().unwrap_or_else(Store::default_root);
    Ok(Store::open(&root)?)
}

fn load(args: &RecipeArgs) -> Result<recipe::LoadedRecipe, Error> {
    Ok(recipe::load(&args.recipe, &Overrides::from_env_and_args(args.sets.clone()))?)
}

/// The artifact or stopped run whose fingerprint starts with `prefix`: exactly one.
fn find_in_cache(store: &Store, prefix: &str) -> Result<String, Error> {
    let found: Vec<String> =
        store.fingerprints().into_iter().filter(|fp| !prefix.is_empty() && fp.starts_with(prefix)).collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(Problem::new("rtune::cache::unknown", format!("no artifact or stopped run `{prefix}` in the cache"))
            .help("`rtune cache ls` lists the artifacts, `rtune plan RECIPE` a recipe's fingerprints")
            .into()),
        many => Err(Problem::new("rtune::cache::ambiguous", format!("`{prefix}` begins {} fingerprints", many.len()))
            .help(format!(
                "give more of it: {}",
                many.iter().map(|f| rtune::fingerprint::short(f)).collect::<Vec<_>>().join(", ")
            ))
            .into()),
    }
}

/// Remove (or with `dry_run`, list) the artifacts and stopped runs `gone`, then what only they
/// used, and say what was freed.
fn remove_from_cache(store: &Store, gone: &BTreeSet<String>, dry_run: bool, json: bool, ui: &Ui) -> Result<u8, Error> {
    let artifacts: Vec<_> = store.manifests().into_iter().filter(|m| gone.contains(&m.fingerprint)).collect();
    let stopped: Vec<_> = store.unfinished().into_iter().filter(|(fp, _)| gone.contains(fp)).collect();
    let estimate = store.freed_by(gone);
    let (entries, freed) = if dry_run { (0, estimate) } else { store.remove(gone)? };
    if json {
        let list: Vec<_> = artifacts
            .iter()
            .map(|m| {
                let (fp, kind, stage, recipe) = (&m.fingerprint, &m.kind, &m.stage, m.recipe());
                json!({"fingerprint": fp, "kind": kind, "stage": stage, "recipe": recipe, "bytes": m.total_size()})
            })
            .chain(stopped.iter().map(|(fp, b)| json!({"fingerprint": fp, "kind": "stopped run", "bytes": b})))
            .collect();
        let report = json!({"dry_run": dry_run, "removed": list, "entries": entries, "freed_bytes": freed});
        ui.out(format!("{}\n", serde_json::to_string_pretty(&report).expect("json")));
        return Ok(0);
    }
    let verb = if dry_run { "would remove" } else { "removed" };
    let mut out = String::new();
    for m in &artifacts {
        let (fp, size) = (rtune::fingerprint::short(&m.fingerprint), human_bytes(m.total_size()));
        out.push_str(&format!("{verb} {fp}  {:<9} {:<12} {size:>10}  {}\n", m.kind, m.stage, m.recipe()));
    }
    for (fp, bytes) in &stopped {
        let (fp, size) = (rtune::fingerprint::short(fp), human_bytes(*bytes));
        out.push_str(&format!("{verb} {fp}  {:<9} {:<12} {size:>10}\n", "stopped", "(resumable)"));
    }
    let what = format!("{} and {}", count(artifacts.len(), "artifact"), count(stopped.len(), "stopped run"));
    out.push_str(&match dry_run {
        true => format!(
            "{what} would go, freeing {} (files that kept artifacts share stay), besides what `cache gc` frees\n",
            human_bytes(freed)
        ),
        false => format!("{what} removed, freed {}\n", human_bytes(freed)),
    });
    ui.out(out);
    Ok(0)
}

fn selection(s: &SelectArgs) -> Selection {
    Selection {
        only: s.only.clone(),
        until: s.until.clone(),
        from: s.from.clone(),
        force: s.force.clone(),
        offline: s.offline,
    }
}

fn make_plan(
    g: &cli::Global,
    args: &RecipeArgs,
    sel: &SelectArgs,
) -> Result<(recipe::LoadedRecipe, Store, LockFile, plan::Plan), Error> {
    let loaded = load(args)?;
    let store = store(g)?;
    let lock = LockFile::read(&exec::lock_path(&loaded))?;
    let inventory = Inventory::probe(device::served_through_vulkan(&loaded.recipe.device.prefer));
    let plan = plan::make(&loaded, &store, &lock, &inventory, &selection(sel))?;
    Ok((loaded, store, lock, plan))
}

fn run(cli: Cli, ui: &Ui) -> Result<u8, Error> {
    let g = &cli.global;
    match cli.command {
        Command::Ls => {
            if g.json {
                let list: Vec<_> = builtin::all()
                    .iter()
                    .map(|b| json!({"name": b.name, "description": b.description(), "builtin": true}))
                    .collect();
                ui.out(format!("{}\n", serde_json::to_string_pretty(&list).expect("json")));
                return Ok(0);
            }
            let width = builtin::all().iter().map(|b| b.name.len()).max().unwrap_or(0);
            let mut out = String::from("built-in recipes:\n");
            for b in builtin::all() {
                out.push_str(&format!("  {:<width$}  {}\n", b.name, b.description()));
            }
            let mut local: Vec<String> = std::fs::read_dir("recipes")
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "toml"))
                .map(|p| p.display().to_string())
                .collect();
            local.sort();
            if !local.is_empty() {
                out.push_str("\nin ./recipes:\n");
                for p in local {
                    out.push_str(&format!("  {p}\n"));
                }
            }
            ui.out(out);
            Ok(0)
        }
        Command::Cp { name, dest } => {
            let b = builtin::find(&name).ok_or_else(|| {
                let mut p = Problem::new("rtune::recipe::not_found", format!("no built-in recipe `{name}`"));
                if let Some(m) = recipe::diag::did_you_mean(&name, builtin::all().iter().map(|b| b.name)) {
                    p = p.help(format!("did you mean `{m}`?"));
                }
                p
            })?;
            let target = if dest.is_dir() { dest.join(format!("{}.toml", b.name)) } else { dest.clone() };
            if target.exists() {
                return Err(Problem::new("rtune::cp::exists", format!("`{}` already exists", target.display()))
                    .help("choose another destination or remove the file first")
                    .into());
            }
            std::fs::write(&target, b.text).map_err(Error::io(format!("cannot write `{}`", target.display())))?;
            let dir = target.parent().map(|p| p.to_path_buf()).unwrap_or_default();
            for (rel, bytes) in builtin::data_files(b) {
                let p = dir.join(rel);
                if !p.exists() {
                    if let Some(parent) = p.parent() {
                        std::fs::create_dir_all(parent)
                            .map_err(Error::io(format!("cannot create `{}`", parent.display())))?;
                    }
                    std::fs::write(&p, bytes).map_err(Error::io(format!("cannot write `{}`", p.display())))?;
                    ui.status("copied", p.display().to_string());
                }
            }
            ui.status("copied", format!("{} → {}", b.name, target.display()));
            Ok(0)
        }
        Command::Cat { recipe: args } => {
            if args.sets.is_empty() {
                let source = recipe::RecipeSource::find(&args.recipe)?;
                let text = source.text().map_err(Error::io(format!("cannot read `{}`", source.display_name())))?;
                ui.out(text);
            } else {
                let loaded = load(&args)?;
                let value = serde_json::to_value(&loaded.recipe).expect("recipe serialises");
                ui.out(toml::to_string_pretty(&value).unwrap_or_default());
            }
            Ok(0)
        }
        Command::Validate { recipe: args } => {
            let loaded = load(&args)?;
            plan::check_stages(&loaded).map_err(recipe::LoadError::Invalid)?;
            let names: Vec<String> = loaded.stages.list.iter().map(|s| s.name.clone()).collect();
            if g.json {
                ui.out(format!("{}\n", json!({"recipe": loaded.recipe.recipe.name, "valid": true, "stages": names})));
            } else {
                ui.out(format!(
                    "recipe `{}` is valid: {} stages ({})\n",
                    loaded.name(),
                    names.len(),
                    names.join(" → ")
                ));
            }
            Ok(0)
        }
        Command::Plan { recipe: args, select, format } => {
            let (_, _, _, plan) = make_plan(g, &args, &select)?;
            let text = match (format, g.json) {
                (PlanFormat::Json, _) | (_, true) => {
                    format!("{}\n", serde_json::to_string_pretty(&plan).expect("json"))
                }
                (PlanFormat::Dot, _) => plan::render_dot(&plan),
                (PlanFormat::Text, _) => plan::render_text(&plan),
            };
            ui.out(text);
            Ok(0)
        }
        Command::Run { recipe: args, select, locked } => {
            let (loaded, store, lock, plan) = make_plan(g, &args, &select)?;
            if locked {
                exec::check_locked(&loaded, &plan, &lock)?;
            }
            if !g.quiet {
                eprint!("{}", plan::render_text(&plan));
                eprintln!();
            }
            // Allocator and thread settings for compute, only for the command that computes.
            rtune::init_process();
            if let Some(n) = loaded.recipe.device.threads {
                // Before any thread pool starts (the first parallel work happens in a stage).
                rtune::set_threads(n);
            }
            let report = exec::run(&loaded, &plan, &store, ui)?;
            if g.json {
                ui.out(format!("{}\n", serde_json::to_string_pretty(&report).expect("json")));
            } else {
                ui.out(summary(&report));
            }
            Ok(0)
        }
        Command::Explain { recipe: args, stage, diff } => {
            let (loaded, _store, lock, plan) = make_plan(g, &args, &SelectArgs::default())?;
            let Some(s) = plan.stage(&stage) else {
                return Err(rtune::plan::unknown_stage(&loaded, &stage).into());
            };
            let mut out = format!(
                "stage `{}` ({}) fingerprint {}\nstatus: {}{}\n\nfingerprint inputs:\n{}\n",
                s.name,
                s.kind,
                s.fingerprint,
                s.action.as_str(),
                if s.reason.is_empty() { String::new() } else { format!(" — {}", s.reason) },
                serde_json::to_string_pretty(&s.doc).expect("json")
            );
            if diff {
                match lock.recipes.get(&plan.recipe).and_then(|r| r.stages.get(&stage)) {
                    None => out.push_str(&format!(
                        "\nno earlier run of `{stage}` is recorded in {}\n",
                        exec::lock_path(&loaded).display()
                    )),
                    Some(old) if old.fingerprint == s.fingerprint => out.push_str("\nunchanged since the last run\n"),
                    Some(old) => {
                        out.push_str(&format!(
                            "\nchanges since the last run ({} → {}):\n",
                            rtune::fingerprint::short(&old.fingerprint),
                            s.short()
                        ));
                        for line in rtune::fingerprint::diff(&old.inputs, &s.doc) {
                            out.push_str(&format!("  {line}\n"));
                        }
                    }
                }
            }
            ui.out(out);
            Ok(0)
        }
        Command::Download { repo_id, revision, include, exclude, repo_type, token, offline } => {
            let env = hub::HubEnv::from_env(token.as_deref(), offline);
            let repo = hub::RepoRef::new(&repo_id, repo_kind(repo_type), revision.as_deref())?;
            let client = hub::Client::new(env.clone());
            let cache = hub::HubCache::new(&env.cache_dir);
            let report = hub::snapshot(&client, &cache, &repo, &hub::Wanted { include, exclude }, ui)?;
            let fetched = report.files.iter().filter(|f| f.fetched).count();
            ui.status(
                "download",
                format!(
                    "{} at {}: {} files ({} fetched, {}), checked against their digests",
                    repo.display(),
                    &report.commit[..12],
                    report.files.len(),
                    fetched,
                    human_bytes(report.bytes_fetched)
                ),
            );
            if g.json {
                ui.out(format!("{}\n", serde_json::to_string_pretty(&report).expect("json")));
            } else {
                ui.out(format!("{}\n", report.snapshot.display()));
            }
            Ok(0)
        }
        Command::Upload { repo_id, paths, repo_type, create, public, message, token } => {
            let env = hub::HubEnv::from_env(token.as_deref(), false);
            if env.offline {
                return Err(recipe::Problem::new("rtune::hub::offline", "cannot upload with HF_HUB_OFFLINE set")
                    .help("unset HF_HUB_OFFLINE (or set it to 0) to upload")
                    .into());
            }
            let (id, rev) = match repo_id.split_once('@') {
                Some((i, r)) => (i, Some(r)),
                None => (repo_id.as_str(), None),
            };
            let repo = hub::RepoRef::new(id, repo_kind(repo_type), rev)?;
            let mut files = Vec::new();
            for p in &paths {
                if p.is_dir() {
                    for rel in rtune::store::walk(p).map_err(Error::io(format!("cannot list `{}`", p.display())))? {
                        let path = rel.to_string_lossy().replace('\\', "/");
                        if !path.split('/').any(|c| c.starts_with('.')) {
                            files.push(hub::CommitFile { path, local: p.join(&rel) });
                        }
                    }
                } else {
                    let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
                    files.push(hub::CommitFile { path: name, local: p.clone() });
                }
            }
            let client = hub::Client::new(env);
            if create {
                hub::create_repo(&client, &repo, !public)?;
            }
            let report = hub::commit(&client, &repo, &files, &message, hub::Ignored::Skip, ui)?;
            let sent = files.len() - report.ignored.len();
            ui.status("upload", format!("{} → {} (commit {})", count(sent, "file"), repo.display(), &report.commit));
            if g.json {
                ui.out(format!("{}\n", serde_json::to_string_pretty(&report).expect("json")));
            } else {
                ui.out(format!("{}\n", report.url));
            }
            Ok(0)
        }
        Command::Cache { command } => {
            let store = store(g)?;
            match command {
                CacheCommand::Path => {
                    ui.out(format!("{}\n", store.root().display()));
                    Ok(0)
                }
                CacheCommand::Ls => {
                    let ms = store.manifests();
                    if g.json {
                        let list: Vec<_> = ms.iter().map(|m| json!({"fingerprint": m.fingerprint, "kind": m.kind, "stage": m.stage, "recipe": m.recipe(), "bytes": m.total_size(), "path": store.artifact_dir(&m.fingerprint)})).collect();
                        ui.out(format!("{}\n", serde_json::to_string_pretty(&list).expect("json")));
                    } else {
                        let mut out = String::new();
                        for m in &ms {
                            out.push_str(&format!(
                                "{}  {:<9} {:<12} {:>10}  {}\n",
                                rtune::fingerprint::short(&m.fingerprint),
                                m.kind,
                                m.stage,
                                human_bytes(m.total_size()),
                                m.recipe()
                            ));
                        }
                        out.push_str(&format!(
                            "{} artifacts, {}\n",
                            ms.len(),
                            human_bytes(ms.iter().map(|m| m.total_size()).sum())
                        ));
                        ui.out(out);
                    }
                    Ok(0)
                }
                CacheCommand::Verify => {
                    let mut bad = 0;
                    let ms = store.manifests();
                    for m in &ms {
                        let problems = store.verify(m);
                        if !problems.is_empty() {
                            bad += 1;
                            store.mark_damaged(&m.fingerprint, &problems)?;
                            ui.out(format!(
                                "damaged {} ({} {}): {}\n",
                                rtune::fingerprint::short(&m.fingerprint),
                                m.kind,
                                m.stage,
                                problems.join("; ")
                            ));
                        }
                    }
                    ui.out(format!("{} artifacts verified, {bad} damaged\n", ms.len()));
                    if bad > 0 {
                        ui.status("verify", "damaged artifacts are rebuilt by the next run that needs them");
                    }
                    Ok(if bad > 0 { 1 } else { 0 })
                }
                CacheCommand::Gc => {
                    let (n, bytes) = store.gc()?;
                    ui.out(format!("removed {n} entries, freed {}\n", human_bytes(bytes)));
                    Ok(0)
                }
                CacheCommand::Rm { fingerprints, dry_run } => {
                    let mut gone = BTreeSet::new();
                    for prefix in &fingerprints {
                        gone.insert(find_in_cache(&store, prefix)?);
                    }
                    remove_from_cache(&store, &gone, dry_run, g.json, ui)
                }
                CacheCommand::Prune { keep, dry_run } => {
                    let mut used = BTreeSet::new();
                    for recipe in keep {
                        let args = RecipeArgs { recipe, sets: Vec::new() };
                        let (_, _, lock, plan) = make_plan(g, &args, &SelectArgs::default())?;
                        used.extend(plan.uses(&lock, &store));
                    }
                    let gone = store.fingerprints().into_iter().filter(|fp| !used.contains(fp)).collect();
                    remove_from_cache(&store, &gone, dry_run, g.json, ui)
                }
            }
        }
        Command::Schema => {
            ui.out(schema_text());
            Ok(0)
        }
        Command::Doctor { check } => {
            let inv = Inventory::probe(true);
            let checks = if check { kernel_checks(&inv, ui) } else { Vec::new() };
            if g.json {
                let mut v = serde_json::to_value(&inv).expect("json");
                if check {
                    v["checks"] = serde_json::to_value(&checks).expect("json");
                }
                ui.out(format!("{}\n", serde_json::to_string_pretty(&v).expect("json")));
                return Ok(0);
            }
            let mut out = format!(
                "rtune {} on {} {}\nbuild features: cuda={} metal={} vulkan={}\ncpu threads: {}\n{}\ndevices:\n",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::OS,
                std::env::consts::ARCH,
                inv.cuda_feature,
                inv.metal_feature,
                inv.vulkan_feature,
                inv.cpu_threads,
                inv.vulkan_library.as_ref().map(|lib| format!("vulkan library: {lib}\n")).unwrap_or_default()
            );
            for d in &inv.devices {
                let mut mem = d.memory_bytes.map(human_bytes).unwrap_or_else(|| "unknown".into());
                if let Some(free) = d.memory_free_bytes {
                    mem.push_str(&format!(" ({} free)", human_bytes(free)));
                }
                let dtypes = d.dtypes.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", ");
                let id = d.class.device_name(d.ordinal);
                out.push_str(&format!("  {id:<8} {}  memory {mem}  training dtypes: {dtypes}\n", d.name));
                if let Some(details) = &d.details {
                    out.push_str(&format!("           {details}\n"));
                }
                if let Some(why) = &d.unusable {
                    out.push_str(&format!("           unusable: {why}\n"));
                }
            }
            let all = rtune::recipe::Gpus::All(rtune::recipe::AllWord::All);
            for want in ["cuda", "metal", "vulkan", "rocm"] {
                match rtune::device::resolve(&[want.to_string()], &[rtune::recipe::Dtype::F32], &inv) {
                    Err(e) => out.push_str(&format!("  {want:<8} unavailable: {}\n", e.tried[0].reason)),
                    // Several GPUs of one kind can share a run (`device.gpus`).
                    Ok(r) if want != "rocm" => {
                        let r = r.with_peers(all, &inv);
                        if !r.peers.is_empty() {
                            out.push_str(&format!(
                                "  {want:<8} {} GPUs can train together: `[device] gpus = {}` (or \"all\") with `prefer = [\"{want}\"]`\n",
                                r.peers.len() + 1,
                                r.peers.len() + 1
                            ));
                        }
                    }
                    Ok(_) => {}
                }
            }
            if check {
                out.push_str(&checks_text(&checks));
            }
            ui.out(out);
            Ok(0)
        }
    }
}

/// `doctor --check` on one device: its name, and what it found or why it could not open.
#[derive(serde::Serialize)]
struct DeviceCheck {
    device: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    dtypes: Vec<rtune::engine::gpu::check::KernelCheck>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// Run the kernel checks on every usable GPU the GPU engine runs on.
fn kernel_checks(inv: &Inventory, ui: &Ui) -> Vec<DeviceCheck> {
    use rtune::device::DeviceClass;
    let gpus = inv.devices.iter().filter(|d| matches!(d.class, DeviceClass::Cuda | DeviceClass::Vulkan));
    gpus.filter(|d| d.unusable.is_none())
        .map(|d| {
            let device = d.class.device_name(d.ordinal);
            ui.status("checking", format!("{device} ({})", d.name));
            match rtune::engine::gpu::open_device(d.class, d.ordinal, false) {
                Ok(gpu) => {
                    let dts: Vec<_> = d.dtypes.iter().map(|&t| rtune::engine::gpu::compute_dtype(t)).collect();
                    DeviceCheck { device, dtypes: rtune::engine::gpu::check::check(&gpu, &dts), error: None }
                }
                Err(e) => DeviceCheck { device, dtypes: Vec::new(), error: Some(e.to_string()) },
            }
        })
        .collect()
}

/// `doctor --check`'s findings as text.
fn checks_text(checks: &[DeviceCheck]) -> String {
    let mut out = String::from("\nkernel checks:\n");
    if checks.is_empty() {
        out.push_str("  no GPU for the GPU engine\n");
    }
    for c in checks {
        if let Some(e) = &c.error {
            out.push_str(&format!("  {:<8} cannot open: {e}\n", c.device));
        }
        for k in &c.dtypes {
            let rate = match (k.tflops, k.size) {
                (Some(r), Some(n)) => format!(", {r:.3} TFLOP/s ({n}³)"),
                _ => String::new(),
            };
            out.push_str(&format!("  {:<8} {:<5} {}{rate}\n", c.device, k.dtype, k.products));
            out.push_str(&format!("  {:<8} {:<5} {}\n", "", "", k.attention));
            if let Some(e) = &k.error {
                out.push_str(&format!("  {:<8} {:<5} error: {e}\n", "", ""));
            }
        }
    }
    out
}

/// The JSON Schema as checked in under schemas/.
fn schema_text() -> String {
    format!("{}\n", serde_json::to_string_pretty(&rtune::recipe::Recipe::json_schema()).expect("json"))
}

/// What `rtune run` prints on stdout at the end: every artifact, and eval losses.
fn summary(r: &exec::RunReport) -> String {
    let mut out = format!("\nrecipe `{}` done\n", r.recipe);
    let w = r.stages.iter().map(|s| s.name.len()).max().unwrap_or(0);
    for s in &r.stages {
        let path = s.artifact.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "-".into());
        out.push_str(&format!("  {:<w$}  {:<8}  {path}\n", s.name, s.outcome));
    }
    let evals: Vec<String> = r
        .stages
        .iter()
        .filter(|s| s.kind == "evaluate")
        .filter_map(|s| {
            let loss = s.metrics["eval_loss"].as_f64()?;
            let ppl = s.metrics["perplexity"].as_f64().unwrap_or(f64::NAN);
            Some(format!(
                "  {:<w$}  {} model: eval loss {loss:.4}, perplexity {ppl:.2}",
                s.name,
                s.metrics["model"].as_str().unwrap_or("?")
            ))
        })
        .collect();
    if !evals.is_empty() {
        out.push_str("\nevaluation:\n");
        for e in evals {
            out.push_str(&e);
            out.push('\n');
        }
    }
    out
}
