//! Recipes: finding, layering, checking and typing them.
//!
//! The pipeline reads like a compiler: text → spanned tree ([`tree`]) → layered with `RTUNE_*`
//! env and `--set` → structural check against the schema ([`check`]) → typed [`Recipe`] →
//! semantic checks (sources, devices, the stage graph in [`stages`]). Every problem found on the
//! way is collected, so `rtune validate` shows all of them at once.

pub mod builtin;
pub mod check;
pub mod diag;
pub mod reference;
pub mod stages;
pub mod tree;
pub mod types;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use diag::{Origin, Problem, Problems, SourceText};
pub use stages::{Settled, StageSpec, Stages};
pub use types::*;

use tree::Node;

/// Sections of a recipe that `RTUNE_<SECTION>__<KEY>` environment variables may set.
pub const SECTIONS: [&str; 6] = ["recipe", "model", "dataset", "adapter", "device", "stages"];

/// Known device names for `[device] prefer` and `[device.<name>]`.
pub const DEVICE_NAMES: [&str; 7] = ["cpu", "cuda", "metal", "rocm", "vulkan", "wgpu", "directml"];

/// Where a recipe comes from.
#[derive(Debug, Clone)]
pub enum RecipeSource {
    File(PathBuf),
    Builtin(&'static builtin::Builtin),
}

impl RecipeSource {
    /// Resolve what the user typed: a path, a built-in name, or `./recipes/NAME.toml`.
    pub fn find(arg: &str) -> Result<RecipeSource, Problem> {
        let path = Path::new(arg);
        if path.is_file() {
            return Ok(RecipeSource::File(path.to_path_buf()));
        }
        if let Some(b) = builtin::find(arg) {
            return Ok(RecipeSource::Builtin(b));
        }
        let local = Path::new("recipes").join(format!("{arg}.toml"));
        if local.is_file() {
            return Ok(RecipeSource::File(local));
        }
        let mut p = Problem::new("rtune::recipe::not_found", format!("no recipe `{arg}`"));
        p = match diag::did_you_mean(arg, builtin::all().iter().map(|b| b.name)) {
            Some(m) => p.help(format!("did you mean the built-in recipe `{m}`? `rtune ls` lists them")),
            None => p.help("give a path to a .toml file or a name from `rtune ls`"),
        };
        Err(p)
    }

    pub fn display_name(&self) -> String {
        match self {
            RecipeSource::File(p) => p.display().to_string(),
            RecipeSource::Builtin(b) => b.name.to_string(),
        }
    }

    /// Where relative paths in the recipe are resolved and `rtune.lock` is written.
    pub fn base_dir(&self) -> PathBuf {
        match self {
            RecipeSource::File(p) => p.parent().map(Path::to_path_buf).unwrap_or_default(),
            RecipeSource::Builtin(_) => PathBuf::from("."),
        }
    }

    pub fn text(&self) -> std::io::Result<String> {
        match self {
            RecipeSource::File(p) => std::fs::read_to_string(p),
            RecipeSource::Builtin(b) => Ok(b.text.to_string()),
        }
    }
}

/// Layers on top of the recipe file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--set key=value` arguments, in order.
    pub sets: Vec<String>,
    /// `RTUNE_*` environment variables (name, value).
    pub env: Vec<(String, String)>,
}

impl Overrides {
    /// `--set` arguments plus the recipe-setting variables of this process's environment.
    pub fn from_env_and_args(sets: Vec<String>) -> Overrides {
        let env = std::env::vars().filter(|(k, _)| env_key_path(k).is_some()).collect::<Vec<_>>();
        Overrides { sets, env }
    }
}

/// A recipe that passed every check, with the tree it came from (for locating later errors).
#[derive(Debug, Clone)]
pub struct LoadedRecipe {
    pub recipe: Recipe,
    pub stages: Stages,
    pub tree: Node,
    pub source: RecipeSource,
    /// The recipe file's text as read (never part of a fingerprint: only what it means is).
    pub text: String,
    /// The layers applied over the file, in order, as a user would write them: recipe-setting
    /// `RTUNE_…=value` variables, then `--set key=value` arguments (the model card shows them).
    pub overrides: Vec<String>,
}

