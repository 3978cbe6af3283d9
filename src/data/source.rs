//! Dataset files to rows: JSON Lines, a JSON array of objects, CSV with a header, or plain text
//! (one row per non-empty line). A folder's data files fall into splits (its card's configs,
//! else their names: `super::configs`, `super::splits`); a split's files are read in name order.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::splits::Splits;

use super::DataError;

/// One dataset row and where it came from.
#[derive(Debug, Clone)]
pub struct Row {
    pub fields: Map<String, Value>,
    /// File name (as shown in messages) and 1-based line.
    pub file: String,
    pub line: usize,
}

/// Read every row of a file or folder (every data file in it, whatever its split). A malformed
/// row is an error, unless `skip_bad` is set, in which case it is returned in the second list.
pub fn read_rows(path: &Path, skip_bad: bool) -> Result<(Vec<Row>, Vec<DataError>), DataError> {
    let mut rows = Vec::new();
    let skipped = for_each_row(
        &data_files(path, None, None)?.files,
        skip_bad,
        &mut |r| {
            rows.push(r);
            Ok(())
        },
        &mut |_| {},
    )?;
    Ok((rows, skipped.first))
}

/// Rows skipped as malformed (with `skip_bad`): how many, and the first few errors.
#[derive(Debug, Default)]
pub struct Skipped {
    pub count: usize,
    pub first: Vec<DataError>,
}

impl Skipped {
    const KEPT: usize = 100;

    pub fn push(&mut self, e: DataError) {
        self.count += 1;
        if self.first.len() < Self::KEPT {
            self.first.push(e);
        }
    }
}

/// Stream every row of `files` (from [`data_files`]) to `each`, in order, holding one line (one
/// Parquet row, or for `.json` arrays the whole file) at a time: a dataset is never read into
/// memory whole. Malformed rows stop the read, or with `skip_bad` are counted. `progress` hears
/// the bytes read so far (of [`total_bytes`]) now and then.
pub fn for_each_row(
    files: &[PathBuf],
    skip_bad: bool,
    each: &mut dyn FnMut(Row) -> Result<(), DataError>,
    progress: &mut dyn FnMut(u64),
) -> Result<Skipped, DataError> {
    let mut skipped = Skipped::default();
    let mut done = 0u64;
    for f in files {
        let mut push = |r: Result<Row, DataError>| -> Result<(), DataError> {
            match r {
                Ok(row) => each(row),
                Err(e) if skip_bad => {
                    skipped.push(e);
                    Ok(())
                }
                Err(e) => Err(e),
            }
        };
        let base = done;
        done += read_file(f, &mut push, &mut |n| progress(base + n))?;
        progress(done);
    }
    Ok(skipped)
}

/// The bytes [`for_each_row`] will read.
pub fn total_bytes(files: &[PathBuf]) -> u64 {
    files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum()
}

/// The files a dataset's rows are read from, and the splits of its folder left unread.
#[derive(Debug, Clone)]
pub struct DataFiles {
    pub files: Vec<PathBuf>,
    /// The folder's other splits (empty for a file, or when every file is read).
    pub unread: Splits,
}

/// The data files of `path`: the file itself, or a folder's data files in name order (hidden
/// ones skipped) — with `split`, only those of that split of `config` ([`folder_splits`]); a
/// split the files do not name is [`DataError::NoSplit`].
pub fn data_files(path: &Path, split: Option<&str>, config: Option<&str>) -> Result<DataFiles, DataError> {
    if !path.is_dir() {
        return Ok(DataFiles { files: vec![path.to_path_buf()], unread: Vec::new() });
    }
    let Some(split) = split else {
        let names = data_names(path)?;
        return Ok(DataFiles { files: names.iter().map(|n| path.join(n)).collect(), unread: Vec::new() });
    };
    let splits = folder_splits(path, config)?;
    let Some((_, mine)) = splits.iter().find(|(name, _)| name == split) else {
        return Err(DataError::NoSplit { split: split.to_string(), found: splits });
    };
    let files = mine.iter().map(|n| path.join(n)).collect();
    let unread = splits.iter().filter(|(name, _)| name != split).cloned().collect();
    Ok(DataFiles { files, unread })
}

