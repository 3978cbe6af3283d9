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
//! datasets' metadata files match only where the pattern names them. tests/fixtures/data/splits.json
//! holds datasets' own answers.
//!
//! A config's settings for its files' loader ([`Reading`]) are applied where they change the
//! rows: a CSV's `sep` (or `delimiter`), a JSON file's `field`, a text file's `sample_by` and
//! `keep_linebreaks`. A setting that would change the rows in a way rtune does not read
//! (`header`, `skiprows`, a non-UTF-8 `encoding`, …) is refused by name rather than read
//! differently; settings that only type or batch the columns (`features`, `chunksize`) leave
//! rtune's rows as they are, and keys no loader knows are ignored, as datasets ignores them.
//! tests/fixtures/data/formats.json holds datasets' rows for each.

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
    /// The loader's settings (`sep`, `field`, …): [`Reading::of`].
    #[serde(flatten)]
    settings: BTreeMap<String, serde_yaml_ng::Value>,
}

/// How a config's files are read into rows: the settings of datasets' CSV, JSON and text loaders
/// that rtune applies. The default reads as datasets does without settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reading {
    /// A CSV's cell separator (`sep` or `delimiter`); None: `,`, or a tab in a `.tsv` file.
    pub sep: Option<Sep>,
    /// A JSON file is one object whose `field` holds the rows: a list of objects, a list of
    /// strings (`text` rows) or an object of equal-length lists (its columns).
    pub field: Option<String>,
    /// How a text file is cut into rows.
    pub sample_by: SampleBy,
    /// A text row keeps its line break (`sample_by = "line"` only).
    pub keep_linebreaks: bool,
}

pub use crate::recipe::SampleBy;

/// A CSV cell separator as rtune reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sep {
    pub text: String,
    /// RFC 4180 quotes are special. Not where the separator was written as more than one
    /// character, which pandas reads as a regular expression, splitting at every match.
    pub quotes: bool,
}

impl Sep {
    /// A one-character separator, with quotes.
    pub fn plain(text: &str) -> Sep {
        Sep { text: text.into(), quotes: true }
    }
}

/// Loader settings that change the rows in ways rtune does not read; refused by name.
const REFUSED: [&str; 21] = [
    "header",
    "names",
    "column_names",
    "index_col",
    "usecols",
    "prefix",
    "skiprows",
    "nrows",
    "skipfooter",
    "skip_blank_lines",
    "quotechar",
    "quoting",
    "escapechar",
    "doublequote",
    "comment",
    "lineterminator",
    "dialect",
    "encoding_errors",
    "columns",
    "filters",
    "delim_whitespace",
];

impl Reading {
    /// The reading settings of config `name`'s other keys.
    fn of(name: &str, settings: &BTreeMap<String, serde_yaml_ng::Value>) -> Result<Reading, String> {
        use serde_yaml_ng::Value;
        let text = |key: &str| -> Result<Option<String>, String> {
            match settings.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(format!("config `{name}`'s `{key}` is {other:?}, not a string")),
            }
        };
        let mut r = Reading::default();
        // Null is these settings' default, except for `header` (whose default is "infer": null
        // reads the first line as data).
        let set = |k: &str, v: &Value| match k {
            "header" => !matches!(v, Value::String(s) if s == "infer") && v.as_u64() != Some(0),
            _ => !v.is_null(),
        };
        if let Some(key) = REFUSED.iter().find(|k| settings.get(**k).is_some_and(|v| set(k, v))) {
            return Err(format!(
                "config `{name}` sets `{key}`, which rtune does not apply: its rows would differ from datasets'"
            ));
        }
        if let Some(enc) = text("encoding")? {
            let e = enc.to_ascii_lowercase().replace('_', "-");
            if !matches!(e.as_str(), "utf-8" | "utf8" | "utf-8-sig") {
                return Err(format!("config `{name}` reads its files as `{enc}`; rtune reads UTF-8 only"));
            }
        }
        r.sep = match (text("sep")?, text("delimiter")?) {
            (Some(a), Some(b)) if a != b => {
                return Err(format!("config `{name}` sets both `sep` ({a:?}) and `delimiter` ({b:?})"));
            }
            (a, b) => a.or(b).map(|s| literal_sep(&format!("config `{name}`'s"), &s)).transpose()?,
        };
        r.field = text("field")?;
        // The names are the recipe's `dataset.sample_by`'s.
        r.sample_by = match text("sample_by")? {
            None => SampleBy::default(),
            Some(by) => serde_yaml_ng::from_value(Value::String(by.clone())).map_err(|_| {
                format!(
                    "config `{name}`'s `sample_by` is `{by}`: datasets' text loader takes line, paragraph or document"
                )
            })?,
        };
        r.keep_linebreaks = match settings.get("keep_linebreaks") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(format!("config `{name}`'s `keep_linebreaks` is {other:?}, not true or false")),
        };
        Ok(r)
    }
}

