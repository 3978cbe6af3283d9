//! `train`: runs the training loop on the tokenize artifact.

use super::{StageCtx, StageError};
use crate::plan::key::TrainKey;
use crate::train::{TrainJob, train};

pub fn run(ctx: &StageCtx<'_>, key: &TrainKey) -> Result<serde_json::Value, StageError> {
    let model_dir = ctx.model_dir()?;
    let tokens_dir = ctx.input("tokens")?;
    let device = key.device.resolution();
    let job = TrainJob {
        model_dir: &model_dir,
        tokens_dir: &tokens_dir,
        settings: &key.settings.train,
        adapter: &key.settings.adapter,
        seed: key.settings.seed,
        device: &device,
        tf32: key.device.tf32,
        engine: key.device.engine.as_deref(),
        work: ctx.work.clone(),
        out: ctx.out,
        ui: ctx.ui,
    };
    Ok(train(&job)?)
}