/// Where a loaded recipe's values are written in its file, for errors raised while stages run.
/// It gives spans, never values: a stage reads settings only from its fingerprinted key.
#[derive(Clone, Copy)]
pub struct Spans<'a>(&'a LoadedRecipe);

impl<'a> Spans<'a> {
    /// The origin of the value at a dotted path.
    pub fn origin<S: AsRef<str>>(&self, path: &[S]) -> Option<&'a Origin> {
        let path: Vec<&str> = path.iter().map(AsRef::as_ref).collect();
        self.0.origin(&path)
    }
}

impl LoadedRecipe {
    pub fn name(&self) -> String {
        self.source.display_name()
    }

    /// The origin of the value at a dotted path, for errors raised after loading.
    pub fn origin(&self, path: &[&str]) -> Option<&Origin> {
        self.tree.get(path).and_then(|n| n.origin.as_ref())
    }

    /// The recipe as rtune reads it: every section and every stage (those added because others
    /// need them too) with its defaults filled in and its `needs` resolved (`rtune cat --set`).
    /// It loads back as the same recipe.
    pub fn resolved(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(&self.recipe).expect("a recipe serialises");
        let stages: serde_json::Map<String, serde_json::Value> =
            self.stages.list.iter().map(|s| (s.name.clone(), s.resolved())).collect();
        value["stages"] = serde_json::Value::Object(stages);
        value
    }

    /// Where the recipe's values are written, without the values.
    pub fn spans(&self) -> Spans<'_> {
        Spans(self)
    }

    /// A path from the recipe, resolved against the recipe's folder.
    pub fn resolve_path(&self, p: &str) -> PathBuf {
        if let RecipeSource::Builtin(_) = self.source
            && let Some(extracted) = builtin::extract(p)
        {
            return extracted;
        }
        let p = Path::new(p);
        if p.is_absolute() { p.to_path_buf() } else { self.source.base_dir().join(p) }
    }
}

/// Why a recipe could not be loaded.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum LoadError {
    #[error("cannot read recipe `{path}`")]
    #[diagnostic(code(rtune::recipe::io))]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    #[diagnostic(transparent)]
    NotFound(Problem),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Invalid(Problems),
}

/// Find, read, layer and check a recipe.
pub fn load(arg: &str, overrides: &Overrides) -> Result<LoadedRecipe, LoadError> {
    let source = RecipeSource::find(arg).map_err(LoadError::NotFound)?;
    let text = source.text().map_err(|e| LoadError::Io { path: source.display_name(), source: e })?;
    load_text(source, text, overrides)
}

