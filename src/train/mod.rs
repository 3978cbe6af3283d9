//! Training (in progress).
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
#[error("{0}")]
pub struct TrainError(pub String);
