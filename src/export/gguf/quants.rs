//! ggml's block quantizers, as llama.cpp's `llama-quantize` runs them without an importance
//! matrix: the reference functions of ggml-quants.c (`quantize_row_q4_K_ref` and its siblings),
//! step for step — the same float operations in the same order, the same rounding
//! (`nearest_int`'s magic-number trick, `roundf`, truncating casts, round-to-nearest-even f16) —
//! so that a tensor rtune writes holds the bytes llama.cpp would write for it.
//! With an importance matrix (the mean square of each input column's activations, [`super::imatrix`])
//! the quantizers are ggml's weighted ones (`quantize_row_q4_K_impl` and siblings, what
//! `llama-quantize --imatrix` runs): the search weights each value by its column's importance.
//! `tests/model.rs::quantizers_write_llama_cpps_bytes` compares both with llama.cpp's on rows
//! that reach every branch (fixture made by `tests/fixtures/quant/make_quant.py`).
//!
//! candle's quantizers are not used for writing: its Q4_K and Q5_K search scales with the
//! older `make_qkx1_quants` (unweighted, five rounds), which llama.cpp replaced with the
//! weighted grid search of `make_qkx2_quants` — a file from candle's Q4_K is a little further
//! from the model than llama.cpp's. candle still reads every file back in the export's check.

use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;

/// The types [`quantize`] writes.
pub const WRITTEN: [GgmlDType; 12] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::Q8_0,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Values per K-quant super-block.
const QK_K: usize = 256;
/// ggml's threshold below which a group counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// The bytes of `x` in ggml type `ty`, as llama.cpp writes them. Without `importance`, `x` is
/// any number of whole blocks (ggml's reference quantizers, block by block). With it, `x` is
/// rows of `importance.len()` values (a multiple of the block size) and `importance[j]` weighs
/// column `j` in the types that search their scales (all but F32, F16 and Q8_0, which ignore
/// it, as llama.cpp does).
pub fn quantize(ty: GgmlDType, x: &[f32], importance: Option<&[f32]>) -> Result<Vec<u8>, String> {
    let block = ty.block_size();
    if !x.len().is_multiple_of(block) {
        return Err(format!("{} values do not fill blocks of {block} for {ty:?}", x.len()));
    }
    if !WRITTEN.contains(&ty) {
        return Err(format!("rtune does not write {ty:?}"));
    }
    let weighted = !matches!(ty, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::Q8_0);
    if let (Some(w), true) = (importance, weighted) {
        let row = w.len();
        if row == 0 || !row.is_multiple_of(block) || !x.len().is_multiple_of(row) {
            return Err(format!(
                "an importance vector of {row} values does not fit {} values in rows of whole blocks of {block}",
                x.len()
            ));
        }
        // ggml's weighted quantizers read the whole row (Q4_0 to Q5_1 weigh by its mean square).
        let rows: Vec<Vec<u8>> = x.par_chunks(row).map(|r| weighted_row(ty, r, w)).collect();
        return Ok(rows.concat());
    }
    // Blocks are independent: a few hundred at a time on each thread, joined in order.
    let parts: Vec<Vec<u8>> = x.par_chunks(block * 256).map(|part| blocks(ty, part)).collect();
    Ok(parts.concat())
}

