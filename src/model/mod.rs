//! Model engine (in progress).
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
#[error("{0}")]
pub struct ModelError(pub String);
