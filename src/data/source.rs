//! Dataset files to rows, as 🤗 datasets' loaders read them: JSON Lines; a `.json` file holding
//! an array of objects (or of strings: `text` rows), or objects one after another (JSON Lines,
//! or pretty-printed), or with a config's `field` one object whose field holds the rows; CSV (or
//! tab-separated `.tsv`) with a header; Parquet; plain text (one row per non-empty line, or per
//! paragraph or file with a config's `sample_by`). A folder's data files fall into splits (its
//! card's configs, else their names: `super::configs`, `super::splits`), and its card's config
//! says how they read ([`Reading`]); a split's files are read in name order.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::configs::{Reading, SampleBy, Sep};
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
        &data_files(path, None, None)?,
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
/// Parquet row, one item of a `.json` array) at a time: a dataset is never read into memory
/// whole (except a JSON file read by `field`, and a text file by `sample_by = "document"`, which
/// datasets reads whole too). Malformed rows stop the read, or with `skip_bad` are counted.
/// `progress` hears the bytes read so far (of [`total_bytes`]) now and then.
pub fn for_each_row(
    files: &DataFiles,
    skip_bad: bool,
    each: &mut dyn FnMut(Row) -> Result<(), DataError>,
    progress: &mut dyn FnMut(u64),
) -> Result<Skipped, DataError> {
    let mut skipped = Skipped::default();
    let mut done = 0u64;
    for f in &files.files {
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
        done += read_file(f, &files.reading, &mut push, &mut |n| progress(base + n))?;
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
    /// How the files read (their config's loader settings).
    pub reading: Reading,
}

impl DataFiles {
    /// `files`, read with no loader settings.
    pub fn of(files: Vec<PathBuf>) -> DataFiles {
        DataFiles { files, unread: Vec::new(), reading: Reading::default() }
    }
}

/// The data files of `path`: the file itself, or a folder's data files in name order (hidden
/// ones skipped) — with `split`, only those of that split of `config` ([`folder_splits`]); a
/// split the files do not name is [`DataError::NoSplit`].
pub fn data_files(path: &Path, split: Option<&str>, config: Option<&str>) -> Result<DataFiles, DataError> {
    if !path.is_dir() {
        return Ok(DataFiles::of(vec![path.to_path_buf()]));
    }
    let Some(split) = split else {
        let names = data_names(path)?;
        return Ok(DataFiles::of(names.iter().map(|n| path.join(n)).collect()));
    };
    let (splits, reading) = folder_splits(path, config)?;
    let Some((_, mine)) = splits.iter().find(|(name, _)| name == split) else {
        return Err(DataError::NoSplit { split: split.to_string(), found: splits });
    };
    let files = mine.iter().map(|n| path.join(n)).collect();
    let unread = splits.iter().filter(|(name, _)| name != split).cloned().collect();
    Ok(DataFiles { files, unread, reading })
}

/// The splits of a dataset folder's data files: those of `config` (None: the default) where its
/// README.md names configs ([`super::configs`]), else as their names say
/// ([`super::splits::infer`]); at least one. With them, how the config reads its files.
pub fn folder_splits(path: &Path, config: Option<&str>) -> Result<(Splits, Reading), DataError> {
    let names = data_names(path)?;
    let (splits, reading) = match super::configs::config_splits(path, &names, config) {
        Ok(Some(found)) => found,
        Ok(None) => (
            super::splits::infer(&names)
                .map_err(|message| DataError::Invalid { message, help: Some(SPLIT_NAMES.into()) })?,
            Reading::default(),
        ),
        Err(message) => {
            return Err(DataError::Invalid { message, help: Some(CARD_HELP.into()) });
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
    Ok((splits, reading))
}

/// A folder's data files (relative, with `/`), hidden ones skipped, in name order; none is an
/// error.
fn data_names(path: &Path) -> Result<Vec<String>, DataError> {
    let mut names = Vec::new();
    for rel in crate::store::walk(path).map_err(|e| DataError::Io { path: path.display().to_string(), source: e })? {
        let name = rel.to_string_lossy().replace(std::path::MAIN_SEPARATOR, "/");
        if is_data_file(&name) {
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

/// [`data_files`] for a split the recipe names at `at` (`dataset.split`, …), read with the
/// recipe's loader settings `over` the card's; any problem located there.
pub fn split_files(
    path: &Path,
    (split, config): (Option<&str>, Option<&str>),
    over: &super::configs::Overrides,
    at: Option<&crate::recipe::Origin>,
) -> Result<DataFiles, crate::recipe::Problem> {
    let mut files = data_files(path, split, config).map_err(|e| located(e, at, "this split"))?;
    files.reading = over
        .apply(files.reading)
        .map_err(|(_, message)| located(DataError::Invalid { message, help: None }, at, "this split"))?;
    Ok(files)
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

/// What a dataset card's configs are, for help texts.
pub const CARD_HELP: &str = "the dataset card (README.md) names the dataset's configs, the files of their splits and \
     how they read, as 🤗 datasets reads them: name another with `dataset.config`, or see docs/interop.md for the \
     loader settings rtune applies";

/// How files name their split, for help texts.
pub const SPLIT_NAMES: &str = "files name their split as in 🤗 datasets: `train.jsonl` / `test.jsonl`, \
     `train/…` / `validation/…`, or shards `data/train-00000-of-00001.parquet`";

/// The dataset files rtune reads, by extension, as a sentence's list.
pub const FORMATS: &str = ".jsonl, .json, .csv, .tsv, .txt or .parquet";

/// Whether a folder's file at `rel` (relative, with `/`) is one of its data files: not hidden,
/// and of a kind rtune reads.
pub fn is_data_file(rel: &str) -> bool {
    !rel.starts_with('.') && supported(rel)
}

/// Whether rtune reads a file of this name as data (by its extension, in any case).
pub fn supported(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [".jsonl", ".json", ".csv", ".tsv", ".txt", ".parquet"].iter().any(|e| name.ends_with(e))
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

/// Read one file's rows into `push`, as `reading` says; returns the bytes read.
fn read_file(path: &Path, reading: &Reading, push: Push<'_>, progress: &mut dyn FnMut(u64)) -> Result<u64, DataError> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let ext = name.rsplit('.').next().unwrap_or_default().to_ascii_lowercase();
    let io = |e| DataError::Io { path: path.display().to_string(), source: e };
    let size = std::fs::metadata(path).map_err(io)?.len();
    let kind = match ext.as_str() {
        "parquet" => {
            read_parquet(path, &name, push)?;
            return Ok(size);
        }
        "json" | "jsonl" if reading.field.is_some() => {
            read_json_field(path, &name, reading.field.as_deref().unwrap_or_default(), push)?;
            return Ok(size);
        }
        "json" => match json_layout(path).map_err(io)? {
            JsonLayout::Array => {
                read_json_array(path, &name, push, progress)?;
                return Ok(size);
            }
            JsonLayout::Objects => {
                read_json_objects(path, &name, push, progress)?;
                return Ok(size);
            }
            JsonLayout::Lines => Lines::Json,
            JsonLayout::Other => {
                return Err(DataError::Invalid {
                    message: format!("`{name}` is not a JSON array of objects"),
                    help: Some("write one object per line as .jsonl, or wrap the objects in [ … ]".into()),
                });
            }
        },
        "jsonl" => Lines::Json,
        "csv" | "tsv" => {
            Lines::Csv(reading.sep.clone().unwrap_or_else(|| Sep::plain(if ext == "tsv" { "\t" } else { "," })))
        }
        _ if reading.sample_by != SampleBy::Line => {
            read_text_samples(path, &name, reading.sample_by, push, progress)?;
            return Ok(size);
        }
        _ => Lines::Text { keep_linebreaks: reading.keep_linebreaks },
    };
    // Line formats stream: one line in memory at a time.
    let mut lines = LineReader::open(path)?;
    let mut header: Option<Vec<String>> = None;
    // A CSV record whose quoted cell is still open: its first line, its text so far.
    let mut record: Option<(usize, String)> = None;
    let csv = matches!(kind, Lines::Csv(_));
    while let Some((line, ended)) = lines.next(&name, progress)? {
        let i = lines.line;
        let mut line = match line {
            Ok(line) => line,
            // A line of a JSON Lines or text file is a row: with `skip_bad_rows` it is skipped
            // like any bad row. A CSV header, or a line inside a quoted cell, is not.
            Err(e) if !csv || (header.is_some() && record.is_none()) => {
                push(Err(e))?;
                continue;
            }
            Err(e) => return Err(e),
        };
        match &kind {
            Lines::Json => {
                if !line.trim().is_empty() {
                    push(parse_object(&name, i, &line))?;
                }
            }
            Lines::Csv(sep) => {
                // A quoted cell may hold line breaks: a record goes on until its quotes balance.
                let quotes = if sep.quotes { line.bytes().filter(|b| *b == b'"').count() } else { 0 };
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
                    header = Some(split_csv(&line, sep));
                    continue;
                };
                if line.trim().is_empty() {
                    continue;
                }
                let cells = split_csv(&line, sep);
                if cells.len() != header.len() {
                    let help = match (sep.text.as_str(), sep.quotes) {
                        ("\t", _) => "quote cells that contain tabs: \"a<tab>b\"".to_string(),
                        (s, true) => format!("quote cells that contain `{s}`: \"a{s} b\""),
                        // pandas splits at a separator of several characters as at a pattern.
                        (s, false) => {
                            format!("a separator of several characters ignores quotes: no cell may hold `{s}`")
                        }
                    };
                    push(Err(DataError::bad_row(
                        &name,
                        start,
                        &line,
                        Some(0..line.len()),
                        format!("row has {} cells, the header has {}", cells.len(), header.len()),
                        Some(help),
                    )))?;
                    continue;
                }
                let fields = header.iter().cloned().zip(cells.into_iter().map(Value::String)).collect();
                push(Ok(Row { fields, file: name.clone(), line: start }))?;
            }
            Lines::Text { keep_linebreaks } => {
                if !line.trim().is_empty() {
                    if *keep_linebreaks && ended {
                        line.push('\n');
                    }
                    push(Ok(text_row(line, &name, i)))?;
                }
            }
        }
    }
    if let Some((start, text)) = record {
        return Err(unclosed_quote(&name, start, &text));
    }
    Ok(lines.read)
}

/// A line's text, or why it is not text.
type Line = Result<String, DataError>;

/// A file read line by line (one line in memory at a time).
struct LineReader {
    reader: std::io::BufReader<std::fs::File>,
    path: PathBuf,
    /// The line last read (1-based), and the bytes read so far.
    line: usize,
    read: u64,
}

impl LineReader {
    fn open(path: &Path) -> Result<LineReader, DataError> {
        let file =
            std::fs::File::open(path).map_err(|e| DataError::Io { path: path.display().to_string(), source: e })?;
        let reader = std::io::BufReader::with_capacity(1 << 20, file);
        Ok(LineReader { reader, path: path.to_path_buf(), line: 0, read: 0 })
    }

    /// The next line of file `name` without its `\n` or `\r\n` (a first line's byte order mark
    /// dropped: Excel's "CSV UTF-8" and some Windows editors start a file with one), as text or
    /// the error of a line that is not UTF-8, and whether it ended with a line break; None at
    /// the end. `progress` hears the bytes read every 4096 lines.
    fn next(&mut self, name: &str, progress: &mut dyn FnMut(u64)) -> Result<Option<(Line, bool)>, DataError> {
        let mut buf = Vec::new();
        let n = std::io::BufRead::read_until(&mut self.reader, b'\n', &mut buf)
            .map_err(|e| DataError::Io { path: self.path.display().to_string(), source: e })?;
        if n == 0 {
            return Ok(None);
        }
        self.line += 1;
        self.read += n as u64;
        if self.line.is_multiple_of(4096) {
            progress(self.read);
        }
        let ended = buf.last() == Some(&b'\n');
        while matches!(buf.last(), Some(b'\n' | b'\r')) {
            buf.pop();
        }
        let line = utf8(name, buf, self.line - 1).map(|mut line| {
            if self.line == 1 && line.starts_with(BOM) {
                line.drain(..BOM.len());
            }
            line
        });
        Ok(Some((line, ended)))
    }
}

/// How a line-by-line file reads: each line a JSON object, CSV records with this separator, or
/// text.
enum Lines {
    Json,
    Csv(Sep),
    Text { keep_linebreaks: bool },
}

/// A `text` row.
fn text_row(text: String, file: &str, line: usize) -> Row {
    Row { fields: Map::from_iter([("text".to_string(), Value::String(text))]), file: file.to_string(), line }
}

/// What a `.json` file holds, by its first value: an array; objects one per line (JSON Lines,
/// which datasets reads from `.json` files too); objects spread over lines (pretty-printed); or
/// something else.
enum JsonLayout {
    Array,
    Lines,
    Objects,
    Other,
}

fn json_layout(path: &Path) -> std::io::Result<JsonLayout> {
    use std::io::BufRead;
    let mut reader = std::io::BufReader::new(std::fs::File::open(path)?);
    let mut first = Vec::new();
    // The first non-blank line (bounded: a line this long is not JSON Lines' first object).
    while first.iter().all(u8::is_ascii_whitespace) {
        first.clear();
        if std::io::Read::take(&mut reader, 64 << 20).read_until(b'\n', &mut first)? == 0 {
            break;
        }
        if first.starts_with(BOM.as_bytes()) {
            first.drain(..BOM.len());
        }
    }
    Ok(match first.iter().find(|b| !b.is_ascii_whitespace()) {
        None | Some(b'[') => JsonLayout::Array,
        Some(b'{') if matches!(serde_json::from_slice::<Value>(&first), Ok(Value::Object(_))) => JsonLayout::Lines,
        Some(b'{') => JsonLayout::Objects,
        Some(_) => JsonLayout::Other,
    })
}

/// A `.json` file of objects one after another, spread over lines (pretty-printed): each object
/// is a row, reported at the line it starts on. A malformed object stops the read (the next
/// object cannot be found without it).
fn read_json_objects(path: &Path, name: &str, push: Push<'_>, progress: &mut dyn FnMut(u64)) -> Result<(), DataError> {
    use serde::Deserialize;
    use std::io::BufRead;
    let io = |e| DataError::Io { path: path.display().to_string(), source: e };
    let reader = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path).map_err(io)?);
    let mut counted = Counted { inner: reader, read: 0, progress, lines: 0 };
    if counted.inner.fill_buf().map_err(io)?.starts_with(BOM.as_bytes()) {
        counted.inner.consume(BOM.len());
    }
    loop {
        // Skip the blanks before the next object, counting lines.
        let next = loop {
            let buf = counted.inner.fill_buf().map_err(io)?;
            let Some(at) = buf.iter().position(|b| !b.is_ascii_whitespace()) else {
                if buf.is_empty() {
                    break None;
                }
                let (n, lines) = (buf.len(), buf.iter().filter(|b| **b == b'\n').count());
                counted.inner.consume(n);
                counted.lines += lines;
                continue;
            };
            let (b, lines) = (buf[at], buf[..at].iter().filter(|b| **b == b'\n').count());
            counted.inner.consume(at);
            counted.lines += lines;
            break Some(b);
        };
        let Some(b) = next else { return Ok(()) };
        let line = counted.lines + 1;
        let text = || read_line(path, line);
        if b != b'{' {
            let e = format!("expected a JSON object, found `{}`", b as char);
            return Err(DataError::bad_row(name, line, &text(), Some(0..1), e, None));
        }
        // An object's end needs no look-ahead: the deserializer stops at its `}`.
        let mut de = serde_json::Deserializer::from_reader(&mut counted);
        match Value::deserialize(&mut de) {
            Ok(Value::Object(fields)) => push(Ok(Row { fields, file: name.to_string(), line }))?,
            Ok(_) => unreachable!("a JSON value that starts with `{{` is an object"),
            Err(e) => return Err(json_error(name, path, e, line - 1)),
        }
    }
}

/// With a config's `field`: the file is one JSON object (read whole, as datasets does), and its
/// `field` holds the rows — a list of objects, a list of strings (`text` rows), or an object of
/// equal-length lists (columns). Item N is reported as "line" N.
fn read_json_field(path: &Path, name: &str, field: &str, push: Push<'_>) -> Result<(), DataError> {
    let io = |e| DataError::Io { path: path.display().to_string(), source: e };
    let bytes = std::fs::read(path).map_err(io)?;
    let text = bytes.strip_prefix(BOM.as_bytes()).unwrap_or(&bytes);
    let invalid = |message: String, help: &str| DataError::Invalid { message, help: Some(help.into()) };
    let help = "the dataset card's config reads the rows from this field of the file's one JSON object";
    let mut top = match serde_json::from_slice::<Value>(text) {
        Ok(Value::Object(top)) => top,
        Ok(other) => {
            return Err(invalid(
                format!("`{name}` is {}, not a JSON object with a field `{field}`", kind(&other)),
                help,
            ));
        }
        Err(e) => return Err(json_error(name, path, e, 0)),
    };
    let Some(rows) = top.remove(field) else {
        let has = top.keys().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ");
        return Err(invalid(format!("`{name}` has no field `{field}`; its fields are {has}"), help));
    };
    let items: Vec<Value> = match rows {
        Value::Array(items) => items,
        Value::Object(mut columns) => {
            let mut n = None;
            for (col, v) in &columns {
                let len = v.as_array().map(Vec::len);
                if len.is_none() || n.is_some_and(|n| Some(n) != len) {
                    let what = format!(
                        "`{name}`'s field `{field}` is an object, but its `{col}` is not a list as long as the others"
                    );
                    return Err(invalid(what, "an object of columns holds one equal-length list per column"));
                }
                n = len;
            }
            (0..n.unwrap_or(0))
                .map(|i| Value::Object(columns.iter_mut().map(|(c, v)| (c.clone(), v[i].take())).collect()))
                .collect()
        }
        other => {
            let what = format!("`{name}`'s field `{field}` is {}, not a list of rows", kind(&other));
            return Err(invalid(what, "the field holds a list of objects, a list of strings, or an object of columns"));
        }
    };
    for (i, item) in items.into_iter().enumerate() {
        push(item_row(name, i + 1, item))?;
    }
    Ok(())
}

/// Item `i` of a JSON list as a row: an object, or a string as a `text` row (datasets' "list of
/// strings").
fn item_row(name: &str, i: usize, item: Value) -> Result<Row, DataError> {
    match item {
        Value::Object(fields) => Ok(Row { fields, file: name.to_string(), line: i }),
        Value::String(text) => Ok(text_row(text, name, i)),
        other => Err(DataError::bad_row(name, i, &other.to_string(), None, format!("item {i} is not an object"), None)),
    }
}

/// A text file cut by paragraph (the text between `"\n\n"`, as Python's `str.split` cuts it, line
/// breaks read as `\n`) or whole, as datasets' text loader with `sample_by`; blank rows are
/// skipped. Paragraphs stream; a document is read whole.
fn read_text_samples(
    path: &Path,
    name: &str,
    by: SampleBy,
    push: Push<'_>,
    progress: &mut dyn FnMut(u64),
) -> Result<u64, DataError> {
    let mut lines = LineReader::open(path)?;
    let (mut text, mut start) = (String::new(), 1usize);
    let mut emit = |text: &str, start: usize| -> Result<(), DataError> {
        if text.trim().is_empty() { Ok(()) } else { push(Ok(text_row(text.to_string(), name, start))) }
    };
    while let Some((line, ended)) = lines.next(name, progress)? {
        let line = line?;
        text.push_str(&line.replace('\r', "\n"));
        if ended {
            text.push('\n');
        }
        if by == SampleBy::Paragraph {
            while let Some(at) = text.find("\n\n") {
                emit(&text[..at], start)?;
                start += text[..at + 2].matches('\n').count();
                text.drain(..at + 2);
            }
        }
    }
    emit(&text, start)?;
    Ok(lines.read)
}

/// Line `line` (1-based) of a file, bounded, for a snippet.
fn read_line(path: &Path, line: usize) -> String {
    use std::io::BufRead;
    std::fs::File::open(path)
        .ok()
        .and_then(|f| std::io::BufReader::new(f).split(b'\n').nth(line.saturating_sub(1)))
        .and_then(Result::ok)
        .map(|l| String::from_utf8_lossy(&l[..l.len().min(4096)]).trim_end_matches('\r').to_string())
        .unwrap_or_default()
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
    if reader.fill_buf().map_err(io)?.starts_with(BOM.as_bytes()) {
        reader.consume(BOM.len());
    }
    let mut de = serde_json::Deserializer::from_reader(Counted { inner: reader, read: 0, progress, lines: 0 });
    let mut stopped = None;
    let items = Items { name, push, stopped: &mut stopped };
    let result = serde::de::DeserializeSeed::deserialize(items, &mut de).and_then(|()| de.end());
    if let Some(e) = stopped {
        return Err(e);
    }
    result.map_err(|e| json_error(name, path, e, 0))
}

/// A reader that tells `progress` how far it has read, every 4 MiB, and counts the lines it has
/// read.
struct Counted<'p, R> {
    inner: R,
    read: u64,
    progress: &'p mut dyn FnMut(u64),
    lines: usize,
}

impl<R: std::io::Read> std::io::Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.lines += buf[..n].iter().filter(|b| **b == b'\n').count();
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
            if let Err(e) = (self.push)(item_row(self.name, i, item)) {
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

/// A JSON parse error located in its file, where the parsed text began after `before` lines:
/// the line is read back (bounded) for the snippet.
fn json_error(file: &str, path: &Path, e: serde_json::Error, before: usize) -> DataError {
    let line = before + e.line();
    let col = e.column().saturating_sub(1);
    DataError::bad_row(file, line, &read_line(path, line), Some(col..col + 1), format!("malformed JSON: {e}"), None)
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

/// Split one CSV record at `sep`, with RFC 4180 quoting (a quoted cell may hold line breaks)
/// where the separator has quotes.
fn split_csv(line: &str, sep: &Sep) -> Vec<String> {
    let (quotes, sep) = (sep.quotes, sep.text.as_str());
    if !quotes {
        return line.split(sep).map(str::to_string).collect();
    }
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if !quoted && rest.starts_with(sep) {
            out.push(std::mem::take(&mut cur));
            rest = &rest[sep.len()..];
            continue;
        }
        rest = &rest[c.len_utf8()..];
        match (c, quoted) {
            ('"', true) if rest.starts_with('"') => {
                cur.push('"');
                rest = &rest[1..];
            }
            ('"', _) => quoted = !quoted,
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
            &DataFiles::of(vec![path.clone()]),
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
        // Neither an array nor objects; trailing garbage after the array.
        for text in ["\"rows\"", "7", "[{\"a\": 1}] [2]"] {
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
            &DataFiles::of(vec![path.clone()]),
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

    /// A `.json` file of objects (as datasets reads it): JSON Lines, each a row at its line, a bad
    /// line a bad row; pretty-printed objects, each at the line it starts on, a malformed one
    /// located in the file.
    #[test]
    fn json_files_of_objects_read_as_lines_or_pretty_objects() {
        let (r, rows, _) = rows_of("{\"a\": 1}\n\n{\"a\": 2}\n{\"a\": ,}\n{\"a\": 4}\n", true);
        assert_eq!(r.unwrap().count, 1);
        assert_eq!(rows.iter().map(|r| r.line).collect::<Vec<_>>(), [1, 3, 5]);
        let (r, rows, _) = rows_of("\n{\n  \"a\": 1\n}\n\n{\n  \"a\": 2,\n  \"b\": {\"c\": 3}\n}", false);
        r.unwrap();
        assert_eq!(rows.iter().map(|r| r.line).collect::<Vec<_>>(), [2, 6]);
        assert_eq!(rows[1].fields["b"]["c"], 3);
        let (r, rows, _) = rows_of("{\n  \"a\": 1\n}\n{\n  \"a\": 2,,\n}\n", false);
        let e = r.unwrap_err();
        assert!(matches!(&e, DataError::BadRow { line: 5, .. }), "{e:?}");
        assert_eq!(rows.len(), 1);
        let (r, _, _) = rows_of("{\n  \"a\": 1\n}\n[2]", false);
        assert!(matches!(r.unwrap_err(), DataError::BadRow { line: 4, .. }));
    }

    /// A config's `field`: the rows of one object's field, or a clear error naming what is there.
    #[test]
    fn a_json_field_holds_rows_or_columns() {
        let field = |text: &str, field: &str| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("d.json");
            std::fs::write(&path, text).unwrap();
            let files = DataFiles {
                reading: Reading { field: Some(field.into()), ..Reading::default() },
                ..DataFiles::of(vec![path])
            };
            let mut rows = Vec::new();
            for_each_row(
                &files,
                false,
                &mut |r| {
                    rows.push(Value::Object(r.fields));
                    Ok(())
                },
                &mut |_| {},
            )
            .map(|_| rows)
            .map_err(|e| e.to_string())
        };
        let rows = field("{\"data\": {\"a\": [1, 2], \"b\": [\"x\", \"y\"]}}", "data").unwrap();
        assert_eq!(rows, [serde_json::json!({"a": 1, "b": "x"}), serde_json::json!({"a": 2, "b": "y"})]);
        let e = field("{\"data\": [], \"version\": 1}", "rows").unwrap_err();
        assert!(e.contains("has no field `rows`; its fields are `data`, `version`"), "{e}");
        let e = field("{\"data\": {\"a\": [1, 2], \"b\": [1]}}", "data").unwrap_err();
        assert!(e.contains("its `b` is not a list as long as the others"), "{e}");
        let e = field("[{\"a\": 1}]", "data").unwrap_err();
        assert!(e.contains("is an array, not a JSON object with a field `data`"), "{e}");
        let e = field("{\"data\": 7}", "data").unwrap_err();
        assert!(e.contains("is a number, not a list of rows"), "{e}");
    }

    #[test]
    fn csv_quotes() {
        let split_csv = |line: &str, sep: &str, quotes| split_csv(line, &Sep { text: sep.into(), quotes });
        assert_eq!(split_csv(r#"a,"b, c","say ""hi""""#, ",", true), ["a", "b, c", "say \"hi\""]);
        assert_eq!(split_csv("a::\"b::c\"::", "::", true), ["a", "b::c", ""]);
        assert_eq!(split_csv("a\t\"b\tc\"", "\t", true), ["a", "b\tc"]);
        assert_eq!(split_csv("a::\"b::c\"", "::", false), ["a", "\"b", "c\""]);
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
                &DataFiles::of(vec![path.clone()]),
                true,
                &mut |_| {
                    rows += 1;
                    Ok(())
                },
                &mut |_| {},
            )
            .unwrap();
            assert_eq!((rows, skipped.count), (2, 1), "{name}");
            let e = for_each_row(&DataFiles::of(vec![path.clone()]), false, &mut |_| Ok(()), &mut |_| {}).unwrap_err();
            assert!(
                matches!(&e, DataError::BadRow { line: 2 | 3, .. }) && e.to_string().contains("UTF-8"),
                "{name}: {e}"
            );
        }
        // A CSV header that is not UTF-8 stops the read whatever `skip_bad` says.
        let path = dir.path().join("h.csv");
        std::fs::write(&path, b"\xff\nx\n").unwrap();
        assert!(for_each_row(&DataFiles::of(vec![path.clone()]), true, &mut |_| Ok(()), &mut |_| {}).is_err());
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