/// Layer and check recipe text that has already been read.
pub fn load_text(source: RecipeSource, text: String, overrides: &Overrides) -> Result<LoadedRecipe, LoadError> {
    let name = source.display_name();
    let src = Arc::new(SourceText { name: name.clone(), text: text.clone() });
    let mut problems = Vec::new();

    let mut tree = match toml::de::DeTable::parse(&text) {
        Ok(doc) => tree::from_toml(&doc, &src),
        Err(e) => {
            let span = e.span().unwrap_or(0..0);
            let origin = Origin::new(&src, span);
            let p = Problem::new("rtune::recipe::syntax", format!("invalid TOML: {}", e.message().trim()))
                .at(Some(&origin), "here");
            return Err(LoadError::Invalid(Problems::new(name, vec![p])));
        }
    };
    for (var, value) in &overrides.env {
        if let Some(path) = env_key_path(var) {
            apply_layer(&mut tree, &path, value, &format!("env {var}"), &mut problems);
        }
    }
    for arg in &overrides.sets {
        match arg.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => {
                let path: Vec<String> = key.trim().split('.').map(|s| s.trim().to_string()).collect();
                apply_layer(&mut tree, &path, value.trim(), "--set", &mut problems);
            }
            _ => {
                let src = Arc::new(SourceText { name: "--set".into(), text: arg.clone() });
                problems.push(
                    Problem::new("rtune::recipe::bad_set", format!("`--set {arg}` is not of the form key=value"))
                        .at(Some(&Origin::new(&src, 0..arg.len())), "expected key=value")
                        .help("for example `--set stages.train.learning_rate=3e-4`"),
                );
            }
        }
    }

    // The tree as JSON once: the stages' tables are typed from it, then the rest of the recipe.
    let mut json = tree.to_json();
    let stages = check_tree(&tree, &json, &mut problems);
    if let Some(o) = json.as_object_mut() {
        o.remove("stages");
    }
    let recipe = if problems.is_empty() {
        match serde_json::from_value::<Recipe>(json) {
            Ok(r) => Some(r),
            Err(e) => {
                problems.push(Problem::new("rtune::recipe::invalid", format!("recipe does not fit its schema: {e}")));
                None
            }
        }
    } else {
        None
    };
    match (recipe, stages) {
        (Some(recipe), Some(stages)) if problems.is_empty() => {
            let env = overrides.env.iter().filter(|(k, _)| env_key_path(k).is_some()).map(|(k, v)| format!("{k}={v}"));
            let overrides = env.chain(overrides.sets.iter().cloned()).collect();
            Ok(LoadedRecipe { recipe, stages, tree, source, text, overrides })
        }
        _ => Err(LoadError::Invalid(Problems::new(name, problems))),
    }
}

/// `RTUNE_STAGES__TRAIN__LEARNING_RATE` → `["stages", "train", "learning_rate"]`.
fn env_key_path(var: &str) -> Option<Vec<String>> {
    let rest = var.strip_prefix("RTUNE_")?;
    let parts: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
    (parts.len() >= 2 && SECTIONS.contains(&parts[0].as_str())).then_some(parts)
}

/// Parse `value` as a TOML value (a bare word becomes a string) and set it at `path`.
fn apply_layer(tree: &mut Node, path: &[String], value: &str, source_name: &str, problems: &mut Vec<Problem>) {
    let key = path.iter().map(|k| toml_key(k)).collect::<Vec<_>>().join(".");
    let mut text = format!("{key} = {value}");
    let parsed = toml::de::DeValue::parse(value).is_ok();
    if !parsed && looks_like_bare_string(value) {
        text = format!("{key} = {}", toml_string(value));
    }
    let src = Arc::new(SourceText { name: source_name.to_string(), text: text.clone() });
    let key_origin = Origin::new(&src, 0..key.len());
    match toml::de::DeTable::parse(&text) {
        Ok(doc) => {
            let layer = tree::from_toml(&doc, &src);
            // The parsed layer is a one-key-path table; take its leaf value.
            let refs: Vec<&str> = path.iter().map(String::as_str).collect();
            if let Some(leaf) = layer.get(&refs)
                && let Err(p) = tree.set_path(path, leaf.clone(), &key_origin)
            {
                problems.push(p);
            }
        }
        Err(e) => {
            let origin = Origin::new(&src, key.len() + 3..text.len());
            problems.push(
                Problem::new(
                    "rtune::recipe::bad_set",
                    format!("`{}` is not a TOML value: {}", value, e.message().trim()),
                )
                .at(Some(&origin), "this value")
                .help("quote strings that contain spaces or TOML punctuation: key='\"a value\"'"),
            );
        }
    }
}

fn looks_like_bare_string(v: &str) -> bool {
    !v.is_empty() && !v.starts_with(['[', '{', '"', '\'']) && !v.chars().any(|c| c.is_whitespace() || c == '#')
}

fn toml_key(k: &str) -> String {
    if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        k.to_string()
    } else {
        toml_string(k)
    }
}

