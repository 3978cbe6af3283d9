//! A dataset card's `configs:` — the YAML front matter of a folder's (or Hub repository's)
//! `README.md` — which names a dataset's subsets and, for each, the files of its splits, as
//! `datasets.load_dataset(repo, name)` reads them (`MetadataConfigs`,
//! `create_builder_configs_from_metadata_configs`):
//!
//! ```yaml
//! configs:
//! - config_name: default        # the config read when none is named (or `default: true`)
//!   data_files:
//!   - split: train
//!     path: data/train-*         # a glob relative to the folder (or to `data_dir`)
//!   - split: test
//!     path: [data/test-*, extra/*.jsonl]
//! - config_name: extended
//!   data_dir: extended           # splits inferred from the names under it
//! ```
//!
//! `data_files` may also be one pattern or a list of them (all `train`). Globs are fsspec's: `*`
//! and `?` stop at `/`, a `**` folder matches any depth; hidden files, `__` folders and
//! datasets' metadata files match only where the pattern names them. Other keys of a config
//! (a CSV `sep`, a JSON `field`, `features`) are not applied. tests/fixtures/data/splits.json
//! holds datasets' own answers.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use super::splits::Splits;

#[derive(Deserialize)]
struct Card {
    #[serde(default)]
    configs: Option<Vec<Config>>,
}

#[derive(Deserialize)]
struct Config {
    config_name: Option<String>,
    data_files: Option<Files>,
    data_dir: Option<String>,
    #[serde(default)]
    default: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Files {
    One(String),
    Many(Vec<String>),
    Splits(Vec<SplitFiles>),
    Map(BTreeMap<String, OneOrMany>),
}

#[derive(Deserialize)]
struct SplitFiles {
    split: String,
    path: OneOrMany,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn list(&self) -> Vec<String> {
        match self {
            OneOrMany::One(p) => vec![p.clone()],
            OneOrMany::Many(p) => p.clone(),
        }
    }
}

/// The splits of `dir`'s data files `names` (relative, with `/`) under config `config` (None: the
/// default) of its README's `configs:`; None when the folder has no such README section and no
/// config is asked for. `Err` says why the card cannot be read as asked.
pub fn config_splits(dir: &Path, names: &[String], config: Option<&str>) -> Result<Option<Splits>, String> {
    let configs = match std::fs::read_to_string(dir.join("README.md")) {
        Ok(text) => card_configs(&text)?,
        Err(_) => Vec::new(),
    };
    if configs.is_empty() {
        return match config {
            Some(c) => Err(format!("the dataset has no configs (no `configs:` in its README.md), so none named `{c}`")),
            None => Ok(None),
        };
    }
    let mut named = Vec::new();
    for c in &configs {
        named.push(c.config_name.clone().ok_or("a config in README.md's `configs:` has no `config_name`")?);
    }
    let listed = || named.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
    let index = match config {
        Some(c) => named
            .iter()
            .position(|n| n == c)
            .ok_or_else(|| format!("the dataset has no config `{c}`: it has {}", listed()))?,
        None => {
            let defaults: Vec<usize> = (0..configs.len())
                .filter(|&i| configs.len() == 1 || named[i] == "default" || configs[i].default)
                .collect();
            match defaults[..] {
                [one] => one,
                [] => return Err(format!("the dataset has configs {} and none is its default", listed())),
                _ => return Err(format!("the dataset's README.md marks several configs as the default: {}", listed())),
            }
        }
    };
    let c = &configs[index];
    let name = &named[index];
    // Under `data_dir`, patterns and names are relative to it.
    let base = c.data_dir.as_deref().map(|d| format!("{}/", d.trim_matches('/'))).unwrap_or_default();
    let local: Vec<&str> = names.iter().filter_map(|n| n.strip_prefix(base.as_str())).collect();
    let patterns: Vec<(String, Vec<String>)> = match &c.data_files {
        None => {
            let local: Vec<String> = local.iter().map(|n| n.to_string()).collect();
            let splits = super::splits::infer(&local)?;
            if splits.is_empty() {
                return Err(format!("config `{name}` finds no data files under `{base}`"));
            }
            return Ok(Some(
                splits.into_iter().map(|(s, f)| (s, f.iter().map(|f| format!("{base}{f}")).collect())).collect(),
            ));
        }
        Some(Files::One(p)) => vec![("train".into(), vec![p.clone()])],
        Some(Files::Many(p)) => vec![("train".into(), p.clone())],
        Some(Files::Splits(s)) => s.iter().map(|s| (s.split.clone(), s.path.list())).collect(),
        Some(Files::Map(m)) => m.iter().map(|(s, p)| (s.clone(), p.list())).collect(),
    };
    let mut splits = Splits::new();
    for (split, patterns) in patterns {
        if splits.iter().any(|(s, _)| *s == split) {
            return Err(format!("config `{name}` names split `{split}` twice"));
        }
        let mut files = Vec::new();
        for pattern in &patterns {
            let pattern = pattern.trim_start_matches("./");
            let hits: Vec<&&str> = local.iter().filter(|n| matches(pattern, n)).collect();
            if hits.is_empty() && !pattern.contains(['*', '?', '[']) {
                return Err(format!(
                    "config `{name}` names `{base}{pattern}`, which is not a data file of the dataset"
                ));
            }
            files.extend(hits.into_iter().map(|n| format!("{base}{n}")));
        }
        files.sort_unstable();
        files.dedup();
        if files.is_empty() {
            return Err(format!("config `{name}`'s split `{split}` matches no data file ({})", patterns.join(", ")));
        }
        splits.push((split, files));
    }
    Ok(Some(splits))
}

/// The `configs:` of a dataset card (empty without front matter or without the section).
fn card_configs(text: &str) -> Result<Vec<Config>, String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text.lines();
    if lines.next().map(str::trim_end) != Some("---") {
        return Ok(Vec::new());
    }
    let yaml: Vec<&str> = lines.by_ref().take_while(|l| l.trim_end() != "---").collect();
    let card: Card = serde_yaml_ng::from_str(&yaml.join("\n"))
        .map_err(|e| format!("README.md's metadata (its YAML front matter) cannot be read: {e}"))?;
    Ok(card.configs.unwrap_or_default())
}

/// Does the glob `pattern` match the relative `path`, as fsspec's glob does (and datasets'
/// `resolve_pattern` after it)?
fn matches(pattern: &str, path: &str) -> bool {
    let p: Vec<&str> = pattern.split('/').collect();
    let n: Vec<&str> = path.split('/').collect();
    if !parts_match(&p, &n) {
        return false;
    }
    // Hidden parts and `__` folders, and datasets' metadata files, only where the pattern names
    // them (as many of them as the path has).
    let hidden = |parts: &[&str]| parts.iter().filter(|s| s.starts_with('.') && s.chars().any(|c| c != '.')).count();
    let special = |parts: &[&str]| parts[..parts.len() - 1].iter().filter(|s| s.starts_with("__")).count();
    let base = n[n.len() - 1];
    let metadata = super::splits::IGNORED.contains(&base) && p[p.len() - 1] != base;
    hidden(&n) == hidden(&p) && special(&n) == special(&p) && !metadata
}

/// Path parts against pattern parts, a `**` part standing for any number of folders.
fn parts_match(p: &[&str], n: &[&str]) -> bool {
    match p.split_first() {
        None => n.is_empty(),
        Some((&"**", rest)) => (0..=n.len()).any(|skip| parts_match(rest, &n[skip..])),
        Some((first, rest)) => !n.is_empty() && crate::glob::fnmatch(first, n[0]) && parts_match(rest, &n[1..]),
    }
}
