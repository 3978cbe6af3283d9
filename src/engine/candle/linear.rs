//! candle's linear layer with an optional LoRA adapter (Hu et al. 2021, as PEFT implements it):
//! `y = x Wᵀ + b + (alpha / r) · dropout(x) Aᵀ Bᵀ`.

use candle_core::{Result, Tensor};

use crate::model::lora::{dropout_factors, dropout_key};

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
    /// The layer's index in [`super::Transformer::linears`] (it keys the layer's dropout mask).
    pub id: usize,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>, id: usize) -> Linear {
        Linear { weight, bias, lora: None, id }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Forward over `[..., in]`; `dropout` is the micro-batch's dropout key (None: evaluation).
    pub fn forward_t(&self, x: &Tensor, dropout: Option<u64>) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let inp = *dims.last().expect("input has a feature dimension");
        let x2 = x.reshape(((), inp))?;
        let frozen_op = FROZEN_MATMUL.load(std::sync::atomic::Ordering::Relaxed);
        let fused_device = x2.device().is_cpu() || x2.device().is_cuda();
        let mut y = if frozen_op && !self.weight.is_variable() && fused_device {
            x2.apply_op1(FrozenMatmul { wt: self.weight.t()? })?
        } else {
            x2.matmul(&self.weight.to_dtype(x2.dtype())?.t()?)?
        };
        if let Some(b) = &self.bias {
            y = y.broadcast_add(&b.to_dtype(y.dtype())?)?;
        }
        if let Some(l) = &self.lora {
            let xin = match dropout {
                Some(batch) if l.dropout > 0.0 => dropout_mask(&x2, l.dropout, dropout_key(batch, self.id))?,
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
}

/// Inverted dropout of `x` (a `[rows, in]` input) with the mask of adapter key `key`.
fn dropout_mask(x: &Tensor, p: f64, key: u64) -> Result<Tensor> {
    let mask =
        Tensor::from_vec(dropout_factors(key, 0, x.elem_count(), p), x.shape(), x.device())?.to_dtype(x.dtype())?;
    x * mask
}

/// Use [`FrozenMatmul`] for frozen weights (on by default; the train-step benchmark turns it
/// off to measure what it saves).
pub static FROZEN_MATMUL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `x Wᵀ` for a frozen `W`: the backward pass returns only the input gradient `g W`.
///
/// candle's `matmul` backward also computes `xᵀ g`, a weight-shaped gradient, for every frozen
/// linear layer of a LoRA model — the same cost again as the forward matmul, plus the memory, for a
/// result nobody reads. This op keeps `W` out of the graph. (CPU and CUDA; on other devices the
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        let (m, k) = xl.shape().dims2()?;
        let (storage, wl) = self.wt.storage_and_layout();
        let candle_core::Storage::Cuda(w) = &*storage else {
            candle_core::bail!("frozen-matmul: the weight is not on the GPU")
        };
        let (k2, n) = wl.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("frozen-matmul: input has {k} features, the weight expects {k2}")
        }
        let out = x.matmul(w, (1, m, n, k), xl, wl)?;
        Ok((out, candle_core::Shape::from((m, n))))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // d(x Wᵀ)/dx · g = g W, with W = (Wᵀ)ᵀ.
        Ok(Some(grad.matmul(&self.wt.t()?)?))
    }
}