fn toml_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// Structural and semantic checks of the layered tree. Returns the stage list when it could be
/// built (even if other problems were found).
fn check_tree(tree: &Node, json: &serde_json::Value, problems: &mut Vec<Problem>) -> Option<Stages> {
    let schema = Recipe::json_schema();
    let mut checker = check::Checker::new(&schema);
    let mut root_schema = schema.clone();
    // `stages` and device overrides are checked below, where the stage kinds are known.
    root_schema["properties"].as_object_mut().map(|p| p.remove("stages"));
    checker.check_table(tree, &root_schema, "", &["stages", "device"]);
    if let Some(device) = tree.get(&["device"]) {
        if device.as_table().is_some() {
            // Besides its own keys, `[device]` holds only `[device.<name>]` tables: any other
            // key is a mistake (a misspelt device's overrides would otherwise never apply), so
            // the table is checked closed, with the device names as the other keys it knows.
            let mut device_schema = schema["$defs"]["DevicePolicy"].clone();
            device_schema["additionalProperties"] = serde_json::Value::Bool(false);
            let allow: Vec<&str> = DEVICE_NAMES
                .into_iter()
                .chain(device.as_table().into_iter().flat_map(|t| t.keys()).map(String::as_str))
                .filter(|k| is_device_name(k))
                .collect();
            checker.check_table(device, &device_schema, "device", &allow);
            // `wgpu` is a name `prefer` explains (it is not a device), so it passes the check
            // above; as a table its overrides would never apply.
            if let Some(entry) = device.as_table().and_then(|t| t.get("wgpu")) {
                problems.push(
                    Problem::new("rtune::recipe::unknown_device", "`[device.wgpu]`: `wgpu` is not a device")
                        .at(entry.key.as_ref(), "its overrides would never apply")
                        .help("Vulkan GPUs are `vulkan` or `vulkan:N`: `[device.vulkan]`"),
                );
            }
        } else {
            checker.check(device, &serde_json::json!({"type": "object"}), "device");
        }
    }
    problems.append(&mut checker.problems);
    semantic_checks(tree, problems);
    stages::build(tree, json, &schema, problems)
}

/// What rtune calls the device PyTorch calls `name` (`torch.device`'s names for GPUs rtune
/// names otherwise), as a hint.
fn torch_device(name: &str) -> Option<&'static str> {
    Some(match device_name_parts(name).0 {
        "mps" => "`mps` is PyTorch's name for Apple GPUs; rtune's is `metal`",
        "xpu" => "`xpu` is PyTorch's name for Intel GPUs; rtune reaches them through Vulkan: `vulkan` or `directml`",
        "hip" => "PyTorch's ROCm build calls AMD GPUs `cuda`; rtune's name is `rocm` (reached through Vulkan)",
        "dml" | "privateuseone" => "torch-directml's device is rtune's `directml` (reached through Vulkan)",
        _ => return None,
    })
}

/// A device name's class and index, the one place that splits them: `cuda:1` is (`cuda`,
/// `Some("1")`), `cpu` is (`cpu`, `None`).
pub fn device_name_parts(s: &str) -> (&str, Option<&str>) {
    match s.split_once(':') {
        Some((class, index)) => (class, Some(index)),
        None => (s, None),
    }
}

/// `cpu`, `cuda`, `cuda:N`, `vulkan:N`, `metal`, … (names rtune knows, available or not).
pub fn is_device_name(s: &str) -> bool {
    let (base, index) = device_name_parts(s);
    let index_ok = match index {
        None => true,
        Some(n) => matches!(base, "cuda" | "vulkan") && n.parse::<u32>().is_ok(),
    };
    DEVICE_NAMES.contains(&base) && index_ok
}

/// The variables every chat-template rendering sets itself (`dataset.chat_template_kwargs`
/// may not name them).
pub const RESERVED_TEMPLATE_VARIABLES: [&str; 6] =
    ["messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"];

