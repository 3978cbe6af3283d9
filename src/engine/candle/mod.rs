//! The candle engine: the [`Transformer`] built from candle ops ([`model`], [`ops`], [`linear`]), trained with candle's autograd,
//! and rtune's AdamW over candle tensors ([`super::params`]). The reference every other engine is
//! checked against.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

pub mod linear;
pub mod model;
pub mod ops;

pub use model::{DecoderLayer, KvCache, Observer, Transformer};

use super::params::Params;
use super::{Engine, EngineError, EngineState, HostBatch, Setup};
use crate::model::Batch;
use crate::rng::Rng;

/// The parts of the architecture spec candle's model computes: all of them (it is the reference
/// the other engines are checked against).
pub const FEATURES: &[crate::model::arch::Feature] = &crate::model::arch::Feature::ALL;

pub struct CandleEngine {
    model: Transformer,
    params: Params,
    /// Generation: the ids the cache holds.
    cache: Option<(Vec<u32>, KvCache)>,
}

fn cerr(context: &str) -> impl FnOnce(candle_core::Error) -> EngineError + '_ {
    EngineError::candle(context)
}

impl CandleEngine {
    pub fn build(setup: &Setup<'_>) -> Result<CandleEngine, EngineError> {
        let device = setup.device.candle_device().map_err(cerr("cannot open the device"))?;
        let (weights, adapters) = super::start_weights(setup, &device)?;
        let mut rng = Rng::derive(setup.seed, "lora-init");
        let model = Transformer::with_dtype(
            &setup.folder.config,
            &weights,
            &setup.trainable,
            &mut rng,
            setup.device.candle_dtype(),
        )?;
        let trainable = &setup.trainable;
        if !trainable.weights.is_empty() && !model.params.iter().any(|p| trainable.trains_weight(&p.name)) {
            return Err(super::no_weight_matches(&trainable.weights));
        }
        if let (Some(_), Some(saved)) = (&trainable.lora, &adapters) {
            // (Base weights that train start from `weights`: the folder's where it saved them.)
            model.load_adapters(saved)?;
        }
        Ok(CandleEngine::new(model, setup.optimizer, setup.ema_decay))
    }

    /// Wrap a built model.
    pub fn new(
        model: Transformer,
        optimizer: Option<crate::engine::params::AdamWConfig>,
        ema: Option<f64>,
    ) -> CandleEngine {
        let params = Params::new(model.params.clone(), optimizer, ema);
        CandleEngine { model, params, cache: None }
    }

    pub fn model(&self) -> &Transformer {
        &self.model
    }

    fn candle_batch(&self, b: &HostBatch) -> Result<(Batch, Tensor, Tensor), EngineError> {
        let device = self.model.device();
        let batch = Batch::from_layout(&b.ids, b.b, b.t, &b.layout, device).map_err(cerr("build a batch"))?;
        let n = b.select.len();
        let select = Tensor::from_slice(&b.select, n, device).map_err(cerr("build a batch"))?;
        let targets = Tensor::from_slice(&b.targets, n, device).map_err(cerr("build a batch"))?;
        Ok((batch, select, targets))
    }
}

impl Engine for CandleEngine {
    fn describe(&self) -> String {
        "candle autograd".into()
    }

    fn trained_count(&self) -> usize {
        self.params.count()
    }

    fn accumulate(
        &mut self,
        b: &HostBatch,
        weight: f64,
        loss_scale: f64,
        dropout: Option<u64>,
    ) -> Result<(), EngineError> {
        let (batch, select, targets) = self.candle_batch(b)?;
        let loss = self.model.loss(&batch, &select, &targets, dropout).map_err(cerr("forward pass"))?;
        let scaled = (&loss * (weight * loss_scale)).map_err(cerr("scale the loss"))?;
        let g = scaled.backward().map_err(cerr("backward pass"))?;
        let grads = self
            .model
            .params
            .iter()
            .filter_map(|p| Some((p.name.clone(), g.get(p.var.as_tensor())?.clone())))
            .collect::<BTreeMap<_, _>>();
        let loss = loss.to_dtype(DType::F32).and_then(|l| l.to_scalar::<f32>()).map_err(cerr("read the loss"))?;
        self.params.add(loss as f64, weight, grads)
    }

    fn gradients(&mut self) -> Result<(f64, f64), EngineError> {
        self.params.gradients()
    }

    fn apply(&mut self, lr: f64, grad_scale: f64) -> Result<(), EngineError> {
        self.params.apply(lr, grad_scale)
    }

    fn discard(&mut self) -> Result<(), EngineError> {
        self.params.discard();
        Ok(())
    }

    fn loss(&mut self, b: &HostBatch) -> Result<f64, EngineError> {
        let (batch, select, targets) = self.candle_batch(b)?;
        self.model
            .loss(&batch, &select, &targets, None)
            .and_then(|l| l.to_dtype(DType::F32))
            .and_then(|l| l.to_scalar::<f32>())
            .map(f64::from)
            .map_err(cerr("evaluate"))
    }

    fn next_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        let (done, mut cache) = match self.cache.take() {
            Some((seen, cache)) if ids.len() > seen.len() && ids.starts_with(&seen) => (seen.len(), cache),
            _ => (0, KvCache::default()),
        };
        let logits = self.model.step(&ids[done..], &mut cache).map_err(cerr("generate"))?;
        self.cache = Some((ids.to_vec(), cache));
        logits.to_vec1::<f32>().map_err(cerr("generate"))
    }

    fn state(&self) -> Result<EngineState, EngineError> {
        self.params.state()
    }

    fn restore(&mut self, s: &EngineState) -> Result<(), EngineError> {
        let device = self.model.device().clone();
        self.params.restore(s, &device)
    }

    fn gradient_values(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        Ok(self.params.gradient_values())
    }

    fn trained(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        self.params.trained()
    }
}
