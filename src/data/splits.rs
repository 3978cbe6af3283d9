//! Which split (`train`, `validation`, `test`, …) each file of a dataset folder or Hub repository
//! belongs to, by its name, as 🤗 datasets infers it for `load_dataset(folder)`
//! (`datasets.data_files.get_data_patterns`), so that a repository's test files never train:
//!
//! 1. shards at `data/{split}-00000-of-00001.*` name their split (any word: `train_sft`);
//! 2. else split keywords in folder names (`train/`, `v2-test/`, `my_eval/`);
//! 3. else split keywords in file names (`train.jsonl`, `test_0.csv`, `replies_eval.jsonl`);
//! 4. else every file is `train`.
//!
//! The first rule that places any file decides, and files it does not place are in no split (as
//! in datasets). Keywords are case-sensitive: train/training; validation/valid/dev/val;
//! test/testing/eval/evaluation, standing alone or between `-._ ` and digits. Hidden files,
//! files under `__` folders and datasets' metadata files (`dataset_info.json`, …) are in none.
//! tests/fixtures/data/splits.json holds datasets' own answers for 426 layouts.

/// The splits of a folder's files, in datasets' order (train, validation, test, then other
/// names sorted), each with its files (as given, sorted). No files gives no splits.
pub type Splits = Vec<(String, Vec<String>)>;

/// Files datasets never reads as data.
pub(crate) const IGNORED: [&str; 6] =
    ["README.md", "config.json", "dataset_info.json", "dataset_infos.json", "dummy_data.zip", "dataset_dict.json"];

