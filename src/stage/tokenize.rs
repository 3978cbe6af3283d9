use super::{StageCtx, StageError};
pub fn run(_ctx: &StageCtx<'_>) -> Result<serde_json::Value, StageError> {
    Err(StageError::Internal("tokenize: in progress".into()))
}
