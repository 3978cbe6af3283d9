//! The candle engine: the [`Transformer`] built from candle ops, trained with candle's
//! autograd — or, on the CPU in f32 with LoRA, with the fused CPU engine
//! ([`crate::engine::fused`]) computing the same loss and gradients — and rtune's AdamW over
//! candle tensors.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};

use super::{Engine, EngineError, EngineState, HostBatch, Setup};
use crate::engine::optim::AdamW;
use crate::model::{Batch, KvCache, Transformer, nf4};
use crate::rng::Rng;

/// The parts of the architecture spec candle's model computes: all of them (it is the reference
/// the other engines are checked against).
pub const FEATURES: &[crate::model::arch::Feature] = &crate::model::arch::Feature::ALL;

pub struct CandleEngine {
    model: Transformer,
    fused: bool,
    opt: Option<AdamW>,
    ema: Option<(f64, BTreeMap<String, Tensor>)>,
    /// The step's gradients so far (f32) and weighted loss.
    grads: BTreeMap<String, Tensor>,
    loss: f64,
    /// Generation: the ids the cache holds.
    cache: Option<(Vec<u32>, KvCache)>,
}

fn missing(name: &str, what: &str) -> EngineError {
    EngineError::Unsupported(format!("the checkpoint has no {what} for `{name}`"))
}

fn cerr(context: &str) -> impl FnOnce(candle_core::Error) -> EngineError + '_ {
    EngineError::candle(context)
}

impl CandleEngine {
    pub fn build(setup: &Setup<'_>, fused: bool) -> Result<CandleEngine, EngineError> {
        let device = setup.device.candle_device().map_err(cerr("cannot open the device"))?;
        // The base weights in f32 (trained master weights start exact), with those the train
        // stage's output replaces in their place.
        let trained = match setup.trained {
            Some(dir) => crate::model::read_trained(dir, &device)?,
            None => Default::default(),
        };
        let mut weights = setup.folder.load_weights(&device, DType::F32)?;
        // A 4-bit base: the values it stands for, dequantized (the math of the GPU engine's
        // packed weights, without their memory saving).
        for (name, w) in weights.iter_mut() {
            if let Some(quant) = nf4::stored(setup.base_quant, &setup.trainable, name)? {
                let v: Vec<f32> = w.flatten_all().and_then(|t| t.to_vec1()).map_err(cerr("read a weight"))?;
                let v = nf4::round_trip(&v, quant);
                *w = Tensor::from_vec(v, w.dims(), &device).map_err(cerr("dequantize a weight"))?;
            }
        }
        weights.extend(trained.base);
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
        if let (Some(_), Some(saved)) = (&trainable.lora, &trained.adapters) {
            // (Base weights that train start from `weights`: the folder's where it saved them.)
            model.load_adapters(saved)?;
        }
        Ok(CandleEngine::new(model, fused, setup.optimizer, setup.ema_decay))
    }

    /// Wrap a built model (`fused`: compute with the fused CPU engine).
    pub fn new(
        model: Transformer,
        fused: bool,
        optimizer: Option<crate::engine::optim::AdamWConfig>,
        ema: Option<f64>,
    ) -> CandleEngine {
        let opt = optimizer.map(|c| AdamW::new(c, &model.params).expect("zero moments"));
        let ema = ema.map(|d| (d, model.param_values()));
        CandleEngine { model, fused, opt, ema, grads: BTreeMap::new(), loss: 0.0, cache: None }
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
        if self.fused { "fused CPU engine".into() } else { "candle autograd".into() }
    }

    fn trained_count(&self) -> usize {
        self.model.params.iter().map(|p| p.var.elem_count()).sum()
    }

    fn accumulate(
        &mut self,
        b: &HostBatch,
        weight: f64,
        loss_scale: f64,
        dropout: Option<u64>,
    ) -> Result<(), EngineError> {
        let (batch, select, targets) = self.candle_batch(b)?;
        let grad_weight = weight * loss_scale;
        let (loss, g) = if self.fused {
            crate::engine::fused::loss_and_grads(
                &self.model,
                &batch,
                &b.select,
                &b.targets,
                grad_weight as f32,
                dropout,
            )
            .map_err(cerr("forward and backward pass"))?
        } else {
            let loss = self.model.loss(&batch, &select, &targets, dropout).map_err(cerr("forward pass"))?;
            let scaled = (&loss * grad_weight).map_err(cerr("scale the loss"))?;
            let g = scaled.backward().map_err(cerr("backward pass"))?;
            let grads = self
                .model
                .params
                .iter()
                .filter_map(|p| Some((p.name.clone(), g.get(p.var.as_tensor())?.clone())))
                .collect::<BTreeMap<_, _>>();
            (loss.to_dtype(DType::F32).and_then(|l| l.to_scalar::<f32>()).map_err(cerr("read the loss"))? as f64, grads)
        };
        self.loss += loss * weight;
        for p in &self.model.params {
            if let Some(pg) = g.get(&p.name) {
                let pg = pg.to_dtype(DType::F32).map_err(cerr("gradient"))?;
                let acc = match self.grads.remove(&p.name) {
                    Some(a) => (a + pg).map_err(cerr("accumulate gradients"))?,
                    None => pg,
                };
                self.grads.insert(p.name.clone(), acc);
            }
        }
        Ok(())
    }

