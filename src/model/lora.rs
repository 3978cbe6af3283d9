//! LoRA adapters (Hu et al. 2021, as PEFT implements them) as every engine shares them: where they
//! go and how they are shaped ([`LoraSpec`]: A `[r, in]` Kaiming-uniform, B `[out, r]` zero), their
//! parameters' names, the one definition of a merge, and the dropout masks every engine draws
//! alike. Each engine's linear layer computes `y = x Wᵀ + b + (alpha / r) · dropout(x) Aᵀ Bᵀ`
//! with them (candle's: [`crate::engine::candle::linear`]).

use candle_core::{DType, Result, Tensor};

use crate::rng::Rng;

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
    /// [`crate::engine::candle::Transformer::linears`] order, from one generator.
    pub fn init_a(&self, inp: usize, rng: &mut Rng) -> Vec<f32> {
        let bound = 1.0 / (inp as f64).sqrt();
        (0..self.rank * inp).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect()
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

/// The merged weight `W + scale · B A` of a linear with weight `w` `[out, in]` and adapter
/// matrices `a` `[r, in]`, `b` `[out, r]`, computed in f32 (whatever the inputs' dtypes), as PEFT's
/// `merge_and_unload` adds `get_delta_weight`. The one definition of a merge.
pub fn merge(w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let ba = b.to_dtype(DType::F32)?.matmul(&a.to_dtype(DType::F32)?)?;
    w.to_dtype(DType::F32)? + (ba * scale)?
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
/// [`crate::engine::candle::Transformer::linears`]) in the micro-batch keyed `batch`.
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