fn semantic_checks(tree: &Node, problems: &mut Vec<Problem>) {
    if let Some(model) = tree.get(&["model"]).filter(|m| m.as_table().is_some()) {
        exactly_one(model, "model", &["repo", "path", "scratch"], problems);
        if model.get(&["revision"]).is_some() && model.get(&["repo"]).is_none() {
            let e = model.entry(&["revision"]).and_then(|e| e.key.as_ref());
            problems.push(
                Problem::new("rtune::recipe::revision_without_repo", "`model.revision` needs `model.repo`")
                    .at(e, "only Hub models have revisions")
                    .help("remove `revision`, or name the Hub repo with `repo = \"owner/name\"`"),
            );
        }
        if let Some(s) = model.get(&["scratch"]) {
            let heads = s.get(&["num_heads"]).and_then(as_int);
            let hidden = s.get(&["hidden_size"]).and_then(as_int);
            let kv = s.get(&["num_kv_heads"]).and_then(as_int);
            let head_dim = s.get(&["head_dim"]);
            if let Some(hd) = head_dim.and_then(as_int).filter(|hd| hd % 2 != 0) {
                problems.push(
                    Problem::new(
                        "rtune::recipe::bad_shape",
                        format!("`model.scratch.head_dim` ({hd}) must be even for rotary embeddings"),
                    )
                    .at(head_dim.and_then(|n| n.origin.as_ref()), "odd head size"),
                );
            }
            if let (Some(h), Some(d)) = (heads, hidden) {
                // An explicit `head_dim` frees the hidden size from the heads (Qwen3's shapes).
                let derived = head_dim.is_none() && h > 0;
                if derived && d % h != 0 {
                    problems.push(
                        Problem::new(
                            "rtune::recipe::bad_shape",
                            format!("`model.scratch.hidden_size` ({d}) must be a multiple of `num_heads` ({h})"),
                        )
                        .at(s.get(&["hidden_size"]).and_then(|n| n.origin.as_ref()), "not divisible")
                        .help("attention splits the hidden size evenly across heads, or set `head_dim`"),
                    );
                } else if derived && (d / h) % 2 != 0 {
                    problems.push(
                        Problem::new(
                            "rtune::recipe::bad_shape",
                            format!(
                                "head size {} (`hidden_size / num_heads`) must be even for rotary embeddings",
                                d / h
                            ),
                        )
                        .at(s.get(&["hidden_size"]).and_then(|n| n.origin.as_ref()), "odd head size")
                        .help("change `hidden_size` or `num_heads`, or set an even `head_dim`"),
                    );
                }
                if let Some(kv) = kv
                    && kv > 0
                    && h % kv != 0
                {
                    problems.push(
                        Problem::new(
                            "rtune::recipe::bad_shape",
                            format!("`model.scratch.num_heads` ({h}) must be a multiple of `num_kv_heads` ({kv})"),
                        )
                        .at(s.get(&["num_kv_heads"]).and_then(|n| n.origin.as_ref()), "does not divide num_heads"),
                    );
                }
            }
        }
    }
    if let Some(ds) = tree.get(&["dataset"]).filter(|m| m.as_table().is_some()) {
        exactly_one(ds, "dataset", &["repo", "path"], problems);
        for key in RESERVED_TEMPLATE_VARIABLES {
            if let Some(e) = ds.entry(&["chat_template_kwargs", key]) {
                problems.push(
                    Problem::new(
                        "rtune::recipe::reserved_template_variable",
                        format!("`dataset.chat_template_kwargs.{key}` is a variable rtune sets itself"),
                    )
                    .at(e.key.as_ref(), "set by rtune")
                    .help(format!(
                        "rtune passes {} to every rendering; remove it here",
                        RESERVED_TEMPLATE_VARIABLES.map(|r| format!("`{r}`")).join(", ")
                    )),
                );
            }
        }
        for key in ["revision", "files"] {
            if ds.get(&[key]).is_some() && ds.get(&["repo"]).is_none() {
                let e = ds.entry(&[key]).and_then(|e| e.key.as_ref());
                problems.push(
                    Problem::new(
                        "rtune::recipe::revision_without_repo",
                        format!("`dataset.{key}` needs `dataset.repo`"),
                    )
                    .at(e, "only Hub datasets have this")
                    .help("remove it, or name the Hub dataset with `repo = \"owner/name\"`"),
                );
            }
        }
    }
    for section in ["model", "dataset"] {
        if let Some(n) = tree.get(&[section, "repo"])
            && let Some(id) = n.as_str()
            && let Err(e) = crate::hub::check_repo_id(id)
        {
            problems.push(
                Problem::new("rtune::recipe::bad_repo_id", e.to_string())
                    .at(n.origin.as_ref(), "not a Hub repository id")
                    .help("ids look like `owner/name`: letters, digits, `-`, `_` and `.`, without `--` or `..`"),
            );
        }
        if let Some(n) = tree.get(&[section, "revision"])
            && let Some(rev) = n.as_str()
            && let Err(e) = crate::hub::check_revision(rev)
        {
            problems.push(
                Problem::new("rtune::recipe::bad_revision", e.to_string())
                    .at(n.origin.as_ref(), "not a branch, tag or commit")
                    .help("use a branch (`main`), a tag, or a 40-digit commit id"),
            );
        }
    }
    if let Some(Node { value: tree::Value::Array(items), .. }) = tree.get(&["device", "prefer"]) {
        for item in items {
            if let Some(name) = item.as_str()
                && !is_device_name(name)
            {
                let mut p = Problem::new("rtune::recipe::unknown_device", format!("unknown device `{name}`"))
                    .at(item.origin.as_ref(), "not a device rtune knows");
                p = match (torch_device(name), diag::did_you_mean(name, DEVICE_NAMES)) {
                    (Some(help), _) => p.help(help),
                    (None, Some(m)) => p.help(format!("did you mean `{m}`?")),
                    (None, None) => p.help(format!(
                        "known devices: {} (and `cuda:N`, `vulkan:N` for the N-th CUDA or Vulkan device)",
                        DEVICE_NAMES.map(|d| format!("`{d}`")).join(", ")
                    )),
                };
                problems.push(p);
            }
        }
    }
    if let Some(Node { value: tree::Value::Array(items), .. }) = tree.get(&["adapter", "targets"]) {
        let mut seen = std::collections::BTreeSet::new();
        for item in items {
            if let Some(t) = item.as_str()
                && !seen.insert(t)
            {
                problems.push(
                    Problem::new("rtune::recipe::duplicate", format!("`adapter.targets` lists `{t}` twice"))
                        .at(item.origin.as_ref(), "listed again here"),
                );
            }
        }
    }
}