/// One row `x` in ggml type `ty`, its columns weighted by `qw` (ggml's `quantize_<type>` with
/// `quant_weights`).
fn weighted_row(ty: GgmlDType, x: &[f32], qw: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / ty.block_size() * ty.type_size());
    match ty {
        GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => {
            for (b, w) in x.chunks_exact(QK_K).zip(qw.chunks_exact(QK_K)) {
                match ty {
                    GgmlDType::Q2K => q2_k_weighted(b, w, &mut out),
                    GgmlDType::Q3K => q3_k_weighted(b, w, &mut out),
                    GgmlDType::Q4K => q4_k_weighted(b, w, &mut out),
                    GgmlDType::Q5K => q5_k_weighted(b, w, &mut out),
                    _ => q6_k_weighted(b, w, &mut out),
                }
            }
        }
        _ => {
            // Q4_0, Q4_1, Q5_0, Q5_1: each value weighted by its column's importance times its
            // distance from zero against the row's mean square.
            let sum_x2 = sum_squares(x);
            let sigma2 = sum_x2 / x.len() as f32;
            for (b, w) in x.chunks_exact(32).zip(qw.chunks_exact(32)) {
                let (weight, _) = importance_weights(b, w, sigma2);
                match ty {
                    GgmlDType::Q4_0 => {
                        let mut l = [0i8; 32];
                        let d = make_qx_quants(8, b, &mut l, Some(&weight));
                        out.extend_from_slice(&half(d));
                        out.extend((0..16).map(|j| (l[j] as u8) | ((l[j + 16] as u8) << 4)));
                    }
                    GgmlDType::Q5_0 => {
                        let mut l = [0i8; 32];
                        let d = make_qx_quants(16, b, &mut l, Some(&weight));
                        five_bits(&half(d), None, |j| l[j] as u8, &mut out);
                    }
                    GgmlDType::Q4_1 => {
                        let mut l = [0u8; 32];
                        let (d, min) = make_qkx3_quants(15, b, &weight, &mut l);
                        out.extend_from_slice(&half(d));
                        out.extend_from_slice(&half(-min));
                        out.extend((0..16).map(|j| l[j] | (l[j + 16] << 4)));
                    }
                    GgmlDType::Q5_1 => {
                        let mut l = [0u8; 32];
                        let (d, min) = make_qkx3_quants(31, b, &weight, &mut l);
                        five_bits(&half(d), Some(&half(-min)), |j| l[j], &mut out);
                    }
                    _ => unreachable!("checked by quantize"),
                }
            }
        }
    }
    out
}

/// `x` (whole blocks) in ggml type `ty`.
fn blocks(ty: GgmlDType, x: &[f32]) -> Vec<u8> {
    let block = ty.block_size();
    let mut out = Vec::with_capacity(x.len() / block * ty.type_size());
    let blocks = x.chunks_exact(block);
    match ty {
        GgmlDType::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlDType::F16 => x.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgmlDType::Q8_0 => blocks.for_each(|b| q8_0(b, &mut out)),
        GgmlDType::Q4_0 => blocks.for_each(|b| q4_0(b, &mut out)),
        GgmlDType::Q4_1 => blocks.for_each(|b| q4_1(b, &mut out)),
        GgmlDType::Q5_0 => blocks.for_each(|b| q5_0(b, &mut out)),
        GgmlDType::Q5_1 => blocks.for_each(|b| q5_1(b, &mut out)),
        GgmlDType::Q4K => blocks.for_each(|b| q4_k(b, &mut out)),
        GgmlDType::Q5K => blocks.for_each(|b| q5_k(b, &mut out)),
        GgmlDType::Q6K => blocks.for_each(|b| q6_k(b, &mut out)),
        GgmlDType::Q2K => blocks.for_each(|b| q2_k(b, &mut out)),
        GgmlDType::Q3K => blocks.for_each(|b| q3_k(b, &mut out)),
        _ => unreachable!("checked by quantize"),
    }
    out
}

/// Σ x², summed in order, as ggml sums it.
fn sum_squares(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |s, v| s + v * v)
}

/// ggml's weights of a group under an importance matrix: each value's column importance `qw`
/// times √(σ² + x²), and their sum (in order).
fn importance_weights(x: &[f32], qw: &[f32], sigma2: f32) -> (Vec<f32>, f32) {
    let weights: Vec<f32> = x.iter().zip(qw).map(|(v, w)| w * (sigma2 + v * v).sqrt()).collect();
    let sum = weights.iter().fold(0f32, |s, w| s + w);
    (weights, sum)
}

