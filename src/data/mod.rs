//! Data: reading dataset files into rows, rendering rows to tokens and loss masks per format,
//! splitting and packing, and the binary token store that training memory-maps.

pub mod chat;
pub mod configs;
pub mod format;
pub mod pyjson;
pub mod source;
pub mod splits;
pub mod tokens;

use std::sync::Arc;

use miette::{Diagnostic, LabeledSpan, MietteError, MietteSpanContents, SourceCode, SourceSpan, SpanContents};

pub use format::{Encoded, Renderer};
pub use source::{DataFiles, Row, Skipped, data_files, for_each_row, read_rows, total_bytes};
pub use tokens::{TokenStore, TokenWriter};

/// A problem with the data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A row that cannot be used, located by file and line.
    #[error("{file}:{line}: {message}")]
    BadRow {
        file: String,
        line: usize,
        message: String,
        /// The offending line and the byte span in it to underline.
        snippet: Option<(Arc<LineSource>, std::ops::Range<usize>)>,
        help: Option<String>,
    },
    #[error("{message}")]
    Invalid { message: String, help: Option<String> },
    #[error("cannot read `{path}`")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write `{path}`")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A dataset folder whose files do not name the split asked for.
    #[error("the dataset's files name no split `{split}`{}", found_splits(found))]
    NoSplit { split: String, found: splits::Splits },
    #[error("tokenizer failed while {context}")]
    Tokenizer {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Diagnostic for DataError {
    fn code<'a>(&'a self) -> Option<Box<dyn std::fmt::Display + 'a>> {
        Some(Box::new(self.code_name()))
    }

    fn help<'a>(&'a self) -> Option<Box<dyn std::fmt::Display + 'a>> {
        match self {
            DataError::BadRow { help, .. } | DataError::Invalid { help, .. } => {
                help.as_ref().map(|h| Box::new(h) as Box<dyn std::fmt::Display>)
            }
            DataError::NoSplit { .. } => Some(Box::new(source::SPLIT_NAMES)),
            _ => None,
        }
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        match self {
            DataError::BadRow { snippet: Some((src, _)), .. } => Some(src.as_ref() as &dyn SourceCode),
            _ => None,
        }
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        match self {
            DataError::BadRow { snippet: Some((_, span)), .. } => Some(Box::new(std::iter::once(LabeledSpan::new(
                Some("here".into()),
                span.start,
                span.end.saturating_sub(span.start),
            )))),
            _ => None,
        }
    }
}

/// `: they name `test` (1 file)`, or nothing when the files name no split at all.
fn found_splits(found: &splits::Splits) -> String {
    if found.is_empty() { String::new() } else { format!(": they name {}", splits::describe(found)) }
}

impl DataError {
    /// The diagnostic code (also of a recipe problem made of it, `source::located`).
    pub fn code_name(&self) -> &'static str {
        match self {
            DataError::BadRow { .. } => "rtune::data::bad_row",
            DataError::Invalid { .. } => "rtune::data::invalid",
            DataError::Io { .. } | DataError::Write { .. } => "rtune::data::io",
            DataError::Tokenizer { .. } => "rtune::data::tokenizer",
            DataError::NoSplit { .. } => "rtune::data::no_split",
        }
    }

    /// A bad row, showing (at most 200 characters of) the line it is on.
    pub fn bad_row(
        file: &str,
        line: usize,
        text: &str,
        span: Option<std::ops::Range<usize>>,
        message: String,
        help: Option<String>,
    ) -> DataError {
        let shown: String = text.chars().take(200).collect();
        let snippet = span.map(|s| {
            let end = s.end.min(shown.len());
            let start = s.start.min(end);
            (Arc::new(LineSource { name: file.to_string(), text: shown.clone(), line }), start..end)
        });
        DataError::BadRow { file: file.into(), line, message, snippet, help }
    }
}

/// One line of a data file as a diagnostic's source, shown with its number in the file (`[a.jsonl:57:30]`
/// and `57 │` in the margin): a snippet alone would be numbered line 1.
#[derive(Debug)]
pub struct LineSource {
    name: String,
    text: String,
    /// 1-based.
    line: usize,
}

impl SourceCode for LineSource {
    fn read_span<'a>(
        &'a self,
        span: &SourceSpan,
        before: usize,
        after: usize,
    ) -> Result<Box<dyn SpanContents<'a> + 'a>, MietteError> {
        let inner = self.text.read_span(span, before, after)?;
        Ok(Box::new(
            MietteSpanContents::new_named(
                self.name.clone(),
                inner.data(),
                *inner.span(),
                inner.line() + self.line.saturating_sub(1),
                inner.column(),
                inner.line_count(),
            )
            .with_language("json"),
        ))
    }
}
