//! Linear layers with optional LoRA adapters (Hu et al. 2021, as PEFT implements them):
//! `y = x Wᵀ + b + (alpha / r) · dropout(x) Aᵀ Bᵀ`, A `[r, in]` Kaiming-uniform, B `[out, r]` zero.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::rng::Rng;

/// A trained parameter: its name in the checkpoint format and its variable.
#[derive(Debug, Clone)]
pub struct Param {
    pub name: String,
    pub var: Var,
}

/// Where adapters go and how they are shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    /// Rank-stabilized: scale by alpha / √rank instead of alpha / rank.
    pub rslora: bool,
    pub dropout: f64,
    /// Module names: `q_proj`, …, `lm_head`.
    pub targets: Vec<String>,
}

impl LoraSpec {
    /// The factor on the adapter's output: alpha / rank, or alpha / √rank (rsLoRA), as PEFT's
    /// `LoraLayer.update_layer` computes it.
    pub fn scale(&self) -> f64 {
        match self.rslora {
            true => self.alpha / (self.rank as f64).sqrt(),
            false => self.alpha / self.rank as f64,
        }
    }

    /// The initial A `[rank, inp]` as PEFT draws it: kaiming_uniform_(a=√5), bound 1/√in (B
    /// starts at zero). Every engine initialises adapters here, layer by layer in
    /// [`super::Transformer::linears`] order, from one generator.
    pub fn init_a(&self, inp: usize, rng: &mut Rng) -> Vec<f32> {
        let bound = 1.0 / (inp as f64).sqrt();
        (0..self.rank * inp).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect()
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
        let a = self.init_a(inp, rng);
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

/// Whether a trained parameter's name is an adapter matrix's ([`param_name`]), not a base
/// weight's.
pub fn is_adapter_param(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// Overwrite the `params` that `which` accepts with the values in `tensors`, each of which must
/// be there with its shape.
pub fn load_params(
    params: &[Param],
    tensors: &BTreeMap<String, Tensor>,
    which: impl Fn(&str) -> bool,
) -> std::result::Result<(), crate::model::ModelError> {
    for p in params.iter().filter(|p| which(&p.name)) {
        let t = tensors.get(&p.name).ok_or_else(|| crate::model::ModelError::MissingTensor { name: p.name.clone() })?;
        if t.dims() != p.var.dims() {
            return Err(crate::model::ModelError::ShapeMismatch {
                name: p.name.clone(),
                expected: p.var.dims().to_vec(),
                found: t.dims().to_vec(),
            });
        }
        let t = t
            .to_dtype(p.var.dtype())
            .and_then(|t| t.to_device(p.var.device()))
            .map_err(crate::model::ModelError::candle(format!("load `{}`", p.name)))?;
        p.var.set(&t).map_err(crate::model::ModelError::candle(format!("load `{}`", p.name)))?;
    }
    Ok(())
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

/// The merged weight `W + scale · B A` of a linear with weight `w` `[out, in]` and adapter
/// matrices `a` `[r, in]`, `b` `[out, r]`, computed in f32 (whatever the inputs' dtypes), as PEFT's
/// `merge_and_unload` adds `get_delta_weight`. The one definition of a merge.
pub fn merge(w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let ba = b.to_dtype(DType::F32)?.matmul(&a.to_dtype(DType::F32)?)?;
    w.to_dtype(DType::F32)? + (ba * scale)?
}

/// Inverted dropout of `x` (a `[rows, in]` input) with the mask of adapter key `key`.
fn dropout_mask(x: &Tensor, p: f64, key: u64) -> Result<Tensor> {
    let mask =
        Tensor::from_vec(dropout_factors(key, 0, x.elem_count(), p), x.shape(), x.device())?.to_dtype(x.dtype())?;
    x * mask
}

/// The threshold on the generator's top 24 bits below which an element is dropped, and the
/// scale `1 / (1 − p)` of kept elements, for dropout probability `p`.
pub fn dropout_params(p: f64) -> (u32, f32) {
    ((p * (1u64 << 24) as f64).round() as u32, (1.0 / (1.0 - p)) as f32)
}

/// splitmix64's output function.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Whether element `i` of an adapter's input survives dropout: the top 24 bits of the `i`-th
/// output of splitmix64 seeded with `key` are at least `threshold`. A counter-based generator:
/// any element's draw is computed on its own, so every engine — and every GPU thread — draws
/// the same mask without a shared sequential stream (kernels.cu computes the same bits).
pub fn dropout_keep(key: u64, i: u64, threshold: u32) -> bool {
    (mix64(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN))) >> 40) as u32 >= threshold
}

/// The dropout key of the adapter on linear layer number `linear` (its index in
/// [`super::Transformer::linears`]) in the micro-batch keyed `batch`.
pub fn dropout_key(batch: u64, linear: usize) -> u64 {
    mix64(batch ^ mix64((linear as u64).wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// The dropout key of micro-batch number `micro` of a training run seeded `seed`.
pub fn batch_dropout_key(seed: u64, micro: u64) -> u64 {
    mix64(mix64(seed ^ 0x6472_6f70_6f75_7400).wrapping_add(micro.wrapping_mul(GOLDEN)))
}

/// The inverted-dropout factors of elements `start .. start + n` of the input of the adapter
/// keyed `key`: 0 where dropped, else `1 / (1 − p)`. Every engine draws its masks here or with
/// the same bits (kernels.cu).
pub fn dropout_factors(key: u64, start: usize, n: usize, p: f64) -> Vec<f32> {
    let (threshold, keep) = dropout_params(p);
    (start as u64..(start + n) as u64).map(|i| if dropout_keep(key, i, threshold) { keep } else { 0.0 }).collect()
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
