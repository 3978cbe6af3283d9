//! Linear layers with optional LoRA adapters (Hu et al. 2021, as PEFT implements them):
//! `y = x Wᵀ + b + (alpha / r) · dropout(x) Aᵀ Bᵀ`, A `[r, in]` Kaiming-uniform, B `[out, r]` zero.

use candle_core::{DType, Device, Result, Tensor, Var};

use super::transformer::Param;
use crate::rng::Rng;

/// Where adapters go and how they are shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Module names: `q_proj`, …, `lm_head`.
    pub targets: Vec<String>,
}

impl LoraSpec {
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// A fresh adapter for the linear layer `prefix` (HF name without `.weight`), named as PEFT
    /// names it in `adapter_model.safetensors`.
    pub fn create(
        &self,
        prefix: &str,
        inp: usize,
        out: usize,
        dtype: DType,
        device: &Device,
        rng: &mut Rng,
    ) -> Result<(Lora, Vec<Param>)> {
        // kaiming_uniform_(a=sqrt(5)) on [r, in]: bound = 1/sqrt(in).
        let bound = 1.0 / (inp as f64).sqrt();
        let a: Vec<f32> = (0..self.rank * inp).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect();
        let a = Var::from_tensor(&Tensor::from_vec(a, (self.rank, inp), device)?.to_dtype(dtype)?)?;
        let b = Var::from_tensor(&Tensor::zeros((out, self.rank), dtype, device)?)?;
        let params = vec![
            Param { name: param_name(prefix, "lora_A"), var: a.clone() },
            Param { name: param_name(prefix, "lora_B"), var: b.clone() },
        ];
        Ok((
            Lora { a: a.as_tensor().clone(), b: b.as_tensor().clone(), scale: self.scale(), dropout: self.dropout },
            params,
        ))
    }
}

/// PEFT's name for adapter matrix `which` (`lora_A`, `lora_B`) of the linear layer `prefix`.
pub fn param_name(prefix: &str, which: &str) -> String {
    format!("base_model.model.{prefix}.{which}.weight")
}

#[derive(Debug, Clone)]
pub struct Lora {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
    pub dropout: f64,
}

#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    pub lora: Option<Lora>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Linear {
        Linear { weight, bias, lora: None }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Forward over `[..., in]`; `dropout` is the training RNG (None: evaluation).
    pub fn forward_t(&self, x: &Tensor, dropout: Option<&mut Rng>) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let inp = *dims.last().expect("input has a feature dimension");
        let x2 = x.reshape(((), inp))?;
        let frozen_op = FROZEN_MATMUL.load(std::sync::atomic::Ordering::Relaxed);
        let mut y = if frozen_op && !self.weight.is_variable() && x2.device().is_cpu() {
            x2.apply_op1(FrozenMatmul { wt: self.weight.t()? })?
        } else {
            x2.matmul(&self.weight.to_dtype(x2.dtype())?.t()?)?
        };
        if let Some(b) = &self.bias {
            y = y.broadcast_add(&b.to_dtype(y.dtype())?)?;
        }
        if let Some(l) = &self.lora {
            let xin = match dropout {
                Some(rng) if l.dropout > 0.0 => dropout_mask(&x2, l.dropout, rng)?,
                _ => x2.clone(),
            };
            let dt = xin.dtype();
            let delta = xin.matmul(&l.a.to_dtype(dt)?.t()?)?.matmul(&l.b.to_dtype(dt)?.t()?)?;
            y = (y + (delta * l.scale)?)?;
        }
        let mut out_dims = dims;
        *out_dims.last_mut().expect("non-empty") = y.dim(1)?;
        y.reshape(out_dims)
    }

    /// `W + scale · B A` (the merged weight), computed in f32.
    pub fn merged_weight(&self) -> Result<Tensor> {
        match &self.lora {
            None => Ok(self.weight.clone()),
            Some(l) => {
                let w = self.weight.to_dtype(DType::F32)?;
                let ba = l.b.to_dtype(DType::F32)?.matmul(&l.a.to_dtype(DType::F32)?)?;
                (w + (ba * l.scale)?)?.to_dtype(self.weight.dtype())
            }
        }
    }
}

/// Inverted dropout with a mask drawn from rtune's own RNG (reproducible on every device).
fn dropout_mask(x: &Tensor, p: f64, rng: &mut Rng) -> Result<Tensor> {
    let mask = Tensor::from_vec(dropout_draws(x.elem_count(), p, rng), x.shape(), x.device())?.to_dtype(x.dtype())?;
    x * mask
}

/// `n` inverted-dropout factors: 0 with probability `p`, else `1 / (1 − p)`. Both training
/// engines draw their masks here, so they draw the same ones.
pub fn dropout_draws(n: usize, p: f64, rng: &mut Rng) -> Vec<f32> {
    let keep = (1.0 / (1.0 - p)) as f32;
    (0..n).map(|_| if rng.next_f64() < p { 0.0 } else { keep }).collect()
}

/// Use [`FrozenMatmul`] for frozen weights (on by default; the train-step benchmark turns it
/// off to measure what it saves).
pub static FROZEN_MATMUL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `x Wᵀ` for a frozen `W`: the backward pass returns only the input gradient `g W`.
///
/// candle's `matmul` backward also computes `xᵀ g`, a weight-shaped gradient, for every frozen
/// linear layer of a LoRA model — the same cost again as the forward matmul, plus the memory, for a
/// result nobody reads. This op keeps `W` out of the graph. (CPU only; on other devices the
/// plain matmul is used.)
struct FrozenMatmul {
    /// `Wᵀ`, `[in, out]` (a transposed view; the CPU matmul takes strided operands).
    wt: Tensor,
}

impl candle_core::CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        x: &candle_core::CpuStorage,
        xl: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        let (m, k) = xl.shape().dims2()?;
        let (storage, wl) = self.wt.storage_and_layout();
        let candle_core::Storage::Cpu(w) = &*storage else {
            candle_core::bail!("frozen-matmul: the weight is not on the CPU")
        };
        let (k2, n) = wl.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("frozen-matmul: input has {k} features, the weight expects {k2}")
        }
        if x.dtype() != w.dtype() {
            candle_core::bail!("frozen-matmul: input is {:?}, the weight {:?}", x.dtype(), w.dtype())
        }
        let out = x.matmul(w, (1, m, n, k), xl, wl)?;
        Ok((out, candle_core::Shape::from((m, n))))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // d(x Wᵀ)/dx · g = g W, with W = (Wᵀ)ᵀ.
        Ok(Some(grad.matmul(&self.wt.t()?)?))
    }
}
