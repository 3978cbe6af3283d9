//! One executor per stage kind. Each reads its inputs' artifact folders, writes its output
//! into a staging folder, and returns metrics; the executor in [`crate::exec`] commits it.

mod download;
mod encode;
mod evaluate;
pub(crate) use evaluate::eval_engine;
mod quantize;
mod tokenize;
mod train;
mod upload;

use std::path::{Path, PathBuf};

use crate::plan::key::{Inputs, Source};
use crate::plan::{PlannedStage, StageKey};
use crate::recipe::{Problem, Spans};
use crate::store::Store;
use crate::ui::Ui;

/// How a stage runs, and where. What it builds comes from its key (see [`crate::plan::key`]),
/// which is passed beside this and is all it gets from the recipe.
pub struct StageCtx<'a> {
    /// The stage's name in the recipe (for messages and error locations).
    pub name: &'a str,
    /// The fingerprint the artifact is built under.
    pub fingerprint: &'a str,
    /// The artifacts it reads, by port (fingerprinted).
    inputs: &'a Inputs,
    /// Where the recipe's values are written, for errors; no values.
    pub spans: Spans<'a>,
    /// Never use the network (`--offline`, `HF_HUB_OFFLINE`): how to run, not what is built.
    pub offline: bool,
    pub store: &'a Store,
    /// Where the stage writes its artifact (committed when it returns Ok).
    pub out: &'a Path,
    /// Resumable state, kept across interrupted runs of the same fingerprint.
    pub work: PathBuf,
    pub ui: &'a Ui,
}

impl<'a> StageCtx<'a> {
    pub fn new(
        stage: &'a PlannedStage,
        spans: Spans<'a>,
        offline: bool,
        store: &'a Store,
        out: &'a Path,
        ui: &'a Ui,
    ) -> StageCtx<'a> {
        StageCtx {
            name: &stage.name,
            fingerprint: &stage.fingerprint,
            inputs: &stage.inputs,
            spans,
            offline,
            store,
            out,
            work: store.work_dir(&stage.fingerprint),
            ui,
        }
    }

    /// The fingerprint of the artifact read at `port`.
    pub fn input_fingerprint(&self, port: &str) -> Result<&'a str, StageError> {
        self.inputs
            .get(port)
            .map(String::as_str)
            .ok_or_else(|| StageError::Internal(format!("stage has no `{port}` input")))
    }

    /// The artifact folder of the stage that produced `port` for this stage.
    pub fn input(&self, port: &str) -> Result<PathBuf, StageError> {
        Ok(self.store.artifact_dir(self.input_fingerprint(port)?))
    }

    /// The base model folder (the `model` input).
    pub fn model_dir(&self) -> Result<PathBuf, StageError> {
        Ok(self.input("model")?.join("model"))
    }

    /// Every input, by port.
    pub fn inputs(&self) -> &'a Inputs {
        self.inputs
    }
}

/// Why a stage failed.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum StageError {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Problem(#[from] Problem),
    #[error("{context}")]
    #[diagnostic(code(rtune::stage::compute))]
    Candle {
        context: String,
        #[source]
        source: candle_core::Error,
    },
    #[error("{context}")]
    #[diagnostic(code(rtune::stage::io))]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    #[diagnostic(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Data(#[from] crate::data::DataError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Train(#[from] crate::train::TrainError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Engine(#[from] crate::engine::EngineError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Export(#[from] crate::export::ExportError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Hub(#[from] crate::hub::HubError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Destination(#[from] crate::destination::DestinationError),
    #[error("internal error: {0}")]
    #[diagnostic(code(rtune::internal), help("this is a bug in rtune; please report it"))]
    Internal(String),
}

impl StageError {
    pub fn candle(context: impl Into<String>) -> impl FnOnce(candle_core::Error) -> StageError {
        let context = context.into();
        move |source| StageError::Candle { context, source }
    }

    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> StageError {
        let context = context.into();
        move |source| StageError::Io { context, source }
    }
}

/// Run one stage with its key; returns its metrics.
pub fn run(ctx: &StageCtx<'_>, key: &StageKey) -> Result<serde_json::Value, StageError> {
    match key {
        StageKey::Download(k) => download::run(ctx, k),
        StageKey::Tokenize(k) => tokenize::run(ctx, k),
        StageKey::Train(k) => train::run(ctx, k),
        StageKey::Evaluate(k) => evaluate::run(ctx, k),
        StageKey::Quantize(k) => quantize::run(ctx, k),
        StageKey::Upload(k) => upload::run(ctx, k),
    }
}

/// `hashed` (a local source, or the copy of one) must still have the digest the plan
/// fingerprinted; otherwise the source changed while rtune was running.
pub fn check_source(ctx: &StageCtx<'_>, hashed: &Path, source: &Source) -> Result<(), StageError> {
    let Source::Local { digest: planned, shown, at, .. } = source else {
        return Err(StageError::Internal("a Hub source has no local digest".into()));
    };
    let digest = crate::fingerprint::digest_path(hashed)
        .map_err(StageError::io(format!("cannot hash `{}`", hashed.display())))?;
    if &digest != planned {
        return Err(Problem::new("rtune::source::changed", format!("`{shown}` changed while rtune was running"))
            .at(ctx.spans.origin(at), "this source")
            .help("run again; the plan will fingerprint the new content")
            .into());
    }
    Ok(())
}

/// Write JSON to a file in a stage's output, pretty and newline-terminated.
pub fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), StageError> {
    crate::json::write_file(path, v).map_err(StageError::io(format!("cannot write `{}`", path.display())))
}
