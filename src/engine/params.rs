//! Trained parameters as candle variables on the host side of an engine, with what a step does
//! to them: the step's accumulated gradients and loss, AdamW ([`super::optim`]), the EMA, and
//! checkpoints' state. candle's engine and the fused CPU engine both keep theirs here, so both
//! step, save and resume exactly alike.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};

use super::optim::{AdamW, AdamWConfig};
use super::{EngineError, EngineState};
use crate::model::Param;

fn cerr(context: &str) -> impl FnOnce(candle_core::Error) -> EngineError + '_ {
    EngineError::candle(context)
}

fn missing(name: &str, what: &str) -> EngineError {
    EngineError::Unsupported(format!("the checkpoint has no {what} for `{name}`"))
}

/// Trained parameters with their optimizer, EMA and the step's gradients.
pub struct Params {
    pub list: Vec<Param>,
    opt: Option<AdamW>,
    ema: Option<(f64, BTreeMap<String, Tensor>)>,
    /// The step's gradients so far (f32) and weighted loss.
    grads: BTreeMap<String, Tensor>,
    loss: f64,
}

impl Params {
    /// `list`, with AdamW where `optimizer` is given (training) and an EMA of decay `ema`.
    pub fn new(list: Vec<Param>, optimizer: Option<AdamWConfig>, ema: Option<f64>) -> Params {
        let opt = optimizer.map(|c| AdamW::new(c, &list).expect("zero moments"));
        let ema = ema.map(|d| (d, values(&list)));
        Params { list, opt, ema, grads: BTreeMap::new(), loss: 0.0 }
    }

    /// Trained values.
    pub fn count(&self) -> usize {
        self.list.iter().map(|p| p.var.elem_count()).sum()
    }

    /// Add a micro-batch's `weight × loss` and its gradients `g` (by parameter name).
    pub fn add(&mut self, loss: f64, weight: f64, g: BTreeMap<String, Tensor>) -> Result<(), EngineError> {
        self.loss += loss * weight;
        for p in &self.list {
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

    /// [`super::Engine::gradients`].
    pub fn gradients(&self) -> Result<(f64, f64), EngineError> {
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

    /// [`super::Engine::apply`].
    pub fn apply(&mut self, lr: f64, grad_scale: f64) -> Result<(), EngineError> {
        if grad_scale != 1.0 {
            for g in self.grads.values_mut() {
                *g = (&*g * grad_scale).map_err(cerr("clip gradients"))?;
            }
        }
        let opt =
            self.opt.as_mut().ok_or_else(|| EngineError::Unsupported("this engine was built for evaluation".into()))?;
        opt.step(&self.list, &self.grads, lr).map_err(cerr("optimizer step"))?;
        if let Some((decay, ema)) = &mut self.ema {
            for p in &self.list {
                let cur = p.var.as_tensor();
                let e = ema.get_mut(&p.name).expect("ema per parameter");
                *e = ((&*e * *decay).and_then(|a| a + (cur * (1.0 - *decay))?)).map_err(cerr("update EMA"))?;
            }
        }
        self.discard();
        Ok(())
    }

    /// [`super::Engine::discard`].
    pub fn discard(&mut self) {
        self.grads.clear();
        self.loss = 0.0;
    }

    /// [`super::Engine::state`].
    pub fn state(&self) -> Result<EngineState, EngineError> {
        let opt = self.opt.as_ref().ok_or_else(|| EngineError::Unsupported("no optimizer state".into()))?;
        Ok(EngineState {
            params: values(&self.list),
            ema: self.ema.as_ref().map(|e| e.1.clone()),
            m: opt.m.clone(),
            v: opt.v.clone(),
            optimizer_step: opt.step,
        })
    }

    /// [`super::Engine::restore`], the parameters on `device`.
    pub fn restore(&mut self, s: &EngineState, device: &Device) -> Result<(), EngineError> {
        crate::model::lora::load_params(&self.list, &s.params, |_| true)?;
        let on = |t: &Tensor| t.to_dtype(DType::F32).and_then(|t| t.to_device(device));
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

    /// [`super::Engine::gradient_values`].
    pub fn gradient_values(&self) -> BTreeMap<String, Tensor> {
        self.grads.clone()
    }

    /// [`super::Engine::trained`]: the EMA weights when kept, else the parameters, f32 on the host.
    pub fn trained(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        let values = match &self.ema {
            Some((_, e)) => e.clone(),
            None => values(&self.list),
        };
        values
            .into_iter()
            .map(|(k, v)| {
                let v = v.to_dtype(DType::F32).and_then(|v| v.to_device(&Device::Cpu));
                Ok((k, v.map_err(cerr("read parameters"))?))
            })
            .collect()
    }
}

/// Current values of `params`, by name.
fn values(params: &[Param]) -> BTreeMap<String, Tensor> {
    params.iter().map(|p| (p.name.clone(), p.var.as_tensor().detach())).collect()
}