/// The splits of a dataset folder's data files: those of `config` (None: the default) where its
/// README.md names configs ([`super::configs`]), else as their names say
/// ([`super::splits::infer`]); at least one.
pub fn folder_splits(path: &Path, config: Option<&str>) -> Result<Splits, DataError> {
    let names = data_names(path)?;
    let splits = match super::configs::config_splits(path, &names, config) {
        Ok(Some(splits)) => splits,
        Ok(None) => super::splits::infer(&names)
            .map_err(|message| DataError::Invalid { message, help: Some(SPLIT_NAMES.into()) })?,
        Err(message) => {
            let help = "the dataset card (README.md) names the dataset's configs and the files of their splits, \
                        as 🤗 datasets reads them: name one with `dataset.config`";
            return Err(DataError::Invalid { message, help: Some(help.into()) });
        }
    };
    if splits.is_empty() {
        return Err(DataError::Invalid {
            message: format!("folder `{}` holds only files no split reads", path.display()),
            help: Some(
                "files under a folder whose name starts with `__`, and datasets' metadata files \
                 (dataset_info.json, …), are not data"
                    .into(),
            ),
        });
    }
    Ok(splits)
}

/// A folder's data files (relative, with `/`), hidden ones skipped, in name order; none is an
/// error.
fn data_names(path: &Path) -> Result<Vec<String>, DataError> {
    let mut names = Vec::new();
    for rel in crate::store::walk(path).map_err(|e| DataError::Io { path: path.display().to_string(), source: e })? {
        let name = rel.to_string_lossy().replace(std::path::MAIN_SEPARATOR, "/");
        if !name.starts_with('.') && supported(&name) {
            names.push(name);
        }
    }
    if names.is_empty() {
        return Err(DataError::Invalid {
            message: format!("folder `{}` holds no dataset files", path.display()),
            help: Some(format!("rtune reads {FORMATS} files")),
        });
    }
    Ok(names)
}

/// [`data_files`] for a split the recipe names at `at` (`dataset.split`, …), any problem located
/// there.
pub fn split_files(
    path: &Path,
    (split, config): (Option<&str>, Option<&str>),
    at: Option<&crate::recipe::Origin>,
) -> Result<DataFiles, crate::recipe::Problem> {
    data_files(path, split, config).map_err(|e| located(e, at, "this split"))
}

/// A data problem as a recipe problem located at `at`, with its code and help.
pub fn located(e: DataError, at: Option<&crate::recipe::Origin>, label: &str) -> crate::recipe::Problem {
    let mut message = e.to_string();
    if let Some(source) = std::error::Error::source(&e) {
        message = format!("{message}: {source}");
    }
    let p = crate::recipe::Problem::new(e.code_name(), message).at(at, label);
    match miette::Diagnostic::help(&e) {
        Some(h) => p.help(h.to_string()),
        None => p,
    }
}

/// The train split's `train` files and the eval split's `eval` files (of folder `dir`) share
/// none: a file in both would train and evaluate. The problem is located at `at`.
pub fn check_disjoint(
    dir: &Path,
    (split, train): (&str, &[PathBuf]),
    (eval_split, eval): (&str, &[PathBuf]),
    at: Option<&crate::recipe::Origin>,
) -> Result<(), crate::recipe::Problem> {
    let Some(both) = eval.iter().find(|f| train.contains(f)) else { return Ok(()) };
    let name = both.strip_prefix(dir).unwrap_or(both).display().to_string();
    Err(crate::recipe::Problem::new(
        "rtune::data::split_overlap",
        format!("`{name}` is in both split `{split}` and split `{eval_split}`: its rows would train and evaluate"),
    )
    .at(at, "the eval split")
    .help("name the file for one split only, or hold rows out with `dataset.eval_fraction` instead"))
}

