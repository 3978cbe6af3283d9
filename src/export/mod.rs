//! Exports: what the quantize stage writes for the tools users load a model with, and the
//! checks each file passes before the stage keeps it.
//!
//! - [`merged`]: the tuned model merged one tensor at a time from the base and the train stage's
//!   output, written as a Hugging Face folder (and the source every GGUF is written from);
//! - [`gguf`]: llama.cpp's GGUF — the writer, its quantization types ([`gguf::quants`]), the
//!   SentencePiece and BPE tokenizer metadata, the importance-matrix file format, and a reader
//!   that computes a file as llama.cpp reads it;
//! - [`calibrate`]: the importance matrix the searched GGUF types are calibrated with;
//! - [`check`]: the read-back and self-checks (the merged folder bit for bit and against the
//!   adapter model; each GGUF's perplexity and top tokens against the adapter model's);
//! - [`tokenizer`]: the tokenizer files and chat template an exported folder carries;
//! - [`ollama`]: the Modelfile beside each GGUF, its chat template translated into Ollama's Go
//!   template syntax and checked by rendering both ([`gotemplate`]: Go's `text/template`, the part
//!   chat templates use).
//!
//! The PEFT adapter format is not here: it is what the train stage writes and every engine reads
//! back, so it lives with the model's other folders ([`crate::model::peft`]); nor is NF4, the
//! codec the engines compute QLoRA's base weights with ([`crate::model::nf4`]) — rtune writes no
//! NF4 file. The quantize stage ([`crate::stage`]) only orchestrates these.

pub mod calibrate;
pub mod check;
pub mod gguf;
pub mod gotemplate;
pub mod merged;
pub mod ollama;
pub mod tokenizer;

use crate::recipe::Problem;

/// Why an export could not be written or did not pass its checks (what failed to compute or to
/// be read or written is a [`crate::model::ModelError`]).
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum ExportError {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Problem(#[from] Problem),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Model(#[from] crate::model::ModelError),
    /// An export that does not read back as written, or a check that cannot be run as it should:
    /// a bug in rtune, never a file kept.
    #[error("internal error: {0}")]
    #[diagnostic(code(rtune::internal), help("this is a bug in rtune; please report it"))]
    Internal(String),
}
