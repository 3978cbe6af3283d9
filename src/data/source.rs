//! Dataset files to rows: JSON Lines, a JSON array of objects, CSV with a header, or plain text
//! (one row per non-empty line). A folder is read file by file in name order.

use std::path::Path;

use serde_json::{Map, Value};

use super::DataError;

/// One dataset row and where it came from.
#[derive(Debug, Clone)]
pub struct Row {
    pub fields: Map<String, Value>,
    /// File name (as shown in messages) and 1-based line.
    pub file: String,
    pub line: usize,
}

/// Read every row of a file or folder. A malformed row is an error, unless `skip_bad` is set,
/// in which case it is returned in the second list.
pub fn read_rows(path: &Path, skip_bad: bool) -> Result<(Vec<Row>, Vec<DataError>), DataError> {
    let mut files = Vec::new();
    if path.is_dir() {
        for rel in
            crate::store::walk(path).map_err(|e| DataError::Io { path: path.display().to_string(), source: e })?
        {
            let name = rel.to_string_lossy().to_string();
            if !name.starts_with('.') && supported(&name) {
                files.push(path.join(rel));
            }
        }
        if files.is_empty() {
            return Err(DataError::Invalid {
                message: format!("folder `{}` holds no dataset files", path.display()),
                help: Some("rtune reads .jsonl, .json, .csv and .txt files".into()),
            });
        }
    } else {
        files.push(path.to_path_buf());
    }
    let mut rows = Vec::new();
    let mut bad = Vec::new();
    for f in files {
        read_file(&f, skip_bad, &mut rows, &mut bad)?;
    }
    Ok((rows, bad))
}

fn supported(name: &str) -> bool {
    [".jsonl", ".json", ".csv", ".txt", ".parquet"].iter().any(|e| name.ends_with(e))
}

/// Parquet rows as JSON objects (lists and structs nest, as in `datasets`); row N of the file is
/// reported as "line" N.
fn read_parquet(path: &Path, name: &str, rows: &mut Vec<Row>) -> Result<(), DataError> {
    // The parquet crate asserts on some malformed metadata: a damaged file is an error here.
    let mut out = Vec::new();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read_parquet_inner(path, name, &mut out))) {
        Ok(r) => r?,
        Err(_) => {
            return Err(DataError::Invalid {
                message: format!("`{name}` is not a readable Parquet file: its metadata is damaged"),
                help: Some("re-export the file, or convert it to JSON Lines".into()),
            });
        }
    }
    rows.extend(out);
    Ok(())
}

fn read_parquet_inner(path: &Path, name: &str, rows: &mut Vec<Row>) -> Result<(), DataError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let bad = |e: parquet::errors::ParquetError| DataError::Invalid {
        message: format!("`{name}` is not a readable Parquet file: {e}"),
        help: Some("rtune reads Parquet with snappy, zstd, gzip or no compression".into()),
    };
    let file = std::fs::File::open(path).map_err(|e| DataError::Io { path: path.display().to_string(), source: e })?;
    let reader = SerializedFileReader::new(file).map_err(bad)?;
    for (i, row) in reader.get_row_iter(None).map_err(bad)?.enumerate() {
        match row.map_err(bad)?.to_json_value() {
            Value::Object(fields) => rows.push(Row { fields, file: name.to_string(), line: i + 1 }),
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

fn read_file(path: &Path, skip_bad: bool, rows: &mut Vec<Row>, bad: &mut Vec<DataError>) -> Result<(), DataError> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let ext = name.rsplit('.').next().unwrap_or_default().to_ascii_lowercase();
    if ext == "parquet" {
        return read_parquet(path, &name, rows);
    }
    let bytes = std::fs::read(path).map_err(|e| DataError::Io { path: path.display().to_string(), source: e })?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let line = 1 + e.as_bytes()[..e.utf8_error().valid_up_to()].iter().filter(|b| **b == b'\n').count();
        DataError::bad_row(&name, line, "", None, "the file is not valid UTF-8".into(), None)
    })?;
    let mut push = |r: Result<Row, DataError>| -> Result<(), DataError> {
        match r {
            Ok(row) => rows.push(row),
            Err(e) if skip_bad => bad.push(e),
            Err(e) => return Err(e),
        }
        Ok(())
    };
    match ext.as_str() {
        "jsonl" => {
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                push(parse_object(&name, i + 1, line))?;
            }
        }
        "json" => {
            let v: Value = serde_json::from_str(&text).map_err(|e| json_error(&name, &text, e))?;
            let Value::Array(items) = v else {
                return Err(DataError::Invalid {
                    message: format!("`{name}` is not a JSON array of objects"),
                    help: Some("write one object per line as .jsonl, or wrap the objects in [ … ]".into()),
                });
            };
            for (i, item) in items.into_iter().enumerate() {
                match item {
                    Value::Object(fields) => push(Ok(Row { fields, file: name.clone(), line: i + 1 }))?,
                    other => push(Err(DataError::bad_row(
                        &name,
                        i + 1,
                        &other.to_string(),
                        None,
                        format!("item {} is not an object", i + 1),
                        None,
                    )))?,
                }
            }
        }
        "csv" => {
            let mut lines = text.lines().enumerate();
            let header = match lines.next() {
                Some((_, h)) => split_csv(h),
                None => Vec::new(),
            };
            for (i, line) in lines {
                if line.trim().is_empty() {
                    continue;
                }
                let cells = split_csv(line);
                if cells.len() != header.len() {
                    push(Err(DataError::bad_row(
                        &name,
                        i + 1,
                        line,
                        Some(0..line.len()),
                        format!("row has {} cells, the header has {}", cells.len(), header.len()),
                        Some("quote cells that contain commas: \"a, b\"".into()),
                    )))?;
                    continue;
                }
                let fields = header.iter().cloned().zip(cells.into_iter().map(Value::String)).collect();
                push(Ok(Row { fields, file: name.clone(), line: i + 1 }))?;
            }
        }
        _ => {
            for (i, line) in text.lines().enumerate() {
                if !line.trim().is_empty() {
                    let fields = Map::from_iter([("text".to_string(), Value::String(line.to_string()))]);
                    push(Ok(Row { fields, file: name.clone(), line: i + 1 }))?;
                }
            }
        }
    }
    Ok(())
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

fn json_error(file: &str, text: &str, e: serde_json::Error) -> DataError {
    let line_text = text.lines().nth(e.line().saturating_sub(1)).unwrap_or_default();
    let col = e.column().saturating_sub(1);
    DataError::bad_row(file, e.line(), line_text, Some(col..col + 1), format!("malformed JSON: {e}"), None)
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

/// Split one CSV line (RFC 4180 quoting; no newlines inside cells).
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

    #[test]
    fn csv_quotes() {
        assert_eq!(split_csv(r#"a,"b, c","say ""hi""""#), ["a", "b, c", "say \"hi\""]);
    }
}