/// How files name their split, for help texts.
pub const SPLIT_NAMES: &str = "files name their split as in 🤗 datasets: `train.jsonl` / `test.jsonl`, \
     `train/…` / `validation/…`, or shards `data/train-00000-of-00001.parquet`";

/// The dataset files rtune reads, by extension, as a sentence's list.
pub const FORMATS: &str = ".jsonl, .json, .csv, .txt or .parquet";

/// Whether rtune reads a file of this name as data (by its extension, in any case).
pub fn supported(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [".jsonl", ".json", ".csv", ".txt", ".parquet"].iter().any(|e| name.ends_with(e))
}

/// Parquet rows as JSON objects (lists and structs nest, as in `datasets`); row N of the file is
/// reported as "line" N.
fn read_parquet(path: &Path, name: &str, push: Push<'_>) -> Result<(), DataError> {
    // The parquet crate asserts on some malformed metadata: a damaged file is an error here.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read_parquet_inner(path, name, push))) {
        Ok(r) => r?,
        Err(_) => {
            return Err(DataError::Invalid {
                message: format!("`{name}` is not a readable Parquet file: its metadata is damaged"),
                help: Some("re-export the file, or convert it to JSON Lines".into()),
            });
        }
    }
    Ok(())
}

/// Where a reader sends each row (or the error that replaced it).
type Push<'a> = &'a mut dyn FnMut(Result<Row, DataError>) -> Result<(), DataError>;

fn read_parquet_inner(path: &Path, name: &str, push: Push<'_>) -> Result<(), DataError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let bad = |e: parquet::errors::ParquetError| DataError::Invalid {
        message: format!("`{name}` is not a readable Parquet file: {e}"),
        help: Some("rtune reads Parquet with snappy, zstd, gzip or no compression".into()),
    };
    let file = std::fs::File::open(path).map_err(|e| DataError::Io { path: path.display().to_string(), source: e })?;
    let reader = SerializedFileReader::new(file).map_err(bad)?;
    for (i, row) in reader.get_row_iter(None).map_err(bad)?.enumerate() {
        match row.map_err(bad)?.to_json_value() {
            Value::Object(fields) => push(Ok(Row { fields, file: name.to_string(), line: i + 1 }))?,
            other => {
                return Err(DataError::bad_row(
                    name,
                    i + 1,
                    &other.to_string(),
                    None,
                    "row is not a record".into(),
                    None,
                ));
            }
        }
    }
    Ok(())
}

