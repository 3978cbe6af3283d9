//! Trained parameters as candle variables on the host side of an engine, with what a step does
//! to them: the step's accumulated gradients and loss, AdamW (as `torch.optim.AdamW` steps), the EMA, and
//! checkpoints' state. candle's engine and the fused CPU engine both keep theirs here, so both
//! step, save and resume exactly alike.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};

use super::{EngineError, EngineState};
use crate::model::ModelError;
use crate::model::lora::{LoraSpec, param_name};
use crate::rng::Rng;

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
        load_params(&self.list, &s.params, |_| true)?;
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

/// A trained parameter: its name in the checkpoint format and its variable.
#[derive(Debug, Clone)]
pub struct Param {
    pub name: String,
    pub var: Var,
}

/// Overwrite the `params` that `which` accepts with the values in `tensors`, each of which must
/// be there with its shape.
pub fn load_params(
    params: &[Param],
    tensors: &BTreeMap<String, Tensor>,
    which: impl Fn(&str) -> bool,
) -> std::result::Result<(), ModelError> {
    for p in params.iter().filter(|p| which(&p.name)) {
        let t = tensors.get(&p.name).ok_or_else(|| ModelError::MissingTensor { name: p.name.clone() })?;
        if t.dims() != p.var.dims() {
            return Err(ModelError::ShapeMismatch {
                name: p.name.clone(),
                expected: p.var.dims().to_vec(),
                found: t.dims().to_vec(),
            });
        }
        let t = t
            .to_dtype(p.var.dtype())
            .and_then(|t| t.to_device(p.var.device()))
            .map_err(ModelError::candle(format!("load `{}`", p.name)))?;
        p.var.set(&t).map_err(ModelError::candle(format!("load `{}`", p.name)))?;
    }
    Ok(())
}

/// A fresh adapter's two parameters, A ([`LoraSpec::init_a`]) and B (zero), for the linear layer
/// `prefix` (its Hugging Face name without `.weight`), named as PEFT names them in
/// `adapter_model.safetensors`.
pub fn new_adapter(
    spec: &LoraSpec,
    prefix: &str,
    (inp, out): (usize, usize),
    dtype: DType,
    device: &Device,
    rng: &mut Rng,
) -> candle_core::Result<[Param; 2]> {
    let a = Tensor::from_vec(spec.init_a(inp, rng), (spec.rank, inp), device)?.to_dtype(dtype)?;
    let b = Tensor::zeros((out, spec.rank), dtype, device)?;
    Ok([
        Param { name: param_name(prefix, "lora_A"), var: Var::from_tensor(&a)? },
        Param { name: param_name(prefix, "lora_B"), var: Var::from_tensor(&b)? },
    ])
}

/// AdamW (Loshchilov & Hutter, decoupled weight decay) exactly as `torch.optim.AdamW` steps,
/// its settings. The moments are in the open ([`AdamW`]) so checkpoints can save and restore
/// them (candle's optimizer keeps them private).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// First and second moments per parameter name, and the number of steps taken.
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub step: u64,
    pub m: BTreeMap<String, Tensor>,
    pub v: BTreeMap<String, Tensor>,
}

impl AdamW {
    pub fn new(cfg: AdamWConfig, params: &[Param]) -> candle_core::Result<AdamW> {
        let mut m = BTreeMap::new();
        let mut v = BTreeMap::new();
        for p in params {
            m.insert(p.name.clone(), Tensor::zeros(p.var.shape(), DType::F32, p.var.device())?);
            v.insert(p.name.clone(), Tensor::zeros(p.var.shape(), DType::F32, p.var.device())?);
        }
        Ok(AdamW { cfg, step: 0, m, v })
    }

    /// One update with learning rate `lr`; `grads` by parameter name (f32).
    pub fn step(&mut self, params: &[Param], grads: &BTreeMap<String, Tensor>, lr: f64) -> candle_core::Result<()> {
        self.step += 1;
        let c = self.cfg;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        for p in params {
            let Some(g) = grads.get(&p.name) else { continue };
            let m = self.m.get_mut(&p.name).expect("moment per parameter");
            let v = self.v.get_mut(&p.name).expect("moment per parameter");
            if p.var.device().is_cpu() && p.var.dtype() == DType::F32 && g.dtype() == DType::F32 {
                // One pass over plain buffers instead of a dozen tensor ops, each allocating.
                let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
                let (mut mv, mut vv, mut w, g) = (flat(m)?, flat(v)?, flat(p.var.as_tensor())?, flat(g)?);
                // Coefficients in f64, then rounded once (1 − 0.9f32 is not 0.1f32).
                let (b2, eps) = (c.beta2 as f32, c.eps as f32);
                let (one_minus_b1, one_minus_b2) = ((1.0 - c.beta1) as f32, (1.0 - c.beta2) as f32);
                let decay = (1.0 - lr * c.weight_decay) as f32;
                // In torch.optim.AdamW's order (m by lerp, step size lr / bc1, denominator √v / √bc2 + eps),
                // so the result is bit for bit torch's in f32.
                let (step_size, bc2_sqrt) = ((lr / bc1) as f32, bc2.sqrt() as f32);
                for (((w, m), v), g) in w.iter_mut().zip(&mut mv).zip(&mut vv).zip(&g) {
                    *w *= decay;
                    *m += (g - *m) * one_minus_b1;
                    *v = *v * b2 + g * g * one_minus_b2;
                    let denom = v.sqrt() / bc2_sqrt + eps;
                    *w += (*m / denom) * -step_size;
                }
                let shape = p.var.shape();
                *m = Tensor::from_vec(mv, shape, m.device())?;
                *v = Tensor::from_vec(vv, shape, v.device())?;
                p.var.set(&Tensor::from_vec(w, shape, p.var.device())?)?;
                continue;
            }
            *m = ((&*m * c.beta1)? + (g * (1.0 - c.beta1))?)?;
            *v = ((&*v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let w = p.var.as_tensor().to_dtype(DType::F32)?;
            let w = if c.weight_decay > 0.0 { (&w * (1.0 - lr * c.weight_decay))? } else { w };
            let denom = ((&*v / bc2)?.sqrt()? + c.eps)?;
            let update = ((&*m / bc1)? / denom)?;
            let w = (w - (update * lr)?)?;
            p.var.set(&w.to_dtype(p.var.dtype())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Two steps of torch.optim.AdamW(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    /// on w = [1.0, -2.0] with grads [0.5, -1.0] then [0.1, 0.2], computed with PyTorch 2.x.
    #[test]
    fn matches_torch_adamw() {
        let var = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
        let params = vec![Param { name: "w".into(), var: var.clone() }];
        let cfg = AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
        let mut opt = AdamW::new(cfg, &params).unwrap();
        for g in [[0.5f32, -1.0], [0.1, 0.2]] {
            let grads = BTreeMap::from([("w".to_string(), Tensor::new(&g, &Device::Cpu).unwrap())]);
            opt.step(&params, &grads, 0.1).unwrap();
        }
        let w: Vec<f32> = var.as_tensor().to_vec1().unwrap();
        let torch = [0.800_796_f32, -1.810_097_3];
        for (a, b) in w.iter().zip(torch) {
            assert!((a - b).abs() < 2e-7, "{w:?} vs torch {torch:?}");
        }
    }
}