    fn gradients(&mut self) -> Result<(f64, f64), EngineError> {
        // One sum on the device and one read, not a read per parameter.
        let mut total: Option<Tensor> = None;
        for g in self.grads.values() {
            let s = g.sqr().and_then(|x| x.sum_all()).map_err(cerr("gradient norm"))?;
            total = Some(match total {
                Some(t) => (t + s).map_err(cerr("gradient norm"))?,
                None => s,
            });
        }
        let norm_sq = match total {
            Some(t) => t.to_scalar::<f32>().map_err(cerr("gradient norm"))? as f64,
            None => 0.0,
        };
        Ok((self.loss, norm_sq.sqrt()))
    }

    fn apply(&mut self, lr: f64, grad_scale: f64) -> Result<(), EngineError> {
        if grad_scale != 1.0 {
            for g in self.grads.values_mut() {
                *g = (&*g * grad_scale).map_err(cerr("clip gradients"))?;
            }
        }
        let opt =
            self.opt.as_mut().ok_or_else(|| EngineError::Unsupported("this engine was built for evaluation".into()))?;
        opt.step(&self.model.params, &self.grads, lr).map_err(cerr("optimizer step"))?;
        if let Some((decay, ema)) = &mut self.ema {
            for p in &self.model.params {
                let cur = p.var.as_tensor();
                let e = ema.get_mut(&p.name).expect("ema per parameter");
                *e = ((&*e * *decay).and_then(|a| a + (cur * (1.0 - *decay))?)).map_err(cerr("update EMA"))?;
            }
        }
        self.discard()
    }

    fn discard(&mut self) -> Result<(), EngineError> {
        self.grads.clear();
        self.loss = 0.0;
        Ok(())
    }

    fn loss(&mut self, b: &HostBatch) -> Result<f64, EngineError> {
        let (batch, select, targets) = self.candle_batch(b)?;
        if self.fused {
            return crate::engine::fused::loss(&self.model, &batch, &b.select, &b.targets).map_err(cerr("evaluate"));
        }
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
        let opt = self.opt.as_ref().ok_or_else(|| EngineError::Unsupported("no optimizer state".into()))?;
        Ok(EngineState {
            params: self.model.param_values(),
            ema: self.ema.as_ref().map(|e| e.1.clone()),
            m: opt.m.clone(),
            v: opt.v.clone(),
            optimizer_step: opt.step,
        })
    }

    fn restore(&mut self, s: &EngineState) -> Result<(), EngineError> {
        self.model.load_params(&s.params)?;
        let device = self.model.device().clone();
        let on = |t: &Tensor| t.to_dtype(DType::F32).and_then(|t| t.to_device(&device));
        if let Some(opt) = self.opt.as_mut() {
            for (saved, moments) in [(&s.m, &mut opt.m), (&s.v, &mut opt.v)] {
                for (k, v) in moments.iter_mut() {
                    let t = saved.get(k).ok_or_else(|| missing(k, "optimizer state"))?;
                    *v = on(t).map_err(cerr("restore optimizer state"))?;
                }
            }
            opt.step = s.optimizer_step;
        }
        if let (Some((_, ema)), Some(saved)) = (self.ema.as_mut(), s.ema.as_ref()) {
            for (k, v) in ema.iter_mut() {
                let t = saved.get(k).ok_or_else(|| missing(k, "EMA value"))?;
                *v = on(t).map_err(cerr("restore EMA"))?;
            }
        }
        Ok(())
    }

    fn gradient_values(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        Ok(self.grads.clone())
    }

    fn trained(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        let values = match &self.ema {
            Some((_, e)) => e.clone(),
            None => self.model.param_values(),
        };
        values
            .into_iter()
            .map(|(k, v)| {
                Ok((
                    k,
                    v.to_dtype(DType::F32).and_then(|v| v.to_device(&Device::Cpu)).map_err(cerr("read parameters"))?,
                ))
            })
            .collect()
    }
}