/// ggml's `nearest_int`: rounds half to even through the float adder (|v| ≤ 2²² − 1).
#[inline]
fn nearest_int(v: f32) -> i32 {
    ((v + 12_582_912.0f32).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

fn half(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

fn unhalf(b: [u8; 2]) -> f32 {
    f16::from_le_bytes(b).to_f32()
}

/// The value of largest magnitude (the first of equal magnitudes) and that magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// The smallest and largest value (ggml starts both from the extremes of f32).
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&half(d));
    out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
}

fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let (max, _) = signed_max(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&half(d));
    let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
}

fn q4_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&half(d));
    out.extend_from_slice(&half(min));
    let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
    out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
}

fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let (max, _) = signed_max(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q = |v: f32| ((v * id + 16.5) as i8).min(31) as u8;
    five_bits(&half(d), None, |j| q(x[j]), out);
}

fn q5_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q = |v: f32| ((v - min) * id + 0.5) as u8;
    five_bits(&half(d), Some(&half(min)), |j| q(x[j]), out);
}

/// A Q5_0 / Q5_1 block: the scale (and minimum), the fifth bits of its 32 quants as one
/// little-endian word, then the low four bits, pairs `j` and `j + 16` sharing a byte.
fn five_bits(d: &[u8; 2], m: Option<&[u8; 2]>, q: impl Fn(usize) -> u8, out: &mut Vec<u8>) {
    let l: Vec<u8> = (0..32).map(q).collect();
    let qh = (0..32).fold(0u32, |h, j| h | (u32::from(l[j] & 0x10) >> 4) << j);
    out.extend_from_slice(d);
    if let Some(m) = m {
        out.extend_from_slice(m);
    }
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend((0..16).map(|j| (l[j] & 0x0f) | ((l[j + 16] & 0x0f) << 4)));
}

