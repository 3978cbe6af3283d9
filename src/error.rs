//! The top-level error of a command, and its exit code.

use miette::Diagnostic;

use crate::recipe::{LoadError, Problem};

/// Exit codes: 0 ok, 1 invalid recipe or input, 2 usage, 3 a stage failed, 4 lock mismatch,
/// 130 interrupted.
#[derive(Debug, thiserror::Error, Diagnostic)]
pub enum Error {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Problem(#[from] Problem),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Lock(#[from] crate::plan::lockfile::LockError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Hub(#[from] crate::hub::HubError),
    #[error("stage `{stage}` failed")]
    #[diagnostic(code(rtune::stage::failed))]
    Stage {
        stage: String,
        #[source]
        #[diagnostic_source]
        source: crate::stage::StageError,
    },
    #[error("`{path}` does not match this plan (`--locked`)")]
    #[diagnostic(code(rtune::lock::mismatch), help("run without `--locked` to update the lock file, and commit it"))]
    LockMismatch {
        path: String,
        #[related]
        changes: Vec<Problem>,
    },
    #[error("interrupted before the next stage started")]
    #[diagnostic(code(rtune::interrupted), help("finished stages are cached; run the same command again to continue"))]
    Interrupted,
    #[error("{message}")]
    #[diagnostic(code(rtune::io))]
    Io {
        message: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Load(_) | Error::Problem(_) | Error::Lock(_) | Error::Io { .. } => 1,
            Error::Hub(crate::hub::HubError::BadRepoId { .. } | crate::hub::HubError::BadRevision { .. }) => 1,
            Error::Hub(_) => 3,
            Error::Stage {
                source: crate::stage::StageError::Train(crate::train::TrainError::Interrupted { .. }),
                ..
            }
            | Error::Interrupted => 130,
            Error::Store(_) | Error::Stage { .. } => 3,
            Error::LockMismatch { .. } => 4,
        }
    }

    pub fn io(message: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let message = message.into();
        move |source| Error::Io { message, source }
    }
}
