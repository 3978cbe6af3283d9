//! `train`: runs the training loop on the tokenize artifact.

use super::{StageCtx, StageError};
use crate::recipe::TrainSettings;
use crate::train::{TrainJob, train};

pub fn run(ctx: &StageCtx<'_>) -> Result<serde_json::Value, StageError> {
    let settings: TrainSettings = serde_json::from_value(ctx.stage.settings()["train"].clone())
        .map_err(|e| StageError::Internal(format!("resolved train settings: {e}")))?;
    let model_dir = ctx.input("model")?.join("model");
    let tokens_dir = ctx.input("tokens")?;
    let job = TrainJob {
        model_dir: &model_dir,
        tokens_dir: &tokens_dir,
        settings: &settings,
        adapter: &ctx.loaded.recipe.adapter,
        seed: ctx.seed(),
        device: ctx.device,
        tf32: ctx.loaded.recipe.device.tf32,
        work: ctx.work.clone(),
        out: ctx.out,
        ui: ctx.ui,
    };
    Ok(train(&job)?)
}
