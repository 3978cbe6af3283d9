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
        /// What to do where the cause says (a full disk).
        #[help]
        help: Option<String>,
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

    /// Stage `stage` failed with `source`.
    pub fn stage(stage: &str, source: crate::stage::StageError) -> Error {
        let help = disk_full(&source).then(|| {
            "the disk is full: free space, or put the cache on a larger disk (`--cache-dir`, RTUNE_CACHE_DIR); \
             finished stages stay cached, and `rtune cache prune --keep RECIPE` removes what no recipe of yours uses"
                .to_string()
        });
        Error::Stage { stage: stage.to_string(), source, help }
    }

    pub fn io(message: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let message = message.into();
        move |source| Error::Io { message, source }
    }
}

/// Whether an I/O error in `e`'s chain of causes is a full disk (or quota).
fn disk_full(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| matches!(io.kind(), std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded))
        {
            return true;
        }
        cause = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_that_fills_the_disk_says_what_to_do() {
        // ENOSPC on Unix, ERROR_DISK_FULL on Windows: both are this kind.
        let full = std::io::Error::from(std::io::ErrorKind::StorageFull);
        let data = crate::data::DataError::Io { path: "train".into(), source: full };
        let Error::Stage { help, .. } = Error::stage("tokenize", data.into()) else { unreachable!() };
        assert!(help.is_some_and(|h| h.starts_with("the disk is full")));
        let other = crate::data::DataError::Io { path: "train".into(), source: std::io::ErrorKind::NotFound.into() };
        let Error::Stage { help, .. } = Error::stage("tokenize", other.into()) else { unreachable!() };
        assert!(help.is_none());
    }
}
