//! Attention per (sequence, head) block: scores, softmax and the backward pass, recomputing
//! probabilities rather than keeping them.

use super::*;

/// Query rows per attention block: a block of queries only meets keys up to its last row (the
/// mask is causal), so the masked upper triangle is skipped block by block.
pub(super) const QUERY_BLOCK: usize = 64;

/// The query blocks of a `t`-row sequence: `(first row, rows, keys it attends to)`.
pub(super) fn query_blocks(t: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..t).step_by(QUERY_BLOCK).map(move |r0| {
        let r1 = (r0 + QUERY_BLOCK).min(t);
        (r0, r1 - r0, r1)
    })
}

/// `S = scale · Q Kᵀ + mask` for one query block, over its `keys` (`scale`: 1/√d, or Gemma's
/// `query_pre_attn_scalar^-½`; Gemma 2 caps `scale · Q Kᵀ` at `c · tanh(· / c)` before the mask).
pub(super) fn block_scores(
    s: &mut [f32],
    qh: &[f32],
    kg: &[f32],
    mask: &[f32],
    block: (usize, usize, usize),
    dims: &Dims,
) {
    let ((r0, rows, keys), t, d) = (block, dims.t, dims.d);
    let scale = dims.scale;
    matmul_here(s, Mat::rm(&qh[r0 * d..][..rows * d], rows, d), Mat::rm(&kg[..keys * d], keys, d).t(), scale, false);
    if let Some(c) = dims.softcap {
        softcap(s, c);
    }
    for (i, row) in s.chunks_mut(keys).enumerate() {
        add(row, &mask[(r0 + i) * t..][..keys]);
    }
}

/// Per (sequence, head): `P = softmax(Q Kᵀ/√d + mask)`, `O = P V`. Keeps only each row's
/// log-sum-exp (`lse`, when given): the backward pass recomputes `P` from it, so memory does not
/// grow with t² per layer.
pub(super) fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    dims: &Dims,
    lse: Option<&mut [f32]>,
    out: &mut [f32],
) {
    let Dims { t, heads, kv_heads, d, .. } = *dims;
    let rep = heads / kv_heads;
    let task = |bh: usize, o: &mut [f32], lse: Option<&mut [f32]>| {
        let (bi, h) = (bh / heads, bh % heads);
        let g = bi * kv_heads + h / rep;
        let qh = &q[bh * t * d..][..t * d];
        let kg = &k[g * t * d..][..t * d];
        let vg = &v[g * t * d..][..t * d];
        let m = &mask[bi * t * t..][..t * t];
        let mut s = vec![0f32; QUERY_BLOCK * t];
        let mut lse = lse;
        for (r0, rows, keys) in query_blocks(t) {
            let s = &mut s[..rows * keys];
            block_scores(s, qh, kg, m, (r0, rows, keys), dims);
            for (i, row) in s.chunks_mut(keys).enumerate() {
                let mx = max(row);
                let total = exp_shifted(row, mx);
                scale(row, 1.0 / total);
                if let Some(l) = lse.as_deref_mut() {
                    l[r0 + i] = mx + total.ln();
                }
            }
            matmul_here(
                &mut o[r0 * d..][..rows * d],
                Mat::rm(s, rows, keys),
                Mat::rm(&vg[..keys * d], keys, d),
                1.0,
                false,
            );
        }
    };
    match lse {
        Some(lse) => out
            .par_chunks_mut(t * d)
            .zip(lse.par_chunks_mut(t))
            .enumerate()
            .for_each(|(bh, (o, l))| task(bh, o, Some(l))),
        None => out.par_chunks_mut(t * d).enumerate().for_each(|(bh, o)| task(bh, o, None)),
    }
}

/// Gradients of attention with respect to (rotated) queries, keys and values, per (sequence,
/// kv head) so that the query heads sharing a kv head accumulate into it on one thread. `dq`,
/// `dk` and `dv` must start zeroed.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    lse: &[f32],
    dout: &[f32],
    dims: &Dims,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let Dims { t, heads, kv_heads, d, .. } = *dims;
    let rep = heads / kv_heads;
    let scale = dims.scale;
    dq.par_chunks_mut(rep * t * d).zip(dk.par_chunks_mut(t * d)).zip(dv.par_chunks_mut(t * d)).enumerate().for_each(
        |(bg, ((dq, dk), dv))| {
            let bi = bg / kv_heads;
            let kg = &k[bg * t * d..][..t * d];
            let vg = &v[bg * t * d..][..t * d];
            let m = &mask[bi * t * t..][..t * t];
            let mut p = vec![0f32; QUERY_BLOCK * t];
            let mut dp = vec![0f32; QUERY_BLOCK * t];
            // With Gemma 2's cap, the capped scores (plus the mask) before the softmax.
            let mut capped = if dims.softcap.is_some() { vec![0f32; QUERY_BLOCK * t] } else { Vec::new() };
            for (j, dq) in dq.chunks_mut(t * d).enumerate() {
                let bh = bi * heads + (bg % kv_heads) * rep + j;
                let qh = &q[bh * t * d..][..t * d];
                let doh = &dout[bh * t * d..][..t * d];
                let lse = &lse[bh * t..][..t];
                for (r0, rows, keys) in query_blocks(t) {
                    let (p, dp) = (&mut p[..rows * keys], &mut dp[..rows * keys]);
                    // P again, from the scores and the saved log-sum-exp.
                    block_scores(p, qh, kg, m, (r0, rows, keys), dims);
                    if dims.softcap.is_some() {
                        capped[..rows * keys].copy_from_slice(p);
                    }
                    for (i, row) in p.chunks_mut(keys).enumerate() {
                        exp_shifted(row, lse[r0 + i]);
                    }
                    let dob = Mat::rm(&doh[r0 * d..][..rows * d], rows, d);
                    let pm = Mat::rm(p, rows, keys);
                    matmul_here(dp, dob, Mat::rm(&vg[..keys * d], keys, d).t(), 1.0, false);
                    matmul_here(&mut dv[..keys * d], pm.t(), dob, 1.0, true);
                    for (dp, p) in dp.chunks_mut(keys).zip(p.chunks(keys)) {
                        let dot = dot3(dp, p, None);
                        for (dp, p) in dp.iter_mut().zip(p) {
                            *dp = p * (*dp - dot);
                        }
                    }
                    if let Some(c) = dims.softcap {
                        // Through the cap: d tanh = 1 − tanh², tanh = capped / c (a masked key's
                        // clamps to −1, and its gradient is 0 already).
                        for (ds, s) in dp.iter_mut().zip(&capped[..rows * keys]) {
                            let th = (s / c).clamp(-1.0, 1.0);
                            *ds *= 1.0 - th * th;
                        }
                    }
                    let ds = Mat::rm(dp, rows, keys);
                    matmul_here(&mut dq[r0 * d..][..rows * d], ds, Mat::rm(&kg[..keys * d], keys, d), scale, false);
                    matmul_here(&mut dk[..keys * d], ds.t(), Mat::rm(&qh[r0 * d..][..rows * d], rows, d), scale, true);
                }
            }
        },
    );
}
