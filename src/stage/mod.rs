//! One executor per stage kind. Each reads its inputs' artifact folders, writes its output
//! into a staging folder, and returns metrics; the executor in [`crate::exec`] commits it.

mod download;
mod evaluate;
mod quantize;
mod tokenize;
mod train;
mod upload;

use std::path::{Path, PathBuf};

use crate::device::Resolution;
use crate::plan::PlannedStage;
use crate::recipe::{LoadedRecipe, Problem, StageKind};
use crate::store::Store;
use crate::ui::Ui;

/// Everything a stage executor may use.
pub struct StageCtx<'a> {
    pub loaded: &'a LoadedRecipe,
    /// Never use the network (`--offline`, `HF_HUB_OFFLINE`): how to run, not what is built.
    pub offline: bool,
    /// This stage as planned: its fingerprint and the document hashed for it (settings and
    /// inputs). Executors read other stages only through its input ports.
    pub stage: &'a PlannedStage,
    pub store: &'a Store,
    /// Where the stage writes its artifact (committed when it returns Ok).
    pub out: &'a Path,
    /// Resumable state, kept across interrupted runs of the same fingerprint.
    pub work: PathBuf,
    pub ui: &'a Ui,
    pub device: &'a Resolution,
    pub threads: usize,
}

impl StageCtx<'_> {
    /// The artifact folder of the stage that produced `port` for this stage.
    pub fn input(&self, port: &str) -> Result<PathBuf, StageError> {
        let fp = self.stage.input(port).ok_or_else(|| StageError::Internal(format!("stage has no `{port}` input")))?;
        Ok(self.store.artifact_dir(fp))
    }

    pub fn seed(&self) -> u64 {
        self.loaded.recipe.recipe.seed
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

/// Run one stage; returns its metrics.
pub fn run(ctx: &StageCtx<'_>) -> Result<serde_json::Value, StageError> {
    match ctx.stage.kind {
        StageKind::Download => download::run(ctx),
        StageKind::Tokenize => tokenize::run(ctx),
        StageKind::Train => train::run(ctx),
        StageKind::Evaluate => evaluate::run(ctx),
        // The planner rejects these before anything runs.
        StageKind::Quantize => quantize::run(ctx),
        StageKind::Upload => upload::run(ctx),
    }
}

/// `hashed` (a source, or the copy of one) must still have the digest the plan fingerprinted;
/// otherwise the source `shown` changed while rtune was running.
pub fn check_source(
    ctx: &StageCtx<'_>,
    hashed: &Path,
    shown: &str,
    planned: Option<&str>,
    at: &[&str],
) -> Result<(), StageError> {
    let digest = crate::fingerprint::digest_path(hashed)
        .map_err(StageError::io(format!("cannot hash `{}`", hashed.display())))?;
    if Some(digest.as_str()) != planned {
        return Err(Problem::new("rtune::source::changed", format!("`{shown}` changed while rtune was running"))
            .at(ctx.loaded.origin(at), "this source")
            .help("run again; the plan will fingerprint the new content")
            .into());
    }
    Ok(())
}

/// Write JSON to a file in a stage's output, pretty and newline-terminated.
pub fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), StageError> {
    let mut s = serde_json::to_string_pretty(v).expect("json serialises");
    s.push('\n');
    std::fs::write(path, s).map_err(StageError::io(format!("cannot write `{}`", path.display())))
}
