//! Row-wise kernels (reductions, RMSNorm, SwiGLU, rotary layout) and the loss, each with its
//! derivative written out.

use super::*;

/// Defines a row kernel twice — for the baseline target and with AVX2 and FMA enabled — and
/// picks one at run time. rtune's binary targets baseline x86-64 (SSE2), where these loops get
/// 4-wide vectors; AVX2 machines get 8-wide ones (the `gemm` crate dispatches the same way). Both
/// versions compute the same operations in the same order.
macro_rules! row_kernel {
    ($(#[$m:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        pub(super) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: this CPU has AVX2 and FMA (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}

/// Reductions keep eight partial results, so that they vectorise (a single running sum is a
/// chain of dependent scalar additions).
pub(super) const LANES: usize = 8;

#[inline(always)]
pub(super) fn reduce(x: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = f(acc[i], c[i]);
        }
    }
    tail.iter().fold(acc.into_iter().fold(init, &f), |a, &v| f(a, v))
}

#[inline(always)]
pub(super) fn sum_generic(x: &[f32]) -> f32 {
    reduce(x, 0.0, |a, b| a + b)
}

row_kernel! {
    fn max(x: &[f32]) -> f32 {
        reduce(x, f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
    }
}

row_kernel! {
    /// `Σ a·b·c` (`c` may be empty: `Σ a·b`).
    fn dot3(a: &[f32], b: &[f32], c: Option<&[f32]>) -> f32 {
        dot3_generic(a, b, c)
    }
}

#[inline(always)]
pub(super) fn dot3_generic(a: &[f32], b: &[f32], c: Option<&[f32]>) -> f32 {
    let mut acc = [0f32; LANES];
    let n = a.len() / LANES * LANES;
    match c {
        Some(c) => {
            for ((a, b), c) in
                a[..n].chunks_exact(LANES).zip(b[..n].chunks_exact(LANES)).zip(c[..n].chunks_exact(LANES))
            {
                for i in 0..LANES {
                    acc[i] += a[i] * b[i] * c[i];
                }
            }
        }
        None => {
            for (a, b) in a[..n].chunks_exact(LANES).zip(b[..n].chunks_exact(LANES)) {
                for i in 0..LANES {
                    acc[i] += a[i] * b[i];
                }
            }
        }
    }
    let mut total: f32 = acc.iter().sum();
    for i in n..a.len() {
        total += a[i] * b[i] * c.map_or(1.0, |c| c[i]);
    }
    total
}

row_kernel! {
    /// `x ← e^(x − m)`; returns the sum.
    fn exp_shifted(x: &mut [f32], m: f32) -> f32 {
        for v in x.iter_mut() {
            *v = exp(*v - m);
        }
        sum_generic(x)
    }
}

row_kernel! {
    /// `x ← x · c`.
    fn scale(x: &mut [f32], c: f32) {
        for v in x.iter_mut() {
            *v *= c;
        }
    }
}

row_kernel! {
    fn add_here(dst: &mut [f32], src: &[f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += s;
        }
    }
}

/// Rows per parallel task so that each task has a few thousand elements.
pub(super) fn min_rows(width: usize) -> usize {
    (16384 / width.max(1)).max(1)
}

pub(super) fn add(dst: &mut [f32], src: &[f32]) {
    if dst.len() >= 1 << 16 {
        dst.par_chunks_mut(1 << 14).zip(src.par_chunks(1 << 14)).for_each(|(d, s)| add_here(d, s));
        return;
    }
    add_here(dst, src)
}

/// RMSNorm as transformers computes it, `(x · inv) · w` with `inv = 1/√(mean(x²) + eps)`;
/// returns the output and `inv` per row.
pub(super) fn rms_norm(x: &[f32], w: &[f32], h: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    let inv: Vec<f32> = x
        .par_chunks(h)
        .with_min_len(min_rows(h))
        .map(|row| {
            let ms = dot3(row, row, None) / h as f32;
            1.0 / (ms + eps).sqrt()
        })
        .collect();
    (rms_norm_with(x, &inv, w, h), inv)
}

/// RMSNorm with the per-row `inv` already known (the backward pass recomputes outputs).
pub(super) fn rms_norm_with(x: &[f32], inv: &[f32], w: &[f32], h: usize) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(h).zip(x.par_chunks(h)).zip(inv.par_iter()).with_min_len(min_rows(h)).for_each(
        |((y, x), &inv)| {
            for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                *y = (x * inv) * w;
            }
        },
    );
    y
}