/// The separator `sep` as literal text. pandas reads a separator of more than one character as
/// a regular expression: one that matches only itself (`::`, or an escaped character such as
/// `\t` or `\|`) is read, without quotes; a pattern is refused.
fn literal_sep(whose: &str, sep: &str) -> Result<Sep, String> {
    if sep.chars().count() == 1 {
        return Ok(Sep::plain(sep));
    }
    let mut out = String::new();
    let mut chars = sep.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('t') => out.push('\t'),
                Some(c) if !c.is_alphanumeric() => out.push(c),
                _ => return Err(refused_sep(whose, sep)),
            },
            '.' | '^' | '$' | '*' | '+' | '?' | '(' | ')' | '[' | ']' | '{' | '}' | '|' => {
                return Err(refused_sep(whose, sep));
            }
            c => out.push(c),
        }
    }
    if out.is_empty() {
        return Err(format!("{whose} `sep` is empty"));
    }
    Ok(Sep { text: out, quotes: false })
}

fn refused_sep(whose: &str, sep: &str) -> String {
    format!("{whose} `sep` {sep:?} is a regular expression (as pandas reads it); rtune reads a literal separator")
}

/// The loader settings a recipe sets over its dataset card's config (`dataset.sep`,
/// `dataset.field`, `dataset.sample_by`), as `load_dataset`'s keyword arguments override a
/// config's; they apply to a single file too.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Overrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sep: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample_by: Option<SampleBy>,
}

impl Overrides {
    /// `reading` with these settings over it; `Err` names the setting that cannot apply and why.
    pub fn apply(&self, mut reading: Reading) -> Result<Reading, (&'static str, String)> {
        if let Some(sep) = &self.sep {
            reading.sep = Some(literal_sep("the recipe's", sep).map_err(|e| ("sep", e))?);
        }
        if let Some(field) = &self.field {
            reading.field = Some(field.clone());
        }
        if let Some(by) = self.sample_by {
            reading.sample_by = by;
        }
        Ok(reading)
    }
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
/// default) of its README's `configs:`, and how that config reads them; None when the folder has
/// no such README section and no config is asked for. `Err` says why the card cannot be read as
/// asked.
pub fn config_splits(dir: &Path, names: &[String], config: Option<&str>) -> Result<Option<(Splits, Reading)>, String> {
    card_splits(std::fs::read_to_string(dir.join("README.md")).ok().as_deref(), names, config)
}

/// [`config_splits`] of a card's text (None: no README.md).
pub fn card_splits(
    card: Option<&str>,
    names: &[String],
    config: Option<&str>,
) -> Result<Option<(Splits, Reading)>, String> {
    let configs = match card {
        Some(text) => card_configs(text)?,
        None => Vec::new(),
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
    let reading = Reading::of(name, &c.settings)?;
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
            let splits =
                splits.into_iter().map(|(s, f)| (s, f.iter().map(|f| format!("{base}{f}")).collect())).collect();
            return Ok(Some((splits, reading)));
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
    Ok(Some((splits, reading)))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(yaml: &str) -> Result<Reading, String> {
        Reading::of("c", &serde_yaml_ng::from_str(yaml).unwrap())
    }

    #[test]
    fn loader_settings_read_or_are_refused_by_name() {
        let sep = |yaml: &str| {
            reading(yaml).map(|r| (r.sep.as_ref().map(|s| s.text.clone()), r.sep.is_some_and(|s| !s.quotes)))
        };
        assert_eq!(sep("sep: ';'"), Ok((Some(";".into()), false)));
        assert_eq!(sep("delimiter: '\\t'"), Ok((Some("\t".into()), true)));
        assert_eq!(sep("sep: \"\\t\""), Ok((Some("\t".into()), false)));
        assert_eq!(sep("{sep: '::', delimiter: '::'}"), Ok((Some("::".into()), true)));
        assert!(sep("{sep: ';', delimiter: ','}").unwrap_err().contains("both `sep`"));
        for pattern in ["'\\s+'", "'a|b'", "'..'", "''"] {
            assert!(sep(&format!("sep: {pattern}")).is_err(), "{pattern}");
        }
        assert_eq!(reading("sample_by: paragraph").unwrap().sample_by, SampleBy::Paragraph);
        assert!(reading("sample_by: sentence").unwrap_err().contains("line, paragraph or document"));
        assert!(reading("keep_linebreaks: 'yes'").is_err());
        // `header: infer` (the default) and unknown or typing-only keys read as without them.
        assert_eq!(reading("{header: infer, features: [], foo: 1, encoding: UTF-8}"), Ok(Reading::default()));
        for refused in ["header: null", "skiprows: 2", "names: [a, b]", "encoding: latin-1"] {
            let e = reading(refused).unwrap_err();
            assert!(e.contains("rtune does not apply") || e.contains("UTF-8 only"), "{refused}: {e}");
        }
    }
}