/// ggml's `make_qkx2_quants`: a scale and minimum for `x` in levels `0..=nmax`, searched over
/// `nstep + 1` candidate scales around the range's (`rmin + rdelta · step`), minimising the
/// `weights`-weighted squared error, or absolute error with `mad`. Writes the levels to `l`;
/// returns `(scale, -min)`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    mad: bool,
) -> (f32, f32) {
    let err = |diff: f32| if mad { diff.abs() } else { diff * diff };
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let level = |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, nmax);
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        l[i] = level(iscale, x[i], min) as u8;
        best_error += weights[i] * err(scale * l[i] as f32 + min - x[i]);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = level(iscale, x[i], min);
            aux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                cur_error += weights[i] * err(this_scale * aux[i] as f32 + this_min - x[i]);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type` 1: a signed scale for `x` in levels `-nmax..nmax`,
/// searched over 18 candidates around `nmax / max`, weighting each value by `qw` where given,
/// else by its square. Writes the levels (offset by `nmax`) to `l`.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8], qw: Option<&[f32]>) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let weight = |i: usize| qw.map_or(x[i] * x[i], |w| w[i]);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for (i, &v) in x.iter().enumerate() {
            let q = level(iscale, v) as f32;
            let w = weight(i);
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for (i, &v) in x.iter().enumerate() {
        l[i] = (level(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                l[i] = (level(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_qkx3_quants` as its weighted quantizers call it (`rmin` −0.9, `rdelta` 0.05,
/// 36 steps, squared error): [`make_qkx2_quants`]'s search, with the importance `weights` and a
/// finer grid. Writes the levels to `l`; returns `(scale, -min)`.
fn make_qkx3_quants(nmax: i32, x: &[f32], weights: &[f32], l: &mut [u8]) -> (f32, f32) {
    // ggml's two functions differ only in their parameters (and in testing `max <= min` where
    // make_qkx2 tests `max == min`: the same, since `min` is at most the smallest value).
    make_qkx2_quants(nmax, x, weights, l, -0.9, 0.05, 36, false)
}

/// ggml's `make_qp_quants`: one non-negative scale for the values `x` (a super-block's eight
/// group scales or minimums) in levels `0..=nmax`, chosen among nine candidates by weighted
/// squared error (`qw`: the groups' summed weights), then refined a level at a time. Writes the
/// levels to `l` (as ggml's `uint8_t`s: a negative level wraps, as there).
fn make_qp_quants(nmax: i32, x: &[f32], l: &mut [u8], qw: &[f32]) -> f32 {
    let max = x.iter().fold(0f32, |m, &v| if m > v { m } else { v });
    if max < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let mut iscale = nmax as f32 / max;
    for (l, &v) in l.iter_mut().zip(x) {
        *l = nearest_int(iscale * v) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..x.len() {
        let diff = x[i] - scale * l[i] as f32;
        best += qw[i] * diff * diff;
    }
    for is in -4..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1 * is as f32 + nmax as f32) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0f32;
        for i in 0..x.len() {
            let q = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * q as f32;
            mse += qw[i] * diff * diff;
        }
        if mse < best {
            best = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..x.len() {
        let q = nearest_int(iscale * x[i]).min(nmax);
        l[i] = q as u8;
        let w = qw[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for i in 0..x.len() {
            let (w, li) = (qw[i], l[i] as f32);
            let mut slx = sumlx - w * x[i] * li;
            let mut sl2 = suml2 - w * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != l[i] as i32 {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Q4_K and Q5_K share their scales: eight groups of 32, each with a scale and a minimum from
/// `make_qkx2_quants` (values weighted by the group's RMS plus their magnitude), both stored in
/// six bits against the block's largest (packed into 12 bytes), then every value re-levelled
/// against the stored scales. Returns `(d, dmin, scales, levels)`.
fn k_scales(x: &[f32], nmax: i32, rmin: f32, nstep: i32) -> ([u8; 2], [u8; 2], [u8; 12], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let g = &x[32 * j..32 * j + 32];
        let sum_x2 = sum_squares(g);
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: Vec<f32> = g.iter().map(|v| av_x + v.abs()).collect();
        (scales[j], mins[j]) =
            make_qkx2_quants(nmax, g, &weights, &mut l[32 * j..32 * j + 32], rmin, 0.1, nstep, false);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let (d, dmin) = (half(max_scale / 63.0), half(max_min / 63.0));
    relevel(x, nmax, d, dmin, &packed, &mut l);
    (d, dmin, packed, l)
}

/// The weighted form of [`k_scales`] (ggml's `quantize_row_q4_K_impl` / `q5_K_impl`): each
/// group's scale and minimum from `make_qkx3_quants` with the weights `qw · √(σ² + x²)`, both
/// sets stored through `make_qp_quants` weighted by the groups' summed weights; `clamp` caps
/// the stored six-bit levels at 63 (Q5_K does, Q4_K does not).
fn k_scales_weighted(x: &[f32], qw: &[f32], nmax: i32, clamp: bool) -> ([u8; 2], [u8; 2], [u8; 12], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let sum_x2 = sum_squares(x);
    let sigma2 = 2.0 * sum_x2 / QK_K as f32;
    let (mut scales, mut mins, mut sw) = ([0f32; 8], [0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let g = &x[32 * j..32 * j + 32];
        let weights;
        (weights, sw[j]) = importance_weights(g, &qw[32 * j..32 * j + 32], sigma2);
        (scales[j], mins[j]) = make_qkx3_quants(nmax, g, &weights, &mut l[32 * j..32 * j + 32]);
    }
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    let d_block = make_qp_quants(63, &scales, &mut ls, &sw);
    let m_block = make_qp_quants(63, &mins, &mut lm, &sw);
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let (ls, lm) = if clamp { (ls[j].min(63), lm[j].min(63)) } else { (ls[j], lm[j]) };
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let (d, dmin) = (half(d_block), half(m_block));
    relevel(x, nmax, d, dmin, &packed, &mut l);
    (d, dmin, packed, l)
}

/// Every value of a Q4_K/Q5_K super-block levelled against its group's stored scale and
/// minimum (a group whose scale rounds to zero keeps the levels it has).
fn relevel(x: &[f32], nmax: i32, d: [u8; 2], dmin: [u8; 2], packed: &[u8; 12], l: &mut [u8; QK_K]) {
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, packed);
        let d = unhalf(d) * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = unhalf(dmin) * m as f32;
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
}

/// ggml's `get_scale_min_k4`: group `j`'s six-bit scale and minimum.
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    q4_k_block(k_scales(x, 15, -1.0, 20), out);
}

fn q4_k_weighted(x: &[f32], qw: &[f32], out: &mut Vec<u8>) {
    q4_k_block(k_scales_weighted(x, qw, 15, false), out);
}

/// A Q4_K block: the super-scales, the packed group scales, the levels two to a byte.
fn q4_k_block((d, dmin, scales, l): ([u8; 2], [u8; 2], [u8; 12], [u8; QK_K]), out: &mut Vec<u8>) {
    out.extend_from_slice(&d);
    out.extend_from_slice(&dmin);
    out.extend_from_slice(&scales);
    for j in (0..QK_K).step_by(64) {
        out.extend((0..32).map(|i| l[j + i] | (l[j + i + 32] << 4)));
    }
}

fn q5_k(x: &[f32], out: &mut Vec<u8>) {
    q5_k_block(k_scales(x, 31, -0.5, 15), out);
}

fn q5_k_weighted(x: &[f32], qw: &[f32], out: &mut Vec<u8>) {
    q5_k_block(k_scales_weighted(x, qw, 31, true), out);
}

/// A Q5_K block: the super-scales, the packed group scales, the fifth bits, the low nibbles.
fn q5_k_block((d, dmin, scales, l): ([u8; 2], [u8; 2], [u8; 12], [u8; QK_K]), out: &mut Vec<u8>) {
    let mut qh = [0u8; QK_K / 8];
    let mut qs = [0u8; QK_K / 2];
    let (mut m1, mut m2) = (1u8, 2u8);
    for (k, n) in (0..QK_K).step_by(64).enumerate() {
        for j in 0..32 {
            let (mut l1, mut l2) = (l[n + j], l[n + j + 32]);
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            qs[32 * k + j] = l1 | (l2 << 4);
        }
        m1 <<= 2;
        m2 <<= 2;
    }
    out.extend_from_slice(&d);
    out.extend_from_slice(&dmin);
    out.extend_from_slice(&scales);
    out.extend_from_slice(&qh);
    out.extend_from_slice(&qs);
}

fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    q6_k_with(x, None, out);
}

fn q6_k_weighted(x: &[f32], qw: &[f32], out: &mut Vec<u8>) {
    q6_k_with(x, Some(qw), out);
}

/// ggml's Q6_K (`quantize_row_q6_K_ref`, or `_impl` with importance weights `qw`, which it
/// uses as they are): sixteen groups of 16 with signed scales, stored in eight bits against
/// the largest.
fn q6_k_with(x: &[f32], qw: Option<&[f32]>, out: &mut Vec<u8>) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for (ib, s) in scales.iter_mut().enumerate() {
        let group = 16 * ib..16 * ib + 16;
        *s = make_qx_quants(32, &x[group.clone()], &mut l[group.clone()], qw.map(|w| &w[group]));
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = *s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        out.extend_from_slice(&[0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = half(1.0 / iscale);
    let sc: Vec<i8> = scales.iter().map(|s| nearest_int(iscale * s).min(127) as i8).collect();
    for (j, &s) in sc.iter().enumerate() {
        let d = unhalf(d) * s as f32;
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    let l: Vec<u8> = l.iter().map(|&v| v as u8).collect();
    let (mut ql, mut qh) = ([0u8; QK_K / 2], [0u8; QK_K / 4]);
    for (k, j) in (0..QK_K).step_by(128).enumerate() {
        for i in 0..32 {
            let (q1, q2, q3, q4) = (l[j + i], l[j + i + 32], l[j + i + 64], l[j + i + 96]);
            ql[64 * k + i] = (q1 & 0xf) | ((q3 & 0xf) << 4);
            ql[64 * k + i + 32] = (q2 & 0xf) | ((q4 & 0xf) << 4);
            qh[32 * k + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend_from_slice(&d);
}

/// Two-bit levels of a K-quant super-block, four to a byte: byte `i` of each 32-byte run holds
/// values `i`, `i + 32`, `i + 64` and `i + 96` of its 128.
fn two_bits(l: &[u8; QK_K]) -> [u8; QK_K / 4] {
    let mut qs = [0u8; QK_K / 4];
    for j in (0..QK_K).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] = l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
        }
    }
    qs
}

/// ggml's `quantize_row_q2_K_ref`: sixteen groups of 16, each a scale and a minimum from
/// `make_qkx2_quants` (weights |x|, absolute error), both stored in four bits against the
/// largest, then every value re-levelled in 0..=3.
fn q2_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..16 {
        let g = &x[16 * j..16 * j + 16];
        let weights: Vec<f32> = g.iter().map(|v| v.abs()).collect();
        (scales[j], mins[j]) = make_qkx2_quants(3, g, &weights, &mut l[16 * j..16 * j + 16], -0.5, 0.1, 15, true);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let mut sc = [0u8; 16];
    let mut d = half(0.0);
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for j in 0..16 {
            sc[j] = nearest_int(iscale * scales[j]) as u8;
        }
        d = half(max_scale / 15.0);
    }
    let mut dmin = half(0.0);
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for j in 0..16 {
            sc[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        dmin = half(max_min / 15.0);
    }
    q2_k_block(x, sc, d, dmin, &mut l, out);
}

/// ggml's `quantize_row_q2_K_impl`: each group's scale and minimum from `make_qkx3_quants`
/// with the weights `qw · √(σ² + x²)`, both sets stored through `make_qp_quants` in four bits.
fn q2_k_weighted(x: &[f32], qw: &[f32], out: &mut Vec<u8>) {
    let mut l = [0u8; QK_K];
    let sum_x2 = sum_squares(x);
    let sigma2 = sum_x2 / QK_K as f32;
    let (mut scales, mut mins, mut sw) = ([0f32; 16], [0f32; 16], [0f32; 16]);
    for j in 0..16 {
        let g = &x[16 * j..16 * j + 16];
        let weights;
        (weights, sw[j]) = importance_weights(g, &qw[16 * j..16 * j + 16], sigma2);
        (scales[j], mins[j]) = make_qkx3_quants(3, g, &weights, &mut l[16 * j..16 * j + 16]);
    }
    let (mut ls, mut lm) = ([0u8; 16], [0u8; 16]);
    let d = half(make_qp_quants(15, &scales, &mut ls, &sw));
    let dmin = half(make_qp_quants(15, &mins, &mut lm, &sw));
    let sc: [u8; 16] = std::array::from_fn(|j| ls[j] | (lm[j] << 4));
    q2_k_block(x, sc, d, dmin, &mut l, out);
}

/// A Q2_K block: every value re-levelled against its group's stored scale and minimum (a group
/// whose scale is zero keeps its levels), then the scales, the levels, the super-scales.
fn q2_k_block(x: &[f32], sc: [u8; 16], d: [u8; 2], dmin: [u8; 2], l: &mut [u8; QK_K], out: &mut Vec<u8>) {
    for (j, s) in sc.iter().enumerate() {
        let dj = unhalf(d) * (s & 0xf) as f32;
        if dj == 0.0 {
            continue;
        }
        let m = unhalf(dmin) * (s >> 4) as f32;
        for i in 16 * j..16 * j + 16 {
            l[i] = nearest_int((x[i] + m) / dj).clamp(0, 3) as u8;
        }
    }
    out.extend_from_slice(&sc);
    out.extend_from_slice(&two_bits(l));
    out.extend_from_slice(&d);
    out.extend_from_slice(&dmin);
}

/// ggml's `make_q3_quants` with `do_rmse`: a signed scale for `x` in levels `-nmax..nmax`,
/// starting from `nmax / max` and refined a value at a time (five rounds at most), each value
/// weighted by its square. Writes the levels (offset by `nmax`) to `l`.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (i, &v) in x.iter().enumerate() {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        l[i] = q as i8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for (i, &v) in x.iter().enumerate() {
            let (w, li) = (v * v, l[i] as f32);
            let mut slx = sumlx - w * v * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] as i32 {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for q in l.iter_mut() {
        *q += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// ggml's `quantize_row_q3_K_ref`: sixteen groups of 16 with signed scales from
/// `make_q3_quants`, stored in six bits against the largest (packed into 12 bytes).
fn q3_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut amax) = (0f32, 0f32);
    for j in 0..16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let mut sc = [0u8; 12];
    let mut d = half(0.0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        let levels: [i32; 16] =
            std::array::from_fn(|j| i32::from(nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) + 32);
        sc = q3_k_scales(&levels);
        d = half(1.0 / iscale);
    }
    q3_k_block(x, sc, d, &mut l, out);
}

/// ggml's `quantize_row_q3_K_impl`: each group's scale from the weighted `make_qx_quants` with
/// `qw · √(σ² + x²)`, the scales themselves stored by `make_qx_quants` weighted by the groups'
/// summed weights.
fn q3_k_weighted(x: &[f32], qw: &[f32], out: &mut Vec<u8>) {
    let mut l = [0i8; QK_K];
    let sum_x2 = sum_squares(x);
    let sigma2 = 2.0 * sum_x2 / QK_K as f32;
    let (mut scales, mut sw) = ([0f32; 16], [0f32; 16]);
    for j in 0..16 {
        let g = &x[16 * j..16 * j + 16];
        let weights;
        (weights, sw[j]) = importance_weights(g, &qw[16 * j..16 * j + 16], sigma2);
        scales[j] = make_qx_quants(4, g, &mut l[16 * j..16 * j + 16], Some(&weights));
    }
    let mut ls = [0i8; 16];
    let d_block = make_qx_quants(32, &scales, &mut ls, Some(&sw));
    let levels: [i32; 16] = std::array::from_fn(|j| i32::from(ls[j]));
    q3_k_block(x, q3_k_scales(&levels), half(d_block), &mut l, out);
}

/// Sixteen six-bit Q3_K scale levels (0..=63) packed into 12 bytes: the low nibbles two to a
/// byte, the high two bits four to a byte.
fn q3_k_scales(levels: &[i32; 16]) -> [u8; 12] {
    let mut sc = [0u8; 12];
    for (j, &l) in levels.iter().enumerate() {
        if j < 8 {
            sc[j] = (l & 0xf) as u8;
        } else {
            sc[j - 8] |= ((l & 0xf) << 4) as u8;
        }
        sc[j % 4 + 8] |= ((l >> 4) << (2 * (j / 4))) as u8;
    }
    sc
}

/// A Q3_K block: every value re-levelled in -4..=3 against its group's stored scale (a group
/// whose scale is zero keeps its levels), the levels' high bits as a mask, their low two bits
/// four to a byte, the scales, the super-scale.
fn q3_k_block(x: &[f32], sc: [u8; 12], d: [u8; 2], l: &mut [i8; QK_K], out: &mut Vec<u8>) {
    for j in 0..16 {
        let low = if j < 8 { sc[j] & 0xf } else { sc[j - 8] >> 4 };
        let level = i32::from(low | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
        let dj = unhalf(d) * level as f32;
        if dj == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / dj).clamp(-4, 3) + 4) as i8;
        }
    }
    let mut levels = [0u8; QK_K];
    let mut hmask = [0u8; QK_K / 8];
    for (j, &q) in l.iter().enumerate() {
        let mut q = q as u8;
        if q > 3 {
            hmask[j % 32] |= 1 << (j / 32);
            q -= 4;
        }
        levels[j] = q;
    }
    out.extend_from_slice(&hmask);
    out.extend_from_slice(&two_bits(&levels));
    out.extend_from_slice(&sc);
    out.extend_from_slice(&d);
}