/// `dx [+]= inv·g − x·inv³·mean(g·x)` with `g = dy ⊙ w` (the weight is frozen).
pub(super) fn rms_norm_backward(
    x: &[f32],
    inv: &[f32],
    w: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
    h: usize,
) {
    dx.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .zip(dy.par_chunks(h))
        .zip(inv.par_iter())
        .with_min_len(min_rows(h))
        .for_each(|(((dx, x), dy), &inv)| {
            let dot = dot3(x, dy, Some(w)) / h as f32;
            let c = inv * inv * inv * dot;
            for (((dx, x), dy), w) in dx.iter_mut().zip(x).zip(dy).zip(w) {
                let g = inv * (dy * w) - x * c;
                if accumulate {
                    *dx += g;
                } else {
                    *dx = g;
                }
            }
        });
}

/// The RMSNorm weight's gradient, `dw += Σ_rows dy ⊙ x · inv`, row by row in order.
pub(super) fn rms_norm_weight_grad(x: &[f32], inv: &[f32], dy: &[f32], h: usize, dw: &mut [f32]) {
    for ((x, dy), &inv) in x.chunks(h).zip(dy.chunks(h)).zip(inv) {
        for ((g, x), dy) in dw.iter_mut().zip(x).zip(dy) {
            *g += dy * x * inv;
        }
    }
}

/// `eˣ` to within 2 ulp, branch-free so that loops over it vectorise (libm's `expf` is a call
/// per element and takes a slow path on underflow). Exactly 0 below the smallest normal result,
/// as `expf` is (to within subnormals).
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that k·LN2_HI is exact (Cephes).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let c = x.clamp(-87.3, 88.3);
    let k = (c * LOG2E + ROUND) - ROUND;
    let r = c - k * LN2_HI - k * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let scale = f32::from_bits((((k as i32) + 127) << 23) as u32);
    if x < -87.3 { 0.0 } else { e * scale }
}

#[inline(always)]
pub(super) fn silu(z: f32) -> f32 {
    z / (1.0 + exp(-z))
}

/// `act(gate) ⊙ up`: SiLU, or with `gelu` GELU's tanh approximation (Gemma).
pub(super) fn swiglu(gate: &[f32], up: &[f32], gelu: bool) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    out.par_chunks_mut(1 << 14)
        .zip(gate.par_chunks(1 << 14))
        .zip(up.par_chunks(1 << 14))
        .for_each(|((o, g), u)| if gelu { geglu_chunk(o, g, u) } else { swiglu_chunk(o, g, u) });
    out
}

row_kernel! {
    fn swiglu_chunk(out: &mut [f32], gate: &[f32], up: &[f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu(g) * u;
        }
    }
}

/// GELU's tanh approximation, `½z(1 + tanh(√(2/π)(z + 0.044715z³)))`, and its derivative.
#[inline(always)]
fn gelu_tanh(z: f32) -> (f32, f32) {
    const K: f32 = 0.797_884_6;
    const C: f32 = 0.044715;
    let t = (K * (z + C * z * z * z)).tanh();
    (0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * K * (1.0 + 3.0 * C * z * z))
}

fn geglu_chunk(out: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu_tanh(g).0 * u;
    }
}

row_kernel! {
    fn swiglu_backward_chunk(dg: &mut [f32], du: &mut [f32], gate: &[f32], up: &[f32], da: &[f32]) {
        for ((((dg, du), &g), &u), &da) in dg.iter_mut().zip(du).zip(gate).zip(up).zip(da) {
            let sig = 1.0 / (1.0 + exp(-g));
            *du = da * g * sig;
            *dg = da * u * sig * (1.0 + g * (1.0 - sig));
        }
    }
}

fn geglu_backward_chunk(dg: &mut [f32], du: &mut [f32], gate: &[f32], up: &[f32], da: &[f32]) {
    for ((((dg, du), &g), &u), &da) in dg.iter_mut().zip(du).zip(gate).zip(up).zip(da) {
        let (a, d) = gelu_tanh(g);
        *du = da * a;
        *dg = da * u * d;
    }
}

