//! Data: reading dataset files into rows, rendering rows to tokens and loss masks per format,
//! splitting and packing, and the binary token store that training memory-maps.

pub mod chat;
pub mod format;
pub mod source;
pub mod tokens;

use std::sync::Arc;

use miette::{Diagnostic, LabeledSpan, NamedSource, SourceCode};

pub use format::{Encoded, Renderer};
pub use source::{Row, Skipped, for_each_row, read_rows, total_bytes};
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
        snippet: Option<(Arc<NamedSource<String>>, std::ops::Range<usize>)>,
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
    #[error("tokenizer failed while {context}")]
    Tokenizer {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Diagnostic for DataError {
    fn code<'a>(&'a self) -> Option<Box<dyn std::fmt::Display + 'a>> {
        Some(Box::new(match self {
            DataError::BadRow { .. } => "rtune::data::bad_row",
            DataError::Invalid { .. } => "rtune::data::invalid",
            DataError::Io { .. } | DataError::Write { .. } => "rtune::data::io",
            DataError::Tokenizer { .. } => "rtune::data::tokenizer",
        }))
    }

    fn help<'a>(&'a self) -> Option<Box<dyn std::fmt::Display + 'a>> {
        match self {
            DataError::BadRow { help, .. } | DataError::Invalid { help, .. } => {
                help.as_ref().map(|h| Box::new(h) as Box<dyn std::fmt::Display>)
            }
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

impl DataError {
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
            (Arc::new(NamedSource::new(format!("{file}:{line}"), shown.clone()).with_language("json")), start..end)
        });
        DataError::BadRow { file: file.into(), line, message, snippet, help }
    }
}