fn as_int(n: &Node) -> Option<i64> {
    match n.value {
        tree::Value::Int(i) => Some(i),
        _ => None,
    }
}

fn exactly_one(table: &Node, section: &str, keys: &[&str], problems: &mut Vec<Problem>) {
    let present: Vec<&&str> = keys.iter().filter(|k| table.get(&[k]).is_some()).collect();
    let listed = keys.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ");
    if present.is_empty() {
        problems.push(
            Problem::new("rtune::recipe::no_source", format!("`[{section}]` names no source"))
                .at(table.origin.as_ref(), "in this table")
                .help(format!("set exactly one of {listed}")),
        );
    } else if present.len() > 1 {
        let second = table.entry(&[present[1]]).and_then(|e| e.key.as_ref());
        problems.push(
            Problem::new(
                "rtune::recipe::conflicting_sources",
                format!("`[{section}]` sets both `{}` and `{}`", present[0], present[1]),
            )
            .at(second, "second source")
            .help(format!("set exactly one of {listed}")),
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cuda_and_vulkan_devices_are_numbered() {
        for ok in ["cpu", "cuda", "cuda:1", "vulkan", "vulkan:0", "vulkan:12", "rocm", "directml", "metal"] {
            assert!(super::is_device_name(ok), "{ok}");
        }
        for bad in ["vulkan:x", "vulkan:", "cpu:1", "rocm:0", "cdua", "cuda:-1"] {
            assert!(!super::is_device_name(bad), "{bad}");
        }
        assert_eq!(super::device_name_parts("cuda:1"), ("cuda", Some("1")));
        assert_eq!(super::device_name_parts("vulkan:"), ("vulkan", Some("")));
        assert_eq!(super::device_name_parts("metal"), ("metal", None));
    }
}