const KEYWORDS: [(&str, &[&str]); 3] = [
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

/// Group `files` (relative paths with `/` between folders) into splits. An error names a shard
/// whose split is not a word (datasets refuses those too).
pub fn infer(files: &[String]) -> Result<Splits, String> {
    let mut files: Vec<&str> = files.iter().map(String::as_str).filter(|f| considered(f)).collect();
    files.sort_unstable();
    files.dedup();
    if let Some(splits) = sharded(&files)? {
        return Ok(splits);
    }
    for in_folder in [true, false] {
        let splits: Splits = KEYWORDS
            .iter()
            .map(|(split, words)| {
                let mine = files.iter().filter(|f| words.iter().any(|w| names(f, w, in_folder))).map(|f| f.to_string());
                (split.to_string(), mine.collect::<Vec<_>>())
            })
            .filter(|(_, f)| !f.is_empty())
            .collect();
        if !splits.is_empty() {
            return Ok(splits);
        }
    }
    if files.is_empty() {
        return Ok(Vec::new());
    }
    Ok(vec![("train".into(), files.iter().map(|f| f.to_string()).collect())])
}

/// Whether datasets looks at this file at all.
fn considered(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    let (base, folders) = parts.split_last().expect("split yields one part");
    let hidden = parts.iter().any(|p| p.starts_with('.') && p.chars().any(|c| c != '.'));
    !hidden && !folders.iter().any(|f| f.starts_with("__")) && !IGNORED.contains(base)
}

fn is_sep(c: char) -> bool {
    matches!(c, '-' | '.' | '_' | ' ') || c.is_ascii_digit()
}

/// Does `path` name split keyword `word` in a folder (`**/word/**`, `**/word[sep]*/**`,
/// `**/*[sep]word/**`, `**/*[sep]word[sep]*/**`) or in its file name (`**/word[sep]*`,
/// `**/*[sep]word[sep]*`)?
fn names(path: &str, word: &str, in_folder: bool) -> bool {
    let mut parts: Vec<&str> = path.split('/').collect();
    let base = parts.pop().unwrap_or_default();
    if in_folder {
        parts.iter().any(|p| *p == word || starts_with_word(p, word) || ends_with_word(p, word) || holds_word(p, word))
    } else {
        starts_with_word(base, word) || holds_word(base, word)
    }
}

/// `word` then a separator at the start of `s`.
fn starts_with_word(s: &str, word: &str) -> bool {
    s.strip_prefix(word).and_then(|rest| rest.chars().next()).is_some_and(is_sep)
}

/// A separator then `word` at the end of `s`.
fn ends_with_word(s: &str, word: &str) -> bool {
    s.strip_suffix(word).and_then(|rest| rest.chars().next_back()).is_some_and(is_sep)
}

/// A separator, `word` and a separator anywhere in `s`.
fn holds_word(s: &str, word: &str) -> bool {
    s.char_indices().any(|(i, c)| is_sep(c) && starts_with_word(&s[i + c.len_utf8()..], word))
}

/// `-NNNNN-of-` and `second` digits (all ASCII) at the start of `s`: the length of what matched.
fn shard_mark(s: &str, second: usize) -> Option<usize> {
    let b = s.as_bytes();
    let digits = |from: usize, n: usize| b.len() >= from + n && b[from..from + n].iter().all(u8::is_ascii_digit);
    (b.first() == Some(&b'-') && digits(1, 5) && b.get(6..10) == Some(b"-of-") && digits(10, second))
        .then_some(10 + second)
}

/// Files at `data/{split}-NNNNN-of-NNNNN*.*` (datasets' `SPLIT_PATTERN_SHARDED`), by split; None
/// when no file is one.
fn sharded(files: &[&str]) -> Result<Option<Splits>, String> {
    // The glob: the mark anywhere in the file name (after any prefix), a `.` somewhere after it.
    fn shard(f: &str) -> Option<&str> {
        let base = f.strip_prefix("data/").filter(|b| !b.contains('/'))?;
        let hit =
            base.char_indices().any(|(i, _)| shard_mark(&base[i..], 5).is_some_and(|n| base[i + n..].contains('.')));
        hit.then_some(base)
    }
    let shards: Vec<(&str, &str)> = files.iter().filter_map(|f| shard(f).map(|b| (*f, b))).collect();
    if shards.is_empty() {
        return Ok(None);
    }
    // The split: datasets un-formats the name with `(?P<split>.+)-[0-9]{5}-of-[0-9]{4}[0-9]*.*`,
    // a greedy search, so the last such mark after at least one character ends it.
    let mut names: Vec<String> = Vec::new();
    for (path, base) in &shards {
        let at = base.char_indices().skip(1).filter(|(i, _)| shard_mark(&base[*i..], 4).is_some()).last();
        let Some((i, _)) = at else {
            return Err(format!("`{path}` is a shard with no split name before its number"));
        };
        let name = &base[..i];
        let word = |w: &str| !w.is_empty() && w.chars().all(|c| c.is_alphanumeric() || c == '_');
        if !name.split('.').all(word) {
            return Err(format!("`{path}` names the split `{name}`, which is not a word (letters, digits, `_`, `.`)"));
        }
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    let rank = |n: &str| KEYWORDS.iter().position(|(s, _)| *s == n).unwrap_or(KEYWORDS.len());
    names.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| a.cmp(b)));
    // Each split's files are those its own pattern matches (`data/{split}-NNNNN-of-NNNNN*.*`).
    let splits = names
        .into_iter()
        .map(|name| {
            let mine = shards
                .iter()
                .filter(|(_, base)| {
                    base.strip_prefix(name.as_str())
                        .and_then(|rest| shard_mark(rest, 5).map(|n| rest[n..].contains('.')))
                        .unwrap_or(false)
                })
                .map(|(path, _)| path.to_string())
                .collect();
            (name, mine)
        })
        .collect();
    Ok(Some(splits))
}

/// A short list of splits for messages: `` `test` (2 files), `validation` (1 file) ``.
pub fn describe<'a>(splits: impl IntoIterator<Item = &'a (String, Vec<String>)>) -> String {
    let list: Vec<String> = splits
        .into_iter()
        .map(|(name, files)| format!("`{name}` ({} file{})", files.len(), if files.len() == 1 { "" } else { "s" }))
        .collect();
    list.join(", ")
}