/// Gradients of [`swiglu`] with respect to gate and up.
pub(super) fn swiglu_backward(gate: &[f32], up: &[f32], da: &[f32], gelu: bool) -> (Vec<f32>, Vec<f32>) {
    let mut dg = vec![0f32; gate.len()];
    let mut du = vec![0f32; gate.len()];
    const C: usize = 1 << 14;
    dg.par_chunks_mut(C)
        .zip(du.par_chunks_mut(C))
        .zip(gate.par_chunks(C))
        .zip(up.par_chunks(C))
        .zip(da.par_chunks(C))
        .for_each(|((((dg, du), g), u), da)| match gelu {
            true => geglu_backward_chunk(dg, du, g, u, da),
            false => swiglu_backward_chunk(dg, du, g, u, da),
        });
    (dg, du)
}

type Rope<'a> = (&'a [u32], &'a [f32], &'a [f32]);

/// `[n, heads·d]` rows → head-major `[b, heads, t, d]`, applying rotary embeddings
/// (`x·cos + rotate_half(x)·sin`) when given.
pub(super) fn to_heads(x: &[f32], b: usize, t: usize, heads: usize, d: usize, rope: Option<Rope<'_>>) -> Vec<f32> {
    let width = heads * d;
    let mut out = vec![0f32; b * heads * t * d];
    out.par_chunks_mut(t * d).enumerate().for_each(|(bh, dst)| {
        let (bi, h) = (bh / heads, bh % heads);
        for i in 0..t {
            let src = &x[(bi * t + i) * width + h * d..][..d];
            let dst = &mut dst[i * d..][..d];
            match rope {
                None => dst.copy_from_slice(src),
                Some((pos, cos, sin)) => {
                    let p = pos[bi * t + i] as usize;
                    let (cos, sin) = (&cos[p * d..][..d], &sin[p * d..][..d]);
                    let half = d / 2;
                    for j in 0..half {
                        dst[j] = src[j] * cos[j] - src[j + half] * sin[j];
                        dst[j + half] = src[j + half] * cos[j + half] + src[j] * sin[j + half];
                    }
                }
            }
        }
    });
    out
}

/// Head-major `[b, heads, t, d]` gradients → `[n, heads·d]` rows, through the transpose of the
/// rotary embedding when given.
pub(super) fn from_heads(x: &[f32], b: usize, t: usize, heads: usize, d: usize, rope: Option<Rope<'_>>) -> Vec<f32> {
    let width = heads * d;
    let mut out = vec![0f32; b * t * width];
    out.par_chunks_mut(width).with_min_len(min_rows(width)).enumerate().for_each(|(row, dst)| {
        let (bi, i) = (row / t, row % t);
        for h in 0..heads {
            let src = &x[((bi * heads + h) * t + i) * d..][..d];
            let dst = &mut dst[h * d..][..d];
            match rope {
                None => dst.copy_from_slice(src),
                Some((pos, cos, sin)) => {
                    let p = pos[row] as usize;
                    let (cos, sin) = (&cos[p * d..][..d], &sin[p * d..][..d]);
                    let half = d / 2;
                    for j in 0..half {
                        dst[j] = src[j] * cos[j] + src[j + half] * sin[j + half];
                        dst[j + half] = src[j + half] * cos[j + half] - src[j] * sin[j];
                    }
                }
            }
        }
    });
    out
}

/// Sum of cross-entropies of `[c, vocab]` logits against `targets`; with `grad_scale`, the
/// logits are replaced by `(softmax − onehot) · grad_scale`.
/// Gemma 2's cap in place: `x = c · tanh(x / c)`.
pub(super) fn softcap(x: &mut [f32], c: f32) {
    for v in x {
        *v = c * (*v / c).tanh();
    }
}

pub(super) fn cross_entropy(logits: &mut [f32], targets: &[u32], vocab: usize, grad_scale: Option<f32>) -> f64 {
    logits
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let m = max(row);
            let picked = row[t as usize] - m;
            // The row becomes eᶻ⁻ᵐ (the logits are not needed again).
            let total = exp_shifted(row, m);
            if let Some(g) = grad_scale {
                scale(row, g / total);
                row[t as usize] -= g;
            }
            (total.ln() - picked) as f64
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (want, got) = (x.exp(), exp(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        for x in [-1e9f32, -1e4, -88.0, f32::NEG_INFINITY] {
            assert_eq!(exp(x), 0.0, "exp({x})");
        }
        assert_eq!(exp(0.0), 1.0);
    }
}