/// Read one file's rows into `push`; returns the bytes read.
fn read_file(path: &Path, push: Push<'_>, progress: &mut dyn FnMut(u64)) -> Result<u64, DataError> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let ext = name.rsplit('.').next().unwrap_or_default().to_ascii_lowercase();
    let io = |e| DataError::Io { path: path.display().to_string(), source: e };
    let size = std::fs::metadata(path).map_err(io)?.len();
    if ext == "parquet" {
        read_parquet(path, &name, push)?;
        return Ok(size);
    }
    if ext == "json" {
        read_json_array(path, &name, push, progress)?;
        return Ok(size);
    }
    // Line formats stream: one line in memory at a time.
    let mut reader = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path).map_err(io)?);
    let mut buf = Vec::new();
    let mut header: Option<Vec<String>> = None;
    // A CSV record whose quoted cell is still open: its first line, its text so far.
    let mut record: Option<(usize, String)> = None;
    let (mut i, mut read) = (0usize, 0u64);
    loop {
        buf.clear();
        let n = std::io::BufRead::read_until(&mut reader, b'\n', &mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        i += 1;
        read += n as u64;
        if i.is_multiple_of(4096) {
            progress(read);
        }
        while matches!(buf.last(), Some(b'\n' | b'\r')) {
            buf.pop();
        }
        let mut line = match utf8(&name, std::mem::take(&mut buf), i - 1) {
            Ok(line) => line,
            // A line of a JSON Lines or text file is a row: with `skip_bad_rows` it is skipped
            // like any bad row. A CSV header, or a line inside a quoted cell, is not.
            Err(e) if ext != "csv" || (header.is_some() && record.is_none()) => {
                push(Err(e))?;
                continue;
            }
            Err(e) => return Err(e),
        };
        if i == 1 && line.starts_with(BOM) {
            // Excel's "CSV UTF-8" and some Windows editors start the file with a byte order mark.
            line.drain(..BOM.len());
        }
        match ext.as_str() {
            "jsonl" => {
                if !line.trim().is_empty() {
                    push(parse_object(&name, i, &line))?;
                }
            }
            "csv" => {
                // A quoted cell may hold line breaks: a record goes on until its quotes balance.
                let quotes = line.bytes().filter(|b| *b == b'"').count();
                let (start, line) = match record.take() {
                    Some((start, mut text)) => {
                        text.push('\n');
                        text.push_str(&line);
                        // An even number of quotes on this line leaves the cell open.
                        if quotes.is_multiple_of(2) {
                            if text.len() > MAX_CSV_RECORD {
                                return Err(unclosed_quote(&name, start, &text));
                            }
                            record = Some((start, text));
                            continue;
                        }
                        (start, text)
                    }
                    None if !quotes.is_multiple_of(2) => {
                        record = Some((i, line));
                        continue;
                    }
                    None => (i, line),
                };
                let Some(header) = &header else {
                    header = Some(split_csv(&line));
                    continue;
                };
                if line.trim().is_empty() {
                    continue;
                }
                let cells = split_csv(&line);
                if cells.len() != header.len() {
                    push(Err(DataError::bad_row(
                        &name,
                        start,
                        &line,
                        Some(0..line.len()),
                        format!("row has {} cells, the header has {}", cells.len(), header.len()),
                        Some("quote cells that contain commas: \"a, b\"".into()),
                    )))?;
                    continue;
                }
                let fields = header.iter().cloned().zip(cells.into_iter().map(Value::String)).collect();
                push(Ok(Row { fields, file: name.clone(), line: start }))?;
            }
            _ => {
                if !line.trim().is_empty() {
                    let fields = Map::from_iter([("text".to_string(), Value::String(line))]);
                    push(Ok(Row { fields, file: name.clone(), line: i }))?;
                }
            }
        }
    }
    if let Some((start, text)) = record {
        return Err(unclosed_quote(&name, start, &text));
    }
    Ok(read)
}

/// The byte order mark some editors start UTF-8 files with.
const BOM: &str = "\u{feff}";

/// The longest CSV record read (a cell whose quote never closes would otherwise take the file).
const MAX_CSV_RECORD: usize = 16 << 20;

fn unclosed_quote(name: &str, line: usize, text: &str) -> DataError {
    let first = text.lines().next().unwrap_or_default();
    let at = first.find('"').unwrap_or(0);
    DataError::bad_row(
        name,
        line,
        first,
        Some(at..at + 1),
        "a quoted cell that starts on this line is never closed".into(),
        Some("close the quote; a `\"` inside a quoted cell is written `\"\"`".into()),
    )
}

/// `bytes` as text, or an error naming the line (`lines_before` + the newlines before the bad
/// byte, 1-based).
fn utf8(name: &str, bytes: Vec<u8>, lines_before: usize) -> Result<String, DataError> {
    String::from_utf8(bytes).map_err(|e| {
        let line =
            lines_before + 1 + e.as_bytes()[..e.utf8_error().valid_up_to()].iter().filter(|b| **b == b'\n').count();
        DataError::bad_row(name, line, "", None, "the file is not valid UTF-8".into(), None)
    })
}

