//! The transformer's math as candle ops with backward passes: RMSNorm, rotary embeddings,
//! grouped-query key/value repetition, softmax and cross-entropy (fused on the CPU).

use candle_core::{D, DType, Device, Result, Tensor};

use crate::model::arch::{ROPE_TABLE_MAX, RopeSpec};

/// Keys/values for grouped-query attention: each kv head serves `n` query heads.
pub(crate) fn repeat_kv(x: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let (b, kvh, t, d) = x.dims4()?;
    x.unsqueeze(2)?.broadcast_as((b, kvh, n, t, d))?.reshape((b, kvh * n, t, d))
}

/// RMSNorm as transformers computes it: in f32, then cast back, then scaled.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps)?.sqrt()?.recip()?;
    xf.broadcast_mul(&inv)?.to_dtype(dtype)?.broadcast_mul(&weight.to_dtype(dtype)?)
}

/// Gemma's RMSNorm: `x̂ · (1 + w)` with both in f32, then rounded to `x`'s dtype once
/// (transformers' `Gemma3RMSNorm`; Llama's rounds `x̂` before the product).
pub fn rms_norm_offset(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps)?.sqrt()?.recip()?;
    let w = (weight.to_dtype(DType::F32)? + 1.0)?;
    xf.broadcast_mul(&inv)?.broadcast_mul(&w)?.to_dtype(dtype)
}

/// Softmax over the last dimension from differentiable ops (in f32 as transformers does).
pub(crate) fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(dtype)
}

/// `x * cos + rotate_half(x) * sin`, where rotate_half(x) = cat(-x2, x1).
pub(crate) fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// Mean cross-entropy of `[n, vocab]` logits against `[n]` targets.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if FUSED_CROSS_ENTROPY.load(std::sync::atomic::Ordering::Relaxed)
        && logits.device().is_cpu()
        && logits.dtype() == DType::F32
        && logits.is_contiguous()
        && logits.rank() == 2
    {
        let targets = targets.to_dtype(DType::U32)?.contiguous()?;
        return logits.apply_op2(&targets, FusedCrossEntropy { grad_scale: None });
    }
    composed_cross_entropy(logits, targets)
}

/// Use [`FusedCrossEntropy`] on the CPU (on by default; the train-step benchmark can turn it off
/// to measure what it saves).
pub static FUSED_CROSS_ENTROPY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Mean cross-entropy from composed ops (any device); [`FusedCrossEntropy`] computes the same
/// on the CPU.
pub fn composed_cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.gather(&targets.unsqueeze(1)?, 1)?;
    (lse - picked)?.mean_all()
}

/// cos/sin tables `[positions, d]` of `rope` over `positions` (at most [`ROPE_TABLE_MAX`]).
pub(crate) fn rope_tables(
    rope: &RopeSpec,
    d: usize,
    positions: usize,
    device: &Device,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let n = positions.min(ROPE_TABLE_MAX);
    let (cos, sin) = rope.values(d, n);
    let cos = Tensor::from_vec(cos, (n, d), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (n, d), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// Mean cross-entropy of `[N, V]` f32 logits against `[N]` u32 targets in one pass per row, and
/// its gradient `(softmax − onehot) / N` in one more (CPU). The composed version writes and keeps
/// several `[N, V]` temporaries (shifted, exp, their gradients): for a 49k vocabulary that is
/// ~100 MB each per 512 positions.
struct FusedCrossEntropy {
    /// Set for the backward op: the upstream gradient of the mean, divided by N.
    grad_scale: Option<f32>,
}

impl FusedCrossEntropy {
    fn rows<'a>(
        s1: &'a candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &'a candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(&'a [f32], &'a [u32], usize, usize)> {
        let (n, v) = l1.shape().dims2()?;
        let (candle_core::CpuStorage::F32(x), candle_core::CpuStorage::U32(t)) = (s1, s2) else {
            candle_core::bail!("cross-entropy: expected f32 logits and u32 targets")
        };
        let (Some((a, b)), Some((c, d))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("cross-entropy: inputs must be contiguous")
        };
        if d - c != n {
            candle_core::bail!("cross-entropy: {n} rows but {} targets", d - c)
        }
        Ok((&x[a..b], &t[c..d], n, v))
    }
}

impl candle_core::CustomOp2 for FusedCrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use rayon::prelude::*;
        let (x, t, n, v) = Self::rows(s1, l1, s2, l2)?;
        if let Some(t) = t.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("cross-entropy: target {t} outside the vocabulary of {v}")
        }
        let lse = |row: &[f32]| {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (m, row.iter().map(|&z| (z - m).exp()).sum::<f32>().ln())
        };
        match self.grad_scale {
            None => {
                let total: f64 = x
                    .par_chunks(v)
                    .zip(t.par_iter())
                    .map(|(row, &t)| {
                        let (m, l) = lse(row);
                        (l - (row[t as usize] - m)) as f64
                    })
                    .sum();
                let mean = if n == 0 { f32::NAN } else { (total / n as f64) as f32 };
                Ok((candle_core::CpuStorage::F32(vec![mean]), candle_core::Shape::from(())))
            }
            Some(scale) => {
                let mut g = vec![0f32; n * v];
                g.par_chunks_mut(v).zip(x.par_chunks(v)).zip(t.par_iter()).for_each(|((g, row), &t)| {
                    let (m, l) = lse(row);
                    for (g, &z) in g.iter_mut().zip(row) {
                        *g = (z - m - l).exp() * scale;
                    }
                    g[t as usize] -= scale;
                });
                Ok((candle_core::CpuStorage::F32(g), candle_core::Shape::from((n, v))))
            }
        }
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = logits.dim(0)?.max(1);
        let scale = grad.to_dtype(DType::F32)?.to_scalar::<f32>()? / n as f32;
        let g = logits.apply_op2_no_bwd(targets, &FusedCrossEntropy { grad_scale: Some(scale) })?;
        Ok((Some(g), None))
    }
}
