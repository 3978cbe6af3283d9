//! AdamW (Loshchilov & Hutter, decoupled weight decay) exactly as `torch.optim.AdamW` steps,
//! with its moments in the open so checkpoints can save and restore them (candle's optimizer
//! keeps them private).

use std::collections::BTreeMap;

use candle_core::{DType, Result, Tensor};

use crate::model::Param;

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
    pub fn new(cfg: AdamWConfig, params: &[Param]) -> Result<AdamW> {
        let mut m = BTreeMap::new();
        let mut v = BTreeMap::new();
        for p in params {
            m.insert(p.name.clone(), Tensor::zeros(p.var.shape(), DType::F32, p.var.device())?);
            v.insert(p.name.clone(), Tensor::zeros(p.var.shape(), DType::F32, p.var.device())?);
        }
        Ok(AdamW { cfg, step: 0, m, v })
    }

    /// One update with learning rate `lr`; `grads` by parameter name (f32).
    pub fn step(&mut self, params: &[Param], grads: &BTreeMap<String, Tensor>, lr: f64) -> Result<()> {
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