/// Stream the items of a JSON array: one item is parsed and handed on before the next is read,
/// so a `.json` dataset costs one item of memory, not the file. Item N is reported as "line" N.
fn read_json_array(path: &Path, name: &str, push: Push<'_>, progress: &mut dyn FnMut(u64)) -> Result<(), DataError> {
    use std::io::BufRead;
    let io = |e| DataError::Io { path: path.display().to_string(), source: e };
    let mut reader = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path).map_err(io)?);
    // A value that is not an array (an object, a string, a number, …) is the wrong shape of
    // file rather than malformed JSON; anything else is left to the parser to locate. (Peeked
    // in the first buffer without consuming it, so the parser's line numbers stay right.)
    if reader.fill_buf().map_err(io)?.starts_with(BOM.as_bytes()) {
        reader.consume(BOM.len());
    }
    let first = reader.fill_buf().map_err(io)?.iter().find(|b| !b.is_ascii_whitespace()).copied();
    if first.is_some_and(|b| matches!(b, b'{' | b'"' | b'-' | b'0'..=b'9' | b't' | b'f' | b'n')) {
        return Err(DataError::Invalid {
            message: format!("`{name}` is not a JSON array of objects"),
            help: Some("write one object per line as .jsonl, or wrap the objects in [ … ]".into()),
        });
    }
    let mut de = serde_json::Deserializer::from_reader(Counted { inner: reader, read: 0, progress });
    let mut stopped = None;
    let items = Items { name, push, stopped: &mut stopped };
    let result = serde::de::DeserializeSeed::deserialize(items, &mut de).and_then(|()| de.end());
    if let Some(e) = stopped {
        return Err(e);
    }
    result.map_err(|e| json_error(name, path, e))
}

/// A reader that tells `progress` how far it has read, every 4 MiB.
struct Counted<'p, R> {
    inner: R,
    read: u64,
    progress: &'p mut dyn FnMut(u64),
}

impl<R: std::io::Read> std::io::Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if (self.read + n as u64) >> 22 != self.read >> 22 {
            (self.progress)(self.read + n as u64);
        }
        self.read += n as u64;
        Ok(n)
    }
}

/// The top-level array, visited item by item. An error from `push` (a bad row without
/// `skip_bad`, or the consumer's own) stops the parse and is kept in `stopped`.
struct Items<'a, 'p> {
    name: &'a str,
    push: Push<'p>,
    stopped: &'a mut Option<DataError>,
}

impl<'de> serde::de::DeserializeSeed<'de> for Items<'_, '_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Items<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON array of objects")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0;
        while let Some(item) = seq.next_element::<Value>()? {
            i += 1;
            let row = match item {
                Value::Object(fields) => Ok(Row { fields, file: self.name.to_string(), line: i }),
                other => Err(DataError::bad_row(
                    self.name,
                    i,
                    &other.to_string(),
                    None,
                    format!("item {i} is not an object"),
                    None,
                )),
            };
            if let Err(e) = (self.push)(row) {
                *self.stopped = Some(e);
                return Err(serde::de::Error::custom("stopped"));
            }
        }
        Ok(())
    }
}

fn parse_object(file: &str, line: usize, text: &str) -> Result<Row, DataError> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(fields)) => Ok(Row { fields, file: file.into(), line }),
        Ok(other) => Err(DataError::bad_row(
            file,
            line,
            text,
            Some(0..text.len()),
            format!("expected a JSON object, found {}", kind(&other)),
            Some("each line of a .jsonl file is one object: {\"instruction\": …}".into()),
        )),
        Err(e) => {
            let col = e.column().saturating_sub(1);
            Err(DataError::bad_row(file, line, text, Some(col..col + 1), format!("malformed JSON: {e}"), None))
        }
    }
}

/// A JSON parse error located in its file: the line is read back (bounded) for the snippet.
fn json_error(file: &str, path: &Path, e: serde_json::Error) -> DataError {
    use std::io::BufRead;
    let line_text = std::fs::File::open(path)
        .ok()
        .and_then(|f| std::io::BufReader::new(f).split(b'\n').nth(e.line().saturating_sub(1)))
        .and_then(Result::ok)
        .map(|l| String::from_utf8_lossy(&l[..l.len().min(4096)]).trim_end_matches('\r').to_string())
        .unwrap_or_default();
    let col = e.column().saturating_sub(1);
    DataError::bad_row(file, e.line(), &line_text, Some(col..col + 1), format!("malformed JSON: {e}"), None)
}

pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Split one CSV record (RFC 4180 quoting; a quoted cell may hold line breaks).
fn split_csv(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut cur)),
            (c, _) => cur.push(c),
        }
    }
    out.push(cur);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows_of(text: &str, skip_bad: bool) -> (Result<Skipped, DataError>, Vec<Row>, Vec<u64>) {
        rows_in("d.json", text, skip_bad)
    }

    fn rows_in(name: &str, text: &str, skip_bad: bool) -> (Result<Skipped, DataError>, Vec<Row>, Vec<u64>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let (mut rows, mut seen) = (Vec::new(), Vec::new());
        let r = for_each_row(
            std::slice::from_ref(&path),
            skip_bad,
            &mut |row| {
                rows.push(row);
                Ok(())
            },
            &mut |n| seen.push(n),
        );
        (r, rows, seen)
    }

    #[test]
    fn json_arrays_stream_item_by_item_with_located_errors() {
        let (r, rows, seen) = rows_of("[\n {\"a\": 1},\n {\"a\": \"x\"}\n]\n", false);
        r.unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[1].line, rows[1].fields["a"].as_str()), (2, Some("x")));
        assert_eq!(seen.last(), Some(&27));
        // A non-object item is a bad row: skipped with `skip_bad`, an error without.
        let (r, rows, _) = rows_of("[{\"a\": 1}, 7, {\"a\": 3}]", true);
        assert_eq!((r.unwrap().count, rows.len()), (1, 2));
        let (r, rows, _) = rows_of("[{\"a\": 1}, 7, {\"a\": 3}]", false);
        assert!(r.unwrap_err().to_string().contains("item 2 is not an object"));
        assert_eq!(rows.len(), 1, "rows before the bad one were already handed on");
        // Malformed JSON names its line, and the line is shown.
        let (r, _, _) = rows_of("[\n {\"a\": 1},\n {\"a\": 2,,}\n]", false);
        let e = r.unwrap_err();
        assert!(matches!(&e, DataError::BadRow { line: 3, .. }), "{e:?}");
        assert!(e.to_string().contains("malformed JSON"), "{e}");
        let (r, _, _) = rows_of("\n\n[\n {\"a\": 2,,}\n]", false);
        assert!(matches!(r.unwrap_err(), DataError::BadRow { line: 4, .. }), "leading blank lines count");
        // Not an array at all; trailing garbage after the array.
        for text in ["{\"a\": 1}", "\"rows\"", "[{\"a\": 1}] [2]"] {
            let (r, _, _) = rows_of(text, false);
            let e = r.unwrap_err().to_string();
            assert!(e.contains("not a JSON array of objects") || e.contains("trailing characters"), "{text}: {e}");
        }
        // The consumer's own error stops the read and is returned as it was.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.json");
        std::fs::write(&path, "[{}, {}, {}]").unwrap();
        let mut n = 0;
        let e = for_each_row(
            std::slice::from_ref(&path),
            false,
            &mut |_| {
                n += 1;
                Err(DataError::Invalid { message: "enough".into(), help: None })
            },
            &mut |_| {},
        )
        .unwrap_err();
        assert_eq!((e.to_string(), n), ("enough".to_string(), 1));
    }

    #[test]
    fn csv_quotes() {
        assert_eq!(split_csv(r#"a,"b, c","say ""hi""""#), ["a", "b, c", "say \"hi\""]);
    }
    /// Excel's "CSV UTF-8" (and Notepad) start files with a byte order mark: it is not part of
    /// the first column's name or the first row.
    #[test]
    fn a_byte_order_mark_is_not_data() {
        for (name, text) in [
            ("d.jsonl", "\u{feff}{\"a\": \"x\"}\r\n{\"a\": \"y\"}\r\n"),
            ("d.json", "\u{feff}[{\"a\": \"x\"}, {\"a\": \"y\"}]"),
            ("d.csv", "\u{feff}a\r\nx\r\ny\r\n"),
        ] {
            let (r, rows, _) = rows_in(name, text, false);
            r.unwrap_or_else(|e| panic!("{name}: {e}"));
            let got: Vec<_> = rows.iter().map(|r| r.fields["a"].as_str().unwrap().to_string()).collect();
            assert_eq!(got, ["x", "y"], "{name}");
        }
        let (r, rows, _) = rows_in("d.txt", "\u{feff}first\nsecond\n", false);
        r.unwrap();
        assert_eq!(rows[0].fields["text"], "first");
    }

    /// A line that is not UTF-8 is a bad row, skipped with `skip_bad` (it stopped the read).
    #[test]
    fn a_line_that_is_not_utf8_is_a_bad_row() {
        let dir = tempfile::tempdir().unwrap();
        for (name, bytes) in [
            ("d.jsonl", &b"{\"a\": \"x\"}\n{\"a\": \"\xff\"}\n{\"a\": \"y\"}\n"[..]),
            ("d.csv", &b"a\nx\n\xff\ny\n"[..]),
            ("d.txt", &b"x\n\xff\ny\n"[..]),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            let mut rows = 0;
            let skipped = for_each_row(
                std::slice::from_ref(&path),
                true,
                &mut |_| {
                    rows += 1;
                    Ok(())
                },
                &mut |_| {},
            )
            .unwrap();
            assert_eq!((rows, skipped.count), (2, 1), "{name}");
            let e = for_each_row(std::slice::from_ref(&path), false, &mut |_| Ok(()), &mut |_| {}).unwrap_err();
            assert!(
                matches!(&e, DataError::BadRow { line: 2 | 3, .. }) && e.to_string().contains("UTF-8"),
                "{name}: {e}"
            );
        }
        // A CSV header that is not UTF-8 stops the read whatever `skip_bad` says.
        let path = dir.path().join("h.csv");
        std::fs::write(&path, b"\xff\nx\n").unwrap();
        assert!(for_each_row(std::slice::from_ref(&path), true, &mut |_| Ok(()), &mut |_| {}).is_err());
    }

    /// A quoted cell may hold line breaks (pandas and spreadsheets write multi-line answers so);
    /// the row is numbered by its first line, and a quote left open is a located error.
    #[test]
    fn csv_cells_may_span_lines() {
        let text = "q,a\r\nhi,\"one\r\ntwo, \"\"three\"\"\r\n\r\nfour\"\r\nnext,\"x\"\r\n";
        let (r, rows, _) = rows_in("d.csv", text, false);
        r.unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].fields["a"], "one\ntwo, \"three\"\n\nfour");
        assert_eq!((rows[1].line, rows[1].fields["q"].as_str()), (6, Some("next")));
        let (r, rows, _) = rows_in("d.csv", "q,a\nok,1\nbad,\"open\nmore,2\n", false);
        let e = r.unwrap_err();
        assert!(matches!(&e, DataError::BadRow { line: 3, .. }), "{e:?}");
        assert!(e.to_string().contains("never closed"), "{e}");
        assert_eq!(rows.len(), 1);
    }

    /// A bad row's snippet carries its line number: `[d.jsonl:3:7]` and `3 │`, not line 1.
    #[test]
    fn a_bad_rows_snippet_shows_its_line_in_the_file() {
        let (r, _, _) = rows_in("d.jsonl", "{\"a\": 1}\n{\"a\": 2}\n{\"a\": ,}\n", false);
        let e = r.unwrap_err();
        let mut shown = String::new();
        miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
            .render_report(&mut shown, &e)
            .unwrap();
        assert!(shown.contains("[d.jsonl:3:7]") && shown.contains(" 3 │ {\"a\": ,}"), "{shown}");
    }
}
